"""How the semi-autoregressive samplers call the model for one block: with or without a KV cache.

The samplers of ddrl.sampling.masked decode the completion block by block; inside a block every
step needs the logits of the block's positions [A, W, V]. Where those come from is a strategy,
picked once per call by `block_forward` from rollout.cache and the model's attention:

  FullForward       cache "none", full attention. Every step runs [prompt, completion] through the
                    model: LLaDA's reference, exactly (ALGORITHMS.md §1.2).
  ApproxBlockCache  cache "prefix" | "dual", full attention (Fast-dLLM, Wu et al. 2025; §1.8).
                    The block's first step runs the whole sequence with use_cache=True and keeps
                      prefix: the keys/values of every position before the block, and
                      suffix ("dual" only): those of every position after the block.
                    Later steps of the block feed
                      prefix: x[block_start:]  (the block and the still-masked suffix), past = prefix
                      dual:   x[block_start:block_end],                              past = prefix + suffix
                    Approximate: the cached keys/values are those of the block's first step and
                    do not see the tokens the block commits afterwards. Refreshed at every block.
  BlockCausalForward / ExactBlockCache   block-causal models (model.block_size set: SDAR, BD3-LM,
                    the built-in block denoiser). "none" runs the whole sequence every step; any
                    cache setting keeps the keys/values of the prompt and of every finished block
                    and feeds only the current block, which is EXACT there, because a block never
                    attends to later positions (the cache of a finished block is final).

**Block layout of block-causal models** (one place: ddrl.processes.block, used here, by the
staircase/blockwise ELBOs, by every estimator through the model's default, and by block
pretraining): block = position // block_size over each row's real tokens, prompt included, as
SDAR's own sampler counts them. A row whose prompt ends inside a block continues that block, so
its first sampler window holds fewer completion tokens. To keep one window loop for rows of
different prompt lengths, the masked sampler shifts each row's completion right by
`offset = n_prompt % block_size` slots (ddrl.sampling.masked): the first `offset` slots of the row
are empty (never attended, no position, never committed), so every window is one model block of
every row. The strategies here take those slots as `slots` [B, W] (True = a real completion slot).
The sampler passes the layout explicitly (a boolean [R, T_new, T_past + T_new] attention_mask and
position_ids counting real tokens). Sampler blocks must be unions of model blocks (block_length a
multiple of block_size) for the cache to be exact. In the first window, the prompt's last tokens
share the block with masked slots, so their keys change until the block is final: the exact cache
re-feeds them (from column P - max offset) with the window.

**Logits shifted by one** (Dream): DiffusionLM realigns them over each call's input, so the first
fed position gets no prediction of its own. Cached calls therefore start one token early (the
token before the block: prompt or previous block), and the cache ends before that token.

**What a model must do for the cache** (the built-in Denoiser does all of it):
  * accept `past_key_values` and `use_cache=True` and return `.past_key_values`: per layer a
    (key, value) pair of [R, H, T, Dh] tensors, position order, keys already rotated (RoPE); a
    transformers DynamicCache also works (4.x: to/from_legacy_cache; 5.x: iterated per layer and
    rebuilt with DynamicCache(ddp_cache_data=...)): the sampler slices the per-layer tensors and
    hands the model a new object of the same class each call;
  * attend to the given past whenever it is passed (use_cache only asks for the cache back);
  * take a 2-D attention_mask [R, T_past + T_new] over (cached keys, new tokens) in the order the
    cache lists them, position_ids [R, T_new] for the new tokens, and, for block-causal models, a
    boolean [R, T_new, T_past + T_new] mask used as given.
A model whose forward takes no past_key_values, or that returns none, is run without cache, with
a one-time warning (cost, not samples, changes: "prefix"/"dual" then give the reference tokens).
ddrl's native LLaDA, MMaDA, Dream and SDAR backbones (ddrl.models.native) do all of it, as does a
Hugging Face model through the "native" feed (a tiny causal LLaMA is tested); the "unpadded" feed
(opt-in, for remote code that ignores attention_mask) and DiffusionGemma return no cache and fall back.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
from torch import Tensor

from ddrl.processes.block import block_attention, position_ids_from_mask
from ddrl.sampling.utils import completion_logits, guided_logits

CACHE_MODES = ("none", "prefix", "dual", "auto")  # auto: the exact cache where it is exact, else none

Layers = list[tuple[Tensor, Tensor]]  # per layer (k, v), each [R, H, T, Dh]

_warned: set[str] = set()


# --------------------------------------------------------------------------------------------
# The model's cache format <-> per-layer (k, v) tensors
# --------------------------------------------------------------------------------------------


def cache_layers(past: Any) -> Layers | None:
    """The model's returned past_key_values -> per-layer (k, v) [R, H, T, Dh]; None when there is none."""
    if past is None:
        return None
    if hasattr(past, "to_legacy_cache"):  # transformers 4 Cache objects
        past = past.to_legacy_cache()
    layers = [(layer[0], layer[1]) for layer in past]  # transformers 5 DynamicCache yields (k, v, sliding)
    return layers or None


def as_model_cache(layers: Layers, like: Any) -> Any:
    """Per-layer (k, v) -> the format the model returned (`like`): a list, or a new Cache object of
    like's class (transformers 4: from_legacy_cache; transformers 5: DynamicCache(ddp_cache_data=...)).
    A new object every call: Hugging Face models append to the cache they are given."""
    if like is None or isinstance(like, (list, tuple)):
        return list(layers)
    if hasattr(like, "from_legacy_cache"):
        return type(like).from_legacy_cache(tuple(layers))
    if "ddp_cache_data" in inspect.signature(type(like).__init__).parameters:
        return type(like)(ddp_cache_data=list(layers))
    raise ValueError(f"cannot rebuild a {type(like).__name__} from per-layer keys/values; the KV cache needs a "
                     f"list of (k, v), a transformers DynamicCache, or rollout.cache=none")


def slice_layers(layers: Layers, lo: int, hi: int | None = None) -> Layers:
    """Keys/values of positions [lo, hi) of every layer."""
    return [(k[:, :, lo:hi], v[:, :, lo:hi]) for k, v in layers]


def cat_layers(first: Layers, second: Layers) -> Layers:
    return [(torch.cat([k1, k2], dim=2), torch.cat([v1, v2], dim=2)) for (k1, v1), (k2, v2) in zip(first, second)]


def select_rows(layers: Layers, index: Tensor) -> Layers:
    return [(k[index], v[index]) for k, v in layers]


def accepts_cache(model: Any) -> bool:
    """Whether model(...) can take past_key_values: an explicit parameter, or **kwargs that reach
    a backbone (DiffusionLM.model, ...) that takes it or **kwargs itself. The first cached call
    still checks that a cache comes back."""
    seen = 0
    while model is not None and seen < 8:
        forward = getattr(model, "forward", None) or getattr(model, "__call__", None)
        try:
            params = inspect.signature(forward).parameters
        except (TypeError, ValueError):
            return False
        if "past_key_values" in params:
            return True
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return False
        inner = getattr(model, "model", None)
        if inner is None or inner is model:
            return True  # **kwargs all the way down: let the first call tell
        model, seen = inner, seen + 1
    return False


def _warn_once(model: Any, why: str) -> None:
    key = f"{type(model).__name__}:{why}"
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"{type(model).__name__}: {why}; sampling without the KV cache (same tokens as "
                      f"rollout.cache=none, at the reference cost)", RuntimeWarning, stacklevel=3)


# --------------------------------------------------------------------------------------------
# Inputs of the running rows: [prompt, completion], conditional rows then unconditional ones
# --------------------------------------------------------------------------------------------


class _RowInputs:
    """The model input of the A running rows, stacked with their unconditional copy under guidance
    (R = 2A rows: cond, then uncond with every real prompt token replaced by mask_id)."""

    def __init__(self, prompt_ids: Tensor, prompt_mask: Tensor | None, rows: Tensor, *, cfg_scale: float,
                 mask_id: int, slots: Tensor | None = None):
        prompt = prompt_ids[rows]  # [A, P]
        self.slots = None if slots is None else slots[rows]  # [A, W] real completion slots
        valid = (torch.ones_like(prompt, dtype=torch.bool) if prompt_mask is None else prompt_mask[rows])
        if cfg_scale > 0:
            prompt = torch.cat([prompt, prompt.masked_fill(valid, mask_id)], dim=0)  # [2A, P]
            valid = torch.cat([valid, valid], dim=0)
        self.prompt, self.prompt_valid = prompt, valid  # [R, P]
        if self.slots is not None and cfg_scale > 0:
            self.slots = torch.cat([self.slots, self.slots], dim=0)
        self.cfg_scale = cfg_scale
        self.A, self.P = rows.numel(), prompt.shape[1]

    def ids(self, completion: Tensor) -> Tensor:
        """completion [A, L] -> [R, P + L]."""
        if self.cfg_scale > 0:
            completion = torch.cat([completion, completion], dim=0)
        return torch.cat([self.prompt, completion], dim=1)

    def key_valid(self, length: int) -> Tensor:
        """[R, P + length] bool: real prompt tokens and the completion's real slots."""
        if self.slots is not None:
            return torch.cat([self.prompt_valid, self.slots[:, :length]], dim=1)
        ones = torch.ones(self.prompt.shape[0], length, dtype=torch.bool, device=self.prompt.device)
        return torch.cat([self.prompt_valid, ones], dim=1)

    def index(self, live: Tensor) -> Tensor | None:
        """Indices into the R rows of the live rows (live: [A] bool); None when every row is live."""
        if bool(live.all()):
            return None
        idx = live.nonzero().squeeze(1)
        return torch.cat([idx, idx + self.A]) if self.cfg_scale > 0 else idx

    def guide(self, logits: Tensor) -> Tensor:
        """[R, W, V] -> [A, W, V] (or the live rows' [R', W, V] -> [A', W, V])."""
        if self.cfg_scale > 0:
            cond, uncond = logits.chunk(2, dim=0)
            return guided_logits(cond, uncond, self.cfg_scale)
        return logits


def _rows(x: Any, index: Tensor | None) -> Any:
    """x[index] for a tensor or per-layer (k, v); x itself when index is None (all rows)."""
    if index is None or x is None:
        return x
    return select_rows(x, index) if isinstance(x, list) else x[index]


def _call(model: Any, ids: Tensor, **kwargs: Any) -> Any:
    """model(ids, **kwargs) without the None-valued arguments (so plain models need not take them)."""
    return model(ids, **{k: v for k, v in kwargs.items() if v is not None})


# --------------------------------------------------------------------------------------------
# Strategies: begin_block(rows, start, end), then block_logits(step, completion) per step
# --------------------------------------------------------------------------------------------


class FullForward:
    """No cache, full attention: [prompt, completion] of the running rows every step (the reference)."""

    def __init__(self, model: Any, prompt_ids: Tensor, prompt_mask: Tensor | None, *, cfg_scale: float,
                 mask_id: int):
        self.model, self.prompt_ids, self.prompt_mask = model, prompt_ids, prompt_mask
        self.cfg_scale, self.mask_id = cfg_scale, mask_id
        self.forward_tokens = 0  # rows x tokens fed to the model, summed over calls

    def begin_block(self, rows: Tensor, start: int, end: int) -> None:
        self.rows, self.start, self.end = rows, start, end

    def block_logits(self, step: int, completion: Tensor, live: Tensor) -> Tensor:
        """completion [A, L] of the block's rows, live [A] bool -> the live rows' (guided) block logits [A', W, V]."""
        rows, completion = self.rows[live], completion[live]
        mask = None if self.prompt_mask is None else self.prompt_mask[rows]
        rows_fed = rows.numel() * (2 if self.cfg_scale > 0 else 1)
        self.forward_tokens += rows_fed * (self.prompt_ids.shape[1] + completion.shape[1])
        logits = completion_logits(self.model, self.prompt_ids[rows], mask, completion, cfg_scale=self.cfg_scale,
                                   mask_id=self.mask_id)  # [A, L, V]
        return logits[:, self.start:self.end]


class ApproxBlockCache:
    """Fast-dLLM's prefix ("prefix") or prefix + suffix ("dual") cache for full-attention models."""

    def __init__(self, model: Any, prompt_ids: Tensor, prompt_mask: Tensor | None, *, cfg_scale: float,
                 mask_id: int, dual: bool):
        self.model, self.prompt_ids, self.prompt_mask = model, prompt_ids, prompt_mask
        self.cfg_scale, self.mask_id, self.dual = cfg_scale, mask_id, dual
        self.context = 1 if getattr(model, "logits_shifted", False) else 0
        self.cached_tokens = 0  # fed by this strategy; the fallback counts its own
        self.fallback: FullForward | None = None

    @property
    def forward_tokens(self) -> int:
        return self.cached_tokens + (self.fallback.forward_tokens if self.fallback is not None else 0)

    def begin_block(self, rows: Tensor, start: int, end: int) -> None:
        self.rows, self.start, self.end = rows, start, end
        if self.fallback is not None:
            self.fallback.begin_block(rows, start, end)
            return
        self.inputs = _RowInputs(self.prompt_ids, self.prompt_mask, rows, cfg_scale=self.cfg_scale,
                                 mask_id=self.mask_id)
        self.past: Layers | None = None  # prefix, or (dual) prefix then suffix: built once per block
        self.like: Any = None

    def block_logits(self, step: int, completion: Tensor, live: Tensor) -> Tensor:
        if self.fallback is not None:
            return self.fallback.block_logits(step, completion, live)
        inp, P, s, e = self.inputs, self.inputs.P, self.start, self.end
        index = inp.index(live)
        ids = _rows(inp.ids(completion), index)  # [R', T]
        valid = _rows(inp.key_valid(completion.shape[1]), index)  # [R', T]
        a = P + s - self.context  # first fed position of the later steps; the prefix is [0, a)
        if self.past is None:  # the block's first step (every row live): the whole sequence, keep its cache
            out = _call(self.model, ids, attention_mask=valid, use_cache=True)
            self.cached_tokens += ids.numel()
            layers = cache_layers(getattr(out, "past_key_values", None))
            if layers is None:
                self._give_up("returned no past_key_values with use_cache=True", s, e)
            else:
                self.like = out.past_key_values
                self.past = slice_layers(layers, 0, a)
                if self.dual:
                    self.past = cat_layers(self.past, slice_layers(layers, P + e))
            return inp.guide(out.logits[:, P + s:P + e])
        past = as_model_cache(_rows(self.past, index), self.like)
        if not self.dual:  # the block and the suffix attend to the cached prefix
            out = _call(self.model, ids[:, a:], attention_mask=valid, past_key_values=past, use_cache=False)
            self.cached_tokens += ids[:, a:].numel()
        else:  # only the block; cached keys listed as (prefix, suffix), then the block's own
            positions = position_ids_from_mask(valid)
            order = torch.cat([valid[:, :a], valid[:, P + e:], valid[:, a:P + e]], dim=1)
            out = _call(self.model, ids[:, a:P + e], attention_mask=order, position_ids=positions[:, a:P + e],
                        past_key_values=past, use_cache=False)
            self.cached_tokens += ids[:, a:P + e].numel()
        c = self.context
        return inp.guide(out.logits[:, c:c + e - s])

    def _give_up(self, why: str, start: int, end: int) -> None:
        _warn_once(self.model, why)
        self.fallback = FullForward(self.model, self.prompt_ids, self.prompt_mask, cfg_scale=self.cfg_scale,
                                    mask_id=self.mask_id)
        self.fallback.begin_block(self.rows, start, end)


class BlockCausalForward:
    """Block-causal model without cache: the whole sequence every step, under the block layout of
    ddrl.processes.block (module doc). The reference the exact cache is tested against.

    slots [B, W] bool: the completion slots that hold tokens (None = all); gen_length = W.
    """

    def __init__(self, model: Any, prompt_ids: Tensor, prompt_mask: Tensor | None, *, cfg_scale: float,
                 mask_id: int, block_size: int, gen_length: int, slots: Tensor | None = None):
        self.model, self.prompt_ids, self.prompt_mask = model, prompt_ids, prompt_mask
        self.cfg_scale, self.mask_id = cfg_scale, mask_id
        self.block_size, self.gen_length, self.slots = block_size, gen_length, slots
        # The first window re-feeds the prompt's last tokens when some row's prompt ends inside a block.
        self.tail = 0 if slots is None else int(slots.int().argmax(dim=1).max())  # the largest offset
        self.forward_tokens = 0

    def begin_block(self, rows: Tensor, start: int, end: int) -> None:
        self.rows, self.start, self.end = rows, start, end
        self.inputs = _RowInputs(self.prompt_ids, self.prompt_mask, rows, cfg_scale=self.cfg_scale,
                                 mask_id=self.mask_id, slots=self.slots)
        valid = self.inputs.key_valid(self.gen_length)  # [R, T]
        self.positions = position_ids_from_mask(valid)
        self.attend = block_attention(valid, self.block_size)  # [R, T, T] True = may attend

    def block_logits(self, step: int, completion: Tensor, live: Tensor) -> Tensor:
        index = self.inputs.index(live)
        ids = _rows(self.inputs.ids(completion), index)
        out = self.model(ids, attention_mask=_rows(self.attend, index), position_ids=_rows(self.positions, index))
        self.forward_tokens += ids.numel()
        P = self.inputs.P
        return self.inputs.guide(out.logits[:, P + self.start:P + self.end])


class ExactBlockCache(BlockCausalForward):
    """Block-causal model with the cache of the prompt and every finished block (exact).

    The first step of block b feeds the tokens not cached yet (the previous block, now final, or
    the prompt at b = 0) together with block b, and keeps the keys/values before block b; later
    steps feed block b only. So no extra call is spent on writing a finished block into the cache.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.context = 1 if getattr(self.model, "logits_shifted", False) else 0
        self.layers: Layers | None = None  # keys/values of positions [0, self.cached) of self.cache_rows
        self.cached = 0
        self.cache_rows: Tensor | None = None
        self.like: Any = None
        self.use_cache = True

    def begin_block(self, rows: Tensor, start: int, end: int) -> None:
        super().begin_block(rows, start, end)
        if self.layers is not None and not torch.equal(rows, self.cache_rows):  # early exit dropped rows
            keep = torch.searchsorted(self.cache_rows, rows)  # rows are sorted subsets of cache_rows
            if self.cfg_scale > 0:
                keep = torch.cat([keep, keep + self.cache_rows.numel()])
            self.layers = select_rows(self.layers, keep)
        self.cache_rows = rows

    def block_logits(self, step: int, completion: Tensor, live: Tensor) -> Tensor:
        if not self.use_cache:
            return super().block_logits(step, completion, live)
        P, s, e = self.inputs.P, self.start, self.end
        index = self.inputs.index(live)  # None at step 0: every row starts the block with masks
        ids = _rows(self.inputs.ids(completion), index)  # [R', T]
        a = P + s - self.context - (self.tail if s == 0 else 0)  # the cache ends before a after this block
        lo = self.cached if step == 0 else a  # first fed position
        past = None if lo == 0 else as_model_cache(_rows(self.layers, index), self.like)
        want_cache = True if step == 0 else None  # None: not passed at all
        out = _call(self.model, ids[:, lo:P + e], attention_mask=_rows(self.attend, index)[:, lo:P + e, :P + e],
                    position_ids=_rows(self.positions, index)[:, lo:P + e], past_key_values=past,
                    use_cache=want_cache)
        self.forward_tokens += ids[:, lo:P + e].numel()
        if step == 0:
            layers = cache_layers(getattr(out, "past_key_values", None))
            if layers is None:
                _warn_once(self.model, "returned no past_key_values with use_cache=True")
                self.use_cache = False  # these logits are still right: this call saw blocks <= b
            else:
                self.like = out.past_key_values
                self.layers, self.cached = slice_layers(layers, 0, a), a
        return self.inputs.guide(out.logits[:, P + s - lo:P + e - lo])


def block_forward(model: Any, prompt_ids: Tensor, prompt_mask: Tensor | None, *, cache: str, block_length: int,
                  gen_length: int, cfg_scale: float, mask_id: int, key: str = "cache", slots: Tensor | None = None):
    """The strategy for `cache` (none | prefix | dual | auto) and the model's attention (module doc)."""
    if cache not in CACHE_MODES:
        raise ValueError(f"{key}={cache!r} is not valid; choose one of: {', '.join(CACHE_MODES)}")
    common = dict(cfg_scale=cfg_scale, mask_id=mask_id)
    block_size = getattr(model, "block_size", None)
    if block_size:
        aligned = block_length % int(block_size) == 0
        if cache in ("prefix", "dual") and not aligned:
            raise ValueError(f"{key}={cache!r} on a block-causal model needs sampler blocks made of whole model "
                             f"blocks, but block_length={block_length} is not a multiple of model.block_size="
                             f"{block_size}; use block_length={block_size} (the 'block' sampler) or {key}=none")
        kind = ExactBlockCache if cache != "none" and aligned else BlockCausalForward
        if kind is ExactBlockCache and not accepts_cache(model):
            _warn_once(model, "its forward takes no past_key_values")
            kind = BlockCausalForward
        return kind(model, prompt_ids, prompt_mask, block_size=int(block_size), gen_length=gen_length, slots=slots,
                    **common)
    if cache in ("none", "auto"):
        return FullForward(model, prompt_ids, prompt_mask, **common)
    if not accepts_cache(model):
        _warn_once(model, "its forward takes no past_key_values")
        return FullForward(model, prompt_ids, prompt_mask, **common)
    return ApproxBlockCache(model, prompt_ids, prompt_mask, dual=cache == "dual", **common)
