"""ddrl's native Dream backbone and Dream's sampler against the authors' code.

The oracle is tests/fixtures/dream (made by tests/fixtures/make_dream.py from ZHZisZZ/dllm @ 03270de7,
the hub's modeling_dream.py / generation_utils.py): their raw logits, their logits on a left-padded
batch, their tokenizer's chat-template ids and their diffusion_generate tokens for every alg. Their
sampler's random draws were fed from a seeded generator in ddrl's layout (golden.json "stand_ins"),
so the sampled settings compare exactly too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ddrl.models.diffusion_lm import DiffusionLM
from ddrl.models.io import ModelDirectoryError
from ddrl.models.native.base import NATIVE_FAMILIES
from ddrl.models.native.dream import DreamBackbone
from ddrl.registry import SAMPLERS
from ddrl.sampling.dream import dream_generate

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "dream"
MODEL_DIR = FIXTURE / "model"
GOLDEN = load_file(str(FIXTURE / "golden.safetensors"))
META = json.loads((FIXTURE / "golden.json").read_text())
SETTINGS = META["sampler"]["settings"]
MASK, TOKENIZER_LEN = META["special_ids"]["mask"], META["tokenizer_len"]


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """1e-5 relative to the logits' scale (they reach ~15 here; float32 rounding of a different kernel
    or mask shape moves them by ~1e-6 of that)."""
    scale = float(expected.abs().max())
    torch.testing.assert_close(actual, expected, atol=1e-5 * scale, rtol=1e-5)


@pytest.fixture(scope="module")
def backbone() -> DreamBackbone:
    return DreamBackbone.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def lm(backbone: DreamBackbone) -> DiffusionLM:
    return DiffusionLM(backbone, mask_token_id=backbone.config.mask_token_id, logits_shifted=True, family="dream")


def rows() -> list[int]:
    return sorted(int(k[3:-4]) for k in GOLDEN if k.startswith("row") and k.endswith("_ids"))


# ------------------------------------------------------------------------------------------- backbone


def test_registered_and_config_fields(backbone: DreamBackbone) -> None:
    assert NATIVE_FAMILIES.get("dream") is DreamBackbone
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert backbone.config.vocab_size == config["vocab_size"] > TOKENIZER_LEN  # the padded vocabulary
    assert backbone.config.mask_token_id == config["mask_token_id"] == MASK
    assert backbone.config.max_position_embeddings == config["max_position_embeddings"]
    assert backbone.config.num_key_value_heads < backbone.config.num_attention_heads  # GQA is exercised
    assert len(backbone.layers) == config["num_hidden_layers"]
    assert backbone.get_output_embeddings() is backbone.lm_head


def test_raw_logits_equal_theirs_per_row(backbone: DreamBackbone) -> None:
    with torch.no_grad():
        for i in rows():
            out = backbone(GOLDEN[f"row{i}_ids"][None])
            assert_logits_close(out.logits[0], GOLDEN[f"row{i}_logits"])
            torch.testing.assert_close(backbone.lm_head(out.hidden_states), out.logits)


@pytest.mark.pinned  # bf16 kernels differ by CPU: re-run under avx2 and default by test_portable_pins.py
def test_bfloat16_follows_their_per_op_dtypes() -> None:
    """In bf16 the native logits match their bf16 logits far more closely than the float32 ones do: a
    backbone that upcast everything (or rounded RoPE/RMSNorm differently) would sit near float32.
    How close depends on the CPU's bf16 kernels, measured with ATEN_CPU_CAPABILITY: avx2 (their
    logits' kernels) bit-equal on all rows; AVX512 and default, row 0 bit-equal and rows 1-2 at
    0.27-0.30 of float32's mean distance (0.17-0.33 of its largest). So the bound is a third of the
    mean and a half of the largest."""
    model = DreamBackbone.from_pretrained(MODEL_DIR).eval()  # the checkpoint's own dtype
    assert model.lm_head.weight.dtype == torch.bfloat16
    with torch.no_grad():
        for i in rows():
            ours = model(GOLDEN[f"row{i}_ids"][None]).logits[0].float()
            theirs, fp32 = GOLDEN[f"row{i}_logits_bf16"], GOLDEN[f"row{i}_logits"]
            ours_gap, fp32_gap = (ours - theirs).abs(), (fp32 - theirs).abs()
            assert ours_gap.mean() <= fp32_gap.mean() / 3 and ours_gap.max() <= fp32_gap.max() / 2


def test_left_padded_batch_with_2d_mask_equals_unpadded_rows(backbone: DreamBackbone) -> None:
    ids, mask = GOLDEN["batch_ids"], GOLDEN["batch_mask"]
    assert not bool(mask.all())  # some rows are padded
    with torch.no_grad():
        logits = backbone(ids, attention_mask=mask).logits
    for i in rows():
        assert_logits_close(logits[i][mask[i].bool()], GOLDEN[f"row{i}_logits"])


def test_their_4d_mask_and_positions_are_used_as_given(backbone: DreamBackbone) -> None:
    """diffusion_generate's own feed (bool [B, 1, T, T] mask + positions with pads at 1); their padded
    query rows attend nothing and give 0 there, ours attend everything: only real positions compare."""
    mask = GOLDEN["batch_mask"].bool()
    with torch.no_grad():
        logits = backbone(GOLDEN["batch_ids"], attention_mask=GOLDEN["batch_mask_4d"],
                          position_ids=GOLDEN["batch_position_ids"]).logits
    assert_logits_close(logits[mask], GOLDEN["batch_logits"][mask])


def test_diffusion_lm_realigns_the_shifted_logits(lm: DiffusionLM) -> None:
    with torch.no_grad():
        for i in rows():
            aligned = lm(GOLDEN[f"row{i}_ids"][None]).logits[0]
            assert_logits_close(aligned[1:], GOLDEN[f"row{i}_logits"][:-1])  # position i predicts token i


def test_logits_to_keep(backbone: DreamBackbone) -> None:
    ids = GOLDEN["batch_ids"]
    with torch.no_grad():
        full = backbone(ids).logits
        assert torch.equal(backbone(ids, logits_to_keep=3).logits, full[:, -3:])
        positions = torch.tensor([0, 5, 7])
        assert torch.equal(backbone(ids, logits_to_keep=positions).logits, full[:, positions])
        assert backbone(ids, logits_to_keep=3).hidden_states.shape == (*ids.shape, backbone.config.hidden_size)


def test_kv_cache_of_the_full_sequence_reproduces_the_suffix(backbone: DreamBackbone) -> None:
    """Bidirectional attention makes a prefix's keys depend on the suffix, so the exact check is: keys
    and values of the prefix taken from a call over the whole sequence, plus the suffix fed anew, give
    the whole call's suffix logits (equal in exact arithmetic; a cache of unrotated keys, wrong
    positions or a mask not spanning the cache breaks it)."""
    ids, mask = GOLDEN["batch_ids"], GOLDEN["batch_mask"]
    P = 5
    with torch.no_grad():
        full = backbone(ids, attention_mask=mask, use_cache=True)
        c = backbone.config
        assert [tuple(k.shape) for k, _ in full.past_key_values] == [(ids.shape[0], c.num_key_value_heads, ids.shape[1],
                                                                      c.head_dim)] * len(backbone.layers)
        prefix = [(k[:, :, :P], v[:, :, :P]) for k, v in full.past_key_values]
        suffix = backbone(ids[:, P:], attention_mask=mask, past_key_values=prefix)
        unmasked = backbone(GOLDEN["row2_ids"][None], use_cache=True)  # no mask: positions T_past + arange(T)
        tail = backbone(GOLDEN["row2_ids"][None, P:], past_key_values=[(k[:, :, :P], v[:, :, :P])
                                                                      for k, v in unmasked.past_key_values])
    real = mask[:, P:].bool()
    assert_logits_close(suffix.logits[real], full.logits[:, P:][real])
    assert_logits_close(tail.logits, unmasked.logits[:, P:])


def test_gradient_checkpointing_gives_the_same_gradients() -> None:
    ids, mask = GOLDEN["batch_ids"], GOLDEN["batch_mask"]
    grads = []
    for checkpointing in (False, True):
        model = DreamBackbone.from_pretrained(MODEL_DIR, dtype=torch.float32).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        model(ids, attention_mask=mask).logits.logsumexp(-1).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        pad_row = model.model.embed_tokens.weight.grad[model.config.pad_token_id]
        assert torch.equal(pad_row, torch.zeros_like(pad_row))  # padding_idx, as their nn.Embedding
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------- the hub layout


def test_save_reload_keeps_the_official_layout(backbone: DreamBackbone, tmp_path: Path) -> None:
    backbone.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads((MODEL_DIR / "config.json").read_text())
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == META["weight_names"]
    reloaded = DreamBackbone.from_pretrained(tmp_path).eval()
    ids = GOLDEN["row1_ids"][None]
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, backbone(ids).logits)


def test_weight_names_not_dreams_are_refused(tmp_path: Path) -> None:
    shutil.copytree(MODEL_DIR, tmp_path / "model")
    state = load_file(str(MODEL_DIR / "model.safetensors"))
    state["model.layers.0.attn.q_proj.weight"] = state.pop("model.layers.0.self_attn.q_proj.weight")
    save_file(state, str(tmp_path / "model" / "model.safetensors"))
    with pytest.raises(ModelDirectoryError, match="missing.*self_attn.q_proj.weight.*unexpected.*attn.q_proj"):
        DreamBackbone.from_pretrained(tmp_path / "model")
    config = json.loads((MODEL_DIR / "config.json").read_text())
    (tmp_path / "model" / "config.json").write_text(json.dumps({**config, "model_type": "llada"}))
    with pytest.raises(ModelDirectoryError, match="not a Dream one"):
        DreamBackbone.from_pretrained(tmp_path / "model")


def test_tied_embeddings(tmp_path: Path) -> None:
    """tie_word_embeddings: the hub file has no lm_head.weight; the head is the embedding, saved once."""
    directory = tmp_path / "tied"
    shutil.copytree(MODEL_DIR, directory)
    config = json.loads((MODEL_DIR / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    state = load_file(str(MODEL_DIR / "model.safetensors"))
    del state["lm_head.weight"]
    save_file(state, str(directory / "model.safetensors"))
    model = DreamBackbone.from_pretrained(directory)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    model.save_pretrained(tmp_path / "saved")
    with safe_open(str(tmp_path / "saved" / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    assert DreamBackbone.from_pretrained(tmp_path / "saved").lm_head.weight is not None


def test_their_tokenizer_ids_are_reproduced() -> None:
    """The hub layout (vocab.json + merges.txt, DreamTokenizer) read without remote code."""
    from ddrl.models import hf_tokenizer
    tokenizer = hf_tokenizer.load_tokenizer(MODEL_DIR, native=True)
    assert len(tokenizer) == TOKENIZER_LEN and tokenizer.mask_token_id == MASK
    for i, messages in enumerate(META["messages"]):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert list(ids) == GOLDEN[f"chat{i}_ids"].tolist()


# ------------------------------------------------------------------------------------------- the sampler


def run_setting(lm: DiffusionLM, name: str, **overrides) -> torch.Tensor:
    setting = {**SETTINGS[name], **overrides}
    seed = setting.pop("seed", None)
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return dream_generate(lm, GOLDEN["prompt_ids"], GOLDEN["prompt_mask"], gen_length=META["sampler"]["gen_length"],
                          eps=META["sampler"]["eps"], generator=generator, **setting)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_dream_generate_equals_their_diffusion_generate(lm: DiffusionLM, name: str) -> None:
    tokens = run_setting(lm, name)
    assert torch.equal(tokens, GOLDEN[f"tokens_{name}"])
    P = GOLDEN["prompt_ids"].shape[1]
    for i in range(tokens.shape[0]):  # deterministic settings: their run of each prompt alone, unpadded
        if f"tokens_{name}_alone{i}" in GOLDEN:
            assert torch.equal(tokens[i, P:], GOLDEN[f"tokens_{name}_alone{i}"])


def test_the_golden_settings_tell_the_algorithms_apart(lm: DiffusionLM) -> None:
    """The oracle can fail: another ordering, no top-k/top-p, no alg_temp or no vocabulary limit each
    change the tokens of the settings above."""
    for name, other in (("entropy", "maskgit_plus"), ("maskgit_plus", "topk_margin"), ("topk_margin", "entropy")):
        assert not torch.equal(run_setting(lm, name, alg=other), GOLDEN[f"tokens_{name}"])
    assert not torch.equal(run_setting(lm, "entropy_top_p_top_k", top_k=None), GOLDEN["tokens_entropy_top_p_top_k"])
    assert not torch.equal(run_setting(lm, "entropy_top_p_top_k", top_p=None), GOLDEN["tokens_entropy_top_p_top_k"])
    assert not torch.equal(run_setting(lm, "maskgit_plus_sampled", alg_temp=None),
                           GOLDEN["tokens_maskgit_plus_sampled"])
    assert not torch.equal(run_setting(lm, "entropy_vocab", vocab_limit=None), GOLDEN["tokens_entropy_vocab"])
    # diffusion_generate without top_k uses the model config's legacy top_k = 50 (golden.json)
    assert not torch.equal(run_setting(lm, "defaults_entropy_sampled", top_k=None),
                           GOLDEN["tokens_defaults_entropy_sampled"])


def test_vocab_limit_is_never_exceeded(lm: DiffusionLM) -> None:
    P = GOLDEN["prompt_ids"].shape[1]
    assert (GOLDEN["tokens_entropy"][:, P:] >= TOKENIZER_LEN).any()  # unrestricted, the model picks padded ids
    for alg in ("origin", "entropy", "maskgit_plus", "topk_margin"):
        for seed in range(3):
            tokens = dream_generate(lm, GOLDEN["prompt_ids"], GOLDEN["prompt_mask"], steps=4, gen_length=12, alg=alg,
                                    alg_temp=None if alg == "origin" else 0.5, temperature=3.0,
                                    generator=torch.Generator().manual_seed(seed), vocab_limit=TOKENIZER_LEN)
            assert int(tokens[:, P:].max()) < TOKENIZER_LEN


def test_trajectory_and_the_registry_entry(lm: DiffusionLM) -> None:
    name = "maskgit_plus_sampled"
    setting = {**SETTINGS[name]}
    seed, steps = setting.pop("seed"), setting.pop("steps")
    cfg = SimpleNamespace(steps=steps, gen_length=META["sampler"]["gen_length"], block_length=None, threshold=None,
                          cfg_scale=0.0, cache="auto", eps=META["sampler"]["eps"], vocab_limit=None, **setting)
    out = SAMPLERS.get("dream")(lm, GOLDEN["prompt_ids"], GOLDEN["prompt_mask"], cfg,
                                generator=torch.Generator().manual_seed(seed), return_trajectory=True)
    P = GOLDEN["prompt_ids"].shape[1]
    assert torch.equal(out.completion_ids, GOLDEN[f"tokens_{name}"][:, P:]) and out.nfe == steps
    traj = out.trajectory
    assert traj.commit_step.shape == out.completion_ids.shape and bool((traj.commit_step >= 0).all())
    assert traj.token_probs.shape == (*out.completion_ids.shape[:1], steps, out.completion_ids.shape[1])
    probs = traj.token_probs
    assert bool(((probs > 0) & (probs <= 1)).all())
    after = torch.arange(steps)[None, :, None] > traj.commit_step[:, None, :]
    at_commit = probs.gather(1, traj.commit_step[:, None, :]).expand_as(probs)
    assert torch.equal(probs[after], at_commit[after])


def test_sampler_inputs_are_checked(lm: DiffusionLM) -> None:
    ids, mask = GOLDEN["prompt_ids"], GOLDEN["prompt_mask"]
    with pytest.raises(ValueError, match="generator is required"):
        dream_generate(lm, ids, mask, steps=2, gen_length=4, alg="origin")
    with pytest.raises(ValueError, match="not one of Dream's orderings"):
        dream_generate(lm, ids, mask, steps=2, gen_length=4, alg="low_confidence")
    with pytest.raises(ValueError, match="vocab_limit"):
        dream_generate(lm, ids, mask, steps=2, gen_length=4, vocab_limit=10_000)
