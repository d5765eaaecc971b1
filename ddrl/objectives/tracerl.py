"""TraceRL: token-level PPO on the states the sampler actually visited.

Paper: Wang et al., "Revolutionizing Reinforcement Learning Framework for Diffusion Large Language
Models" (TraceRL / TraDo), arXiv 2509.06949. Code: Gen-Verse/dLLM-RL @ 10b4fd1c, train/rl_llada.py
(`prepare_inputs_and_labels_for_text`, method "TraceRL", and `forward_process`); docs/methods.md.

    the `trace` estimator turns each sample into training rows, one per (merged) sampler state s:
    tokens committed at s are its targets, every token committed at s or later is masked
    ℓ_row = -(1/|targets|) Σ_{i∈targets} min(ρ_i A, clip(ρ_i,1±ε) A),   ρ_i = π_θ(x^i|state)/π_old(x^i|state)
    L     = Σ_rows ℓ_row / R  +  β Σ_rows Σ_{i∈targets} k3(π_old, π_θ)_i / R      (R = number of rows)
    A     = per-prompt z-score with the population std

So the KL is measured against the BEHAVIOUR policy and each state weighs as one row (the earlier
ddrl form, one mean per sample and a KL summed per sample, made the KL weigh 64x more for the
LLaDA recipe). `aggregation = row_token_mean` divides by the step's global number of rows R
(AggregationCounts.rows, counted by the update planner); `row_token_mean_local` divides by the micro-batch's own rows,
exactly dLLM-RL's forward_process for one of its micro-batches (the golden test uses it).

The released loop is part of the method: old log-probs are computed once per rollout, then many
optimizer steps run over the rollout's state rows (~64 for the LLaDA recipe), on prompts whose
fraction correct is within [0.2, 0.8], with answers cut off at the length limit scored wrong. In
ddrl: train.minibatches (optimizer steps over shares of the groups, old log-probs fixed),
train.group_filter=[0.2, 0.8], train.truncated_reward=0 (configs/paper/tracerl_llada8b.yaml). With one
update per rollout (train.num_iterations = train.minibatches = 1) old = sg(current), ρ ≡ 1 and the
k3 term has zero gradient. Deviation: a ddrl minibatch holds whole groups (every state of its
samples); dLLM-RL cuts the sample-major list of state rows, so a minibatch may split a sample.

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
    source: ClassVar[str] = "Gen-Verse/dLLM-RL@10b4fd1 train/rl_llada.py forward_process (method TraceRL)"
    formula: ClassVar[str] = "per trace state: mean over its targets of -min(ρA, clip(ρ)A), / rows; + β·Σk3(old,θ)/rows"
    default_estimator: ClassVar[str] = "trace"
    default_advantage: ClassVar[str] = "zscore"
    default_advantage_std: ClassVar[str] = "population"
    default_advantage_eps: ClassVar[float] = 0.0  # no eps: a group with std 0 gets advantages 0 (rl_reward.py)
    kl_against: ClassVar[str] = "old"
    kl_aggregation: ClassVar[str | None] = "row_token_sum"
    estimator_needs_trajectory: ClassVar[bool] = True

    epsilon: float = 0.2  # clip range ε
    beta: float = 0.01  # k3 KL coefficient, measured against the behaviour policy (no reference pass)
    aggregation: str = "row_token_mean"  # per trace state: mean over its targets; / rows (row_token_mean_local: dLLM-RL)
