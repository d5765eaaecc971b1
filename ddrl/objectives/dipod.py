"""DiPOD: FPO plus an on-policy ELBO regulariser, which also composes with any objective.

Paper: Jiang, Feng, Abbeel, Jiao, Kanazawa, Haghtalab, "DiPOD: Diffusion Policy Optimization without
Drifting Apart", arXiv 2606.13795. Code: Astro-Eric/DiPOD-release (via a public mirror,
language/d1/diffu-grpo/diffu_grpo_trainer.py `compute_loss`: `- current_elbos.mean() * dipod_beta`).
See docs/methods.md.

Optimising a variational surrogate lets the ELBO drift away from the true log-likelihood, and the
proxy gradient with it ("double drift"). DiPOD keeps the bound tight by maximising the ELBO of the
policy's own current samples next to each policy-gradient step:

    L_DiPOD = L_base + λ·mean_i(-ELBO_θ(x_i)),      λ = 0.05 (README: re-tune around 0.05 on other hardware)

ELBO_θ is the estimator's extras["elbo"] if present, else its seq_logp. "dipod" is FPO + this term
(the released d1-based recipe; it inherits FPO's mask reuse across inner iterations and EOS
exclusion, both as released, golden test tests/unit/test_golden_dipod.py);
`method.elbo_reg=λ` adds the same term to any other objective (ddrl.training.loss_terms.ElboTerm;
e.g. SPG: note the released SPG+DiPOD weights the term by length, Σ_i(-ELBO_i)·len_i/Σlen, while
ddrl uses the plain sequence mean). Both compute `elbo_regulariser`, the one implementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from ddrl.objectives.aggregation import AggregationCounts, sequence_mean
from ddrl.objectives.base import sequence_proxy
from ddrl.objectives.fpo import FPO
from ddrl.registry import OBJECTIVES
from ddrl.types import EstimatorOutput, LossOutput, RolloutBatch


def elbo_regulariser(batch: RolloutBatch, new: EstimatorOutput, counts: AggregationCounts) -> Tensor:
    """mean_i(-ELBO_θ(x_i)) over valid rows, with the global sequence count (a 0-d tensor with grad)."""
    return sequence_mean(-sequence_proxy(new, "elbo"), counts, batch.reward_valid)


def add_elbo_regulariser(out: LossOutput, batch: RolloutBatch, new: EstimatorOutput, lam: float,
                         counts: AggregationCounts) -> LossOutput:
    if lam == 0.0:
        return out
    reg = elbo_regulariser(batch, new, counts)
    return LossOutput(out.loss + lam * reg, {**out.stats, "elbo_reg": reg.detach()})


@OBJECTIVES.register("dipod")
@dataclass
class DiPOD(FPO):
    name: ClassVar[str] = "dipod"
    paper: ClassVar[str] = "DiPOD, Jiang et al., arXiv 2606.13795"
    formula: ClassVar[str] = "FPO loss + λ·mean_i(-ELBO_θ(x_i)) (on-policy ELBO regulariser)"

    advantage_weighted: ClassVar[bool] = False  # the ELBO regulariser acts on every row
    elbo_reg: float = 0.05  # λ, weight of the on-policy ELBO regulariser (dipod_beta)

    def __call__(self, batch: RolloutBatch, new: EstimatorOutput, old: EstimatorOutput | None,
                 ref: EstimatorOutput | None, *, counts: AggregationCounts) -> LossOutput:
        out = super().__call__(batch, new, old, ref, counts=counts)
        return add_elbo_regulariser(out, batch, new, self.elbo_reg, counts)
