"""Masked-diffusion samplers on a tiny toy model.

The central check: with temperature 0 and low-confidence remasking, the batched, padded generate()
gives exactly the tokens of a plain, one-row-at-a-time transcription of LLaDA's algorithm
(docs/diffusion.md#low-confidence-sampler) written below with Python lists and loops.
"""

from __future__ import annotations

import math

import pytest
import torch

from ddrl.config import SamplerConfig
from ddrl.registry import SAMPLERS
from ddrl.sampling.commit import commit_above_threshold, commit_top_k, transfer_counts
from ddrl.sampling.masked import generate, sample_block, sample_emerge, sample_masked
from ddrl.processes.draws import uniform_draw
from ddrl.processes.masked import MaskedProcess
from ddrl.sampling.utils import gumbel_argmax
from tests.toy_models import Output, ToyDiffusionLM

MASK, PAD, EOS = 11, 0, 1
PROMPTS = [[2, 3, 4], [5, 6, 7, 8, 9], [10]]  # different lengths -> left padding in the batch


def left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[False] * (P - len(p)) + [True] * len(p) for p in prompts])
    return ids, mask


class Counting:
    """Wraps a model, counts its calls and forwards every attribute (vocab_size, mask_token_id, ...)."""

    def __init__(self, model):
        self.model = model
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.model(*args, **kwargs)


@pytest.fixture(scope="module")
def model():
    return ToyDiffusionLM(vocab_size=12, mask_token_id=MASK, pad_token_id=PAD, eos_token_id=EOS, seed=0).eval()


class FiniteMaskLogit(ToyDiffusionLM):
    """The toy with a finite (-30) mask logit, like LLaDA's real models: LLaDA's CFG formula turns a
    -inf logit in both passes into NaN, so the reference comparison with guidance uses this one."""

    def forward(self, input_ids, attention_mask=None):
        logits = self.model(input_ids, attention_mask).logits.clone()
        logits[..., self.mask_token_id] = -30.0
        return Output(logits=logits)


# --------------------------------------------------------------------------------------------
# The plain reference: one unpadded row, lists and loops, greedy low-confidence remasking
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def plain_llada(model, prompt, *, steps, gen_length, block_length, cfg_scale, mask_id=MASK):
    """-> (completion tokens, commit step per completion position, sequence entering each step)."""
    P = len(prompt)
    seq = list(prompt) + [mask_id] * gen_length
    num_blocks = gen_length // block_length
    per_block = steps // num_blocks
    commit, states, step_index = [-1] * gen_length, [], 0
    for block in range(num_blocks):
        lo, hi = P + block * block_length, P + (block + 1) * block_length
        n = sum(1 for i in range(lo, hi) if seq[i] == mask_id)
        for s in range(per_block):
            k = n // per_block + (1 if s < n % per_block else 0)
            states.append(list(seq))
            logits = reference_logits(model, seq, P, cfg_scale, mask_id)
            probs = torch.softmax(logits.double(), dim=-1)
            candidates = []
            for i in range(lo, hi):
                if seq[i] == mask_id:
                    token = int(logits[i].argmax())
                    candidates.append((float(probs[i, token]), -i, token, i))  # highest first, then leftmost
            candidates.sort(reverse=True)
            for _, _, token, i in candidates[:k]:
                seq[i] = token
                commit[i - P] = step_index
            step_index += 1
    return seq[P:], commit, states


def reference_logits(model, seq, P, cfg_scale, mask_id=MASK):
    """[T, V]: the logits the reference acts on for one unpadded sequence (LLaDA CFG form)."""
    logits = model(torch.tensor([seq])).logits[0]
    if cfg_scale > 0:
        un = model(torch.tensor([[mask_id] * P + seq[P:]])).logits[0]
        logits = un + (cfg_scale + 1) * (logits - un)
    return logits


CONFIGS = [  # steps, gen_length, block_length, cfg_scale
    (8, 8, 8, 0.0),  # one block, one token per step
    (4, 8, 8, 0.0),  # steps < block length: two per step
    (6, 12, 4, 0.0),  # several blocks
    (9, 12, 4, 0.0),  # uneven counts 2, 1, 1
    (24, 8, 4, 0.0),  # steps per block (12) > block length: trailing steps commit nothing
    (6, 6, 3, 1.5),  # guidance
    (4, 8, 4, 1.5),
]


@pytest.mark.parametrize("steps,gen_length,block_length,cfg_scale", CONFIGS)
def test_greedy_matches_plain_reference_with_left_padding(model, steps, gen_length, block_length, cfg_scale):
    if cfg_scale > 0:
        model = FiniteMaskLogit(vocab_size=12, mask_token_id=MASK, seed=0).eval()
    ids, mask = left_pad(PROMPTS)
    counting = Counting(model)
    out, traj = generate(counting, ids, mask, steps=steps, gen_length=gen_length, block_length=block_length,
                         cfg_scale=cfg_scale, mask_id=MASK, return_trajectory=True)
    assert out.shape == (3, ids.shape[1] + gen_length)
    assert torch.equal(out[:, :ids.shape[1]], ids)
    assert counting.calls == steps  # no extra forward pass for the trajectory
    for r, prompt in enumerate(PROMPTS):
        tokens, commit, _ = plain_llada(model, prompt, steps=steps, gen_length=gen_length,
                                        block_length=block_length, cfg_scale=cfg_scale)
        assert out[r, ids.shape[1]:].tolist() == tokens, f"row {r}"
        assert traj.commit_step[r].tolist() == commit, f"row {r}"
    assert not (out == MASK).any()


def test_guidance_keeps_a_token_both_passes_forbid_forbidden(model):
    ids, mask = left_pad(PROMPTS)
    out = generate(model, ids, mask, steps=4, gen_length=8, block_length=4, cfg_scale=1.5, mask_id=MASK)
    assert not (out == MASK).any()  # -inf - -inf would be NaN, and argmax picks NaN


class FixedLogits:
    """Every call returns the same completion logits [L, V] (prompt positions get zeros)."""

    def __init__(self, completion_logits):
        self.completion_logits = completion_logits
        self.vocab_size = completion_logits.shape[-1]
        self.inputs = []

    def __call__(self, x, attention_mask=None):
        self.inputs.append((x.clone(), None if attention_mask is None else attention_mask.clone()))
        L = self.completion_logits.shape[0]
        prompt = torch.zeros(x.shape[0], x.shape[1] - L, self.vocab_size)
        return Output(logits=torch.cat([prompt, self.completion_logits.expand(x.shape[0], -1, -1)], dim=1))


def test_confidence_is_ranked_in_float64_like_the_reference():
    # p(token 0) = 1 - 3e^-20 at position 0 and 1 - 3e^-20.5 at position 1: equal (1.0) in float32,
    # different in float64, where the reference ranks them; so position 1 goes first.
    logits = torch.zeros(2, 4)
    logits[0, 0], logits[1, 0] = 20.0, 20.5
    _, traj = generate(FixedLogits(logits), torch.tensor([[2]]), steps=2, gen_length=2, block_length=2,
                       mask_id=3, return_trajectory=True)
    assert traj.commit_step.tolist() == [[1, 0]]


def test_unconditional_input_masks_real_prompt_tokens_and_keeps_padding():
    ids, mask = left_pad([[2, 3], [4, 5, 6]])
    model = FixedLogits(torch.randn(4, 12))
    generate(model, ids, mask, steps=1, gen_length=4, block_length=4, cfg_scale=1.0, mask_id=MASK)
    x, attn = model.inputs[0]
    one_pass = torch.cat([mask, torch.ones(2, 4, dtype=torch.bool)], dim=1)  # completion always attended
    assert x.shape == (4, 7) and torch.equal(attn, torch.cat([one_pass, one_pass]))  # one call of 2B rows
    assert x[2:, :3].tolist() == [[PAD, MASK, MASK], [MASK, MASK, MASK]]
    assert torch.equal(x[:2, :3], ids) and (x[:, 3:] == MASK).all()


def test_token_probs_follow_the_documented_contract(model):
    steps, gen_length, block_length = 6, 6, 3
    ids, mask = left_pad(PROMPTS)
    out, traj = generate(model, ids, mask, steps=steps, gen_length=gen_length, block_length=block_length,
                         mask_id=MASK, return_trajectory=True)
    assert traj.token_probs.shape == (3, steps, gen_length) and traj.states is None
    per_block = steps // (gen_length // block_length)
    for r, prompt in enumerate(PROMPTS):
        tokens, commit, states = plain_llada(model, prompt, steps=steps, gen_length=gen_length,
                                             block_length=block_length, cfg_scale=0.0)
        P = len(prompt)
        expected = torch.full((steps, gen_length), float("nan"))
        for s, state in enumerate(states):
            with torch.no_grad():
                probs = torch.softmax(reference_logits(model, state, P, 0.0).double(), -1)
            for j in range(gen_length):
                block_start_step = (j // block_length) * per_block
                if block_start_step <= s <= commit[j]:  # inside its block, up to its commit: exact
                    expected[s, j] = probs[P + j, tokens[j]]
        for s in range(steps):  # after the commit: the value at the commit step; before the block: NaN
            for j in range(gen_length):
                if s > commit[j]:
                    expected[s, j] = expected[commit[j], j]
        assert torch.allclose(traj.token_probs[r], expected, atol=1e-5, equal_nan=True), f"row {r}"


# --------------------------------------------------------------------------------------------
# Small pieces
# --------------------------------------------------------------------------------------------


def test_transfer_counts_by_hand():
    counts = transfer_counts(torch.tensor([5, 4, 0, 2]), 3)
    assert counts.tolist() == [[2, 2, 1], [2, 1, 1], [0, 0, 0], [1, 1, 0]]


def test_commit_top_k_by_hand_with_ties_to_the_left():
    conf = torch.tensor([[0.1, 0.9, 0.5, 0.9], [0.3, float("-inf"), 0.2, 0.4]], dtype=torch.float64)
    picked = commit_top_k(conf, torch.tensor([2, 1]))
    assert picked.tolist() == [[False, True, False, True], [False, False, False, True]]
    picked = commit_top_k(conf, torch.tensor([1, 0]))
    assert picked.tolist() == [[False, True, False, False], [False, False, False, False]]


def test_commit_above_threshold_by_hand():
    masked = torch.tensor([[True, True, True, False], [True, True, False, False], [False, False, False, False]])
    conf = torch.tensor([[0.95, 0.5, 0.91, 0.99], [0.2, 0.3, 0.99, 0.99], [0.1, 0.1, 0.1, 0.1]], dtype=torch.float64)
    conf = conf.masked_fill(~masked, float("-inf"))
    picked = commit_above_threshold(conf, masked, 0.9)
    assert picked.tolist() == [[True, False, True, False], [False, True, False, False], [False] * 4]


def test_gumbel_argmax_samples_softmax_over_temperature():
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0])
    n, temperature = 40000, 0.5
    u = uniform_draw((n, 4), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    draws = gumbel_argmax(logits.expand(n, 4), temperature, u)
    freq = torch.bincount(draws, minlength=4).double() / n
    assert torch.allclose(freq, torch.softmax(logits.double() / temperature, -1), atol=0.01)
    assert gumbel_argmax(logits.expand(2, 4), 0.0, None).tolist() == [3, 3]


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_a_codebook_draw_from_full_width_uniforms_is_the_full_vocabulary_draw(temperature):
    """An image model's emerge step: logits of ids [lo, hi) only, uniforms still over all V ids (the seeded
    stream). offset=lo reads the noise at those ids: the token is the one the full-width draw over the
    suppressed logits picks (every other id's logit is SUPPRESSED_LOGIT), lo off the vector width on purpose."""
    from ddrl.ops.logprobs import SUPPRESSED_LOGIT

    V, lo, hi = 203, 133, 197
    g = torch.Generator().manual_seed(3)
    codes = 3 * torch.randn(5, 7, hi - lo, generator=g)
    full = torch.full((5, 7, V), SUPPRESSED_LOGIT).index_copy(-1, torch.arange(lo, hi), codes)
    u = torch.rand(5, 7, V, generator=g)
    expected = gumbel_argmax(full, temperature, u.clone(), consume=True)
    got = gumbel_argmax(codes, temperature, u.clone(), consume=True, offset=lo) + lo
    assert torch.equal(got, expected) and ((got >= lo) & (got < hi)).all()
    if temperature:
        assert not torch.equal(got, gumbel_argmax(codes, temperature, u[..., :hi - lo].clone()) + lo)  # other noise
        with pytest.raises(ValueError, match=r"cover ids \[150, 214\)"):
            gumbel_argmax(codes, temperature, u, offset=150)


@pytest.mark.pinned  # re-run under avx2 and default by test_portable_pins.py
def test_the_recorder_reads_codebook_probabilities_at_token_minus_offset():
    """ProbRecorder(offset=lo) over the codebook's logits records what the full record over the suppressed
    vocabulary records: the token's probability, 0 for an id outside the codebook, NaN for a row early exit
    filled. Two softmaxes of different widths: bit-equal under AVX512 and AVX2 kernels, but the pre-AVX2
    kernels (ATEN_CPU_CAPABILITY=default) sum in another order: 6 of 24 entries differ, by at most
    1.6e-7 relative. So rtol=2e-6; reading the token without the offset is off by O(1)."""
    from ddrl.ops.logprobs import SUPPRESSED_LOGIT
    from ddrl.sampling.trajectory import ProbRecorder

    V, lo, hi = 203, 133, 197
    g = torch.Generator().manual_seed(4)
    codes = [2 * torch.randn(3, 4, hi - lo, generator=g) for _ in range(2)]
    final = torch.randint(lo, hi, (3, 4), generator=g)
    final[0, 1] = 121  # an id outside the codebook (an EOS fill)
    live = torch.tensor([True, True, False])
    records = []
    for offset, steps in ((None, [torch.full((3, 4, V), SUPPRESSED_LOGIT).index_copy(-1, torch.arange(lo, hi), z)
                                  for z in codes]), (lo, codes)):
        recorder = ProbRecorder(offset=offset)
        for z in steps:
            recorder.add_step(z, 0.5, live)
        recorder.close_block(0, 0, final)
        records.append(recorder.trajectory(torch.zeros(3, 4, dtype=torch.long), 2).token_probs)
    torch.testing.assert_close(records[1], records[0], rtol=2e-6, atol=0, equal_nan=True)
    assert records[1][0, :, 1].eq(0).all() and records[1][2].isnan().all() and (records[1][1] > 0).all()


# --------------------------------------------------------------------------------------------
# Randomness, remasking, threshold decoding
# --------------------------------------------------------------------------------------------


def _sample(model, seed, **kw):
    ids, mask = left_pad(PROMPTS)
    args = dict(steps=8, gen_length=8, block_length=4, mask_id=MASK)
    args.update(kw)
    return generate(model, ids, mask, generator=torch.Generator().manual_seed(seed), **args)


def test_temperature_sampling_is_a_function_of_the_generator(model):
    a, b, c = _sample(model, 1, temperature=1.0), _sample(model, 1, temperature=1.0), _sample(model, 2, temperature=1.0)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert not torch.equal(a, _sample(model, 1, temperature=0.0))
    assert not (a == MASK).any()


def test_random_remasking_completes_and_changes_the_order(model):
    out, traj = _sample(model, 3, remasking="random", return_trajectory=True)
    again, _ = _sample(model, 3, remasking="random", return_trajectory=True)
    greedy, greedy_traj = _sample(model, 3, return_trajectory=True)
    assert torch.equal(out, again) and not (out == MASK).any()
    assert not torch.equal(traj.commit_step, greedy_traj.commit_step)
    for s in range(8):  # the fixed schedule still holds: one commit per row per step
        assert ((traj.commit_step == s).sum(1) == 1).all()


def test_threshold_one_is_one_token_per_step(model):
    ids, mask = left_pad(PROMPTS)
    counting = Counting(model)
    out = generate(counting, ids, mask, steps=1, gen_length=8, block_length=4, mask_id=MASK, threshold=1.0)
    fixed = generate(model, ids, mask, steps=8, gen_length=8, block_length=4, mask_id=MASK)
    assert torch.equal(out, fixed)
    assert counting.calls == 8


# The greedy token's probability is at least 1/V, so a threshold below it commits every position.
ANY_CONFIDENCE = 1e-6


def test_a_threshold_below_any_confidence_commits_each_block_in_one_step(model):
    ids, mask = left_pad(PROMPTS)
    counting = Counting(model)
    out = generate(counting, ids, mask, steps=99, gen_length=8, block_length=4, mask_id=MASK,
                   threshold=ANY_CONFIDENCE)
    one_step_per_block = generate(model, ids, mask, steps=2, gen_length=8, block_length=4, mask_id=MASK)
    assert torch.equal(out, one_step_per_block)
    assert counting.calls == 2


def test_threshold_commits_confident_tokens_and_one_more(model):
    ids, mask = left_pad(PROMPTS)
    threshold = 0.7
    out, traj = generate(model, ids, mask, steps=1, gen_length=8, block_length=8, mask_id=MASK,
                         threshold=threshold, return_trajectory=True)
    S = traj.token_probs.shape[1]
    assert 1 < S < 8  # the toy model is confident enough to commit several tokens in some step
    # With low-confidence remasking, token_probs at the commit step is the confidence that decided it.
    conf_at_commit = traj.token_probs.gather(1, traj.commit_step[:, None, :]).squeeze(1)  # [B, L]
    for s in range(S):
        now = traj.commit_step == s
        rows_with_masks = (traj.commit_step >= s).any(1)
        assert (now.sum(1)[rows_with_masks] >= 1).all()
        assert ((now & (conf_at_commit < threshold)).sum(1) <= 1).all()  # only the forced top-1 may be below


# --------------------------------------------------------------------------------------------
# Input checks: ValueError naming the parameter, before any model call
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    (dict(gen_length=10, block_length=4), "gen_length=10.*block_length=4"),
    (dict(steps=5), "steps=5"),
    (dict(mask_id=12), "mask_id=12"),
    (dict(remasking="confident"), "remasking"),
    (dict(temperature=0.5), "generator"),
    (dict(remasking="random"), "generator"),
    (dict(threshold=1.5), "threshold"),
    (dict(threshold=0.0), r"threshold must be in \(0, 1\]"),
    (dict(temperature=-1.0), "temperature"),
])
def test_bad_generate_arguments_fail_before_any_model_call(model, kwargs, match):
    ids, mask = left_pad(PROMPTS)
    counting = Counting(model)
    args = dict(steps=8, gen_length=8, block_length=4, mask_id=MASK)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        generate(counting, ids, mask, **args)
    assert counting.calls == 0


def test_too_long_for_the_model_fails_before_any_model_call(model):
    ids, mask = left_pad(PROMPTS)
    counting = Counting(model)
    counting.max_seq_len = 10
    with pytest.raises(ValueError, match="max_seq_len=10"):
        generate(counting, ids, mask, steps=8, gen_length=8, block_length=4, mask_id=MASK)
    assert counting.calls == 0


def test_mask_id_is_checked_against_the_logits_when_the_model_hides_its_vocabulary(model):
    class NoVocab:  # exposes no vocab_size; its logits show V = 12
        def __call__(self, x, attention_mask=None):
            return Output(logits=torch.zeros(*x.shape, 12))

    ids, mask = left_pad(PROMPTS)
    with pytest.raises(ValueError, match="mask_id=40"):
        generate(NoVocab(), ids, mask, steps=8, gen_length=8, block_length=4, mask_id=40)


# --------------------------------------------------------------------------------------------
# Registry samplers: masked, block, emerge; early exit
# --------------------------------------------------------------------------------------------


def test_registered_masked_sampler_returns_the_completion_of_generate(model):
    ids, mask = left_pad(PROMPTS)
    cfg = SamplerConfig(name="masked", steps=6, gen_length=6, block_length=3, temperature=0.0, early_exit=False)
    out = SAMPLERS.get("masked")(model, ids, mask, cfg, generator=None, return_trajectory=True)
    full = generate(model, ids, mask, steps=6, gen_length=6, block_length=3, mask_id=MASK)
    assert torch.equal(out.completion_ids, full[:, ids.shape[1]:])
    assert out.nfe == 6 and out.trajectory.commit_step.shape == (3, 6)


def test_registered_sampler_counts_a_guided_call_once(model):
    ids, mask = left_pad(PROMPTS)
    counting = Counting(model)
    cfg = SamplerConfig(steps=4, gen_length=8, block_length=4, temperature=0.0, cfg_scale=1.0)
    out = sample_masked(counting, ids, mask, cfg, generator=None)
    assert out.nfe == counting.calls == 4


def _builtin_block_model(block_size: int = 4):
    """A random built-in block-causal denoiser: the block sampler passes it an explicit block mask."""
    from ddrl.models import Denoiser, DenoiserConfig, DiffusionLM

    backbone = Denoiser(DenoiserConfig(vocab_size=12, d_model=16, n_layers=1, n_heads=2, max_seq_len=32,
                                       block_size=block_size), seed=0)
    return DiffusionLM(backbone, mask_token_id=MASK, pad_token_id=PAD, eos_token_id=EOS, vocab_size=12,
                       block_size=block_size, suppress_mask_logit=True).eval()


def test_block_sampler_uses_the_model_block_size(model):
    ids, mask = left_pad(PROMPTS)
    block_model = Counting(_builtin_block_model(4))
    cfg = SamplerConfig(name="block", steps=8, gen_length=8, temperature=0.0, early_exit=False)
    out = sample_block(block_model, ids, mask, cfg, generator=None)
    full = generate(block_model.model, ids, mask, steps=8, gen_length=8, block_length=4, mask_id=MASK)
    assert torch.equal(out.completion_ids, full[:, ids.shape[1]:])
    one_call = SamplerConfig(steps=8, gen_length=8, temperature=0.0, threshold=ANY_CONFIDENCE, early_exit=False)
    threshold = sample_block(block_model, ids, mask, one_call, generator=None)
    # Prompts of 3, 5 and 1 tokens end 3, 1 and 1 tokens into a block of 4 (SDAR's layout counts blocks
    # from position 0), so 8 completion tokens span 3 blocks: one call each when every position passes.
    assert threshold.nfe == 3
    aligned = sample_block(block_model, ids[:, 1:2], None, one_call, generator=None)
    assert aligned.nfe == 3  # a 1-token prompt: blocks [p, c0..c2], [c3..c6], [c7]
    four = torch.tensor([[2, 3, 4, 5]])
    assert sample_block(block_model, four, None, one_call, generator=None).nfe == 2
    with pytest.raises(ValueError, match="block_size"):
        sample_block(model, ids, mask, cfg, generator=None)
    with pytest.raises(ValueError, match="block_length=2"):
        sample_block(block_model, ids, mask, SamplerConfig(steps=8, gen_length=8, block_length=2), generator=None)


def test_unknown_cache_setting_is_refused(model):
    ids, mask = left_pad(PROMPTS)
    with pytest.raises(ValueError, match="cache='block'"):
        sample_masked(model, ids, mask, SamplerConfig(cache="block"), generator=torch.Generator())


class EosLover:
    """The toy model, with a bonus on EOS in rows whose prompt holds `trigger` (every row when None)."""

    def __init__(self, model, trigger=None, bonus=6.0):
        self.model, self.trigger, self.bonus = model, trigger, bonus
        self.calls, self.rows_seen = 0, []
        for name in ("vocab_size", "mask_token_id", "eos_token_id", "pad_token_id", "process", "block_size"):
            setattr(self, name, getattr(model, name))

    def __call__(self, x, attention_mask=None):
        self.calls += 1
        self.rows_seen.append(x.shape[0])
        logits = self.model(x, attention_mask).logits.clone()
        rows = torch.ones(x.shape[0], dtype=torch.bool) if self.trigger is None else (x == self.trigger).any(1)
        logits[rows, :, EOS] += self.bonus
        return Output(logits=logits)


def _up_to_first_eos(row: list[int]) -> list[int]:
    return row[:row.index(EOS) + 1] if EOS in row else row


@pytest.mark.parametrize("trigger", [None, 10])
def test_early_exit_keeps_tokens_up_to_eos_and_saves_calls(model, trigger):
    ids, mask = left_pad(PROMPTS)
    cfg = SamplerConfig(steps=12, gen_length=12, block_length=3, temperature=0.8)
    runs = {}
    for early_exit in (True, False):
        eos_model = EosLover(model, trigger)
        cfg.early_exit = early_exit
        out = sample_masked(eos_model, ids, mask, cfg, generator=torch.Generator().manual_seed(5),
                            return_trajectory=True)
        runs[early_exit] = (out, eos_model)
    (fast, fast_model), (slow, _) = runs[True], runs[False]
    for r in range(3):
        a, b = fast.completion_ids[r].tolist(), slow.completion_ids[r].tolist()
        assert _up_to_first_eos(a) == _up_to_first_eos(b), f"row {r}"
        if EOS in a:  # the blocks after the one holding the first EOS are filled with EOS
            block_end = (a.index(EOS) // 3 + 1) * 3
            assert set(a[block_end:]) <= {EOS}
    assert slow.nfe == 12
    if trigger is None:
        assert all(EOS in row for row in fast.completion_ids.tolist())
        assert fast.nfe < slow.nfe
        filled = fast.trajectory.commit_step == -1
        assert filled.any() and (fast.completion_ids[filled] == EOS).all()
        assert fast.trajectory.token_probs.shape[1] == fast.nfe
    else:  # the rows with the trigger finish early and stay in the batch, masked (static shapes)
        assert any(EOS in row[:9] for row in fast.completion_ids.tolist())
        assert set(fast_model.rows_seen) == {3}


def test_emerge_completes_deterministically_with_nfe_steps(model):
    ids, mask = left_pad(PROMPTS)
    cfg = SamplerConfig(name="emerge", steps=5, gen_length=10, temperature=1.0, cfg_scale=2.0, early_exit=False)
    counting = Counting(model)
    a = sample_emerge(counting, ids, mask, cfg, generator=torch.Generator().manual_seed(0), return_trajectory=True)
    b = sample_emerge(model, ids, mask, cfg, generator=torch.Generator().manual_seed(0))
    c = sample_emerge(model, ids, mask, cfg, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a.completion_ids, b.completion_ids) and not torch.equal(a.completion_ids, c.completion_ids)
    assert not (a.completion_ids == MASK).any()
    assert a.nfe == counting.calls == 5
    traj = a.trajectory
    assert ((traj.commit_step >= 0) & (traj.commit_step < 5)).all()
    at_commit = traj.token_probs.gather(1, traj.commit_step[:, None, :]).squeeze(1)
    assert torch.isfinite(at_commit).all() and (at_commit > 0).all()
    assert torch.allclose(traj.step_times, torch.tensor([1.0, 0.8, 0.6, 0.4, 0.2]))


def test_emerge_with_one_step_at_temperature_zero_is_the_argmax(model):
    ids, mask = left_pad(PROMPTS)
    cfg = SamplerConfig(name="emerge", steps=1, gen_length=6, temperature=0.0, early_exit=False)
    out = sample_emerge(model, ids, mask, cfg, generator=None)
    full = generate(model, ids, mask, steps=1, gen_length=6, block_length=6, mask_id=MASK)
    assert torch.equal(out.completion_ids, full[:, ids.shape[1]:])


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_emerge_unmasks_at_the_schedule_pace(schedule):
    toy = ToyDiffusionLM(vocab_size=12, mask_token_id=MASK, seed=1)
    toy.process = MaskedProcess(MASK, schedule=schedule)
    B, L, T = 128, 12, 4
    ids, mask = torch.full((B, 1), 5), torch.ones(B, 1, dtype=torch.bool)
    cfg = SamplerConfig(name="emerge", steps=T, gen_length=L, temperature=1.0, early_exit=False)
    out = sample_emerge(toy, ids, mask, cfg, generator=torch.Generator().manual_seed(0), return_trajectory=True)
    k = (lambda tau: 1 - tau) if schedule == "linear" else (lambda tau: math.cos(math.pi * tau / 2))
    for s in range(T):
        expected = L * (k(s / T) - k((s + 1) / T))
        mean = (out.trajectory.commit_step == s).sum(1).double().mean().item()
        assert abs(mean - expected) < 0.5, (s, mean, expected)


# --------------------------------------------------------------------------------------------
# Models whose logits are shifted by one (Dream)
# --------------------------------------------------------------------------------------------


class Shifted:
    """The toy model read Dream's way: position t carries the prediction for token t + 1."""

    logits_shifted = True

    def __init__(self, model):
        self.model = model
        self.vocab_size = model.vocab_size

    def __call__(self, x, attention_mask=None):
        logits = self.model(x, attention_mask).logits
        junk = torch.zeros_like(logits[:, :1])
        return Output(logits=torch.cat([logits[:, 1:], junk], dim=1))


@pytest.mark.parametrize("cfg_scale", [0.0, 1.0])
def test_shifted_logits_are_realigned_once_by_diffusion_lm(model, cfg_scale):
    # DiffusionLM undoes the shift; the sampler must not shift again (it used to: tokens one position off).
    from ddrl.models import DiffusionLM

    dream = DiffusionLM(Shifted(model), mask_token_id=MASK, vocab_size=12, logits_shifted=True).eval()
    ids, mask = left_pad(PROMPTS)
    args = dict(steps=4, gen_length=8, block_length=4, mask_id=MASK, cfg_scale=cfg_scale)
    assert torch.equal(generate(dream, ids, mask, **args), generate(model, ids, mask, **args))
