"""UDM-GRPO: on-policy GRPO for uniform discrete diffusion with the final clean sample as action.

Paper: Wang, Deng, Pan, Liu, Wang, Zhang, Qi, Wang, "UDM-GRPO", arXiv 2604.18518 (ICML 2026).
Code: Yovecent/UDM-GRPO (diffnext/pipelines/ursa/pipeline_grpo.py `postprocess`, driven by
diffnext/engine/train_engine.py). See docs/methods.md.

    for each selected timestep t (the `udm` estimator re-noises x_0 with the forward process):
        lp_b(t) = (1/N) Σ_i log p_θ(x_0^{b,i} | x̃_t, c)    per-image mean, extras["per_timestep"] [B, n_t]
        ρ_b(t)  = exp(lp_b(t) - sg(lp_b(t)))   ≡ 1, with gradient ∇lp   (strictly on-policy: old = sg(current))
        L_t     = -mean_b A_b ρ_b(t) + β·mean_b k3(lp_ref,b(t), lp_b(t))
    L = (1/n_t) Σ_t L_t
    A = (r - mean_group r) / (population std_group r + 1e-4), clipped to ±5;  β = 0.05,
    reference = frozen initial model

As released: each timestep is one micro-batch of their trainer, and accelerate divides every
micro-batch's loss by the accumulation count (= n_t), so the step's gradient is the mean over the
timesteps, not their sum; the group std is numpy's default (population, ddof 0). The golden test
(tests/unit/test_golden_udm_grpo.py) replays one whole optimizer step of their trainer.

Deviation: the released PPO clip (ratio_clipping = 1e-4) is inert because ρ ≡ 1 and is omitted.
Without extras["per_timestep"] the estimator's seq_logp is used as a single timestep.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ddrl.objectives.aggregation import AggregationCounts, sequence_mean
from ddrl.objectives.base import Objective, masked_stat, require_ref
from ddrl.objectives.kl import kl
from ddrl.registry import OBJECTIVES
from ddrl.types import EstimatorOutput, LossOutput, RolloutBatch


def per_timestep_logp(out: EstimatorOutput) -> Tensor:
    """[B, n_t] per-image mean log-prob at each selected timestep."""
    if "per_timestep" in out.extras:
        return out.extras["per_timestep"].float()
    if out.seq_logp is None:
        raise ValueError("udm_grpo needs extras['per_timestep'] or seq_logp from the estimator")
    return out.seq_logp.float()[:, None]


@OBJECTIVES.register("udm_grpo")
@dataclass
class UDMGRPO(Objective):
    name: ClassVar[str] = "udm_grpo"
    paper: ClassVar[str] = "UDM-GRPO, Wang et al., arXiv 2604.18518"
    source: ClassVar[str] = (
        "Yovecent/UDM-GRPO@d1bec49 diffnext/diffnext/pipelines/ursa/pipeline_grpo.py URSAGRPOPipeline via engine/train_engine.py Trainer.run_step")
    formula: ClassVar[str] = "mean_t [-mean_b A·exp(lp-sg(lp)) + β·k3(ref,θ)], lp = per-image mean log p(x_0|x̃_t)"
    default_estimator: ClassVar[str] = "udm"
    default_advantage: ClassVar[str] = "zscore"
    default_advantage_clip: ClassVar[float | None] = 5.0
    default_advantage_std: ClassVar[str] = "population"  # numpy's std (ddof 0), pipeline_grpo.py process_rewards
    on_policy: ClassVar[bool] = True
    advantage_weighted: ClassVar[bool] = True

    beta: float = 0.05  # k3 KL coefficient on per-image mean log-probs (reference = frozen initial model)

    def __call__(self, batch: RolloutBatch, new: EstimatorOutput, old: EstimatorOutput | None,
                 ref: EstimatorOutput | None, *, counts: AggregationCounts) -> LossOutput:
        valid = batch.reward_valid
        logp = per_timestep_logp(new)  # [B, n_t]
        ratio = torch.exp(logp - logp.detach())  # ≡ 1, carries ∇logp
        adv = batch.advantages.to(logp.dtype)[:, None]
        loss = sequence_mean(-(adv * ratio).mean(1), counts, valid)  # mean over timesteps, as accumulated
        stats = {"logp_mean": masked_stat(logp.mean(1), valid)}
        if self.beta > 0:
            ref_logp = per_timestep_logp(require_ref(ref, self.name)).detach()
            per_row_kl = kl(logp, ref_logp, "k3").mean(1)  # [B], mean over timesteps
            loss = loss + self.beta * sequence_mean(per_row_kl, counts, valid)
            stats["kl"] = masked_stat(per_row_kl, valid)
        return LossOutput(loss, stats)
