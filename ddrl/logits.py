"""logits_to_keep: the LM head only on the positions a caller scores.

At LLaDA-8B scale (V = 126,464) the head over every position of [prompt, completion] is most of a
forward's logits memory, and an estimator reads only the completion. So a caller names the
positions it scores and the model computes only those:

    logits = kept_logits(model, ids, mask, logits_to_keep=L)          # [B, L, V]: the last L positions
    logits = kept_logits(model, ids, mask, logits_to_keep=positions)  # [B, K, V]: those positions
    logits = kept_logits(model, ids, mask, logits_to_keep=per_row)    # [B, K, V]: per_row [B, K], row b's own

A model whose forward takes `logits_to_keep` (it says so: ddrl.contract.ScoringModel; ddrl's
DiffusionLM, also under DDP or FSDP2; see ddrl.models.diffusion_lm for how it reaches each backbone)
computes only those; any other model computes every position and is sliced here, with the same result.

An estimator that needs only log p(target) asks for that instead of logits:

    lp = kept_logprobs(model, ids, mask, logits_to_keep=L, targets=completion)  # [B, L]

A model whose forward takes `targets` (a DiffusionLM) runs its LM head and the cross-entropy
chunk by chunk from the final hidden states (ddrl.ops.logprobs), never holding [B, L, V]; any
other model gives logits, scored here with the same numbers. Torch only: estimators, processes
and samplers import it.
"""

from __future__ import annotations

from typing import Any, TypeGuard

import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from ddrl.contract import scoring_arguments
from ddrl.ops.logprobs import TargetRequest
from ddrl.ops.value_checks import check_values

LogitsToKeep = int | Tensor | None  # None/0: every position; int K: the last K; long [K]: those; long [B, K]: per row


def keeps_some(logits_to_keep: LogitsToKeep) -> TypeGuard[int | Tensor]:
    """False for None / 0 (every position), True for a count or an index tensor."""
    return isinstance(logits_to_keep, Tensor) or bool(logits_to_keep)


def kept_index(logits_to_keep: int | Tensor, T: int, device: torch.device | None = None, *,
               rows: int | None = None) -> Tensor:
    """A count K (the last K) or an index tensor -> the kept positions [K] (or per row [B, K]) long,
    checked against T (and a per-row one against the batch's `rows` when given)."""
    if isinstance(logits_to_keep, Tensor):
        per_row = logits_to_keep.dim() == 2 and (rows is None or logits_to_keep.shape[0] == rows)
        if not (logits_to_keep.dim() == 1 or per_row) or logits_to_keep.dtype not in (torch.long, torch.int32):
            raise ValueError(f"logits_to_keep must be an int, a 1-D long tensor of positions or a [B, K] one of "
                             f"each row's positions (B = {rows if rows is not None else 'the batch'}), got a "
                             f"{logits_to_keep.dtype} tensor of shape {tuple(logits_to_keep.shape)}")
        index = logits_to_keep.long()
        if index.numel():  # queued on the device, not read on the host (ddrl.ops.value_checks)
            check_values(((index >= 0) & (index < T)).all(),
                         f"logits_to_keep holds positions outside [0, {T}); pass indices into the input sequence",
                         lambda: f"min {int(index.min())}, max {int(index.max())}")
        return index.to(device) if device is not None else index
    K = int(logits_to_keep)
    if not 0 < K <= T:
        raise ValueError(f"logits_to_keep={K} must be in [1, T={T}] (0 or None keeps every position)")
    return torch.arange(T - K, T, device=device)


def kept_logits(model: Any, input_ids: Tensor, attention_mask: Tensor | None = None, *,
                logits_to_keep: LogitsToKeep, class_range: tuple[int, int] | None = None, **kwargs: Any) -> Tensor:
    """model(input_ids, attention_mask=..., **kwargs).logits at the kept positions only: [B, K, V]
    ([B, K, b - a] for the vocabulary ids [a, b) of class_range).

    A model whose forward takes logits_to_keep (a DiffusionLM, also under DDP or FSDP2) computes only
    those; any other (a test's toy, a wrapper) computes every position, sliced here. The same for
    class_range (a DiffusionLM computes only those ids where its head can: DiffusionLM._ranged_forward).
    Without a mask the model is called without one.
    """
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    inner = model.module if isinstance(model, DistributedDataParallel) else model  # DDP passes kwargs on
    if class_range is not None and takes_argument(inner, "class_range"):
        kwargs["class_range"], class_range = class_range, None  # the model selects the ids
    logits = _kept(model, inner, input_ids, logits_to_keep, kwargs)
    return logits if class_range is None else logits[..., class_range[0]:class_range[1]]


def _kept(model: Any, inner: Any, input_ids: Tensor, logits_to_keep: LogitsToKeep, kwargs: dict) -> Tensor:
    if not keeps_some(logits_to_keep):
        return model(input_ids, **kwargs).logits
    if takes_argument(inner, "logits_to_keep"):
        return model(input_ids, logits_to_keep=logits_to_keep, **kwargs).logits
    logits = model(input_ids, **kwargs).logits  # [B, T, V]
    index = kept_index(logits_to_keep, input_ids.shape[1], logits.device, rows=input_ids.shape[0])
    if isinstance(logits_to_keep, Tensor):
        return take_positions(logits, index)
    return logits[:, logits.shape[1] - index.numel():]


def take_positions(x: Tensor, index: Tensor) -> Tensor:
    """x [B, T, ...] at positions index [K] (every row) or [B, K] (row b's own) -> [B, K, ...]."""
    index = index.to(x.device)
    if index.dim() == 1:
        return x[:, index]
    rows = torch.arange(x.shape[0], device=x.device)[:, None]  # [B, 1]
    return x[rows, index]


def kept_logprobs(model: Any, input_ids: Tensor, attention_mask: Tensor | None = None, *, logits_to_keep: LogitsToKeep,
                  targets: Tensor, mask: Tensor | None = None, class_range: tuple[int, int] | None = None,
                  **kwargs: Any) -> Tensor:
    """log p_model(targets) at the kept positions: [B, K] float32 (float64 for a float64 model).

    targets [B, K] long, the token scored at each kept position; mask [B, K] bool, the positions to
    score (the others give 0, and a DiffusionLM runs no head work for them); class_range (a, b): the
    softmax over vocabulary ids [a, b) only (targets are ids in it). A model whose forward takes
    `targets` computes them without the logits (module docstring); any other is scored from its
    logits here, with the same numbers.
    """
    request = TargetRequest(targets, mask, class_range)
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    if takes_argument(inner, "targets"):
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        return model(input_ids, logits_to_keep=logits_to_keep, targets=request, **kwargs).target_logprobs
    return request.score(kept_logits(model, input_ids, attention_mask, logits_to_keep=logits_to_keep, **kwargs))


def takes_argument(model: Any, name: str) -> bool:
    """Whether the model's forward takes the scoring argument `name` (logits_to_keep, targets or
    class_range): declared by the model (ddrl.contract.ScoringModel), never read off a signature."""
    return name in scoring_arguments(model)
