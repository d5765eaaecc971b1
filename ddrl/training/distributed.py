"""Glue to PyTorch's own distributed engine (torchrun + DDP or FSDP2). No home-made layer.

`torchrun --nproc_per_node N -m ddrl train CONFIG` sets RANK/WORLD_SIZE/LOCAL_RANK; we init the
process group from them, give each rank whole prompt groups, and let DDP (or fully_shard) reduce
gradients. The loss of each rank is scaled by world_size before backward so that DDP's gradient
*average* equals the gradient of the global loss (see objectives/aggregation.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(backend: str | None, device: torch.device) -> DistInfo:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    if not dist.is_initialized():
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        dist.init_process_group(backend=backend)
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def resolve_strategy(strategy: str, info: DistInfo) -> str:
    if strategy == "auto":
        return "ddp" if info.enabled else "none"
    if strategy in ("ddp", "fsdp") and not info.enabled:
        return "none"  # one process: nothing to synchronise
    return strategy


def wrap_model(model: torch.nn.Module, strategy: str, device: torch.device) -> torch.nn.Module:
    """DDP returns a wrapper; FSDP2's fully_shard shards in place and returns the same module."""
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if device.type == "cuda" else None
        return DDP(model, device_ids=ids)
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        backbone = getattr(model, "model", model)
        for layer in getattr(backbone, "layers", []):  # shard each block, then the root
            fully_shard(layer)
        fully_shard(model)
        return model
    return model


class ModelHandle:
    """What estimators and samplers see: calls go through the (possibly wrapped) module, attribute
    reads (mask_token_id, process, tokenizer ...) go to the underlying DiffusionLM."""

    def __init__(self, wrapped: torch.nn.Module, inner: torch.nn.Module):
        self._wrapped = wrapped
        self._inner = inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._wrapped(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def all_reduce_sum(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def reduce_mean_dict(stats: dict[str, float], info: DistInfo, device: torch.device) -> dict[str, float]:
    if not info.enabled or not stats:
        return stats
    keys = sorted(stats)
    t = torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return {k: (t[i] / info.world_size).item() for i, k in enumerate(keys)}


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()
