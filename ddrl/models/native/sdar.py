"""SDAR and TraDo: the native block-diffusion backbone (ddrl.models.native.base has the contract).

SDAR (JetAstra, "SDAR: a synergistic diffusion-autoregression paradigm", 2025) turns a Qwen3
checkpoint into a block diffusion LM; TraDo (Gen-Verse, TraceRL, 2025) checkpoints are SDAR models
trained further with RL. The network is Qwen3's: pre-norm decoder layers, grouped-query attention
with an RMSNorm on each query and key head (q_norm / k_norm, before RoPE), SwiGLU MLP. What makes
it a diffusion model is the attention layout it is trained and sampled with:

    block(token) = position // block_size          (block_size 4 in every released checkpoint)
    query q attends key k  iff  block(k) <= block(q) and k is not padding

so blocks are counted from the first token, the prompt included (block-causal inside the prompt,
bidirectional inside a block), the layout of SDAR's block_diffusion_generate (JetAstra/SDAR
generate.py). The checkpoint's config.json names the block size `block_size` and the mask token
`mask_token_id`.

Numerics follow Gen-Verse/dLLM-RL's models/sdar/modeling_sdar.py (the code TraDo ships with); the layers are
ddrl.models.native.qwen3's, shared with URSA:
  * RMSNorm is flash-attn's Triton rms_norm_fn: x and the weight in float32, y = x / sqrt(mean(x^2)
    + eps) * w, cast to x's dtype at the end (not Qwen3's weight * norm(x).to(dtype), which rounds
    to bf16 before the weight multiply);
  * RoPE: cos/sin from float32 angles, cast to the hidden states' dtype, applied in that dtype;
  * attention: scaled_dot_product_attention with an additive mask (0 where allowed, finfo.min
    elsewhere) over the K/V heads repeated to the query heads.

Where this module differs from theirs: given only a 2-D padding mask (or none) their attention
attends every real key, with positions 0..T-1 whatever the padding; here it builds the block layout
above with positions counted over real tokens (left padding shifts nothing). A boolean 3-D/4-D
mask is used exactly as given, as theirs is. Their q_len == 1 decoding path (flash_attn_func,
causal, ignoring the mask) is the same as the mask path on unpadded rows. They never read
config.json's attn_implementation ("flex_attention" in the hub files); neither does this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ddrl.processes.block import block_layout_mask
from ddrl.models.io import ModelDirectoryError, write_json
from ddrl.models.native.qwen3 import (Qwen3Attention, Qwen3Decoder, Qwen3DecoderLayer, Qwen3MLP, Qwen3RMSNorm,
                                      additive_mask, rope_tables)
from ddrl.models.native.base import (
    QwenStyleBackbone,
    head_output,
    run_layers,
    NATIVE_FAMILIES,
    BackboneOutput,
    KVCache,
    attention_inputs,
    check_past,
    check_weight_names,
    finish_mask,
    positions_from_mask,
    read_config,
    read_weights,
    weight_names,
    write_weights,
)

MODEL_TYPE = "sdar"
LM_HEAD = "lm_head.weight"


# --------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SDARConfig:
    """The fields of an SDAR/TraDo config.json this module reads; `raw` keeps the whole file, so
    save_pretrained writes back every field the authors' code or the hub tooling may need."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    block_size: int | None
    mask_token_id: int | None
    pad_token_id: int | None
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, block_size: int | None = None) -> "SDARConfig":
        """Validate config.json. block_size: the config's "block_size", else its "ddrl" section's,
        else this argument (a config without one cannot say how it was trained)."""
        if raw.get("model_type") != MODEL_TYPE:
            raise ModelDirectoryError(f"config.json has model_type {raw.get('model_type')!r}, not {MODEL_TYPE!r}; "
                                      f"load it with its own family")
        unsupported = {"hidden_act": raw.get("hidden_act", "silu") != "silu",
                       "rope_scaling": (raw.get("rope_scaling") or {}).get("rope_type", "default") != "default",
                       "use_sliding_window": bool(raw.get("use_sliding_window", False))}
        bad = [name for name, is_bad in unsupported.items() if is_bad]
        if bad:
            raise ModelDirectoryError(f"config.json sets {', '.join(f'{n}={raw.get(n)!r}' for n in bad)}; the native "
                                      f"SDAR backbone implements silu, default RoPE and full attention only (what "
                                      f"every released SDAR/TraDo checkpoint uses)")
        stored = raw.get("block_size") or raw.get("ddrl", {}).get("block_size")
        if stored is not None and block_size is not None and int(stored) != int(block_size):
            raise ValueError(f"block_size={block_size} contradicts config.json's block_size={stored}; drop the "
                             f"argument (the checkpoint was trained with {stored})")
        resolved = stored if stored is not None else block_size
        if resolved is not None and (isinstance(resolved, bool) or int(resolved) <= 0):
            raise ValueError(f"block_size must be a positive int, got {resolved!r}")
        heads = int(raw["num_attention_heads"])
        return cls(
            vocab_size=int(raw["vocab_size"]), hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]), num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads, num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=float(raw.get("rope_theta", 10000.0)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            block_size=None if resolved is None else int(resolved), mask_token_id=raw.get("mask_token_id"),
            pad_token_id=raw.get("pad_token_id"), bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"), raw=dict(raw))


# --------------------------------------------------------------------------------------------
# Layers: Qwen3's (ddrl.models.native.qwen3), shared with URSA
# --------------------------------------------------------------------------------------------

SDARRMSNorm, SDARAttention, SDARMLP = Qwen3RMSNorm, Qwen3Attention, Qwen3MLP
SDARDecoderLayer, SDARDecoder = Qwen3DecoderLayer, Qwen3Decoder


# --------------------------------------------------------------------------------------------
# The backbone
# --------------------------------------------------------------------------------------------


@NATIVE_FAMILIES.register("sdar")
class SDARBackbone(QwenStyleBackbone):
    """SDARForCausalLM's parameters (model.*, lm_head) behind ddrl's backbone contract."""

    def __init__(self, config: SDARConfig):
        super().__init__(config, SDARDecoder(config))

    # ------------------------------------------------------------------ forward

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                past_key_values: KVCache | None = None, use_cache: bool = False,
                logits_to_keep: int | Tensor | None = None, compute_logits: bool = True) -> BackboneOutput:
        """input_ids [B, T] -> logits [B, T, V] (base module doc for the arguments).

        logits_to_keep: None or 0 = every position; an int K = the last K positions; a 1-D long
        tensor = those positions; a 2-D [B, K] one = each row's own. hidden_states always covers all
        T positions; compute_logits=False skips lm_head (logits None).
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        past_len = check_past(past_key_values, len(self.layers), B)
        mask, positions = self._attention(attention_mask, position_ids, B, T, past_len, input_ids.device)
        h = self.model.embed_tokens(input_ids)  # [B, T, D]
        cos, sin = self._rotary(positions, h.dtype)
        h, cache = run_layers(self.layers, h, cos, sin, additive_mask(mask, h.dtype), past_key_values=past_key_values,
                              use_cache=use_cache,
                              checkpointing=self.checkpointing_now)
        hidden = self.model.norm(h)  # [B, T, D]
        return BackboneOutput(logits=head_output(self.lm_head, hidden, logits_to_keep, compute_logits),
                              past_key_values=cache, hidden_states=hidden)

    def _attention(self, attention_mask: Tensor | None, position_ids: Tensor | None, B: int, T: int, past_len: int,
                   device: torch.device) -> tuple[Tensor, Tensor]:
        """-> (boolean [B, 1, T, T_past + T] mask, query positions [B, T]).

        An explicit 3-D/4-D mask is used as given. Otherwise the block layout over key positions
        counted from the 2-D mask (all keys real without one); a new token's key position is its
        query position, so explicit position_ids move both.
        """
        explicit, valid, query_pos = attention_inputs(attention_mask, position_ids, B, T, past_len, device)
        if explicit is not None:
            return finish_mask(explicit.expand(B, 1, T, past_len + T)), query_pos
        if self.config.block_size is None:
            raise ValueError("this SDAR checkpoint's config.json has no block_size, so its block layout is unknown; "
                             "load it with SDARBackbone.from_pretrained(..., block_size=4) (what SDAR/TraDo are "
                             "trained with) or pass an explicit boolean attention_mask")
        if valid is None:
            valid = torch.ones(B, past_len + T, dtype=torch.bool, device=device)
            key_pos = torch.arange(past_len + T, device=device).expand(B, -1)
        else:
            key_pos = positions_from_mask(valid)
        key_pos = torch.cat([key_pos[:, :past_len], query_pos], dim=1)  # [B, T_past + T]
        return finish_mask(block_layout_mask(key_pos, valid, self.config.block_size, query_pos)), query_pos

    def _rotary(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [B, T] -> cos, sin [B, 1, T, Dh]: float32 angles, cast to the activations' dtype."""
        dim = self.config.head_dim
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64,
                                                                   device=positions.device).float() / dim))
        return rope_tables(positions.float()[..., None] * inv_freq, dtype)  # angles [B, T, Dh/2]

    # ------------------------------------------------------------------ persistence (official layout)

    def official_weight_names(self) -> set[str]:
        """The names SDARForCausalLM's checkpoints use (lm_head dropped when tied, as transformers saves)."""
        names = set(self.state_dict())
        return names - {LM_HEAD} if self.config.tie_word_embeddings else names

    @classmethod
    def from_pretrained(cls, directory: str | Path, *, device: torch.device | str | None = None,
                        dtype: torch.dtype | None = None, block_size: int | None = None) -> "SDARBackbone":
        """Read an SDAR/TraDo hub directory (config.json + safetensors); runs none of its code.

        dtype None keeps the stored dtype; block_size only for a config.json without one.
        """
        path = Path(directory)
        config = SDARConfig.from_dict(read_config(path), block_size=block_size)
        with torch.device("meta"):
            model = cls(config)
        got = weight_names(path) - ({LM_HEAD} if config.tie_word_embeddings else set())
        check_weight_names(path, MODEL_TYPE, got, model.official_weight_names())  # before any tensor is read
        state = read_weights(path)
        if config.tie_word_embeddings:
            state[LM_HEAD] = state["model.embed_tokens.weight"]
        if dtype is not None:
            state = {k: v.to(dtype) for k, v in state.items()}
        try:
            model.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as e:  # shapes that disagree with config.json
            raise ModelDirectoryError(f"the weights in {str(path)!r} do not fit its config.json: {e}") from e
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        return model.to(device) if device is not None else model

    def save_pretrained(self, directory: str | Path, state_dict: dict[str, Tensor] | None = None) -> None:
        """Write config.json (every field of the loaded one) and safetensors with the official names.
        state_dict (keyed like self.state_dict()) replaces the module's own tensors, e.g. gathered
        FSDP2 shards. Atomic: DiffusionLM.save_pretrained passes its own temporary directory."""
        state = dict(self.state_dict() if state_dict is None else state_dict)
        if self.config.tie_word_embeddings:
            state.pop(LM_HEAD, None)
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        write_json(directory / "config.json", self.config.raw)
        write_weights(directory, state)
