"""Likelihood estimators against exact enumeration on a tiny vocabulary, plus seed, shape and gradient checks.

The reference values here are computed by hand from direct model calls (log_softmax + gather on
inputs built in this file), never through ddrl.estimators.common, so a bug shared by the estimators
cannot hide in the reference.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from torch import nn

from ddrl import registry
from ddrl.estimators import (UDM, CoupledELBO, CoupledThreePass, FPOElbo, MaskGRPOEstimator, MeanField,
                             RandomRatio, SPGBounds, Staircase, Stratified, Trace)
from ddrl.estimators.maskgrpo import maskgrpo_ratio
from ddrl.estimators.trace import merged_steps
from ddrl.registry import ESTIMATORS
from ddrl.types import RolloutBatch, Trajectory
from tests.toy_models import ToyDiffusionLM

MASK = 11
EOS = 1


# ----------------------------------------------------------------------------------------------- helpers


def make_batch(prompt_ids, prompt_mask, completion_ids, completion_mask, trajectory=None, extras=None,
               mask_seeds=(7,)) -> RolloutBatch:
    B = completion_ids.shape[0]
    return RolloutBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask.bool(), completion_ids=completion_ids,
        completion_mask=completion_mask.bool(), group_ids=torch.zeros(B, dtype=torch.long),
        rewards=torch.zeros(B), advantages=torch.zeros(B), mask_seeds=torch.tensor(list(mask_seeds)),
        trajectory=trajectory, extras=extras or {},
    )


def tiny_batch() -> RolloutBatch:
    """Two rows: a left-padded prompt, one completion ending in EOS at position 1 (Lc = 2 of L = 3)."""
    prompt_ids = torch.tensor([[0, 4, 5], [6, 7, 8]])
    prompt_mask = torch.tensor([[False, True, True], [True, True, True]])
    completion_ids = torch.tensor([[3, 9, 2], [5, EOS, EOS]])
    completion_mask = torch.tensor([[True, True, True], [True, True, False]])
    return make_batch(prompt_ids, prompt_mask, completion_ids, completion_mask)


def repeat_rows(batch: RolloutBatch, reps: int, interleave: bool = True) -> RolloutBatch:
    """Each row `reps` times; interleaved (A, B, A, B, ...) so stratified draws spread over both."""
    B = len(batch)
    rows = torch.arange(B).repeat(reps) if interleave else torch.arange(B).repeat_interleave(reps)
    return batch.index(rows)


def direct_logp(model, prompt_ids, prompt_mask, completion_in, targets) -> torch.Tensor:
    """log p(targets^i | prompt, completion_in) per completion position, by hand. [N, L]"""
    N, P = prompt_ids.shape
    ids = torch.cat([prompt_ids, completion_in], 1)
    attn = torch.cat([prompt_mask.bool(), torch.ones_like(completion_in, dtype=torch.bool)], 1)
    with torch.no_grad():
        logits = model(ids, attention_mask=attn).logits[:, P:].float()
    return torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]


def subset_logps(model, batch: RolloutBatch, row: int, eligible: list[int], always_masked: list[int]):
    """{S: log p(x^i | x with S and always_masked masked) [L]} for every subset S of `eligible`."""
    L = batch.completion_ids.shape[1]
    subsets = [S for k in range(len(eligible) + 1) for S in itertools.combinations(eligible, k)]
    x = batch.completion_ids[row]
    inputs = torch.stack([torch.tensor([MASK if (i in S or i in always_masked) else int(x[i]) for i in range(L)])
                          for S in subsets])
    n = len(subsets)
    lp = direct_logp(model, batch.prompt_ids[row].repeat(n, 1), batch.prompt_mask[row].repeat(n, 1), inputs,
                     x.repeat(n, 1))
    return {S: lp[j] for j, S in enumerate(subsets)}


def exact_count_elbo(lps: dict, n_elig: int, weight) -> float:
    """sum over nonempty S of weight(|S|, n) * sum_{i in S} log p(x^i | x_{-S})."""
    return sum(weight(len(S), n_elig) * float(lp[list(S)].sum()) for S, lp in lps.items() if S)


def assert_unbiased(samples: torch.Tensor, exact: float, z: float = 5.0) -> None:
    """|mean - exact| within z standard errors of independent samples (per-call means)."""
    mean, se = samples.mean().item(), samples.std().item() / math.sqrt(len(samples))
    assert abs(mean - exact) < z * se + 1e-4, f"MC mean {mean:.4f} vs exact {exact:.4f} (se {se:.4f})"


class Recording(nn.Module):
    """Wraps a model and records every forward call's input ids."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.calls: list[torch.Tensor] = []
        for attr in ("mask_token_id", "vocab_size", "pad_token_id", "eos_token_id", "block_size", "process"):
            setattr(self, attr, getattr(inner, attr))

    def forward(self, input_ids, attention_mask=None):
        self.calls.append(input_ids.detach().clone())
        return self.inner(input_ids, attention_mask)


@pytest.fixture
def model():
    torch.manual_seed(0)  # the toy model seeds its own init; this only guards test-local torch calls
    return ToyDiffusionLM(vocab_size=12, mask_token_id=MASK, pad_token_id=0, eos_token_id=EOS, seed=3)


def binom(n, k):
    return math.comb(n, k)


# ----------------------------------------------------------------------------------------------- registry


def test_registry_lists_every_estimator_with_documented_fields(monkeypatch):
    monkeypatch.setattr(registry, "_loaded", True)  # look only at this layer (others may be mid-build)
    expected = {"mean_field", "random_ratio", "coupled_elbo", "coupled_three_pass", "spg", "trace", "maskgrpo",
                "stratified", "fpo_elbo", "staircase", "udm"}
    assert expected <= set(ESTIMATORS.names())
    for name in expected:
        cls = ESTIMATORS.get(name)
        assert cls.name == name and cls.paper and cls.formula and cls.passes
        assert dataclasses.is_dataclass(cls)
        cls()  # every field has a default


# ----------------------------------------------------------------------------------------------- mean field


def test_mean_field_equals_one_step_conditional(model):
    batch = tiny_batch()
    out = MeanField(p_mask_prompt=0.0)(model, batch, seed=1)
    all_masked = torch.full_like(batch.completion_ids, MASK)
    ref = direct_logp(model, batch.prompt_ids, batch.prompt_mask, all_masked, batch.completion_ids)
    cm = batch.completion_mask
    torch.testing.assert_close(out.token_logp, ref * cm)
    torch.testing.assert_close(out.seq_logp, (ref * cm).sum(1))
    assert torch.equal(out.mask, cm)


def test_mean_field_masks_only_real_prompt_tokens(model):
    batch = tiny_batch()
    rec = Recording(model)
    MeanField(p_mask_prompt=1.0)(rec, batch, seed=1)
    prompt_in = rec.calls[0][:, :3]
    assert torch.equal(prompt_in == MASK, batch.prompt_mask)  # padding untouched, every real token masked


# ----------------------------------------------------------------------------------------------- coupled ELBO


@pytest.mark.parametrize("weighted", [True, False])
def test_coupled_elbo_exact_expectation_over_masks(model, weighted):
    """E over (n, S) of the estimator, enumerated through score(), equals the exact ELBO."""
    batch = tiny_batch().index(torch.tensor([0]))
    L = 3
    lps = subset_logps(model, batch, 0, list(range(L)), [])
    if weighted:  # LLaDA's discrete ELBO: sum_n (1/n) E_{|S|=n}
        exact = exact_count_elbo(lps, L, lambda k, n: 1.0 / (k * binom(n, k)))
    else:  # GDSD: (1/(L+1)) sum_n E_{|S|=n}
        exact = exact_count_elbo(lps, L, lambda k, n: 1.0 / ((n + 1) * binom(n, k)))
    subsets = list(lps)
    first = torch.tensor([[i in S for i in range(L)] for S in subsets])  # [2^L, L]
    est = CoupledELBO(weighted=weighted)
    with torch.no_grad():
        values = est.score(model, repeat_rows(batch, len(subsets)), first[None]).seq_logp  # [2^L]
    prob = torch.tensor([1.0 / ((L + 1) * binom(L, len(S))) for S in subsets])  # n ~ U{0..L}, S | n uniform
    assert abs(float((prob * values).sum()) - exact) < 1e-4


def test_coupled_elbo_monte_carlo_is_unbiased(model):
    """End to end (stratified counts + random subsets): the seed average matches the exact ELBO per row."""
    batch = tiny_batch()
    est = CoupledELBO(num_mc=2, include_padding=False)
    exact = []
    for row in range(2):
        Lc = int(batch.completion_mask[row].sum())
        lps = subset_logps(model, batch, row, list(range(Lc)), list(range(Lc, 3)))
        exact.append(exact_count_elbo(lps, Lc, lambda k, n: 1.0 / (k * binom(n, k))))
    big = repeat_rows(batch, 16)
    with torch.no_grad():
        samples = torch.stack([est(model, big, seed=s).seq_logp.view(16, 2).mean(0) for s in range(60)])  # [60, 2]
    for row in range(2):
        assert_unbiased(samples[:, row], exact[row])


def test_coupled_elbo_stratified_counts_cover_all_levels(model):
    batch = repeat_rows(tiny_batch().index(torch.tensor([0])), 8)  # B = 8 = 2 (L + 1)
    masks = CoupledELBO(num_mc=1).draw_masks(batch, seed=3)[0]
    counts = sorted(masks.sum(1).tolist())
    assert counts == [0, 0, 1, 1, 2, 2, 3, 3]  # evenly spread over {0..L}


# ----------------------------------------------------------------------------------------------- FPO ELBO


@pytest.mark.parametrize("min_masked", [0, 1])
def test_fpo_elbo_matches_exact_enumeration(model, min_masked):
    batch = tiny_batch()
    est = FPOElbo(num_samples=4, min_masked=min_masked)
    exact = []
    for row in range(2):
        n = int(batch.completion_mask[row].sum())
        lps = subset_logps(model, batch, row, list(range(n)), [])  # post-EOS stays clean (DiPOD code)

        def weight(k, n):  # P(k) * (n / k) / C(n, k), k = max(min_masked, floor(u n)) in {0..n-1}
            p_k = (1.0 / n if k < n else 0.0) + (1.0 / n if (k == 1 and min_masked == 1) else 0.0)
            return p_k * (n / k) / binom(n, k)

        exact.append(exact_count_elbo(lps, n, weight))
    big = repeat_rows(batch, 16)
    with torch.no_grad():
        samples = torch.stack([est(model, big, seed=s).seq_logp.view(16, 2).mean(0) for s in range(60)])
    for row in range(2):
        assert_unbiased(samples[:, row], exact[row])


def test_fpo_token_logp_sums_to_elbo_and_keeps_post_eos_clean(model):
    batch = tiny_batch()
    rec = Recording(model)
    out = FPOElbo()(rec, batch, seed=5)
    torch.testing.assert_close(out.token_logp.sum(1), out.seq_logp)
    completion_in = rec.calls[0][:, 3:].view(4, 2, 3)
    assert not (completion_in[:, 1, 2] == MASK).any()


# ----------------------------------------------------------------------------------------------- SPG


def spg_exact_elbo(model, batch, row, block_length):
    """E over (block b, count n, subset S) of sum_masked log p / #masked (p_mask_prompt = 0)."""
    L = batch.completion_ids.shape[1]
    Lc = int(batch.completion_mask[row].sum())
    num_blocks = (Lc - 1) // block_length + 1
    total = 0.0
    for b in range(num_blocks):
        block = [i for i in range(b * block_length, min((b + 1) * block_length, Lc))]
        later = [i for i in range(L) if i >= (b + 1) * block_length or i >= Lc]
        lps = subset_logps(model, batch, row, block, later)
        for n in range(1, len(block) + 1):
            for S in itertools.combinations(block, n):
                m = [i for i in list(S) + later if i < Lc]
                p = 1.0 / (num_blocks * len(block) * binom(len(block), n))
                total += p * float(lps[S][m].sum()) / len(m)
    return total


def test_spg_elbo_matches_exact_enumeration(model):
    prompt_ids = torch.tensor([[4, 5], [6, 7]])
    completion_ids = torch.tensor([[3, 9, 2, 8], [5, 6, EOS, EOS]])
    completion_mask = torch.tensor([[True] * 4, [True, True, True, False]])
    batch = make_batch(prompt_ids, torch.ones(2, 2, dtype=torch.bool), completion_ids, completion_mask)
    est = SPGBounds(num_t=2, block_length=2, p_mask_prompt=0.0)
    exact = [spg_exact_elbo(model, batch, row, 2) for row in range(2)]
    big = repeat_rows(batch, 16)
    with torch.no_grad():
        samples = torch.stack([est(model, big, seed=s).seq_logp.view(16, 2).mean(0) for s in range(60)])
    for row in range(2):
        assert_unbiased(samples[:, row], exact[row])


def test_spg_mask_distribution_is_exact():
    """Frequencies of the block-random patterns over many draws match their exact probabilities.

    Lc = 4, block 2: block b in {0, 1} (1/2 each), n in {1, 2} (1/2 each), S uniform of size n;
    later blocks fully masked. Together with the score-given-masks test this pins the expectation.
    """
    B = 50
    batch = make_batch(torch.full((B, 2), 4), torch.ones(B, 2, dtype=torch.bool), torch.full((B, 4), 5),
                       torch.ones(B, 4, dtype=torch.bool))
    est = SPGBounds(num_t=8, block_length=2, p_mask_prompt=0.0)
    masks = torch.cat([est.draw_masks(batch, seed)[1].reshape(-1, 4) for seed in range(10)])  # [4000, 4]
    exact = {(1, 0, 1, 1): 1 / 8, (0, 1, 1, 1): 1 / 8, (1, 1, 1, 1): 1 / 4,  # b = 0
             (0, 0, 1, 0): 1 / 8, (0, 0, 0, 1): 1 / 8, (0, 0, 1, 1): 1 / 4}  # b = 1
    patterns = [tuple(int(v) for v in m) for m in masks]
    assert set(patterns) <= set(exact)
    for pattern, p in exact.items():
        assert abs(patterns.count(pattern) / len(patterns) - p) < 0.03, pattern


def test_spg_eubo_formula_on_given_masks(model):
    batch = tiny_batch()
    est = SPGBounds(num_t=2, beta_eubo=1.5)
    masks = torch.tensor([[[True, False, False], [True, False, True]],
                          [[True, True, False], [False, True, True]]])  # [num_t, B, L]
    with torch.no_grad():
        out = est.score(model, batch, None, masks)
    for row in range(2):
        Lc = int(batch.completion_mask[row].sum())
        lp = [direct_logp(model, batch.prompt_ids[row:row + 1], batch.prompt_mask[row:row + 1],
                          torch.where(masks[n, row], MASK, batch.completion_ids[row])[None],
                          batch.completion_ids[row:row + 1])[0] for n in range(2)]
        m = [masks[n, row] & batch.completion_mask[row] for n in range(2)]
        elbo = sum(float(lp[n][m[n]].sum()) / int(m[n].sum()) for n in range(2)) / 2
        logs = []
        for i in range(3):
            terms = [float(m[n][i]) * math.exp(1.5 * float(lp[n][i])) / (int(m[n].sum()) / Lc) for n in range(2)]
            if any(m[n][i] for n in range(2)):
                logs.append(math.log(sum(terms) / 2))
        eubo = sum(logs) / len(logs) / 1.5
        assert abs(float(out.extras["elbo"][row]) - elbo) < 1e-4
        assert abs(float(out.extras["eubo"][row]) - eubo) < 1e-4


def test_spg_masks_follow_block_structure(model):
    completion_ids = torch.tensor([[3, 9, 2, 8, 4, 6]])
    batch = make_batch(torch.tensor([[4, 5]]), torch.ones(1, 2, dtype=torch.bool), completion_ids,
                       torch.tensor([[True] * 5 + [False]]))
    est = SPGBounds(num_t=8, block_length=2, p_mask_prompt=0.0)
    for seed in range(5):
        _, masks = est.draw_masks(batch, seed)
        for m in masks[:, 0]:
            assert m[5]  # post-EOS always masked
            b = int(m[:5].nonzero()[0]) // 2  # first masked position's block
            assert not m[: 2 * b].any()  # earlier blocks clean
            assert m[2 * (b + 1): 5].all()  # later blocks fully masked


# ------------------------------------------------------------------------------------- three pass / random ratio


def test_coupled_three_pass_formula(model):
    batch = tiny_batch()
    rec = Recording(model)
    out = CoupledThreePass()(rec, batch, seed=4)
    completion_in = rec.calls[0][:, 3:].view(3, 2, 3)
    assert (completion_in[0] == MASK).all()
    S = completion_in[1] == MASK
    assert torch.equal(completion_in[2] == MASK, ~S)  # exact complement
    lp = [direct_logp(model, batch.prompt_ids, batch.prompt_mask, completion_in[k], batch.completion_ids)
          for k in range(3)]
    t = out.extras["t"][:, None]
    expected = 0.5 * (lp[0] + torch.where(S, lp[1] / t, lp[2] / (1 - t))) * batch.completion_mask
    torch.testing.assert_close(out.token_logp, expected)


def test_random_ratio_scores_masked_tokens_only(model):
    batch = tiny_batch()
    rec = Recording(model)
    out = RandomRatio(copies=3)(rec, batch, seed=2)
    completion_in = rec.calls[0][:, 3:].view(3, 2, 3)
    masked = completion_in == MASK
    assert masked[:, 1, 2].all()  # post-EOS always masked
    lp = torch.stack([direct_logp(model, batch.prompt_ids, batch.prompt_mask, completion_in[c], batch.completion_ids)
                      for c in range(3)])
    scored = masked & batch.completion_mask
    expected = (lp * scored).sum(0) / scored.sum(0).clamp(min=1)
    torch.testing.assert_close(out.token_logp, expected * scored.any(0))
    assert torch.equal(out.mask, scored.any(0))


# ----------------------------------------------------------------------------------------------- trace


def test_trace_states_match_hand_built_trajectory(model):
    completion_ids = torch.tensor([[3, 9, 2, 8], [5, EOS, EOS, EOS]])
    commit = torch.tensor([[0, 0, 1, 2], [1, 0, -1, -1]])  # row 1: EOS fill of an early exit has no step
    traj = Trajectory(commit_step=commit, token_probs=torch.rand(2, 3, 4))
    batch = make_batch(torch.tensor([[4, 5], [6, 7]]), torch.ones(2, 2, dtype=torch.bool), completion_ids,
                       torch.tensor([[True] * 4, [True, True, False, False]]), trajectory=traj)
    M = MASK
    expected = {  # shrink -> (row, completion input, targets)
        1: [(0, [M, M, M, M], [0, 1]), (1, [M, M, M, M], [1]), (0, [3, 9, M, M], [2]), (1, [M, EOS, M, M], [0]),
            (0, [3, 9, 2, M], [3])],
        2: [(0, [M, M, M, M], [0, 1, 2]), (1, [M, M, M, M], [0, 1]), (0, [3, 9, 2, M], [3])],
    }
    for shrink, states in expected.items():
        rec = Recording(model)
        out = Trace(shrink=shrink)(rec, batch, seed=0)
        inputs = rec.calls[0][:, 2:]
        assert inputs.tolist() == [s[1] for s in states]
        ref = torch.zeros(2, 4)
        for row, state, targets in states:
            lp = direct_logp(model, batch.prompt_ids[row:row + 1], batch.prompt_mask[row:row + 1],
                             torch.tensor([state]), completion_ids[row:row + 1])[0]
            ref[row, targets] = lp[targets]
        torch.testing.assert_close(out.token_logp, ref)
        assert torch.equal(out.mask, torch.tensor([[True] * 4, [True, True, False, False]]))


def test_merged_steps_groups_distinct_steps():
    commit = torch.tensor([[0, 3, 3, 5, 8, -1]])
    assert merged_steps(commit, 1).tolist() == [[0, 1, 1, 2, 3, -1]]
    assert merged_steps(commit, 2).tolist() == [[0, 0, 0, 1, 1, -1]]


# ----------------------------------------------------------------------------------------------- stratified / DPS


def test_stratified_covers_every_real_position_exactly_once(model):
    completion_ids = torch.tensor([[3, 9, 2, 8, 4, 6, 7], [5, 6, 2, EOS, EOS, EOS, EOS]])
    completion_mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    batch = make_batch(torch.tensor([[4, 5], [6, 7]]), torch.ones(2, 2, dtype=torch.bool), completion_ids,
                       completion_mask)
    rec = Recording(model)
    out = Stratified(num_strata=3)(rec, batch, seed=9)
    completion_in = rec.calls[0][:, 2:].view(3, 2, 7)
    masked = completion_in == MASK
    assert torch.equal(masked.sum(0)[completion_mask], torch.ones(11, dtype=torch.long))
    assert masked[:, ~completion_mask].all()  # post-EOS masked in every pass
    assert sorted(masked[:, 0].sum(-1).tolist()) == [2, 2, 3]  # near-equal strata
    lp = torch.stack([direct_logp(model, batch.prompt_ids, batch.prompt_mask, completion_in[k], completion_ids)
                      for k in range(3)])
    torch.testing.assert_close(out.token_logp, (lp * (masked & completion_mask)).sum(0))


# ----------------------------------------------------------------------------------------------- MaskGRPO


@pytest.mark.parametrize("mode", ["arlike", "uniform"])
def test_maskgrpo_masked_fraction_matches_ratio(model, mode):
    B, L = 64, 48
    g = torch.Generator().manual_seed(1)
    batch = make_batch(torch.randint(2, 11, (B, 4), generator=g), torch.ones(B, 4, dtype=torch.bool),
                       torch.randint(2, 11, (B, L), generator=g), torch.ones(B, L, dtype=torch.bool),
                       mask_seeds=(11, 12, 13, 14))
    est = MaskGRPOEstimator(gamma=0.6, mode=mode)
    for k, seed in enumerate((11, 12, 13)):  # ratios 0.7, 0.8, 0.9; k found from the seed's position
        with torch.no_grad():
            out = est(model, batch, seed)
        ratio = maskgrpo_ratio(k, 4, 0.6)
        assert abs(float(out.extras["ratio"]) - ratio) < 1e-6
        assert abs(out.mask.float().mean().item() - ratio) < 0.03
    batch.extras["inner_iteration"] = 3
    assert abs(float(est(model, batch, 11).extras["ratio"]) - 0.999) < 1e-6  # the trainer's k wins


def test_maskgrpo_arlike_masks_later_tokens_more(model):
    B, L = 128, 40
    batch = make_batch(torch.full((B, 2), 4), torch.ones(B, 2, dtype=torch.bool), torch.full((B, L), 5),
                       torch.ones(B, L, dtype=torch.bool))
    masked = MaskGRPOEstimator(gamma=0.6).draw_mask(batch, ratio=0.7, seed=0).float().mean(0)
    assert masked[:10].mean() < 0.6 < 0.8 < masked[-10:].mean()


# ----------------------------------------------------------------------------------------------- UDM


class FakeUniformProcess:
    """UniformProcess's documented interface: each eligible token becomes a uniform class w.p. t."""

    def __init__(self, num_classes=8, offset=2):
        self.num_classes, self.offset = num_classes, offset

    def noise(self, x0, t, *, generator, eligible=None):
        u = torch.rand(x0.shape, generator=generator)
        noised = (u < t.cpu()[:, None]) & (eligible.cpu() if eligible is not None else True)
        rand = self.offset + torch.randint(self.num_classes, x0.shape, generator=generator)
        return torch.where(noised, rand, x0.cpu()).to(x0.device), noised.to(x0.device)


def uniform_model():
    m = ToyDiffusionLM(vocab_size=12, mask_token_id=MASK, seed=4)
    m.process = FakeUniformProcess()
    return m


def uniform_batch(**kw):
    g = torch.Generator().manual_seed(2)
    return make_batch(torch.randint(2, 10, (2, 3), generator=g), torch.ones(2, 3, dtype=torch.bool),
                      torch.randint(2, 10, (2, 5), generator=g), torch.ones(2, 5, dtype=torch.bool), **kw)


def sliced_logp(model, batch, states, targets):
    n = states.shape[0] // len(batch)
    ids = torch.cat([batch.prompt_ids.repeat(n, 1), states], 1)
    logits = model(ids, attention_mask=torch.ones_like(ids, dtype=torch.bool)).logits[:, 3:, 2:10]
    return torch.log_softmax(logits.float(), -1).gather(-1, (targets - 2)[..., None])[..., 0]


def test_udm_renoises_x0_and_scores_clean_sample_over_classes():
    model, batch = uniform_model(), uniform_batch()
    rec = Recording(model)
    out = UDM(t_values=[1.0, 0.5])(rec, batch, seed=3)
    states = rec.calls[0][:, 3:]  # [n_t*B, L]
    assert ((states >= 2) & (states < 10)).all()
    lp = sliced_logp(model, batch, states, batch.completion_ids.repeat(2, 1)).view(2, 2, 5)
    torch.testing.assert_close(out.extras["per_timestep"], lp.mean(-1).T)
    torch.testing.assert_close(out.seq_logp, lp.mean(-1).mean(0))
    assert not UDM().needs_trajectory and UDM(forward_process=False).needs_trajectory


def test_udm_naive_ablations_use_rollout_states_and_step_predictions():
    model = uniform_model()
    g = torch.Generator().manual_seed(5)
    states = torch.randint(2, 10, (2, 4, 5), generator=g)  # [B, S, L]
    preds = torch.randint(2, 10, (2, 4, 5), generator=g)
    traj = Trajectory(commit_step=torch.zeros(2, 5, dtype=torch.long), token_probs=torch.rand(2, 4, 5),
                      states=states, step_times=torch.tensor([1.0, 0.75, 0.5, 0.25]))
    batch = uniform_batch(trajectory=traj, extras={"step_predictions": preds})
    rec = Recording(model)
    out = UDM(t_values=[0.9, 0.5], forward_process=False, clean_target=False)(rec, batch, seed=0)
    used = rec.calls[0][:, 3:].view(2, 2, 5)
    assert torch.equal(used, states[:, [0, 2]].transpose(0, 1))  # steps nearest to t = 0.9 and 0.5
    lp = sliced_logp(model, batch, used.reshape(4, 5), preds[:, [0, 2]].transpose(0, 1).reshape(4, 5)).view(2, 2, 5)
    torch.testing.assert_close(out.extras["per_timestep"], lp.mean(-1).T)
    # without a recorded step_predictions: the action of step k is the state entering step k + 1
    # (the completion for the last step), read off the trajectory
    del batch.extras["step_predictions"]
    rec = Recording(model)
    out = UDM(t_values=[0.9, 0.1], forward_process=False, clean_target=False)(rec, batch, seed=0)
    outputs = torch.cat([states[:, 1:], batch.completion_ids[:, None]], dim=1)  # [B, S, L]
    used = rec.calls[0][:, 3:].view(2, 2, 5)
    assert torch.equal(used, states[:, [0, 3]].transpose(0, 1))  # steps nearest to t = 0.9 and 0.1
    lp = sliced_logp(model, batch, used.reshape(4, 5), outputs[:, [0, 3]].transpose(0, 1).reshape(4, 5)).view(2, 2, 5)
    torch.testing.assert_close(out.extras["per_timestep"], lp.mean(-1).T)
    batch.trajectory = None
    with pytest.raises(ValueError, match="trajectory.states"):
        UDM(t_values=[0.9], clean_target=False)(model, batch, seed=0)


def test_trajectory_step_outputs_are_the_next_states_then_the_completion():
    states = torch.tensor([[[1, 1], [2, 2], [3, 3]]])  # [B=1, S=3, L=2]: the states entering steps 0, 1, 2
    traj = Trajectory(commit_step=torch.zeros(1, 2, dtype=torch.long), token_probs=torch.rand(1, 3, 2), states=states)
    assert traj.step_outputs(torch.tensor([[4, 4]])).tolist() == [[[2, 2], [3, 3], [4, 4]]]
    with pytest.raises(ValueError, match="return_trajectory"):
        Trajectory(commit_step=traj.commit_step, token_probs=traj.token_probs).step_outputs(torch.tensor([[4, 4]]))


def test_udm_with_real_uniform_process():
    import ddrl.processes.uniform as uniform_mod
    model = ToyDiffusionLM(vocab_size=12, mask_token_id=MASK, seed=4)
    model.process = uniform_mod.UniformProcess(8, 2, "linear")
    out = UDM()(model, uniform_batch(), seed=1)
    assert out.seq_logp.shape == (2,) and torch.isfinite(out.seq_logp).all()


def test_udm_states_grid_or_levels():
    """grid: num_timesteps consecutive steps of the rollout grid from start ~ U{lo .. hi - 1} (UDM-GRPO as
    released), the default on a metric-path process; levels: U[t_min, t_max] (the default elsewhere)."""
    import ddrl.processes.uniform as uniform_mod
    from ddrl.processes.metric_path import MetricPathProcess

    uniform = uniform_mod.UniformProcess(8, 2, "linear")
    metric = MetricPathProcess(8, 2, codebook=torch.randn(8, 3, generator=torch.Generator().manual_seed(0)), shift=3.0)
    assert UDM().resolved_states(uniform) == "levels" and UDM().resolved_states(metric) == "grid"
    assert UDM(t_values=[0.5]).resolved_states(metric) == "levels"
    est = UDM(states="grid", grid_steps=4, grid_start=[1, 2], num_timesteps=2)
    torch.testing.assert_close(est.timesteps(0, uniform), torch.tensor([0.75, 0.5]))  # t = 1 - i / 4, i = 1, 2
    flow = metric.inference_flow_times(10)
    for seed in range(8):
        start = UDM().grid_start_index(seed)
        assert start in (0, 1, 2)
        torch.testing.assert_close(UDM().timesteps(seed, metric), (1 - flow[start:start + 3]).float())
    levels = UDM(states="levels").timesteps(3, metric)
    assert levels.shape == (3,) and bool(((levels >= 0.6) & (levels <= 1.0)).all())
    for bad, match in (({"states": "steps"}, "choose one of grid, levels"),
                       ({"grid_start": [0, 9]}, "stay on the grid"),
                       ({"states": "grid", "t_values": [0.5]}, "states='levels'")):
        with pytest.raises(ValueError, match=match):
            UDM(**bad)


# ----------------------------------------------------------------------------------------------- staircase


class StaircaseToy(nn.Module):
    """One attention layer that takes a [B, T, T] bool attention mask and position ids (staircase input)."""

    def __init__(self, vocab_size=12, d=16, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Parameter(torch.randn(vocab_size, d, generator=g) * 0.5)
        self.pos = nn.Parameter(torch.randn(64, d, generator=g) * 0.5)
        self.out = nn.Parameter(torch.randn(d, vocab_size, generator=g))
        self.mask_token_id, self.vocab_size, self.block_size, self.process = MASK, vocab_size, 2, None

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        h = self.emb[input_ids] + self.pos[position_ids]  # [B, T, d]
        scores = (h @ h.transpose(1, 2)).masked_fill(~attention_mask, float("-inf"))
        h = h + torch.softmax(scores, -1) @ h
        logits = h @ self.out
        logits[..., MASK] = float("-inf")

        class Out:
            pass
        o = Out()
        o.logits = logits
        return o


# ----------------------------------------------------------------------------------------------- every estimator


def all_estimators():
    """(name, estimator, needs a uniform model, batch factory)."""
    def with_traj():
        b = tiny_batch()
        b.trajectory = Trajectory(commit_step=torch.tensor([[0, 1, 1], [1, 0, -1]]), token_probs=torch.rand(2, 2, 3))
        return b
    return [
        ("mean_field", MeanField(), False, tiny_batch),
        ("random_ratio", RandomRatio(copies=2), False, tiny_batch),
        ("coupled_elbo", CoupledELBO(), False, tiny_batch),
        ("coupled_elbo_gdsd", CoupledELBO(weighted=False, include_padding=False), False, tiny_batch),
        ("coupled_three_pass", CoupledThreePass(), False, tiny_batch),
        ("spg", SPGBounds(block_length=2), False, tiny_batch),
        ("trace", Trace(), False, with_traj),
        ("maskgrpo", MaskGRPOEstimator(num_iterations=4), False, tiny_batch),
        ("stratified", Stratified(num_strata=2), False, tiny_batch),
        ("fpo_elbo", FPOElbo(min_masked=1), False, tiny_batch),
        ("udm", UDM(), True, uniform_batch),
    ]


@pytest.mark.parametrize("name,est,uniform,make", all_estimators(), ids=[e[0] for e in all_estimators()])
def test_same_seed_same_output_and_different_seed_differs(model, name, est, uniform, make):
    m = uniform_model() if uniform else model
    batch = make()
    with torch.no_grad():
        a, b = est(m, batch, seed=123), est(m, batch, seed=123)
        c = [est(m, batch, seed=s) for s in (124, 125, 126)]
    for x, y in ((a.token_logp, b.token_logp), (a.seq_logp, b.seq_logp), (a.mask, b.mask)):
        assert torch.equal(x, y)
    if name != "trace":  # the trace estimator reads the rollout's states; it has no randomness
        assert any(not torch.equal(a.seq_logp, o.seq_logp) for o in c)
    assert a.token_logp.shape == batch.completion_ids.shape and a.seq_logp.shape == (len(batch),)
    assert a.mask.dtype == torch.bool and not (a.token_logp[~a.mask] != 0).any()
    assert torch.isfinite(a.token_logp).all() and torch.isfinite(a.seq_logp).all()


@pytest.mark.parametrize("name,est,uniform,make", all_estimators(), ids=[e[0] for e in all_estimators()])
def test_gradients_flow(model, name, est, uniform, make):
    m = uniform_model() if uniform else model
    out = est(m, make(), seed=0)
    params = list(m.parameters())
    for v in out.extras.values():  # extras with grad (ELBO, EUBO) must backprop cleanly too
        if v.requires_grad:
            grads = torch.autograd.grad(v.sum(), params, retain_graph=True, allow_unused=True)
            assert all(torch.isfinite(g).all() for g in grads if g is not None)
    out.seq_logp.sum().backward()
    grads = [p.grad for p in params if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0
