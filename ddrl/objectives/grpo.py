"""diffu-GRPO (d1): token-level GRPO on mean-field one-step log-probabilities.

Paper: Zhao, Gupta, Zheng, Grover, "d1: Scaling Reasoning in Diffusion Large Language Models via
Reinforcement Learning", arXiv 2504.12216. Code: dllm-reasoning/d1 @ 837888f,
diffu-grpo/diffu_grpo_trainer.py (`DiffuGRPOTrainer.compute_loss`).

    log π(x^i) := log p_θ(x^i | c̃, M…M)   (completion fully masked, prompt masked with p=0.15: `mean_field`)
    ρ_i = exp(log π_θ - log π_old)   (same mask seed for θ, old and ref)
    ℓ_i = -min(ρ_i A, clip(ρ_i, 1-ε, 1+ε) A) + β·k3(π_ref, π_θ)_i,   A = r - mean_group(r)
    L   = Σ_{b,i} ℓ·m / Σ m          (token mean over the completion mask)

Defaults follow d1's train.yaml: ε = 0.5, β = 0.04. With μ = 1 there is no old pass and old = sg(θ).

Deviation (deliberate): the token mean divides by the step's global token count, so gradient
accumulation and data parallelism do not change the gradient (aggregation.py). d1 divides each
micro-batch (one prompt group per GPU) by its own token count and averages the micro-batches;
`aggregation="micro_batch_token_mean"` reproduces that exactly (checked against d1's own
training_step in tests/unit/test_golden_d1.py). d1 also scores a None reward as 0 and keeps the
row in its group (`method.invalid_reward: zero`). Registered as "grpo" and "diffu_grpo".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ddrl.objectives.ppo import TokenPPO
from ddrl.registry import OBJECTIVES


@OBJECTIVES.register("grpo")
@dataclass
class GRPO(TokenPPO):
    name: ClassVar[str] = "grpo"
    paper: ClassVar[str] = "d1 / diffu-GRPO, Zhao et al., arXiv 2504.12216"
    source: ClassVar[str] = "dllm-reasoning/d1@837888f diffu-grpo/diffu_grpo_trainer.py DiffuGRPOTrainer.compute_loss"
    formula: ClassVar[str] = "-min(ρA, clip(ρ,1±ε)A) + β·k3(ref,θ) per token, token mean; ρ = token ratio"
    default_estimator: ClassVar[str] = "mean_field"
    default_advantage: ClassVar[str] = "mean"

    epsilon: float = 0.5  # clip range ε (d1 train.yaml)
    beta: float = 0.04  # k3 KL coefficient to the reference model (d1 train.yaml)


OBJECTIVES.register("diffu_grpo", GRPO)
