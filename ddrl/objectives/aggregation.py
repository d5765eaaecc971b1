"""Loss aggregation that gives the same gradient however the step's batch is split.

An optimizer step sees its rollouts in micro-batches (gradient accumulation) and, with torchrun,
on several processes. Dividing each micro-batch's loss by its *own* token or sequence count makes
the result depend on how the batch was cut (a short micro-batch weighs as much as a long one).
Every function here divides by the GLOBAL count of the step instead, carried by
`AggregationCounts`, and returns the micro-batch's *contribution*: summing the contributions of
all micro-batches on all processes gives exactly the full-batch loss and gradient.

    counts = AggregationCounts.from_batch(step_batch, micro_batches=len(micro_batches))  # this process's step
    counts = all-reduce(tokens, sequences, groups, micro_batches) over processes; world_size = N
    for micro in micro_batches:
        out = objective(micro, new, old, ref, counts=counts)
        (out.loss * counts.world_size).backward()              # DDP averages grads over N

DDP *averages* gradients over processes, so the trainer multiplies each contribution by
`counts.world_size` before backward; the average of N such gradients is then their sum.

Group-level operations (the softmax over a group in wd1 and StableDRL, leave-one-out) need the
whole group in one micro-batch: the trainer must cut micro-batches on group boundaries.

One reduction deliberately depends on the split, to reproduce released code that has it:
`micro_batch_token_mean` (d1's diffu-GRPO, TRL's GRPOTrainer of early 2025) divides each micro-batch
by its own token count and averages the micro-batches (gradient accumulation, then DDP), so a token
of a short micro-batch weighs more than one of a long micro-batch (docs/methods.md, diffu-GRPO).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ddrl.types import RolloutBatch


@dataclass
class AggregationCounts:
    """Global counts of the loss-bearing units in one optimizer step (all micro-batches, all processes).

    tokens:        completion tokens of rows with a valid reward (sum of the completion mask)
    sequences:     rows with a valid reward
    world_size:    number of data-parallel processes (the trainer scales losses by it before backward)
    groups:        prompt groups with at least one valid row (for per-group objectives: wd1, StableDRL)
    micro_batches: micro-batches of the step summed over all processes (gradient-accumulation steps x
                   world size when every process cuts the same number); only `micro_batch_token_mean`
                   reads it
    rows:          training rows of the step when an estimator makes several per sample (TraceRL's
                   trace states, UniGRPO's masked copies), summed over processes; None when a row is a sample. Read by the
                   row aggregations of ppo.TokenPPO.
    """

    tokens: float
    sequences: float
    world_size: int = 1
    groups: float | None = None
    micro_batches: float = 1.0
    rows: float | None = None

    @classmethod
    def from_batch(cls, batch: RolloutBatch, world_size: int = 1, micro_batches: int = 1) -> "AggregationCounts":
        """Counts of one process's step batch, cut into `micro_batches` micro-batches; sum them over
        processes (`+`) for the global counts."""
        valid = batch.reward_valid
        mask = batch.completion_mask.bool() & valid[:, None]
        groups = torch.unique(batch.group_ids[valid]).numel()
        return cls(float(mask.sum()), float(valid.sum()), world_size, float(groups), float(micro_batches))

    def __add__(self, other: "AggregationCounts") -> "AggregationCounts":
        """Counts of two disjoint parts of a step (e.g. two processes' batches)."""
        groups = None if self.groups is None or other.groups is None else self.groups + other.groups
        rows = None if self.rows is None or other.rows is None else self.rows + other.rows
        return AggregationCounts(self.tokens + other.tokens, self.sequences + other.sequences,
                                 max(self.world_size, other.world_size), groups,
                                 self.micro_batches + other.micro_batches, rows)

    def number_of_groups(self) -> float:
        if self.groups is None:
            raise ValueError("this objective normalises per prompt group: pass AggregationCounts(groups=...)")
        return self.groups


def _safe(count: float) -> float:
    return max(float(count), 1.0)  # an empty step contributes 0, never NaN


def masked(values: Tensor, mask: Tensor) -> Tensor:
    """values where mask, else 0 (also where values are inf/NaN at unmasked positions)."""
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def token_mean(values: Tensor, mask: Tensor, counts: AggregationCounts) -> Tensor:
    """Σ_{b,i} values·mask / global token count. values, mask: [B, L]."""
    return masked(values, mask).sum() / _safe(counts.tokens)


def sequence_token_mean(values: Tensor, mask: Tensor, counts: AggregationCounts) -> Tensor:
    """Per-sequence mean over its masked positions, summed over rows / global sequence count.

    A row with an empty mask contributes 0. values, mask: [B, L].
    """
    per_row = masked(values, mask).sum(1) / mask.sum(1).clamp(min=1)
    return per_row.sum() / _safe(counts.sequences)


def sequence_token_sum(values: Tensor, mask: Tensor, counts: AggregationCounts) -> Tensor:
    """Per-sequence sum over its masked positions / global sequence count. values, mask: [B, L]."""
    return masked(values, mask).sum() / _safe(counts.sequences)


def sequence_mean(values: Tensor, counts: AggregationCounts, mask: Tensor | None = None) -> Tensor:
    """Σ_b values_b (over rows where mask) / global sequence count. values, mask: [B]."""
    if mask is not None:
        values = masked(values, mask)
    return values.sum() / _safe(counts.sequences)


def length_weighted_mean(values: Tensor, lengths: Tensor, counts: AggregationCounts,
                         mask: Tensor | None = None) -> Tensor:
    """Σ_b values_b·len_b / Σ_b len_b with the global token count as Σ len (SPG). values, lengths: [B]."""
    weighted = values * lengths.to(values.dtype)
    if mask is not None:
        weighted = masked(weighted, mask)
    return weighted.sum() / _safe(counts.tokens)


def group_mean(values: Tensor, counts: AggregationCounts, mask: Tensor | None = None) -> Tensor:
    """Σ_b values_b / global number of groups: per-group sums averaged over groups. values: [B]."""
    if mask is not None:
        values = masked(values, mask)
    return values.sum() / _safe(counts.number_of_groups())


def micro_batch_token_mean(values: Tensor, mask: Tensor, counts: AggregationCounts) -> Tensor:
    """Σ_{b,i} values·mask / (this micro-batch's Σ mask) / global number of micro-batches.

    The released form of d1's diffu-GRPO (and TRL's GRPOTrainer it builds on): a token mean per
    micro-batch, then gradient accumulation and DDP average the micro-batches. Unlike `token_mean`
    the gradient depends on how the step is cut: with micro-batches of n_1 and n_2 tokens a token
    weighs 1/(2 n_j) instead of 1/(n_1 + n_2). A micro-batch without tokens contributes 0.
    values, mask: [B, L].
    """
    return masked(values, mask).sum() / mask.sum().clamp(min=1) / _safe(counts.micro_batches)


# The per-token reductions a token-level objective may choose by name (see ppo.py).
TOKEN_REDUCTIONS = {
    "token_mean": token_mean,
    "sequence_token_mean": sequence_token_mean,
    "sequence_token_sum": sequence_token_sum,
    "micro_batch_token_mean": micro_batch_token_mean,
}


def group_softmax(logits: Tensor, group_ids: Tensor, mask: Tensor | None = None) -> Tensor:
    """Softmax of logits [B] within each group of rows sharing a group id; rows outside mask get 0.

    Needs every member of a group in this call (micro-batches cut on group boundaries). The groups
    are a [B, B] same-group table, not a table sized by the number of groups: that size would be a
    host read of the group ids (torch.unique), and a micro-batch holds few rows."""
    if mask is None:
        mask = torch.ones_like(logits, dtype=torch.bool)
    same = group_ids[:, None] == group_ids[None, :]  # [B, B] rows b and b' share a group
    filled = torch.where(mask, logits, torch.full_like(logits, float("-inf")))  # [B]
    group_max = torch.where(same, filled[None, :], float("-inf")).amax(1)  # [B] the max of b's group
    shift = torch.where(torch.isfinite(group_max), group_max, torch.zeros_like(group_max))
    e = torch.where(mask, torch.exp(filled - shift), torch.zeros_like(logits))  # [B]
    total = torch.where(same, e[None, :], 0.0).sum(1)  # [B] the sum over b's group
    return e / total.clamp(min=torch.finfo(logits.dtype).tiny)
