"""The MDLM DNA family (DRAKES / SEPO) against the authors' code: tests/fixtures/make_sepo_dna.py ran
ozekri/SEPO @ 4a4a40f GRPO_MDLM_DNA on a tiny Lightning checkpoint (hidden 16, 1 stack, length 8)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from safetensors.torch import load_file  # noqa: E402

import ddrl  # noqa: E402
from ddrl.models.mdlm_dna import export_lightning_checkpoint  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "sepo_dna"
CKPT = FIXTURE / "tiny_mdlm_dna.ckpt"

@pytest.fixture(scope="module")
def golden() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURE / "golden.safetensors"))

@pytest.fixture(scope="module")
def model():
    return ddrl.load_model(CKPT).eval()

def test_loads_the_lightning_checkpoint_natively(model):
    assert model.family == "mdlm_dna"
    assert model.mask_token_id == 4 and model.vocab_size == 5
    assert model.tokenizer.encode("ACGT") == [0, 1, 2, 3]
    assert model.tokenizer.decode([3, 2, 1, 0, 4]) == "TGCA"
    assert model.process.schedule.name == "loglinear"
    cfg = model.model.config
    assert (cfg.hidden_dim, cfg.num_cnn_stacks, cfg.length, cfg.time_conditioning) == (16, 1, 8, False)

def test_raw_logits_equal_the_released_cnn(model, golden):
    with torch.no_grad():
        raw = model.model(golden["logits_input"]).logits  # [B, L, 5]
    torch.testing.assert_close(raw, golden["backbone_logits"], atol=1e-5, rtol=0)

def test_time_conditioning_path_equals_the_released_cnn(model, golden):
    """With time conditioning on, sigma reaches the Fourier features (the released config zeroes it)."""
    from ddrl.models.native.mdlm_dna import MDLMDNABackbone

    cfg = model.model.config
    cfg_t = type(cfg)(**{**cfg.__dict__, "time_conditioning": True})
    backbone = MDLMDNABackbone(cfg_t)
    backbone.load_state_dict(model.model.state_dict())
    t = golden["logits_t"]
    sigma = -torch.log1p(-(1 - 1e-3) * t)  # LogLinearNoise.total_noise
    with torch.no_grad():
        out = backbone(golden["logits_input"], sigma=sigma).logits
    torch.testing.assert_close(out, golden["backbone_logits_timecond"], atol=1e-5, rtol=0)
    assert not torch.allclose(out, golden["backbone_logits"], atol=1e-3)

def test_wrapped_logits_give_the_released_subs_and_full_scores(model, golden):
    x = golden["logits_input"]
    with torch.no_grad():
        logits = model(x).logits  # mask logit suppressed (subs)
    masked = x == 4
    subs = torch.log_softmax(logits.float(), -1)
    torch.testing.assert_close(subs[masked][:, :4], golden["subs_logprobs"][masked][:, :4], atol=1e-5, rtol=0)
    assert (golden["subs_logprobs"][masked][:, 4] < -1e5).all() and (subs[masked][:, 4] < -1e3).all()
    with torch.no_grad():
        full = torch.log_softmax(model.model(x).logits, -1)  # SEPO's scores: all 5 classes
    torch.testing.assert_close(full, golden["full_logprobs"], atol=1e-5, rtol=0)

def test_save_and_export_round_trip(model, golden, tmp_path):
    model.save_pretrained(tmp_path / "dna")
    again = ddrl.load_model(tmp_path / "dna")
    export_lightning_checkpoint(again, tmp_path / "again.ckpt")
    back = ddrl.load_model(tmp_path / "again.ckpt")
    with torch.no_grad():
        for m in (again, back):
            torch.testing.assert_close(m.model(golden["logits_input"]).logits, golden["backbone_logits"],
                                       atol=1e-5, rtol=0)
