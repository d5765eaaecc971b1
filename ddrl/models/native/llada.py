"""LLaDA (LLaDA-8B-Base/Instruct, LLaDA-1.5) and MMaDA's LLaDA backbone, without their remote code.

LLaDA (Nie et al. 2025, "Large Language Diffusion Models") is a LLaMA-style encoder: pre-norm
blocks of bidirectional multi-head attention with RoPE and a SiLU-gated MLP, RMSNorm, an untied
output head, no biases. LLaDA-1.5 (VRPO fine-tuning) has the same architecture and checkpoint
layout. MMaDA (Yang et al. 2025) is LLaDA-8B-Instruct with the vocabulary extended by an image
codebook; its backbone is this one.

**The checkpoint is read as the hub ships it**: config.json with the authors' field names
(d_model, n_heads, n_kv_heads, mlp_hidden_size, rope_theta, embedding_size, weight_tying, ...)
and safetensors with their weight names, which are this module's parameter names:

    model.transformer.wte.weight                       [embedding_size, d_model]
    model.transformer.blocks.N.{attn_norm,ff_norm}.weight
    model.transformer.blocks.N.{q_proj,k_proj,v_proj,attn_out}.weight
    model.transformer.blocks.N.{ff_proj,up_proj,ff_out}.weight     (ff_proj is the SiLU gate)
    model.transformer.ln_f.weight
    model.transformer.ff_out.weight                    the LM head [embedding_size, d_model], absent
                                                       when weight_tying (wte is the head then)

Note that `ff_out` names both a block's MLP output projection and the untied LM head.

**Numerics follow the authors' code op for op** (ZHZisZZ/dllm @ 03270de7, the hub
modeling_llada.py), so float32 and bfloat16 logits match theirs:
  * RMSNorm: x in float32 (autocast off), x * rsqrt(mean(x^2) + eps), cast back to x's dtype,
    then weight * x in the weight's dtype.
  * RoPE: the sin/cos table is built in float32 on the CPU for max_sequence_length positions
    (inv_freq = 1 / theta^(2i/Dh), angles = position * inv_freq, the halves concatenated) and
    read at each token's position; with rope_full_precision q and k are rotated in float32 and
    cast back. Channels i and i + Dh/2 form a pair (rotate_half).
  * Grouped-query attention repeats each key/value head n_heads / n_kv_heads times
    (repeat_interleave) before scaled_dot_product_attention, scale 1/sqrt(Dh).

**Where this differs from the authors' code, on purpose:**
  * Positions count real tokens (the backbone contract in ddrl.models.native.base), so a
    left-padded row gets its unpadded logits. The dllm copy masks padding but numbers positions
    0..T-1; RoPE being relative, its padded logits differ from the unpadded ones only by float
    rounding (~1e-5 on the tiny fixture). MMaDA's copy turns a 2-D attention_mask with padding
    into a *causal* bias plus padding (the OLMo code path it kept); its own samplers pass a
    pairwise boolean attention_bias instead. Here a 2-D mask is always padding, attention is
    always bidirectional.
  * A KV cache (the contract's per-layer (k, v), keys already rotated) for Fast-dLLM-style
    block caches; the hub code refuses past_key_values. Keys are rotated once, when computed;
    the authors' Fast-dLLM copy caches unrotated keys and rotates all of them at every call,
    the same numbers since rotation is elementwise per position.
  * The RoPE table is built on the CPU and moved to the device once, as the hub code does at
    init; for sequences longer than max_sequence_length it is extended on the CPU as well (the
    hub code rebuilds it on the device, a last-ulp difference on GPUs).
  * No global torch.backends flags are set (the hub code disables the memory-efficient SDPA
    kernel process-wide), so on a GPU the attention kernel, and the last bits, may differ.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ddrl.models.io import ModelDirectoryError
from ddrl.ops.logprobs import HeadLinear
from ddrl.ops.value_checks import check_ids
from ddrl.models.native.base import (
    LayerCheckpointing,
    BackboneOutput,
    KVCache,
    NATIVE_FAMILIES,
    attention_inputs,
    check_past,
    check_weight_names,
    finish_mask,
    head_output,
    read_config,
    read_weights,
    weight_names,
    rotate_half,
    run_layers,
    write_weights,
)

LM_HEAD = "model.transformer.ff_out.weight"

# config.json values this implementation computes (field: accepted values); the authors' code has
# other block/norm/activation variants that no released LLaDA or MMaDA checkpoint uses.
_SUPPORTED = {
    "block_type": ("llama",),
    "layer_norm_type": ("rms",),
    "activation_type": ("silu",),
    "rope": (True,),
    "alibi": (False,),
    "attention_layer_norm": (False,),
    "block_group_size": (1,),
    "layer_norm_with_affine": (True,),
}
# The authors' ModelConfig defaults, used for fields a config.json leaves out.
_DEFAULTS: dict[str, Any] = {
    "n_kv_heads": None, "multi_query_attention": None, "mlp_ratio": 4, "mlp_hidden_size": None,
    "embedding_size": None, "max_sequence_length": 1024, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
    "rope_full_precision": True, "weight_tying": True, "include_bias": False, "include_qkv_bias": False,
    "bias_for_layer_norm": None, "input_emb_norm": False, "scale_logits": False, "attention_dropout": 0.1,
    "residual_dropout": 0.1, "embedding_dropout": 0.1, "mask_token_id": None, "eos_token_id": None,
    "pad_token_id": None, "block_type": "sequential", "layer_norm_type": "default", "activation_type": "swiglu",
    "rope": False, "alibi": False, "attention_layer_norm": False, "block_group_size": 1,
    "layer_norm_with_affine": True,
}


# --------------------------------------------------------------------------------------------
# Configuration: the facts of config.json this code reads, and the file itself
# --------------------------------------------------------------------------------------------


@dataclass
class LLaDAConfig:
    """What the backbone needs from a LLaDA config.json (the authors' field names)."""

    d_model: int
    n_heads: int
    n_kv_heads: int  # key/value heads (grouped-query attention when < n_heads)
    n_layers: int
    mlp_hidden_size: int
    vocab_size: int  # the tokenizer's vocabulary; DiffusionLM reads it
    embedding_size: int  # rows of wte and of the LM head = logits width (>= vocab_size)
    max_sequence_length: int  # trained context; DiffusionLM.max_seq_len reads it
    rope_theta: float
    rms_norm_eps: float
    rope_full_precision: bool
    weight_tying: bool
    include_bias: bool  # biases on every linear layer
    include_qkv_bias: bool
    norm_bias: bool  # bias_for_layer_norm (None in config.json: include_bias)
    input_emb_norm: bool  # embeddings scaled by sqrt(d_model)
    scale_logits: bool  # logits scaled by 1/sqrt(d_model)
    embedding_dropout: float
    attention_dropout: float
    residual_dropout: float
    mask_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    fields: dict[str, Any] = field(default_factory=dict, repr=False)  # config.json as read, saved back unchanged

    model_type: ClassVar[str] = "llada"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config.json") -> "LLaDAConfig":
        """config.json's dict -> config; an unsupported or inconsistent value is an error naming the field."""
        if data.get("model_type") != cls.model_type:
            raise ModelDirectoryError(f"{source} has model_type {data.get('model_type')!r}, not {cls.model_type!r}; "
                                      f"load it with the native family of its model_type")
        missing = [k for k in ("d_model", "n_heads", "n_layers", "vocab_size") if data.get(k) is None]
        if missing:
            raise ModelDirectoryError(f"{source} lacks {missing}; a LLaDA config.json names its sizes")
        get: Callable[[str], Any] = lambda name: data.get(name, _DEFAULTS.get(name))  # noqa: E731
        for name, accepted in _SUPPORTED.items():
            if get(name) not in accepted:
                raise ModelDirectoryError(f"{source}: {name}={get(name)!r} is not supported by ddrl's native LLaDA "
                                          f"(it computes {name} in {accepted}, as every released LLaDA/MMaDA does)")
        d_model, n_heads = int(data["d_model"]), int(data["n_heads"])
        n_kv = get("n_kv_heads")
        if n_kv is None:
            n_kv = 1 if get("multi_query_attention") else n_heads
        if d_model % n_heads or n_heads % n_kv:
            raise ModelDirectoryError(f"{source}: d_model={d_model}, n_heads={n_heads}, n_kv_heads={n_kv} do not "
                                      f"divide (need d_model % n_heads == 0 and n_heads % n_kv_heads == 0)")
        vocab = int(data["vocab_size"])
        embedding = int(get("embedding_size") or vocab)
        if embedding < vocab:
            raise ModelDirectoryError(f"{source}: embedding_size={embedding} < vocab_size={vocab}")
        norm_bias = get("bias_for_layer_norm")
        return cls(
            d_model=d_model, n_heads=n_heads, n_kv_heads=int(n_kv), n_layers=int(data["n_layers"]),
            mlp_hidden_size=int(get("mlp_hidden_size") or get("mlp_ratio") * d_model), vocab_size=vocab,
            embedding_size=embedding, max_sequence_length=int(get("max_sequence_length")),
            rope_theta=float(get("rope_theta")), rms_norm_eps=float(get("rms_norm_eps")),
            rope_full_precision=bool(get("rope_full_precision")), weight_tying=bool(get("weight_tying")),
            include_bias=bool(get("include_bias")), include_qkv_bias=bool(get("include_qkv_bias")),
            norm_bias=bool(get("include_bias") if norm_bias is None else norm_bias),
            input_emb_norm=bool(get("input_emb_norm")), scale_logits=bool(get("scale_logits")),
            embedding_dropout=float(get("embedding_dropout")), attention_dropout=float(get("attention_dropout")),
            residual_dropout=float(get("residual_dropout")), mask_token_id=get("mask_token_id"),
            eos_token_id=get("eos_token_id"), pad_token_id=get("pad_token_id"), fields=dict(data),
            **cls._extra_fields(data, source),
        )

    @classmethod
    def _extra_fields(cls, data: dict[str, Any], source: str) -> dict[str, Any]:
        return {}


@dataclass
class MMaDAConfig(LLaDAConfig):
    """LLaDA's fields plus MMaDA's image-codebook facts. Image code c is token id len(tokenizer) + c,
    which the config cannot know (ddrl.models.families.image_token_range); llm_vocab_size counts the
    embedding's text rows, padded past the tokenizer."""

    llm_vocab_size: int = 0  # the text vocabulary (LLaDA's 126464 for MMaDA-8B)
    codebook_size: int = 0  # VQ codebook entries (8192 for MMaDA-8B)
    num_new_special_tokens: int = 0
    num_vq_tokens: int | None = None  # image tokens per image, when the config says

    model_type: ClassVar[str] = "mmada"

    @classmethod
    def _extra_fields(cls, data: dict[str, Any], source: str) -> dict[str, Any]:
        missing = [k for k in ("llm_vocab_size", "codebook_size") if data.get(k) is None]
        if missing:
            raise ModelDirectoryError(f"{source} lacks MMaDA's {missing}; an MMaDA config.json has them")
        extra: dict[str, Any] = {"llm_vocab_size": int(data["llm_vocab_size"]), "codebook_size": int(data["codebook_size"]),
                 "num_new_special_tokens": int(data.get("num_new_special_tokens") or 0),
                 "num_vq_tokens": data.get("num_vq_tokens")}
        end = extra["llm_vocab_size"] + extra["num_new_special_tokens"] + extra["codebook_size"]
        if end > int(data["vocab_size"]):
            raise ModelDirectoryError(f"{source}: the image codebook ends at id {end} > "
                                      f"vocab_size={data['vocab_size']}")
        return extra


# --------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, bias: bool):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        # Normalised in float32 with autocast off, cast back, then scaled in the weight's dtype (as LLaDA).
        with torch.autocast(device_type=x.device.type, enabled=False):
            dtype = x.dtype
            x = x.to(torch.float32)
            x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        x = self.weight * x
        return x if self.bias is None else x + self.bias


class Rotary:
    """RoPE tables (float32, built on the CPU like the hub code's) and the rotation."""

    def __init__(self, cfg: LLaDAConfig):
        self.head_dim, self.theta, self.length = cfg.head_dim, cfg.rope_theta, cfg.max_sequence_length
        self.full_precision = cfg.rope_full_precision
        self._tables: dict[torch.device, tuple[Tensor, Tensor]] = {}  # per device: cos, sin [L, Dh]

    def table(self, length: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """cos, sin [L, Dh] for positions 0..L-1, L >= max(length, max_sequence_length)."""
        if device not in self._tables or self._tables[device][0].shape[0] < length:
            dim = self.head_dim
            inv_freq = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))  # [Dh/2]
            positions = torch.arange(max(length, self.length), dtype=torch.float)
            angles = positions[:, None] * inv_freq[None, :]  # [L, Dh/2]
            angles = torch.cat([angles, angles], dim=-1)  # [L, Dh]
            self._tables[device] = (angles.cos().to(device), angles.sin().to(device))
        return self._tables[device]

    def at(self, positions: Tensor, length: int) -> tuple[Tensor, Tensor]:
        """positions [B, T], all below `length` -> cos, sin [B, 1, T, Dh] (float32).

        The table's length comes from the call's shapes (T_past + T: positions counted over real
        tokens stay below it), not from positions.max(), which would read the device every call."""
        cos, sin = self.table(length, positions.device)
        return cos[positions][:, None], sin[positions][:, None]

    def rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [B, H, T, Dh] rotated at its positions, computed in float32 when rope_full_precision."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            t = x.float() if self.full_precision else x
            cos, sin = cos.type_as(t), sin.type_as(t)
            return ((t * cos) + (rotate_half(t) * sin)).to(t.dtype).type_as(x)


class LLaDABlock(nn.Module):
    """Pre-norm block: x + attn(attn_norm(x)), then x + ff_out(silu(ff_proj(h)) * up_proj(h)), h = ff_norm(x)."""

    def __init__(self, cfg: LLaDAConfig):
        super().__init__()
        d, kv, hidden = cfg.d_model, cfg.n_kv_heads * cfg.head_dim, cfg.mlp_hidden_size
        qkv_bias = cfg.include_bias or cfg.include_qkv_bias
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.attention_dropout = cfg.attention_dropout
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.norm_bias)
        self.ff_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.norm_bias)
        self.q_proj = nn.Linear(d, d, bias=qkv_bias)
        self.k_proj = nn.Linear(d, kv, bias=qkv_bias)
        self.v_proj = nn.Linear(d, kv, bias=qkv_bias)
        self.attn_out = nn.Linear(d, d, bias=cfg.include_bias)
        self.ff_proj = nn.Linear(d, hidden, bias=cfg.include_bias)
        self.up_proj = nn.Linear(d, hidden, bias=cfg.include_bias)
        self.ff_out = nn.Linear(hidden, d, bias=cfg.include_bias)
        self.dropout = nn.Dropout(cfg.residual_dropout) if cfg.residual_dropout > 0 else nn.Identity()

    def forward(self, x: Tensor, rotary: Rotary, cos: Tensor, sin: Tensor, mask: Tensor | None,
                past: tuple[Tensor, Tensor] | None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """x [B, T, D] -> (x [B, T, D], this call's keys/values [B, H_kv, T_past + T, Dh], keys rotated)."""
        B, T, D = x.shape
        h = self.attn_norm(x)
        q = self.q_proj(h).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, Dh]
        k = self.k_proj(h).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, H_kv, T, Dh]
        v = self.v_proj(h).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotary.rotate(q, cos, sin), rotary.rotate(k, cos, sin)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)  # [B, H_kv, T_past + T, Dh]
        present = (k, v)
        if self.n_kv_heads != self.n_heads:
            k = k.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1, output_size=self.n_heads)
            v = v.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1, output_size=self.n_heads)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False,
                                           dropout_p=self.attention_dropout if self.training else 0.0)
        x = x + self.dropout(self.attn_out(a.transpose(1, 2).contiguous().view(B, T, D)))
        h = self.ff_norm(x)
        h = F.silu(self.ff_proj(h)) * self.up_proj(h)
        return x + self.dropout(self.ff_out(h)), present


class _Transformer(nn.Module):
    """Holds `transformer` so that parameter names are the checkpoint's (model.transformer.*)."""

    def __init__(self, cfg: LLaDAConfig):
        super().__init__()
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(cfg.embedding_size, cfg.d_model),
            "blocks": nn.ModuleList(LLaDABlock(cfg) for _ in range(cfg.n_layers)),
            "ln_f": RMSNorm(cfg.d_model, cfg.rms_norm_eps, cfg.norm_bias),
        })
        if not cfg.weight_tying:
            self.transformer["ff_out"] = nn.Linear(cfg.d_model, cfg.embedding_size, bias=cfg.include_bias)


# --------------------------------------------------------------------------------------------
# The backbone
# --------------------------------------------------------------------------------------------


@NATIVE_FAMILIES.register("llada")
class LLaDABackbone(LayerCheckpointing, nn.Module):
    """input_ids [B, T] -> BackboneOutput(logits [B, T, embedding_size], past_key_values, hidden_states)."""

    family: ClassVar[str] = "llada"
    config_class: ClassVar[type[LLaDAConfig]] = LLaDAConfig

    def __init__(self, config: LLaDAConfig):
        super().__init__()
        self.config = config
        self.model = _Transformer(config)
        self.rotary = Rotary(config)
        self.emb_drop = nn.Dropout(config.embedding_dropout) if config.embedding_dropout > 0 else nn.Identity()

    @property
    def layers(self) -> nn.ModuleList:
        """The transformer blocks (FSDP2 units, activation checkpointing)."""
        return cast(nn.ModuleList, self.model.transformer["blocks"])

    def get_input_embeddings(self) -> nn.Embedding:
        return cast(nn.Embedding, self.model.transformer["wte"])

    def get_output_embeddings(self) -> nn.Module:
        """The LM head: model.transformer.ff_out, or wte itself when weight_tying."""
        t = self.model.transformer
        return t["wte"] if self.config.weight_tying else t["ff_out"]

    def lm_head(self, hidden: Tensor) -> Tensor:
        """hidden [..., D] (after the final norm) -> logits [..., embedding_size]."""
        t = self.model.transformer
        logits = F.linear(hidden, self.get_input_embeddings().weight) if self.config.weight_tying else t["ff_out"](hidden)
        return logits * (1 / math.sqrt(self.config.d_model)) if self.config.scale_logits else logits

    def range_logits(self, hidden: Tensor, lo: int, hi: int) -> Tensor:
        """hidden [..., D] -> lm_head(hidden)[..., lo:hi], computing only the head's rows [lo, hi)
        (DiffusionLM's class_range: a text-to-image MMaDA's samplers ask for its 8,192 codes, not the
        134,656 ids). Each logit is the same dot product as in lm_head, the rows a view of the weight;
        a head that is not a plain Linear (a LoRA adapter on ff_out) runs whole and is sliced."""
        head = self.model.transformer["ff_out"] if not self.config.weight_tying else None
        if self.config.weight_tying:
            weight, bias = self.get_input_embeddings().weight, None
        elif type(head) is nn.Linear:
            weight, bias = head.weight, head.bias
        else:
            return self.lm_head(hidden)[..., lo:hi]
        logits = F.linear(hidden, weight[lo:hi], None if bias is None else bias[lo:hi])
        return logits * (1 / math.sqrt(self.config.d_model)) if self.config.scale_logits else logits

    def head_linear(self) -> HeadLinear | None:
        """lm_head as one affine map for fused kernels: the tied wte or ff_out weight, LLaDA's
        scale_logits; None when ff_out is not a plain Linear (a LoRA adapter on it)."""
        t = self.model.transformer
        scale = 1 / math.sqrt(self.config.d_model) if self.config.scale_logits else None
        if self.config.weight_tying:
            return HeadLinear(self.get_input_embeddings().weight, None, scale)
        head = t["ff_out"]
        return HeadLinear(head.weight, head.bias, scale) if type(head) is nn.Linear else None

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                past_key_values: KVCache | None = None, use_cache: bool = False,
                logits_to_keep: int | Tensor | None = None, compute_logits: bool = True) -> BackboneOutput:
        """The backbone contract of ddrl.models.native.base.

        logits_to_keep: None or 0 = every position; k > 0 = the last k; a 1-D index tensor = those
        positions; a 2-D [B, K] one = each row's own. compute_logits=False: hidden states only.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        past_len = check_past(past_key_values, self.config.n_layers, B)
        check_ids(input_ids, self.config.embedding_size, "embedding_size")
        explicit, valid, positions = attention_inputs(attention_mask, position_ids, B, T, past_len, input_ids.device)
        if explicit is not None:
            mask = finish_mask(explicit)
        elif valid is not None:  # used as given, all ones included: asking would read the device every call
            mask = finish_mask(valid[:, None, None, :])  # [B, 1, 1, T_keys]
        else:
            mask = None  # no mask given: the hub code's unmasked call (and SDPA's fastest kernel)

        x = self.model.transformer["wte"](input_ids)  # [B, T, D]
        if self.config.input_emb_norm:
            x = x * (self.config.d_model ** 0.5)
        x = self.emb_drop(x)
        cos, sin = self.rotary.at(positions, past_len + T)  # [B, 1, T, Dh]
        x, cache = run_layers(self.layers, x, self.rotary, cos, sin, mask, past_key_values=past_key_values,
                              use_cache=use_cache,
                              checkpointing=self.checkpointing_now)
        hidden = self.model.transformer["ln_f"](x)  # [B, T, D]
        return BackboneOutput(logits=head_output(self.lm_head, hidden, logits_to_keep, compute_logits),
                              past_key_values=cache, hidden_states=hidden)

    # ------------------------------------------------------------------ the official directory layout

    @classmethod
    def from_pretrained(cls, directory: str | Path, *, device: torch.device | str | None = None,
                        dtype: torch.dtype | None = None) -> "LLaDABackbone":
        """config.json + (sharded) safetensors in the authors' names -> backbone; dtype None keeps the stored one."""
        path = Path(directory)
        config = cls.config_class.from_dict(read_config(path), source=str(path / "config.json"))
        with torch.device("meta"):
            model = cls(config)
        names = weight_names(path) - ({LM_HEAD} if config.weight_tying else set())
        check_weight_names(path, cls.family, names, set(model.state_dict()))  # before any tensor is read
        state = read_weights(path)
        if config.weight_tying:
            state.pop(LM_HEAD, None)  # a tied checkpoint may list the head under both names
        try:
            model.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as e:  # shapes that disagree with config.json
            raise ModelDirectoryError(f"the weights in {str(path)!r} do not fit its config.json: {e}") from None
        return model.to(device=device, dtype=dtype)

    def save_pretrained(self, directory: str | Path, state_dict: dict[str, Tensor] | None = None) -> None:
        """Write config.json (the fields as read) and the weights in the official names."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        fields = self.config.fields or {"model_type": self.config.model_type}
        (path / "config.json").write_text(json.dumps(fields, indent=2) + "\n")
        write_weights(path, state_dict if state_dict is not None else self.state_dict())


@NATIVE_FAMILIES.register("mmada")
class MMaDABackbone(LLaDABackbone):
    """MMaDA (config model_type "mmada", MMadaModelLM): the LLaDA backbone over text + image-codebook ids.

    Its image codes start after the tokenizer (ddrl.models.families.image_token_range)."""

    family: ClassVar[str] = "mmada"
    config_class: ClassVar[type[LLaDAConfig]] = MMaDAConfig
