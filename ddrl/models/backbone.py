"""The parts of a backbone that ddrl looks up by structure: its transformer blocks and its LM head.

Blocks are the FSDP2 units and the activation-checkpointing units; the LM head is what LoRA
must not adapt unless asked for by path (ddrl.models.lora), and what fused log-prob kernels read
as one affine map (`head_linear`). They work on any backbone: the built-in Denoiser, ddrl's native
families (`layers`, `lm_head` by the contract in ddrl.models.native.base), Hugging Face models
(get_output_embeddings), and peft wrappers of them.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ddrl.ops.logprobs import HeadLinear


def base_model(backbone: Any) -> Any:
    """The model under a peft wrapper (LoRA), or the backbone itself (a Hugging Face, peft or native
    backbone, read by the attribute names they share: typed Any)."""
    return backbone.get_base_model() if hasattr(backbone, "get_base_model") else backbone


def forward_takes(backbone: Any, name: str) -> bool:
    """Whether a backbone's forward takes the keyword `name` (logits_to_keep, compute_logits, ...).

    A DiffusionModel declares its scoring arguments (ddrl.contract.ScoringModel); the backbone
    under it may be a transformers or user module, which states what it takes only through its
    forward's signature, so it is read here, inside the model layer. Cached per forward function
    (inspect.signature costs about as much as a tiny model's layer)."""
    backbone = getattr(backbone, "_orig_mod", backbone)  # under torch.compile: the compiled module's own forward
    forward = getattr(backbone, "forward", backbone)
    return _takes(getattr(forward, "__func__", forward), name)


@functools.lru_cache(maxsize=256)
def _takes(function: Any, name: str) -> bool:
    try:
        return name in inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False


def transformer_blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a transformer: its `layers` ModuleList (the native contract), else the
    children of its largest nn.ModuleList (by parameters)."""
    module = base_model(module)
    layers = getattr(module, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) > 0:
        return list(layers)
    best, best_size = None, -1
    for sub in module.modules():
        if isinstance(sub, nn.ModuleList) and len(sub) > 0:
            size = sum(p.numel() for p in sub.parameters())
            if size > best_size:
                best, best_size = sub, size
    return list(best) if best is not None else []


def checkpoint_blocks(backbone: nn.Module, enable: bool = True) -> None:
    """Recompute each transformer block's activations in backward (non-reentrant checkpointing)."""
    blocks = transformer_blocks(backbone)
    if not blocks:
        raise ValueError(f"{type(backbone).__name__} has no nn.ModuleList of transformer blocks to checkpoint; "
                         f"disable model.gradient_checkpointing for it")
    for block in blocks:
        original = block.__dict__.get("_ddrl_forward")
        if not enable:
            if original is not None:
                block.forward = original
                del block._ddrl_forward
            continue
        if original is not None:
            continue  # already checkpointed
        inner = block.forward

        def forward(*args: Any, _inner: Callable = inner, _block: nn.Module = block, **kwargs: Any) -> Any:
            if _block.training and torch.is_grad_enabled():
                return checkpoint(_inner, *args, use_reentrant=False, **kwargs)
            return _inner(*args, **kwargs)

        block._ddrl_forward = inner  # type: ignore[assignment]  # a plain attribute (not a submodule): the original
        block.forward = forward


# The names peft (`_prepare_model_for_gradient_checkpointing`) and transformers
# (`enable_input_require_grads`) give the hook they hang on the input embeddings.
INPUT_GRAD_HOOKS = ("make_inputs_require_grad", "make_inputs_require_grads")


def drop_input_grad_hooks(backbone: nn.Module) -> int:
    """Remove the forward hooks that make the input embeddings' output require grad; -> how many.

    peft adds one when it wraps a model in LoRA (always, on a backbone that does not say
    `is_gradient_checkpointing`), transformers when it turns on checkpointing: both for REENTRANT
    checkpointing, whose checkpointed blocks pass no gradient unless an input requires one. Every
    checkpointing in ddrl is non-reentrant (run_layers, checkpoint_blocks, Hugging Face's with
    use_reentrant=False), which needs none. With the hook, each training forward's embedding output
    was a leaf that required grad: backward computed the first block's input gradient, which nothing
    uses under a frozen embedding, and accumulated it into a [B, T, D] .grad kept as long as the graph
    (the rehearsal of issue 33 found them, one pair per micro-batch, alive at the optimizer step). A
    trainable embedding's output requires grad without the hook, so full fine-tuning is unchanged."""
    removed = 0
    for module in backbone.modules():
        hooks = module._forward_hooks
        for key in [k for k, fn in hooks.items() if getattr(fn, "__name__", "") in INPUT_GRAD_HOOKS]:
            for table in (hooks, module._forward_hooks_with_kwargs, module._forward_hooks_always_called):
                table.pop(key, None)
            removed += 1
    return removed


def output_projection(backbone: nn.Module) -> tuple[str, nn.Module] | None:
    """(name relative to the backbone, module) of the LM head, or None when the backbone does not say.

    The head is get_output_embeddings() (Hugging Face; LLaDA's `model.transformer.ff_out`), else an
    `lm_head` module (the built-in Denoiser), else (a backbone whose `lm_head` is a method) the
    only nn.Linear outside its transformer blocks. Names are those of backbone.named_modules(),
    i.e. the checkpoint's weight names without ".weight".
    """
    inner = base_model(backbone)
    head = None
    getter = getattr(inner, "get_output_embeddings", None)
    if callable(getter):
        try:
            head = getter()
        except (NotImplementedError, AttributeError):
            head = None
    if not isinstance(head, nn.Module):
        head = getattr(inner, "lm_head", None)
    if not isinstance(head, nn.Module):
        in_blocks = {id(m) for block in transformer_blocks(inner) for m in block.modules()}
        outside = [m for m in inner.modules() if isinstance(m, nn.Linear) and id(m) not in in_blocks]
        head = outside[0] if len(outside) == 1 else None
    if head is None:
        return None
    for name, module in inner.named_modules():
        if module is head:
            return name, module
    return None


def head_linear(backbone: nn.Module) -> HeadLinear | None:
    """The LM head as one affine map (weight [V, D], bias, scale) for a fused cross-entropy kernel,
    or None where it is not one: a LoRA adapter on the head (peft's module is not a plain Linear),
    or a backbone that does not say. A backbone whose `lm_head` is a method says with its own
    `head_linear()` (LLaDA: tied weights, scale_logits)."""
    base = base_model(backbone)
    own = getattr(base, "head_linear", None)
    if callable(own):
        return own()
    head = getattr(base, "lm_head", None)
    if type(head) is nn.Linear:
        return HeadLinear(head.weight, head.bias)
    return None


def logits_width(backbone: nn.Module) -> int | None:
    """Output classes of the LM head (its out_features / num_embeddings), None when there is no head to read."""
    found = output_projection(backbone)
    if found is None:
        return None
    head = found[1]
    if isinstance(head, nn.Linear):
        return head.out_features
    if isinstance(head, nn.Embedding):  # a tied head reads the input embedding
        return head.num_embeddings
    return None
