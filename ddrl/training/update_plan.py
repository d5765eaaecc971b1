"""How one RL step's rollouts become optimizer steps, the same on 1 process and on N.

    filter     train.group_filter drops the groups whose mean reward is outside its band
    shares     train.minibatches shares of the step's GLOBAL groups, one optimizer step each
    skip       train.skip_uninformative drops the groups whose advantages are all zero
    micro      each share cut into micro-batches of whole groups (train.micro_batch_size), and again into
               the estimator's row chunks (train.micro_batch_rows)
    counts     each share's loss normalisers, summed over ranks, so the gradient is the 1-process one
    padding    zero-weight micro-batches up to the largest count of any rank, so that every rank runs
               the same passes and collectives
    groups     with fresh masks (StableDRL) or per-group masks (an estimator's mask_per_group), each
               micro-batch's groups as step-global indices (RolloutBatch.groups): masks are seeded
               from them, not from the rank

The trainer runs the plan (ddrl.training.trainer); nothing here computes a loss.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterator

import torch

from ddrl.config import TrainConfig
from ddrl.objectives import AggregationCounts
from ddrl.training.distributed import DistInfo, all_reduce_max, all_reduce_sum
from ddrl.training.method import Method
from ddrl.types import RolloutBatch

log = logging.getLogger(__name__)


@dataclass
class UpdatePlan:
    """The update of one RL step, the same shape on every rank."""

    micro: list[list[RolloutBatch]]  # micro-batches of each optimizer-step share, padded to equal counts
    counts: list[AggregationCounts]  # each share's loss normalisers, summed over ranks
    rows: int  # rows of this rank's real (not padding) micro-batches, for update/rows_frac


def passes(micro: list[list[RolloutBatch]], num_iterations: int) -> Iterator[tuple[int, int, int, RolloutBatch]]:
    """(k, m, j, micro-batch) of every inner iteration k, share m and micro-batch j."""
    for k in range(num_iterations):
        for m, share in enumerate(micro):
            for j, mb in enumerate(share):
                yield k, m, j, mb


class UpdatePlanner:
    """Plans each step's update from train.* (group_filter, skip_uninformative, minibatches,
    micro_batch_size, micro_batch_rows), the method and this process's place among the ranks."""

    def __init__(self, train: TrainConfig, method: Method, dist: DistInfo, device: torch.device):
        self.train, self.method, self.dist, self.device = train, method, dist, device
        self.steps_without_update = 0  # rollout steps whose groups train.group_filter dropped, all of them

    def plan(self, batch: RolloutBatch, kept: RolloutBatch) -> UpdatePlan | None:
        """The micro-batches of every optimizer step and their loss normalisers, or None when no rank
        has a group to learn from.

        A share's normalisers count the whole share (uninformative groups included) over all
        processes. Every rank cuts its share of the step into micro-batches, then pads them with
        zero-weight ones to the largest count of any rank (at least one, so a step whose gradient is
        zero still steps the optimizer), so all ranks run the same backward passes and collectives."""
        shares = self.minibatch_shares(kept)  # train.minibatches shares, some possibly empty
        cut = [self.micro_batches(share) for share in shares]
        local = [self._share_counts(share, len(pieces)) for share, pieces in zip(shares, cut)]
        totals = all_reduce_sum(torch.stack(local), self.dist).tolist()  # [M, 6], one collective
        informative = [self.informative_groups(share) for share in shares]
        learn = [self.micro_batches(share) for share in informative]
        widest = all_reduce_max(torch.tensor([len(pieces) for pieces in learn], device=self.device),
                                self.dist).tolist()
        micro, counts, rows = [], [], 0
        for share, pieces, total, width in zip(informative, learn, totals, widest):
            size, tokens, sequences, groups, n_micro, trace_rows = total
            if size == 0:  # this share is empty on every rank
                continue
            rows += len(share)
            micro.append(pieces + [self._padding(batch)] * (max(int(width), 1) - len(pieces)))
            counts.append(AggregationCounts(tokens=tokens, sequences=sequences, world_size=self.dist.world_size,
                                            groups=groups, micro_batches=n_micro,
                                            rows=trace_rows if self.method.has_rows else None))
        if not micro:
            return None
        if self.method.fresh_masks or self.method.masks_per_group:
            self._tag_groups(micro)
        return UpdatePlan(micro, counts, rows)

    def filter_groups(self, batch: RolloutBatch) -> RolloutBatch:
        """The groups train.group_filter keeps: mean valid reward within [lo, hi] (all when unset).
        A group left out is not trained on and not counted, as in dLLM-RL's data filter; each rank
        drops its own (plan pads the ranks left with fewer micro-batches)."""
        from ddrl.objectives.advantages import groups_in_band

        bounds = self.train.group_filter
        if bounds is None:
            return batch
        keep = groups_in_band(batch.rewards, batch.group_ids, bounds[0], bounds[1])
        return batch.index(keep.nonzero().squeeze(1))

    def minibatch_shares(self, batch: RolloutBatch) -> list[RolloutBatch]:
        """train.minibatches shares of the step's GLOBAL groups, one optimizer step each: the groups
        kept on all ranks, in data order, cut into consecutive shares, and this rank's part of share m
        is its own groups among them (often none: plan pads it, and drops a share empty on every
        rank). So 1 process and N processes make the same optimizer steps on the same groups;
        cutting each rank's groups instead left most shares empty (4 groups per rank, 32 shares)."""
        t = self.train
        if t.minibatches == 1:
            return [batch]
        offset = self.dist.rank * (t.prompts_per_step // self.dist.world_size)  # a rank's first global group
        kept = torch.zeros(t.prompts_per_step, device=self.device)  # [N] global groups
        kept[batch.group_ids + offset] = 1.0
        kept_ids = all_reduce_sum(kept, self.dist).nonzero().squeeze(1).tolist()  # kept on any rank, in order
        bounds = [round(i * len(kept_ids) / t.minibatches) for i in range(t.minibatches + 1)]
        share_of = torch.full((t.prompts_per_step,), -1, device=self.device)  # [N] each global group's share
        for m, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            share_of[kept_ids[lo:hi]] = m
        row_share = share_of[batch.group_ids + offset]  # [B]
        return [batch.index((row_share == m).nonzero().squeeze(1)) for m in range(t.minibatches)]

    def informative_groups(self, batch: RolloutBatch) -> RolloutBatch:
        """The groups that carry a gradient: those with a non-zero advantage, when every loss term of
        the method is multiplied by A (no KL, no regulariser). With binary rewards most groups are
        all-right or all-wrong, so this removes most of the old/ref/update compute. The losses are
        still divided by the whole step's counts, so the gradient is the one the full batch gives
        (exactly, for estimators without random masks; in distribution otherwise, since a row's
        masks depend on its place in the batch)."""
        if not self.train.skip_uninformative or not self.method.skip_safe or len(batch) == 0:
            return batch
        groups = batch.group_ids
        n_groups = self.train.prompts_per_step // self.dist.world_size  # a rank's group ids: 0 .. n - 1
        signal = torch.zeros(n_groups, device=groups.device).index_add(0, groups, (batch.advantages != 0).float())
        keep = signal[groups] > 0  # [B]
        return batch.index(keep.nonzero().squeeze(1))

    def micro_batches(self, batch: RolloutBatch) -> list[RolloutBatch]:
        """Slices of whole groups (group-level normalisations need the full group); with
        train.micro_batch_rows, each slice cut again into the estimator's own row chunks: TraceRL's
        (sample, state) rows or UniGRPO's (sample, copy) rows, sample-major, every N rows as dLLM-RL
        does, each micro-batch with extras[estimator.row_selection] naming the rows to compute (a
        sample may span two micro-batches; its loss is per row, so nothing needs the whole group).
        A copy chunk holds its whole slice, so its masks are the uncut slice's (RandomRatio)."""
        t = self.train
        if len(batch) == 0:
            return []
        size = t.micro_batch_size or len(batch)
        rows = max(1, size // t.group_size) * t.group_size
        pieces = [batch.index(slice(lo, lo + rows)) for lo in range(0, len(batch), rows)]
        if t.micro_batch_rows:
            return [chunk for piece in pieces for chunk in self.method.row_chunks(piece, t.micro_batch_rows)]
        return pieces

    def report_no_update(self, step: int) -> None:
        """One line per step that learns nothing because train.group_filter dropped every group, on
        every rank's data (plan is None only then), with how often it happened so far."""
        self.steps_without_update += 1
        if self.dist.is_main:
            assert self.train.group_filter is not None  # the only way a step has no plan
            lo, hi = self.train.group_filter
            log.warning("step %d made no update: train.group_filter=[%g, %g] dropped every group (each group's "
                        "mean reward is outside the band, e.g. all completions right or all wrong); %d step(s) of "
                        "this run so far made no update. Widen train.group_filter, raise train.group_size, or "
                        "unset it", step, lo, hi, self.steps_without_update)

    def _share_counts(self, share: RolloutBatch, n_micro: int) -> torch.Tensor:
        """[6] float64: rows, valid tokens, valid sequences, groups, micro-batches and training rows
        (TraceRL's trace states) of this rank's part of a share, to be summed over ranks."""
        if len(share) == 0:
            return torch.zeros(6, dtype=torch.float64, device=self.device)
        c = AggregationCounts.from_batch(share, self.dist.world_size, micro_batches=n_micro)
        rows = self.method.count_rows(share) if self.method.has_rows else 0.0
        return torch.tensor([len(share), c.tokens, c.sequences, c.groups, c.micro_batches, rows],
                            dtype=torch.float64, device=self.device)

    def _tag_groups(self, micro: list[list[RolloutBatch]]) -> None:
        """RolloutBatch.groups of every micro-batch: its groups' indices among the step's global groups
        (rank * groups per rank + the group id on the rank), in row order.
        The trainer draws fresh masks from (seed, step, iteration, pass, first group) and a
        mask_per_group estimator each group's from (seed, group), so a group gets the same masks on 1
        or N processes; a seed mixed with the rank changed StableDRL's updates with the GPU count.
        One host read a step."""
        pieces = [mb for share in micro for mb in share]
        ids = torch.cat([mb.group_ids for mb in pieces]).tolist()  # every micro-batch has a row
        offset = self.dist.rank * (self.train.prompts_per_step // self.dist.world_size)
        at = 0
        for mb in pieces:
            rows, at = ids[at:at + len(mb)], at + len(mb)
            groups = [g for i, g in enumerate(rows) if i == 0 or g != rows[i - 1]]  # a group's rows are consecutive
            mb.groups = [offset + int(g) for g in groups]

    def _padding(self, batch: RolloutBatch) -> RolloutBatch:
        """A zero-weight micro-batch: the rank's first micro-batch of the whole rollout, its rewards
        made valid so that it has rows to compute (TraceRL's state rows need them). Its loss is 0 x
        its log-probs: zero gradients, the same collectives as a real micro-batch."""
        full = batch.index(torch.arange(len(batch), device=batch.rewards.device))
        full.rewards = torch.zeros_like(full.rewards)
        full.advantages = torch.zeros_like(full.advantages)
        mb = self.micro_batches(full)[0]
        mb.padding = True
        return mb
