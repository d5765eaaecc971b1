"""Dream (Ye et al. 2025, "Dream 7B: Diffusion Large Language Models"): Dream-v0-Base/Instruct-7B,
Dream-Coder-7B and DiffuCoder-7B (Gong et al. 2025) share this backbone.

Dream is Qwen2.5 with the causal mask removed: pre-norm RMSNorm, RoPE, grouped-query attention with
biased q/k/v projections, SwiGLU MLP. It is initialised from an AR model and keeps the AR alignment,
so its raw logits are shifted (position i predicts token i + 1); the backbone returns them raw, as
the authors' model does, and ddrl.models.DiffusionLM(logits_shifted=True) realigns them.

What is reproduced from the authors' modeling_dream.py (the hub file; pinned copy ZHZisZZ/dllm @
03270de7, tests/fixtures/make_dream.py), with its per-op dtypes:
  * RMSNorm: x upcast to float32, x * rsqrt(mean(x^2) + eps), cast back, then times the weight.
  * RoPE: inv_freq = 1 / theta^(arange(0, Dh, 2) / Dh) in float32 (transformers' "default" rope),
    angles and cos/sin in float32, cast to the activations' dtype before rotating q and k.
  * Attention through torch's scaled_dot_product_attention (their DreamSdpaAttention, is_causal=False),
    k/v heads repeated for GQA, a boolean mask passed as given (True = attend).
  * nn.Embedding(padding_idx=pad_token_id): the pad row gets no gradient, as in their model (Dream's
    pad is its EOS, 151643).
Deviations (none changes a real position's logits):
  * Positions default to cumsum - 1 of a 2-D padding mask (base.attention_inputs), as Dream's own
    diffusion_generate passes them; their forward given only a 2-D mask numbers positions 0..T-1.
    RoPE scores depend on position differences, so the two agree on real tokens up to rounding.
  * Query rows that see no key (padding) attend everything (base.finish_mask) instead of giving 0;
    their outputs are padding, never read.
  * inv_freq is recomputed in float32 on every call: their buffer would be rounded if the module
    were cast with .to(bfloat16) (from_pretrained(torch_dtype=bfloat16) keeps it float32, as here).
  * Only rope_scaling = None ("default") and hidden_act = "silu" are supported, the values of every
    released Dream checkpoint; sliding-window fields are ignored, as their SDPA attention ignores them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ddrl.models.io import ModelDirectoryError
from ddrl.ops.value_checks import check_ids
from ddrl.models.native.base import (
    QwenStyleBackbone,
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

MODEL_TYPE = "Dream"  # config.json "model_type" of Dream, Dream-Coder and DiffuCoder checkpoints
LM_HEAD = "lm_head.weight"


@dataclass
class DreamConfig:
    """The config.json fields the forward reads, under the authors' names (DreamConfig's defaults
    where a field is absent). `raw` is the whole config.json, written back unchanged on save."""

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 32  # None = num_attention_heads (no GQA)
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    mask_token_id: int | None = 151666
    pad_token_id: int | None = 151643
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    hidden_act: str = "silu"
    rope_scaling: dict | None = None
    attention_dropout: float = 0.0
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str = "config.json") -> "DreamConfig":
        names = {f for f in cls.__dataclass_fields__ if f != "raw"}
        config = cls(**{k: v for k, v in data.items() if k in names}, raw=dict(data))
        if config.num_key_value_heads is None:
            config.num_key_value_heads = config.num_attention_heads
        config.validate(where)
        return config

    def validate(self, where: str) -> None:
        if self.hidden_size % self.num_attention_heads or self.head_dim % 2:
            raise ModelDirectoryError(f"{where}: hidden_size={self.hidden_size} must split into num_attention_heads="
                                      f"{self.num_attention_heads} heads of even width; the config is not a Dream one")
        if self.num_attention_heads % (self.num_key_value_heads or self.num_attention_heads):
            raise ModelDirectoryError(f"{where}: num_attention_heads={self.num_attention_heads} is not a multiple of "
                                      f"num_key_value_heads={self.num_key_value_heads}; fix the config")
        scaling = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        if scaling != "default":
            raise ModelDirectoryError(f"{where}: rope_scaling={self.rope_scaling!r} is not supported by ddrl's Dream "
                                      f"(released Dream checkpoints use none); remove it or load the model with "
                                      f"transformers")
        if self.hidden_act != "silu":
            raise ModelDirectoryError(f"{where}: hidden_act={self.hidden_act!r} is not supported by ddrl's Dream "
                                      f"(released checkpoints use 'silu')")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class DreamRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """positions [B, T] -> cos, sin [B, 1, T, Dh], computed as transformers' default rope in float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
                                / head_dim))  # [Dh/2]
    angles = positions.float()[..., None] * inv_freq  # [B, T, Dh/2] (their outer-product matmul, one term each)
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # [B, 1, T, Dh]
    return angles.cos().to(dtype), angles.sin().to(dtype)


class DreamAttention(nn.Module):
    def __init__(self, config: DreamConfig):
        super().__init__()
        # None = no GQA (from_dict resolves it; a DreamConfig built in code may still hold None)
        self.n_heads, self.n_kv = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
        self.head_dim = config.head_dim
        self.dropout = config.attention_dropout
        D = config.hidden_size
        self.q_proj = nn.Linear(D, self.n_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(D, self.n_kv * self.head_dim, bias=True)
        self.v_proj = nn.Linear(D, self.n_kv * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, D, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
                past: tuple[Tensor, Tensor] | None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        B, T, D = x.shape
        heads = lambda t, n: t.view(B, T, n, self.head_dim).transpose(1, 2)  # noqa: E731  [B, n, T, Dh]
        q = heads(self.q_proj(x), self.n_heads)
        k, v = heads(self.k_proj(x), self.n_kv), heads(self.v_proj(x), self.n_kv)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if past is not None:  # cached keys were stored rotated
            k = torch.cat([past[0], k], dim=2)  # [B, H_kv, T_past + T, Dh]
            v = torch.cat([past[1], v], dim=2)
        groups = self.n_heads // self.n_kv
        k_all = k.repeat_interleave(groups, dim=1) if groups > 1 else k  # [B, H, T_keys, Dh] (their repeat_kv)
        v_all = v.repeat_interleave(groups, dim=1) if groups > 1 else v
        if q.device.type == "cuda" and mask is not None:  # SDPA's memory-efficient kernel wants contiguous inputs
            q, k_all, v_all = q.contiguous(), k_all.contiguous(), v_all.contiguous()
        out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask,
                                             dropout_p=self.dropout if self.training else 0.0)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, D)), (k, v)


class DreamMLP(nn.Module):
    def __init__(self, config: DreamConfig):
        super().__init__()
        D, H = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(D, H, bias=False)
        self.up_proj = nn.Linear(D, H, bias=False)
        self.down_proj = nn.Linear(H, D, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DreamDecoderLayer(nn.Module):
    def __init__(self, config: DreamConfig):
        super().__init__()
        self.self_attn = DreamAttention(config)
        self.mlp = DreamMLP(config)
        self.input_layernorm = DreamRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DreamRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
                past: tuple[Tensor, Tensor] | None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        a, kv = self.self_attn(self.input_layernorm(h), cos, sin, mask, past)
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h)), kv


class DreamTrunk(nn.Module):
    """The `model.` prefix of the checkpoint's names: embed_tokens, layers, norm."""

    def __init__(self, config: DreamConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.layers = nn.ModuleList(DreamDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = DreamRMSNorm(config.hidden_size, config.rms_norm_eps)


@NATIVE_FAMILIES.register("dream")
class DreamBackbone(QwenStyleBackbone):
    """input_ids [B, T] -> raw (AR-shifted) logits [B, T, V], by the contract of ddrl.models.native.base."""

    def __init__(self, config: DreamConfig):
        super().__init__(config, DreamTrunk(config))

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                past_key_values: KVCache | None = None, use_cache: bool = False,
                logits_to_keep: int | Tensor | None = None, compute_logits: bool = True) -> BackboneOutput:
        """
        input_ids        [B, T] long, the new tokens.
        attention_mask   None | [B, T_past + T] padding mask (1 = real) | boolean [B, (1,) T, T_past + T].
        position_ids     [B, T]; default: counted over real tokens of the 2-D mask (base.attention_inputs).
        past_key_values  per layer (k, v) [B, H_kv, T_past, Dh], keys rotated, from a call with use_cache.
        logits_to_keep   None / 0: every position; int K: the last K; 1-D long tensor: those positions;
                         2-D [B, K]: each row's own positions.
        compute_logits   False: skip lm_head (logits None), hidden_states only.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        check_ids(input_ids, self.config.vocab_size, "vocab_size")
        past_len = check_past(past_key_values, len(self.layers), B)
        explicit, valid, positions = attention_inputs(attention_mask, position_ids, B, T, past_len, input_ids.device)
        if explicit is not None:
            mask = finish_mask(explicit)
        elif valid is not None:  # used as given, all ones included: asking would read the device every call
            mask = finish_mask(valid[:, None, None, :].expand(B, 1, T, past_len + T))
        else:
            mask = None  # no mask given: the authors' "full" path, and SDPA's fastest kernel

        h = self.model.embed_tokens(input_ids)  # [B, T, D]
        cos, sin = rotary(positions, self.config.head_dim, self.config.rope_theta, h.dtype)
        h, cache = run_layers(self.layers, h, cos, sin, mask, past_key_values=past_key_values, use_cache=use_cache,
                              checkpointing=self.checkpointing_now)
        hidden = self.model.norm(h)  # [B, T, D]
        return BackboneOutput(logits=head_output(self.lm_head, hidden, logits_to_keep, compute_logits),
                              past_key_values=cache, hidden_states=hidden)

    # ------------------------------------------------------------------ persistence (the hub layout)

    def expected_weight_names(self) -> set[str]:
        names = set(self.state_dict())
        return names - {LM_HEAD} if self.config.tie_word_embeddings else names

    def save_pretrained(self, directory: str | Path, state_dict: dict[str, Tensor] | None = None) -> None:
        """config.json (the loaded one, unchanged) + safetensors with the official weight names."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        raw = self.config.raw or {"model_type": MODEL_TYPE, "architectures": ["DreamModel"],
                                  **{k: v for k, v in vars(self.config).items() if k != "raw"}}
        (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        state = dict(self.state_dict() if state_dict is None else state_dict)
        if self.config.tie_word_embeddings:
            state.pop(LM_HEAD, None)  # the hub drops the tied head; from_pretrained re-ties it
        write_weights(path, state)

    @classmethod
    def from_pretrained(cls, directory: str | Path, *, device: torch.device | str | None = None,
                        dtype: torch.dtype | None = None) -> "DreamBackbone":
        """Build from a Dream checkpoint directory (config.json + safetensors); runs no code from it."""
        path = Path(directory)
        data = read_config(path)
        if data.get("model_type") != MODEL_TYPE:
            raise ModelDirectoryError(f"{str(path)!r} holds a {data.get('model_type')!r} model, not a Dream one "
                                      f"(config.json model_type {MODEL_TYPE!r}); pick the family that matches it")
        config = DreamConfig.from_dict(data, where=str(path / "config.json"))
        with torch.device("meta"):
            model = cls(config)
        names = weight_names(path) - ({LM_HEAD} if config.tie_word_embeddings else set())
        check_weight_names(path, "Dream", names, model.expected_weight_names())  # before any tensor is read
        state = read_weights(path)
        if config.tie_word_embeddings:
            state.pop(LM_HEAD, None)  # some tied checkpoints store the head anyway; the embedding is the one used
        try:
            model.load_state_dict(state, strict=False, assign=True)
        except RuntimeError as e:  # shapes that disagree with config.json
            raise ModelDirectoryError(f"the weights in {str(path)!r} do not fit its config.json: {e}") from None
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        return model.to(device=device, dtype=dtype)

