"""GDSD: Guided Denoiser Self-Distillation (log-ratio regression onto the scaled advantage).

Paper: Tang, Jiang, Liu, Zhao, Xu, Yoon, Bogunovic, "Guided Denoiser Self-Distillation", arXiv
2605.29398. Code: GaryBall/GDSD (gdsd/trainers/gdsd_trainer_batchll.py:154-200; gdsd_trainer_tlc.py). §7.

    D_θ(x) = ½[Σ_{i∈S} log p_θ(x^i|x_S̄) + Σ_{i∈S^c} log p_θ(x^i|x_S)]   coupled complementary masks, no 1/t
    Δ_i = clamp(D_θ(x_i) - D_old(x_i), log(1-ε), log(1+ε))            hard trust region (zero gradient outside)
    L   = mean_i (Δ_i/L - ψ·A_i)² + β·mean_i ½(D_θ - D_ref)²/L          L = padded completion length
    A = leave-one-out (scale_rewards = false)

This regresses the per-token log-ratio log π_θ/π_old onto ψA, the relation satisfied by the target
π* ∝ π_old^{1-β} π_ref^β exp(ψA) as β → 0, without ever computing log Z.
"gdsd_tlc" (token logits centralisation) is the same loss with D computed with ESPO's ELBO weights
(1/t, 1/(L/(L+1)-t)); the vocabulary-mean logit subtraction of the released code is a no-op under
softmax cross-entropy. Both use the `coupled_elbo` estimator, weighted=False / True.

WARNING: ε = 4e-4 is the released yaml's value and it clamps the SEQUENCE-summed Δ before the /L,
so the gradient of the regression term vanishes once |D_θ - D_old| > ~4e-4: a very tight trust
region (ESPO's ε = 0.2 acts on the length-normalised ratio). Set `epsilon` larger if updates stall.
Defaults: ψ = 1 (the code default; the GSM8K and MATH scripts use ψ = 10), β = 1e-3 (GSM8K; MATH 1e-4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from ddrl.objectives.aggregation import AggregationCounts, sequence_mean
from ddrl.objectives.base import Objective, masked_stat, old_or_detached, require_ref, sequence_proxy
from ddrl.objectives.kl import kl
from ddrl.registry import OBJECTIVES
from ddrl.types import EstimatorOutput, LossOutput, RolloutBatch


@OBJECTIVES.register("gdsd")
@dataclass
class GDSD(Objective):
    name: ClassVar[str] = "gdsd"
    paper: ClassVar[str] = "GDSD, Tang et al., arXiv 2605.29398"
    formula: ClassVar[str] = "mean (clamp(D_θ-D_old, log(1±ε))/L - ψA)² + β·½(D_θ-D_ref)²/L, D = denoise log-prob"
    default_estimator: ClassVar[str] = "coupled_elbo"
    default_estimator_args: ClassVar[dict] = {"weighted": False}
    default_advantage: ClassVar[str] = "loo"
    needs_old: ClassVar[bool] = True

    psi: float = 1.0  # ψ, advantage scale of the regression target (GSM8K/MATH scripts: 10)
    epsilon: float = 4e-4  # trust region on the sequence log-ratio (released yaml; very tight, see above)
    beta: float = 1e-3  # k2 KL coefficient to the reference model (GSM8K; MATH 1e-4)

    def __call__(self, batch: RolloutBatch, new: EstimatorOutput, old: EstimatorOutput | None,
                 ref: EstimatorOutput | None, *, counts: AggregationCounts) -> LossOutput:
        valid = batch.reward_valid
        length = batch.completion_ids.shape[1]
        denoise = sequence_proxy(new, "seq")  # [B] D_θ
        old_denoise = old_or_detached(old, denoise, lambda o: sequence_proxy(o, "seq"))
        raw = denoise - old_denoise
        delta = raw.clamp(math.log1p(-self.epsilon), math.log1p(self.epsilon))
        adv = batch.advantages.to(delta.dtype)
        loss = sequence_mean((delta / length - self.psi * adv).square(), counts, valid)
        outside = (raw.detach() != delta.detach()).float()
        stats = {"clip_frac": masked_stat(outside, valid), "log_ratio_mean": masked_stat(raw, valid)}
        if self.beta > 0:
            ref_denoise = sequence_proxy(require_ref(ref, self.name), "seq").detach()
            k2 = kl(denoise, ref_denoise, "k2") / length
            loss = loss + self.beta * sequence_mean(k2, counts, valid)
            stats["kl"] = masked_stat(k2, valid)
        return LossOutput(loss, stats)


@OBJECTIVES.register("gdsd_tlc")
@dataclass
class GDSDTLC(GDSD):
    name: ClassVar[str] = "gdsd_tlc"
    paper: ClassVar[str] = "GDSD-TLC, Tang et al., arXiv 2605.29398"
    formula: ClassVar[str] = "GDSD's loss with D = ESPO-weighted coupled ELBO (1/t weights)"
    default_estimator_args: ClassVar[dict] = {"weighted": True}
