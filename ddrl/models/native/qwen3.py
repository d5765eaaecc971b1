"""The Qwen3 decoder: the layers SDAR/TraDo (ddrl.models.native.sdar) and URSA (ddrl.models.native.ursa)
share, with module names = the checkpoints' weight names (`model.embed_tokens`, `model.layers.N.{self_attn,
mlp, input_layernorm, post_attention_layernorm}`, `model.norm`).

Qwen3's layer: pre-norm, grouped-query attention with an RMSNorm on each query and key head (q_norm /
k_norm, before RoPE), SwiGLU MLP. Numerics are those of flash-attn's kernels, which both families'
reference code runs on GPU:
  * RMSNorm is flash-attn's Triton rms_norm_fn: x and the weight in float32, y = x / sqrt(mean(x^2)
    + eps) * w, cast to x's dtype at the end (not transformers' weight * norm(x).to(dtype), which rounds
    to bf16 before the weight multiply); in float32 the two are the same function;
  * RoPE: the caller gives cos/sin [B, 1, T, Dh] (1-D positions for SDAR, URSA's 3-D ones), applied to
    the halves of each head (rotate_half) in the activations' dtype;
  * attention: scaled_dot_product_attention with an additive mask (0 where allowed, finfo.min
    elsewhere) over the K/V heads repeated to the query heads.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ddrl.models.native.base import rotate_half


class Qwen3Dims(Protocol):
    """The config fields the layers read (SDARConfig and URSAConfig have them). Read-only properties,
    so that frozen dataclasses satisfy it."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def intermediate_size(self) -> int: ...

    @property
    def num_hidden_layers(self) -> int: ...

    @property
    def num_attention_heads(self) -> int: ...

    @property
    def num_key_value_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def rms_norm_eps(self) -> float: ...

    @property
    def attention_bias(self) -> bool: ...

    @property
    def pad_token_id(self) -> int | None: ...


class Qwen3RMSNorm(nn.Module):
    """flash-attn's rms_norm_fn: float32 inside, weight applied in float32, one cast at the end."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        rstd = 1 / torch.sqrt(xf.square().mean(dim=-1, keepdim=True) + self.eps)
        return (xf * rstd * self.weight.float()).to(x.dtype)


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: Qwen3Dims):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.groups = cfg.num_attention_heads // cfg.num_key_value_heads
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = Qwen3RMSNorm(cfg.head_dim, cfg.rms_norm_eps)  # per head, before RoPE (Qwen3)
        self.k_norm = Qwen3RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
                past: tuple[Tensor, Tensor] | None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        B, T, _ = h.shape
        q = self.q_norm(self.q_proj(h).view(B, T, -1, self.head_dim)).transpose(1, 2)  # [B, H, T, Dh]
        k = self.k_norm(self.k_proj(h).view(B, T, -1, self.head_dim)).transpose(1, 2)  # [B, H_kv, T, Dh]
        v = self.v_proj(h).view(B, T, -1, self.head_dim).transpose(1, 2)  # [B, H_kv, T, Dh]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)  # [B, H_kv, T_past + T, Dh]
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(self.groups, dim=1),
                                             v.repeat_interleave(self.groups, dim=1), attn_mask=mask,
                                             scale=self.head_dim ** -0.5)  # [B, H, T, Dh]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1)), (k, v)


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: Qwen3Dims):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Dims):
        super().__init__()
        self.self_attn = Qwen3Attention(cfg)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
                past: tuple[Tensor, Tensor] | None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        a, kv = self.self_attn(self.input_layernorm(h), cos, sin, mask, past)
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h)), kv


class Qwen3Decoder(nn.Module):
    """The `model.` prefix of the checkpoint's weight names: embeddings, layers, final norm."""

    def __init__(self, cfg: Qwen3Dims):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = Qwen3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def additive_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """Boolean [B, 1, T, T_keys] (True = attend) -> the additive float mask the layers take."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def rope_tables(angles: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Rotation angles [B, T, Dh/2] (float32) -> cos, sin [B, 1, T, Dh] in `dtype`, for rotate_half."""
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # [B, 1, T, Dh]
    return angles.cos().to(dtype), angles.sin().to(dtype)
