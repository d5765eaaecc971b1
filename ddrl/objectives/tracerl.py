"""TraceRL: token-level PPO on the states the sampler actually visited.

Paper: Wang et al., "Revolutionizing Reinforcement Learning Framework for Diffusion Large Language
Models" (TraceRL / TraDo), arXiv 2509.06949. Code: Gen-Verse/dLLM-RL (train/rl_llada.py). §10.4.

    the `trace` estimator scores token x^i at the (merged) sampler step that committed it, with every
    token committed later still masked: log p_θ(x^i | state_s(i))
    per-sample surrogate = Σ_{i∈targets} min(ρ_i A, clip(ρ_i,1±ε) A) / #targets;  L = -Σ_b surrogate_b / B
    KL: β·Σ_{i∈targets} k3(π_old, π_θ)_i / B     (against the BEHAVIOUR policy, β = 0.01)
    A = per-prompt z-score with the population std

Defaults: ε = 0.2, β = 0.01 (configs/rl_llada.yaml). The optional value model is not implemented.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ddrl.objectives.ppo import TokenPPO
from ddrl.registry import OBJECTIVES


@OBJECTIVES.register("tracerl")
@dataclass
class TraceRL(TokenPPO):
    name: ClassVar[str] = "tracerl"
    paper: ClassVar[str] = "TraceRL, Wang et al., arXiv 2509.06949"
    formula: ClassVar[str] = "per-sample mean over trace targets of -min(ρA, clip(ρ)A), / B; + β·Σk3(old,θ)/B"
    default_estimator: ClassVar[str] = "trace"
    default_advantage: ClassVar[str] = "zscore"
    default_advantage_std: ClassVar[str] = "population"
    kl_against: ClassVar[str] = "old"
    kl_aggregation: ClassVar[str | None] = "sequence_token_sum"
    estimator_needs_trajectory: ClassVar[bool] = True

    epsilon: float = 0.2  # clip range ε
    beta: float = 0.01  # k3 KL coefficient, measured against the behaviour policy (no reference pass)
    aggregation: str = "sequence_token_mean"  # mean over each sample's targets, then / B
