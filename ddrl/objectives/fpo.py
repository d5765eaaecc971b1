"""DiPOD-FPO: sequence-level PPO on an ELBO ratio (the FPO baseline of DiPOD).

Paper: Jiang, Feng, Abbeel, Jiao, Kanazawa, Haghtalab, "DiPOD: Diffusion Policy Optimization without
Drifting Apart", arXiv 2606.13795. Code: Astro-Eric/DiPOD-release (language/d1/diffu-grpo,
`fpo: True`, `_get_sequence_elbo`, `compute_loss`), read via a public mirror. See docs/methods.md.

    ELBO_θ(x) = mean_{n=1..4} (L_c/k_n) Σ_{i∈S_n} log p_θ(x^i | x with S_n masked, c)
                (`fpo_elbo`; the same masks for old, reference and θ, and for every inner iteration)
    ρ_i = exp(ELBO_θ(x_i) - ELBO_old(x_i))            sequence level, NOT length-normalised
    L   = -mean_i min(ρ_i A_i, clip(ρ_i, 1±ε) A_i) + β·mean_i (ELBO_θ - ELBO_ref)(x_i)    (k1 KL)
    ε = 0.5, β = 0.04 (d1's train.yaml, on which the FPO code is built); A = r - mean_group(r)

As released (golden test tests/unit/test_golden_dipod.py, which runs their compute_loss): the S_n
are drawn ONCE per rollout, at the behaviour pass, and reused for all μ inner updates
(`reuse_masks`: the trainer gives every inner iteration the mask seed of iteration 0), and the
completion mask stops before the first EOS (`fpo_elbo` exclude_eos=True, the default here). The
released mean is over the micro-batch's rows; here over the step's rows (the same for equal
micro-batches without invalid rewards).

Note: k1 used as a loss pushes the current ELBO of the policy's own samples down (its expectation
is a KL only under sampling from π_θ, which the loss does not differentiate); it is kept as
released. Set beta=0 to drop it. DiPOD's regulariser is in dipod.py ("dipod" = this + λ·(-ELBO)).
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


@OBJECTIVES.register("fpo")
@dataclass
class FPO(Objective):
    name: ClassVar[str] = "fpo"
    paper: ClassVar[str] = "DiPOD-FPO, Jiang et al., arXiv 2606.13795"
    source: ClassVar[str] = ("Astro-Eric/DiPOD-release, public mirror manbeastfurryfreedom-ctrl/dipod-release-e361cc37"
                             "@6111ba4 language/d1/diffu-grpo/diffu_grpo_trainer.py DiffuGRPOTrainer.compute_loss (fpo)")
    formula: ClassVar[str] = "-min(ρA, clip(ρ,1±ε)A), ρ = exp(ELBO_θ - ELBO_old), seq. mean; + β·(ELBO_θ - ELBO_ref)"
    default_estimator: ClassVar[str] = "fpo_elbo"
    default_estimator_args: ClassVar[dict] = {"exclude_eos": True}  # released: EOS neither masked nor counted
    default_advantage: ClassVar[str] = "mean"
    needs_old: ClassVar[bool] = True
    # One mask set per rollout, reused by every inner iteration (released: stored at the behaviour pass);
    # the trainer must then pass every iteration the mask seed of iteration 0.
    reuse_masks: ClassVar[bool] = True
    advantage_weighted: ClassVar[bool] = True

    epsilon: float = 0.5  # clip range ε on the (unnormalised) sequence ratio
    beta: float = 0.04  # k1 KL coefficient on the ELBO (0 = no reference pass)
    ratio_noise_std: float = 0.0  # stress test: std of Gaussian noise added to log ρ

    def __call__(self, batch: RolloutBatch, new: EstimatorOutput, old: EstimatorOutput | None,
                 ref: EstimatorOutput | None, *, counts: AggregationCounts) -> LossOutput:
        valid = batch.reward_valid
        elbo = sequence_proxy(new, "elbo")  # [B]
        old_elbo = old_or_detached(old, elbo, lambda o: sequence_proxy(o, "elbo"))
        log_ratio = inject_ratio_noise(elbo - old_elbo, self.ratio_noise_std, noise_seed(batch))
        loss, stats = sequence_ppo_loss(log_ratio, batch.advantages, valid, self.epsilon, self.epsilon, counts)
        if self.beta > 0:
            ref_elbo = sequence_proxy(require_ref(ref, self.name), "elbo").detach()
            k1 = kl(elbo, ref_elbo, "k1")
            loss = loss + self.beta * sequence_mean(k1, counts, valid)
            stats["kl"] = masked_stat(k1, valid)
        return LossOutput(loss, stats)
