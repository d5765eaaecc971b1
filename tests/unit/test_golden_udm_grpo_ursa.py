"""UDM-GRPO exactly as released, on URSA: one whole optimizer step of the authors' trainer on the
tiny URSA pipeline, its real transformer included (tests/fixtures/methods/make_udm_grpo_ursa.py).

Their step: a 10-step rollout, start ~ U{0, 1, 2}, the final x1 re-noised by the metric path at the
grid's steps start .. start + 2, per-image mean log p(x1 | state, text) from the transformer, population-std
advantages clipped, -A * exp(lp - sg(lp)) + 0.05 k3 against the frozen reference, one micro-batch per
state, accelerate dividing by 3. ddrl's `udm` estimator (states=grid, the default on a metric-path
model) and udm_grpo objective on ddrl's own URSA must give the same loss and parameter gradients to
1e-6 in float64, with the start and the re-noising draws of their run injected (an RNG stream cannot
be matched) and the reference a frozen copy, as ddrl's trainer makes it.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import ddrl
from ddrl.estimators.udm import UDM
from ddrl.objectives import AggregationCounts, compute_advantages
from ddrl.processes.metric_path import MetricPathProcess
from ddrl.registry import OBJECTIVES
from ddrl.types import RolloutBatch
from tests.fixtures.methods.method_common import load

URSA = Path(__file__).resolve().parents[1] / "fixtures" / "ursa" / "model"
TOL = {"atol": 1e-6, "rtol": 1e-6}
TENSORS, META = load("udm_grpo_ursa")
S = META["settings"]


def perturb(backbone: torch.nn.Module) -> None:
    """The policy's move away from the reference, as the fixture made it (p += c sin(0.7 k + j))."""
    names = [n for n, _ in backbone.named_parameters()]
    assert names == S["parameter_order"], "ddrl's URSA parameters are theirs, in their order"
    with torch.no_grad():
        for j, (_, p) in enumerate(backbone.named_parameters()):
            k = torch.arange(p.numel(), dtype=torch.float64).view(p.shape)
            p.add_(S["perturb"] * torch.sin(0.7 * k + j).to(p.dtype))


@pytest.fixture(scope="module")
def models():
    policy = ddrl.load_model(URSA, dtype="float32").double()
    policy.max_prompt_length = S["max_prompt_length"]
    reference = copy.deepcopy(policy).eval()  # ddrl's trainer: a frozen copy of the initial policy
    for p in reference.parameters():
        p.requires_grad_(False)
    perturb(policy.model)
    return policy.train(), reference


def rollout_batch(policy) -> RolloutBatch:
    P, G = S["num_prompts"], S["images_per_prompt"]
    texts = [S["prompts"][i % P] for i in range(P * G)]  # their prompt list is prompts * G
    prompt_ids, prompt_mask = policy.encode_prompts(texts)
    assert torch.equal(prompt_ids[:, :-1], TENSORS["txt_ids"]), "ddrl's URSA prompt is their tokenizer call's"
    x1 = TENSORS["x1"] + policy.image_token_range[0]
    rewards = TENSORS["rewards"]
    adv = compute_advantages(rewards, TENSORS["group_ids"], "zscore", std="population", clip=S["advantage_clipping"])
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask.bool(), completion_ids=x1,
                        completion_mask=torch.ones_like(x1, dtype=torch.bool), group_ids=TENSORS["group_ids"],
                        rewards=rewards, advantages=adv, mask_seeds=torch.tensor([0]))


@pytest.fixture
def injected(monkeypatch):
    """Their start and their add_noise draws in place of ddrl's (checked against the times ddrl asks for)."""
    asked = []

    def their_start(self, seed):
        return S["start"]

    def their_states(self, x0, t, *, generator, eligible=None):
        n_t = TENSORS["states"].shape[0]
        B = x0.shape[0] // n_t
        asked.append(t.view(n_t, B)[:, 0].double())
        return TENSORS["states"].reshape(n_t * B, -1).to(x0) + self.offset, eligible

    monkeypatch.setattr(UDM, "grid_start_index", their_start)
    monkeypatch.setattr(MetricPathProcess, "noise", their_states)
    return asked


def test_advantages_match_theirs(models):
    batch = rollout_batch(models[0])
    torch.testing.assert_close(batch.advantages.double(), TENSORS["advantages"], atol=1e-7, rtol=0)  # theirs: float32
    assert (batch.advantages.abs() == S["advantage_clipping"]).any(), "the fixture should exercise the clamp"


def test_grid_states_are_their_consecutive_steps(models):
    estimator = UDM()
    assert estimator.resolved_states(models[0].process) == "grid"
    start = S["start"]
    times = estimator.grid_times(models[0].process)[start:start + S["train_steps"]]
    torch.testing.assert_close(1 - times, TENSORS["flow_times"], atol=1e-12, rtol=0)  # their t: flow time
    starts = {estimator.grid_start_index(seed) for seed in range(64)}
    assert starts == set(range(*S["train_start"])), "start ~ U{0, 1, 2} (train_start [0, 3))"


def test_step_loss_and_gradients_match_the_released_trainer(models, injected):
    policy, reference = models
    batch = rollout_batch(policy)
    estimator = UDM()
    objective = OBJECTIVES.get("udm_grpo")(beta=S["kl_beta"])
    policy.zero_grad(set_to_none=True)
    new = estimator(policy, batch, seed=0)
    with torch.no_grad():
        ref = estimator(reference, batch, seed=0)
    out = objective(batch, new, None, ref, counts=AggregationCounts.from_batch(batch))
    out.loss.backward()
    for asked in injected:  # ddrl re-noised at their times (ddrl time t = 1 - their flow time)
        torch.testing.assert_close(1 - asked, TENSORS["flow_times"], atol=1e-6, rtol=0)
    # accelerate divides each state's micro-batch loss by the accumulation count (3): the step is their mean
    torch.testing.assert_close(out.loss.detach().double(), TENSORS["micro_batch_losses"].mean(), **TOL)
    grads = {n: p.grad for n, p in policy.model.named_parameters()}
    for name in S["recorded_grads"]:
        torch.testing.assert_close(grads[name], TENSORS[f"grad/{name}"], **TOL)
    total = sum(float(g.square().sum()) for g in grads.values())
    torch.testing.assert_close(torch.tensor(total, dtype=torch.float64), TENSORS["grad_total_sq_norm"], **TOL)
