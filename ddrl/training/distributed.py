"""Glue to PyTorch's own distributed engine (torchrun + DDP or FSDP2). No home-made layer.

    torchrun --nproc_per_node N -m ddrl train CONFIG dist.strategy=fsdp          # one machine
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d \\
             --rdzv-endpoint HOST:29500 --rdzv-id RUN -m ddrl train CONFIG       # on every node

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; we init the process group from them (nccl on GPU,
gloo on CPU), give each rank whole prompt groups (so group advantages need no gather), and let
DDP or FSDP2 (torch.distributed.fsdp.fully_shard) reduce gradients. Each rank's loss is scaled by
world_size before backward, so that the engines' gradient *average* equals the gradient of the
global loss (see objectives/aggregation.py). Logged metrics are averaged over ranks.

FSDP2 specifics:
  * fully_shard shards each transformer block (the largest nn.ModuleList of the backbone), then the
    root, in place: the sharded module is still the DiffusionLM, so its attributes (mask_token_id,
    process, tokenizer, disable_adapter ...) stay reachable and calling it directly still works.
  * Generation (rollouts, evaluation) runs inside `gathered_parameters`: every shard is all-gathered
    once up front and kept until the end. Ranks make different numbers of model calls (early exit,
    threshold decoding), which per-call all-gathers could not survive; this costs one full copy of
    the weights per rank while generating, like the rollout engines of other RL libraries.
  * Checkpoints: `gather_full_state` collects a full state dict (model and optimizer, on the CPU, on
    rank 0) with torch.distributed.checkpoint.state_dict, and rank 0 writes an ordinary model
    directory, so a sharded run's checkpoint loads in one process. `load_full_state` loads a
    full state dict into a sharded (or plain) model and optimizer, so any checkpoint resumes under
    any strategy. Optimizer states are keyed by parameter name in every strategy.
  * The RL reference model (a separate copy when the method needs one and LoRA is off) is not
    sharded: it holds a full copy per rank. Use LoRA (reference = adapter disabled) at scale.
  * DiffusionGemma ties its encoder and decoder layers: sharding them as separate units is not
    supported by FSDP2; use DDP for it.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Iterator

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
        if device.type == "cuda":
            torch.cuda.set_device(device)
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
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from ddrl.models.hf import transformer_blocks  # no transformers import at module level

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in transformer_blocks(getattr(model, "model", model)):  # shard each block, then the root
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    return model


@contextlib.contextmanager
def gradient_sync(wrapped: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """Inside, backward passes reduce gradients over ranks only when `enabled`: gradient accumulation
    all-reduces once, on the last micro-batch of an optimizer step, instead of after every one (DDP
    no_sync; FSDP2 set_requires_gradient_sync). Every rank must run the same number of backward
    passes with the same pattern (the trainer's micro-batches are equal across ranks)."""
    if enabled:
        yield
        return
    no_sync = getattr(wrapped, "no_sync", None)  # DDP
    if no_sync is not None:
        with no_sync():
            yield
        return
    if is_sharded(wrapped):
        wrapped.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            wrapped.set_requires_gradient_sync(True)
        return
    yield  # one process: nothing to synchronise


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def gathered_parameters(model: torch.nn.Module) -> Iterator[None]:
    """Under FSDP2: all-gather every shard now, keep the full parameters until the block ends, then
    reshard. Inside, forward calls make no collective call, so ranks may call the model any number
    of times (generation). A no-op for unsharded models."""
    if not is_sharded(model):
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    inner = [m for m in modules if m is not model]
    for m in inner:
        m.set_reshard_after_forward(False, recurse=False)
    for m in modules:
        m.unshard()
    try:
        yield
    finally:
        for m in inner:
            m.set_reshard_after_forward(True, recurse=False)
        for m in modules:
            m.reshard()


# --------------------------------------------------------------------------------------------
# Full state dicts (checkpoints that load under any strategy)
# --------------------------------------------------------------------------------------------


def gather_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict | None, dict]:
    """-> (model state or None, optimizer state keyed by parameter name).

    Sharded (FSDP2): a collective, so every rank must call it; full tensors are gathered to the CPU
    of rank 0 (the other ranks get empty dicts). Unsharded: the model state is None (save the
    module's own tensors) and the optimizer state is renamed, without copies.
    """
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return (get_model_state_dict(model, options=options),
                get_optimizer_state_dict(model, optimizer, options=options))
    return None, named_optimizer_state(model, optimizer)


def load_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, model_state: dict[str, Any],
                    optimizer_state: dict[str, Any] | None) -> None:
    """Load full (unsharded) model and optimizer states into a sharded or plain model. Collective
    under FSDP2 (every rank calls it with the same full states)."""
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, model_state, options=options)
        if optimizer is not None and optimizer_state is not None:
            if _is_index_keyed(optimizer_state):
                raise ValueError("this checkpoint's optimizer state is keyed by position (an older ddrl); it cannot "
                                 "be resharded. Resume it without dist.strategy=fsdp, save once, then switch")
            set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)
        return
    model.load_state_dict(model_state)
    if optimizer is not None and optimizer_state is not None:
        if _is_index_keyed(optimizer_state):
            optimizer.load_state_dict(optimizer_state)
        else:
            load_named_optimizer_state(model, optimizer, optimizer_state)


def named_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """optimizer.state_dict() with parameter names instead of positions (the layout of
    torch.distributed.checkpoint's full optimizer state dict), so it loads under any strategy."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    own = optimizer.state_dict()
    names, groups = [], []
    for group in optimizer.param_groups:
        group_names = [name_of[id(p)] for p in group["params"]]
        names += group_names
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": group_names})
    state = {names[i]: s for i, s in own["state"].items()}
    return {"state": state, "param_groups": groups}


def load_named_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                               named: dict[str, Any]) -> None:
    name_of = {id(p): n for n, p in model.named_parameters()}
    if len(named["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"the checkpoint's optimizer has {len(named['param_groups'])} parameter groups, this one "
                         f"{len(optimizer.param_groups)}; resume with the same model and LoRA settings")
    state, groups, index = {}, [], 0
    for saved, group in zip(named["param_groups"], optimizer.param_groups):
        names = [name_of[id(p)] for p in group["params"]]
        if set(names) != set(saved["params"]):
            raise ValueError("the checkpoint's optimizer holds other parameters than this model's trainable ones "
                             "(was LoRA switched on or off?); resume with the settings the run started with")
        positions = []
        for n in names:
            if n in named["state"]:
                state[index] = named["state"][n]
            positions.append(index)
            index += 1
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": positions})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _is_index_keyed(optimizer_state: dict[str, Any]) -> bool:
    groups = optimizer_state.get("param_groups") or [{}]
    return any(isinstance(p, int) for g in groups for p in g.get("params", []))


class GatheredModel:
    """Stands for a model whose weights were gathered: save_pretrained writes the given full state
    (what ddrl.training.checkpoint.save_checkpoint calls on rank 0 of a sharded run)."""

    def __init__(self, model: torch.nn.Module, state: dict[str, torch.Tensor] | None):
        self.model = model
        self.state = state

    def save_pretrained(self, directory: Any) -> None:
        self.model.save_pretrained(directory, state_dict=self.state)


# --------------------------------------------------------------------------------------------
# Calls and reductions
# --------------------------------------------------------------------------------------------


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
    """Average every metric over the ranks that logged it (a key one rank lacks, e.g. a non-finite
    step counter, must not desynchronise the collective)."""
    if not info.enabled:
        return stats
    key_sets: list[Any] = [None] * info.world_size
    dist.all_gather_object(key_sets, sorted(stats))
    keys = sorted(set().union(*key_sets))
    if not keys:
        return stats
    values = torch.tensor([[float(stats[k]) if k in stats else 0.0, float(k in stats)] for k in keys],
                          dtype=torch.float64, device=device)  # [K, 2]: value, present
    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return {k: (values[i, 0] / values[i, 1]).item() for i, k in enumerate(keys)}


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()
