"""Glue to PyTorch's own distributed engine (torchrun + DDP or FSDP2). No home-made layer.

    torchrun --nproc_per_node N -m ddrl train CONFIG dist.strategy=fsdp          # one machine
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d \\
             --rdzv-endpoint HOST:29500 --rdzv-id RUN -m ddrl train CONFIG       # on every node

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; we init the process group from them (nccl on GPU,
gloo on CPU), give each rank whole prompt groups (so group advantages need no gather), and let
DDP or FSDP2 (torch.distributed.fsdp.fully_shard) reduce gradients. Each rank's loss is scaled by
world_size before backward, so that the engines' gradient *average* equals the gradient of the
global loss (see objectives/aggregation.py). Logged metrics mean the same at any world size: the
update's statistics are summed with their counts over ranks, then divided (`StepSums`), and so are
the rollout's per-row statistics (`RowSums`: reward mean and std, lengths, fractions); only values
every rank holds alike (the sampler's call count, timings) are averaged over ranks.

Mixed precision (model.mixed_precision=bf16 over fp32 parameters): under FSDP2 every fully_shard gets
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): shards, gradients and AdamW state stay fp32,
parameters are all-gathered and used in bf16, gradients are reduced in fp32. Under DDP or in one
process the parameters stay fp32 and the passes run under torch.autocast(bf16) (`compute_context`).

Memory: `check_memory_fits` refuses, before anything is moved to the device, a model whose weights,
gradients and AdamW state (~16 bytes per fp32 trainable parameter) plus a reference copy cannot fit
one device under the chosen strategy (DDP replicates all of it; FSDP divides it by the ranks).

FSDP2 specifics:
  * fully_shard shards each transformer block (the largest nn.ModuleList of the backbone), then the
    root, in place: the sharded module is still the DiffusionLM, so its attributes (mask_token_id,
    process, tokenizer, disable_adapter ...) stay reachable and calling it directly still works.
  * The RL reference model (a separate copy when the method needs one and LoRA is off) is sharded the
    same way, so it costs 1/N of a copy per rank; `sync_reference` copies shard into shard.
  * Generation (rollouts, evaluation) runs inside `gathered_parameters`: every shard is all-gathered
    once up front and kept until the end. Ranks make different numbers of model calls (early exit,
    threshold decoding), which per-call all-gathers could not survive; this costs one full copy of
    the weights per rank while generating, like the rollout engines of other RL libraries.
  * Checkpoints (ddrl.training.checkpoint): sharded under FSDP by default, each rank writing its own
    shard with torch.distributed.checkpoint; or full (rank 0 writes an ordinary model directory).
    Either loads under any strategy and any number of processes.
  * DiffusionGemma ties its encoder and decoder layers: sharding them as separate units is not
    supported by FSDP2; use DDP for it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, NoReturn, cast

import torch
import torch.distributed as dist

from ddrl.contract import scoring_arguments

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    grouped: bool = False  # a process group exists even with one rank (FSDP2 with dist.cpu_offload)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(backend: str | None, device: torch.device, *, timeout_s: float | None = None,
                     one_rank_group: bool = False, cpu_offload: bool = False) -> DistInfo:
    """The process group torchrun's RANK / WORLD_SIZE describe, with collectives timing out after
    timeout_s (dist.timeout), on `process_group_backend`'s backend. One process makes none, unless
    one_rank_group: FSDP2 (dist.cpu_offload on one GPU) needs a process group even alone."""
    from datetime import timedelta

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 and not one_rank_group:
        return DistInfo()
    if not dist.is_initialized():
        backend = process_group_backend(backend, device, cpu_offload=cpu_offload)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        kwargs: dict[str, Any] = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        if world <= 1 and "MASTER_ADDR" not in os.environ:  # not launched by torchrun: an in-memory store
            kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
        dist.init_process_group(backend=backend, **kwargs)
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), grouped=True)


def process_group_backend(backend: str | None, device: torch.device, *, cpu_offload: bool = False) -> str:
    """init_process_group's backend: dist.backend, else nccl on GPU and gloo on CPU. With dist.cpu_offload
    on a GPU, FSDP2 keeps the gradients in host memory and the norm that clip_grad_norm_ reduces over
    ranks (and its full_tensor) lives there too, which an nccl-only group refuses ("No backend type
    associated with device type cpu", pytorch#148532): the group gets gloo for CPU tensors beside nccl
    for CUDA ones, "cpu:gloo,cuda:nccl" (torchtune's fix for the same failure)."""
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if cpu_offload and device.type == "cuda" and backend == "nccl":
        return "cpu:gloo,cuda:nccl"
    return backend


def check_whole_groups(prompts_per_step: int, world_size: int) -> None:
    """Every rank holds whole prompt groups (a group's advantages are computed where it was sampled), so
    train.prompts_per_step must divide over the processes. The error names the process counts that
    work and the nearest batch that runs on this many (GDSD's released 20 prompts on 8 GPUs split
    groups across devices; ddrl cannot)."""
    n = prompts_per_step
    if n % world_size == 0:
        return
    counts = [w for w in range(1, n + 1) if n % w == 0]
    batches = [m for m in (n // world_size * world_size, -(-n // world_size) * world_size) if m > 0]
    raise ValueError(
        f"train.prompts_per_step={n} prompt groups cannot be split over {world_size} processes: each process "
        f"holds whole groups. Run on {', '.join(map(str, counts[:-1]))} or {counts[-1]} processes (torchrun "
        f"--nproc_per_node N; on a larger node pick the GPUs with CUDA_VISIBLE_DEVICES), or set "
        f"train.prompts_per_step to a multiple of {world_size} ({' or '.join(map(str, batches))}: a different "
        f"batch than the recipe's; scale train.steps to keep its length)")


def resolve_strategy(strategy: str, info: DistInfo) -> str:
    if strategy == "auto":
        return "ddp" if info.enabled else "none"
    if strategy == "fsdp" and info.grouped:
        return strategy  # FSDP2 in one process: dist.cpu_offload
    if strategy in ("ddp", "fsdp") and not info.enabled:
        return "none"  # one process: nothing to synchronise
    return strategy


def wrap_model(model: torch.nn.Module, strategy: str, device: torch.device,
               mixed_precision: str = "none", cpu_offload: bool = False) -> torch.nn.Module:
    """DDP returns a wrapper; FSDP2's fully_shard shards in place and returns the same module.

    mixed_precision="bf16" under FSDP2: bf16 all-gathers and compute over the fp32 shards, fp32
    gradient reduction (module doc). DDP and one process leave the parameters alone (autocast)."""
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if device.type == "cuda" else None
        return DDP(model, device_ids=ids)
    if strategy == "fsdp":
        shard_model(model, device, mixed_precision, cpu_offload)
    return model


def shard_model(model: torch.nn.Module, device: torch.device, mixed_precision: str = "none",
                cpu_offload: bool = False) -> torch.nn.Module:
    """fully_shard each transformer block, then the root, in place (trainable or frozen: the RL
    reference is sharded the same way as the policy, so their shards line up). cpu_offload: FSDP2's
    CPUOffloadPolicy, the shards (and so gradients and AdamW state) in pinned host memory; pass the
    model still on the CPU, so that no more than one block is ever on the device outside its pass."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from ddrl.contract import model_view
    from ddrl.models.hf import transformer_blocks  # no transformers import at module level

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # the mesh's ranks are host data, also in a rehearsal (ddrl.training.rehearse)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = mixed_precision_policy(mixed_precision)
    kwargs: dict[str, Any] = {} if policy is None else {"mp_policy": policy}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for block in transformer_blocks(model_view(model).backbone):  # shard each block, then the root
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def mixed_precision_policy(mixed_precision: str) -> Any:
    """FSDP2's policy for model.mixed_precision: bf16 parameters in compute, fp32 gradient reduction
    (the fp32 shards are the master weights AdamW updates); None for "none"."""
    if mixed_precision == "none":
        return None
    if mixed_precision != "bf16":
        raise ValueError(f"model.mixed_precision={mixed_precision!r}; valid: none, bf16")
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def compute_context(device: torch.device, mixed_precision: str, strategy: str) -> contextlib.AbstractContextManager:
    """What a forward pass runs under: torch.autocast(bf16) for bf16 compute over fp32 parameters
    under DDP or in one process; nothing under FSDP2, whose policy casts the parameters itself."""
    if mixed_precision == "bf16" and strategy != "fsdp":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


# --------------------------------------------------------------------------------------------
# Memory: does a full copy of the training state fit one device?
# --------------------------------------------------------------------------------------------

ADAMW_STATES = 2  # exp_avg and exp_avg_sq, each the size of its parameter


def training_state_bytes(model: torch.nn.Module, *, reference_copy: bool) -> tuple[int, int]:
    """(bytes of weights + gradients + AdamW state, bytes of a reference copy) of a model: each
    parameter's own bytes, plus for a trainable one its gradient and AdamW's two moments in its dtype
    (16 bytes per fp32 trainable parameter, 2 per frozen bf16 one). Activations are not counted."""
    state = ref = 0
    for p in model.parameters():
        size = p.numel() * p.element_size()
        state += size * (2 + ADAMW_STATES) if p.requires_grad else size
        ref += size
    return state, ref if reference_copy else 0


def check_memory_fits(state_bytes: int, reference_bytes: int, device_bytes: int | None, *, strategy: str,
                      world_size: int) -> None:
    """Refuse a run whose training state cannot fit one device before any of it is moved there.

    Replicated strategies (none, ddp) hold all of it on every device; FSDP2 holds 1/world_size of the
    model state and of the reference. device_bytes None (the CPU) skips the check. The estimate leaves
    out activations, so a run it passes may still run out of memory, but one it refuses cannot fit."""
    if device_bytes is None:
        return
    shards = world_size if strategy == "fsdp" else 1
    need = (state_bytes + reference_bytes) / shards
    if need <= device_bytes:
        return
    gb = 1e9
    what = (f"the weights, gradients and AdamW state ({state_bytes / gb:.1f} GB"
            + (f") plus the reference copy ({reference_bytes / gb:.1f} GB" if reference_bytes else "")
            + f") need {need / gb:.1f} GB per device, more than its {device_bytes / gb:.1f} GB")
    if shards == 1:
        raise ValueError(f"dist.strategy={strategy} replicates the model on every device (auto is ddp under "
                         f"torchrun, none in one process): {what}. Shard it: torchrun --nproc_per_node N -m ddrl "
                         f"train ... dist.strategy=fsdp, or train LoRA adapters (model.lora.rank=128)")
    raise ValueError(f"FSDP over {world_size} devices: {what}. Use more devices (need >= "
                     f"{math.ceil((state_bytes + reference_bytes) / device_bytes)}) or train LoRA adapters "
                     f"(model.lora.rank=128)")


def device_memory(device: torch.device) -> int | None:
    """Total memory of a CUDA device in bytes; None elsewhere (the CPU's is not checked)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(device).total_memory)


@contextlib.contextmanager
def gradient_sync(wrapped: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """Inside, backward passes reduce gradients over ranks only when `enabled`, under DDP: gradient
    accumulation all-reduces once, on the last micro-batch of an optimizer step (DDP no_sync). The
    forward must run inside too: DDP arms (or not) its gradient reducer in forward.

    FSDP2 reduce-scatters every micro-batch, `enabled` or not: its no-sync mode
    (set_requires_gradient_sync(False)) keeps every gradient unsharded, upcast to the reduce dtype,
    until the last micro-batch (8B x 4 B = 32 GB per rank at LLaDA-8B), where a reduce-scatter per
    micro-batch keeps 1/N of it. The cost is one reduce-scatter per micro-batch, overlapped with the
    backward. Every rank must run the same number of backward passes (the trainer pads them)."""
    no_sync = getattr(wrapped, "no_sync", None)  # DDP
    if enabled or no_sync is None:  # FSDP2 and one process: nothing to switch off
        yield
        return
    with no_sync():
        yield


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@torch.no_grad()
def copy_parameters(dst: torch.nn.Module, src: torch.nn.Module) -> None:
    """dst's parameters := src's (the RL reference := the policy). Sharded alike under FSDP2, they are
    copied shard into shard, nothing gathered; a sharded src into a plain dst is gathered first."""
    reshard(dst)
    reshard(src)
    for d, s in zip(dst.parameters(), src.parameters()):
        if hasattr(d, "to_local"):  # DTensor shards (typed as plain Parameters)
            cast(Any, d).to_local().copy_(cast(Any, s).to_local())
        else:
            d.copy_(s.full_tensor() if hasattr(s, "full_tensor") else s)


def zero_loss(new: Any) -> torch.Tensor:
    """0 x a padding micro-batch's log-probs (an EstimatorOutput): its backward gives every parameter
    it reached a zero gradient and runs the engines' collectives like a real micro-batch, so ranks
    with fewer micro-batches keep in step. Non-finite values (a forbidden token's -inf) are zeroed
    first, so the loss is exactly 0."""
    parts = [x.nan_to_num(0.0, 0.0, 0.0).sum() for x in (new.token_logp, new.seq_logp)
             if x is not None and x.requires_grad]
    if not parts:
        raise RuntimeError("a padding micro-batch's estimator output carries no gradient; every rank must run "
                           "the same backward passes")
    return 0.0 * sum(parts)


def reshard(model: torch.nn.Module) -> None:
    """Free a sharded model's gathered parameters and register its shards again. FSDP2 leaves the
    root's parameters gathered after a forward (for the backward it expects): a frozen reference,
    which never runs backward, would keep them, and a copy into them would be lost. No-op unsharded."""
    if is_sharded(model):
        cast("FSDPModule", model).reshard()


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

    @property
    def scoring_arguments(self) -> frozenset[str]:  # calls reach the DiffusionLM's forward (ddrl.contract)
        return scoring_arguments(self._inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def all_reduce_sum(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def all_reduce_max(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x


@dataclass
class StepSums:
    """A metric kept as one sum per optimizer step of the update over this rank's real (not padding)
    micro-batches, with the count of those micro-batches. reduce_mean_dict sums both over ranks, then
    divides: the logged value is mean_u (Σ_ranks total[u] / Σ_ranks count[u]), a step with no count
    giving 0, which is the 1-process value at any world size (a mean of rank means was not: a rank
    holding only padding logged nothing, and one with fewer micro-batches weighed more). count None:
    the sum itself (a count of rows), mean_u Σ_ranks total[u]."""

    total: torch.Tensor  # [U] float, one entry per optimizer step
    count: torch.Tensor | None = None  # [U] float: real micro-batches of each optimizer step on this rank


@dataclass
class RowSums:
    """A statistic of rows (rollouts, groups) as sums over this rank's rows, reduced over ranks before
    it is divided, so that it is the 1-process value at any world size (a mean of rank means is not:
    ranks with fewer valid rewards weigh more, and a std of each rank's rows is not the std of all).

        count given, squares None    the global mean  Σx / n            (NaN when n = 0)
        count given, squares given   the sample std   sqrt((Σx² - (Σx)²/n) / (n - 1))   (0 when n < 2)
        count None                   the global sum   Σx                (e.g. tokens fed by all ranks)"""

    total: Any  # 0-d tensor or float: Σ x over this rank's rows
    count: Any = None  # 0-d tensor or float: n, this rank's rows
    squares: Any = None  # 0-d tensor or float: Σ x² (the metric is then the std)


def reduce_mean_dict(stats: dict[str, Any], info: DistInfo, device: torch.device) -> dict[str, float]:
    """Python floats of every metric over all ranks: StepSums and RowSums reduced as sums and counts,
    then divided; floats and 0-d tensors averaged over the ranks that logged them (a key one rank lacks, e.g. a
    metric of a method option, must not desynchronise the collective). Values may live on the device:
    they are stacked into one table, reduced with one all_reduce and copied to the host once."""
    local = {k: _layout(v) for k, v in stats.items()}  # key -> (kind, entries)
    if info.enabled:
        layouts: list[Any] = [None] * info.world_size
        dist.all_gather_object(layouts, local)
        merged: dict[str, tuple[str, int]] = {}
        for layout in layouts:
            for key, shape in layout.items():
                if merged.setdefault(key, shape) != shape:
                    raise RuntimeError(f"metric {key!r} has the shape {shape} on one rank and {merged[key]} on "
                                       f"another; every rank must make the same optimizer steps")
    else:
        merged = local
    keys = sorted(merged)
    if not keys:
        return {}
    rows = [_table_rows(stats.get(k), *merged[k], device) for k in keys]
    table = torch.cat(rows)  # [R, 2]: (value, weight) rows of every metric
    if info.enabled:
        dist.all_reduce(table, op=dist.ReduceOp.SUM)
    values = table.tolist()  # the one host transfer
    out, at = {}, 0
    for key in keys:
        kind, n = merged[key]
        part, at = values[at:at + n], at + n
        out[key] = _finish(kind, part)
    return out


def _layout(value: Any) -> tuple[str, int]:
    """(kind, table rows) of a metric: ("mean", 1) for a float or 0-d tensor; ("ratio" or "sum", U)
    for StepSums of U optimizer steps; ("rows_mean", 1), ("rows_std", 2) or ("sum", 1) for RowSums."""
    if isinstance(value, RowSums):
        return ("sum", 1) if value.count is None else ("rows_mean", 1) if value.squares is None else ("rows_std", 2)
    if isinstance(value, StepSums):
        return ("sum" if value.count is None else "ratio", int(value.total.numel()))
    return ("mean", 1)


def _table_rows(value: Any, kind: str, n: int, device: torch.device) -> torch.Tensor:
    """[n, 2] float64 (value, weight) rows of a metric on this rank; zeros where this rank lacks it."""
    if value is None:
        return torch.zeros(n, 2, dtype=torch.float64, device=device)
    if kind == "mean":
        return torch.stack([_as_tensor(value, device), torch.ones((), dtype=torch.float64, device=device)])[None]
    if isinstance(value, RowSums):  # (Σx, n) and, for a std, (Σx², n)
        count = _as_tensor(0.0 if value.count is None else value.count, device)
        sums = [value.total] + ([] if value.squares is None else [value.squares])
        return torch.stack([torch.stack([_as_tensor(v, device), count]) for v in sums])
    total = value.total.detach().reshape(-1).to(device=device, dtype=torch.float64)
    count = torch.zeros_like(total) if value.count is None else value.count.reshape(-1).to(device=device,
                                                                                           dtype=torch.float64)
    return torch.stack([total, count], dim=1)


def _finish(kind: str, rows: list[list[float]]) -> float:
    """A metric's value from its summed (value, weight) rows (see StepSums)."""
    if kind == "mean":
        value, present = rows[0]
        return value / present
    if kind == "sum":
        return sum(total for total, _ in rows) / len(rows)
    if kind == "rows_mean":
        total, n = rows[0]
        return total / n if n else float("nan")
    if kind == "rows_std":
        (total, n), (squares, _) = rows
        return math.sqrt(max(squares - total * total / n, 0.0) / (n - 1)) if n > 1 else 0.0
    return sum(total / count if count else 0.0 for total, count in rows) / len(rows)


def _as_tensor(value: Any, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(()).to(device=device, dtype=torch.float64)
    return torch.tensor(float(value), dtype=torch.float64, device=device)


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def end_process_group() -> bool:
    """Destroy this process's group, if it has one (True when it had): its connections close cleanly
    for the other ranks."""
    if not dist.is_initialized():
        return False
    dist.destroy_process_group()
    return True


def exit_without_finalizing(code: int) -> NoReturn:
    """End a process that ran gloo collectives, skipping the interpreter's finalization.

    Why: gloo's worker threads outlive destroy_process_group (FSDP2's mesh still holds the group) and
    may drop the last reference of a finished collective's work (FSDP2's all-gathers, whose tensors are
    Python objects) just as the interpreter finalizes; that thread cannot take the GIL any more and the
    process aborts, "terminate called without an active exception" (SIGABRT; a core dump here showed
    ProcessGroupGloo::runLoop in ~AsyncAllgatherCoalescedWork during Py_FinalizeEx; pytorch PR 179291),
    and torchrun reports a finished run as failed: 1 in 30 to 44 two-process runs on this CPU.
    Everything ddrl writes is closed by then; logging and the standard streams are flushed here."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
