"""StableDRL: unconditional clipping and group self-normalisation of noisy sequence ratios.

Paper: Zhong, Wang, Ding, Feng, Bai, Xiang, Sun, Xu, "Stabilizing Reinforcement Learning for
Diffusion Language Models", arXiv 2603.06743. Code: JianyuanZhong/StableDRL @ 26ad014
(networks/llada_svpo.py `compute_loss_spg` with use_snis, built on SPG).

    log ρ_i = sg(ELBO_θ(x_i) - ELBO_old(x_i))          sequence level; FRESH mask seeds for old and θ
    log ρ̃_i = min(log ρ_i, log C)                      UNCONDITIONAL clip, whatever the sign of A (C = 5)
    w_i     = softmax_group(log ρ̃)_i = min(ρ_i, C) / Σ_{j∈group} min(ρ_j, C)    (detached)
    L       = -Σ_i w_i A_i ℓ^SPG_θ(x_i)   per group,   A = r - mean_group(r)

The gradient -Σ w_i A_i ∇ℓ_i is a convex combination of per-sample gradients: an outlier ratio can
no longer multiply the step (ρ = 100 with A < 0 weighs at most C/Σ min(ρ_j, C)), unlike GRPO's
conditional clip. ℓ^SPG is SPG's sandwiched bound (spg.spg_proxy); the ELBO in ρ is the
per-token mean over masked tokens of the `spg` estimator (full attention) or of `staircase`
(block models), as in the released code, never a 1/t-weighted sum (whose fresh-mask noise of tens
of nats would zero half of each group's weights).

Golden test (tests/unit/test_golden_stable_drl.py): `compute_loss_spg` run on fixed logits, with
ELBO_old from the same file's `_get_per_seq_logps_spg` (as its rollout computes `ref_elbo`) and
both draws' masks injected; loss and gradient match.

Normalisation: the released code sums over one prompt group per device and averages over devices /
accumulation steps; here the per-group sums are divided by the step's global number of groups, the
same value when each micro-batch holds one group, and independent of the split otherwise
(micro-batches must hold whole groups, since the softmax is over the group). Rows with an invalid
reward are left out of the softmax. `ratio_noise_std` adds N(0, std²) to log ρ before the clip
("exploding weight" stress test).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ddrl.objectives.aggregation import AggregationCounts, group_mean, group_softmax
from ddrl.objectives.base import Objective, inject_ratio_noise, masked_stat, noise_seed, old_or_detached, sequence_proxy
from ddrl.objectives.spg import check_bounds_estimator, check_variant, spg_proxy
from ddrl.registry import OBJECTIVES
from ddrl.types import EstimatorOutput, LossOutput, RolloutBatch


@OBJECTIVES.register("stable_drl")
@dataclass
class StableDRL(Objective):
    name: ClassVar[str] = "stable_drl"
    paper: ClassVar[str] = "StableDRL, Zhong et al., arXiv 2603.06743"
    source: ClassVar[str] = "JianyuanZhong/StableDRL@26ad014 networks/llada_svpo.py compute_loss_spg"
    formula: ClassVar[str] = "-Σ_group softmax(min(sg log ρ, log C))·A·ℓ^SPG, mean over groups; fresh masks"
    default_estimator: ClassVar[str] = "spg"
    default_advantage: ClassVar[str] = "mean"
    needs_old: ClassVar[bool] = True
    fresh_masks: ClassVar[bool] = True
    advantage_weighted: ClassVar[bool] = True

    clip_ratio: float = 5.0  # C: importance weights are clipped to min(ρ, C) before self-normalisation
    omega: float = 0.5  # EUBO weight ω in SPG's negative-advantage mixture
    variant: str = "mix"  # SPG bound: mix | elbo | eubo
    ratio_noise_std: float = 0.0  # stress test: std of Gaussian noise added to log ρ before the clip

    def __post_init__(self) -> None:
        super().__post_init__()
        check_variant(self.variant)

    def check_estimator(self, estimator) -> None:
        """Raise, naming the fix, when `estimator` cannot give what this variant reads."""
        check_bounds_estimator(self.name, self.variant, estimator)

    def __call__(self, batch: RolloutBatch, new: EstimatorOutput, old: EstimatorOutput | None,
                 ref: EstimatorOutput | None, *, counts: AggregationCounts) -> LossOutput:
        valid = batch.reward_valid
        adv = batch.advantages.float()
        elbo = sequence_proxy(new, "elbo").detach()  # [B]
        old_elbo = old_or_detached(old, elbo, lambda o: sequence_proxy(o, "elbo"))
        log_ratio = inject_ratio_noise(elbo - old_elbo, self.ratio_noise_std, noise_seed(batch))
        log_c = math.log(self.clip_ratio)
        weights = group_softmax(log_ratio.clamp(max=log_c), batch.group_ids, valid)  # [B], Σ_group = 1
        ell = spg_proxy(new, adv, self.omega, self.variant)  # [B], carries the gradient
        loss = group_mean(-weights * adv * ell, counts, valid)
        ratio = torch.exp(log_ratio)
        stats = {"weight_max": masked_stat(weights, valid, "max"), "ratio_mean": masked_stat(ratio, valid),
                 "ratio_max": masked_stat(ratio, valid, "max"),
                 "clip_frac": masked_stat((log_ratio > log_c).float(), valid)}
        return LossOutput(loss, stats)
