"""diffu-GRPO against d1's own trainer: two optimizer steps of DiffuGRPOTrainer.training_step.

The fixture (tests/fixtures/methods/make_d1.py) ran dllm-reasoning/d1 @ 837888f on its pinned TRL
and transformers 4.49.0, with only the model calls replaced by fixed log-probs. It records, per
micro-batch, the current/old/reference log-probs, the advantages d1 computed from rewards with
None in them, d1's compute_loss, the loss after the Trainer's gradient-accumulation scaling, its
gradient w.r.t. the current log-probs, and per optimizer step the gradient on the tiny model's one
parameter (summed over the step's micro-batches).

ddrl's GRPO with aggregation="micro_batch_token_mean" (d1's per-micro-batch token mean, averaged
over micro-batches) and invalid="zero" advantages must reproduce all of it to 1e-6 in float64; the
default aggregation (global token mean) must not, since the two micro-batches have 21 and 12 tokens.
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


TENSORS, META = load("d1")
S = META["settings"]
G, GA = S["num_generations"], S["gradient_accumulation_steps"]


def rollout(j: int, rewards: torch.Tensor | None = None) -> RolloutBatch:
    """Micro-batch j as ddrl sees it: one prompt group, d1's completion mask and advantages."""
    t = lambda name: TENSORS[f"mb{j}.{name}"]  # noqa: E731
    mask = t("completion_mask").bool()
    return RolloutBatch(
        prompt_ids=t("prompt_ids"), prompt_mask=torch.ones_like(t("prompt_ids"), dtype=torch.bool),
        completion_ids=t("completion_ids"), completion_mask=mask, group_ids=torch.full((G,), j),
        rewards=torch.zeros(G) if rewards is None else rewards,
        advantages=t("advantages").double(), mask_seeds=t("mask_seeds"))


def step_counts() -> AggregationCounts:
    """The step's counts over its GA micro-batches on one process, as the trainer builds them."""
    total = AggregationCounts.from_batch(rollout(0), micro_batches=1)
    for j in range(1, GA):
        total = total + AggregationCounts.from_batch(rollout(j), micro_batches=1)
    return total


def objective(aggregation: str):
    return OBJECTIVES.get("diffu_grpo")(epsilon=S["epsilon"], beta=S["beta"], aggregation=aggregation)


def loss_of(aggregation: str, j: int, k: int, logp: torch.Tensor) -> torch.Tensor:
    batch = rollout(j)
    mask = batch.completion_mask
    new = EstimatorOutput(token_logp=logp, seq_logp=None, mask=mask)
    old = EstimatorOutput(token_logp=TENSORS[f"mb{j}.old_logps"][k], seq_logp=None, mask=mask)
    ref = EstimatorOutput(token_logp=TENSORS[f"mb{j}.ref_logps"][k], seq_logp=None, mask=mask)
    return objective(aggregation)(batch, new, old, ref, counts=step_counts()).loss


def test_fixture_is_the_recorded_setting():
    assert META["commit"].startswith("837888f") and S["world_size"] == 1
    counts = step_counts()
    assert counts.micro_batches == GA and counts.tokens == 21 + 12
    # d1's compute_loss picks the mask-seed iteration as _step % num_iterations, counted per micro-batch
    assert [(o["step"], o["mb"], o["k"]) for o in META["order"]] == [(0, 0, 1), (0, 1, 2), (1, 0, 0), (1, 1, 1)]


@pytest.mark.parametrize("n", range(4))
def test_micro_batch_loss_and_gradient_match_d1(n):
    o = META["order"][n]
    key = f"step{o['step']}.mb{o['mb']}"
    logp = TENSORS[f"{key}.logp"].clone().requires_grad_(True)
    loss = loss_of("micro_batch_token_mean", o["mb"], o["k"], logp)
    # the Trainer divides compute_loss by the accumulation steps before backward
    torch.testing.assert_close(TENSORS[f"{key}.training_step_loss"], TENSORS[f"{key}.compute_loss"] / GA)
    # .double(): ddrl.objectives.base.token_logps casts log-probs to float32, so the loss is float32
    torch.testing.assert_close(loss.detach().double(), TENSORS[f"{key}.training_step_loss"], **TOL)
    loss.backward()
    torch.testing.assert_close(logp.grad, TENSORS[f"{key}.grad"], **TOL)


def current_logps(j: int, k: int, theta: torch.Tensor) -> torch.Tensor:
    """The fixture's tiny model: log_softmax(base + theta)[target] over the completion. [G, L]"""
    base = TENSORS["base_logits"][j, k]  # [G, L, V]
    targets = TENSORS[f"mb{j}.completion_ids"]
    return torch.log_softmax(base + theta, dim=-1).gather(-1, targets[..., None]).squeeze(-1)


@pytest.mark.parametrize("step", range(S["optimizer_steps"]))
def test_step_parameter_gradient_matches_d1(step):
    theta = TENSORS["theta"].clone().requires_grad_(True)
    for o in (o for o in META["order"] if o["step"] == step):
        logp = current_logps(o["mb"], o["k"], theta)
        torch.testing.assert_close(logp.detach(), TENSORS[f"step{step}.mb{o['mb']}.logp"], **TOL)
        loss_of("micro_batch_token_mean", o["mb"], o["k"], logp).backward()
    torch.testing.assert_close(theta.grad, TENSORS[f"step{step}.theta_grad"], **TOL)


def test_default_global_token_mean_differs_from_d1_by_the_normalisation():
    o = META["order"][0]
    logp = TENSORS[f"step{o['step']}.mb{o['mb']}.logp"]
    released = loss_of("micro_batch_token_mean", o["mb"], o["k"], logp)
    default = loss_of("token_mean", o["mb"], o["k"], logp)
    tokens = float(TENSORS[f"mb{o['mb']}.completion_mask"].sum())
    # d1: Σℓ / (n_mb · GA); ddrl's default: Σℓ / N_step
    torch.testing.assert_close(default / released, torch.tensor(tokens * GA / 33.0, dtype=default.dtype),
                               atol=1e-6, rtol=1e-6)
    assert abs(float(default - released)) > 1e-3


def composite_rewards(j: int) -> torch.Tensor:
    """ddrl's CompositeReward over the fixture's two reward functions (weights as in d1's run)."""
    raw = META["reward_raw"][j * G:(j + 1) * G]  # [G][2], None = not applicable
    parts = [(f"f{f}", (lambda f: lambda completions, **_: [row[f] for row in raw])(f), w)
             for f, w in enumerate(S["reward_weights"])]
    scores = CompositeReward(parts)([""] * G)
    return torch.tensor([float("nan") if s is None else s for s in scores], dtype=torch.float32)


@pytest.mark.parametrize("j", range(GA))
def test_advantages_with_none_rewards_match_d1(j):
    rewards = composite_rewards(j)
    assert j != 0 or torch.isnan(rewards[1])  # a row whose every reward function returned None
    group = torch.full((G,), j)
    torch.testing.assert_close(compute_advantages(rewards, group, "mean", invalid="zero"),
                               TENSORS[f"mb{j}.advantages"], **TOL)
    # the trainer's "zero" policy stores the reward as 0 first: same advantages, and the row stays in the loss
    zeroed = torch.nan_to_num(rewards, nan=0.0)
    torch.testing.assert_close(compute_advantages(zeroed, group, "mean"), TENSORS[f"mb{j}.advantages"], **TOL)
    assert bool(rollout(j, zeroed).reward_valid.all())


def test_dropping_none_rewards_differs_from_d1():
    dropped = compute_advantages(composite_rewards(0), torch.zeros(G), "mean")  # default invalid="drop"
    assert dropped[1] == 0 and not torch.allclose(dropped, TENSORS["mb0.advantages"], atol=1e-3)
