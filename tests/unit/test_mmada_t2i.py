"""MMaDA text-to-image: the image offset, MAGVIT-v2 decoder, the t2i prompt layout with its completion
suffix and guidance input (ddrl.models.mmada, ddrl.models.native.magvit2).

The tiny MMaDA here is built like MMaDA-8B's vocabulary: its tokenizer (the LLaDA fixture's 128 tokens +
<|soi|> <|eoi|> <|t2i|> [iPAD] = 132) is shorter than its text rows (llm_vocab_size 136), and 64 image
codes follow the tokenizer (ids 132..195) in a vocabulary of 200. The golden comparisons with the
authors' code are in test_mmada_t2i_golden.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import ddrl
from ddrl.models.native.llada import MMaDABackbone, MMaDAConfig

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
T2I_TOKENS = ["<|soi|>", "<|eoi|>", "<|t2i|>", "[iPAD]"]  # ids 128..131 in the tiny tokenizer
SOI, EOI, T2I, IPAD = 128, 129, 130, 131
BOS, EOS = 120, 121  # the LLaDA fixture's <|startoftext|>, <|endoftext|>
N_TOKENIZER, LLM_VOCAB, CODEBOOK = 132, 136, 64


def write_tiny_mmada(directory: Path, *, seed: int = 0) -> Path:
    """A tiny official-layout MMaDA (config.json fields as the fixture's, weights N(0, 0.5)) whose
    tokenizer is shorter than llm_vocab_size."""
    from transformers import PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    source = FIXTURES / "mmada" / "model"
    tok = PreTrainedTokenizerFast.from_pretrained(str(source))
    tok.add_tokens(T2I_TOKENS, special_tokens=True)
    tok.save_pretrained(str(directory))
    assert len(tok) == N_TOKENIZER and tok.convert_tokens_to_ids("[iPAD]") == IPAD
    fields = json.loads((source / "config.json").read_text())
    vocab = LLM_VOCAB + CODEBOOK
    fields.update(llm_vocab_size=LLM_VOCAB, vocab_size=vocab, embedding_size=vocab, new_vocab_size=vocab,
                  codebook_size=CODEBOOK, num_vq_tokens=16)
    model = MMaDABackbone(MMaDAConfig.from_dict(fields))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name or "ln_f" in name
                    else 0.5 * torch.randn(p.shape, generator=g))
    model.save_pretrained(directory)
    return directory


def write_magvit(directory: Path, *, seed: int = 0, std: float = 0.02) -> Path:
    """A MAGVIT-v2 directory as released (config.json with the class name only, pytorch_model.safetensors)
    holding seeded decoder weights (the encoder is not read by ddrl and left out here)."""
    from safetensors.torch import save_file

    from ddrl.models.native.magvit2 import MAGVITv2Decoder

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"_class_name": "MAGVITv2", "_diffusers_version": "0.30.1"}))
    g = torch.Generator().manual_seed(seed)
    state = {}
    for k, v in sorted(MAGVITv2Decoder().state_dict().items()):
        is_norm = "norm" in k.split(".")[-2] and k.endswith("weight")  # GroupNorm scales: 1 + noise
        state[k] = (1.0 if is_norm else 0.0) + torch.randn(v.shape, generator=g) * (0.1 if is_norm else std)
    save_file(state, str(directory / "pytorch_model.safetensors"))
    return directory


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("mmada_t2i")
    return write_tiny_mmada(root / "mmada"), write_magvit(root / "magvit")


@pytest.fixture(scope="module")
def t2i_model(tiny):
    mmada, magvit = tiny
    return ddrl.load_model(mmada, dtype="float32", vq_path=magvit).eval()


# --------------------------------------------------------------------------------------------
# Item 1: image code c is token len(tokenizer) + c
# --------------------------------------------------------------------------------------------


def test_image_codes_follow_the_tokenizer_not_llm_vocab_size(tiny):
    model = ddrl.load_model(tiny[0], dtype="float32")
    assert len(model.tokenizer) == N_TOKENIZER < LLM_VOCAB
    assert model.image_token_range == (N_TOKENIZER, N_TOKENIZER + CODEBOOK)  # (132, 196), not (136, 200)
    logits = model(torch.tensor([[BOS, 5, 6, EOS]])).logits
    assert torch.equal(model.image_logits(logits), logits[..., 132:196])


# --------------------------------------------------------------------------------------------
# Item 2: MAGVIT-v2's decoder, read from its directory
# --------------------------------------------------------------------------------------------


def test_lfq_lookup_is_the_13_bit_sign_code():
    from ddrl.models.native.magvit2 import lfq_codes

    z = lfq_codes(torch.tensor([[[0, 1, 4096, 8191, 5]]]))  # [1, 13, 1, 5]
    assert z.shape == (1, 13, 1, 5)
    expected = torch.full((13, 5), -1.0)
    expected[12, 1] = 1  # code 1: the least significant bit is the last channel
    expected[0, 2] = 1  # 4096 = 2**12: the first channel
    expected[:, 3] = 1  # 8191: every bit
    expected[10, 4] = expected[12, 4] = 1  # 5 = 0b101
    assert torch.equal(z[0, :, 0], expected)


def test_load_model_with_vq_path_decodes_images(t2i_model, tiny):
    from ddrl.models.mmada import MMaDAImageLM

    model = t2i_model
    assert isinstance(model, MMaDAImageLM) and model.family == "mmada"
    assert model.image_token_range == model.logits_range == (132, 196)
    assert sum(p.numel() for p in model.vq_decoder.parameters()) == 39_947_833  # not in the trained module tree
    assert not any(n.startswith("vq_decoder") for n, _ in model.named_parameters())
    codes = torch.tensor([[[0, 63], [5, 8191]]])
    pixels = model.decode_images(codes)
    assert pixels.shape == (1, 3, 32, 32) and pixels.dtype == torch.float32
    assert 0 <= float(pixels.min()) and float(pixels.max()) <= 1
    raw = model.vq_decoder(codes)
    torch.testing.assert_close(pixels, ((raw + 1) / 2).clamp(0, 1))
    with pytest.raises(ValueError, match="codebook indices in \\[0, 8192\\)"):
        model.decode_images(codes + 132)


def test_a_magvit_directory_that_is_not_one_fails_before_weights(tmp_path, tiny):
    from ddrl.models.io import ModelDirectoryError

    bad = tmp_path / "vq"
    shutil.copytree(tiny[1], bad)
    (bad / "config.json").write_text(json.dumps({"_class_name": "VQModel"}))
    with pytest.raises(ModelDirectoryError, match="names class 'VQModel'.*MAGVITv2"):
        ddrl.load_model(tiny[0], vq_path=bad)
    with pytest.raises(ModelDirectoryError, match="not a MAGVIT-v2 directory"):
        ddrl.load_model(tiny[0], vq_path=tmp_path)
    with pytest.raises(ValueError, match="vq_path applies to URSA pipelines and MMaDA"):
        ddrl.load_model(FIXTURES / "llada" / "model", vq_path=tiny[1])


# --------------------------------------------------------------------------------------------
# Item 3: the t2i layout, the completion suffix and the released guidance input
# --------------------------------------------------------------------------------------------


def test_prompts_take_the_t2i_layout(t2i_model):
    tok = t2i_model.tokenizer
    text = tok.encode("a red cat")
    assert tok.encode_prompt("a red cat") == [T2I, BOS] + text + [EOS, SOI]
    assert tok.encode_prompt("") == [T2I, BOS, EOS, SOI]
    assert tok.pad_token_id == IPAD and t2i_model.completion_suffix == (EOI,)
    tok.max_text_len = 4  # a longer text keeps its first tokens and ends with <eos> (max_text_len + 1 in all)
    try:
        long = tok.encode_prompt("a red cat sat on the mat")
        tok.attend_padding = True  # MaskGRPO's rows: [iPAD]-padded to max_text_len + 1, then <|soi|>
        assert tok.encode_prompt("") == [IPAD, IPAD, T2I, BOS, EOS, SOI]
    finally:
        tok.max_text_len, tok.attend_padding = 256, False
    assert long == [T2I, BOS] + tok.encode("a red cat sat on the mat")[:2] + [EOS, SOI]


def _prompt_batch(model, texts):
    from ddrl.data import encode_prompts

    return encode_prompts(model.tokenizer, texts)  # left-padded with [iPAD], mask False there


def test_the_sampler_and_the_estimators_see_eoi_after_the_completion(t2i_model):
    from ddrl.estimators.common import forward_logprobs
    from ddrl.sampling.utils import completion_logits

    model = t2i_model
    ids, mask = _prompt_batch(model, ["a red cat", "dog"])
    assert (ids[~mask] == IPAD).all() and (ids[:, -1] == SOI).all()
    completion = torch.tensor([[140, model.mask_token_id, 150, 195], [132, 133, 134, 135]])
    P, L = ids.shape[1], completion.shape[1]
    full = torch.cat([ids, completion, torch.full((2, 1), EOI)], dim=1)
    attn = torch.cat([mask, torch.ones(2, L + 1, dtype=torch.bool)], dim=1)
    expected = model(full, attention_mask=attn).logits[:, P:P + L]  # [2, L, V]
    got = completion_logits(model, ids, mask, completion, cfg_scale=0.0, mask_id=model.mask_token_id)
    torch.testing.assert_close(got, expected)
    no_suffix = model(full[:, :-1], attention_mask=attn[:, :-1]).logits[:, P:]
    assert (no_suffix - expected).abs().max() > 1e-2  # the suffix changes what the model sees
    clean = torch.tensor([[140, 141, 150, 195], [132, 133, 134, 135]])
    lp = forward_logprobs(model, ids, mask, completion, clean)
    ref = torch.log_softmax(expected.float(), dim=-1).gather(-1, clean[..., None])[..., 0]
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=1e-5)


def test_guidance_uses_the_empty_prompt_laid_out_the_same_way(t2i_model):
    from ddrl.sampling.utils import completion_logits

    model, w = t2i_model, 3.5
    ids, mask = _prompt_batch(model, ["a red cat"])
    completion = torch.full((1, 4), model.mask_token_id)
    completion[0, 2] = 140
    P, L = ids.shape[1], 4
    rest = torch.cat([completion, torch.tensor([[EOI]])], dim=1)
    cond = model(torch.cat([ids, rest], 1), attention_mask=torch.cat([mask, torch.ones(1, L + 1, dtype=torch.bool)],
                                                                          1)).logits[:, P:P + L]
    empty = torch.tensor([[T2I, BOS, EOS, SOI]])  # the empty caption, in the layout, unpadded
    uncond = model(torch.cat([empty, rest], 1)).logits[:, 4:4 + L]
    got = completion_logits(model, ids, mask, completion, cfg_scale=w, mask_id=model.mask_token_id)
    torch.testing.assert_close(got, (1 + w) * cond - w * uncond, atol=1e-4, rtol=1e-4)
    model.cfg_unconditional = "masked_prompt"  # ddrl's form: the real prompt tokens masked
    try:
        masked = model(torch.cat([ids.masked_fill(mask, model.mask_token_id), rest], 1),
                       attention_mask=torch.cat([mask, torch.ones(1, L + 1, dtype=torch.bool)], 1)).logits[:, P:P + L]
        got = completion_logits(model, ids, mask, completion, cfg_scale=w, mask_id=model.mask_token_id)
        torch.testing.assert_close(got, (1 + w) * cond - w * masked, atol=1e-4, rtol=1e-4)
    finally:
        model.cfg_unconditional = "empty_prompt"
    with pytest.raises(ValueError, match="cfg_unconditional='x'"):
        model.cfg_unconditional = "x"


def test_a_t2i_model_generates_images_with_emerge(t2i_model):
    from ddrl.config import SamplerConfig
    from ddrl.data import task_completions
    from ddrl.registry import SAMPLERS
    import ddrl.sampling  # noqa: F401

    model = t2i_model
    ids, mask = _prompt_batch(model, ["a red cat", "dog"])
    cfg = SamplerConfig(name="emerge", steps=3, gen_length=4, temperature=1.0, cfg_scale=1.5)
    out = SAMPLERS.get("emerge")(model, ids, mask, cfg, generator=torch.Generator().manual_seed(0))
    assert ((out.completion_ids >= 132) & (out.completion_ids < 196)).all()
    task = type("T", (), {"modality": "image", "image_grid": (2, 2), "name": "t2i"})()
    images = task_completions(model, task, out.completion_ids).images
    assert images.shape == (2, 3, 32, 32)
    with pytest.raises(ValueError, match="rollout.cache=none"):
        SAMPLERS.get("emerge")(model, ids, mask, SamplerConfig(name="emerge", steps=3, gen_length=4, cache="prefix"),
                               generator=torch.Generator().manual_seed(0))


def test_a_saved_t2i_model_reloads_with_its_decoder(t2i_model, tmp_path):
    t2i_model.save_pretrained(tmp_path / "saved")
    again = ddrl.load_model(tmp_path / "saved", dtype="float32")
    assert type(again).__name__ == "MMaDAImageLM" and again.vq_path == t2i_model.vq_path
    assert again.image_token_range == again.logits_range == (132, 196)
    assert again.tokenizer.encode_prompt("dog") == t2i_model.tokenizer.encode_prompt("dog")


def test_text_to_image_task_takes_a_cleared_preset_and_refuses_a_real_one(tmp_path):
    """A per-task image recipe based on a text recipe clears its preset (configs/paper/maskgrpo/t2i_mmada.yaml)."""
    from ddrl.tasks import get_task

    prompts = tmp_path / "p.txt"
    prompts.write_text("a red cat\na blue dog\n")
    args = dict(image_grid=[2, 2], reward=lambda completions, **c: [0.0] * len(completions),
                train_path=str(prompts), test_path=str(prompts))
    assert get_task("text_to_image", preset=None, **args).name == "text_to_image"
    with pytest.raises(ValueError, match="no presets"):
        get_task("text_to_image", preset="d1", **args)


# --------------------------------------------------------------------------------------------
# The image samplers ask for the codebook's logits only (class_range)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_head_computes_the_codebook_rows_alone_bit_for_bit(tiny, monkeypatch, dtype):
    """forward(class_range = the codebook): LLaDA's range_logits runs the head's 64 code rows, never the
    200-row head, and the logits are the full logits' slice bit for bit (CPU), at kept positions given as a
    count or as indices; another range is the same slice, its suppressed ids included."""
    from ddrl.models.native.llada import LLaDABackbone

    model = ddrl.load_model(tiny[0], dtype=dtype, vq_path=tiny[1]).eval()
    ids, mask = _prompt_batch(model, ["a red cat", "dog"])
    ids = torch.cat([ids, torch.tensor([[140, 150, model.mask_token_id, EOI]] * 2)], dim=1)
    mask = torch.cat([mask, torch.ones(2, 4, dtype=torch.bool)], dim=1)
    codes = model.image_token_range
    real = LLaDABackbone.lm_head
    with torch.no_grad():
        for keep in (4, torch.tensor([0, 5, ids.shape[1] - 2])):
            full = model(ids, attention_mask=mask, logits_to_keep=keep).logits
            heads = []
            monkeypatch.setattr(LLaDABackbone, "lm_head", lambda self, h: heads.append(h.shape) or real(self, h))
            got = model(ids, attention_mask=mask, logits_to_keep=keep, class_range=codes).logits
            assert not heads and got.dtype == full.dtype and torch.equal(got, full[..., codes[0]:codes[1]])
            assert torch.equal(model(ids, attention_mask=mask, logits_to_keep=keep, class_range=(100, 160)).logits,
                               full[..., 100:160])  # suppressed ids (text, the mask) and codes
            monkeypatch.undo()


def test_range_logits_of_a_tied_scaled_head_and_of_an_adapted_one():
    """A tied (wte) head with scale_logits, and a head that is not a plain Linear (a LoRA adapter on ff_out,
    computed whole and sliced), give lm_head's columns bit for bit."""
    from ddrl.models.native.llada import LLaDABackbone, LLaDAConfig

    fields = json.loads((FIXTURES / "llada" / "model" / "config.json").read_text())
    hidden = torch.randn(2, 5, fields["d_model"], generator=torch.Generator().manual_seed(1))
    for tied in (True, False):
        backbone = LLaDABackbone(LLaDAConfig.from_dict({**fields, "weight_tying": tied, "scale_logits": True}))
        for p in backbone.parameters():
            torch.nn.init.normal_(p, generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            assert torch.equal(backbone.range_logits(hidden, 7, 40), backbone.lm_head(hidden)[..., 7:40])
    t = backbone.model.transformer
    t["ff_out"] = torch.nn.Sequential(t["ff_out"])  # not a plain Linear (as a LoRA wrapper): run whole, sliced
    with torch.no_grad():
        assert torch.equal(backbone.range_logits(hidden, 7, 40), backbone.lm_head(hidden)[..., 7:40])


def test_image_samplers_never_compute_the_whole_vocabulary(t2i_model, tiny, monkeypatch):
    """emerge (ddrl's layout and the released one, guided, with its trajectory) and maskgit never run the
    whole head on a text-to-image MMaDA; the tokens are vocabulary ids of the codebook. A text MMaDA's
    emerge still computes every id's logits (the text path is unchanged)."""
    from ddrl.config import SamplerConfig
    from ddrl.models.native.llada import LLaDABackbone
    from ddrl.registry import SAMPLERS
    import ddrl.sampling  # noqa: F401

    real = LLaDABackbone.lm_head
    heads = []
    monkeypatch.setattr(LLaDABackbone, "lm_head", lambda self, h: heads.append(h.shape) or real(self, h))
    ids, mask = _prompt_batch(t2i_model, ["a red cat", "dog"])
    for name, rng in (("emerge", "ddrl"), ("emerge", "released"), ("maskgit", "ddrl")):
        cfg = SamplerConfig(name=name, rng=rng, steps=3, gen_length=4, temperature=1.0, cfg_scale=1.5, cache="none")
        out = SAMPLERS.get(name)(t2i_model, ids, mask, cfg, generator=torch.Generator().manual_seed(0),
                                 return_trajectory=name == "emerge")
        assert ((out.completion_ids >= 132) & (out.completion_ids < 196)).all()
        assert out.trajectory is None or (out.trajectory.token_probs > 0).all()
    assert not heads
    text = ddrl.load_model(tiny[0], dtype="float32").eval()
    SAMPLERS.get("emerge")(text, torch.tensor([[BOS, 5, 6]]), None,
                           SamplerConfig(name="emerge", steps=2, gen_length=4, cache="none"),
                           generator=torch.Generator().manual_seed(0))
    assert heads  # the text MMaDA's head ran whole
