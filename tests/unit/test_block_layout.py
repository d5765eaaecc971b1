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
    """Exactly, except in a last block that reaches past gen_length (rows 0-2 here): the sampler also
    decodes that block's trailing slots and drops them, so a token committed after one of them was
    is scored with it still masked (the Trace module doc)."""
    model = block_model()
    out, batch = rollout(model, threshold)
    with torch.no_grad():
        est = Trace(shrink=1)(model, batch, seed=0)
    at_commit = out.trajectory.token_probs.gather(1, out.trajectory.commit_step[:, None, :]).squeeze(1)  # [B, L]
    L = batch.completion_ids.shape[1]
    blocks = completion_blocks(batch.prompt_mask, L, 4)  # [B, L]
    tailed = (batch.prompt_mask.sum(1) + L) % 4 != 0  # [B]
    exact = ~((blocks == blocks.max(1, keepdim=True).values) & tailed[:, None])
    assert tailed.tolist() == [True, True, True, False] and exact.sum() > L * 3
    torch.testing.assert_close(est.token_logp.double()[exact], at_commit.double().log()[exact], atol=1e-5, rtol=0)
    assert bool(torch.isfinite(est.token_logp).all()) and bool((est.token_logp <= 0).all())


def test_estimators_see_the_last_block_whole():
    """A completion that ends inside a block is scored with mask tokens completing that block: the
    view the block sampler decodes it in (SDAR's whole blocks). forward_logprobs on a left-padded
    batch == each unpadded row run with those mask tokens appended, and != the row without them."""
    from ddrl.estimators.common import forward_logprobs

    model = block_model()
    ids, mask = left_pad(PROMPTS)  # 3, 5, 1, 4 real tokens; + L = 6: tails 3, 1, 1, 2
    L = 6
    completion = torch.randint(2, 20, (len(PROMPTS), L), generator=torch.Generator().manual_seed(0))
    noisy = completion.masked_fill(torch.tensor([False, True, False, True, True, False]), MASK)
    with torch.no_grad():
        lp = forward_logprobs(model, ids, mask, noisy, completion)  # [B, L]
        for row, prompt in enumerate(PROMPTS):
            tail = -(len(prompt) + L) % 4
            for extra, same in ((tail, True), (0, False)):
                seq = torch.tensor([prompt + noisy[row].tolist() + [MASK] * extra])
                logits = model(seq).logits[0, len(prompt):len(prompt) + L].double()  # [L, V]
                want = logits.log_softmax(-1).gather(-1, completion[row, :, None])[:, 0]
                last = slice(L - (len(prompt) + L) % 4, L)  # the completion's tokens in the last block
                if same:
                    torch.testing.assert_close(lp[row].double(), want, atol=1e-5, rtol=0)
                else:
                    assert (lp[row, last].double() - want[last]).abs().max() > 1e-4  # the tail matters


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


class LayoutCheck(torch.nn.Module):
    """Passes every call through and checks it: a call with a plain 2-D padding mask must give the
    logits of the same call under the explicit block layout (block_attention), so an estimator
    that leaves the layout to the model scores it in the sampler's layout."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.calls = model, 0
        self.mask_token_id, self.vocab_size, self.block_size = model.mask_token_id, model.vocab_size, model.block_size
        self.process, self.eos_token_id, self.pad_token_id = model.process, model.eos_token_id, model.pad_token_id

    def forward(self, input_ids, attention_mask=None, **kwargs):
        out = self.inner(input_ids, attention_mask=attention_mask, **kwargs)
        if attention_mask is not None and attention_mask.dim() == 2 and not kwargs:
            valid = attention_mask.bool()
            explicit = self.inner(input_ids, attention_mask=block_attention(valid, self.block_size),
                                  position_ids=(valid.long().cumsum(1) - 1).clamp(min=0)).logits
            torch.testing.assert_close(out.logits[valid], explicit[valid], atol=1e-5, rtol=0)  # padding is never read
            self.calls += 1
        return out


@pytest.mark.parametrize("name", ["random_ratio", "coupled_elbo", "spg", "mean_field", "trace"])
def test_every_estimator_scores_block_models_in_the_sampler_layout(name):
    from ddrl.registry import ESTIMATORS

    model = block_model()
    _, batch = rollout(model)
    checked = LayoutCheck(model)
    with torch.no_grad():
        ESTIMATORS.get(name)()(checked, batch, seed=0)
    assert checked.calls > 0


def test_a_block_size_that_contradicts_the_backbone_is_refused():
    backbone = Denoiser(DenoiserConfig(vocab_size=V, d_model=32, n_layers=1, n_heads=2, block_size=None))
    with pytest.raises(ValueError, match="contradicts the backbone"):
        DiffusionLM(backbone, mask_token_id=MASK, vocab_size=V, block_size=4)
    from ddrl.estimators.staircase import Staircase

    _, batch = rollout(block_model())
    with pytest.raises(ValueError, match="contradicts the block model"):
        Staircase(block_size=8)(block_model(), batch, seed=0)
