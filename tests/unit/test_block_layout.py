"""One block layout for sampler, estimators and pretraining (ddrl.processes.block).

The layout is SDAR's (block = position // block_size, prompt included). These tests check that the
likelihood estimators, which call a block model with a plain 2-D padding mask, score exactly the
states the block sampler visited, for prompts of every length: a TraceRL run on a block model must
not train on states the sampler never saw.
"""

from __future__ import annotations

import pytest
import torch

from ddrl.config import SamplerConfig
from ddrl.estimators import MeanField, Trace
from ddrl.models import DiffusionLM
from ddrl.models.transformer import Denoiser, DenoiserConfig
from ddrl.processes.block import block_attention, block_ids, completion_blocks
from ddrl.sampling.masked import sample_block
from ddrl.types import RolloutBatch

V, MASK, PAD, EOS = 24, 23, 0, 1
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13], [14, 15, 16, 17]]  # end 3, 1, 1, 0 tokens into a block of 4


def block_model(block_size: int = 4) -> DiffusionLM:
    backbone = Denoiser(DenoiserConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=2, max_seq_len=64,
                                       block_size=block_size, init_std=0.4), seed=3)
    return DiffusionLM(backbone, mask_token_id=MASK, pad_token_id=PAD, eos_token_id=EOS, vocab_size=V,
                       block_size=block_size, suppress_mask_logit=True).eval()


def left_pad(prompts):
    P = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[False] * (P - len(p)) + [True] * len(p) for p in prompts])
    return ids, mask


def rollout(model, threshold=None):
    ids, mask = left_pad(PROMPTS)
    cfg = SamplerConfig(name="block", steps=12, gen_length=12, temperature=0.0, cache="auto", early_exit=False,
                        threshold=threshold)
    out = sample_block(model, ids, mask, cfg, generator=None, return_trajectory=True)
    B, L = out.completion_ids.shape
    batch = RolloutBatch(prompt_ids=ids, prompt_mask=mask, completion_ids=out.completion_ids,
                         completion_mask=torch.ones(B, L, dtype=torch.bool), group_ids=torch.arange(B),
                         rewards=torch.zeros(B), advantages=torch.zeros(B), mask_seeds=torch.tensor([0]),
                         trajectory=out.trajectory)
    return out, batch


def test_layout_by_hand():
    valid = torch.tensor([[False, True, True, True, True, True, True]])  # 1 pad, then 6 real tokens
    assert block_ids(valid, 4).tolist() == [[0, 0, 0, 0, 0, 1, 1]]  # the pad gets block 0, never attended
    attend = block_attention(valid, 4)[0]
    assert attend[1].tolist() == [False, True, True, True, True, False, False]  # block 0 sees block 0 only
    assert attend[5].tolist() == [False, True, True, True, True, True, True]
    # completion blocks counted from the block the prompt ends in
    assert completion_blocks(torch.tensor([[False] + [True] * 3, [True] * 4]), 6, 4).tolist() == [[0, 1, 1, 1, 1, 2],
                                                                                      [0, 0, 0, 0, 1, 1]]


@pytest.mark.parametrize("threshold", [None, 0.3])
def test_trace_estimator_scores_the_states_the_block_sampler_visited(threshold):
    model = block_model()
    out, batch = rollout(model, threshold)
    with torch.no_grad():
        est = Trace(shrink=1)(model, batch, seed=0)
    at_commit = out.trajectory.token_probs.gather(1, out.trajectory.commit_step[:, None, :]).squeeze(1)  # [B, L]
    torch.testing.assert_close(est.token_logp.double(), at_commit.double().log(), atol=1e-5, rtol=0)


def test_mean_field_scores_the_first_block_in_the_sampler_first_state():
    # With everything masked, a token of the completion's first block sees the prompt and its own
    # block only: the sampler's state at the block's first step.
    model = block_model()
    out, batch = rollout(model)
    with torch.no_grad():
        est = MeanField(p_mask_prompt=0.0)(model, batch, seed=0)
    first = completion_blocks(batch.prompt_mask, 12, 4) == 0  # [B, L]
    step0 = out.trajectory.token_probs[:, 0].double().log()  # [B, L]
    torch.testing.assert_close(est.token_logp.double()[first], step0[first], atol=1e-5, rtol=0)
