"""Random-ratio masking: UniGRPO's log-prob proxy (MMaDA).

Yang et al., "MMaDA: Multimodal Large Diffusion Language Models", arXiv 2505.15809; the RL code is
Gen-Verse/dLLM-RL @ 10b4fd1c train/rl_llada.py (`method: random_masking`, `mask_times_per_sample`).

    t ~ U(lower, upper) per copy and sequence;  mask each real completion token iid with prob t
    log pi(x^i) := log p_theta(x^i | x_t, c)  on masked tokens only (no 1/t weight)

The prompt stays clean. As in dLLM-RL (`tail_pad` positions), tokens after the first EOS are
always masked and never scored. In dLLM-RL every copy is its own training row with its own ratio:
extras["copy_token_logp"] [C, B, L] (0 where unscored) and extras["copy_mask"] [C, B, L] keep the
copies for objectives that score rows (UniGRPO's row_token_mean). token_logp is, for the others,
a token's mean over the copies that masked it; a token no copy masked carries no signal (mask
False). seq_logp is the mean over the scored tokens (0 if none was masked).

Row chunks (train.micro_batch_rows). dLLM-RL trains the (sample, copy) rows a few at a time; one
call here would hold the activations of all copies x rows until backward (35 copies of 8 LLaDA-8B
rows are ~92 GB with gradient checkpointing). `row_chunks` cuts the rows sample-major, as TraceRL's
trace states are cut (ddrl.estimators.trace), and a micro-batch built from a chunk holds the WHOLE
batch with extras["copy_rows"] [B, C] naming the rows it computes: its masks are drawn for the whole
batch, so they are the ones an uncut call draws, and the other rows are neither run nor scored. The
row aggregations sum per-row losses over the step's global row count (`count_rows`), so the chunks'
losses and gradients add up to the uncut ones exactly. token_logp / seq_logp of a chunk average over
its own copies only, which is why micro_batch_rows needs a row aggregation (ddrl.config checks).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ddrl.estimators.common import forward_logprobs, generator_from_seed, masked_mean, per_group_draws, uniform
from ddrl.registry import ESTIMATORS
from ddrl.types import EstimatorOutput, RolloutBatch


@ESTIMATORS.register("random_ratio")
@dataclass
class RandomRatio:
    lower: float = 0.1  # smallest mask ratio t (dLLM-RL lower_p)
    upper: float = 0.9  # largest mask ratio t (dLLM-RL upper_p)
    copies: int = 1  # masked copies per sequence (dLLM-RL mask_times_per_sample), batched in one call
    # (train.micro_batch_rows: at most that many (sample, copy) rows per forward and backward)
    rows_per_call: int | None = None  # at most this many sequences per forward call (memory); None = one call
    mask_per_group: bool = False  # each group's masks from its own seed (ddrl.estimators.common); False = dLLM-RL's

    name: ClassVar[str] = "random_ratio"
    paper: ClassVar[str] = "UniGRPO / MMaDA (Yang et al. 2025, arXiv 2505.15809)"
    formula: ClassVar[str] = "t~U(0.1,0.9); log pi(x^i) = log p(x^i | x_t) on masked tokens, no 1/t"
    passes: ClassVar[str] = "copies"
    needs_trajectory: ClassVar[bool] = False
    row_selection: ClassVar[str] = "copy_rows"  # the extras key of a row chunk's rows (Method.row_chunks)
    rows_share_tokens: ClassVar[bool] = True  # a token is scored by several rows: chunks need a row loss

    @property
    def copies_per_row(self) -> int:
        """Copies of a row in one call's forward and backward graph (ddrl.training.memory's k)."""
        return self.copies

    def __call__(self, model, batch: RolloutBatch, seed: int) -> EstimatorOutput:
        if not 0.0 <= self.lower <= self.upper <= 1.0:
            raise ValueError(f"random_ratio needs 0 <= lower <= upper <= 1, got {self.lower}, {self.upper}")
        t, masked = self.draw_masks(batch, seed)
        out = self.score(model, batch, masked)
        out.extras["t"] = t[..., 0].mean(0)
        return out

    def draw_masks(self, batch: RolloutBatch, seed: int) -> tuple[Tensor, Tensor]:
        """The copies' ratios t [C, B, 1] and masks [C, B, L] bool (True = masked), before post-EOS."""
        if self.mask_per_group:
            return per_group_draws(dataclasses.replace(self, mask_per_group=False).draw_masks, batch, seed)
        g = generator_from_seed(seed)
        C, (B, L) = self.copies, batch.completion_ids.shape
        device = batch.completion_ids.device
        t = self.lower + (self.upper - self.lower) * uniform((C, B, 1), g, device)  # [C, B, 1]
        return t, uniform((C, B, L), g, device) < t

    def row_table(self, batch: RolloutBatch) -> Tensor:
        """[B, C] bool: the (sample, copy) training rows, those of samples with a valid reward."""
        return batch.reward_valid[:, None].expand(-1, self.copies)

    def count_rows(self, batch: RolloutBatch) -> int:
        """Training rows of a (step) batch: the R of aggregation=row_token_mean, before summing over processes."""
        return int(self.row_table(batch).sum())

    def row_chunks(self, batch: RolloutBatch, rows_per_chunk: int) -> list[tuple[Tensor, Tensor]]:
        """The (sample, copy) rows, sample-major as dLLM-RL orders them, cut every rows_per_chunk.

        Returns [(samples [B] long: every sample, copy_rows [B, C] bool)]: a chunk's micro-batch holds
        the whole batch (its masks are the uncut call's) and computes only its rows (module doc).
        """
        table = self.row_table(batch)  # [B, C]
        pairs = table.nonzero()  # [R, 2] (sample, copy), sample-major
        every = torch.arange(table.shape[0], device=table.device)
        chunks = []
        for start in range(0, pairs.shape[0], rows_per_chunk):
            part = pairs[start:start + rows_per_chunk]
            selection = torch.zeros_like(table)
            selection[part[:, 0], part[:, 1]] = True
            chunks.append((every, selection))
        return chunks

    def score(self, model, batch: RolloutBatch, masked: Tensor) -> EstimatorOutput:
        """The estimate for given masks [C, B, L] bool (True = masked); post-EOS is masked on top.
        Only the rows batch.extras["copy_rows"] [B, C] names are computed (all when absent)."""
        real = batch.completion_mask.bool()
        masked = masked.to(real.device) | ~real  # post-EOS always masked
        C, B, L = masked.shape
        rows = batch.extras.get(self.row_selection)  # [B, C] bool: a row chunk's rows
        device = real.device
        if rows is None:  # every (copy, sample) row, copy-major: all rows of copy 0 first, as one [C*B] batch
            chosen = torch.ones(C, B, dtype=torch.bool, device=device)
            c = torch.arange(C, device=device).repeat_interleave(B)  # [C*B], no host read
            b = torch.arange(B, device=device).repeat(C)
        else:  # a row chunk's rows, copy-major: their count is a host read (it sizes the forward)
            chosen = rows.T.to(device).bool()  # [C, B]
            c, b = chosen.nonzero(as_tuple=True)
        scored = masked & real & chosen[..., None]  # [C, B, L]
        completion_in = torch.where(masked[c, b], model.mask_token_id, batch.completion_ids[b])  # [N, L]
        rows_lp = forward_logprobs(model, batch.prompt_ids[b], batch.prompt_mask[b], completion_in,
                                   batch.completion_ids[b], rows_per_call=self.rows_per_call)  # [N, L]
        lp = rows_lp.new_zeros(C, B, L).index_put((c, b), rows_lp)  # [C, B, L]
        token_logp = masked_mean(lp, scored, dim=0)  # [B, L], mean over the copies that masked i
        mask = scored.any(0)
        return EstimatorOutput(token_logp=token_logp * mask, seq_logp=masked_mean(token_logp, mask, dim=1), mask=mask,
                               extras={"copy_token_logp": lp * scored, "copy_mask": scored})
