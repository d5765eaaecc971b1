"""MaskGRPO: token-level GRPO on masked-token log-probs at scheduled, truncated mask ratios.

Paper: Ma, Zhang, Wang, Ye, "Consolidating Reinforcement Learning for Multimodal Discrete Diffusion
Models", arXiv 2510.02880. Code: martian422/MaskGRPO (grpo/mask_grpo_trainer.py). See docs/methods.md.

    inner iteration k masks at ratio min(γ + (1-γ)(k+1)/μ, 0.999) (AR-like fading for text): `maskgrpo`
    ℓ_i = -min(ρ_i A, clip(ρ_i, 1±ε) A) + β·k3(π_ref, π_θ)_i   on the masked tokens only
    A = (r - mean_group r) / (sample std_group r + 1e-5);   ε = 0.2, β = 0.01 (configs/rl.yaml)

Default (the paper's form, split-invariant): each sample's loss is its mean over its own masked
tokens and samples are averaged with the global sequence count (aggregation "sequence_token_mean");
aggregation="token_mean" normalises by completion tokens instead.

The released form (golden test tests/unit/test_golden_maskgrpo.py): the released compute_loss
multiplies the per-token loss by the masks of ALL μ iterations ([μ, B, L]) and divides by their
sum, on one prompt group per call (one device micro-batch). With the estimator's form="released"
(extras["position_weights"] = how many iterations masked each position, post-EOS filler included)
and aggregation="group_weighted_token_mean" here:

    L = (1/#groups) Σ_g Σ_{b∈g,i} w_{b,i} ℓ_{b,i} / Σ_{b∈g,i} w_{b,i}

Rows with an invalid reward carry no loss in either form (the released code scores them with reward 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ddrl.objectives.aggregation import AggregationCounts, masked
from ddrl.objectives.base import (
    Objective,
    clipped_surrogate,
    masked_stat,
    old_or_detached,
    require_ref,
    token_logps,
)
from ddrl.objectives.kl import KL_ESTIMATORS, kl
from ddrl.objectives.ppo import TokenPPO
from ddrl.registry import OBJECTIVES
from ddrl.types import EstimatorOutput, LossOutput, RolloutBatch

GROUP_WEIGHTED = "group_weighted_token_mean"


def _logps(out: EstimatorOutput, who: str) -> Tensor:
    """Per-token log-probs: float64 kept (golden tests), else float32."""
    return token_logps(out, who)  # raises, naming the fix, when the estimator gave none; promote keeps float64


def group_weighted_token_mean(values: Tensor, weights: Tensor, group_ids: Tensor,
                              counts: AggregationCounts) -> Tensor:
    """Σ_g [Σ_{b∈g,i} w·values / Σ_{b∈g,i} w] / global number of groups. values, weights: [B, L]."""
    _, index = torch.unique(group_ids, return_inverse=True)  # [B] dense group index
    n = int(index.max()) + 1 if index.numel() else 0
    num = torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, index, (weights * values).sum(1))
    den = torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, index, weights.sum(1))
    return (num / den.clamp(min=torch.finfo(values.dtype).tiny)).sum() / max(counts.number_of_groups(), 1.0)


@OBJECTIVES.register("maskgrpo")
@dataclass
class MaskGRPO(TokenPPO):
    name: ClassVar[str] = "maskgrpo"
    paper: ClassVar[str] = "MaskGRPO, Ma et al., arXiv 2510.02880"
    source: ClassVar[str] = "martian422/MaskGRPO@b74ba3c grpo/mask_grpo_trainer.py MaskGRPOTrainer.compute_loss"
    formula: ClassVar[str] = "-min(ρA, clip(ρ,1±ε)A) + β·k3 over the estimator's masked tokens, per-sample mean"
    default_estimator: ClassVar[str] = "maskgrpo"
    default_advantage: ClassVar[str] = "zscore"
    default_advantage_eps: ClassVar[float] = 1e-5  # the released z-score's std + 1e-5 (trainer: pass as eps)

    epsilon: float = 0.2  # clip range ε (text; the image recipe uses 0.001)
    beta: float = 0.01  # k3 KL coefficient to the reference model
    # sequence_token_mean (default) | token_mean | ... (aggregation.py) | group_weighted_token_mean (released)
    aggregation: str = "sequence_token_mean"

    def __post_init__(self) -> None:
        if self.aggregation != GROUP_WEIGHTED:
            super().__post_init__()
            return
        Objective.__post_init__(self)
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"{self.name}: kl_estimator={self.kl_estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
        if self.token_weights:
            raise ValueError(f"{self.name}: aggregation={GROUP_WEIGHTED} takes its weights from the estimator "
                             f"(extras['position_weights']); set token_weights=False")

    def __call__(self, batch: RolloutBatch, new: EstimatorOutput, old: EstimatorOutput | None,
                 ref: EstimatorOutput | None, *, counts: AggregationCounts) -> LossOutput:
        if self.aggregation != GROUP_WEIGHTED:
            return super().__call__(batch, new, old, ref, counts=counts)
        # The released form scores post-EOS positions too, so the completion mask is not applied.
        mask = new.mask.bool() & batch.reward_valid[:, None]  # [B, L]
        logp = _logps(new, "current")
        weights = masked(new.extras.get("position_weights", mask.to(logp.dtype)).to(logp.dtype), mask)
        old_logp = old_or_detached(old, logp, lambda o: _logps(o, "old"))
        adv = batch.advantages.to(logp.dtype)[:, None]  # [B, 1]
        eps_high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        per_token, clipped = clipped_surrogate(logp - old_logp, adv, self.epsilon, eps_high)  # [B, L]
        stats = {"clip_frac": masked_stat(clipped.float(), mask),
                 "ratio_mean": masked_stat(torch.exp((logp - old_logp).detach()), mask)}
        if self.beta > 0:
            per_token_kl = kl(logp, _logps(require_ref(ref, self.name), "ref").detach(), self.kl_estimator)
            per_token = per_token + self.beta * per_token_kl
            stats["kl"] = masked_stat(per_token_kl, mask)
        loss = group_weighted_token_mean(masked(per_token, mask), weights, batch.group_ids, counts)
        return LossOutput(loss, stats)

