"""UniGRPO (MMaDA): token-level GRPO on random-ratio masked log-probabilities.

Paper: Yang et al., "MMaDA: Multimodal Large Diffusion Language Models", arXiv 2505.15809; RL code in
Gen-Verse/dLLM-RL (`method: random_masking`). ALGORITHMS.md §10.5.

    t ~ U(0.1, 0.9); mask each completion token with prob. t; score only masked tokens (`random_ratio`)
    ℓ_i = -min(ρ_i A, clip(ρ_i, 1±ε) A) + β·k3(π_ref, π_θ)_i,   A = z-score within the group
    L   = (1/B) Σ_b mean_{i masked in b} ℓ_{b,i}

Defaults: ε = 0.2, β = 0.01 (dLLM-RL's configs). The per-sample mean over the scored (masked)
tokens follows dLLM-RL; with the global sequence count it is split-invariant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ddrl.objectives.ppo import TokenPPO
from ddrl.registry import OBJECTIVES


@OBJECTIVES.register("unigrpo")
@dataclass
class UniGRPO(TokenPPO):
    name: ClassVar[str] = "unigrpo"
    paper: ClassVar[str] = "UniGRPO (MMaDA), Yang et al., arXiv 2505.15809"
    formula: ClassVar[str] = "-min(ρA, clip(ρ,1±ε)A) + β·k3 on randomly masked tokens, per-sample token mean"
    default_estimator: ClassVar[str] = "random_ratio"
    default_advantage: ClassVar[str] = "zscore"

    epsilon: float = 0.2  # clip range ε
    beta: float = 0.01  # k3 KL coefficient to the reference model
    aggregation: str = "sequence_token_mean"  # mean over each sample's masked tokens, then over samples
