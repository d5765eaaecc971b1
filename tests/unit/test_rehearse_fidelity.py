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
