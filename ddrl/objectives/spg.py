"""SPG: Sandwiched Policy Gradient (ELBO for positive, EUBO mix for negative advantages).

Paper: Wang, Rashidinejad, ..., Tian, Liu, "SPG: Sandwiched Policy Gradient for Masked Diffusion
Language Models", arXiv 2510.09541. Code: facebookresearch/SPG (copied in GDSD and StableDRL).

    ℓ^SPG(x) = ELBO(x)                        if A > 0
             = ω·EUBO(x) + (1-ω)·ELBO(x)      if A <= 0
    (variant "mix": ω = 0.5; "eubo": ω = 1; "elbo": the ELBO for every sample)
    L = Σ_i (-A_i ℓ^SPG_θ(x_i))·len_i / Σ_i len_i,   A = r - mean_group(r)

No ratio, no clipping, no KL. ELBO and EUBO come from the `spg` estimator (extras "elbo", "eubo";
block_random masking, num_t = 2, β_EUBO = 1.5), or `staircase` on block models. `spg_proxy` is
shared with StableDRL.

Golden test (tests/unit/test_golden_spg.py): facebookresearch/SPG @ a1c7120, spg/spg_trainer.py
`SPGTrainer.compute_loss`, run on fixed logits with its own masks injected, for mix, elbo and eubo.

Normalisation (`aggregation`, the token reductions of aggregation.py applied to -A·ℓ^SPG spread
over each row's completion tokens, so Σ_i(-A_i ℓ_i)·len_i / Σ len): "token_mean" (default) divides
by Σ len of the whole optimizer step (all micro-batches and processes), so the gradient does not
depend on how the step is split. The released trainer divides each micro-batch by its OWN Σ len,
then the HF Trainer divides by the accumulation count and DDP averages over processes;
"micro_batch_token_mean" reproduces that exactly (it reads counts.micro_batches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ddrl.objectives.aggregation import TOKEN_REDUCTIONS, AggregationCounts
from ddrl.objectives.base import Objective, masked_stat, sequence_proxy
from ddrl.registry import OBJECTIVES
from ddrl.types import EstimatorOutput, LossOutput, RolloutBatch

SPG_VARIANTS = ("mix", "elbo", "eubo")
SPG_AGGREGATIONS = ("token_mean", "micro_batch_token_mean")


def spg_proxy(out: EstimatorOutput, adv: Tensor, omega: float, variant: str) -> Tensor:
    """[B] ℓ^SPG: the ELBO where A > 0, else the EUBO/ELBO mixture of the variant."""
    elbo = sequence_proxy(out, "elbo")
    weight = {"mix": omega, "eubo": 1.0, "elbo": 0.0}[variant]
    if weight == 0.0:
        return elbo
    eubo = out.extras.get("eubo")
    if eubo is None:
        raise ValueError(f"SPG variant {variant!r} needs extras['eubo'] from the estimator (use the `spg` "
                         f"estimator, or `staircase` on block models, or set variant='elbo')")
    return torch.where(adv > 0, elbo, weight * eubo.float() + (1.0 - weight) * elbo)


def check_variant(variant: str) -> None:
    if variant not in SPG_VARIANTS:
        raise ValueError(f"variant={variant!r}; valid: {', '.join(SPG_VARIANTS)}")


def check_bounds_estimator(name: str, variant: str, estimator) -> None:
    """Before any forward pass: the variants that mix in the EUBO need an estimator that gives it
    (its class lists "eubo" in `extras`: `spg`, or `staircase` for block models)."""
    if variant != "elbo" and "eubo" not in getattr(estimator, "extras", ()):
        raise ValueError(f"{name}: variant={variant!r} needs the EUBO, which estimator "
                         f"{getattr(estimator, 'name', type(estimator).__name__)!r} does not give; use "
                         f"method.estimator=spg (full attention) or staircase (block models), or set "
                         f"method.objective_args.variant=elbo")


@OBJECTIVES.register("spg")
@dataclass
class SPG(Objective):
    name: ClassVar[str] = "spg"
    paper: ClassVar[str] = "SPG, Wang et al., arXiv 2510.09541"
    source: ClassVar[str] = "facebookresearch/SPG@a1c7120 spg/spg_trainer.py SPGTrainer.compute_loss"
    formula: ClassVar[str] = "Σ -A·ℓ^SPG·len/Σlen, ℓ^SPG = ELBO (A>0) or ω·EUBO+(1-ω)·ELBO (A<=0)"
    default_estimator: ClassVar[str] = "spg"
    default_advantage: ClassVar[str] = "mean"
    advantage_weighted: ClassVar[bool] = True

    omega: float = 0.5  # EUBO weight ω in the negative-advantage mixture
    variant: str = "mix"  # mix | elbo | eubo
    aggregation: str = "token_mean"  # token_mean: / Σ len of the step | micro_batch_token_mean: released

    def __post_init__(self) -> None:
        super().__post_init__()
        check_variant(self.variant)
        if self.aggregation not in SPG_AGGREGATIONS:
            raise ValueError(f"spg: aggregation={self.aggregation!r}; valid: {', '.join(SPG_AGGREGATIONS)}")

    def check_estimator(self, estimator) -> None:
        """Raise, naming the fix, when `estimator` cannot give what this variant reads."""
        check_bounds_estimator(self.name, self.variant, estimator)

    def __call__(self, batch: RolloutBatch, new: EstimatorOutput, old: EstimatorOutput | None,
                 ref: EstimatorOutput | None, *, counts: AggregationCounts) -> LossOutput:
        valid = batch.reward_valid
        adv = batch.advantages.float()
        ell = spg_proxy(new, adv, self.omega, self.variant)  # [B]
        mask = batch.completion_mask.bool() & valid[:, None]  # [B, L]
        per_token = (-adv * ell)[:, None].expand(mask.shape)  # [B, L]: Σ over a row's tokens = -A·ℓ·len
        loss = TOKEN_REDUCTIONS[self.aggregation](per_token, mask, counts)
        stats = {"proxy_mean": masked_stat(ell, valid)}
        return LossOutput(loss, stats)
