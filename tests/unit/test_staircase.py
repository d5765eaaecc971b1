"""Block diffusion: the one-pass staircase ELBO equals the block-by-block computation, and the
`staircase` RL estimator gives SPG's per-token-mean bounds on block models.

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
    """The staircase rules of ddrl.processes.block's module doc, entry by entry (stream[j] = "clean" | "noisy")."""
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
    ids, pos, attn = staircase_inputs(prompt_ids, prompt_mask, completion, noisy, block_size=2, mask_token_id=MASK)
    P, L = 4, 5
    # Real prompt lengths 2, 4, 1: rows 0 and 1 end inside a block (7 and 9 tokens), so one mask
    # token completes their last block (SDAR's whole blocks); row 2 (6 tokens) gets padding there.
    tail = torch.tensor([[True], [True], [False]])
    filler = torch.full((3, 1), MASK)
    T = P + L + 1
    assert torch.equal(ids, torch.cat([prompt_ids, completion, filler, prompt_ids, noisy, filler], 1))
    assert torch.equal(pos[:, :T], pos[:, T:])
    assert pos[0].tolist()[:T] == [0, 0, 0, 1, 2, 3, 4, 5, 6, 7]  # padding does not shift positions
    valid = torch.cat([prompt_mask, torch.ones(3, L, dtype=torch.bool), tail], 1).tolist()
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


# --------------------------------------------------------------------------------------------
# The `staircase` RL estimator: SPG's bounds (per-token mean ELBO, EUBO) on block models
# --------------------------------------------------------------------------------------------


def rollout_batch():
    from ddrl.types import RolloutBatch

    prompt_ids, prompt_mask, completion = left_padded_batch()
    completion_mask = torch.tensor([[True] * 5, [True] * 4 + [False], [True, True, True, False, False]])
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion,
                        completion_mask=completion_mask, group_ids=torch.zeros(3, dtype=torch.long),
                        rewards=torch.tensor([1.0, 0.0, 0.5]), advantages=torch.tensor([0.5, -0.5, 0.0]),
                        mask_seeds=torch.tensor([0]))


def blockwise_token_logps(model, batch, masks, block_size):
    """log p(x^i | [prompt, clean blocks < b, noisy block b]) per draw, the slow way: [C, B, L]. The
    last block is whole, as SDAR decodes it: mask tokens follow a completion that ends inside a block."""
    from ddrl.processes.block import block_causal_mask, block_ids, completion_blocks, position_ids_from_mask

    B, P = batch.prompt_ids.shape
    L = batch.completion_ids.shape[1]
    tails = [-(int(n) + L) % block_size for n in batch.prompt_mask.sum(1)]  # mask slots to the block end
    E = max(tails)
    tail = torch.tensor([[e < t for e in range(E)] for t in tails], dtype=torch.bool).reshape(B, E)
    key_valid = torch.cat([batch.prompt_mask, torch.ones(B, L, dtype=torch.bool), tail], 1)
    blocks, pos = block_ids(key_valid, block_size), position_ids_from_mask(key_valid)
    rel = completion_blocks(batch.prompt_mask, L + E, block_size)  # [B, L + E]
    out = torch.zeros(masks.shape, dtype=torch.float64)
    for n, m in enumerate(masks):
        noisy = torch.where(m, MASK, batch.completion_ids)
        for b in range(int(rel[:, :L].max()) + 1):
            ids = torch.cat([batch.prompt_ids, torch.where(rel[:, :L] < b, batch.completion_ids, noisy),
                             torch.full((B, E), MASK)], 1)
            visible = key_valid & torch.cat([torch.ones_like(batch.prompt_mask), rel <= b], 1)
            logits = model(ids, attention_mask=block_causal_mask(blocks, visible), position_ids=pos).logits
            lp = torch.log_softmax(logits[:, P:P + L].double(), -1).gather(-1, batch.completion_ids[..., None])[..., 0]
            out[n] = torch.where(rel[:, :L] == b, lp, out[n])
    return out


@pytest.mark.parametrize("block_size", [2, 3])
def test_staircase_estimator_gives_spg_bounds_of_the_blockwise_model(block_size):
    from ddrl.estimators.staircase import Staircase

    model, batch = TinyAttentionLM(seed=3), rollout_batch()
    est = Staircase(block_size=block_size, num_t=3, beta_eubo=1.5)
    out = est(model, batch, seed=11)
    masks, rate = est.draw_masks(batch, block_size, seed=11)
    with torch.no_grad():
        lp = blockwise_token_logps(model, batch, masks, block_size)
    real = batch.completion_mask
    for row in range(3):
        scored = [masks[n, row] & real[row] for n in range(3)]
        # ELBO: the unweighted mean over each draw's masked real tokens, averaged over the draws
        elbo = sum(lp[n, row][scored[n]].mean() for n in range(3)) / 3
        # EUBO: (1/beta) mean over tokens masked in some draw of log mean_n [m p^beta / t_block]
        terms = []
        for i in range(5):
            if any(s[i] for s in scored):
                inner = sum(float(scored[n][i]) * math.exp(1.5 * lp[n, row, i]) / rate[n, row, i] for n in range(3)) / 3
                terms.append(math.log(inner) / 1.5)
        assert out.extras["elbo"][row].item() == pytest.approx(elbo.item(), abs=1e-5)
        assert out.extras["eubo"][row].item() == pytest.approx(sum(terms) / len(terms), abs=1e-5)
    assert torch.equal(out.mask, (masks & real).any(0))


def test_staircase_masks_k_of_every_block_uniformly():
    from ddrl.estimators.staircase import Staircase
    from ddrl.processes.block import completion_blocks

    batch = rollout_batch()
    rel = completion_blocks(batch.prompt_mask, 5, 2)  # [B, L]
    est = Staircase(block_size=2, num_t=1)
    counts: dict[tuple[int, int], list[int]] = {}
    for seed in range(300):
        masks, rate = est.draw_masks(batch, 2, seed)
        assert not (masks & ~batch.completion_mask).any()
        for row in range(3):
            for b in rel[row].unique().tolist():
                in_b = (rel[row] == b) & batch.completion_mask[row]
                if not in_b.any():
                    continue
                k = int(masks[0, row][in_b].sum())
                assert 1 <= k <= int(in_b.sum())  # every block with real tokens is scored
                assert torch.allclose(rate[0, row][in_b], torch.tensor(k / int(in_b.sum())))
                counts.setdefault((row, int(in_b.sum())), []).append(k)
    for (_, n), ks in counts.items():  # k ~ U{1..len_b}
        for k in range(1, n + 1):
            assert abs(ks.count(k) / len(ks) - 1 / n) < 0.1


def test_fresh_mask_log_ratio_is_not_the_noise_of_a_weighted_sum():
    """The same policy under two fresh mask draws: StableDRL's log-ratio must be small, or the
    clip + group softmax zeroes most weights. The 1/t-weighted block ELBO fails this by far."""
    from ddrl.estimators.staircase import Staircase

    model, batch = TinyAttentionLM(seed=4), rollout_batch()
    est = Staircase(block_size=2)
    def mean_elbo(seed):
        return est(model, batch, seed=seed).extras["elbo"]

    def weighted_elbo(seed):
        return staircase_elbo(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, 2,
                              generator=torch.Generator().manual_seed(seed), completion_mask=batch.completion_mask)[0]

    with torch.no_grad():
        mean_ratio = torch.stack([mean_elbo(2 * s) - mean_elbo(2 * s + 1) for s in range(20)])
        weighted_ratio = torch.stack([weighted_elbo(2 * s) - weighted_elbo(2 * s + 1) for s in range(20)])
    assert mean_ratio.abs().mean() < 0.25 * weighted_ratio.abs().mean()


def test_spg_and_stable_drl_run_on_staircase_and_refuse_an_estimator_without_eubo():
    from ddrl.estimators.coupled_elbo import CoupledELBO
    from ddrl.estimators.staircase import Staircase
    from ddrl.objectives.aggregation import AggregationCounts
    from ddrl.objectives.spg import SPG
    from ddrl.objectives.stable_drl import StableDRL

    model, batch = TinyAttentionLM(seed=5), rollout_batch()
    est = Staircase(block_size=2)
    for objective in (SPG(), StableDRL()):  # default variant "mix" reads the EUBO
        objective.check_estimator(est)
        with pytest.raises(ValueError, match="variant=elbo"):
            objective.check_estimator(CoupledELBO())
        old = None if isinstance(objective, SPG) else est(model, batch, seed=1).detach()
        loss = objective(batch, est(model, batch, seed=2), old, None, counts=AggregationCounts.from_batch(batch)).loss
        loss.backward()
        assert torch.isfinite(loss) and model.out.grad.abs().sum() > 0
        model.zero_grad()
    type(objective)(variant="elbo").check_estimator(CoupledELBO())  # the ELBO variant needs no EUBO
