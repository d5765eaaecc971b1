"""MMaDA text-to-image against the authors' code (Gen-Verse/MMaDA @ 3cdb870; tests/fixtures/make_mmada_t2i.py):
prompt ids, the image-logits slice (conditional and guided), MAGVIT-v2 pixels. float32, 1e-4."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ddrl

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "mmada_t2i"
sys.path.insert(0, str(FIXTURE.parent))
from magvit_weights import decoder_state, fingerprint  # noqa: E402  (shared with the fixture script)

META = json.loads((FIXTURE / "golden.json").read_text())
# Per tensor (magvit_weights.fingerprint), measured under ATEN_CPU_CAPABILITY=default against the
# authors' side's bits (AVX512 and AVX2 draw them exactly): |sum - theirs| <= 2.7e-5 of the tensor's
# norm, sum of squares within 2.6e-8 relative; bounds 10x that. Seed + 1 moves the sums by 0.77 of the
# norm (median; 1e-3 at least) and the sums of squares by 7e-6 to 0.6.
MAGVIT_SUM_TOL, MAGVIT_SUMSQ_RTOL = 3e-4, 3e-7
G = load_file(str(FIXTURE / "golden.safetensors"))
N_VQ, CODEBOOK = 16, 64


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from ddrl.models.native.magvit2 import MAGVITv2Decoder

    vq = tmp_path_factory.mktemp("magvit")
    (vq / "config.json").write_text(json.dumps({"_class_name": "MAGVITv2"}))
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in MAGVITv2Decoder().state_dict().items()}
    weights = decoder_state(shapes)
    assert_theirs(fingerprint(weights), json.loads((FIXTURE / "magvit_fingerprint.json").read_text()))
    save_file(weights, str(vq / "pytorch_model.safetensors"))
    m = ddrl.load_model(FIXTURE / "model", dtype="float32", vq_path=vq).eval()
    m.tokenizer.max_text_len = META["max_text_len"]
    return m


def assert_theirs(ours: dict[str, list[float]], theirs: dict[str, list[float]]) -> None:
    """The seeded MAGVIT weights are the authors' side's up to the float32 rounding of torch.randn's
    kernel on this CPU (golden.json's sha256 holds bit for bit on AVX2 / AVX512 only; magvit_weights)."""
    assert sorted(ours) == sorted(theirs)
    for name, (total, squares) in theirs.items():
        norm = squares ** 0.5
        assert abs(ours[name][0] - total) <= MAGVIT_SUM_TOL * norm, name
        assert abs(ours[name][1] - squares) <= MAGVIT_SUMSQ_RTOL * squares, name


def test_image_range_is_the_authors(model):
    n = META["tokenizer_length"]
    assert n == 132 < json.loads((FIXTURE / "model" / "config.json").read_text())["llm_vocab_size"]
    assert model.image_token_range == (n, n + CODEBOOK)


def test_prompt_ids_equal_t2i_gen_prompt(model):
    tok = model.tokenizer
    P = META["max_text_len"] + 2  # [iPAD].. <|t2i|> <bos> text <eos> <|soi|>
    for theirs, their_mask, texts in ((G["prompt_ids"], G["prompt_attention"], META["prompts"]),
                                      (G["uncond_ids"], G["uncond_attention"], ["", ""])):
        for row, mask, text in zip(theirs, their_mask, texts):
            assert tok.encode_prompt(text) == row[:P][mask[:P].bool()].tolist()  # MMaDA: padding masked
            tok.attend_padding = True
            try:
                assert tok.encode_prompt(text) == row[:P].tolist()  # MaskGRPO's rows: padding attended
            finally:
                tok.attend_padding = False
        assert (theirs[:, -1] == model.completion_suffix[0]).all()  # <|eoi|> after the image slots


@torch.no_grad()
@pytest.mark.parametrize("guidance", [0.0, 3.5])
def test_image_logits_equal_t2i_generate(model, guidance):
    from ddrl.data import encode_prompts
    from ddrl.sampling.utils import completion_logits

    ids, mask = encode_prompts(model.tokenizer, META["prompts"])
    canvas = G["state_ids"][:, -(N_VQ + 1):-1]
    logits = completion_logits(model, ids, mask, canvas, cfg_scale=guidance, mask_id=model.mask_token_id)
    expected = G["guided_image_logits" if guidance else "cond_image_logits"]
    torch.testing.assert_close(model.image_logits(logits), expected, atol=1e-4, rtol=1e-4)


@torch.no_grad()
@pytest.mark.pinned  # the seeded weights' check (model fixture) under other CPU kernels
def test_magvit_pixels_equal_decode_code(model):
    codes = G["magvit_codes"].view(2, 4, 4)
    torch.testing.assert_close(model.vq_decoder(codes), G["magvit_raw"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(model.decode_images(codes), G["magvit_pixels"], atol=1e-4, rtol=1e-4)


def test_maskgit_remasking_equals_mask_by_random_topk():
    from ddrl.sampling.maskgit import maskgit_remask

    masking = maskgit_remask(G["maskgit_probs"], G["maskgit_mask_len"], float(G["maskgit_temperature"]),
                             G["maskgit_uniforms"])
    assert torch.equal(masking, G["maskgit_masking"])
    assert not (masking & ~G["maskgit_unknown"]).any()  # decided slots are never re-masked


def test_maskgit_sampler_decodes_every_slot_into_image_codes(model):
    from ddrl.config import SamplerConfig
    from ddrl.data import encode_prompts
    from ddrl.registry import SAMPLERS
    from ddrl.sampling.checks import resolve_sampler

    assert resolve_sampler(model, "maskgit") == "maskgit"
    ids, mask = encode_prompts(model.tokenizer, META["prompts"])
    cfg = SamplerConfig(name="maskgit", steps=4, gen_length=N_VQ, temperature=1.0, cfg_scale=3.5)
    run = lambda: SAMPLERS.get("maskgit")(model, ids, mask, cfg, generator=torch.Generator().manual_seed(0))  # noqa: E731
    out = run()
    lo, hi = model.image_token_range
    assert out.nfe == 4 and ((out.completion_ids >= lo) & (out.completion_ids < hi)).all()
    assert torch.equal(out.completion_ids, run().completion_ids)  # a fixed function of the seed
