"""The PPO-clip machinery shared by the ratio-based objectives.

`TokenPPO` is the one token-level clipped objective behind diffu-GRPO (d1), UniGRPO,
coupled-GRPO, TraceRL, MaskGRPO and DACA-GRPO; those differ only in their estimator, defaults,
aggregation and KL target, which are fields and class attributes here:

    ρ_{b,i} = exp(log π_θ(x^i_b) - log π_old(x^i_b))                       (per scored token)
    ℓ_{b,i} = -min(ρA_b, clip(ρ, 1-ε, 1+ε_high)A_b)·w_{b,i} + β·k(π_target, π_θ)_{b,i}
    L       = aggregation(ℓ) over scored completion tokens of valid rows

w is 1, or the per-token Denoising Progress Score weights (DACA, `token_weights=True`); the KL
target is the reference model (d1 ...) or the behaviour policy (TraceRL).

`sequence_ppo_loss` is the sequence-level counterpart used by ESPO and DiPOD-FPO.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ddrl.objectives.aggregation import TOKEN_REDUCTIONS, AggregationCounts, sequence_mean
from ddrl.objectives.base import (
    Objective,
    clipped_surrogate,
    inject_ratio_noise,
    masked_stat,
    noise_seed,
    old_or_detached,
    require_ref,
    token_logps,
    token_loss_mask,
)
from ddrl.objectives.kl import KL_ESTIMATORS, kl
from ddrl.types import EstimatorOutput, LossOutput, RolloutBatch


@dataclass
class TokenPPO(Objective):
    """Token-level PPO-clip with conditional clipping and an optional per-token KL penalty."""

    epsilon: float = 0.5  # clip range ε: ratios are clipped to [1-ε, 1+ε_high]
    epsilon_high: float | None = None  # upper clip range ("clip-higher"); None = epsilon
    beta: float = 0.04  # KL penalty coefficient β (0 = no KL, no reference pass)
    kl_estimator: str = "k3"  # k1 | k2 | k3 (kl.py)
    aggregation: str = "token_mean"  # token_mean | sequence_token_mean | sequence_token_sum (aggregation.py)
    token_weights: bool = False  # multiply each token's surrogate by batch.extras["dps_weights"] (DACA)
    ratio_noise_std: float = 0.0  # stress test: std of Gaussian noise added to log ρ ("exploding weights")

    needs_old: ClassVar[bool] = True
    kl_against: ClassVar[str] = "ref"  # "ref": KL to the reference model; "old": to the behaviour policy
    kl_aggregation: ClassVar[str | None] = None  # None = same as `aggregation`
    estimator_needs_trajectory: ClassVar[bool] = False  # the default estimator reads batch.trajectory
    advantage_weighted: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.aggregation not in TOKEN_REDUCTIONS:
            raise ValueError(f"{self.name}: aggregation={self.aggregation!r}; valid: {', '.join(TOKEN_REDUCTIONS)}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"{self.name}: kl_estimator={self.kl_estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")

    @property
    def needs_ref(self) -> bool:  # type: ignore[override]
        return self.beta > 0 and self.kl_against == "ref"

    @property
    def needs_trajectory(self) -> bool:  # type: ignore[override]
        return self.estimator_needs_trajectory or self.token_weights  # DPS weights come from the trajectory

    def __call__(self, batch: RolloutBatch, new: EstimatorOutput, old: EstimatorOutput | None,
                 ref: EstimatorOutput | None, *, counts: AggregationCounts) -> LossOutput:
        mask = token_loss_mask(batch, new.mask)  # [B, L]
        logp = token_logps(new, "current")  # [B, L]
        old_logp = old_or_detached(old, logp, lambda o: token_logps(o, "old"))
        log_ratio = inject_ratio_noise(logp - old_logp, self.ratio_noise_std, noise_seed(batch))
        adv = batch.advantages.to(logp.dtype)[:, None]  # [B, 1]
        eps_high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        surrogate, clipped = clipped_surrogate(log_ratio, adv, self.epsilon, eps_high)  # [B, L]
        if self.token_weights:
            weights = batch.extras.get("dps_weights")
            if weights is not None:
                surrogate = surrogate * weights.to(surrogate.dtype)
        reduce = TOKEN_REDUCTIONS[self.aggregation]
        loss = reduce(surrogate, mask, counts)
        ratio = torch.exp(log_ratio.detach())
        stats = {"clip_frac": masked_stat(clipped.float(), mask), "ratio_mean": masked_stat(ratio, mask),
                 "ratio_max": masked_stat(ratio, mask, "max")}
        if self.beta > 0:
            target = old_logp if self.kl_against == "old" else token_logps(require_ref(ref, self.name), "ref").detach()
            per_token_kl = kl(logp, target, self.kl_estimator)  # [B, L]
            reduce_kl = TOKEN_REDUCTIONS[self.kl_aggregation or self.aggregation]
            loss = loss + self.beta * reduce_kl(per_token_kl, mask, counts)
            stats["kl"] = masked_stat(per_token_kl, mask)
        return LossOutput(loss, stats)


def sequence_ppo_loss(log_ratio: Tensor, adv: Tensor, valid: Tensor, eps_low: float, eps_high: float,
                      counts: AggregationCounts) -> tuple[Tensor, dict[str, Tensor]]:
    """Σ_b -min(ρ_b A_b, clip(ρ_b) A_b) / global sequence count, over valid rows. log_ratio, adv: [B]."""
    surrogate, clipped = clipped_surrogate(log_ratio, adv.to(log_ratio.dtype), eps_low, eps_high)
    ratio = torch.exp(log_ratio.detach())
    stats = {"clip_frac": masked_stat(clipped.float(), valid), "ratio_mean": masked_stat(ratio, valid),
             "ratio_max": masked_stat(ratio, valid, "max")}
    return sequence_mean(surrogate, counts, valid), stats
