"""coupled-GRPO (objective + `coupled_three_pass` estimator) against DiffuCoder's own trainer code.

The fixture (tests/fixtures/methods/make_coupled_grpo.py) ran apple/ml-diffucoder @ f735e01
`DiffuGRPOTrainer` under transformers' `Trainer.training_step` for 4 micro-steps (2 prompt groups of 4,
2 accumulation steps, num_iterations 2 = 2 SGD steps) on a tiny float64 model with Dream-style shifted
logits, and recorded every mask and t its `forward_process` drew, the log-probs, each micro-step's loss
(already divided by the accumulation count) and the parameter gradient it added.

Here the same model is rebuilt from the recorded weights, ddrl's estimator gets the released masks
injected (`coupled_log_probs`), and `coupled_grpo` with aggregation="micro_batch_token_mean" must give
each micro-step's loss and gradient.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import ddrl.objectives  # noqa: F401  (registers the objectives)
from ddrl.estimators.coupled_three_pass import CoupledThreePass, coupled_log_probs
from ddrl.objectives import AggregationCounts
from ddrl.objectives.advantages import compute_advantages
from ddrl.registry import OBJECTIVES
from ddrl.types import RolloutBatch
from tests.fixtures.methods.method_common import load


TENSORS, META = load("coupled_grpo")
SET = META["settings"]
MICRO, GAS, MU = SET["per_device_batch"], SET["gradient_accumulation_steps"], SET["num_iterations"]
STEPS = GAS * MU
TOL = dict(atol=1e-6, rtol=1e-6)  # the released per-token log-probs are cast to float32


class TinyShiftedLM(nn.Module):
    """The fixture's model, read as ddrl reads a Dream-style model: logits realigned so that position p
    predicts token p (the released `get_logits` uses position p-1's logits for token p)."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.embed, self.mix, self.head = (nn.Parameter(weights[k].clone()) for k in ("embed", "mix", "head"))
        self.mask_token_id = SET["mask_token_id"]

    def forward(self, input_ids, attention_mask=None):
        e = self.embed[input_ids]  # [N, T, H]
        raw = torch.tanh(e + torch.einsum("pq,nqh->nph", self.mix, e)) @ self.head  # [N, T, V], p predicts p+1
        return SimpleNamespace(logits=torch.cat([raw[:, :1], raw[:, :-1]], dim=1))


def weights(prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in TENSORS.items() if k.startswith(prefix)}


def full_batch() -> RolloutBatch:
    n = TENSORS["completion_ids"].shape[0]
    group_ids = torch.arange(n) // SET["num_generations"]
    return RolloutBatch(
        prompt_ids=TENSORS["prompt_ids"], prompt_mask=torch.ones_like(TENSORS["prompt_ids"], dtype=torch.bool),
        completion_ids=TENSORS["completion_ids"], completion_mask=TENSORS["completion_mask"].bool(),
        group_ids=group_ids, rewards=TENSORS["rewards"], advantages=TENSORS["advantages"].double(),
        mask_seeds=TENSORS["mask_seeds"])


def micro_step(step: int):
    """(micro-batch, its rows, injected t [B, 1], S [B, L]) of one released micro-step."""
    mb = step % GAS
    rows = torch.arange(mb * MICRO, (mb + 1) * MICRO)
    batch = full_batch().index(rows)
    t = (1.0 / TENSORS[f"step{step}.t_weights"][0]).expand(MICRO, 1)
    return batch, rows, t, TENSORS[f"step{step}.S"].bool()


def test_fixture_exercises_the_clip_and_the_kl():
    clip = SET["clip_ratio_per_step"]
    assert clip[0] == clip[1] == 0 and min(clip[2:]) > 0  # ratio 1 on the first step, clipped tokens on the second
    assert TENSORS["losses"].abs().min() > 1e-3


def test_released_masks_are_one_seed_per_micro_batch_and_complementary():
    """The released loop: micro-batch j of inner iteration k uses seed index (j + 1 + k·GAS) mod μ, so with
    GAS = μ = 2 each micro-batch keeps one mask set for both inner iterations; the rollout pass tiles its
    random matrix over micro-batches, so the old/ref masks of a micro-batch's rows are the current ones."""
    seeds = TENSORS["mask_seeds"].tolist()
    for step in range(STEPS):
        assert int(TENSORS["seeds_used"][step]) == seeds[(step + 1) % MU]
        batch, rows, t, S = micro_step(step)
        index = (step + 1) % MU
        for kind in ("old", "ref"):
            assert torch.equal(TENSORS[f"{kind}{index}.S"][rows].bool(), S)
            torch.testing.assert_close(TENSORS[f"{kind}{index}.t_weights"], TENSORS[f"step{step}.t_weights"])
        w = TENSORS[f"step{step}.t_weights"]
        assert 0.2 <= 1 / w[0] <= 0.8 and abs(1 / w[0] + 1 / w[1] - 1) < 1e-12  # t ~ U(0.2, 0.8); 1/t, 1/(1-t)


@pytest.mark.parametrize("step", range(STEPS))
def test_estimator_with_injected_masks_gives_the_released_log_probs(step):
    batch, rows, t, S = micro_step(step)
    index = (step + 1) % MU
    real = batch.completion_mask
    policy = TinyShiftedLM(weights(f"params{step // GAS}."))
    with torch.no_grad():
        current = coupled_log_probs(policy, batch, t, S).token_logp
        old = coupled_log_probs(TinyShiftedLM(weights("params0.")), batch, t, S).token_logp
        ref = coupled_log_probs(TinyShiftedLM(weights("ref.")), batch, t, S).token_logp
    torch.testing.assert_close(current[real], TENSORS[f"step{step}.logp"][real].to(current.dtype), **TOL)
    torch.testing.assert_close(old[real], TENSORS["old_logp"][rows, index][real].to(old.dtype), **TOL)
    torch.testing.assert_close(ref[real], TENSORS["ref_logp"][rows, index][real].to(ref.dtype), **TOL)


@pytest.mark.parametrize("step", range(STEPS))
def test_objective_gives_each_released_micro_step_loss_and_gradient(step):
    batch, rows, t, S = micro_step(step)
    policy = TinyShiftedLM(weights(f"params{step // GAS}."))
    new = coupled_log_probs(policy, batch, t, S)
    with torch.no_grad():
        old = coupled_log_probs(TinyShiftedLM(weights("params0.")), batch, t, S)
        ref = coupled_log_probs(TinyShiftedLM(weights("ref.")), batch, t, S)
    counts = AggregationCounts.from_batch(full_batch(), micro_batches=GAS)
    objective = OBJECTIVES.get("coupled_grpo")(aggregation="micro_batch_token_mean")
    assert (objective.epsilon, objective.beta) == (SET["epsilon"], SET["beta"])  # ddrl's defaults = the recipe's
    out = objective(batch, new, old, ref, counts=counts)
    torch.testing.assert_close(out.loss.detach().double(), TENSORS["losses"][step].double(), **TOL)
    out.loss.backward()
    for name, p in policy.named_parameters():
        torch.testing.assert_close(p.grad, TENSORS[f"step{step}.grad.{name}"], **TOL)


def test_leave_one_out_advantages_match():
    batch = full_batch()
    adv = compute_advantages(batch.rewards, batch.group_ids, "loo")
    torch.testing.assert_close(adv.float(), TENSORS["advantages"], atol=1e-6, rtol=0)


def test_shared_t_draws_one_t_per_call_like_the_released_code():
    batch = full_batch()
    t, S, _ = CoupledThreePass(shared_t=True).draw(batch, seed=3)
    assert torch.all(t == t[0]) and 0.2 <= float(t[0]) <= 0.8
    t_rows, _, _ = CoupledThreePass().draw(batch, seed=3)
    assert t_rows.unique().numel() == t_rows.shape[0]
    # the same seed gives every micro-batch the same t (the released code re-seeds per call)
    t_half, _, _ = CoupledThreePass(shared_t=True).draw(batch.index(torch.arange(MICRO)), seed=3)
    assert float(t_half[0]) == float(t[0])
