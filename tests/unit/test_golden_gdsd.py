"""GDSD and GDSD-TLC against GaryBall/GDSD's own compute_loss (fixture: tests/fixtures/methods/make_gdsd.py).

Each fixture is one optimizer step of the released loop (2 micro-batches of 4 rows, num_mc = 2) on
the tiny deterministic denoiser of make_espo.py: per micro-batch the loss, its gradient w.r.t. the
model's parameters, the per-draw values [b, M] their `_get_denoise_probs` gave compute_loss (with
their gradient), the per-draw old and reference values, and the masks their `forward_process` drew.
Cases: gdsd off-policy (inner iteration 1 of 2: the trust-region clamp cuts some draws and not
others) and on-policy (num_iterations 1), gdsd_tlc off-policy.

The released loss clamps and regresses every draw and sums over draws; the KL is averaged over
draws. ddrl's objective must reproduce it from the estimator's extras["per_draw"]; averaging the
draws first (what ddrl did before) halves the on-policy regression gradient and moves the clamp
onto the mean, and these tests then fail. ddrl divides by the step's 8 rows, the released trainer
by 4 rows per micro-batch and 2 micro-batches: the same, so ddrl's loss is the released loss / 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from ddrl.estimators.coupled_elbo import CoupledELBO
from ddrl.objectives.aggregation import AggregationCounts
from ddrl.registry import OBJECTIVES
from ddrl.types import EstimatorOutput, RolloutBatch
from tests.fixtures.methods.method_common import load

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures" / "methods"))
from make_espo import ToyDenoiser  # noqa: E402

FIXTURES = {name: load(name) for name in ("gdsd", "gdsd_tlc")}
CASES = [("gdsd", ""), ("gdsd", "onpolicy_"), ("gdsd_tlc", "")]
WEIGHTED = {"gdsd": False, "gdsd_tlc": True}  # the released gdsd_tlc uses ESPO's 1/t pass weights


def settings(name):
    return FIXTURES[name][1]["settings"]


def micro(name, k):
    rows = settings(name)["rows"] // settings(name)["gradient_accumulation_steps"]
    return slice(k * rows, (k + 1) * rows)


def step_batch(name) -> RolloutBatch:
    """The step's 8 rollouts; completion mask = tokens up to and including the first EOS."""
    t, s = FIXTURES[name][0], settings(name)
    completion = t["completion_ids"]
    is_eos = completion == s["eos"]
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), completion.shape[1])
    return RolloutBatch(
        prompt_ids=t["prompt_ids"], prompt_mask=torch.ones_like(t["prompt_ids"], dtype=torch.bool),
        completion_ids=completion, completion_mask=torch.arange(completion.shape[1])[None] <= first[:, None],
        group_ids=torch.arange(s["rows"]) // s["group_size"], rewards=t["rewards"], advantages=t["advantages"],
        mask_seeds=torch.tensor([0]))


def model(name, who, grad=False) -> ToyDenoiser:
    t = FIXTURES[name][0]
    return ToyDenoiser(t[f"{who}_emb"].clone().requires_grad_(grad), t[f"{who}_ctx"].clone().requires_grad_(grad))


def draws_output(per_draw: torch.Tensor, batch: RolloutBatch) -> EstimatorOutput:
    """An estimator output carrying per-draw values [b, M] and their mean, as coupled_elbo gives them."""
    mean = per_draw.mean(1)
    return EstimatorOutput(None, mean, torch.ones_like(batch.completion_mask), {"elbo": mean, "per_draw": per_draw})


def objective(name):
    s = settings(name)
    return OBJECTIVES.get(name)(psi=s["psi"], epsilon=s["epsilon"], beta=s["beta"])


@pytest.mark.parametrize("name,prefix", CASES)
@pytest.mark.parametrize("k", [0, 1])
def test_objective_reproduces_the_released_loss_and_per_draw_gradient(name, prefix, k):
    t = FIXTURES[name][0]
    step = step_batch(name)
    batch = step.index(micro(name, k))
    new = t[f"{prefix}per_draw_{k}"].clone().requires_grad_(True)  # [b, M] their values, as compute_loss got them
    old = t.get(f"{prefix}old_{k}")
    old = None if old is None else draws_output(old, batch)  # on-policy: old = sg(new), as released
    ref = draws_output(t[f"{prefix}ref_{k}"], batch)
    out = objective(name)(batch, draws_output(new, batch), old, ref, counts=AggregationCounts.from_batch(step))
    out.loss.backward()
    GA = settings(name)["gradient_accumulation_steps"]
    torch.testing.assert_close(out.loss.detach().double(), t[f"{prefix}loss_{k}"] / GA, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(new.grad, t[f"{prefix}per_draw_grad_{k}"] / GA, atol=1e-7, rtol=1e-6)


def test_the_fixture_exercises_per_draw_clamping():
    """Some row has one draw inside the trust region and one outside (so clamping the mean differs)."""
    import math

    for name in WEIGHTED:
        t, s = FIXTURES[name][0], settings(name)
        hi, lo = math.log1p(s["epsilon"]), math.log1p(-s["epsilon"])
        delta = torch.cat([t[f"per_draw_{k}"] - t[f"old_{k}"] for k in (0, 1)])  # [B, M]
        outside = (delta > hi) | (delta < lo)
        assert (outside.any(1) & ~outside.all(1)).any(), name
        assert (~outside).any() and outside.any()


def test_averaging_the_draws_first_halves_the_on_policy_regression_gradient():
    """The form ddrl had before (mean over draws, then clamp and square once): on-policy, its
    regression gradient w.r.t. the mean ELBO is 1/num_mc of the released (per-draw, summed) one."""
    name, prefix, k = "gdsd", "onpolicy_", 0
    t = FIXTURES[name][0]
    step = step_batch(name)
    batch = step.index(micro(name, k))
    obj = objective(name)
    obj.beta = 0.0  # the regression alone
    mean = t[f"{prefix}per_draw_{k}"].mean(1).clone().requires_grad_(True)
    only_mean = EstimatorOutput(None, mean, torch.ones_like(batch.completion_mask), {})  # no per-draw values
    obj(batch, only_mean, None, None, counts=AggregationCounts.from_batch(step)).loss.backward()
    per_draw = t[f"{prefix}per_draw_{k}"].clone().requires_grad_(True)
    obj(batch, draws_output(per_draw, batch), None, None, counts=AggregationCounts.from_batch(step)).loss.backward()
    # Σ_m (0 - ψA)²: -2ψA/L on every draw; (mean - sg(mean))/L - ψA squared once: -2ψA/L on the mean
    ratio = per_draw.grad.sum(1) / mean.grad
    torch.testing.assert_close(ratio, torch.full_like(ratio, float(settings(name)["num_mc"])), atol=0, rtol=1e-6)


@pytest.mark.parametrize("name,prefix", CASES)
@pytest.mark.parametrize("k", [0, 1])
def test_coupled_elbo_with_their_masks_gives_their_per_draw_values(name, prefix, k):
    t = FIXTURES[name][0]
    batch = step_batch(name).index(micro(name, k))
    estimator = CoupledELBO(num_mc=settings(name)["num_mc"], weighted=WEIGHTED[name])
    masks = t[f"{prefix}masks_{k}"]
    with torch.no_grad():
        for who, key in (("policy", "per_draw"), ("old", "old"), ("ref", "ref")):
            if f"{prefix}{key}_{k}" not in t:
                continue
            out = estimator.score(model(name, who), batch, masks)
            # float32 cross-entropies summed on both sides (theirs in a float32 buffer)
            torch.testing.assert_close(out.extras["per_draw"].double(), t[f"{prefix}{key}_{k}"], atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("name,prefix", CASES)
def test_one_released_step_end_to_end(name, prefix):
    """Estimator (their masks) + objective over both micro-batches: the released parameter gradient
    (grad_0 + grad_1) / 2 of one optimizer step."""
    t, s = FIXTURES[name][0], settings(name)
    GA = s["gradient_accumulation_steps"]
    step = step_batch(name)
    counts = AggregationCounts.from_batch(step)
    estimator = CoupledELBO(num_mc=s["num_mc"], weighted=WEIGHTED[name])
    policy = model(name, "policy", grad=True)
    on_policy = f"{prefix}old_0" not in t
    for k in range(GA):
        batch = step.index(micro(name, k))
        masks = t[f"{prefix}masks_{k}"]
        with torch.no_grad():
            old = None if on_policy else estimator.score(model(name, "old"), batch, masks)
            ref = estimator.score(model(name, "ref"), batch, masks)
        loss = objective(name)(batch, estimator.score(policy, batch, masks), old, ref, counts=counts).loss
        loss.backward()
        torch.testing.assert_close(loss.detach().double(), t[f"{prefix}loss_{k}"] / GA, atol=1e-6, rtol=1e-6)
    for param in ("emb", "ctx"):
        released = (t[f"{prefix}grad_{param}_0"] + t[f"{prefix}grad_{param}_1"]) / GA
        torch.testing.assert_close(getattr(policy, param).grad, released, atol=1e-6, rtol=1e-5)
        assert released.abs().max() > 1e-2
