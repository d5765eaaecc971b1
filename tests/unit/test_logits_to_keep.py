"""logits_to_keep: only the positions a caller scores go through the LM head, with the same logits.

Every check compares against the full call (all T positions) sliced afterwards, so each would fail
if the kept logits were misaligned (Dream's shift at position 0 and right after the prompt), if the
mask/range suppression were skipped, or if an estimator read other positions than before. The
forward hooks on the LM head check that the head really sees only the kept positions.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import ddrl
import ddrl.estimators  # noqa: F401  (registers the estimators)
from ddrl.estimators.common import forward_logprobs
from ddrl.estimators.concrete_score import masked_position_log_probs
from ddrl.logits import kept_logits
from ddrl.models.diffusion_lm import DiffusionLM
from ddrl.models.transformer import Denoiser, DenoiserConfig
from ddrl.processes.block import staircase_elbo
from ddrl.registry import ESTIMATORS
from ddrl.sampling.utils import completion_logits
from ddrl.types import RolloutBatch

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
V = 24
MASK = 23


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """1e-6 relative to the logits' scale: the LM head on fewer rows may pick another matmul kernel."""
    scale = max(float(expected.abs().max()), 1.0)
    torch.testing.assert_close(actual, expected, atol=1e-6 * scale, rtol=1e-6)


class HeadInputs:
    """Records the shape of every input the LM head module sees (a forward pre-hook)."""

    def __init__(self, head: nn.Module):
        self.shapes: list[tuple[int, ...]] = []
        self.handle = head.register_forward_pre_hook(lambda _m, args: self.shapes.append(tuple(args[0].shape)))

    def __enter__(self) -> "HeadInputs":
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.remove()


class WithoutKeep(nn.Module):
    """The same model behind a forward that takes no logits_to_keep: callers must compute every
    position and slice (what the code did before logits_to_keep)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        for name in ("mask_token_id", "vocab_size", "pad_token_id", "eos_token_id", "block_size", "process",
                     "logits_shifted"):
            setattr(self, name, getattr(inner, name))

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        kwargs = {} if position_ids is None else {"position_ids": position_ids}
        return self.inner(input_ids, attention_mask=attention_mask, **kwargs)


def denoiser_lm(block_size: int | None = None, **kw) -> DiffusionLM:
    cfg = DenoiserConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=2, max_seq_len=64, block_size=block_size,
                         init_std=0.5)
    return DiffusionLM(Denoiser(cfg, seed=1), mask_token_id=MASK, suppress_mask_logit=True, **kw).eval()


@pytest.fixture(scope="module")
def llada() -> DiffusionLM:
    return ddrl.load_model(FIXTURES / "llada" / "model", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def dream() -> DiffusionLM:
    return ddrl.load_model(FIXTURES / "dream" / "model", dtype=torch.float32).eval()


def ids_and_mask(vocab: int, B: int = 3, T: int = 12, pad: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids [B, T] below `vocab` and a mask with row 1 left-padded by `pad`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :pad] = False
    return ids, mask


def rollout_batch(vocab: int, mask_id: int, *, B: int = 4, P: int = 5, L: int = 7, seed: int = 0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, P + L), generator=g)
    ids = ids.masked_fill(ids == mask_id, 0)
    prompt_mask = torch.ones(B, P, dtype=torch.bool)
    prompt_mask[1, :2] = False
    completion_mask = torch.ones(B, L, dtype=torch.bool)
    completion_mask[2, 5:] = False
    return RolloutBatch(prompt_ids=ids[:, :P], prompt_mask=prompt_mask, completion_ids=ids[:, P:],
                        completion_mask=completion_mask, group_ids=torch.tensor([0, 0, 1, 1]),
                        rewards=torch.zeros(B), advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
                        mask_seeds=torch.tensor([3]))


# -------------------------------------------------------------------------------- kept == full[:, kept]


@pytest.mark.parametrize("keep", [1, 5, torch.tensor([0, 4, 5, 11]), torch.tensor([7, 2, 2])])
def test_denoiser_kept_logits_equal_the_full_slice(keep):
    lm = denoiser_lm()
    ids, mask = ids_and_mask(V)
    with torch.no_grad():
        full = lm(ids, attention_mask=mask).logits  # [B, T, V]
        with HeadInputs(lm.model.lm_head) as head:
            kept = lm(ids, attention_mask=mask, logits_to_keep=keep).logits
        raw = lm.model(ids, attention_mask=mask, logits_to_keep=keep).logits  # the backbone's own contract
        raw_full = lm.model(ids, attention_mask=mask).logits
    index = keep if isinstance(keep, torch.Tensor) else torch.arange(12 - keep, 12)
    close(kept, full[:, index])
    close(raw, raw_full[:, index])
    assert head.shapes == [(3, len(index), 32)]
    assert (kept[..., MASK] == -1e4).all()  # suppression applies to the kept logits


def test_none_and_zero_keep_every_position():
    lm = denoiser_lm()
    ids, mask = ids_and_mask(V)
    with torch.no_grad():
        full = lm(ids, attention_mask=mask).logits
        assert torch.equal(lm(ids, attention_mask=mask, logits_to_keep=0).logits, full)
        assert torch.equal(lm(ids, attention_mask=mask, logits_to_keep=None).logits, full)
        assert full.shape == (3, 12, V)


def test_out_of_range_requests_are_errors(monkeypatch):
    lm = denoiser_lm()
    ids, _ = ids_and_mask(V)
    with pytest.raises(ValueError, match=r"logits_to_keep=13 must be in \[1, T=12\]"):
        lm(ids, logits_to_keep=13)
    with pytest.raises(RuntimeError, match="outside"):  # queued on the device (ddrl.ops.value_checks)
        lm(ids, logits_to_keep=torch.tensor([12]))
    monkeypatch.setenv("DDRL_SYNC_CHECKS", "1")  # debugging: read at once, the values named
    with pytest.raises(ValueError, match=r"outside \[0, 12\).*min 12, max 12"):
        lm(ids, logits_to_keep=torch.tensor([12]))
    with pytest.raises(ValueError, match="1-D long tensor"):
        lm(ids, logits_to_keep=torch.tensor([[1]]))


def test_native_llada_kept_logits_and_lm_head_sees_only_k(llada):
    ids, mask = ids_and_mask(llada.vocab_size - 4)  # below the special ids
    head_module = llada.model.get_output_embeddings()  # ff_out
    with torch.no_grad():
        full = llada(ids, attention_mask=mask).logits
        with HeadInputs(head_module) as head:
            last = llada(ids, attention_mask=mask, logits_to_keep=4).logits
            picked = llada(ids, attention_mask=mask, logits_to_keep=torch.tensor([0, 6, 11])).logits
    close(last, full[:, -4:])
    close(picked, full[:, [0, 6, 11]])
    assert head.shapes == [(3, 4, 64), (3, 3, 64)]


@pytest.mark.parametrize("keep", [torch.tensor([0]), torch.tensor([0, 1, 5, 6]), 7, 12])
def test_dream_shift_on_kept_positions(dream, keep):
    """Aligned position i is raw position i - 1 (position 0 repeats raw 0): the backbone is asked for
    those raw positions, and the result equals the full call's realigned logits at i."""
    assert dream.logits_shifted
    ids, mask = ids_and_mask(100)
    with torch.no_grad():
        full = dream(ids, attention_mask=mask).logits  # realigned by DiffusionLM
        raw = dream.model(ids, attention_mask=mask).logits  # the backbone's own, unshifted
        with HeadInputs(dream.model.lm_head) as head:
            kept = dream(ids, attention_mask=mask, logits_to_keep=keep).logits
    index = keep if isinstance(keep, torch.Tensor) else torch.arange(12 - keep, 12)
    close(kept, full[:, index])
    lo, hi = dream.logits_range or (0, raw.shape[-1])  # raw logits are not range-suppressed
    if isinstance(keep, torch.Tensor) and keep[0] == 0:
        close(kept[:, 0, lo:hi], raw[:, 0, lo:hi])  # position 0 repeats raw 0
    if isinstance(keep, torch.Tensor) and len(keep) > 2:
        close(kept[:, 2, lo:hi], raw[:, 4, lo:hi])  # aligned 5 = raw 4
    n_head = 12 if len(index) == 12 else len(index)
    assert head.shapes == [(3, n_head, 64)]
    if dream.logits_range is not None:  # the padded vocabulary past the tokenizer stays suppressed
        assert (kept[..., dream.logits_range[1]:] == -1e4).all()


def test_dream_position_right_after_the_prompt_reads_the_last_prompt_token(dream):
    """completion_logits keeps the L completion positions; the first one's logits are the raw logits
    of the last prompt token (P - 1), exactly as the full call's realignment gives."""
    ids, mask = ids_and_mask(100, T=10)
    P = 6
    with torch.no_grad():
        kept = completion_logits(dream, ids[:, :P], mask[:, :P], ids[:, P:], cfg_scale=0.0, mask_id=dream.mask_token_id)
        raw = dream.model(ids, attention_mask=mask).logits
        full = dream(ids, attention_mask=mask).logits
    close(kept, full[:, P:])
    lo, hi = dream.logits_range or (0, raw.shape[-1])
    close(kept[:, 0, lo:hi], raw[:, P - 1, lo:hi])


# -------------------------------------------------------------------------------- backbones without it


class NoKeepBackbone(nn.Module):
    """A user's module whose forward takes no logits_to_keep: logits_i = embedding of token i and i-1."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = nn.Parameter(torch.randn(V, V, generator=g))
        self.config = SimpleNamespace(vocab_size=V)

    def forward(self, input_ids, attention_mask=None):
        e = self.emb[input_ids]
        return SimpleNamespace(logits=e + torch.roll(e, 1, dims=1))


class IntOnlyBackbone(NoKeepBackbone):
    """A transformers-style forward: logits_to_keep must be an int (the last K positions)."""

    def __init__(self):
        super().__init__()
        self.requests: list[object] = []

    def forward(self, input_ids, attention_mask=None, logits_to_keep=0):
        assert isinstance(logits_to_keep, int), "this backbone takes only a count"
        self.requests.append(logits_to_keep)
        logits = super().forward(input_ids).logits
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


@pytest.mark.parametrize("backbone_cls", [NoKeepBackbone, IntOnlyBackbone])
@pytest.mark.parametrize("shifted", [False, True])
@pytest.mark.parametrize("keep", [3, torch.tensor([0, 4, 5]), torch.tensor([6, 2])])
def test_backbones_without_index_support(backbone_cls, shifted, keep):
    lm = DiffusionLM(backbone_cls(), mask_token_id=MASK, logits_shifted=shifted, suppress_mask_logit=True)
    ids, mask = ids_and_mask(V, T=8)
    full = lm(ids, attention_mask=mask).logits
    kept = lm(ids, attention_mask=mask, logits_to_keep=keep).logits
    index = keep if isinstance(keep, torch.Tensor) else torch.arange(8 - keep, 8)
    assert torch.equal(kept, full[:, index])
    if backbone_cls is IntOnlyBackbone:  # asked for the suffix that covers the (raw) positions
        raw_first = int((index - 1).clamp(min=0).min()) if shifted else int(index.min())
        assert lm.model.requests[-1] == (0 if 8 - raw_first == 8 else 8 - raw_first)


def test_a_registered_native_backbone_that_ignores_the_request_is_sliced(llada):
    """A backbone that returns every position although asked for a few (test_model_loading's stand-in
    does) still gives the kept positions."""

    class Ignores(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, input_ids, attention_mask=None, logits_to_keep=None):
            return self.inner(input_ids, attention_mask=attention_mask)

    lm = DiffusionLM(Ignores(llada.model), mask_token_id=llada.mask_token_id)
    ids, mask = ids_and_mask(100)
    with torch.no_grad():
        full = lm(ids, attention_mask=mask).logits
        assert torch.equal(lm(ids, attention_mask=mask, logits_to_keep=torch.tensor([1, 9])).logits, full[:, [1, 9]])
        assert torch.equal(lm(ids, attention_mask=mask, logits_to_keep=2).logits, full[:, -2:])


def test_kept_logits_slices_for_models_without_the_argument():
    lm = denoiser_lm()
    ids, mask = ids_and_mask(V)
    with torch.no_grad():
        full = lm(ids, attention_mask=mask).logits
        wrapped = WithoutKeep(lm)
        assert torch.equal(kept_logits(wrapped, ids, mask, logits_to_keep=5), full[:, -5:])
        assert torch.equal(kept_logits(wrapped, ids, mask, logits_to_keep=torch.tensor([3, 0])), full[:, [3, 0]])
        close(kept_logits(lm, ids, mask, logits_to_keep=5), full[:, -5:])


def test_class_range_is_the_slice_of_the_suppressed_logits():
    """kept_logits(class_range=(a, b)) = the kept logits' ids [a, b): sliced for a model without the argument,
    and for a DiffusionLM whose head has no range_logits (the mask id in the range stays suppressed)."""
    lm = denoiser_lm()
    ids, mask = ids_and_mask(V)
    a, b = MASK - 3, MASK + 1  # the mask id is the last of the range
    with torch.no_grad():
        full = lm(ids, attention_mask=mask).logits
        for model in (WithoutKeep(lm), lm):
            got = kept_logits(model, ids, mask, logits_to_keep=5, class_range=(a, b))
            assert torch.equal(got, full[:, -5:, a:b])
        assert (lm(ids, attention_mask=mask, class_range=(a, b)).logits[..., 3] == -1e4).all()
        for bad in [(b, a), (0, V + 1), (3,)]:
            with pytest.raises(ValueError, match="class_range"):
                lm(ids, attention_mask=mask, class_range=bad)


# -------------------------------------------------------------------------------- estimators unchanged


def test_forward_logprobs_equals_the_full_logits_computation(llada):
    batch = rollout_batch(100, llada.mask_token_id)
    P = batch.prompt_ids.shape[1]
    noisy = batch.completion_ids.clone()
    noisy[:, ::2] = llada.mask_token_id
    with torch.no_grad():
        with HeadInputs(llada.model.get_output_embeddings()) as head:
            lp = forward_logprobs(llada, batch.prompt_ids, batch.prompt_mask, noisy, batch.completion_ids,
                                  rows_per_call=3)
        ids = torch.cat([batch.prompt_ids, noisy], dim=1)
        attn = torch.cat([batch.prompt_mask, torch.ones_like(noisy, dtype=torch.bool)], dim=1)
        full = llada(ids, attention_mask=attn).logits[:, P:]  # [B, L, V]
        expected = torch.log_softmax(full.float(), -1).gather(-1, batch.completion_ids[..., None]).squeeze(-1)
    close(lp, expected)
    assert head.shapes == [(3, 7, 64), (1, 7, 64)]  # the completion's 7 positions only, per call


@pytest.mark.parametrize("cfg_scale", [0.0, 1.5])
def test_completion_logits_unchanged(llada, cfg_scale):
    batch = rollout_batch(100, llada.mask_token_id)
    P = batch.prompt_ids.shape[1]
    with torch.no_grad():
        kept = completion_logits(llada, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                 cfg_scale=cfg_scale, mask_id=llada.mask_token_id)
        sliced = completion_logits(WithoutKeep(llada), batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                   cfg_scale=cfg_scale, mask_id=llada.mask_token_id)
        direct = llada(batch.input_ids, attention_mask=batch.attention_mask).logits[:, P:]
    close(kept, sliced)
    if cfg_scale == 0.0:
        close(kept, direct)


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("name", ["mean_field", "coupled_elbo", "random_ratio", "concrete_score"])
def test_estimators_unchanged_against_a_model_that_slices(request, family, name):
    lm = request.getfixturevalue(family)
    batch = rollout_batch(100, lm.mask_token_id)
    estimator = ESTIMATORS.get(name)()
    with torch.no_grad():
        with HeadInputs(lm.model.get_output_embeddings()) as head:
            kept = estimator(lm, batch, seed=5)
        sliced = estimator(WithoutKeep(lm), batch, seed=5)
    assert torch.equal(kept.mask, sliced.mask)
    close(kept.token_logp, sliced.token_logp)
    close(kept.seq_logp, sliced.seq_logp)
    T = batch.input_ids.shape[1]
    assert head.shapes and all(shape[1] < T for shape in head.shapes)


def test_concrete_score_reads_only_the_probed_positions(llada):
    batch = rollout_batch(100, llada.mask_token_id)
    positions = torch.tensor([[0, 3], [6, 1], [2, 0], [5, 4]])  # [B, K]
    P = batch.prompt_ids.shape[1]
    with torch.no_grad():
        with HeadInputs(llada.model.get_output_embeddings()) as head:
            lp = masked_position_log_probs(llada, batch, positions)  # [B, K, V]
        # direct: row (b, k) masks only its probed position; full logits read there
        ids = batch.input_ids.repeat_interleave(2, dim=0)
        target = P + positions.reshape(-1)
        ids[torch.arange(8), target] = llada.mask_token_id
        full = llada(ids, attention_mask=batch.attention_mask.repeat_interleave(2, dim=0)).logits
        logits = full[torch.arange(8), target].float()
        logits[:, llada.mask_token_id] = float("-inf")
        expected = torch.log_softmax(logits, -1).reshape(4, 2, -1)
    close(lp, expected)
    assert head.shapes == [(8, 1, 64)]  # each row's own probed position only (was the union: 7 of T = 12)


def test_staircase_elbo_reads_only_the_noisy_completion():
    lm = denoiser_lm(block_size=2)
    batch = rollout_batch(V - 1, MASK)
    L = batch.completion_ids.shape[1]
    run = lambda model: staircase_elbo(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, 2,  # noqa: E731
                                       generator=torch.Generator().manual_seed(2),
                                       completion_mask=batch.completion_mask)
    with torch.no_grad():
        with HeadInputs(lm.model.lm_head) as head:
            kept = run(lm)
        sliced = run(WithoutKeep(lm))
    for a, b in zip(kept, sliced):
        close(a.double(), b.double())
    assert head.shapes == [(4, L, 32)]


def test_block_pretrain_loss_unchanged():
    lm = denoiser_lm(block_size=2)
    batch = rollout_batch(V - 1, MASK)
    x0, eligible = batch.input_ids, torch.cat([torch.zeros_like(batch.prompt_mask), batch.completion_mask], 1)
    run = lambda model: lm.process.pretrain_loss(model, x0, eligible, batch.attention_mask,  # noqa: E731
                                                 generator=torch.Generator().manual_seed(4))[0]
    with torch.no_grad():
        with HeadInputs(lm.model.lm_head) as head:
            kept = run(lm)
        sliced = run(WithoutKeep(lm))
    close(kept, sliced)
    assert head.shapes == [(4, x0.shape[1], 32)]  # the noisy stream only: T of the 2T positions


def test_gradients_equal_the_sliced_version():
    """The kept path is differentiable and gives the full path's gradients (the RL backward)."""
    batch = rollout_batch(V - 1, MASK)
    noisy = batch.completion_ids.masked_fill(torch.arange(7) % 3 == 0, MASK)
    grads = []
    for wrap in (lambda m: m, WithoutKeep):
        lm = denoiser_lm()
        lp = forward_logprobs(wrap(lm), batch.prompt_ids, batch.prompt_mask, noisy, batch.completion_ids)
        lp.sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in lm.parameters()]))
    close(grads[0], grads[1])


def test_lora_wrapped_backbone_still_keeps():
    from ddrl.config import LoraConfig
    from ddrl.models.lora import apply_lora

    lm = apply_lora(denoiser_lm(), LoraConfig(rank=4))
    ids, mask = ids_and_mask(V)
    with torch.no_grad():
        full = lm(ids, attention_mask=mask).logits
        with HeadInputs(lm.model.get_base_model().lm_head) as head:
            kept = lm(ids, attention_mask=mask, logits_to_keep=torch.tensor([1, 8])).logits
    close(kept, full[:, [1, 8]])
    assert head.shapes == [(3, 2, 32)]


@pytest.mark.parametrize("family,cache", [("llada", "none"), ("llada", "prefix"), ("llada", "dual"),
                                          ("dream", "dual"), ("sdar", "none"), ("sdar", "auto")])
def test_samplers_apply_the_lm_head_to_the_block_only(family, cache):
    """Every sampler call computes logits for the current block's positions and nothing else, and
    the tokens are those of the reference path (cache none on full attention, exact cache on SDAR)."""
    model = ddrl.load_model(FIXTURES / family / "model").eval()
    head = model.model.get_output_embeddings()
    widths: list[int] = []
    handle = head.register_forward_hook(lambda m, args, out: widths.append(args[0].shape[1]))
    prompt = torch.tensor([model.tokenizer.encode_prompt("Say a")])
    block = model.block_size or 4
    kwargs = dict(steps=8, gen_length=8, block_length=block, temperature=0.0, mask_id=model.mask_token_id)
    try:
        with torch.no_grad():
            out = ddrl.generate(model, prompt, None, cache=cache, **kwargs)
    finally:
        handle.remove()
    assert widths and set(widths) <= {block}, widths  # the head never sees the prompt or other blocks
    if cache in ("none", "auto"):
        with torch.no_grad():
            ref = ddrl.generate(model, prompt, None, cache="none", **kwargs)
        assert torch.equal(out, ref)
