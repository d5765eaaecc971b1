"""logits_to_keep: the LM head only on the positions a caller scores.

At LLaDA-8B scale (V = 126,464) the head over every position of [prompt, completion] is most of a
forward's logits memory, and an estimator reads only the completion. So a caller names the
positions it scores and the model computes only those:

    logits = kept_logits(model, ids, mask, logits_to_keep=L)          # [B, L, V]: the last L positions
    logits = kept_logits(model, ids, mask, logits_to_keep=positions)  # [B, K, V]: those positions

A model whose forward takes `logits_to_keep` (ddrl's DiffusionLM, also under DDP or FSDP2; see
ddrl.models.diffusion_lm for how it reaches each backbone) computes only those; any other model
computes every position and is sliced here, with the same result. Torch only: estimators,
processes and samplers import it.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

LogitsToKeep = int | Tensor | None  # None/0: every position; int K: the last K; 1-D long tensor: those positions


def keeps_some(logits_to_keep: LogitsToKeep) -> bool:
    """False for None / 0 (every position), True for a count or an index tensor."""
    return isinstance(logits_to_keep, Tensor) or bool(logits_to_keep)


def kept_index(logits_to_keep: int | Tensor, T: int, device: torch.device | None = None) -> Tensor:
    """A count K (the last K) or an index tensor -> the kept positions [K] long, checked against T."""
    if isinstance(logits_to_keep, Tensor):
        if logits_to_keep.dim() != 1 or logits_to_keep.dtype not in (torch.long, torch.int32, torch.int64):
            raise ValueError(f"logits_to_keep must be an int or a 1-D long tensor of positions, got a "
                             f"{logits_to_keep.dtype} tensor of shape {tuple(logits_to_keep.shape)}")
        index = logits_to_keep.long()
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= T):
            raise ValueError(f"logits_to_keep holds positions outside [0, {T}) (min {int(index.min())}, max "
                             f"{int(index.max())}); pass indices into the input sequence")
        return index.to(device) if device is not None else index
    K = int(logits_to_keep)
    if not 0 < K <= T:
        raise ValueError(f"logits_to_keep={K} must be in [1, T={T}] (0 or None keeps every position)")
    return torch.arange(T - K, T, device=device)


def kept_logits(model: Any, input_ids: Tensor, attention_mask: Tensor | None = None, *,
                logits_to_keep: LogitsToKeep, **kwargs: Any) -> Tensor:
    """model(input_ids, attention_mask=..., **kwargs).logits at the kept positions only: [B, K, V].

    A model whose forward takes logits_to_keep (a DiffusionLM, also under DDP or FSDP2) computes only
    those; any other (a test's toy, a wrapper) computes every position, sliced here. Without a mask
    the model is called without one.
    """
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    if not keeps_some(logits_to_keep):
        return model(input_ids, **kwargs).logits
    inner = model.module if isinstance(model, DistributedDataParallel) else model  # DDP passes kwargs on
    if names_parameter(inner, "logits_to_keep"):
        return model(input_ids, logits_to_keep=logits_to_keep, **kwargs).logits
    logits = model(input_ids, **kwargs).logits  # [B, T, V]
    index = kept_index(logits_to_keep, input_ids.shape[1], logits.device)
    return logits[:, index] if isinstance(logits_to_keep, Tensor) else logits[:, logits.shape[1] - index.numel():]


def names_parameter(module: Any, name: str) -> bool:
    """Whether module.forward (or the callable itself) takes `name`. Asked on every sampler step, so
    the answer is cached per forward function (inspect.signature costs about as much as a tiny
    model's layer)."""
    forward = getattr(module, "forward", module)
    return _takes(getattr(forward, "__func__", forward), name)


@functools.lru_cache(maxsize=256)
def _takes(function: Any, name: str) -> bool:
    try:
        return name in inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False
