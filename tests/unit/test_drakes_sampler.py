"""The DRAKES sampler (rollout.name=drakes) against the authors' DDPM step: their q_xs for fixed states and
t (diffusion_gosai_update_new.py _build_distrib, as _ddpm_update draws from it) and one soft step
(_ddpm_update_finetune_gradient), from tests/fixtures/make_sepo_dna.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import ddrl
from ddrl.registry import SAMPLERS
from ddrl.sampling.drakes import EPS, ddpm_transition, move_chance, soft_update, subs_probs

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "sepo_dna"
STEPS = 128


@pytest.fixture(scope="module")
def golden():
    return load_file(str(FIXTURE / "golden.safetensors"))


@pytest.fixture(scope="module")
def model():
    return ddrl.load_model(FIXTURE / "tiny_mdlm_dna.ckpt").eval()


def test_loglinear_move_chances():
    m = ddrl.load_model(FIXTURE / "tiny_mdlm_dna.ckpt")
    assert move_chance(m, 0.5) == pytest.approx((1 - 1e-3) * 0.5, abs=1e-12)


def test_transition_probs_equal_the_released_step(model, golden):
    x = golden["logits_input"]
    times = torch.linspace(1, EPS, STEPS + 1, dtype=torch.float64)
    dt = (1 - EPS) / STEPS
    with torch.no_grad():
        p_x0 = subs_probs(model(x).logits, x, 4)
    for k, i in enumerate(golden["step_indices"].tolist()):
        t = float(times[i])
        q = ddpm_transition(p_x0, move_chance(model, t), move_chance(model, t - dt), 4)
        torch.testing.assert_close(q, golden["step_q_xs"][k], atol=1e-6, rtol=1e-5)


def test_soft_step_equals_the_released_one(model, golden):
    x = golden["logits_input"]
    times = torch.linspace(1, EPS, STEPS + 1, dtype=torch.float64)
    dt = (1 - EPS) / STEPS
    t = float(times[STEPS - 1])
    current = torch.nn.functional.one_hot(x, 5).float()
    with torch.no_grad():
        q = ddpm_transition(subs_probs(model(current).logits, current, 4), move_chance(model, t),
                            move_chance(model, t - dt), 4)
    # Theirs computes m(s) = 1 - exp(-sigma(s)) in float32, which loses digits near s = 0 (here s ~ 1e-5 +
    # a step: ~3e-6 absolute on the mask class); ddrl's (1 - 1e-3) s is exact.
    torch.testing.assert_close(soft_update(current, q, 4), golden["soft_step_output"], atol=1e-5, rtol=0)


def test_sampler_draws_bases_reproducibly(model):
    cfg = SimpleNamespace(steps=16, gen_length=8, temperature=1.0)
    prompt = torch.zeros(5, 0, dtype=torch.long)
    a = SAMPLERS.get("drakes")(model, prompt, None, cfg, generator=torch.Generator().manual_seed(0),
                               return_trajectory=True)
    b = SAMPLERS.get("drakes")(model, prompt, None, cfg, generator=torch.Generator().manual_seed(0))
    assert a.completion_ids.shape == (5, 8) and torch.equal(a.completion_ids, b.completion_ids)
    assert ((a.completion_ids >= 0) & (a.completion_ids < 4)).all()
    assert a.trajectory.commit_step.max() <= 15 and a.trajectory.token_probs.shape == (5, 16, 8)
    with pytest.raises(ValueError, match="prompt must be empty"):
        SAMPLERS.get("drakes")(model, torch.zeros(1, 2, dtype=torch.long), None, cfg,
                               generator=torch.Generator().manual_seed(0))
