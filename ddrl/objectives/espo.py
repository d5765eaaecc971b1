"""ESPO: ELBO-based sequence-level PPO with a length-normalised ratio.

Paper: Ou, Han, Xu, Xu, Xie, Ermon, Wu, Li, "ESPO: ELBO-based Sequence-level Policy Optimization for
Diffusion LLMs", arXiv 2512.03759. Code: ML-GSAI/ESPO @ b5f2dac (espo/espo_trainer.py
`compute_loss`). See docs/methods.md.

    ρ_i = exp((ELBO_θ(x_i) - ELBO_old(x_i)) / L)       L = padded completion length (logits_to_keep)
    L   = -(1/B) Σ_i min(ρ_i A_i, clip(ρ_i, 1±ε) A_i) + β·(1/B) Σ_i ½(ELBO_θ - ELBO_ref)² / L     (k2 KL)
    A = leave-one-out (scale_rewards = false);  ε = 0.2, β = 0.01 (recipes/train.yaml; GSM8K: 1e-3)

ELBO from the `coupled_elbo` estimator: the mean over its num_mc draws (extras["elbo"] or seq_logp),
the same mask seeds for old, ref and θ. The ratio and the KL use that mean, as the released code
(`_get_elbo_mc` averages the draws before compute_loss sees them).

Normalisation: 1/B is the step's global sequence count. The released trainer divides each
micro-batch by its own row count and the accumulated loss by the number of micro-batches; its
micro-batches are equal-sized, so the two agree (tests/unit/test_golden_espo.py checks one
released step of two micro-batches). Rows with an invalid reward carry no loss here; the released
code gives them reward 0 and keeps them.

`ratio_noise_std` adds N(0, std²) to log ρ (stress test: ESPO's conditional clip lets
negative-advantage outliers through).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ddrl.objectives.aggregation import AggregationCounts, sequence_mean
from ddrl.objectives.base import (
    Objective,
    inject_ratio_noise,
    masked_stat,
    noise_seed,
    old_or_detached,
    require_ref,
    sequence_proxy,
)
from ddrl.objectives.kl import kl
from ddrl.objectives.ppo import sequence_ppo_loss
from ddrl.registry import OBJECTIVES
from ddrl.types import EstimatorOutput, LossOutput, RolloutBatch


@OBJECTIVES.register("espo")
@dataclass
class ESPO(Objective):
    name: ClassVar[str] = "espo"
    paper: ClassVar[str] = "ESPO, Ou et al., arXiv 2512.03759"
    source: ClassVar[str] = "ML-GSAI/ESPO@b5f2dac espo/espo_trainer.py ESPOTrainer.compute_loss"
    formula: ClassVar[str] = "-min(ρA, clip(ρ,1±ε)A), ρ = exp(ΔELBO/L), seq. mean; + β·½(ELBO_θ-ELBO_ref)²/L"
    default_estimator: ClassVar[str] = "coupled_elbo"
    default_advantage: ClassVar[str] = "loo"
    needs_old: ClassVar[bool] = True
    advantage_weighted: ClassVar[bool] = True

    epsilon: float = 0.2  # clip range ε on the length-normalised sequence ratio
    beta: float = 0.01  # k2 KL coefficient on the ELBO (the GSM8K recipe uses 1e-3)
    ratio_noise_std: float = 0.0  # stress test: std of Gaussian noise added to log ρ

    def __call__(self, batch: RolloutBatch, new: EstimatorOutput, old: EstimatorOutput | None,
                 ref: EstimatorOutput | None, *, counts: AggregationCounts) -> LossOutput:
        valid = batch.reward_valid
        length = batch.completion_ids.shape[1]  # padded L, as the released code
        elbo = sequence_proxy(new, "elbo")  # [B]
        old_elbo = old_or_detached(old, elbo, lambda o: sequence_proxy(o, "elbo"))
        log_ratio = inject_ratio_noise((elbo - old_elbo) / length, self.ratio_noise_std, noise_seed(batch))
        loss, stats = sequence_ppo_loss(log_ratio, batch.advantages, valid, self.epsilon, self.epsilon, counts)
        if self.beta > 0:
            ref_elbo = sequence_proxy(require_ref(ref, self.name), "elbo").detach()
            k2 = kl(elbo, ref_elbo, "k2") / length
            loss = loss + self.beta * sequence_mean(k2, counts, valid)
            stats["kl"] = masked_stat(k2, valid)
        return LossOutput(loss, stats)
