"""UniGRPO (MMaDA): token-level GRPO on random-ratio masked log-probabilities.

Paper: Yang et al., "MMaDA: Multimodal Large Diffusion Language Models", arXiv 2505.15809. Code
this follows: Gen-Verse/dLLM-RL @ 10b4fd1c, train/rl_llada.py (method "random_masking" in
`prepare_inputs_and_labels_for_text`, and `forward_process`); docs/methods.md.

    per masked copy c of sample b (`random_ratio`, `copies` = dLLM-RL mask_times_per_sample):
    t ~ U(0.1, 0.9); mask each completion token with prob. t; its targets are the masked tokens
    ℓ_row = -(1/|masked|) Σ_{i masked} min(ρ_i A, clip(ρ_i, 1±ε) A)      (ρ from this copy's log-probs)
    L     = Σ_rows ℓ_row / R  +  β Σ_rows Σ_{i masked} k3(π_old, π_θ)_i / R   (R = number of copy rows)
    A     = z-score within the group, population std

Every copy is its own row with its own ratio (copies are not averaged first), and the KL is against
the behaviour policy, summed over masked tokens. `aggregation = row_token_mean` divides by
copies x valid sequences of the step (an empty copy counts, with zero loss; dLLM-RL skips it);
`row_token_mean_local` by the micro-batch's non-empty copies, as dLLM-RL's forward_process does
(the golden test uses it). The released loop (tracerl.py) applies here too: with one update
per rollout old = sg(current) and the KL has zero gradient.

Defaults: ε = 0.2, β = 0.01 (dLLM-RL's configs); its recipe uses mask_times_per_sample = 35
(method.estimator_args.copies=35), ddrl's estimator default is 1 copy.
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
    source: ClassVar[str] = "Gen-Verse/dLLM-RL@10b4fd1 train/rl_llada.py forward_process (method random_masking)"
    formula: ClassVar[str] = "per masked copy: mean of -min(ρA, clip(ρ,1±ε)A), / rows; + β·Σk3(old,θ)/rows"
    default_estimator: ClassVar[str] = "random_ratio"
    default_advantage: ClassVar[str] = "zscore"
    default_advantage_std: ClassVar[str] = "population"
    default_advantage_eps: ClassVar[float] = 0.0  # dLLM-RL's z-score (reward/rl_reward.py) has no eps
    kl_against: ClassVar[str] = "old"
    kl_aggregation: ClassVar[str | None] = "row_token_sum"

    epsilon: float = 0.2  # clip range ε
    beta: float = 0.01  # k3 KL coefficient, measured against the behaviour policy (no reference pass)
    aggregation: str = "row_token_mean"  # per masked copy: mean over its masked tokens; / rows
