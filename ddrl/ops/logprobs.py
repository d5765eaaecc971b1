"""log p(target) without the [rows, positions, V] logits: the LM head and the cross-entropy chunk by chunk.

An estimator reads one number per scored position, log softmax(h W^T)[target], but the plain
computation materialises the logits of every scored position, takes a float32 copy and keeps a
float32 log-softmax for backward: at LLaDA-8B's vocabulary (V = 126,464) that is ~1.5 MB per
position, ~130 MB per row of 256 positions, and most of a scoring pass's memory.

`target_logprobs(hidden, targets, head, ...)` takes the final hidden states at the scored positions
[..., D] and the backbone's own head (hidden -> logits; LLaDA's scale and tied weights included)
and computes the log-probabilities in pieces of at most `chunk` positions:

* **torch (every device).** Each piece runs under non-reentrant activation checkpointing: its
  logits [c, V] live only while the piece is computed, and backward recomputes them piece by
  piece, so peak memory is O(c * V) instead of O(rows * positions * V), in forward and in backward.
  The cross-entropy is `TargetLogSoftmax`, an autograd Function that keeps only the logits and the
  log-normaliser and writes its gradient into one buffer; the gradient through the head is
  autograd's own (weight, bias, tied embeddings, a LoRA adapter on the head, FSDP2's unsharded
  parameters, autocast), so nothing family-specific is differentiated by hand. A `class_range`
  (a, b) with the head as one affine map (`linear`) multiplies by the weight's rows [a, b) only
  (`range_head`), as the Liger path and the samplers' `range_logits` do; a head that is not one
  (a LoRA adapter on it) runs whole and is sliced.
* **Liger (CUDA).** liger-kernel's fused linear cross-entropy (`backend="auto"` on CUDA when it is
  installed and the head is one affine map, `HeadLinear`; `backend="liger"` forces it). Only
  liger-kernel >= 0.8.2 is used: before it, reduction="none" returned gradients scaled by the first
  token's upstream gradient for every token (linkedin/Liger-Kernel PR #1298).

Numerics are the logits path's (to rounding): logits in the head's dtype, the softmax in float32
(float64 stays float64: the golden tests run in float64), suppressed ids (the mask token, ids
outside a model's logits_range) set to SUPPRESSED_LOGIT before the softmax, and `class_range`
(uniform diffusion's classes [a, b)) applied after suppression. The Liger path adds the suppression
as a bias of SUPPRESSED_LOGIT instead (the same probabilities unless a target is itself suppressed).
"""

from __future__ import annotations

import functools
import importlib.metadata
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

# Logit given to a suppressed vocabulary id (the mask token, ids outside a model's range). Finite on
# purpose: -inf makes p * log p (entropies, full-vocabulary KLs) NaN. exp(-1e4) is exactly 0 in
# float32/bfloat16, and dividing by a sampling temperature as small as 1e-30 still stays finite.
SUPPRESSED_LOGIT = -1e4

# Logits elements per piece: 2**24 is 64 MiB in float32 (512 positions at V = 32k, 132 at 126,464),
# large enough that each piece's head matmul keeps a GPU busy.
CHUNK_ELEMENTS = 2**24

BACKENDS = ("auto", "torch", "liger")
LIGER_MIN_VERSION = (0, 8, 2)  # reduction="none" gradients are right from this release on


@dataclass(frozen=True)
class HeadLinear:
    """The LM head as one affine map, logits = scale * (h W^T + b), for fused kernels that take W."""

    weight: Tensor  # [V, D]
    bias: Tensor | None = None  # [V]
    scale: float | None = None  # LLaDA's scale_logits: 1/sqrt(d_model); None = 1


@dataclass(frozen=True)
class TargetRequest:
    """What a scoring call asks a model for instead of logits: log p(target) at the kept positions."""

    ids: Tensor  # [B, K] long: the token scored at each kept position
    mask: Tensor | None = None  # [B, K] bool: the positions to score (others give 0 and cost no head work); None = all
    class_range: tuple[int, int] | None = None  # softmax over vocabulary ids [a, b) only; ids are then in [a, b)

    def score(self, logits: Tensor) -> Tensor:
        """The same numbers from logits the caller already has: [B, K, V] -> [B, K]. A backbone
        without a fused head gives [B, K, V] logits in its own dtype: TargetLogSoftmax widens them to
        float32 a piece at a time, not as one float32 copy (and one saved log-softmax) of the whole."""
        classes = restrict(logits, self.class_range)  # [B, K, V']
        ids = shift(self.ids, self.class_range)
        lp = TargetLogSoftmax.apply(classes.reshape(-1, classes.shape[-1]), ids.reshape(-1), None).view(ids.shape)
        if self.mask is None:
            return lp
        return torch.where(self.mask, lp, torch.zeros((), dtype=lp.dtype, device=lp.device))


def restrict(logits: Tensor, class_range: tuple[int, int] | None) -> Tensor:
    """[..., V] -> [..., b - a]: the classes [a, b) only (no copy)."""
    return logits if class_range is None else logits[..., class_range[0]:class_range[1]]


def shift(ids: Tensor, class_range: tuple[int, int] | None) -> Tensor:
    """Vocabulary ids -> class indices within class_range."""
    return ids if class_range is None else ids - class_range[0]


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """log softmax(logits)[target] per position: [..., V], [...] -> [...] float32.

    Cross-entropy in float32 at least: bf16 log-softmax over a 126k vocabulary is too coarse for
    ratios; float64 logits stay float64 (the golden loss tests run in float64).
    """
    V = logits.shape[-1]
    wide = logits if logits.dtype == torch.float64 else logits.float()
    ce = F.cross_entropy(wide.reshape(-1, V), targets.reshape(-1), reduction="none")
    return -ce.view(targets.shape)


def chunk_positions(vocab: int, chunk: int | None = None) -> int:
    """Positions per piece: `chunk` if given, else as many as CHUNK_ELEMENTS logits hold."""
    if chunk is not None:
        if int(chunk) < 1:
            raise ValueError(f"the log-prob chunk must be a positive number of positions, got {chunk}")
        return int(chunk)
    return max(1, CHUNK_ELEMENTS // max(1, vocab))


def target_logprobs(hidden: Tensor, targets: Tensor, head: Callable[[Tensor], Tensor], *, vocab: int,
                    suppressed: Tensor | None = None, class_range: tuple[int, int] | None = None,
                    chunk: int | None = None, backend: str = "auto", linear: HeadLinear | None = None) -> Tensor:
    """log softmax(head(hidden))[target], never holding more than `chunk` positions' logits.

    hidden [..., D] (final hidden states at the scored positions), targets [...] long -> [...] float32
    (float64 for float64 hidden). head: the backbone's hidden -> logits [..., vocab]. suppressed:
    [vocab] bool, ids whose logit is SUPPRESSED_LOGIT. linear: the head as an affine map (Liger needs
    it; None where the head is not one, e.g. a LoRA-adapted head).
    """
    if backend not in BACKENDS:
        raise ValueError(f"log-prob backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if tuple(hidden.shape[:-1]) != tuple(targets.shape):
        raise ValueError(f"hidden {list(hidden.shape)} must be [..., D] over the targets' shape {list(targets.shape)}")
    chunk = chunk_positions(vocab, chunk)
    if targets.numel() == 0:
        return torch.zeros(targets.shape, dtype=_score_dtype(hidden.dtype), device=hidden.device)
    if use_liger(backend, hidden, linear):
        return _liger_logprobs(hidden, targets, linear, suppressed, class_range)  # type: ignore[arg-type]
    if class_range is not None and linear is not None:  # the head's rows [a, b) only, as Liger's path does
        a, b = class_range
        return _chunked_logprobs(hidden, targets - a, range_head(linear, a, b),
                                 None if suppressed is None else suppressed[a:b], None, chunk)
    return _chunked_logprobs(hidden, targets, head, suppressed, class_range, chunk)


def range_head(linear: HeadLinear, lo: int, hi: int) -> Callable[[Tensor], Tensor]:
    """hidden [..., D] -> the head's logits of ids [lo, hi) only, [..., hi - lo]: a view of the
    weight's rows, so a class range (MMaDA's 8,192 image codes of ~134k ids) costs (hi - lo) / V of
    the head's matmul. Each logit is the same dot product and scale as the whole head's."""
    weight = linear.weight[lo:hi]  # [hi - lo, D]
    bias = None if linear.bias is None else linear.bias[lo:hi]
    scale = linear.scale

    def head(hidden: Tensor) -> Tensor:
        logits = F.linear(hidden, weight, bias)
        return logits if scale is None else logits * scale
    return head


def _chunked_logprobs(hidden: Tensor, targets: Tensor, head: Callable[[Tensor], Tensor], suppressed: Tensor | None,
                      class_range: tuple[int, int] | None, chunk: int) -> Tensor:
    """The torch path: pieces of whole rows when a row fits in a chunk (the head sees [n, K, D], as
    the logits path shows it), else pieces of `chunk` positions of the flattened rows."""
    if hidden.dim() == 3 and hidden.shape[1] <= chunk:
        step = max(1, chunk // max(1, hidden.shape[1]))
        h_pieces, t_pieces = hidden.split(step, dim=0), targets.split(step, dim=0)  # [n, K, D], [n, K]
    else:
        h_pieces = hidden.reshape(-1, hidden.shape[-1]).split(chunk, dim=0)  # [c, D]
        t_pieces = targets.reshape(-1).split(chunk, dim=0)
    out = []
    for h, t in zip(h_pieces, t_pieces):
        if torch.is_grad_enabled():  # backward recomputes this piece's logits instead of keeping them
            lp = checkpoint(_piece_logprobs, h, t, head, suppressed, class_range, use_reentrant=False,
                            preserve_rng_state=False)
        else:
            lp = _piece_logprobs(h, t, head, suppressed, class_range)
        out.append(lp)
    return torch.cat([p.reshape(-1) for p in out]).view(targets.shape)


def _score_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _piece_logprobs(hidden: Tensor, targets: Tensor, head: Callable[[Tensor], Tensor], suppressed: Tensor | None,
                    class_range: tuple[int, int] | None) -> Tensor:
    logits = head(hidden)  # [..., V]: the only place a piece's logits exist
    if class_range is not None:
        suppressed = None if suppressed is None else suppressed[class_range[0]:class_range[1]]
    V = logits.shape[-1] if class_range is None else class_range[1] - class_range[0]
    lp = TargetLogSoftmax.apply(restrict(logits, class_range).reshape(-1, V), shift(targets, class_range).reshape(-1),
                                suppressed)
    return lp.view(targets.shape)


class TargetLogSoftmax(torch.autograd.Function):
    """log softmax(logits)[target] per row, logits [M, V] (any float dtype) -> [M] float32 (float64
    stays), with the `suppressed` ids' logits replaced by SUPPRESSED_LOGIT first.

    The same value as F.cross_entropy's, with less memory: it saves the logits and the
    log-normaliser [M] only, and widens the logits to float32 CHUNK_ELEMENTS at a time, in forward
    and in backward, whose gradient, g * (onehot(target) - softmax), is written piece by piece into
    one buffer of the logits' dtype (autograd's float32 copy + log_softmax + nll_loss keep a float32
    [M, V] output and build more). Suppressed logits are constants: their gradient is 0.
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, suppressed: Tensor | None) -> Tensor:
        dtype = _score_dtype(logits.dtype)
        lse = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)  # [M]
        out = torch.empty_like(lse)
        for rows in _row_pieces(logits):
            wide = logits[rows].to(dtype)  # [m, V]: a copy unless the logits are already float32/64
            if suppressed is not None:
                wide = wide.masked_fill(suppressed, SUPPRESSED_LOGIT)
            lse[rows] = torch.logsumexp(wide, dim=-1)
            out[rows] = wide.gather(-1, targets[rows, None]).squeeze(-1) - lse[rows]
        ctx.save_for_backward(logits, targets, lse, suppressed)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        logits, targets, lse, suppressed = ctx.saved_tensors
        dtype = lse.dtype
        out = torch.empty_like(logits)  # [M, V] the one buffer, in the logits' dtype
        in_place = logits.dtype == dtype  # else each piece is computed in lse's dtype and copied back
        for rows in _row_pieces(logits):
            dz = out[rows] if in_place else torch.empty(out[rows].shape, dtype=dtype, device=out.device)
            dz.copy_(logits[rows])  # [m, V]
            if suppressed is not None:
                dz.masked_fill_(suppressed, SUPPRESSED_LOGIT)
            g = grad[rows].to(dtype)
            dz.sub_(lse[rows, None]).exp_().mul_(-g[:, None])  # -g * softmax
            dz.scatter_add_(-1, targets[rows, None], g[:, None])  # + g at the target
            if suppressed is not None:
                dz.masked_fill_(suppressed, 0.0)
            if not in_place:
                out[rows] = dz
        return out, None, None


def _row_pieces(logits: Tensor) -> list[slice]:
    """Row slices of [M, V] holding at most CHUNK_ELEMENTS logits each (at least one row)."""
    M, V = logits.shape
    step = max(1, CHUNK_ELEMENTS // max(1, V))
    return [slice(lo, lo + step) for lo in range(0, M, step)]


# --------------------------------------------------------------------------------------------
# Liger's fused linear cross-entropy (CUDA)
# --------------------------------------------------------------------------------------------


def use_liger(backend: str, hidden: Tensor, linear: HeadLinear | None) -> bool:
    """Whether this call takes the Liger path; backend="liger" that cannot is an error naming why."""
    if backend == "torch":
        return False
    reason = None
    if linear is None:
        reason = "the model's LM head is not one affine map (e.g. a LoRA adapter on it)"
    elif hidden.dtype == torch.float64:
        reason = "Liger's kernels do not take float64"
    elif liger_function() is None:
        reason = (f"liger-kernel >= {'.'.join(map(str, LIGER_MIN_VERSION))} is not installed "
                  f"(pip install 'liger-kernel>=0.8.5')")
    if backend == "liger":
        if reason is not None:
            raise ValueError(f"logprob backend 'liger' cannot run: {reason}; use backend 'auto' or 'torch'")
        return True
    return reason is None and hidden.is_cuda


@functools.lru_cache(maxsize=1)
def liger_function() -> Callable[..., Tensor] | None:
    """liger_kernel's liger_fused_linear_cross_entropy when a release with right reduction="none"
    gradients is installed, else None."""
    try:
        version = importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        return None
    if _release(version) < LIGER_MIN_VERSION:
        return None
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:  # e.g. no triton on this machine
        return None
    return liger_fused_linear_cross_entropy


def _release(version: str) -> tuple[int, ...]:
    """'0.8.5.dev2026' -> (0, 8, 5)."""
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _liger_logprobs(hidden: Tensor, targets: Tensor, linear: HeadLinear, suppressed: Tensor | None,
                    class_range: tuple[int, int] | None) -> Tensor:
    """-CE from Liger's kernel on [M, D] (reduction="none", recomputed in its backward)."""
    D = hidden.shape[-1]
    h = hidden.reshape(-1, D)  # [M, D]
    if linear.scale is not None:
        h = h * linear.scale  # scale * (h W^T) = (scale * h) W^T; a bias is scaled below
    weight, bias = linear.weight, linear.bias
    if bias is not None and linear.scale is not None:
        bias = bias * linear.scale
    if suppressed is not None:
        penalty = torch.zeros(suppressed.shape, dtype=h.dtype, device=h.device)
        penalty = penalty.masked_fill(suppressed, SUPPRESSED_LOGIT)  # [V]
        bias = penalty if bias is None else bias + penalty
    if class_range is not None:
        a, b = class_range
        weight = weight[a:b]
        bias = None if bias is None else bias[a:b]
    half = weight.dtype in (torch.float16, torch.bfloat16)
    kernel = liger_function()
    assert kernel is not None  # use_liger checked it
    loss = kernel(h, weight, shift(targets, class_range).reshape(-1), bias=bias, reduction="none",
                  accum_dtype=torch.float32 if half and weight.requires_grad else None)  # [M] float32
    return (-loss.float()).view(targets.shape)
