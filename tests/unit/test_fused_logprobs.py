"""log p(target) through the LM head chunk by chunk (ddrl.ops.logprobs) equals the unfused computation.

Every check compares values AND gradients with the plain path (full logits, float32/64
log-softmax, gather) in float64, where both must agree to rounding: the chunked op alone; a
DiffusionLM over the built-in Denoiser and over each native family's backbone (Dream's shift and
padded-vocabulary range included), with a scored-position mask and uniform diffusion's class
range; LoRA adapters on the trunk and on the head. The Liger path's plumbing (scale, bias,
suppression, class range) is checked against the torch path with a stand-in kernel, since Liger
runs only on CUDA. A forward hook on the head shows what reaches it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import ddrl
import ddrl.ops.logprobs as ops
from ddrl.logits import kept_logits, kept_logprobs
from ddrl.models.backbone import head_linear
from ddrl.models.diffusion_lm import DiffusionLM
from ddrl.models.transformer import Denoiser, DenoiserConfig
from ddrl.ops.logprobs import SUPPRESSED_LOGIT, HeadLinear, target_logprobs
from tests.unit.test_logits_to_keep import HeadInputs  # records what the LM head sees

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
V, D, MASK = 40, 12, 39


def exact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """float64: the chunked and plain paths differ by summation order only."""
    torch.testing.assert_close(actual, expected, atol=1e-10, rtol=1e-9)


class VocabTensors(TorchDispatchMode):
    """The largest freshly allocated tensor (not a view) whose last dimension is the vocabulary."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.largest, self.ops = vocab, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab and not t._is_view():
                self.largest = max(self.largest, t.numel())
                self.ops.add(str(func))
        return out


def reference(hidden, targets, weight, bias=None, scale=None, suppressed=None, class_range=None):
    """The plain computation: every logit, float64 log-softmax, gather."""
    logits = F.linear(hidden, weight, bias)
    if scale is not None:
        logits = logits * scale
    if suppressed is not None:
        logits = logits.masked_fill(suppressed, SUPPRESSED_LOGIT)
    if class_range is not None:
        logits, targets = logits[..., class_range[0]:class_range[1]], targets - class_range[0]
    return torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)


def head_parts(seed: int = 0, bias: bool = True, dtype: torch.dtype = torch.float64):
    """A head nn.Linear(D, V), hidden states [3, 7, D] (with grad), targets [3, 7], loss weights [3, 7]."""
    g = torch.Generator().manual_seed(seed)
    head = nn.Linear(D, V, bias=bias).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, D, generator=g))
        if bias:
            head.bias.copy_(torch.randn(V, generator=g))
    hidden = torch.randn(3, 7, D, generator=g).to(dtype).requires_grad_()
    targets = torch.randint(0, V - 1, (3, 7), generator=g)
    return head, hidden, targets, torch.randn(3, 7, generator=g).to(dtype)


def gradients(loss: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, tensors))


# -------------------------------------------------------------------------------- the op


@pytest.mark.parametrize("chunk", [1, 4, 7, 15, None])
@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("extras", ["plain", "suppressed", "class_range"])
def test_chunked_values_and_gradients_equal_the_unfused_computation(chunk, flat, extras):
    head, hidden, targets, weights = head_parts()
    suppressed = class_range = None
    if extras == "suppressed":
        suppressed = torch.zeros(V, dtype=torch.bool)
        suppressed[[MASK, 3]] = True
        targets = targets.masked_fill(targets == 3, 4)
    if extras == "class_range":
        class_range = (5, 30)
        targets = targets % 25 + 5
    h = hidden.reshape(-1, D) if flat else hidden  # [21, D] or [3, 7, D]
    t = targets.reshape(h.shape[:-1])
    lp = target_logprobs(h, t, head, vocab=V, suppressed=suppressed, class_range=class_range, chunk=chunk)
    ref = reference(h, t, head.weight, head.bias, suppressed=suppressed, class_range=class_range)
    exact(lp, ref)
    params = (hidden, head.weight, head.bias)
    w = weights.reshape(t.shape)
    for got, want in zip(gradients((lp * w).sum(), *params), gradients((ref * w).sum(), *params)):
        exact(got, want)


@pytest.mark.parametrize("chunk", [2, 5])
def test_no_piece_holds_more_than_chunk_positions_in_forward_or_backward(chunk):
    head, hidden, targets, weights = head_parts()
    with VocabTensors(V) as seen:
        lp = target_logprobs(hidden, targets, head, vocab=V, chunk=chunk)
        (lp * weights).sum().backward()
    assert seen.largest <= max(chunk, D) * V, seen.largest  # a piece's logits, or the head's [D, V] gradient
    with VocabTensors(V) as plain:  # the test can fail: the plain path holds all 21 positions
        (reference(hidden, targets, head.weight, head.bias) * weights).sum().backward()
    assert plain.largest >= hidden.shape[0] * hidden.shape[1] * V


def test_rows_that_fit_a_chunk_reach_the_head_whole():
    """The head sees [n, K, D] pieces of whole rows (as the logits path shows it), or flattened
    pieces of `chunk` positions when one row is longer than a chunk."""
    head, hidden, targets, _ = head_parts()
    with torch.no_grad(), HeadInputs(head) as seen:
        target_logprobs(hidden, targets, head, vocab=V, chunk=14)
        target_logprobs(hidden, targets, head, vocab=V, chunk=5)
    assert seen.shapes == [(2, 7, D), (1, 7, D)] + [(5, D)] * 4 + [(1, D)]


def test_bfloat16_hidden_states_give_float32_log_probs_of_the_bfloat16_logits():
    head, hidden, targets, _ = head_parts(bias=False)
    head = head.to(torch.bfloat16)
    h = hidden.detach().to(torch.bfloat16)
    lp = target_logprobs(h, targets, head, vocab=V, chunk=4)
    assert lp.dtype == torch.float32
    plain = torch.log_softmax(head(h).float(), -1).gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(lp, plain, atol=1e-5, rtol=1e-5)
    assert target_logprobs(hidden.detach(), targets, head.double(), vocab=V).dtype == torch.float64


def test_bad_arguments_name_the_fix():
    head, hidden, targets, _ = head_parts()
    with pytest.raises(ValueError, match="positive number of positions"):
        target_logprobs(hidden, targets, head, vocab=V, chunk=0)
    with pytest.raises(ValueError, match="must be one of auto, torch, liger"):
        target_logprobs(hidden, targets, head, vocab=V, backend="cuda")
    with pytest.raises(ValueError, match=r"over the targets' shape"):
        target_logprobs(hidden, targets[:, :3], head, vocab=V)


# -------------------------------------------------------------------------------- Liger (stand-in kernel)


def fake_liger(calls: list):
    """liger_fused_linear_cross_entropy's contract (reduction="none": per-token CE, float32) in torch.
    Liger takes no float64, so these checks run in float32."""

    def kernel(h, weight, target, bias=None, reduction="mean", accum_dtype=None):
        assert reduction == "none" and h.dim() == 2 and target.dim() == 1
        calls.append((tuple(h.shape), tuple(weight.shape), accum_dtype))
        return F.cross_entropy(F.linear(h, weight, bias).float(), target, reduction="none")

    return kernel


@pytest.mark.parametrize("extras", ["plain", "scale_and_suppressed", "class_range"])
def test_liger_path_passes_scale_bias_suppression_and_range_to_the_kernel(monkeypatch, extras):
    calls: list = []
    monkeypatch.setattr(ops, "liger_function", lambda: fake_liger(calls))
    head, hidden, targets, weights = head_parts(dtype=torch.float32)
    scale = suppressed = class_range = None
    if extras == "scale_and_suppressed":
        scale = 0.5
        suppressed = torch.zeros(V, dtype=torch.bool)
        suppressed[MASK] = True
    if extras == "class_range":
        class_range = (5, 30)
        targets = targets % 25 + 5
    linear = HeadLinear(head.weight, head.bias, scale)
    fn = (lambda h: head(h) * scale) if scale is not None else head  # noqa: E731
    got = target_logprobs(hidden, targets, fn, vocab=V, suppressed=suppressed, class_range=class_range,
                          backend="liger", linear=linear)
    want = target_logprobs(hidden, targets, fn, vocab=V, suppressed=suppressed, class_range=class_range,
                           backend="torch")
    assert len(calls) == 1 and calls[0][0] == (21, D)
    close = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, want, **close)
    params = (hidden, head.weight, head.bias)
    for a, b in zip(gradients((got * weights).sum(), *params), gradients((want * weights).sum(), *params)):
        torch.testing.assert_close(a, b, **close)


def test_liger_is_chosen_on_cuda_only_and_refused_where_it_cannot_run(monkeypatch):
    calls: list = []
    monkeypatch.setattr(ops, "liger_function", lambda: fake_liger(calls))
    head, hidden, targets, _ = head_parts(dtype=torch.float32)
    linear = HeadLinear(head.weight, head.bias)
    target_logprobs(hidden, targets, head, vocab=V, linear=linear)
    assert calls == []  # auto on the CPU: the torch path
    with pytest.raises(ValueError, match="not one affine map"):
        target_logprobs(hidden, targets, head, vocab=V, backend="liger", linear=None)
    with pytest.raises(ValueError, match="do not take float64"):
        target_logprobs(hidden.double(), targets, head.double(), vocab=V, backend="liger", linear=linear)
    monkeypatch.setattr(ops, "liger_function", lambda: None)
    with pytest.raises(ValueError, match=r"liger-kernel >= 0\.8\.2 is not installed"):
        target_logprobs(hidden, targets, head, vocab=V, backend="liger", linear=linear)


def test_liger_releases_before_the_reduction_none_gradient_fix_are_not_used(monkeypatch):
    """liger-kernel < 0.8.2 scaled every token's gradient by the first token's (PR #1298)."""
    assert ops._release("0.8.5.dev20261027042432") == (0, 8, 5) and ops._release("0.8.1") < ops.LIGER_MIN_VERSION
    ops.liger_function.cache_clear()
    monkeypatch.setattr(ops.importlib.metadata, "version", lambda name: "0.8.1")
    try:
        assert ops.liger_function() is None
    finally:
        ops.liger_function.cache_clear()


# -------------------------------------------------------------------------------- DiffusionLM


def denoiser_lm(vocab: int = V, seed: int = 1, **kw) -> DiffusionLM:
    cfg = DenoiserConfig(vocab_size=vocab, d_model=16, n_layers=2, n_heads=2, max_seq_len=64, init_std=0.4)
    return DiffusionLM(Denoiser(cfg, seed=seed), mask_token_id=vocab - 1, suppress_mask_logit=True, **kw).double()


def batch(vocab: int, B: int = 3, T: int = 11, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab - 1, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :2] = False  # a left-padded row
    return ids, mask, torch.rand(B, 6, generator=g) < 0.6, torch.randn(B, 6, generator=g, dtype=torch.float64)


def scored_both_ways(lm: DiffusionLM, ids, mask, *, keep, targets, scored=None, class_range=None, chunk=3):
    """(values, grads) of the fused path and of the unfused one (fused_logprobs=False), same model."""
    results = []
    for fused in (True, False):
        lm.zero_grad()
        lm.fused_logprobs, lm.logprob_chunk = fused, chunk
        lp = kept_logprobs(lm, ids, mask, logits_to_keep=keep, targets=targets, mask=scored, class_range=class_range)
        w = torch.linspace(-1.0, 2.0, lp.numel(), dtype=lp.dtype).view(lp.shape)
        (lp * w).sum().backward()
        results.append((lp.detach(), {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}))
    lm.fused_logprobs, lm.logprob_chunk = True, None
    return results


def assert_same(results) -> None:
    (lp, grads), (lp_ref, grads_ref) = results
    exact(lp, lp_ref)
    assert grads.keys() == grads_ref.keys() and grads
    for name in grads:
        exact(grads[name], grads_ref[name])


@pytest.mark.parametrize("case", ["last_k", "positions", "scored_subset", "class_range"])
def test_denoiser_fused_equals_unfused_values_and_every_gradient(case):
    lm = denoiser_lm()
    ids, mask, scored, _ = batch(V)
    keep: int | torch.Tensor = 6
    kwargs: dict = {}
    targets = ids[:, -6:]
    if case == "positions":
        keep = torch.tensor([0, 3, 4, 7, 9, 10])
        targets = ids[:, keep]
    if case == "scored_subset":
        kwargs["scored"] = scored
    if case == "class_range":
        kwargs["class_range"] = (4, 30)
        targets = targets % 26 + 4
    results = scored_both_ways(lm, ids, mask, keep=keep, targets=targets, **kwargs)
    assert_same(results)
    if case == "scored_subset":
        assert (results[0][0][~scored] == 0).all()


def test_only_scored_positions_reach_the_head_and_no_vocabulary_wide_logits_exist():
    lm = denoiser_lm(vocab=300)
    ids, mask, scored, _ = batch(300)
    lm.logprob_chunk = 4
    with HeadInputs(lm.model.lm_head) as head, VocabTensors(300) as seen:
        lp = kept_logprobs(lm, ids, mask, logits_to_keep=6, targets=ids[:, -6:], mask=scored)
        lp.sum().backward()
    n = int(scored.sum())  # forward pieces, then backward's recomputation of the same pieces
    assert sum(s[0] for s in head.shapes) == 2 * n and all(s[0] <= 4 for s in head.shapes)
    assert seen.largest <= 16 * 300  # at most the head's [d_model = 16, V] gradient: no [rows, K, V] logits


def test_lora_on_the_trunk_and_on_the_head_gets_the_unfused_gradients():
    from ddrl.config import LoraConfig
    from ddrl.models.lora import apply_lora

    lm = apply_lora(denoiser_lm(), LoraConfig(rank=4, target_modules=["q_proj", "v_proj", "lm_head"]))
    with torch.no_grad():  # B = 0 at init: move it so that the adapter changes the logits
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.linspace(-0.3, 0.3, p.numel(), dtype=p.dtype).view(p.shape))
    assert head_linear(lm.model) is None  # the head is adapted: no single affine map for Liger
    ids, mask, scored, _ = batch(V)
    results = scored_both_ways(lm, ids, mask, keep=6, targets=ids[:, -6:], scored=scored)
    assert_same(results)
    assert any("lm_head" in n and "lora_A" in n for n in results[0][1])  # the head's adapter learns
    assert not any(n.endswith("base_layer.weight") for n in results[0][1])  # frozen base weights


@pytest.fixture(scope="module", params=["llada", "dream", "sdar"])
def native(request) -> DiffusionLM:
    """A DiffusionLM over each native family's backbone, with the loaded model's facts."""
    loaded = ddrl.load_model(FIXTURES / request.param / "model", dtype=torch.float64)
    lm = DiffusionLM(loaded.model, mask_token_id=loaded.mask_token_id, logits_shifted=loaded.logits_shifted,
                     suppress_mask_logit=True, family=loaded.family)
    lm.logits_range = loaded.logits_range  # Dream: its padded vocabulary stays suppressed
    return lm


def test_native_families_fused_equals_unfused(native):
    ids, mask, scored, _ = batch(100, T=12)
    keep = torch.tensor([0, 1, 5, 6, 9, 11])  # position 0 and a later one: Dream's shift at both ends
    assert_same(scored_both_ways(native, ids, mask, keep=keep, targets=ids[:, keep], scored=scored))
    assert_same(scored_both_ways(native, ids, mask, keep=6, targets=ids[:, -6:]))


def test_native_head_linear_is_the_head(native):
    linear = head_linear(native.model)
    h = torch.randn(2, 3, linear.weight.shape[1], dtype=torch.float64)
    logits = F.linear(h, linear.weight, linear.bias) * (linear.scale or 1.0)
    exact(logits, native.model.lm_head(h))


def test_dream_realigns_by_positions_without_copying_the_logits():
    dream = ddrl.load_model(FIXTURES / "dream" / "model", dtype=torch.float64).eval()
    ids, mask, _, _ = batch(100, T=9)
    with torch.no_grad():
        raw = dream.model(ids, attention_mask=mask).logits  # [B, T, V] the backbone's own (AR-shifted)
        with VocabTensors(raw.shape[-1]) as seen, HeadInputs(dream.model.lm_head) as head:
            aligned = dream(ids, attention_mask=mask).logits
    shifted = dream.suppress_logits(torch.cat([raw[:, :1], raw[:, :-1]], dim=1))
    exact(aligned, shifted)
    assert head.shapes == [(3, 9, 64)] and "aten.cat.default" not in seen.ops


# -------------------------------------------------------------------------------- per-row positions


def test_per_row_positions_equal_the_full_logits_there():
    lm = denoiser_lm()
    ids, mask, _, _ = batch(V)
    index = torch.tensor([[10, 2], [4, 4], [0, 7]])  # [B, K]
    with torch.no_grad():
        full = lm(ids, attention_mask=mask).logits
        with HeadInputs(lm.model.lm_head) as head:
            kept = lm(ids, attention_mask=mask, logits_to_keep=index).logits
        sliced = kept_logits(NoKeep(lm), ids, mask, logits_to_keep=index)
    rows = torch.arange(3)[:, None]
    exact(kept, full[rows, index])
    exact(sliced, full[rows, index])
    assert head.shapes == [(3, 2, 16)]
    with pytest.raises(ValueError, match=r"\[B, K\] one of each row's positions \(B = 3\)"):
        lm(ids, logits_to_keep=index[:2])


class NoKeep(nn.Module):
    """The model behind a forward that takes neither logits_to_keep nor targets."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.mask_token_id = inner.mask_token_id

    def forward(self, input_ids, attention_mask=None):
        return self.inner(input_ids, attention_mask=attention_mask)


def test_models_without_targets_are_scored_from_their_logits():
    lm = denoiser_lm()
    ids, mask, scored, _ = batch(V)
    with torch.no_grad():
        fused = kept_logprobs(lm, ids, mask, logits_to_keep=6, targets=ids[:, -6:], mask=scored)
        plain = kept_logprobs(NoKeep(lm), ids, mask, logits_to_keep=6, targets=ids[:, -6:], mask=scored)
    exact(fused, plain)


def test_targets_of_the_wrong_shape_are_an_error():
    lm = denoiser_lm()
    ids, mask, _, _ = batch(V)
    with pytest.raises(ValueError, match=r"targets.ids has shape \[3, 5\]; it must be \[B, K\] = \[3, 6\]"):
        kept_logprobs(lm, ids, mask, logits_to_keep=6, targets=ids[:, -5:])


class IntOnly(nn.Module):
    """A transformers-style backbone: logits_to_keep must be a count (the last K positions)."""

    def __init__(self, inner: Denoiser):
        super().__init__()
        self.inner, self.config, self.requests = inner, inner.config, []

    def forward(self, input_ids, attention_mask=None, logits_to_keep=0):
        assert isinstance(logits_to_keep, int)
        self.requests.append(logits_to_keep)
        out = self.inner(input_ids, attention_mask=attention_mask)  # every position
        return dataclasses.replace(out, logits=out.logits[:, -logits_to_keep:] if logits_to_keep else out.logits)


@pytest.mark.parametrize("shifted", [False, True])
def test_per_row_positions_on_a_backbone_that_takes_a_count(shifted):
    """The backbone computes the suffix that covers every row's positions; each row takes its own
    (Dream's raw i - 1 when shifted). No fused head: such a backbone has no compute_logits."""
    inner = denoiser_lm().model
    lm = DiffusionLM(IntOnly(inner), mask_token_id=MASK, logits_shifted=shifted, suppress_mask_logit=True).double()
    ref = DiffusionLM(inner, mask_token_id=MASK, logits_shifted=shifted, suppress_mask_logit=True).double()
    ids, mask, _, _ = batch(V)
    index = torch.tensor([[10, 6], [7, 9], [8, 8]])
    with torch.no_grad():
        exact(lm(ids, attention_mask=mask, logits_to_keep=index).logits,
              ref(ids, attention_mask=mask).logits[torch.arange(3)[:, None], index])
        lp = kept_logprobs(lm, ids, mask, logits_to_keep=index, targets=ids.gather(1, index))
        exact(lp, kept_logprobs(ref, ids, mask, logits_to_keep=index, targets=ids.gather(1, index)))
    assert lm.model.requests[0] == 11 - (5 if shifted else 6)


def test_the_estimator_memory_bench_runs_at_tiny_size(capsys):
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "bench" / "bench_memory.py"
    spec = importlib.util.spec_from_file_location("bench_memory", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(["--estimator", "--tiny", "--estimators", "mean_field"])
    assert [(r["path"], r["rows"]) for r in rows] == [("old", 2), ("new", 2)]
    assert all(r["peak_MB"] > 0 for r in rows) and "| mean_field | 2,000 | 2 |" in capsys.readouterr().out


def test_the_torch_path_runs_only_a_class_ranges_rows_of_the_head():
    """class_range (a, b) on the torch path: the head's matmul covers the range's b - a rows of the
    weight, not the vocabulary (MMaDA scores 8,192 image codes of ~134k ids), forward and backward,
    and the log-probs and gradients are the full head's sliced ones."""
    from torch.utils.flop_counter import FlopCounterMode

    g = torch.Generator().manual_seed(3)
    head = nn.Linear(D, V, dtype=torch.float64)
    a, b = 5, 13
    h = torch.randn(2, 4, D, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(a, b, (2, 4), generator=g)
    linear = HeadLinear(head.weight, head.bias, 0.5)
    fn = lambda x: head(x) * 0.5  # noqa: E731  (the head HeadLinear describes)
    flops = {}
    for name, lin in (("range", linear), ("full", None)):
        with FlopCounterMode(display=False) as count:
            lp = target_logprobs(h, t, fn, vocab=V, class_range=(a, b), backend="torch", linear=lin)
            lp.sum().backward()
        flops[name] = (count.get_total_flops(), lp.detach(), h.grad.clone(), head.weight.grad.clone())
        h.grad = head.weight.grad = head.bias.grad = None
    matmul = 2 * h.shape[0] * h.shape[1] * D  # flops per head row and forward matmul
    # forward, recomputed forward, and the two backward matmuls: 4 head matmuls over b - a rows
    assert flops["range"][0] == 4 * matmul * (b - a)
    assert flops["full"][0] == 4 * matmul * V  # the full head: what the range saves
    for got, want in zip(flops["range"][1:], flops["full"][1:]):
        exact(got, want)
    ref = reference(h.detach(), t, head.weight.detach(), head.bias.detach(), scale=0.5, class_range=(a, b))
    exact(flops["range"][1], ref)


def test_scored_logits_are_widened_piece_by_piece(monkeypatch):
    """TargetRequest.score on bfloat16 logits (a backbone without a fused head): never a float32 copy
    of all of them, the values the float32 cross-entropy of the whole gives, and the same gradient."""
    from ddrl.ops.logprobs import TargetRequest

    monkeypatch.setattr(ops, "CHUNK_ELEMENTS", 2 * V)  # two positions' logits per piece
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 4, V, generator=g).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, V, (3, 4), generator=g)
    widest = []

    class Widest(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.dim() == 2:
                widest.append(out.numel())
            return out

    with Widest():
        lp = TargetRequest(ids).score(logits)
        lp.sum().backward()
    assert max(widest) <= 2 * V  # float32 [m, V] pieces of two positions only
    want = logits.detach().float().requires_grad_()
    ref = -F.cross_entropy(want.reshape(-1, V), ids.reshape(-1), reduction="none").view(3, 4)
    ref.sum().backward()
    torch.testing.assert_close(lp, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(logits.grad.float(), want.grad.to(torch.bfloat16).float())
