"""coupled-GRPO (DiffuCoder): token-level GRPO on three-pass coupled log-probabilities.

Paper: Gong et al., "DiffuCoder: Understanding and Improving Masked Diffusion Models for Code
Generation", arXiv 2506.20639. Code: apple/ml-diffucoder @ f735e01, src/open_r1/coupled_grpo.py
(`DiffuGRPOTrainer.compute_loss`, `_generate_and_score_completions`), on TRL 1bca495.

    log π(x^i) := ½[log p0(x^i) + 1[i∈S]·log p1(x^i)/t + 1[i∉S]·log p2(x^i)/(1-t)]   (`coupled_three_pass`)
    ℓ_i = -min(ρ_i A, clip(ρ_i, 1±ε) A) + β·k3(π_ref, π_θ)_i,   ρ_i = π_θ(x^i)/π_old(x^i)
    A   = r - (Σ_group r - r)/(G-1)   (leave-one-out; the recipe's scale_rewards=false: no std)
    L   = token mean over the completion mask (tokens up to and including the first EOS)

Defaults from recipes/config_coupled_code.yaml: ε = 0.5, β = 0.01. The KL is k3 against the
reference model on the same coupled per-token log-probs (same masks), added per token before the mean.

Normalisation. The released trainer takes the token mean of each micro-batch and the HF Trainer
divides it by the number of accumulation steps; ddrl's default divides by the step's global token
count, so the gradient does not depend on how the step is cut. `aggregation="micro_batch_token_mean"`
reproduces the released form exactly (docs/methods.md; golden test tests/unit/test_golden_coupled_grpo.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ddrl.objectives.ppo import TokenPPO
from ddrl.registry import OBJECTIVES


@OBJECTIVES.register("coupled_grpo")
@dataclass
class CoupledGRPO(TokenPPO):
    name: ClassVar[str] = "coupled_grpo"
    paper: ClassVar[str] = "coupled-GRPO (DiffuCoder), Gong et al., arXiv 2506.20639"
    source: ClassVar[str] = "apple/ml-diffucoder@f735e01 src/open_r1/coupled_grpo.py DiffuGRPOTrainer.compute_loss"
    formula: ClassVar[str] = "-min(ρA, clip(ρ,1±ε)A) + β·k3 per token on coupled 3-pass log-probs, token mean"
    default_estimator: ClassVar[str] = "coupled_three_pass"
    default_advantage: ClassVar[str] = "loo"

    epsilon: float = 0.5  # clip range ε
    beta: float = 0.01  # k3 KL coefficient to the reference model
