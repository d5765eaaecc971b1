"""What one transformer block of a native family keeps for backward, measured: the tensors autograd
saves (torch.autograd.graph.saved_tensors_hooks) while the model's first block runs, each storage
counted once, in bytes per token. The memory model's `_block_saved_bytes` must equal it
(tests/unit/test_block_saved_bytes.py).

Per token, by difference: the block runs inside a whole forward at three sequence lengths, and the
bytes are fitted exactly as a + B (b T + p T^2): b is what each token costs, p what each (query, key)
pair costs (a mask cast per block). What does not grow with the tokens (the weights, autocast's bf16
weight copies, LoRA's A and B) is a. The block's other tensor
arguments (RoPE tables, the attention mask) are built once for every block by the backbone, so they
are not this block's and are left out by storage.

Two CPU kernels differ from CUDA's in what they keep, and are run the CUDA way: torch.dropout on the
CPU multiplies by a noise tensor of the input's dtype (CUDA's fused native_dropout keeps a bool mask),
and the CPU attention kernel lays its output out like the query (CUDA's flash and memory-efficient
kernels always write [B, T, H, Dh], so the output projection reads the attention output as a view).

Two ways the trainer computes in bf16 (ddrl.training.distributed), both measured:
  "autocast"  fp32 parameters under torch.autocast(bf16): DDP and one process (the LoRA recipes);
  "bf16"      bf16 parameters, no autocast: FSDP2's MixedPrecisionPolicy(param_dtype=bf16), which
              casts the sharded fp32 parameters to bf16 for compute (the full fine-tuning recipes).
"""

from __future__ import annotations

import contextlib
import weakref
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FIXTURES = Path(__file__).resolve().parent / "fixtures"
# The tiny checkpoints of the native families (tests/fixtures/make_*.py)
FAMILY_FIXTURES = {"llada": FIXTURES / "llada/model", "mmada": FIXTURES / "mmada/model",
                   "dream": FIXTURES / "dream/model", "sdar": FIXTURES / "sdar/model",
                   "llada2": FIXTURES / "llada2/model-2.0", "ursa": FIXTURES / "ursa/model"}


def _storages(values: Any) -> set[int]:
    found: set[int] = set()
    for v in values if isinstance(values, (tuple, list)) else [values]:
        if isinstance(v, Tensor):
            found.add(v.untyped_storage().data_ptr())
    return found


def _block_saved_storages(model: nn.Module, layer: nn.Module, input_ids: Tensor, context: Any) -> int:
    """Bytes of the distinct storages that autograd saved during `layer`'s forward and still holds after
    the whole model's forward (its input included; its other tensor arguments and its weights left
    out). A tensor saved by a part of the graph that is dropped before backward (the router's group
    scores, which only choose indices) is freed and not counted: each is held by a weak reference."""
    saved: list[weakref.ref[Tensor]] = []
    arguments: set[int] = set()
    recording = contextlib.ExitStack()
    # the weights (and their transposes: views) are left out by storage: an MoE block saves only the
    # experts that got tokens, which differs between calls. Autocast's bf16 copies of them are new
    # storages, left to cancel in the fit: so an MoE block is measured with bf16 weights only
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}

    def pack(t: Tensor) -> Tensor:
        saved.append(weakref.ref(t))  # the graph keeps t itself (unpack returns it)
        return t

    def start(module: nn.Module, args: tuple) -> tuple:
        arguments.update(_storages(args[1:]))  # RoPE tables, mask: the backbone's, shared by every block
        recording.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        # The formula is a middle block's, whose input requires grad (the adapters below it). Under LoRA
        # the first block's input, a frozen embedding's output, does not (ddrl drops peft's require-grad
        # hook: ddrl.models.backbone.drop_input_grad_hooks), and that block saves less (its first norm
        # nothing): measured as a middle block, on the same storage.
        hidden = args[0]
        return args if hidden.requires_grad else (hidden.detach().requires_grad_(), *args[1:])

    def stop(module: nn.Module, args: tuple, output: Any) -> None:
        recording.close()

    handles = [layer.register_forward_pre_hook(start), layer.register_forward_hook(stop)]
    try:
        with context:
            out = model(input_ids)  # kept alive: what backward needs stays saved while counted
        alive = {}
        for ref in saved:
            t = ref()
            if t is not None:
                storage = t.untyped_storage()
                alive[storage.data_ptr()] = storage.nbytes()
        del out
    finally:
        for h in handles:
            h.remove()
    return sum(n for ptr, n in alive.items() if ptr not in arguments | weights)


def _cuda_dropout(x: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:
    return torch.native_dropout(x, p, training)[0] if training and 0 < p < 1 else x


def _cuda_layout_attention(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, H, T, Dh] viewing a [B, T, H, Dh] buffer
    return _SDPA(q, k, v, *args, **kwargs)


_SDPA = F.scaled_dot_product_attention


def block_saved_bytes_measured(family: str, *, lora: Any | None, compute: str, layer_index: int = 0,
                               rows: int = 2, step: int = 24) -> tuple[float, float]:
    """(bytes per token, bytes per (query, key) pair of a row) that block `layer_index` of `family`'s tiny
    fixture keeps for backward in training mode, fitted exactly to three lengths (step, 2 step, 3 step):
    saved(T) = a + rows (b T + p T^2). lora: a ddrl.config.LoraConfig (the base frozen, the adapters
    trainable, via ddrl's apply_lora), or None for full fine-tuning (every weight trainable). compute:
    "autocast" or "bf16" (module doc). p is not 0 only where the block casts a [B, 1, T, T] mask under
    autocast (an fp32 additive mask cast to bf16 for SDPA: SDAR, LLaDA2)."""
    from ddrl.models import load_model
    from ddrl.models.lora import apply_lora

    model = load_model(FAMILY_FIXTURES[family], dtype=torch.float32)
    if lora is not None:
        model = apply_lora(model, lora)
    model = model.to(torch.bfloat16 if compute == "bf16" else torch.float32).train()
    layer = model.model.layers[layer_index]

    def context() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if compute == "autocast":
            stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
        stack.enter_context(mock.patch.object(F, "dropout", _cuda_dropout))
        stack.enter_context(mock.patch.object(F, "scaled_dot_product_attention", _cuda_layout_attention))
        return stack

    g = torch.Generator().manual_seed(0)
    s1, s2, s3 = (_block_saved_storages(model, layer, torch.randint(0, 100, (rows, n * step), generator=g), context())
                  for n in (1, 2, 3))  # ids below every fixture's text vocabulary
    pair = ((s3 - s2) - (s2 - s1)) / (2 * step**2)
    token = ((s2 - s1) - pair * 3 * step**2) / step
    return token / rows, pair / rows
