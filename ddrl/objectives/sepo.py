"""SEPO: Score Entropy Policy Optimization (policy gradient through the concrete score).

Paper: Zekri & Boullé, "Fine-Tuning Discrete Diffusion Models with Policy Gradient Methods",
arXiv 2502.01384, NeurIPS 2025. Code: ozekri/SEPO @ 4a4a40f, GRPO_MDLM_DNA/diffusion_gosai_update_new.py
`Diffusion._compute_loss_sepo`, driven by GRPO_MDLM_DNA/grpo_train.py `fine_tune`.

Identity (estimator `concrete_score`): with S(x) = -Σ_y π̂(y) log s_θ(x)_y, ∇S(x) = ∇ log π_θ(x), and the
ratio π_θ(x)/π_old(x) can be read through any neighbour y:
    r_y = (π̂_θ(y)/π̂_old(y)) · (s_old(x)_y / s_θ(x)_y)          (no gradient)
For ddrl's exact single-site scores r_y is the same for every neighbour of position i: it is
p_θ(x^i|x^{-i}) / p_old(x^i|x^{-i}).

clip="sample" (ddrl's default): PPO's per-sample pessimistic clip on a length-normalised ratio.
    S̄_b, log ρ̄_b = means over the probed positions of S_i and of log p_θ(x^i|.) - log p_old(x^i|.)
    log ρ_b = sg(log ρ̄_b) + S̄_b - sg(S̄_b)                 value ρ̄_b, gradient ρ̄_b·∇S̄_b
    L = (1/B) Σ_b -min(ρ_b A_b, clip(ρ_b, 1±ε) A_b)

clip="released": the released loss, per neighbour and per rollout batch.
    U_k = Σ_{b∈k} A_b Σ_{i,y} π̂_θ(y) r_y log s_θ(x_b)_y,   C_k = the same with clip(r_y, 1±ε) per neighbour
    L   = Σ_k min(U_k, C_k) / (number of rows)
  k is a rollout batch of the released loop: it draws G batches of B samples and z-scores each sample
  index over the G batches, so a "group" there is one index across batches and batch k holds the k-th
  member of every group. Here k = a row's rank inside its prompt group. The min is of two batch-level
  sums (not PPO's per-sample pessimistic clip), and min(U, C) of losses is the optimistic branch.
  Sums over the probed positions are scaled by completion length / probes, an estimate of the
  released sum over all L positions (exact when every position is probed). Needs the estimator's
  neighbour extras (`concrete_score` with neighbour_extras=True) for the current and old policy.
  With every group of the step in one micro-batch this is the released loss exactly (the min does not
  split over micro-batches); tests/unit/test_golden_sepo.py checks it against the released code.

Kept documented rather than changed: the gradient goes through the single-site (pseudo-likelihood)
conditionals log p(x^i|x^{-i}) summed over probed positions, not through log π(x) of the sampler; the
optional DRAKES trajectory KL and entropy bonus (off by default in the released code) are not implemented.
Advantages: the released z-score uses torch's sample std + 1e-8 over the G batches (docs/methods.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ddrl.estimators.concrete_score import score_surrogate
from ddrl.objectives.aggregation import AggregationCounts, masked
from ddrl.objectives.base import Objective, masked_stat, old_or_detached, token_logps, token_loss_mask
from ddrl.objectives.ppo import sequence_ppo_loss
from ddrl.registry import OBJECTIVES
from ddrl.types import EstimatorOutput, LossOutput, RolloutBatch

SEPO_CLIPS = ("sample", "released")
NEIGHBOUR_EXTRAS = ("log_scores", "neighbour_weights", "probe_valid")


def rank_in_group(group_ids: Tensor) -> Tensor:
    """[B] long: how many earlier rows share the row's group id (0 for the first member)."""
    same = group_ids[:, None] == group_ids[None, :]  # [B, B]
    earlier = torch.ones_like(same).tril(-1)  # column < row
    return (same & earlier).sum(1)


def released_surrogates(new: dict[str, Tensor], old: dict[str, Tensor], epsilon: float) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row Σ_{i,y} π̂_θ(y)·r_y·log s_θ(x)_y, unclipped and with r_y clipped per neighbour: [B], [B]; and the
    per-neighbour ratios [B, K, V] (1 where the weight is 0). Extras: log_scores [B, K, V] (with grad),
    neighbour_weights [B, K, V], probe_valid [B, K]."""
    log_s, weights = new["log_scores"], new["neighbour_weights"].detach().to(new["log_scores"].dtype)
    old_log_s, old_weights = old["log_scores"].detach(), old["neighbour_weights"].detach().to(weights.dtype)
    keep = new["probe_valid"].bool()[..., None] & (weights > 0)  # [B, K, V]
    ratio = (weights / old_weights) * (old_log_s.exp() / log_s.detach().exp())  # [B, K, V] r_y, no gradient
    ratio = torch.where(keep, ratio, torch.ones_like(ratio))
    zero = torch.zeros((), dtype=weights.dtype, device=weights.device)
    unclipped = torch.where(keep, weights * ratio, zero)
    clipped = torch.where(keep, weights * ratio.clamp(1 - epsilon, 1 + epsilon), zero)
    # score_surrogate(log s, w) = -Σ_v w log s (skipping w = 0): the sums here carry the opposite sign.
    return -score_surrogate(log_s, unclipped).sum(1), -score_surrogate(log_s, clipped).sum(1), ratio


@OBJECTIVES.register("sepo")
@dataclass
class SEPO(Objective):
    name: ClassVar[str] = "sepo"
    paper: ClassVar[str] = "SEPO, Zekri & Boullé, arXiv 2502.01384"
    source: ClassVar[str] = (
        "ozekri/SEPO@4a4a40f GRPO_MDLM_DNA/diffusion_gosai_update_new.py Diffusion._compute_loss_sepo")
    formula: ClassVar[str] = "-min(ρA, clip(ρ,1±ε)A) per sample, ∇ via S = -Σ_y π̂(y) log s(x)_y; ρ via neighbours"
    default_estimator: ClassVar[str] = "concrete_score"
    default_advantage: ClassVar[str] = "zscore"
    # The released z-score adds 1e-8 to torch's sample std (grpo_train.py).
    default_advantage_eps: ClassVar[float] = 1e-8
    needs_old: ClassVar[bool] = True
    advantage_weighted: ClassVar[bool] = True

    epsilon: float = 0.2  # clip range ε
    clip: str = "sample"  # sample: per-sample pessimistic clip (ddrl) | released: per-neighbour clip, batch-level min

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.clip not in SEPO_CLIPS:
            raise ValueError(f"sepo: clip={self.clip!r}; valid: {', '.join(SEPO_CLIPS)}")

    def __call__(self, batch: RolloutBatch, new: EstimatorOutput, old: EstimatorOutput | None,
                 ref: EstimatorOutput | None, *, counts: AggregationCounts) -> LossOutput:
        if self.clip == "released":
            return self.released_loss(batch, new, old, counts)
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

    def released_loss(self, batch: RolloutBatch, new: EstimatorOutput, old: EstimatorOutput | None,
                      counts: AggregationCounts) -> LossOutput:
        missing = [k for k in NEIGHBOUR_EXTRAS if k not in new.extras or (old is not None and k not in old.extras)]
        if missing:
            raise ValueError(f"sepo clip='released' needs the estimator's per-neighbour extras {missing}: set "
                             f"method.estimator_args.neighbour_extras: true (concrete_score)")
        old_extras = new.detach().extras if old is None else old.extras
        unclipped, clipped, ratio = released_surrogates(new.extras, old_extras, self.epsilon)  # [B], [B]
        valid = batch.reward_valid
        probed = new.extras["probe_valid"].bool()  # [B, K]
        scale = batch.completion_mask.sum(1).to(unclipped.dtype) / probed.sum(1).clamp(min=1)  # [B] len / K
        adv = batch.advantages.to(unclipped.dtype)
        zero = torch.zeros((), dtype=unclipped.dtype, device=unclipped.device)
        row_u = torch.where(valid, adv * unclipped * scale, zero)  # [B]
        row_c = torch.where(valid, adv * clipped * scale, zero)
        rank = rank_in_group(batch.group_ids)  # [B] rollout-batch index of each row
        n = int(rank.max()) + 1 if rank.numel() else 0
        per_batch_u = torch.zeros(n, dtype=row_u.dtype, device=row_u.device).index_add(0, rank, row_u)  # [n]
        per_batch_c = torch.zeros(n, dtype=row_c.dtype, device=row_c.device).index_add(0, rank, row_c)
        loss = torch.minimum(per_batch_u, per_batch_c).sum() / max(float(counts.sequences), 1.0)
        keep = (probed & valid[:, None])[..., None] & (new.extras["neighbour_weights"] > 0)
        outside = (ratio < 1 - self.epsilon) | (ratio > 1 + self.epsilon)
        stats = {"clip_frac": masked_stat(outside.float(), keep), "ratio_mean": masked_stat(ratio, keep),
                 "ratio_max": masked_stat(ratio, keep, "max"),
                 "clipped_batches": (per_batch_c < per_batch_u).float().mean().detach() if n else zero.detach()}
        return LossOutput(loss, stats)
