"""What every native family (LLaDA, MMaDA's LLaDA backbone, Dream, SDAR/TraDo) implements, and the
pieces they share.

ddrl keeps its own model code for the dLLM families, as vLLM, SGLang and torchtune do: the hub
directories ship remote code written for one old transformers release each (LLaDA's never calls
post_init, Dream's needs ROPE_INIT_FUNCTIONS['default'], SDAR imports flash_attn and LossKwargs),
so no single transformers version runs them all. A native family reads the official checkpoint
directory (config.json with the authors' field names, safetensors shards with their weight
names) and runs no code from it.

**The backbone contract** (the built-in ddrl.models.transformer.Denoiser keeps the same one, so
the samplers' caches and the estimators treat every backbone alike):

    out = backbone(input_ids, attention_mask=None, position_ids=None, past_key_values=None,
                   use_cache=False, logits_to_keep=None, compute_logits=True)
    out.logits           [B, T, V]   (or [B, K, V] for the K positions of logits_to_keep; None
                                      with compute_logits=False: the caller applies lm_head itself)
    out.past_key_values  per layer (k, v) [B, H_kv, T_past + T, Dh], keys already rotated, when use_cache
    out.hidden_states    [B, T, D]   after the final norm (what lm_head reads)

  * attention_mask: None (every key); [B, T_past + T] padding mask (1 = real) over (cached keys,
    new tokens); or a boolean [B, (1,) T, T_past + T] mask used exactly as given (True = attend).
  * position_ids [B, T]; default: counted over real tokens (cumsum - 1 of the 2-D mask), so a
    left-padded row gets the logits of the unpadded one (padding invariance). With a cache and no
    mask: T_past + arange(T).
  * A block-causal family (SDAR) given only a 2-D mask builds ddrl.processes.block's layout itself.
  * logits_to_keep: None / 0 every position, an int K the last K, a 1-D long tensor those positions,
    a 2-D [B, K] one each row's own positions (`kept_positions`).
  * `layers` is the nn.ModuleList of transformer blocks (FSDP2 units, activation checkpointing),
    `lm_head(hidden)` the output projection applied separately by callers that score few positions
    (ddrl.ops.logprobs chunks it); a family whose `lm_head` is a method also has `head_linear()`,
    the head as one affine map (ddrl.models.backbone.head_linear).

A family module registers its class with `@NATIVE_FAMILIES.register("llada")`; the class has
`from_pretrained(directory, *, device=None, dtype=None)` and `save_pretrained(directory,
state_dict=None)` writing the same official layout back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, cast, overload

import torch
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ddrl.logits import take_positions
from ddrl.models.io import ModelDirectoryError, open_safetensors, read_safetensors
from ddrl.registry import Registry

NATIVE_FAMILIES: Registry[type[Any]] = Registry("native model family")  # classes with from_pretrained

KVCache = list[tuple[Tensor, Tensor]]  # per layer (k, v), each [B, H_kv, T, Dh]

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
_SHARD_BYTES = 5 * 1024**3  # the hub's usual shard size


@dataclass
class BackboneOutput:
    logits: Tensor | None  # [B, T, V] (or [B, K, V] with logits_to_keep); None with compute_logits=False
    past_key_values: KVCache | None = None  # per layer (k, v) [B, H_kv, T_past + T, Dh] when use_cache
    hidden_states: Tensor | None = None  # [B, T, D] after the final norm


# --------------------------------------------------------------------------------------------
# Weights on disk: single or sharded safetensors, as the hub writes them
# --------------------------------------------------------------------------------------------


def weight_files(directory: Path, file: str = SAFETENSORS_FILE) -> list[Path]:
    """The safetensors files of a checkpoint directory (the index's shards, or the single file).
    file: the single file's name; its index is FILE.index.json (diffusers' components name theirs
    diffusion_pytorch_model.safetensors)."""
    index = directory / f"{file}.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (directory / s).is_file()]
        if missing:
            raise ModelDirectoryError(f"{str(directory)!r}: {index.name} names shards that are not there: "
                                      f"{missing}; copy the whole checkpoint directory")
        return [directory / s for s in shards]
    if (directory / file).is_file():
        return [directory / file]
    raise ModelDirectoryError(f"{str(directory)!r} has no {file} or {index.name}; native families "
                              f"read safetensors weights (convert a pytorch_model.bin with safetensors first)")


def weight_names(directory: Path, file: str = SAFETENSORS_FILE) -> set[str]:
    """The tensor names of the checkpoint, read from the safetensors headers only (no tensor data),
    so a directory of the wrong family fails before gigabytes are read."""
    names: set[str] = set()
    for path in weight_files(directory, file):
        with open_safetensors(path) as f:
            names.update(f.keys())
    return names


def read_weights(directory: Path, file: str = SAFETENSORS_FILE) -> dict[str, Tensor]:
    """Every tensor of the checkpoint, keyed by the authors' weight names (meta tensors of the
    stored shapes under `with torch.device("meta")`: no tensor data is read)."""
    state: dict[str, Tensor] = {}
    for path in weight_files(directory, file):
        state.update(read_safetensors(path))  # headers only under torch.device("meta")
    return state


def write_weights(directory: Path, state: dict[str, Tensor], *, shard_bytes: int = _SHARD_BYTES,
                  file: str = SAFETENSORS_FILE) -> None:
    """Write `state` as FILE (model.safetensors), or as hub-style shards + index when it is larger than shard_bytes."""
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    total = sum(v.numel() * v.element_size() for v in state.values())
    if total <= shard_bytes:
        save_file(state, str(directory / file), metadata={"format": "pt"})
        return
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    stem = file.removesuffix(".safetensors")
    for i, shard in enumerate(shards):
        name = f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
    (directory / f"{file}.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                              "weight_map": weight_map}, indent=2))


def check_weight_names(directory: Path, family: str, got: set[str], expected: set[str]) -> None:
    """A checkpoint whose weight names are not its family's fails before anything is built."""
    if got == expected:
        return
    missing, unexpected = sorted(expected - got), sorted(got - expected)
    raise ModelDirectoryError(
        f"the weights in {str(directory)!r} are not a {family} checkpoint's: missing {missing[:5]}"
        f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}. "
        f"Check config.json's model_type/architectures (they chose {family!r}) or pass a {family} checkpoint")


# --------------------------------------------------------------------------------------------
# Attention masks and positions
# --------------------------------------------------------------------------------------------


def positions_from_mask(valid: Tensor) -> Tensor:
    """[B, T] bool -> [B, T] positions counting real tokens only (left padding shifts nothing)."""
    return (valid.long().cumsum(1) - 1).clamp(min=0)


def attention_inputs(attention_mask: Tensor | None, position_ids: Tensor | None, B: int, T: int, past_len: int,
                     device: torch.device) -> tuple[Tensor | None, Tensor | None, Tensor]:
    """The forward's mask arguments -> (explicit boolean [B, 1, T, T_keys] mask or None,
    key validity [B, T_keys] or None, query positions [B, T]).

    A bidirectional family attends `valid` keys; a block family combines `valid` with its block
    layout. Rows whose query sees no key attend everything (their output is padding, never read;
    an empty softmax would give NaN that leaks through 0 * NaN).
    """
    T_keys = past_len + T
    explicit = valid = None
    key_pos = torch.arange(T_keys, device=device).expand(B, T_keys)
    if attention_mask is not None and attention_mask.dim() == 2:
        if tuple(attention_mask.shape) != (B, T_keys):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected [B, T_past + T] = "
                             f"{(B, T_keys)}")
        valid = attention_mask.bool()
        key_pos = positions_from_mask(valid)
    elif attention_mask is not None and attention_mask.dim() in (3, 4):
        explicit = attention_mask if attention_mask.dim() == 4 else attention_mask[:, None]
        if explicit.dtype != torch.bool or explicit.shape[0] != B or tuple(explicit.shape[-2:]) != (T, T_keys):
            raise ValueError(f"a 3-D/4-D attention_mask must be boolean [B, (1,) T, T_past + T] = [{B}, {T}, {T_keys}], "
                             f"got {attention_mask.dtype} {tuple(attention_mask.shape)}")
    elif attention_mask is not None:
        raise ValueError(f"attention_mask must be 2-D, 3-D or 4-D, got shape {tuple(attention_mask.shape)}")
    if position_ids is not None:
        if tuple(position_ids.shape) not in ((B, T), (1, T)):
            raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}, expected [B, T] = {(B, T)}")
        query_pos = position_ids.to(device).expand(B, T)
    else:
        query_pos = key_pos[:, past_len:]
    return explicit, valid, query_pos


@overload
def finish_mask(allowed: Tensor) -> Tensor: ...
@overload
def finish_mask(allowed: None) -> None: ...
def finish_mask(allowed: Tensor | None) -> Tensor | None:
    """A boolean [B, 1, T, T_keys] mask with every empty query row opened (see attention_inputs)."""
    return None if allowed is None else allowed | ~allowed.any(dim=-1, keepdim=True)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def check_past(past_key_values: KVCache | None, n_layers: int, batch: int) -> int:
    """Length of the cached prefix (0 without one); a cache of the wrong shape is an error naming it."""
    if not past_key_values:
        return 0
    if len(past_key_values) != n_layers:
        raise ValueError(f"past_key_values has {len(past_key_values)} layers, the model has {n_layers}; "
                         f"pass the cache this model returned with use_cache=True")
    k = past_key_values[0][0]
    if k.dim() != 4 or k.shape[0] != batch:
        raise ValueError(f"past_key_values keys must be [B={batch}, H_kv, T_past, Dh], got {tuple(k.shape)}")
    return int(k.shape[2])


def read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise ModelDirectoryError(f"{str(directory)!r} has no config.json; pass a checkpoint directory")
    return json.loads(path.read_text())


# --------------------------------------------------------------------------------------------
# What every family's backbone class shares
# --------------------------------------------------------------------------------------------


class LayerCheckpointing:
    """Per-layer activation checkpointing switched the Hugging Face way (a mixin of every native
    backbone; forward passes `checkpointing=self.checkpointing_now` to run_layers)."""

    supports_gradient_checkpointing = True
    gradient_checkpointing = False
    training: bool  # nn.Module's, in the class this mixes into

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        """Recompute each layer's activations in backward (non-reentrant torch.utils.checkpoint)."""
        self.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.gradient_checkpointing = False

    @property
    def checkpointing_now(self) -> bool:
        return self.gradient_checkpointing and self.training and torch.is_grad_enabled()


class QwenStyleBackbone(LayerCheckpointing, nn.Module):
    """The layout Dream (Qwen2) and SDAR (Qwen3) checkpoints share: `model.{embed_tokens, layers,
    norm}` and `lm_head` (tied to the embedding when config.tie_word_embeddings). A subclass builds
    `trunk` (the `model.` module) and defines forward."""

    def __init__(self, config: Any, trunk: nn.Module):
        super().__init__()
        self.config = config
        self.model: Any = trunk  # the family's trunk (`model.{embed_tokens, layers, norm}`), read by name
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = cast(nn.Embedding, self.model.embed_tokens).weight

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers (FSDP2 units, activation checkpointing)."""
        return self.model.layers

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head



# --------------------------------------------------------------------------------------------
# The forward loop every family shares
# --------------------------------------------------------------------------------------------


def run_layers(layers: Iterable[nn.Module], h: Tensor, *args: Any, past_key_values: KVCache | None,
               use_cache: bool, checkpointing: bool) -> tuple[Tensor, KVCache | None]:
    """h [B, T, D] through every layer `layer(h, *args, past) -> (h, (k, v))`, per-layer activation
    checkpointing (non-reentrant) when `checkpointing`; -> (h, per-layer (k, v) or None)."""
    cache: KVCache = []
    for i, layer in enumerate(layers):
        past = past_key_values[i] if past_key_values else None
        if checkpointing:
            h, kv = checkpoint(layer, h, *args, past, use_reentrant=False)
        else:
            h, kv = layer(h, *args, past)
        if use_cache:
            cache.append(kv)
    return h, (cache if use_cache else None)


def kept_positions(hidden: Tensor, logits_to_keep: int | Tensor | None) -> Tensor:
    """The positions whose logits a call computes: hidden [B, T, D] -> [B, K, D].
    None or 0 = every position; an int K = the last K; a 1-D long tensor = those positions; a 2-D
    [B, K] long tensor = row b's own positions."""
    if isinstance(logits_to_keep, Tensor):
        return take_positions(hidden, logits_to_keep)
    if logits_to_keep:
        return hidden[:, -int(logits_to_keep):]
    return hidden


def head_output(lm_head: Any, hidden: Tensor, logits_to_keep: int | Tensor | None,
                compute_logits: bool) -> Tensor | None:
    """The forward's logits: lm_head at the kept positions, or None when the caller applies the
    head itself (compute_logits=False: ddrl.ops.logprobs scores the hidden states chunk by chunk)."""
    return lm_head(kept_positions(hidden, logits_to_keep)) if compute_logits else None
