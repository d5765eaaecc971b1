"""MaskGRPO: token-level GRPO on masked-token log-probs at scheduled, truncated mask ratios.

Paper: Ma, Zhang, Wang, Ye, "Consolidating Reinforcement Learning for Multimodal Discrete Diffusion
Models", arXiv 2510.02880. Code: martian422/MaskGRPO (grpo/mask_grpo_trainer.py). §5.

    inner iteration k masks at ratio min(γ + (1-γ)(k+1)/μ, 0.999) (AR-like fading for text): `maskgrpo`
    ℓ_i = -min(ρ_i A, clip(ρ_i, 1±ε) A) + β·k3(π_ref, π_θ)_i   on the masked tokens only
    A = z-score within the group;   ε = 0.2, β = 0.01 (configs/rl.yaml; images use ε = 0.001)

Deviation: the released loss divides by #masked tokens of the micro-batch, whose value depends on the
estimator's random masks and on how the batch is cut. Here each sample's loss is its mean over its
own masked tokens and samples are averaged with the global sequence count (aggregation
"sequence_token_mean"), which is split-invariant; set aggregation="token_mean" for a
completion-token normalisation instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ddrl.objectives.ppo import TokenPPO
from ddrl.registry import OBJECTIVES


@OBJECTIVES.register("maskgrpo")
@dataclass
class MaskGRPO(TokenPPO):
    name: ClassVar[str] = "maskgrpo"
    paper: ClassVar[str] = "MaskGRPO, Ma et al., arXiv 2510.02880"
    formula: ClassVar[str] = "-min(ρA, clip(ρ,1±ε)A) + β·k3 over the estimator's masked tokens, per-sample mean"
    default_estimator: ClassVar[str] = "maskgrpo"
    default_advantage: ClassVar[str] = "zscore"

    epsilon: float = 0.2  # clip range ε (text; the image recipe uses 0.001)
    beta: float = 0.01  # k3 KL coefficient to the reference model
    aggregation: str = "sequence_token_mean"  # mean over each sample's masked tokens, then over samples
