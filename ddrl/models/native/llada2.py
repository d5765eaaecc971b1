"""LLaDA2.0 / LLaDA2.1: the native block-diffusion MoE backbone (ddrl.models.native.base has the contract).

LLaDA2.0-mini / LLaDA2.1-mini (inclusionAI, 2025-26; 16B parameters, ~1.4B active) and their "flash"
siblings: `LLaDA2MoeModelLM`, config.json model_type "llada2_moe". Numerics follow the hub's
modeling_llada2_moe.py (yjyddq/DARE @ 83ae8a3 models/LLaDA2.{0,1}-mini; the two files differ only
in generate(), see ddrl.sampling.llada2):

  * pre-norm decoder layers; RMSNorm as transformers' (float32 inside, weight * x.to(dtype));
  * attention: one fused `query_key_value` projection split into H query, H_kv key and H_kv value
    heads (GQA), an RMSNorm on each query and key head (query_layernorm / key_layernorm, before
    RoPE), partial rotary embedding on the first head_dim * partial_rotary_factor dims (rotate_half
    on those, the rest passed through), output projection `dense`;
  * MLP: the first `first_k_dense_replace` layers dense SwiGLU (intermediate_size), the others a
    mixture of experts: `num_experts` routed SwiGLU experts (moe_intermediate_size) of which
    `num_experts_per_tok` per token, plus `num_shared_experts` always-on experts fused into one
    SwiGLU of moe_intermediate_size * num_shared_experts;
  * the router (`mlp.gate`), in float32 whatever the model's dtype:

        s      = sigmoid(h W_r^T)                                         [N, E]
        group  = sum of the top-2 of (s + expert_bias) inside each of n_group groups
        keep the topk_group best groups; idx = top-k of (s + expert_bias) over their experts
        w      = s[idx] / (sum s[idx] + 1e-20) * routed_scaling_factor    (k > 1; else s[idx] * factor)

    expert_bias only chooses (auxiliary-loss-free balancing, DeepSeek-V3), the weights use s;
  * untied lm_head; logits returned in float32 (their forward casts them).

Their code reads neither norm_topk_prob (it always normalises when k > 1) nor
moe_router_enable_expert_bias, use_qk_norm, use_rmsnorm (always on); neither does this module.

**Experts are batched**: the (token, slot) pairs are sorted by expert, each expert runs once on its
contiguous slice (one host read per layer for the slice sizes), and the outputs are gathered back
and mixed with the router weights (WeightedSlots: the modeling file's float32 weighting, with a
backward that holds a [T, d] float32 slot at a time where autograd held two [T, k, d] ones); no
Python loop over tokens. Every expert is called, with an
empty slice when no token chose it, so every parameter is in the graph (DDP, FSDP2).

**The block layout** is ddrl.processes.block's (block = position // block_size, prompt included,
block-causal, bidirectional inside a block): the 0 / -inf mask LLaDA2.0's generate() builds, over
positions counted on real tokens. config.json names no block size; it is read, in order, from
config.json "block_size", the "ddrl" section of a ddrl save, generation_config.json "block_length",
else 32 (the block_length of both modeling files' generate()). LLaDA2.1 is told from 2.0 (same
config.json) by `is_token_editing`: its sampler edits tokens (ddrl.sampling.llada2).

Where this module differs from theirs: given only a 2-D padding mask (or none) their forward is
causal (transformers' _prepare_4d_causal_attention_mask), which is neither how the model is trained
nor how it is decoded; here a 2-D mask gives the block layout. A boolean 3-D/4-D mask is used as
given (their 4-D masks are additive floats; True here = 0 there).

**LoRA** (ddrl.models.lora; names = the checkpoint's): the attention's query_key_value / dense, the
dense layers' and the experts' gate_proj / up_proj / down_proj (shared and routed alike) are
nn.Linear and can be wrapped. The router `mlp.gate` is not an nn.Linear and is never wrapped: under
LoRA it is frozen with the rest of the base model; in full fine-tuning its weight trains (the
expert_bias is a buffer, never trained: the released models balance without an auxiliary loss, and so
does RL here unless method.moe_aux_loss_coef > 0, ddrl.models.moe_balance).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ddrl.models.io import ModelDirectoryError, read_json, write_json
from ddrl.models.native.base import (
    NATIVE_FAMILIES,
    BackboneOutput,
    KVCache,
    LayerCheckpointing,
    check_past,
    check_weight_names,
    head_output,
    read_config,
    read_weights,
    rotate_half,
    run_layers,
    weight_names,
    write_weights,
)
from ddrl.models.native.dream import DreamRMSNorm as LLaDA2RMSNorm  # transformers' RMSNorm, as theirs
from ddrl.models.native.qwen3 import additive_mask, rope_tables
from ddrl.models.native.sdar import SDARBackbone

MODEL_TYPE = "llada2_moe"
DEFAULT_BLOCK_SIZE = 32  # generate(block_length=32) in both hub modeling files
GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class LLaDA2Config:
    """The fields of a LLaDA2 config.json this module reads; `raw` keeps the whole file for saving."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int  # int(head_dim * partial_rotary_factor): the rotated leading dims of each head
    rms_norm_eps: float
    rope_theta: float
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    first_k_dense_replace: int
    use_qkv_bias: bool
    use_bias: bool
    tie_word_embeddings: bool
    pad_token_id: int | None
    block_size: int
    token_editing: bool = False  # LLaDA2.1: its generate() edits decoded tokens (ddrl.sampling.llada2)
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, block_size: int, token_editing: bool = False) -> "LLaDA2Config":
        if raw.get("model_type") != MODEL_TYPE:
            raise ModelDirectoryError(f"config.json has model_type {raw.get('model_type')!r}, not {MODEL_TYPE!r}; "
                                      f"load it with its own family")
        unsupported = {"hidden_act": raw.get("hidden_act", "silu") != "silu",
                       "rope_scaling": (raw.get("rope_scaling") or {}).get("rope_type", "default") != "default",
                       "use_sliding_window": bool(raw.get("use_sliding_window", False)),
                       "score_function": raw.get("score_function", "sigmoid") != "sigmoid",
                       "router_dtype": raw.get("router_dtype", "fp32") != "fp32"}
        bad = [name for name, is_bad in unsupported.items() if is_bad]
        if bad:
            raise ModelDirectoryError(f"config.json sets {', '.join(f'{n}={raw.get(n)!r}' for n in bad)}; the native "
                                      f"LLaDA2 backbone implements silu, default RoPE, full attention and the fp32 "
                                      f"sigmoid router (what the released LLaDA2.0/2.1 checkpoints use)")
        heads = int(raw["num_attention_heads"])
        head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // heads)
        experts = int(raw.get("num_experts") or 0)
        n_group = int(raw.get("n_group") or 1)
        if experts and (experts % n_group or experts // n_group < 2):
            raise ModelDirectoryError(f"config.json has num_experts={experts}, n_group={n_group}: the router ranks "
                                      f"groups by their top-2 experts, so each group needs >= 2 experts")
        return cls(
            vocab_size=int(raw["vocab_size"]), hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
            num_hidden_layers=int(raw["num_hidden_layers"]), num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads), head_dim=head_dim,
            rotary_dim=int(head_dim * float(raw.get("partial_rotary_factor", 0.5))),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)), rope_theta=float(raw.get("rope_theta", 10000.0)),
            num_experts=experts, num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
            num_shared_experts=int(raw.get("num_shared_experts") or 0), n_group=n_group,
            topk_group=int(raw.get("topk_group") or 1),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
            use_qkv_bias=bool(raw.get("use_qkv_bias", False)), use_bias=bool(raw.get("use_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), pad_token_id=raw.get("pad_token_id"),
            block_size=int(block_size), token_editing=token_editing, raw=dict(raw))


def is_token_editing(directory: Path, raw: dict[str, Any]) -> bool:
    """LLaDA2.1 or 2.0? Their config.json files are the same; 2.1's modeling file's generate() takes an
    editing_threshold (read as text, never run), or generation_config.json / the ddrl section names one."""
    generation = read_json(directory / GENERATION_CONFIG) if (directory / GENERATION_CONFIG).is_file() else {}
    if "editing_threshold" in generation or (raw.get("ddrl") or {}).get("token_editing"):
        return True
    code = directory / "modeling_llada2_moe.py"
    return code.is_file() and "editing_threshold" in code.read_text(errors="replace")


def stored_block_size(directory: Path, raw: dict[str, Any]) -> int:
    """The checkpoint's block size (module doc): config.json, its ddrl section, generation_config.json
    block_length, else 32."""
    generation = read_json(directory / GENERATION_CONFIG) if (directory / GENERATION_CONFIG).is_file() else {}
    value = (raw.get("block_size") or (raw.get("ddrl") or {}).get("block_size") or generation.get("block_length")
             or DEFAULT_BLOCK_SIZE)
    if isinstance(value, bool) or int(value) <= 0:
        raise ModelDirectoryError(f"{str(directory)!r}: block size {value!r} is not a positive int")
    return int(value)


# --------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------


class LLaDA2Attention(nn.Module):
    def __init__(self, cfg: LLaDA2Config):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.query_key_value = nn.Linear(cfg.hidden_size, (self.heads + 2 * self.kv_heads) * self.head_dim,
                                         bias=cfg.use_qkv_bias)
        self.query_layernorm = LLaDA2RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.key_layernorm = LLaDA2RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.dense = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=cfg.use_bias)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
                past: tuple[Tensor, Tensor] | None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        B, T, _ = h.shape
        qkv = self.query_key_value(h).view(B, T, self.heads + 2 * self.kv_heads, self.head_dim)
        q, k, v = (x.transpose(1, 2) for x in qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=2))
        q, k = partial_rope(self.query_layernorm(q), cos, sin), partial_rope(self.key_layernorm(k), cos, sin)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)  # [B, H_kv, T_past + T, Dh]
        groups = self.heads // self.kv_heads
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1),
                                             attn_mask=mask, scale=self.head_dim ** -0.5)  # [B, H, T, Dh]
        return self.dense(out.transpose(1, 2).reshape(B, T, -1)), (k, v)


def partial_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, T, Dh]; cos, sin [B, 1, T, R]: rotate the first R dims (rotate_half), pass the rest."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    return torch.cat([x_rot * cos + rotate_half(x_rot) * sin, x_pass], dim=-1)


class LLaDA2MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LLaDA2Router(nn.Module):
    """`mlp.gate`: sigmoid scores + expert bias, group-limited top-k, in float32 (module doc)."""

    moe_router = True  # ddrl.models.moe_balance finds it (method.moe_aux_loss_coef)
    expert_bias: Tensor  # [E] buffer, declared for the type checker

    def __init__(self, cfg: LLaDA2Config):
        super().__init__()
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.scaling = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts))

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """h [N, D] -> (expert ids [N, k] long, weights [N, k] float32, router logits [N, E] float32)."""
        logits = F.linear(h.float(), self.weight.float())  # [N, E]
        scores = torch.sigmoid(logits)
        idx = self.group_limited_topk(scores + self.expert_bias)  # the bias chooses, the scores weigh
        weights = scores.gather(1, idx)  # [N, k]
        if self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, weights * self.scaling, logits

    def group_limited_topk(self, scores: Tensor) -> Tensor:
        """scores [N, E] -> the top-k experts [N, k] among the topk_group groups whose top-2 sum is largest."""
        N, E = scores.shape
        grouped = scores.view(N, self.n_group, E // self.n_group)  # [N, G, E/G]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, G]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(
            1, group_scores.topk(self.topk_group, dim=-1, sorted=False).indices, True)  # [N, G]
        masked = grouped.masked_fill(~keep[..., None], float("-inf")).view(N, E)
        return masked.topk(self.top_k, dim=-1).indices


class LLaDA2SparseMoe(nn.Module):
    """Routed experts (batched by expert, module doc) + the shared expert."""

    def __init__(self, cfg: LLaDA2Config):
        super().__init__()
        self.experts = nn.ModuleList(LLaDA2MLP(cfg.hidden_size, cfg.moe_intermediate_size)
                                     for _ in range(cfg.num_experts))
        self.gate = LLaDA2Router(cfg)
        self.shared_experts = (LLaDA2MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts)
                               if cfg.num_shared_experts else None)

    def forward(self, x: Tensor) -> Tensor:
        B, T, D = x.shape
        flat = x.reshape(-1, D)  # [N, D]
        idx, weights, _ = self.gate(flat)  # [N, k]
        y = routed_experts(self.experts, flat, idx, weights).view(B, T, D)
        return y + self.shared_experts(x) if self.shared_experts is not None else y


def routed_experts(experts: nn.ModuleList, x: Tensor, idx: Tensor, weights: Tensor) -> Tensor:
    """x [N, D], idx / weights [N, k] -> sum_j weights[:, j] * expert_{idx[:, j]}(x)  [N, D].

    The N*k (token, slot) pairs are sorted by expert; each expert runs once on its contiguous slice. The
    outputs come back to (token, slot) order by a gather, which keeps only its index for backward (the
    modeling file's scatter, index_copy under autograd, keeps its source too); the gathered inputs and the
    expert-ordered outputs die with the statement (a no-grad pass, the rollout, holds no copy of them)."""
    N, k = idx.shape
    flat = idx.reshape(-1)  # [N*k]
    order = flat.argsort(stable=True)  # pair positions grouped by expert
    counts = torch.bincount(flat, minlength=len(experts)).tolist()  # one host read per layer
    back = torch.empty_like(order).scatter_(0, order, torch.arange(N * k, device=order.device))  # order's inverse
    slots = torch.cat([expert(piece) for expert, piece in zip(experts, x[order // k].split(counts))]).index_select(0, back)
    return WeightedSlots.apply(slots.view(N, k, -1), weights)


class WeightedSlots(torch.autograd.Function):
    """slots [N, k, D] (the experts' dtype), weights [N, k] float32 -> sum_j weights[:, j] slots[:, j] [N, D]
    in the slots' dtype, summed in float32: the modeling file's `.type(fp32).mul_(weights).sum(1).type(dtype)`,
    the same values. Autograd over those ops keeps the fp32 copy for the weights' gradient and makes two
    fp32 [N, k, D] gradients at once: 2 K d 4 bytes a token, an MoE block's backward peak (measured). Here
    the slots are kept in their own dtype and the backward works a slot at a time over [N, D] float32
    temporaries: the same products and sums."""

    @staticmethod
    def forward(ctx: Any, slots: Tensor, weights: Tensor) -> Tensor:
        ctx.save_for_backward(slots, weights)
        return slots.to(weights.dtype, copy=True).mul_(weights[..., None]).sum(dim=1).to(slots.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        slots, weights = ctx.saved_tensors
        g = grad.to(weights.dtype)  # [N, D]
        grad_slots = torch.empty_like(slots) if ctx.needs_input_grad[0] else None
        grad_weights = torch.empty_like(weights) if ctx.needs_input_grad[1] else None
        for j in range(slots.shape[1]):
            if grad_slots is not None:
                grad_slots[:, j] = g * weights[:, j, None]
            if grad_weights is not None:
                grad_weights[:, j] = (g * slots[:, j].to(weights.dtype)).sum(dim=-1)
        return grad_slots, grad_weights


class LLaDA2DecoderLayer(nn.Module):
    def __init__(self, cfg: LLaDA2Config, index: int):
        super().__init__()
        self.attention = LLaDA2Attention(cfg)
        moe = cfg.num_experts > 0 and index >= cfg.first_k_dense_replace
        self.mlp = LLaDA2SparseMoe(cfg) if moe else LLaDA2MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = LLaDA2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = LLaDA2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
                past: tuple[Tensor, Tensor] | None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        a, kv = self.attention(self.input_layernorm(h), cos, sin, mask, past)
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h)), kv


class LLaDA2Trunk(nn.Module):
    """The `model.` prefix of the weight names."""

    def __init__(self, cfg: LLaDA2Config):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.layers = nn.ModuleList(LLaDA2DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = LLaDA2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# --------------------------------------------------------------------------------------------
# The backbone
# --------------------------------------------------------------------------------------------


@NATIVE_FAMILIES.register("llada2")
class LLaDA2Backbone(LayerCheckpointing, nn.Module):
    """LLaDA2MoeModelLM's parameters (model.*, lm_head) behind ddrl's backbone contract."""

    def __init__(self, config: LLaDA2Config):
        super().__init__()
        self.config = config
        self.model = LLaDA2Trunk(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.word_embeddings.weight

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.word_embeddings

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    # The block layout from a 2-D mask, an explicit boolean mask as given: SDAR's rule, the same layout.
    _attention = SDARBackbone._attention

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                past_key_values: KVCache | None = None, use_cache: bool = False,
                logits_to_keep: int | Tensor | None = None, compute_logits: bool = True) -> BackboneOutput:
        """input_ids [B, T] -> float32 logits [B, T, V] (base module doc for the arguments)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        past_len = check_past(past_key_values, len(self.layers), B)
        # SDARBackbone's method, borrowed: it reads only self.config.block_size, which LLaDA2's config has
        mask, positions = self._attention(attention_mask, position_ids, B, T, past_len, input_ids.device)  # type: ignore[misc]
        h = self.model.word_embeddings(input_ids)  # [B, T, D]
        cos, sin = self._rotary(positions, h.dtype)
        h, cache = run_layers(self.layers, h, cos, sin, additive_mask(mask, h.dtype), past_key_values=past_key_values,
                              use_cache=use_cache, checkpointing=self.checkpointing_now)
        hidden = self.model.norm(h)  # [B, T, D]
        logits = head_output(self.lm_head, hidden, logits_to_keep, compute_logits)
        return BackboneOutput(logits=None if logits is None else logits.float(), past_key_values=cache,
                              hidden_states=hidden)

    def _rotary(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [B, T] -> cos, sin [B, 1, T, R]: transformers' default RoPE over R = rotary_dim dims."""
        dim = self.config.rotary_dim
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64,
                                                                   device=positions.device).float() / dim))
        return rope_tables(positions.float()[..., None] * inv_freq, dtype)  # angles [B, T, R/2]

    # ------------------------------------------------------------------ persistence (official layout)

    def official_weight_names(self) -> set[str]:
        names = set(self.state_dict())
        return names - {"lm_head.weight"} if self.config.tie_word_embeddings else names

    @classmethod
    def from_pretrained(cls, directory: str | Path, *, device: torch.device | str | None = None,
                        dtype: torch.dtype | None = None, block_size: int | None = None) -> "LLaDA2Backbone":
        """Read a LLaDA2 hub directory (config.json + sharded safetensors); runs none of its code.
        block_size: must agree with the checkpoint's (module doc) when given."""
        path = Path(directory)
        raw = read_config(path)
        stored = stored_block_size(path, raw)
        if block_size is not None and int(block_size) != stored:
            raise ValueError(f"block_size={block_size} contradicts {str(path)!r}'s block size {stored}; drop it")
        config = LLaDA2Config.from_dict(raw, block_size=stored, token_editing=is_token_editing(path, raw))
        with torch.device("meta"):
            model = cls(config)
        got = weight_names(path) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
        check_weight_names(path, MODEL_TYPE, got, model.official_weight_names())  # before any tensor is read
        state = read_weights(path)
        if dtype is not None:
            state = {k: v.to(dtype) for k, v in state.items()}
        try:
            model.load_state_dict(state, strict=not config.tie_word_embeddings, assign=True)
        except RuntimeError as e:  # shapes that disagree with config.json
            raise ModelDirectoryError(f"the weights in {str(path)!r} do not fit its config.json: {e}") from e
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.word_embeddings.weight
        return model.to(device) if device is not None else model

    def save_pretrained(self, directory: str | Path, state_dict: dict[str, Tensor] | None = None) -> None:
        """config.json (every field of the loaded one) + safetensors with the official names
        (sharded with an index past 5 GB, as the hub's) + generation_config.json with the block
        length (and, for LLaDA2.1, editing_threshold: is_token_editing reads it back)."""
        state = dict(self.state_dict() if state_dict is None else state_dict)
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        write_json(directory / "config.json", self.config.raw)
        write_weights(directory, state)
        # what tells this checkpoint's decoding, kept by a save (its modeling file is not copied)
        generation: dict[str, Any] = {"pad_token_id": self.config.pad_token_id, "block_length": self.config.block_size}
        if self.config.token_editing:
            generation["editing_threshold"] = 0.9  # LLaDA2.1's generate() default
        write_json(directory / GENERATION_CONFIG, generation)
