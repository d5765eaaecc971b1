"""GDSD: Guided Denoiser Self-Distillation (log-ratio regression onto the scaled advantage).

Paper: Tang, Jiang, Liu, Zhao, Xu, Yoon, Bogunovic, "Guided Denoiser Self-Distillation", arXiv
2605.29398. Code: GaryBall/GDSD @ 3fb6780 (gdsd/trainers/gdsd_trainer_batchll.py `compute_loss`;
gdsd_trainer_tlc.py for GDSD-TLC). See docs/methods.md.

For each row i and Monte-Carlo draw m (num_mc draws, each a pair of complementary masks S_m, S_m^c
shared by the policy, old and reference passes):

    D_θ,m(x) = ½[Σ_{i∈S_m} log p_θ(x^i|x_{S̄_m}) + Σ_{i∈S_m^c} log p_θ(x^i|x_{S_m})]   no 1/t weights
    Δ_im = clamp(D_θ,m(x_i) - D_old,m(x_i), log(1-ε), log(1+ε))                  hard trust region
    L    = (1/B) Σ_i Σ_m (Δ_im/L - ψ·A_i)²  +  β·(1/B) Σ_i (1/M) Σ_m ½(D_θ,m - D_ref,m)²/L
    L = padded completion length, M = num_mc, A = leave-one-out (scale_rewards = false)

This regresses the per-token log-ratio log π_θ/π_old onto ψA, the relation satisfied by the target
π* ∝ π_old^{1-β} π_ref^β exp(ψA) as β → 0, without ever computing log Z.

Per draw, as released. The clamp and the square act on every draw, and the regression is SUMMED
over draws while the KL is averaged over them, exactly as the released compute_loss on its
[B, num_mc] values: so with num_mc = 2 the regression weighs twice as much against the KL as with
one draw, and a draw outside the trust region loses its gradient even when the mean over draws is
inside. The draws come from the estimator's extras["per_draw"] [B, M] (`coupled_elbo`); an
estimator without it counts as one draw (seq_logp).

"gdsd_tlc" (token logits centralisation) is the same loss with D computed with ESPO's ELBO weights
(1/t, 1/(L/(L+1)-t)); the released code also subtracts the detached vocabulary-mean logit before
the cross-entropy, a no-op for value and gradient under softmax. Both use the `coupled_elbo`
estimator, weighted=False / True.

Normalisation: 1/B uses the step's global sequence count. The released trainer divides each
micro-batch by its own row count and the accumulation by the number of micro-batches, which is the
same for its equal-sized micro-batches. Rows with an invalid reward carry no loss here; the
released code gives them reward 0 and keeps them.

WARNING: ε = 4e-4 is the released yaml's value and it clamps the SEQUENCE-summed Δ before the /L,
so the gradient of the regression term vanishes once |D_θ - D_old| > ~4e-4: a very tight trust
region (ESPO's ε = 0.2 acts on the length-normalised ratio). Set `epsilon` larger if updates stall.
Defaults: ψ = 1 (the code default; the GSM8K and MATH scripts use ψ = 10), β = 1e-3 (GSM8K; MATH 1e-4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ddrl.objectives.aggregation import AggregationCounts, sequence_mean
from ddrl.objectives.base import Objective, masked_stat, require_ref, sequence_proxy
from ddrl.objectives.kl import kl
from ddrl.registry import OBJECTIVES
from ddrl.types import EstimatorOutput, LossOutput, RolloutBatch


def per_draw_values(out: EstimatorOutput) -> Tensor:
    """[B, M] each Monte-Carlo draw's sequence value (extras["per_draw"]), or seq_logp as one draw.

    Float64 stays float64 (the golden tests); half precision is promoted to float32.
    """
    value = out.extras.get("per_draw")
    if value is None:
        return sequence_proxy(out, "seq")[:, None]
    if value.dim() != 2:
        raise ValueError(f"extras['per_draw'] must be [B, num_mc], got shape {tuple(value.shape)}")
    return value if value.dtype == torch.float64 else value.float()


@OBJECTIVES.register("gdsd")
@dataclass
class GDSD(Objective):
    name: ClassVar[str] = "gdsd"
    paper: ClassVar[str] = "GDSD, Tang et al., arXiv 2605.29398"
    source: ClassVar[str] = "GaryBall/GDSD@3fb6780 gdsd/trainers/gdsd_trainer_batchll.py GDSDTrainer.compute_loss"
    formula: ClassVar[str] = ("Σ_m (clamp(D_θm-D_old,m, log(1±ε))/L - ψA)² + β·mean_m ½(D_θm-D_ref,m)²/L, "
                              "row mean; D = denoise log-prob per MC draw m")
    default_estimator: ClassVar[str] = "coupled_elbo"
    default_estimator_args: ClassVar[dict] = {"weighted": False}
    default_advantage: ClassVar[str] = "loo"
    needs_old: ClassVar[bool] = True

    psi: float = 1.0  # ψ, advantage scale of the regression target (GSM8K/MATH scripts: 10)
    epsilon: float = 4e-4  # trust region on each draw's sequence log-ratio (released yaml; very tight, see above)
    beta: float = 1e-3  # k2 KL coefficient to the reference model (GSM8K; MATH 1e-4)

    def __call__(self, batch: RolloutBatch, new: EstimatorOutput, old: EstimatorOutput | None,
                 ref: EstimatorOutput | None, *, counts: AggregationCounts) -> LossOutput:
        valid = batch.reward_valid
        length = batch.completion_ids.shape[1]  # padded L, as the released code
        denoise = per_draw_values(new)  # [B, M] D_θ per draw
        old_denoise = denoise.detach() if old is None else self._matching(per_draw_values(old), denoise, "old")
        raw = denoise - old_denoise  # [B, M]
        delta = raw.clamp(math.log1p(-self.epsilon), math.log1p(self.epsilon))
        adv = batch.advantages.to(delta.dtype)[:, None]  # [B, 1]
        regression = (delta / length - self.psi * adv).square().sum(1)  # [B]: summed over draws
        loss = sequence_mean(regression, counts, valid)
        outside = (raw.detach() != delta.detach()).float().mean(1)  # [B] share of draws clamped
        stats = {"clip_frac": masked_stat(outside, valid), "log_ratio_mean": masked_stat(raw.mean(1), valid)}
        if self.beta > 0:
            ref_denoise = self._matching(per_draw_values(require_ref(ref, self.name)), denoise, "ref").detach()
            k2 = kl(denoise, ref_denoise, "k2").mean(1) / length  # [B]: averaged over draws
            loss = loss + self.beta * sequence_mean(k2, counts, valid)
            stats["kl"] = masked_stat(k2, valid)
        return LossOutput(loss, stats)

    def _matching(self, other: Tensor, new: Tensor, who: str) -> Tensor:
        """The old/ref per-draw values, checked to have the policy's draws (same masks, same num_mc)."""
        if other.shape != new.shape:
            raise ValueError(f"{self.name}: the {who} estimate has {tuple(other.shape)} per-draw values but the "
                             f"policy's has {tuple(new.shape)}; compute both with the same estimator and seeds")
        return other.detach().to(new.dtype)


@OBJECTIVES.register("gdsd_tlc")
@dataclass
class GDSDTLC(GDSD):
    name: ClassVar[str] = "gdsd_tlc"
    paper: ClassVar[str] = "GDSD-TLC, Tang et al., arXiv 2605.29398"
    source: ClassVar[str] = "GaryBall/GDSD@3fb6780 gdsd/trainers/gdsd_trainer_tlc.py GDSDTLCTrainer.compute_loss"
    formula: ClassVar[str] = "GDSD's per-draw loss with D = ESPO-weighted coupled ELBO (1/t weights)"
    default_estimator_args: ClassVar[dict] = {"weighted": True}
