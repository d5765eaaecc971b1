"""SEPO: Score Entropy Policy Optimization (policy gradient through the concrete score).

Paper: Zekri & Boullé, "Fine-Tuning Discrete Diffusion Models with Policy Gradient Methods",
arXiv 2502.01384, NeurIPS 2025. Code: ozekri/SEPO (GRPO_MDLM_DNA/diffusion_gosai_update_new.py
`_compute_loss_sepo`, grpo_train.py). ALGORITHMS.md §4.

    S(x)  = -Σ_y π̂(y) log s_θ(x)_y        ∇S(x) = ∇ log π_θ(x)  (SEPO identity; `concrete_score`)
    ρ(x)  = π_θ(x)/π_old(x) "via a neighbour": (π̂_θ(y)/π̂_old(y))·(s_old(x)_y/s_θ(x)_y), which for any
            neighbour y at position i equals p_θ(x^i|x^{-i}) / p_old(x^i|x^{-i}) (same probed positions)
    per sample, with S̄, log ρ̄ the means over the K probed positions (length-normalised, like ESPO):
        log ρ_b = sg(log ρ̄_b) + S̄_b - sg(S̄_b)          value ρ̄_b, gradient ρ̄_b·∇S̄_b
        ℓ_b     = -min(ρ_b A_b, clip(ρ_b, 1±ε) A_b)      ε = 0.2
    L = (1/B) Σ_b ℓ_b,   A = z-score over the group

Deviations (INFERRED, ALGORITHMS.md §4 caveat): the released loss takes min(L_unclip, L_clip) of two
BATCH-level scalars that already carry the negative-surrogate sign, which is not PPO's per-sample
pessimistic clip; here the clip is applied per sample, so one clipped sample does not switch the
whole batch's branch. The ratio and surrogate are means over the probed positions (not sums over
all L·d neighbours), so the ratio stays O(1) for long completions. The optional DRAKES trajectory
KL and entropy bonus (off by default in the code) are not implemented.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ddrl.objectives.aggregation import AggregationCounts, masked
from ddrl.objectives.base import Objective, masked_stat, old_or_detached, token_logps, token_loss_mask
from ddrl.objectives.ppo import sequence_ppo_loss
from ddrl.registry import OBJECTIVES
from ddrl.types import EstimatorOutput, LossOutput, RolloutBatch


@OBJECTIVES.register("sepo")
@dataclass
class SEPO(Objective):
    name: ClassVar[str] = "sepo"
    paper: ClassVar[str] = "SEPO, Zekri & Boullé, arXiv 2502.01384"
    formula: ClassVar[str] = "-min(ρA, clip(ρ,1±ε)A) per sample, ∇ via S = -Σ_y π̂(y) log s(x)_y; ρ via neighbours"
    default_estimator: ClassVar[str] = "concrete_score"
    default_advantage: ClassVar[str] = "zscore"
    needs_old: ClassVar[bool] = True
    advantage_weighted: ClassVar[bool] = True

    epsilon: float = 0.2  # clip range ε, applied per sample

    def __call__(self, batch: RolloutBatch, new: EstimatorOutput, old: EstimatorOutput | None,
                 ref: EstimatorOutput | None, *, counts: AggregationCounts) -> LossOutput:
        if "score_surrogate" not in new.extras:
            raise ValueError("sepo needs extras['score_surrogate'] from the `concrete_score` estimator")
        mask = token_loss_mask(batch, new.mask)  # [B, L] probed positions
        probes = mask.sum(1).clamp(min=1)
        surrogate = masked(new.extras["score_surrogate"].float(), mask).sum(1) / probes  # [B] S̄, with grad
        logp = token_logps(new, "current")
        old_logp = old_or_detached(old, logp, lambda o: token_logps(o, "old"))
        log_ratio = masked(logp - old_logp, mask).sum(1).detach() / probes  # [B] log ρ̄
        log_ratio = log_ratio + surrogate - surrogate.detach()
        loss, stats = sequence_ppo_loss(log_ratio, batch.advantages, batch.reward_valid,
                                        self.epsilon, self.epsilon, counts)
        stats["surrogate_mean"] = masked_stat(surrogate, batch.reward_valid)
        return LossOutput(loss, stats)
