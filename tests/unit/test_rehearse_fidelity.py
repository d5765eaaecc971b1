"""The rehearsal's FLOP counter must not keep activation checkpointing's recomputations alive.

torch's FlopCounterMode, through its ModuleTracker, hangs a gradient hook on every module's outputs,
the recomputed ones in backward included. A block returns its keys/values beside its output (as
ddrl's native blocks do: `(h, (k, v))`); recomputed in backward, those never get a gradient, and
their graph stayed alive as long as the counter ran. The rehearsal counts over a whole update (every
micro-batch and inner iteration), so a recipe with model.gradient_checkpointing=true measured every
backward's recomputed blocks alive at once (issue 33: dipod at 2 layers 24.6 GB, 9.5 GB without)."""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from ddrl.training.rehearse import _flop_counter


class MadeInBackward(TorchDispatchMode):
    """Weak references to every tensor of `shape` an op makes while autograd runs backward."""

    def __init__(self, shape: tuple[int, int]):
        super().__init__()
        self.shape, self.refs = shape, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch._C._current_graph_task_id() != -1 and isinstance(out, torch.Tensor) and tuple(out.shape) == self.shape:
            self.refs.append(weakref.ref(out))
        return out


class Block(nn.Module):
    """x [rows, width] -> (x + tanh(W x), this call's keys/values), a native block's contract."""

    def __init__(self, width: int):
        super().__init__()
        self.w, self.k = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor, past: None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        k = self.k(x)
        return x + torch.tanh(self.w(x)), (k, 2 * k)


def test_checkpoint_recomputations_are_freed_under_the_flop_counter():
    torch.manual_seed(0)
    blocks = [Block(16) for _ in range(3)]
    x = torch.randn(5, 16)  # [rows, width]
    with _flop_counter() as flops, MadeInBackward((5, 16)) as made:
        for _ in range(2):  # two micro-batches under one counter, as an update is counted
            h = x
            for block in blocks:
                h, _cache = checkpoint(block, h, None, use_reentrant=False)
            h.sum().backward()
            del h, _cache
        gc.collect()
        alive = [r for r in made.refs if r() is not None]
    assert made.refs, "the backward recomputed no block: the test checks nothing"
    assert not alive, f"{len(alive)} of {len(made.refs)} tensors made in backward (recomputed activations) outlive it"
    assert flops.get_total_flops() > 0


def test_dropout_keeps_a_bool_mask_as_on_a_gpu_and_recomputes_alike():
    """A CPU build's dropout keeps a float mask of the input's dtype for backward; CUDA's fused
    native_dropout keeps a bool one (a quarter of LoRA's fp32 adapter input). The rehearsal runs the
    GPU's, also inside a checkpointed block's recomputation (which must draw a mask of the same dtype)."""
    from ddrl.training.rehearse import cuda_dropout

    saved: list[torch.dtype] = []
    x = torch.randn(4, 16, requires_grad=True)
    with cuda_dropout(), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t):
        y = torch.nn.functional.dropout(x, 0.1, True)
    assert torch.bool in saved and torch.float32 not in saved, saved
    lin = nn.Linear(16, 16)
    with cuda_dropout():
        out = checkpoint(lambda h: lin(torch.nn.functional.dropout(h, 0.1, True)), x, use_reentrant=False)
        out.sum().backward()  # a recomputation with a float mask would raise CheckpointError
    assert x.grad is not None and y.shape == x.shape


def test_dtensor_shape_propagation_is_not_counted_as_memory():
    """DTensor computes an op's output shape by running it on fake tensors of the global shape in the
    fake mode it finds active: the rehearsal's own, so MemTracker counted them (AdamW's foreach step
    over FSDP2 shards: coupled_grpo measured 21 GB of "optimizer state" at 2 layers for 1.6 GB of
    moments). A step on 1/8 shards of a 1024 x 1024 fp32 weight holds its two moments and at most one
    shard-sized temporary; the global-shape stand-ins were 27 shards' worth (14.2 MB)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ddrl.training.rehearse import HostReads, step_memory_tracker

    world, width = 8, 1024
    shard = width * width * 4 // world
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        with FakeTensorMode(allow_non_fake_inputs=True), HostReads():  # HostReads: AdamW's step-counter reads
            model = fully_shard(nn.Linear(width, width, bias=False), mesh=mesh)
            opt = torch.optim.AdamW(model.parameters(), foreach=True)
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            tracker = step_memory_tracker(model, opt)
            with tracker:
                opt.step()
    finally:
        dist.destroy_process_group()
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    optimizer = next(v for k, v in peak.items() if getattr(k, "name", "") == "OPT")
    assert 2 * shard <= optimizer <= 3 * shard + 64, (optimizer, shard)  # two moments, one temporary, step counters


def test_the_rehearsed_step_starts_with_a_later_steps_gradients_and_adamw_state():
    """A step after the first starts with the previous update's gradients (freed at this update's
    zero_grad) and AdamW's moments: a rollout-peaked recipe (coupled_grpo, FSDP2 full fine-tuning)
    measured 11.4 GB low without them. With dist.cpu_offload both are host memory: none made."""
    from types import SimpleNamespace

    from ddrl.training.rehearse import _steady_state

    for offload in (False, True):
        model = nn.Linear(4, 4)
        opt = torch.optim.AdamW(model.parameters())
        trainer = SimpleNamespace(cfg=SimpleNamespace(dist=SimpleNamespace(cpu_offload=offload)), opt=opt,
                                  optimizer_steps=0)
        _steady_state(trainer)
        made = [p.grad is not None and set(opt.state[p]) >= {"exp_avg", "exp_avg_sq"} for p in model.parameters()]
        assert made == [not offload] * 2 and trainer.optimizer_steps == 0
