"""The built-in denoiser: a small bidirectional (or block-causal) transformer.

A LLaMA-shaped stack, minus the causal mask: pre-norm RMSNorm, rotary position embeddings,
SwiGLU MLP, attention through torch's scaled_dot_product_attention. Module names follow LLaMA
(q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) so LoRA target lists written
for Hugging Face models apply unchanged.

Masked diffusion LMs (LLaDA, MDLM) attend in both directions. Block diffusion (BD3-LM, SDAR)
attends block-causally: a token in block b sees every token of blocks <= b, which makes a KV
cache of the finished blocks exact. Both are one model here, switched by `block_size`.

Positions come from the attention mask (cumsum - 1), so a left-padded prompt has the same
positions, and hence the same logits on its real tokens, as the unpadded one.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ddrl.processes.block import block_layout_mask
from ddrl.models.native.base import head_output
from ddrl.models.io import (CONFIG_FILE, WEIGHTS_FILE, ModelDirectoryError, check_model_dir, read_json,
                            read_safetensors, write_json)

MODEL_TYPE = "ddrl_denoiser"  # config.json "model_type" of a built-in model directory


def _skip_init(cls: type, *args: Any, **kwargs: Any) -> nn.Module:
    """nn.utils.skip_init on the current default device: under `with torch.device("meta")` (a rank
    that receives its weights by broadcast, ddrl.training.checkpoint.load_model_on_rank0) the module
    holds no memory; elsewhere the CPU, as before."""
    return nn.utils.skip_init(cls, *args, device=torch.get_default_device(), **kwargs)


NORM_EPS = 1e-5

KVCache = list[tuple[Tensor, Tensor]]  # per layer (k, v), each [B, H, T_past, Dh]


def swiglu_hidden(d_model: int, mult: float = 8 / 3) -> int:
    """SwiGLU width: mult * d_model rounded to a multiple of 8 (8/3 keeps the parameter count of a 4x GELU MLP)."""
    return max(8, 8 * round(mult * d_model / 8))


@dataclass
class DenoiserConfig:
    vocab_size: int  # output classes = input token ids [0, vocab_size)
    d_model: int = 128  # residual width
    n_layers: int = 4  # transformer blocks
    n_heads: int = 4  # attention heads; d_model / n_heads must be even (rotary pairs)
    ffn_hidden: int | None = None  # SwiGLU hidden width; None = a multiple of 8 near 8/3 * d_model
    max_seq_len: int = 256  # longest sequence (cached + new tokens) accepted
    block_size: int | None = None  # None = full bidirectional attention; else block-causal attention
    rope_theta: float = 10000.0  # rotary base
    dropout: float = 0.0  # attention and residual dropout (training only)
    init_std: float = 0.02  # std of every weight init, embeddings included (std 1.0 stalled training)
    tie_embeddings: bool = False  # share the input embedding with the output projection

    def __post_init__(self) -> None:
        if self.ffn_hidden is None:
            self.ffn_hidden = swiglu_hidden(self.d_model)
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "ffn_hidden", "max_seq_len"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"DenoiserConfig.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"DenoiserConfig.d_model={self.d_model} must split into n_heads={self.n_heads} heads of even width "
                f"(rotary embeddings rotate pairs); pick d_model divisible by 2 * n_heads"
            )
        if self.block_size is not None and self.block_size <= 0:
            raise ValueError(f"DenoiserConfig.block_size must be positive or None, got {self.block_size}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"DenoiserConfig.dropout must be in [0, 1), got {self.dropout}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DenoiserConfig":
        """Build from a config.json dict; keys that are not fields (model_type, ddrl, ...) are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class DenoiserOutput:
    logits: Tensor | None  # [B, T, V] (or [B, K, V] with logits_to_keep); None with compute_logits=False
    past_key_values: KVCache | None = None  # per layer (k, v) [B, H, T_past + T, Dh] when use_cache
    hidden_states: Tensor | None = None  # [B, T, D] after the final norm (what lm_head reads)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate channel pairs (i, i + Dh/2) by the position angle. x [B, H, T, Dh]; cos, sin [B, 1, T, Dh]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: DenoiserConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.dropout = cfg.dropout
        # skip_init: parameters are filled once, from an explicit generator, by Denoiser.reset_parameters.
        make = lambda: _skip_init(nn.Linear, cfg.d_model, cfg.d_model, bias=False)  # noqa: E731
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = make(), make(), make(), make()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
                past: tuple[Tensor, Tensor] | None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        B, T, D = x.shape
        heads = lambda t: t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # noqa: E731  [B, H, T, Dh]
        q = apply_rotary(heads(self.q_proj(x)), cos, sin)
        k = apply_rotary(heads(self.k_proj(x)), cos, sin)
        v = heads(self.v_proj(x))
        if past is not None:  # cached keys were stored already rotated
            k = torch.cat([past[0], k], dim=2)  # [B, H, T_past + T, Dh]
            v = torch.cat([past[1], v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, D)), (k, v)


class SwiGLU(nn.Module):
    def __init__(self, cfg: DenoiserConfig):
        super().__init__()
        hidden = cfg.ffn_hidden
        self.gate_proj = _skip_init(nn.Linear, cfg.d_model, hidden, bias=False)
        self.up_proj = _skip_init(nn.Linear, cfg.d_model, hidden, bias=False)
        self.down_proj = _skip_init(nn.Linear, hidden, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DenoiserLayer(nn.Module):
    def __init__(self, cfg: DenoiserConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=NORM_EPS)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=NORM_EPS)
        self.mlp = SwiGLU(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
                past: tuple[Tensor, Tensor] | None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        a, kv = self.attn(self.attn_norm(h), cos, sin, mask, past)
        h = h + self.drop(a)
        h = h + self.drop(self.mlp(self.mlp_norm(h)))
        return h, kv


class Denoiser(nn.Module):
    """input_ids [B, T] -> logits [B, T, V] for every position (the clean token there)."""

    supports_gradient_checkpointing = True

    def __init__(self, config: DenoiserConfig, *, seed: int = 0):
        super().__init__()
        self.config = config
        self.embed_tokens = _skip_init(nn.Embedding, config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(DenoiserLayer(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.d_model, eps=NORM_EPS)
        self.lm_head = _skip_init(nn.Linear, config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.gradient_checkpointing = False
        self.reset_parameters(seed)

    def reset_parameters(self, seed: int = 0) -> None:
        """Normal(0, init_std) weights from a generator seeded with `seed` (global RNG untouched).

        The projections that write into the residual stream (o_proj, down_proj) are scaled by
        1/sqrt(2 * n_layers), as in GPT-2, so the residual variance does not grow with depth.
        """
        g = torch.Generator().manual_seed(seed)
        std = self.config.init_std
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                elif name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.copy_(torch.randn(p.shape, generator=g) * (std / math.sqrt(2 * self.config.n_layers)))
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)

    # ------------------------------------------------------------------ gradient checkpointing

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        """Recompute each layer's activations in backward (same signature as Hugging Face's)."""
        self.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.gradient_checkpointing = False

    # ------------------------------------------------------------------ forward

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                past_key_values: KVCache | None = None, use_cache: bool = False,
                logits_to_keep: int | Tensor | None = None, compute_logits: bool = True) -> DenoiserOutput:
        """The backbone contract of ddrl.models.native.base.

        input_ids:       [B, T] long, the new tokens.
        attention_mask:  None (attend everything allowed by block_size); [B, T_past + T] with
                         1 = real token, 0 = padding; or a boolean [B, T, T_past + T] /
                         [B, 1, T, T_past + T] (True = may attend), used exactly as given.
        position_ids:    [B, T]; default from the 2-D mask (cumsum - 1), else T_past + arange(T).
        past_key_values: per layer (k, v) [B, H, T_past, Dh] from an earlier call with use_cache.
        logits_to_keep:  None / 0: logits at every position; an int K: the last K; a 1-D long tensor:
                         those positions; a 2-D [B, K] one: each row's own (only they go through lm_head).
        compute_logits:  False: skip lm_head (logits None); the caller scores hidden_states itself.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        past_len = self._check_cache(past_key_values, B)
        self._check_ids(input_ids)
        mask, positions = self._attention(attention_mask, position_ids, B, T, past_len, input_ids.device)
        self._check_length(positions)

        h = self.embed_tokens(input_ids)  # [B, T, D]
        cos, sin = self._rotary(positions, h.dtype)
        cache: KVCache = []
        for i, layer in enumerate(self.layers):
            past = past_key_values[i] if past_key_values else None
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                h, kv = checkpoint(layer, h, cos, sin, mask, past, use_reentrant=False)
            else:
                h, kv = layer(h, cos, sin, mask, past)
            if use_cache:
                cache.append(kv)
        hidden = self.norm(h)  # [B, T, D]
        logits = head_output(self.lm_head, hidden, logits_to_keep, compute_logits)  # [B, T or K, V]
        return DenoiserOutput(logits=logits, past_key_values=cache if use_cache else None, hidden_states=hidden)

    def _check_cache(self, past_key_values: KVCache | None, batch: int) -> int:
        if not past_key_values:
            return 0
        if len(past_key_values) != self.config.n_layers:
            raise ValueError(
                f"past_key_values has {len(past_key_values)} layers, the model has n_layers={self.config.n_layers}; "
                f"pass the cache returned by this model with use_cache=True"
            )
        k = past_key_values[0][0]
        expected = (batch, self.config.n_heads, k.shape[2], self.config.d_model // self.config.n_heads)
        if tuple(k.shape) != expected:
            raise ValueError(f"past_key_values keys have shape {tuple(k.shape)}, expected [B, H, T_past, Dh] = {expected}")
        return k.shape[2]

    def _check_length(self, positions: Tensor) -> None:
        # The limit is on the positions the tokens occupy, not on how many tokens are fed: the
        # staircase ELBO feeds a clean and a noisy copy of the sequence at the same positions.
        span = int(positions.max()) + 1 if positions.numel() else 0
        if span > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {span} (cached + new tokens, by position) exceeds "
                f"max_seq_len={self.config.max_seq_len}; shorten the prompt or generation, or build the model "
                f"with a larger max_seq_len"
            )

    def _check_ids(self, input_ids: Tensor) -> None:
        if ((input_ids < 0) | (input_ids >= self.config.vocab_size)).any():
            raise ValueError(
                f"input_ids hold ids outside [0, vocab_size={self.config.vocab_size}) "
                f"(min {int(input_ids.min())}, max {int(input_ids.max())}); encode with this model's tokenizer"
            )

    def _attention(self, attention_mask: Tensor | None, position_ids: Tensor | None, B: int, T: int, past_len: int,
                   device: torch.device) -> tuple[Tensor | None, Tensor]:
        """-> (boolean mask broadcastable to [B, H, T, T_keys] or None, query positions [B, T])."""
        T_keys = past_len + T
        key_valid = explicit = None
        if attention_mask is None or attention_mask.dim() != 2:
            key_pos = torch.arange(T_keys, device=device).expand(B, T_keys)
        else:
            if tuple(attention_mask.shape) != (B, T_keys):
                raise ValueError(
                    f"attention_mask has shape {tuple(attention_mask.shape)}, expected [B, T_past + T] = {(B, T_keys)}"
                )
            key_valid = attention_mask.bool()
            key_pos = (key_valid.long().cumsum(1) - 1).clamp(min=0)  # left padding does not shift positions
        if attention_mask is not None and attention_mask.dim() in (3, 4):
            explicit = attention_mask if attention_mask.dim() == 4 else attention_mask[:, None]
            if explicit.dtype != torch.bool or explicit.shape[0] != B or explicit.shape[-2:] != (T, T_keys):
                raise ValueError(
                    f"a 3-D/4-D attention_mask must be boolean [B, (1,) T, T_past + T] = [{B}, {T}, {T_keys}], "
                    f"got {attention_mask.dtype} {tuple(attention_mask.shape)}"
                )
        elif attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(f"attention_mask must be 2-D, 3-D or 4-D, got shape {tuple(attention_mask.shape)}")
        if position_ids is not None:
            if tuple(position_ids.shape) not in ((B, T), (1, T)):
                raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}, expected [B, T] = {(B, T)}")
            key_pos = torch.cat([key_pos[:, :past_len], position_ids.to(device).expand(B, T)], dim=1)
        query_pos = key_pos[:, past_len:]  # [B, T]

        allowed: Tensor | None
        if explicit is not None:
            allowed = explicit
        else:
            allowed = None if key_valid is None else key_valid[:, None, None, :]  # [B, 1, 1, T_keys]
            if self.config.block_size is not None:  # ddrl.processes.block's layout, the one every caller uses
                valid = torch.ones_like(key_pos, dtype=torch.bool) if key_valid is None else key_valid
                allowed = block_layout_mask(key_pos, valid, self.config.block_size, query_pos)  # [B, 1, T, T_keys]
        if allowed is not None:
            # A query with no key to attend (an all-padding row) would softmax over nothing -> NaN,
            # which poisons losses even when multiplied by 0. Let such rows attend everything: their
            # output is padding and is never read.
            allowed = allowed | ~allowed.any(dim=-1, keepdim=True)
        return allowed, query_pos

    def _rotary(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [B, T] -> cos, sin [B, 1, T, Dh]. Computed in float32 (bf16 angles are too coarse)."""
        head_dim = self.config.d_model // self.config.n_heads
        inv_freq = self.config.rope_theta ** (
            -torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
        )
        angles = positions.float()[..., None] * inv_freq  # [B, T, Dh/2]
        angles = torch.cat([angles, angles], dim=-1)[:, None]  # [B, 1, T, Dh]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    # ------------------------------------------------------------------ persistence (Hugging Face layout)

    def save_pretrained(self, directory: str | Path) -> None:
        """Write config.json + model.safetensors into `directory` (not atomic; DiffusionLM's save is)."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        write_json(path / CONFIG_FILE, {"model_type": MODEL_TYPE, "architectures": ["Denoiser"],
                                        **dataclasses.asdict(self.config)})
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        if self.config.tie_embeddings:
            del state["lm_head.weight"]  # safetensors refuses shared storage; re-tied on load
        save_file(state, str(path / WEIGHTS_FILE), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, directory: str | Path, *, device: torch.device | str | None = None,
                        dtype: torch.dtype | None = None) -> "Denoiser":
        path = check_model_dir(directory)
        data = read_json(path / CONFIG_FILE)
        if data.get("model_type") != MODEL_TYPE:
            raise ModelDirectoryError(
                f"{str(path)!r} holds a {data.get('model_type')!r} model, not a built-in {MODEL_TYPE!r}; "
                f"load it with ddrl.load_model"
            )
        model = cls(DenoiserConfig.from_dict(data))
        state = read_safetensors(path / WEIGHTS_FILE)  # headers only under torch.device("meta")
        if model.config.tie_embeddings and "embed_tokens.weight" in state:
            state["lm_head.weight"] = state["embed_tokens.weight"]
        expected = set(model.state_dict())
        if set(state) != expected:
            raise ModelDirectoryError(
                f"weights in {str(path / WEIGHTS_FILE)!r} do not match its config.json "
                f"(missing: {sorted(expected - set(state))}, unexpected: {sorted(set(state) - expected)}); "
                f"the checkpoint is damaged, use another one"
            )
        try:
            model.load_state_dict(state)
        except RuntimeError as e:  # shapes that disagree with config.json
            raise ModelDirectoryError(f"weights in {str(path / WEIGHTS_FILE)!r} do not fit its config.json: {e}") from None
        return model.to(device=device, dtype=dtype)
