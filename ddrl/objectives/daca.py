"""DACA-GRPO: GRPO with Denoising-Progress-Score token weights and stratified-masking likelihoods.

Paper: Karimi Monsefi et al., "Denoising-Aware Credit Assignment for Diffusion LLM RL", arXiv
2605.16342. No code was released and the full text was not available: the implementation below is
INFERRED from the abstract and is a plausible reading, not the authors' method (docs/methods.md).

    w_{b,i} = DPS weights from the rollout trajectory (ddrl.estimators.dps; fields dps_kind, dps_floor),
              computed once per step by TokenPPO.prepare into batch.extras["dps_weights"] [B, L]
    log π(x^i) := stratified masking likelihood (`stratified`: K strata, each token scored with ~(1-1/K)L context)
    ℓ_i = -min(ρ_i A, clip(ρ_i, 1±ε) A)·w_i + β·k3(π_ref, π_θ)_i,   token mean (d1's base loss)

The DPS weighting is the `token_weights` option of every token-level objective (ppo.TokenPPO), so
it also plugs into unigrpo, coupled_grpo, maskgrpo, tracerl. Weights multiply the surrogate only,
not the KL. Defaults follow the d1 base: ε = 0.5, β = 0.04.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ddrl.objectives.grpo import GRPO
from ddrl.registry import OBJECTIVES


@OBJECTIVES.register("daca_grpo")
@dataclass
class DACAGRPO(GRPO):
    name: ClassVar[str] = "daca_grpo"
    paper: ClassVar[str] = "DACA-GRPO, Karimi Monsefi et al., arXiv 2605.16342 (inferred; no code)"
    source: ClassVar[str] = "none released (reconstructed from the abstract)"
    formula: ClassVar[str] = "-min(ρA, clip(ρ,1±ε)A)·w_DPS + β·k3 per token, token mean; stratified log-probs"
    default_estimator: ClassVar[str] = "stratified"

    token_weights: bool = True  # weight each token's surrogate by its Denoising Progress Score
