"""Block diffusion: the one-pass staircase ELBO equals the block-by-block computation.

The model here is a tiny two-layer attention network (learned position embeddings indexed by
position_ids, a 4-D boolean attention mask), in float64 so that "equal" can mean 1e-5 or better.
Two layers matter: the clean-context tokens' own representations must also be block-causal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product

import numpy as np
import pytest
import torch
from torch import nn

from ddrl.processes import BlockMaskedProcess, blockwise_elbo, staircase_elbo, staircase_inputs

V, MASK, PAD = 7, 6, 0


@dataclass
class Output:
    logits: torch.Tensor


class TinyAttentionLM(nn.Module):
    """Embedding + position embedding -> n x (attention + tanh MLP) -> logits. Accepts a [B, T, T] mask."""

    def __init__(self, vocab_size: int = V, d: int = 16, n_layers: int = 2, max_pos: int = 32, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
        self.mask_token_id = MASK
        self.emb = nn.Parameter(r(vocab_size, d))
        self.pos = nn.Parameter(r(max_pos, d))
        self.qkv = nn.ParameterList([nn.Parameter(r(d, 3 * d) / d**0.5) for _ in range(n_layers)])
        self.mlp = nn.ParameterList([nn.Parameter(r(d, d) / d**0.5) for _ in range(n_layers)])
        self.out = nn.Parameter(r(d, vocab_size) / d**0.5 * 2)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T).expand(B, T)
        if attention_mask is None:
            attention_mask = torch.ones(B, T, dtype=torch.bool)
        if attention_mask.dim() == 2:  # padding mask
            attention_mask = attention_mask.bool()[:, None, :].expand(B, T, T)
        h = self.emb[input_ids] + self.pos[position_ids]
        for qkv, mlp in zip(self.qkv, self.mlp):
            q, k, v = (h @ qkv).chunk(3, dim=-1)
            scores = (q @ k.transpose(1, 2) / q.shape[-1] ** 0.5).masked_fill(~attention_mask, float("-inf"))
            h = h + torch.softmax(scores, -1) @ v
            h = h + torch.tanh(h @ mlp)
        return Output(h @ self.out)


def rule_mask(block_ids: list[list[int]], valid: list[list[bool]], stream: list[str]) -> torch.Tensor:
    """The staircase rules of ALGORITHMS.md §1.6, entry by entry (stream[j] = "clean" | "noisy")."""
    B, T2 = len(block_ids), len(stream)
    m = torch.zeros(B, T2, T2, dtype=torch.bool)
    for b, q, k in product(range(B), range(T2), range(T2)):
        bq, bk = block_ids[b][q], block_ids[b][k]
        allowed = {("clean", "clean"): bk <= bq, ("noisy", "clean"): bk < bq,
                   ("noisy", "noisy"): bk == bq, ("clean", "noisy"): False}[(stream[q], stream[k])]
        m[b, q, k] = (allowed and valid[b][k]) or q == k
    return m


def left_padded_batch():
    prompt_ids = torch.tensor([[PAD, PAD, 3, 4], [5, 1, 2, 3], [PAD, PAD, PAD, 2]])
    prompt_mask = prompt_ids != PAD
    completion = torch.tensor([[1, 2, 3, 4, 5], [5, 4, 3, 2, 1], [2, 2, 1, 1, 3]])
    return prompt_ids, prompt_mask, completion


def test_staircase_inputs_follow_the_rules():
    prompt_ids, prompt_mask, completion = left_padded_batch()
    noisy = torch.where(torch.arange(5) % 2 == 0, MASK, completion)
    ids, pos, attn = staircase_inputs(prompt_ids, prompt_mask, completion, noisy, block_size=2)
    P, L = 4, 5
    T = P + L
    assert torch.equal(ids, torch.cat([prompt_ids, completion, prompt_ids, noisy], 1))
    assert torch.equal(pos[:, :T], pos[:, T:])
    assert pos[0].tolist()[:T] == [0, 0, 0, 1, 2, 3, 4, 5, 6]  # padding does not shift positions
    valid = torch.cat([prompt_mask, torch.ones(3, L, dtype=torch.bool)], 1).tolist()
    # SDAR's layout: block = position // block_size over the real tokens, prompt included
    # (padding gets block 0 but is never attended).
    block = [[max(sum(v[:i + 1]) - 1, 0) // 2 for i in range(T)] for v in valid]
    expected = rule_mask([b + b for b in block], [v + v for v in valid], ["clean"] * T + ["noisy"] * T)
    assert torch.equal(attn, expected)


@pytest.mark.parametrize("block_size", [2, 3])
@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_one_pass_elbo_equals_blockwise(block_size, schedule):
    model = TinyAttentionLM()
    prompt_ids, prompt_mask, completion = left_padded_batch()
    completion_mask = torch.tensor([[True] * 5, [True] * 5, [True, True, True, False, False]])
    for seed in range(3):
        fast = staircase_elbo(model, prompt_ids, prompt_mask, completion, block_size, schedule=schedule,
                              generator=torch.Generator().manual_seed(seed), completion_mask=completion_mask)
        slow = blockwise_elbo(model, prompt_ids, prompt_mask, completion, block_size, schedule=schedule,
                              generator=torch.Generator().manual_seed(seed), completion_mask=completion_mask)
        assert torch.equal(fast[2], slow[2])  # same masks
        assert fast[2].any() and not (fast[2] & ~completion_mask).any()
        assert torch.allclose(fast[1], slow[1], atol=1e-5, rtol=0)
        assert torch.allclose(fast[0], slow[0], atol=1e-5, rtol=0)
        assert torch.allclose(fast[0], fast[1].sum(1))
        assert (fast[0] <= 0).all() and (fast[0] < 0).any()


def test_staircase_sees_clean_earlier_blocks_only():
    # Changing a token of block 2 must not move block 0/1 terms; changing block 0 must move block 1's.
    model = TinyAttentionLM(seed=1)
    prompt_ids, prompt_mask, completion = left_padded_batch()
    run = lambda c: staircase_elbo(model, prompt_ids, prompt_mask, c, 2,  # noqa: E731
                                   generator=torch.Generator().manual_seed(5))[1]
    base = run(completion)
    later = completion.clone()
    later[:, 4] = (later[:, 4] + 1) % 6
    assert torch.allclose(run(later)[:, :4], base[:, :4], atol=1e-12, rtol=0)
    earlier = completion.clone()
    earlier[:, 0] = (earlier[:, 0] + 1) % 6
    moved = (run(earlier)[:, 2:4] - base[:, 2:4]).abs()
    assert (moved[base[:, 2:4] != 0] > 1e-6).all()


def test_block_pretrain_loss_matches_exact_expectation():
    """BlockMaskedProcess.pretrain_loss (one staircase pass) against exact enumeration per block.

    Given the clean earlier blocks, block b's term depends only on t_b and block b's own mask, so
    E[NELBO] = sum_b (1/(1-eps)) int w(t) sum_{S subset of b} q(S|t) sum_{i in S} CE_i dt, with CE_i read from
    the block-causal forward pass on [prompt, clean blocks < b, block b with S masked].
    """
    eps, bs = 1e-3, 2
    model = TinyAttentionLM(seed=2)
    process = BlockMaskedProcess(MASK, block_size=bs)
    prompt, completion = [PAD, 3, 4], [1, 5, 2, 4]
    P, L = len(prompt), len(completion)
    valid = [False, True, True] + [True] * L
    positions = torch.tensor([0, 0, 1, 2, 3, 4, 5])

    u, w = np.polynomial.legendre.leggauss(40)
    t = torch.tensor(eps + (1 - eps) * (u + 1) / 2)
    w = torch.tensor(w * (1 - eps) / 2)
    exact = 0.0
    for b in range(L // bs):
        hi = P + (b + 1) * bs
        blocks = [-1] * P + [j // bs for j in range((b + 1) * bs)]
        mask = rule_mask([blocks], [valid[:hi]], ["clean"] * hi)
        for subset in product([False, True], repeat=bs):
            noisy = [MASK if s else v for s, v in zip(subset, completion[b * bs:(b + 1) * bs])]
            ids = torch.tensor([prompt + completion[:b * bs] + noisy])
            logits = model(ids, attention_mask=mask, position_ids=positions[None, :hi]).logits[0, P + b * bs:hi]
            ce = -torch.log_softmax(logits, -1)[torch.arange(bs), torch.tensor(completion[b * bs:(b + 1) * bs])]
            k = sum(subset)
            prob = t**k * (1 - t) ** (bs - k)
            exact += ((w * prob / t).sum() * ce[torch.tensor(subset)].sum()).item() / (1 - eps)

    n_chunks, rows = 16, 400
    x0 = torch.tensor(prompt + completion).repeat(rows, 1)
    eligible = torch.tensor([False] * P + [True] * L).repeat(rows, 1)
    attention_mask = torch.tensor(valid).repeat(rows, 1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        chunk_means = torch.stack([
            process.pretrain_loss(model, x0, eligible, attention_mask, generator=g, eps=eps)[0] * L
            for _ in range(n_chunks)
        ])
    mean, se = chunk_means.mean().item(), chunk_means.std().item() / math.sqrt(n_chunks)
    assert se < 0.03 * exact
    assert abs(mean - exact) < 4 * se, (mean, exact, se)
