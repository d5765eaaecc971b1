"""ESPO against ML-GSAI/ESPO's own compute_loss (fixture: tests/fixtures/methods/make_espo.py).

The fixture is one optimizer step of the released loop (2 micro-batches of 4 rows, inner iteration 1
of 2, num_mc = 2) on a tiny deterministic denoiser (ToyDenoiser): each micro-batch's loss, its
gradient w.r.t. the model's parameters, the per-draw ELBOs of their `_get_elbo`, the old and
reference ELBOs of their `_get_elbo_by_chunk`, and the masks their `forward_process` drew.

Checked here: (1) ddrl's `espo` objective on the released ELBOs gives the released loss and its
gradient w.r.t. the ELBO; (2) ddrl's `coupled_elbo` estimator with their masks injected gives their
per-draw ELBOs; (3) both together give the released gradient w.r.t. the model's parameters. The
released trainer divides each micro-batch by its 4 rows and the step by 2 micro-batches; ddrl
divides by the step's 8 rows: the same, so ddrl's loss is the released loss / 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from ddrl.estimators.coupled_elbo import CoupledELBO
from ddrl.objectives.aggregation import AggregationCounts
from ddrl.objectives.espo import ESPO
from ddrl.types import EstimatorOutput, RolloutBatch
from tests.fixtures.methods.method_common import load

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures" / "methods"))
from make_espo import ToyDenoiser  # noqa: E402

T, META = load("espo")
S = META["settings"]
GA, EOS = S["gradient_accumulation_steps"], S["eos"]
ROWS = S["rows"] // GA
MICRO = [slice(k * ROWS, (k + 1) * ROWS) for k in range(GA)]


def step_batch() -> RolloutBatch:
    """The step's 8 rollouts; completion mask = tokens up to and including the first EOS."""
    completion = T["completion_ids"]
    is_eos = completion == EOS
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), completion.shape[1])
    return RolloutBatch(
        prompt_ids=T["prompt_ids"], prompt_mask=torch.ones_like(T["prompt_ids"], dtype=torch.bool),
        completion_ids=completion, completion_mask=torch.arange(completion.shape[1])[None] <= first[:, None],
        group_ids=torch.arange(S["rows"]) // S["group_size"], rewards=T["rewards"], advantages=T["advantages"],
        mask_seeds=torch.tensor([0]))


def model(who: str, grad: bool = False) -> ToyDenoiser:
    emb, ctx = T[f"{who}_emb"].clone(), T[f"{who}_ctx"].clone()
    return ToyDenoiser(emb.requires_grad_(grad), ctx.requires_grad_(grad))


def sequence_output(elbo: torch.Tensor, batch: RolloutBatch) -> EstimatorOutput:
    return EstimatorOutput(None, elbo, torch.ones_like(batch.completion_mask), {"elbo": elbo})


def objective() -> ESPO:
    return ESPO(epsilon=S["epsilon"], beta=S["beta"])


@pytest.mark.parametrize("k", range(GA))
def test_espo_objective_reproduces_the_released_loss_and_gradient(k):
    step = step_batch()
    batch = step.index(MICRO[k])
    elbo = T[f"per_draw_{k}"].mean(1).requires_grad_(True)  # [b] their MC mean, as compute_loss uses it
    old, ref = sequence_output(T[f"old_{k}"], batch), sequence_output(T[f"ref_{k}"], batch)
    out = objective()(batch, sequence_output(elbo, batch), old, ref, counts=AggregationCounts.from_batch(step))
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach().double(), T[f"loss_{k}"] / GA, atol=1e-6, rtol=1e-6)
    released = T[f"per_draw_grad_{k}"].sum(1) / GA  # d loss / d mean = Σ_m d loss / d draw_m
    torch.testing.assert_close(elbo.grad, released, atol=1e-7, rtol=1e-6)
    assert out.stats["clip_frac"] > 0 and released.abs().min() > 1e-4  # clipped and unclipped rows both present


@pytest.mark.parametrize("k", range(GA))
def test_coupled_elbo_with_their_masks_gives_their_per_draw_elbos(k):
    batch = step_batch().index(MICRO[k])
    with torch.no_grad():
        out = CoupledELBO(num_mc=S["num_mc"]).score(model("policy"), batch, T[f"masks_{k}"])
    # both sides accumulate float32 cross-entropies (theirs in a float32 buffer): |ELBO| ~ 20, ulp 2e-6
    torch.testing.assert_close(out.extras["per_draw"].double(), T[f"per_draw_{k}"], atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(out.seq_logp.double(), T[f"per_draw_{k}"].mean(1), atol=1e-5, rtol=1e-6)
    with torch.no_grad():
        old = CoupledELBO(num_mc=S["num_mc"]).score(model("old"), batch, T[f"masks_{k}"])
    torch.testing.assert_close(old.seq_logp.double(), T[f"old_{k}"], atol=1e-5, rtol=1e-6)


def test_one_released_step_end_to_end():
    """Estimator (their masks) + objective, summed over the two micro-batches: the released step's
    parameter gradient (grad_0 + grad_1) / 2."""
    step = step_batch()
    counts = AggregationCounts.from_batch(step)
    estimator = CoupledELBO(num_mc=S["num_mc"])
    policy = model("policy", grad=True)
    total = 0.0
    for k in range(GA):
        batch = step.index(MICRO[k])
        masks = T[f"masks_{k}"]
        with torch.no_grad():
            old = estimator.score(model("old"), batch, masks)
            ref = estimator.score(model("ref"), batch, masks)
        loss = objective()(batch, estimator.score(policy, batch, masks), old, ref, counts=counts).loss
        loss.backward()
        torch.testing.assert_close(loss.detach().double(), T[f"loss_{k}"] / GA, atol=1e-6, rtol=1e-6)
        total += loss.item()
    for name in ("emb", "ctx"):
        released = (T[f"grad_{name}_0"] + T[f"grad_{name}_1"]) / GA
        torch.testing.assert_close(getattr(policy, name).grad, released, atol=1e-6, rtol=1e-5)
        assert released.abs().max() > 1e-2
    assert total == pytest.approx(float(T["loss_0"] + T["loss_1"]) / GA, abs=1e-6)
