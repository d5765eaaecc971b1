"""SPG: Sandwiched Policy Gradient (ELBO for positive, EUBO mix for negative advantages).

Paper: Wang, Rashidinejad, ..., Tian, Liu, "SPG: Sandwiched Policy Gradient for Masked Diffusion
Language Models", arXiv 2510.09541. Code: facebookresearch/SPG (copied in GDSD and StableDRL). §10.2.

    ℓ^SPG(x) = ELBO(x)                        if A > 0
             = ω·EUBO(x) + (1-ω)·ELBO(x)      if A <= 0
    (variant "mix": ω = 0.5; "eubo": ω = 1; "elbo": the ELBO for every sample)
    L = Σ_i (-A_i ℓ^SPG_θ(x_i))·len_i / Σ_i len_i,   A = r - mean_group(r)

No ratio, no clipping, no KL. ELBO and EUBO come from the `spg` estimator (extras "elbo", "eubo";
block_random masking, num_t = 2, β_EUBO = 1.5). Σ len is the step's global completion-token count.
`spg_proxy` is shared with StableDRL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ddrl.objectives.aggregation import AggregationCounts, length_weighted_mean
from ddrl.objectives.base import Objective, masked_stat, sequence_proxy
from ddrl.registry import OBJECTIVES
from ddrl.types import EstimatorOutput, LossOutput, RolloutBatch

SPG_VARIANTS = ("mix", "elbo", "eubo")


def spg_proxy(out: EstimatorOutput, adv: Tensor, omega: float, variant: str) -> Tensor:
    """[B] ℓ^SPG: the ELBO where A > 0, else the EUBO/ELBO mixture of the variant."""
    elbo = sequence_proxy(out, "elbo")
    weight = {"mix": omega, "eubo": 1.0, "elbo": 0.0}[variant]
    if weight == 0.0:
        return elbo
    eubo = out.extras.get("eubo")
    if eubo is None:
        raise ValueError(f"SPG variant {variant!r} needs extras['eubo'] from the estimator (use the `spg` "
                         f"estimator, or set variant='elbo')")
    return torch.where(adv > 0, elbo, weight * eubo.float() + (1.0 - weight) * elbo)


def check_variant(variant: str) -> None:
    if variant not in SPG_VARIANTS:
        raise ValueError(f"variant={variant!r}; valid: {', '.join(SPG_VARIANTS)}")


@OBJECTIVES.register("spg")
@dataclass
class SPG(Objective):
    name: ClassVar[str] = "spg"
    paper: ClassVar[str] = "SPG, Wang et al., arXiv 2510.09541"
    formula: ClassVar[str] = "Σ -A·ℓ^SPG·len/Σlen, ℓ^SPG = ELBO (A>0) or ω·EUBO+(1-ω)·ELBO (A<=0)"
    default_estimator: ClassVar[str] = "spg"
    default_advantage: ClassVar[str] = "mean"
    advantage_weighted: ClassVar[bool] = True

    omega: float = 0.5  # EUBO weight ω in the negative-advantage mixture
    variant: str = "mix"  # mix | elbo | eubo

    def __post_init__(self) -> None:
        super().__post_init__()
        check_variant(self.variant)

    def __call__(self, batch: RolloutBatch, new: EstimatorOutput, old: EstimatorOutput | None,
                 ref: EstimatorOutput | None, *, counts: AggregationCounts) -> LossOutput:
        valid = batch.reward_valid
        adv = batch.advantages.float()
        ell = spg_proxy(new, adv, self.omega, self.variant)  # [B]
        lengths = (batch.completion_mask.bool() & valid[:, None]).sum(1)
        loss = length_weighted_mean(-adv * ell, lengths, counts, valid)
        stats = {"proxy_mean": masked_stat(ell, valid)}
        return LossOutput(loss, stats)
