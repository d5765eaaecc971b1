"""Trajectory-aware log-probs: TraceRL's states actually visited by the sampler.

Wang et al., "Revolutionizing RL Framework for Diffusion LLMs" (TraceRL), arXiv 2509.06949
(Gen-Verse/dLLM-RL train/rl_llada.py: `collapse_k_unique`, trace construction). ALGORITHMS.md §10.4.

From the rollout's commit order (trajectory.commit_step [B, L], the sampler step at which each
token was committed):
  * `shrink` = k merges k consecutive decoding steps of a sequence into one training step (dLLM-RL's
    `collapse_k_unique`: the row's distinct commit steps, sorted, grouped k at a time);
  * for merged step s the state is: prompt clean, completion tokens with order < s clean, every
    token with order >= s masked; its targets are the tokens with order == s;
  * log pi(x^i) := log p_theta(x^i | state at which i was committed).

No randomness: the seed is unused. Positions without trajectory information (commit_step -1,
e.g. EOS fill written by an early exit) are masked in every state and never scored; scored
positions are also restricted to the completion mask. All (state, row) pairs with at least one
target go through the model as one batch. seq_logp sums the token log-probs (the log-probability
of the decoding path); extras["trace_step"] [B, L] gives each token's merged step (-1 if unscored)
for objectives that normalise per state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ddrl.estimators.common import forward_logprobs
from ddrl.registry import ESTIMATORS
from ddrl.types import EstimatorOutput, RolloutBatch


def merged_steps(commit_step: Tensor, shrink: int) -> Tensor:
    """Each token's training step: the dense rank of its commit step within its row, // shrink.

    commit_step [B, L] long (-1 = no information) -> [B, L] long (-1 kept).
    """
    if shrink < 1:
        raise ValueError(f"shrink must be >= 1, got {shrink}")
    valid = commit_step >= 0
    S = int(commit_step.max().item()) + 1 if valid.any() else 1
    steps = commit_step.clamp(min=0)
    present = torch.zeros(commit_step.shape[0], S, dtype=torch.long, device=commit_step.device)
    present.scatter_add_(1, steps, valid.long())  # [B, S] tokens committed at step s
    dense = present.clamp(max=1).cumsum(1) - 1  # [B, S] rank of step s among the row's used steps
    rank = dense.gather(1, steps)  # [B, L]
    return torch.where(valid, rank // shrink, -1)


@ESTIMATORS.register("trace")
@dataclass
class Trace:
    shrink: int = 1  # merge this many consecutive decoding steps into one training state (TraceRL LLaDA: 8)
    rows_per_call: int | None = None  # at most this many states per forward call (memory); None = one call

    name: ClassVar[str] = "trace"
    paper: ClassVar[str] = "TraceRL (Wang et al. 2025, arXiv 2509.06949)"
    formula: ClassVar[str] = "log pi(x^i) = log p(x^i | rollout state where i was committed: order>=s masked)"
    passes: ClassVar[str] = "decoding steps / shrink"
    needs_trajectory: ClassVar[bool] = True

    def states(self, batch: RolloutBatch) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The training states: (rows [N], masks [N, L] (True = masked), targets [N, L], order [B, L])."""
        if batch.trajectory is None:
            raise ValueError("the trace estimator needs batch.trajectory (sample with return_trajectory=True)")
        order = merged_steps(batch.trajectory.commit_step.to(batch.completion_ids.device), self.shrink)  # [B, L]
        scored = (order >= 0) & batch.completion_mask.bool()
        num_states = int(order.max().item()) + 1 if (order >= 0).any() else 0
        s = torch.arange(num_states, device=order.device)[:, None, None]  # [S, 1, 1]
        masks = (order[None] >= s) | (order[None] < 0)  # [S, B, L]
        targets = (order[None] == s) & scored[None]  # [S, B, L]
        keep = targets.any(-1)  # [S, B] states with something to score
        rows = torch.arange(order.shape[0], device=order.device).expand(num_states, -1)[keep]  # [N]
        return rows, masks[keep], targets[keep], torch.where(scored, order, -1)

    def __call__(self, model, batch: RolloutBatch, seed: int) -> EstimatorOutput:
        rows, masks, targets, order = self.states(batch)
        B, L = batch.completion_ids.shape
        token_logp = torch.zeros(B, L, device=batch.completion_ids.device)
        if rows.numel() > 0:
            completion_in = torch.where(masks, model.mask_token_id, batch.completion_ids[rows])
            lp = forward_logprobs(model, batch.prompt_ids[rows], batch.prompt_mask[rows], completion_in,
                                  batch.completion_ids[rows], rows_per_call=self.rows_per_call)  # [N, L]
            # each scored token is the target of exactly one state: scatter its log-prob back to its row
            token_logp = token_logp.index_put((rows,), torch.where(targets, lp, 0.0), accumulate=True)
        mask = order >= 0
        return EstimatorOutput(token_logp=token_logp, seq_logp=token_logp.sum(1), mask=mask,
                               extras={"trace_step": order})
