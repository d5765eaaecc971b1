"""wd1 against its authors' trainer: two optimizer steps of RevDiffuGRPOTrainer.training_step.

The fixture (tests/fixtures/methods/make_wd1.py) ran xiaohangt/wd1 @ 0898985 on TRL 0f88c17 and
transformers 4.49.0 with only the model calls replaced by fixed log-probs: two micro-batches of one
prompt group each (21 and 12 completion tokens), rewards with None in them, gradient accumulation 2.
It records each micro-batch's loss after the Trainer's accumulation scaling, its gradient w.r.t. the
current log-probs, the gradient of each step on the tiny model's parameter, and the same losses
recomputed by their compute_loss with float64 advantages.

ddrl's WD1 (per-group softmax, mean over the step's groups) must reproduce the released losses and
gradients to 1e-6 in float64. The released weights are float32 (a few 1e-7 of rounding); against
their float64-advantage losses ddrl agrees to 1e-12.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ddrl.objectives import AggregationCounts, compute_advantages
from ddrl.registry import OBJECTIVES
from ddrl.rewards.composite import CompositeReward
from ddrl.types import EstimatorOutput, RolloutBatch
from tests.fixtures.methods.method_common import load

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "methods"
TOL = {"atol": 1e-6, "rtol": 1e-6}
TIGHT = {"atol": 1e-12, "rtol": 1e-12}


TENSORS, META = load("wd1")
S = META["settings"]
G, GA = S["num_generations"], S["gradient_accumulation_steps"]


def rollout(j: int, advantages: torch.Tensor | None = None) -> RolloutBatch:
    """Micro-batch j as ddrl sees it: one prompt group, wd1's completion mask and advantages."""
    t = lambda name: TENSORS[f"mb{j}.{name}"]  # noqa: E731
    return RolloutBatch(
        prompt_ids=t("prompt_ids"), prompt_mask=torch.ones_like(t("prompt_ids"), dtype=torch.bool),
        completion_ids=t("completion_ids"), completion_mask=t("completion_mask").bool(),
        group_ids=torch.full((G,), j), rewards=torch.zeros(G),
        advantages=t("advantages") if advantages is None else advantages, mask_seeds=t("mask_seeds"))


def step_counts() -> AggregationCounts:
    total = AggregationCounts.from_batch(rollout(0))
    for j in range(1, GA):
        total = total + AggregationCounts.from_batch(rollout(j))
    return total


def loss_of(j: int, logp: torch.Tensor, advantages: torch.Tensor | None = None) -> torch.Tensor:
    batch = rollout(j, advantages)
    new = EstimatorOutput(token_logp=logp, seq_logp=None, mask=batch.completion_mask)
    return OBJECTIVES.get("wd1")()(batch, new, None, None, counts=step_counts()).loss


def test_fixture_is_the_recorded_setting():
    assert META["commit"].startswith("0898985") and S["trainer_type"] == "wll_d1_neg"
    assert step_counts().groups == GA  # one group per micro-batch, as in wd1's train.yaml
    assert TENSORS["mb0.advantages"].dtype == torch.float32


@pytest.mark.parametrize("n", range(4))
def test_micro_batch_loss_and_gradient_match_wd1(n):
    key = "step{step}.mb{mb}".format(**META["order"][n])
    j = META["order"][n]["mb"]
    torch.testing.assert_close(TENSORS[f"{key}.training_step_loss"], TENSORS[f"{key}.compute_loss"] / GA)
    logp = TENSORS[f"{key}.logp"].clone().requires_grad_(True)
    loss = loss_of(j, logp)
    loss.backward()
    assert loss.dtype == torch.float64  # float64 log-probs are not cut to float32
    torch.testing.assert_close(loss.detach(), TENSORS[f"{key}.training_step_loss"], **TOL)
    torch.testing.assert_close(logp.grad, TENSORS[f"{key}.grad"], **TOL)


@pytest.mark.parametrize("n", range(4))
def test_residual_is_the_released_float32_weights(n):
    key = "step{step}.mb{mb}".format(**META["order"][n])
    j = META["order"][n]["mb"]
    logp = TENSORS[f"{key}.logp"].clone().requires_grad_(True)
    loss = loss_of(j, logp, TENSORS[f"mb{j}.advantages"].double())
    loss.backward()
    torch.testing.assert_close(loss.detach(), TENSORS[f"{key}.adv64_loss"], **TIGHT)
    torch.testing.assert_close(logp.grad, TENSORS[f"{key}.adv64_grad"], **TIGHT)


def current_logps(j: int, k: int, theta: torch.Tensor) -> torch.Tensor:
    """The fixture's tiny model: log_softmax(base + theta)[target] over the completion. [G, L]"""
    base = TENSORS["base_logits"][j, k]  # [G, L, V]
    targets = TENSORS[f"mb{j}.completion_ids"]
    return torch.log_softmax(base + theta, dim=-1).gather(-1, targets[..., None]).squeeze(-1)


@pytest.mark.parametrize("step", range(S["optimizer_steps"]))
def test_step_parameter_gradient_matches_wd1(step):
    theta = TENSORS["theta"].clone().requires_grad_(True)
    for o in (o for o in META["order"] if o["step"] == step):
        logp = current_logps(o["mb"], o["k"], theta)
        torch.testing.assert_close(logp.detach(), TENSORS[f"step{step}.mb{o['mb']}.logp"], **TOL)
        loss_of(o["mb"], logp).backward()
    torch.testing.assert_close(theta.grad, TENSORS[f"step{step}.theta_grad"], **TOL)


@pytest.mark.parametrize("j", range(GA))
def test_advantages_with_none_rewards_match_wd1(j):
    raw = META["reward_raw"][j * G:(j + 1) * G]  # [G][2], None = not applicable
    parts = [(f"f{f}", (lambda f: lambda completions, **_: [row[f] for row in raw])(f), w)
             for f, w in enumerate(S["reward_weights"])]
    scores = CompositeReward(parts)([""] * G)
    rewards = torch.tensor([float("nan") if s is None else s for s in scores], dtype=torch.float32)
    torch.testing.assert_close(compute_advantages(rewards, torch.full((G,), j), "mean", invalid="zero"),
                               TENSORS[f"mb{j}.advantages"], **TOL)
