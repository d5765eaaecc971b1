"""The rehearsal sizes an estimator's own training rows as the recipe's GPU step does (issue 33).

HostReads answers a data-dependent read with a stand-in, "every element" by default. For TraceRL's
states and UniGRPO's copy chunks that stand-in is not the recipe's step: `int(order.max())` answered
1 made every row 2 states whatever the sampler's steps, torch.unique of a chunk's samples made one
sample per row (64 samples x 2 states for a 64-row chunk), and a UniGRPO chunk computed all
35 copies x 8 samples instead of its 70 rows. recipe_answers gives the recipe's own, by hand:

  TraceRL LLaDA-8B (configs/paper/tracerl_llada8b.yaml): 512 steps of one token each, shrink 8:
  512 / 8 = 64 states a row; micro_batch_rows 64 = one sample's states a chunk.
  UniGRPO: micro_batch_rows 70 of the slice's 35 copies x 8 samples = 280 rows: 4 chunks of 70.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import ddrl.estimators.random_ratio as random_ratio
from ddrl.estimators.random_ratio import RandomRatio
from ddrl.estimators.trace import Trace
from ddrl.training.rehearse import HostReads, recipe_answers

L = 512  # gen_length


def batch(samples: int, **extras: torch.Tensor) -> SimpleNamespace:
    """A fake RolloutBatch's fields that the estimators' row code reads."""
    return SimpleNamespace(trajectory=SimpleNamespace(commit_step=torch.zeros(samples, L, dtype=torch.long)),
                           completion_ids=torch.zeros(samples, L, dtype=torch.long),
                           completion_mask=torch.ones(samples, L, dtype=torch.long),
                           prompt_ids=torch.zeros(samples, 8, dtype=torch.long),
                           prompt_mask=torch.ones(samples, 8, dtype=torch.long),
                           reward_valid=torch.ones(samples, dtype=torch.bool), extras=dict(extras))


def trace_shapes(answers: dict[str, int]) -> tuple[tuple[int, int], list[int], tuple[int, int]]:
    """(row table [B, S], each chunk's sample count, one chunk's state masks [N, L]) under HostReads."""
    trace = Trace(shrink=8)
    with FakeTensorMode(allow_non_fake_inputs=True), HostReads() as reads:
        reads.answers = answers
        share = batch(8)  # one group: an optimizer step's share of the recipe
        table = trace.row_table(share)
        chunks = trace.row_chunks(share, 64)
        samples, selection = chunks[0]
        _, masks, _, _ = trace.states(batch(samples.numel(), trace_states=selection))
    return tuple(table.shape), [s.numel() for s, _ in chunks], tuple(masks.shape)


def test_trace_rows_are_the_recipes_states_not_the_quick_runs():
    cfg = SimpleNamespace(train=SimpleNamespace(micro_batch_rows=64), rollout=SimpleNamespace(steps=16, gen_length=L))
    answers = recipe_answers(Trace(shrink=8), cfg, recipe_steps=512)  # --quick's 16 steps, the recipe's 512
    table, chunk_samples, masks = trace_shapes(answers)
    assert table == (8, 64)  # 512 / 8 states a row
    assert chunk_samples == [1] * 8  # 8 x 64 rows in chunks of 64: one sample each
    assert masks == (64, L)  # a chunk computes its 64 rows
    # without the recipe's answers: 2 states a row and 16 "samples" in the one chunk, 32 rows
    assert trace_shapes({}) == ((8, 2), [16], (32, L))


def test_unigrpo_chunk_computes_its_rows_not_every_copy(monkeypatch):
    cfg = SimpleNamespace(train=SimpleNamespace(micro_batch_rows=70), rollout=SimpleNamespace(steps=512, gen_length=L))
    copies = RandomRatio(copies=35, lower=0.1, upper=0.9)
    seen = []

    def forward_logprobs(model, prompt_ids, prompt_mask, completion_in, targets, **kwargs):
        seen.append(completion_in.shape[0])
        return torch.zeros(completion_in.shape)

    monkeypatch.setattr(random_ratio, "forward_logprobs", forward_logprobs)
    for answers in (recipe_answers(copies, cfg), {}):
        with FakeTensorMode(allow_non_fake_inputs=True), HostReads() as reads:
            reads.answers = answers
            share = batch(8)
            chunks = copies.row_chunks(share, 70)
            assert len(chunks) == 4  # 280 rows / 70
            _, selection = chunks[0]
            copies(SimpleNamespace(mask_token_id=0), batch(8, copy_rows=selection), seed=0)
    assert seen == [70, 35 * 8]  # the recipe's chunk; without the answers every copy of every sample
