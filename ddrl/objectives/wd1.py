"""wd1: ratio-free weighted policy optimisation.

Paper: Tang, Dolga, Yoon, Bogunovic, "wd1: Weighted Policy Optimization for Reasoning in Diffusion
Language Models", arXiv 2507.08838. Code: xiaohangt/wd1 @ 0898985, wd1/trainers/rev_grpo_trainer.py
(`RevDiffuGRPOTrainer.compute_loss`).

    ℓ_θ(x) = Σ_i m_i log p_θ(x^i | c̃)          (d1's mean-field log-probs summed over the completion)
    w⁺ = softmax(A) over the group,  w⁻ = softmax(-A) over the group,   A = r - mean_group(r)
    L  = -Σ_i w⁺_i ℓ_θ(x_i) + Σ_i w⁻_i ℓ_θ(x_i)     per group, averaged over the step's groups

No old or reference likelihoods, no ratio. The released code takes the softmax over the per-device
micro-batch, which with its shipped settings (per-device batch = num_generations) is exactly one
prompt group, and gradient accumulation then averages over micro-batches = groups. Here the softmax
is explicitly per group (micro-batches must hold whole groups) and the average uses the global
group count, so the split does not matter; with one group per micro-batch this is the released
loss exactly (tests/unit/test_golden_wd1.py). A released micro-batch holding several groups would
share one softmax across them; ddrl never does. Rows with an invalid reward are left out of the
softmax; the released code scores a None reward as 0 and keeps the row (`method.invalid_reward: zero`).

Precision: the loss is computed in the dtype of the log-probs (float32 at least). The released code
computes the weights in float32 (its advantages are float32), so in a float64 comparison the two
differ by that rounding, a few 1e-7 on a loss of order 1; with float64 advantages they agree to 1e-12.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ddrl.objectives.aggregation import AggregationCounts, group_mean, group_softmax, masked
from ddrl.objectives.base import Objective, masked_stat, token_loss_mask
from ddrl.registry import OBJECTIVES
from ddrl.types import EstimatorOutput, LossOutput, RolloutBatch


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 log-probs are summed in float32; float32 and float64 keep their precision."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def summed_logp(batch: RolloutBatch, out: EstimatorOutput) -> torch.Tensor:
    """[B] Σ of per-token log-probs over the scored completion tokens (seq_logp if no token values)."""
    if out.token_logp is None:
        if out.seq_logp is None:
            raise ValueError("wd1 needs token_logp or seq_logp from the estimator")
        return at_least_float32(out.seq_logp)
    return masked(at_least_float32(out.token_logp), token_loss_mask(batch, out.mask)).sum(1)


@OBJECTIVES.register("wd1")
@dataclass
class WD1(Objective):
    name: ClassVar[str] = "wd1"
    paper: ClassVar[str] = "wd1, Tang et al., arXiv 2507.08838"
    source: ClassVar[str] = "xiaohangt/wd1@0898985 wd1/trainers/rev_grpo_trainer.py RevDiffuGRPOTrainer.compute_loss"
    formula: ClassVar[str] = "-Σ softmax_G(A)·ℓ + Σ softmax_G(-A)·ℓ, ℓ = Σ_i log π(x^i); mean over groups"
    default_estimator: ClassVar[str] = "mean_field"
    default_advantage: ClassVar[str] = "mean"

    def __call__(self, batch: RolloutBatch, new: EstimatorOutput, old: EstimatorOutput | None,
                 ref: EstimatorOutput | None, *, counts: AggregationCounts) -> LossOutput:
        valid = batch.reward_valid
        ell = summed_logp(batch, new)  # [B]
        adv = batch.advantages.to(ell.dtype)
        w_pos = group_softmax(adv, batch.group_ids, valid)
        w_neg = group_softmax(-adv, batch.group_ids, valid)
        loss = group_mean((w_neg - w_pos) * ell, counts, valid)
        stats = {"weight_max": masked_stat(w_pos, valid, "max"), "seq_logp_mean": masked_stat(ell, valid)}
        return LossOutput(loss, stats)
