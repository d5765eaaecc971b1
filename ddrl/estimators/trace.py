"""Trajectory-aware log-probs: TraceRL's states actually visited by the sampler.

Wang et al., "Revolutionizing RL Framework for Diffusion LLMs" (TraceRL), arXiv 2509.06949
(Gen-Verse/dLLM-RL @ 10b4fd1c train/rl_llada.py: `collapse_k_unique` and the "TraceRL" branch of
`prepare_inputs_and_labels_for_text`); docs/methods.md.

From the rollout's commit order (trajectory.commit_step [B, L], the sampler step at which each
token was committed):
  * `shrink` = k merges k consecutive decoding steps of a sequence into one training step (dLLM-RL's
    `collapse_k_unique`: the row's distinct commit steps, sorted, grouped k at a time);
  * for merged step s the state is: prompt clean, completion tokens with order < s clean, every
    token with order >= s masked; its targets are the tokens with order == s;
  * log pi(x^i) := log p_theta(x^i | state at which i was committed).

Block models (SDAR): a completion that ends inside a block is scored with mask tokens completing
that block (ddrl.processes.block "Whole blocks"). The sampler decodes those slots too and drops
them, so a token of such a last block committed after one of them is scored with it still masked,
not with the token the sampler had put there: the states are the sampler's everywhere else.

No randomness: the seed is unused. Positions without trajectory information (commit_step -1,
e.g. EOS fill written by an early exit) are masked in every state and never scored; scored
positions are also restricted to the completion mask. All (state, row) pairs with at least one
target go through the model as one batch (`rows_per_call` splits it), and only each state's
targets go through the LM head: B*L head positions in all, not states*B*L (a state scores the few
tokens committed in it; ddrl.ops.logprobs). seq_logp sums the token log-probs (the log-probability
of the decoding path); extras["trace_step"] [B, L] gives each token's merged step (-1 if unscored)
for objectives that normalise per state (TraceRL: each (sample, state) is one training row).

Row selection. dLLM-RL cuts the list of (sample, state) rows, sample-major, into micro-batches that
may split a sample's states. `row_chunks` gives those chunks; a micro-batch built from one holds
the samples it touches and batch.extras["trace_states"] [B, S] bool, the states to compute (others
are neither run nor scored). `count_rows` counts a step's rows, the normaliser of row_token_mean.

Memory. One call holds the activations of all its state rows until backward (the rows_per_call
results are concatenated), so a step's memory is bounded by the trainer running the estimator and
backward once per row chunk: the loss is additive over rows once row_token_mean's global count R
is fixed, so that gradient is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ddrl.estimators.common import forward_logprobs
from ddrl.registry import ESTIMATORS
from ddrl.types import COMMIT_ORDER, EstimatorOutput, RolloutBatch


def merged_steps(commit_step: Tensor, shrink: int) -> Tensor:
    """Each token's training step: the dense rank of its commit step within its row, // shrink.

    commit_step [B, L] long (-1 = no information) -> [B, L] long (-1 kept). The ranks come from a sort
    of each row (a step's rank = how many distinct valid steps come before it), not from a table
    sized by the largest step, whose size would be a host read.
    """
    if shrink < 1:
        raise ValueError(f"shrink must be >= 1, got {shrink}")
    valid = commit_step >= 0
    steps, where = commit_step.sort(dim=1)  # [B, L] ascending: the -1s first
    new = torch.ones_like(valid)
    new[:, 1:] = steps[:, 1:] != steps[:, :-1]  # [B, L] the first token of each distinct step
    dense_sorted = (new & (steps >= 0)).long().cumsum(1) - 1  # [B, L] rank of each sorted token's step
    rank = torch.empty_like(dense_sorted).scatter_(1, where, dense_sorted)  # [B, L] back in token order
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
    copies_per_row: ClassVar[int] = 1  # per training state (memory's k): its rows are train.micro_batch_rows
    needs_trajectory: ClassVar[bool] = True
    trajectory_record: ClassVar[str] = COMMIT_ORDER  # reads commit_step only: no per-step token_probs
    row_selection: ClassVar[str] = "trace_states"  # the extras key of a row chunk's states (Method.row_chunks)

    def states(self, batch: RolloutBatch) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The training states: (rows [N], masks [N, L] (True = masked), targets [N, L], order [B, L])."""
        if batch.trajectory is None:
            raise ValueError("the trace estimator needs batch.trajectory (sample with return_trajectory=True)")
        order = merged_steps(batch.trajectory.commit_step.to(batch.completion_ids.device), self.shrink)  # [B, L]
        scored = (order >= 0) & batch.completion_mask.bool()
        num_states = int(order.max()) + 1 if order.numel() else 0  # a host read: S sizes the [S, B, L] masks
        s = torch.arange(num_states, device=order.device)[:, None, None]  # [S, 1, 1]
        masks = (order[None] >= s) | (order[None] < 0)  # [S, B, L]
        targets = (order[None] == s) & scored[None]  # [S, B, L]
        keep = targets.any(-1)  # [S, B] states with something to score
        selected = batch.extras.get("trace_states")  # [B, S'] bool or absent: every state
        if selected is not None:
            chosen = torch.zeros(num_states, order.shape[0], dtype=torch.bool, device=order.device)
            n = min(num_states, selected.shape[1])
            chosen[:n] = selected[:, :n].T.to(order.device).bool()
            keep = keep & chosen
            targets = targets & keep[..., None]
        scored = targets.any(0)  # [B, L] the tokens some kept state scores
        B, L = order.shape
        kept = keep.reshape(-1).nonzero().squeeze(1)  # [N] (state, sample) pairs, state-major: the row count's read
        rows = kept % B  # [N]
        return (rows, masks.reshape(-1, L).index_select(0, kept), targets.reshape(-1, L).index_select(0, kept),
                torch.where(scored, order, -1))

    def row_table(self, batch: RolloutBatch) -> Tensor:
        """[B, S] bool: which (sample, state) pairs are training rows (a target, a valid reward)."""
        _, _, _, order = self.states(batch)
        S = int(order.max()) + 1 if order.numel() else 0
        table = (order[:, None, :] == torch.arange(S, device=order.device)[None, :, None]).any(-1)  # [B, S]
        return table & batch.reward_valid[:, None]

    def count_rows(self, batch: RolloutBatch) -> int:
        """Training rows of a (step) batch: the R of aggregation=row_token_mean, before summing over processes."""
        return int(self.row_table(batch).sum())

    def row_chunks(self, batch: RolloutBatch, rows_per_chunk: int) -> list[tuple[Tensor, Tensor]]:
        """dLLM-RL's micro-batches: the rows, sample-major and by state, cut every rows_per_chunk.

        Returns [(samples [n] long, trace_states [n, S] bool)]: build a micro-batch as
        batch.index(samples) with extras["trace_states"] = trace_states.
        """
        table = self.row_table(batch)  # [B, S]
        pairs = table.nonzero()  # [R, 2] (sample, state), sample-major
        chunks = []
        for start in range(0, pairs.shape[0], rows_per_chunk):
            part = pairs[start:start + rows_per_chunk]
            samples = torch.unique(part[:, 0])  # sorted
            selection = torch.zeros(samples.numel(), table.shape[1], dtype=torch.bool, device=table.device)
            selection[torch.searchsorted(samples, part[:, 0]), part[:, 1]] = True
            chunks.append((samples, selection))
        return chunks

    def __call__(self, model, batch: RolloutBatch, seed: int) -> EstimatorOutput:
        rows, masks, targets, order = self.states(batch)
        B, L = batch.completion_ids.shape
        token_logp = torch.zeros(B, L, device=batch.completion_ids.device)
        if rows.numel() > 0:
            completion_in = torch.where(masks, model.mask_token_id, batch.completion_ids[rows])
            lp = forward_logprobs(model, batch.prompt_ids[rows], batch.prompt_mask[rows], completion_in,
                                  batch.completion_ids[rows], rows_per_call=self.rows_per_call,
                                  scored=targets)  # [N, L], 0 off each state's targets
            # each scored token is the target of exactly one state: scatter its log-prob back to its row
            token_logp = token_logp.to(lp.dtype).index_put((rows,), torch.where(targets, lp, 0.0), accumulate=True)
        mask = order >= 0
        return EstimatorOutput(token_logp=token_logp, seq_logp=token_logp.sum(1), mask=mask,
                               extras={"trace_step": order})
