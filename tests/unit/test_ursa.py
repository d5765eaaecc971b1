"""URSA natively (ddrl.models.ursa, ddrl.models.native.ursa), its metric path (ddrl.processes.metric_path)
and CTMC sampler (ddrl.sampling.metric_path), against golden outputs of the authors' code
(tests/fixtures/make_ursa.py: URSA's diffnext at Yovecent/UDM-GRPO @ d1bec49)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ddrl
from ddrl.models.io import ModelDirectoryError
from ddrl.ops.logprobs import SUPPRESSED_LOGIT
from ddrl.processes.metric_path import MetricPathProcess
from ddrl.registry import PROCESSES, SAMPLERS
from ddrl.sampling.metric_path import ctmc_step, guided_logits, transition_probs, unconditional_prompt

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "ursa"
MODEL_DIR = FIXTURE / "model"
GOLDEN = load_file(str(FIXTURE / "golden.safetensors"))
META = json.loads((FIXTURE / "golden.json").read_text())
LM_VOCAB, CODES, BOV, PAD = 127, 64, 110, 101
N = 16  # a 4 x 4 latent grid
PROMPT_LEN = META["inputs"]["max_prompt_length"]


@pytest.fixture(scope="module")
def model():
    m = ddrl.load_model(MODEL_DIR, dtype="float32")
    m.max_prompt_length = PROMPT_LEN
    return m.eval()


def code_logits(model, ids, mask=None):
    """Aligned logits over the codebook [B, T, C]: position i scores token i."""
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits[..., LM_VOCAB:LM_VOCAB + CODES]


def test_family_and_layout(model):
    assert model.family == "ursa" and model.image_token_range == (LM_VOCAB, LM_VOCAB + CODES)
    assert model.vocab_size == LM_VOCAB + CODES and model.bov_token_id == BOV and model.pad_token_id == PAD
    assert model.model.config.head_dim == 128  # absent from transformer/config.json: Qwen3's default
    assert isinstance(model.process, MetricPathProcess) and model.process.offset == LM_VOCAB
    assert model.logits_shifted and model.logits_range == (LM_VOCAB, LM_VOCAB + CODES)


def test_logits_equal_theirs(model):
    """Their raw logits at position j score token j + 1; ddrl's at i score token i, over codes only."""
    ids = GOLDEN["batch_ids"]
    with torch.no_grad():
        full = model(ids).logits  # [2, T, V]
    torch.testing.assert_close(full[:, 1:, LM_VOCAB:], GOLDEN["batch_logits"][:, :-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(full[:, -N:, LM_VOCAB:], GOLDEN["batch_code_logits"], atol=1e-4, rtol=0)
    assert bool((full[..., :LM_VOCAB] == SUPPRESSED_LOGIT).all())  # text ids are never sampled
    torch.testing.assert_close(code_logits(model, GOLDEN["unpadded_ids"])[:, 1:], GOLDEN["unpadded_logits"][:, :-1],
                               atol=1e-4, rtol=0)


def test_codebook_logits_are_the_full_logits_slice_without_the_full_tensor(model, monkeypatch):
    """class_range = the codebook (the metric_path sampler's request): URSA's head computes the codes' logits
    alone (CodebookHead.forward, which lays them into the vocabulary, never runs), bit for bit the full
    logits' slice; another range is sliced from the full logits; with targets it is an error."""
    from ddrl.models.native.ursa import CodebookHead
    from ddrl.ops.logprobs import TargetRequest

    ids = GOLDEN["batch_ids"]
    codes = (LM_VOCAB, LM_VOCAB + CODES)
    with torch.no_grad():
        for keep in (N, torch.tensor([0, 5, ids.shape[1] - 1])):
            full = model(ids, logits_to_keep=keep).logits
            widths = []
            real = CodebookHead.forward
            monkeypatch.setattr(CodebookHead, "forward", lambda self, h: widths.append(1) or real(self, h))
            assert torch.equal(model(ids, logits_to_keep=keep, class_range=codes).logits, full[..., LM_VOCAB:])
            assert not widths
            assert torch.equal(model(ids, logits_to_keep=keep, class_range=(100, 130)).logits, full[..., 100:130])
            assert widths  # not the codebook: the full logits, sliced
            monkeypatch.undo()
        with pytest.raises(ValueError, match="TargetRequest"):
            model(ids, targets=TargetRequest(ids[:, -N:]), logits_to_keep=N, class_range=codes)


def test_left_padded_batch_equals_rows_unpadded(model):
    """A row left-padded by ddrl (mask 0) gets the logits of the row alone (their code, no padding):
    the 10-token prompt next to an 8-token one, whose own max_prompt_length padding is real input."""
    long_row, short_row = GOLDEN["unpadded_ids"][0], GOLDEN["batch_ids"][1]
    width = long_row.shape[0]
    ids = torch.stack([long_row, torch.cat([torch.full((width - short_row.shape[0],), PAD), short_row])])
    mask = torch.ones_like(ids)
    mask[1, :width - short_row.shape[0]] = 0
    got = code_logits(model, ids, mask)
    torch.testing.assert_close(got[0, 1:], GOLDEN["unpadded_logits"][0, :-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[1, -short_row.shape[0] + 1:], GOLDEN["batch_logits"][1, :-1], atol=1e-4, rtol=0)


def test_encode_prompts_is_their_layout(model):
    ids, mask = model.encode_prompts(META["inputs"]["prompts"])
    assert torch.equal(ids, GOLDEN["batch_ids"][:, :PROMPT_LEN + 1]) and bool(mask.all())
    assert torch.equal(unconditional_prompt(model, ids), GOLDEN["uncond_ids"][:, :PROMPT_LEN + 1].expand(2, -1))


def test_decode_images_equals_theirs(model):
    pixels = model.decode_images(GOLDEN["decode_codes"])
    assert pixels.shape == (3, 3, 8, 8) and pixels.dtype == torch.float32
    torch.testing.assert_close(pixels, GOLDEN["decode_pixels"], atol=1e-5, rtol=0)
    assert 0 < float((pixels == 1).float().mean() + (pixels == 0).float().mean()) < 0.5  # the clamp is exercised
    with pytest.raises(ValueError, match="image_token_range"):
        model.decode_images(GOLDEN["decode_codes"] + LM_VOCAB)  # vocabulary ids, not codebook indices


def test_vq_path_replaces_the_pipeline_vae(tmp_path):
    vae = tmp_path / "vae"
    shutil.copytree(MODEL_DIR / "vae", vae)
    weights = vae / "diffusion_pytorch_model.safetensors"
    state = load_file(str(weights))
    state["decoder.conv_out.bias"] = torch.full_like(state["decoder.conv_out.bias"], 50.0)
    save_file(state, str(weights))
    other = ddrl.load_model(MODEL_DIR, dtype="float32", vq_path=vae)
    assert bool((other.decode_images(GOLDEN["decode_codes"]) == 1).all())
    with pytest.raises(ModelDirectoryError, match="AutoencoderVQ"):
        ddrl.load_model(MODEL_DIR, vq_path=MODEL_DIR / "scheduler")


def test_path_and_timesteps_equal_theirs(model):
    process = model.process
    torch.testing.assert_close(process.emb, GOLDEN["path_emb_normalized"], atol=0, rtol=0)
    for t in META["path_t"]:
        torch.testing.assert_close(process.path_probs(torch.arange(16), t), GOLDEN[f"path_probs_t{t}"],
                                   atol=1e-6, rtol=0)
    for steps in (10, 4):
        grid = process.inference_flow_times(steps)
        torch.testing.assert_close(grid[:steps], GOLDEN[f"inference_t_{steps}"], atol=1e-12, rtol=0)
        assert float(grid[-1]) == 1.0
    g = torch.Generator().manual_seed(META["init"]["seed"] + 3)
    torch.testing.assert_close(process.training_flow_times(16, generator=g), GOLDEN["train_timesteps"],
                               atol=1e-7, rtol=0)
    g = torch.Generator().manual_seed(META["init"]["seed"] + 3)
    torch.testing.assert_close(process.sample_t(16, generator=g), 1 - GOLDEN["train_timesteps"], atol=1e-7, rtol=0)


def recorded_steps():
    return [(run, i) for run, steps in META["ctmc"]["recorded_steps"].items() for i in steps]


@pytest.mark.parametrize("run,step", recorded_steps())
def test_guided_logits_and_transition_probs_equal_theirs(model, run, step):
    """Their pipeline's CFG logits z at a recorded state, and the exact law of their CTMC step."""
    key, process = f"{run}_step{step}", model.process
    grid = process.inference_flow_times(META["ctmc"]["steps"]).tolist()
    s, last = grid[step], step == META["ctmc"]["steps"] - 1
    scale = META["ctmc"]["cfg_guidance_scale"] if run == "cfg" else 1.0
    g = scale if s < META["ctmc"]["guidance_trunc"] else 1.0
    prompt, _ = model.encode_prompts(META["inputs"]["prompts"])
    uncond = unconditional_prompt(model, prompt) if scale > 1 else None
    x_t = GOLDEN[f"{key}_x_t"]
    mask = torch.ones(2, prompt.shape[1] + N, dtype=torch.bool)
    with torch.no_grad():
        z = guided_logits(model, process, prompt, uncond, x_t + LM_VOCAB, mask, g)
    torch.testing.assert_close(z, GOLDEN[f"{key}_z"], atol=1e-4, rtol=0)
    probs = transition_probs(process, z, x_t, s, None if last else grid[step + 1])
    torch.testing.assert_close(probs.float(), GOLDEN[f"{key}_probs"], atol=2e-5, rtol=0)
    if key == "cfg_step5":  # their velocity for candidate x1 = 0
        torch.testing.assert_close(process.velocity(torch.zeros_like(x_t), x_t, s), GOLDEN[f"{key}_velocity_x1_0"],
                                   atol=1e-5, rtol=1e-5)


def test_ctmc_step_draws_from_transition_probs(model):
    """The sampler's step (one draw of x1^, the jump, the target) has the law transition_probs computes."""
    process, reps = model.process, 2000
    z, x_t = GOLDEN["cfg_step5_z"], GOLDEN["cfg_step5_x_t"]
    grid = process.inference_flow_times(META["ctmc"]["steps"]).tolist()
    nxt = ctmc_step(process, z.repeat(reps, 1, 1), x_t.repeat(reps, 1), grid[5], grid[6],
                    generator=torch.Generator().manual_seed(0))
    freq = torch.nn.functional.one_hot(nxt, CODES).double().view(reps, 2, N, CODES).mean(0)
    assert float((freq - GOLDEN["cfg_step5_probs"].double()).abs().max()) < 0.05
    assert float((nxt.view(reps, 2, N) != x_t).float().mean()) > 0.05  # it does jump


def test_process_noise_draws_from_the_path(model):
    process, reps = model.process, 3000
    x0 = torch.arange(4).repeat(reps, 1) + LM_VOCAB
    xt, noised = process.noise(x0, torch.full((reps,), 0.3), generator=torch.Generator().manual_seed(1))
    assert bool(noised.all()) and bool(((xt >= LM_VOCAB) & (xt < LM_VOCAB + CODES)).all())
    freq = torch.nn.functional.one_hot(xt - LM_VOCAB, CODES).double().mean(0)  # [4, C]
    assert float((freq - process.path_probs(torch.arange(4), 0.7).double()).abs().max()) < 0.05
    # No NELBO, schedule or uniform posterior: a sibling of the uniform process, never asked for them.
    from ddrl.processes.base import ScheduledProcess
    from ddrl.processes.uniform import UniformProcess

    assert not isinstance(process, (ScheduledProcess, UniformProcess))


def test_process_noise_in_chunks_draws_what_one_pass_draws(monkeypatch):
    """noise() makes the path's [positions, N] probabilities a chunk of positions at a time (issue 33:
    UDM-GRPO's re-noised copies over URSA's 131,072 codes were three 25.8 GB tensors at once); the
    draws are those of one pass over every position (sample_categorical over [B, L, N]), down to
    chunks of one position."""
    import ddrl.processes.metric_path as metric_path
    from ddrl.processes.draws import sample_categorical

    torch.manual_seed(0)
    classes, offset = 1000, 10
    process = metric_path.MetricPathProcess(classes, offset, codebook=torch.randn(classes, 8))
    x0, t = offset + torch.randint(classes, (3, 50)), torch.rand(3)
    d = process.distances(x0 - offset)  # [B, L, N]
    s = 1 - process.token_times(t, x0.shape)
    one_pass = offset + sample_categorical(torch.softmax(-process.beta(s).to(d)[..., None] * d, dim=-1),
                                           generator=torch.Generator().manual_seed(3))
    for chunk in (metric_path.NOISE_CHUNK_ELEMENTS, 7 * classes, classes):
        monkeypatch.setattr(metric_path, "NOISE_CHUNK_ELEMENTS", chunk)
        xt, _ = process.noise(x0, t, generator=torch.Generator().manual_seed(3))
        assert torch.equal(xt, one_pass), chunk
    assert float((xt != x0).float().mean()) > 0.5  # it noised


def test_sampler_generates_codes_with_explicit_generator(model):
    from ddrl.config import SamplerConfig

    prompt, _ = model.encode_prompts(["red cat", "is it"])
    cfg = SamplerConfig(name="metric_path", steps=4, gen_length=N, temperature=1.0, cfg_scale=2.0)
    sample = SAMPLERS.get("metric_path")
    out = sample(model, prompt, None, cfg, generator=torch.Generator().manual_seed(3), return_trajectory=True)
    again = sample(model, prompt, None, cfg, generator=torch.Generator().manual_seed(3))
    assert torch.equal(out.completion_ids, again.completion_ids) and out.nfe == 4
    codes = out.completion_ids - LM_VOCAB
    assert codes.shape == (2, N) and bool(((codes >= 0) & (codes < CODES)).all())
    assert out.trajectory.states.shape == (2, 4, N) and out.trajectory.step_times[0] == 1.0
    assert model.decode_images(codes.view(2, 4, 4)).shape == (2, 3, 8, 8)
    with pytest.raises(ValueError, match="block_length does not apply"):
        sample(model, prompt, None, SamplerConfig(name="metric_path", steps=4, gen_length=N, block_length=4),
               generator=torch.Generator())


def test_save_and_reload_round_trip(model, tmp_path):
    out = tmp_path / "saved"
    model.save_pretrained(out)
    index = json.loads((MODEL_DIR / "model_index.json").read_text())
    assert json.loads((out / "model_index.json").read_text()) == index
    assert not (out / "config.json").exists() and (out / "scheduler" / "scheduler_model.pth").is_file()
    saved = json.loads((out / "transformer" / "config.json").read_text())
    assert saved == json.loads((MODEL_DIR / "transformer" / "config.json").read_text())
    back = ddrl.load_model(out, dtype="float32")
    assert back.family == "ursa"
    ids = GOLDEN["batch_ids"]
    torch.testing.assert_close(code_logits(back, ids), code_logits(model, ids), atol=0, rtol=0)
    torch.testing.assert_close(back.decode_images(GOLDEN["decode_codes"]), model.decode_images(GOLDEN["decode_codes"]))
    # trained weights are what is written
    with torch.no_grad():
        model.model.lm_head.weight.mul_(-1)
    try:
        model.save_pretrained(tmp_path / "flipped")
    finally:
        with torch.no_grad():
            model.model.lm_head.weight.mul_(-1)
    flipped = ddrl.load_model(tmp_path / "flipped", dtype="float32")
    torch.testing.assert_close(code_logits(flipped, ids), -code_logits(model, ids), atol=1e-5, rtol=0)


def broken_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "pipe"
    shutil.copytree(MODEL_DIR, copy)
    return copy


def test_malformed_directories_fail_with_the_fix(tmp_path):
    pipe = broken_copy(tmp_path)
    shutil.rmtree(pipe / "vae")
    with pytest.raises(ModelDirectoryError, match="no vae folder"):
        ddrl.load_model(pipe)
    with pytest.raises(ModelDirectoryError, match="pass the pipeline directory"):
        ddrl.load_model(MODEL_DIR / "transformer")
    pipe = broken_copy(tmp_path / "b")
    index = json.loads((pipe / "model_index.json").read_text())
    index["_class_name"], index["transformer"] = "StableDiffusionPipeline", ["diffusers", "UNet2DConditionModel"]
    (pipe / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ModelDirectoryError, match="URSA"):
        ddrl.load_model(pipe)
    pipe = broken_copy(tmp_path / "c")
    torch.save({"path.emb": torch.randn(32, 8)}, str(pipe / "scheduler" / "scheduler_model.pth"))
    with pytest.raises(ModelDirectoryError, match="do not belong together"):
        ddrl.load_model(pipe)
    pipe = broken_copy(tmp_path / "d")
    weights = pipe / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(str(weights))
    state["lm_head.proj"] = state.pop("lm_head.weight")
    save_file(state, str(weights))
    with pytest.raises(ModelDirectoryError, match="missing \\['lm_head.weight'\\]"):
        ddrl.load_model(pipe)
    with pytest.raises(ValueError, match="vq_path applies to URSA"):
        ddrl.load_model(FIXTURE.parent / "sdar" / "model", vq_path=MODEL_DIR / "vae")


def test_metric_path_from_a_spec_with_an_inline_codebook():
    """A ddrl uniform model can name the metric path in its process_spec with a small codebook (gray levels)."""
    process = PROCESSES.get("metric_path")(num_classes=3, offset=2, codebook=[[0.0, 1.0], [1.0, 1.0], [1.0, 0.0]],
                                           alpha=1.0, c=2.0)
    near = process.path_probs(torch.tensor([0]), 0.9)[0]
    assert near.argmax() == 0 and near[1] > near[2]  # class 1 is closer to class 0 than class 2 is
    torch.testing.assert_close(process.path_probs(torch.tensor([0]), 0.0)[0], torch.full((3,), 1 / 3))


def test_sampler_on_a_plain_model_with_an_inline_codebook():
    """Not URSA: any model whose process is a MetricPathProcess (ids 3..5 here) samples with it, guidance
    included (the unconditional prompt is all pad ids)."""
    from types import SimpleNamespace

    from ddrl.config import SamplerConfig

    class Plain:
        process = MetricPathProcess(3, 3, codebook=[[1.0, 0.0], [0.7, 0.7], [0.0, 1.0]], alpha=1.0, c=3.0)
        vocab_size, mask_token_id, pad_token_id = 7, 6, 1
        calls: list[torch.Tensor] = []

        def __call__(self, ids, attention_mask=None):
            self.calls.append(ids.clone())
            logits = torch.zeros(*ids.shape, 7)
            logits[..., 5] = torch.where(ids[:, :1] == 0, 8.0, -8.0)  # prompt 0 -> class 2, else class 0
            logits[..., 3] = -logits[..., 5]
            return SimpleNamespace(logits=logits)

    model = Plain()
    calls = model.calls
    prompt = torch.tensor([[0, 2], [2, 2]])
    out = SAMPLERS.get("metric_path")(model, prompt, None, SamplerConfig(name="metric_path", steps=3, gen_length=4,
                                                                          cfg_scale=1.0),
                                      generator=torch.Generator().manual_seed(0))
    assert out.completion_ids.tolist() == [[5] * 4, [3] * 4]
    assert bool((calls[0][2:, :2] == 1).all()) and calls[0].shape[0] == 4  # cond + uncond rows, one call
