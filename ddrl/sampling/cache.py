"""How the semi-autoregressive samplers call the model for one block: with or without a KV cache.

The samplers of ddrl.sampling.masked decode the completion block by block; inside a block every
step needs the logits of the block's positions [A, W, V]. Where those come from is a strategy,
picked once per call by `block_forward` from rollout.cache and the model's attention:

  FullForward       cache "none", full attention. Every step runs [prompt, completion] through the
                    model: LLaDA's reference, exactly (docs/diffusion.md#low-confidence-sampler).
  ApproxBlockCache  cache "prefix" | "dual", full attention (Fast-dLLM, Wu et al. 2025;
                    docs/diffusion.md#kv-cache).
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
every row. A row's last block is decoded whole, as SDAR does (its slots past gen_length are mask
slots, decoded and then dropped); the slots after that block, there when other rows reach further,
are empty too. The strategies here take the decoded slots as `slots` [B, W] (True = decoded).
The sampler passes the layout explicitly (a boolean [R, T_new, T_past + T_new] attention_mask and
position_ids counting real tokens). Sampler blocks must be unions of model blocks (block_length a
multiple of block_size) for the cache to be exact. In the first window, the prompt's last tokens
share the block with masked slots, so their keys change until the block is final: the exact cache
re-feeds them (from column P - max offset) with the window.

**Static shapes** (masked module doc): every call is fed all R rows, finished or not, so the batch
never shrinks; the input ids live in one buffer [R, P + W] whose completion part each step
overwrites; the keys/values live in one buffer per layer [R, H, P + W, Dh], allocated from the first
cache the model returns and written in place (the exact cache: each finished block once; the
approximate caches: once per block), and the model is given views [:, :, :T_past] of it. So a
call's shapes and storage depend only on the block and the step, and no whole-cache copy happens
when rows finish. The model itself still concatenates past and new keys (its cache contract).

**Compiled steps** (rollout.compile): the strategies call `compiled_model(model)`, torch.compile of
the model (mode "reduce-overhead" on CUDA: the call is captured once as a CUDA graph and replayed,
so a step costs one launch instead of one per kernel; the default mode elsewhere). Only the model
call is compiled; the commit rule and the noise stay eager, so the tokens are the eager ones. The
static shapes above make it compile once per call shape: no cache and the dual cache have at most
two (a block's first call and its later ones) in every block; the exact block cache's past grows
with the block, so it is compiled with dynamic sizes (a bounded number of graphs, tested). The
prefix cache feeds a shorter suffix every block and would recompile per block: the settings
(masked.BlockwiseSettings) refuse compile with it. Under CUDA graphs each call's outputs live until the next call; the
sampler reads the logits and copies the keys/values into its buffer before then.

**Logits shifted by one** (Dream): DiffusionLM realigns them over each call's input, so the first
fed position gets no prediction of its own. Cached calls therefore start one token early (the
token before the block: prompt or previous block), and the cache ends before that token.

**What a model must do for the cache** (the built-in Denoiser does all of it):
  * accept `past_key_values` and `use_cache=True` and return `.past_key_values`: per layer a
    (key, value) pair of [R, H, T, Dh] tensors, position order, keys already rotated (RoPE); a
    transformers DynamicCache also works (4.x: to/from_legacy_cache; 5.x: iterated per layer and
    rebuilt with DynamicCache(ddp_cache_data=...)): the sampler copies the per-layer tensors into
    its buffer and hands the model a new object of the same class, over views of it, each call;
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
import weakref
from typing import Any

import torch
from torch import Tensor

from ddrl.logits import takes_argument
from ddrl.contract import model_view
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


def accepts_cache(model: Any) -> bool:
    """Whether model(...) can take past_key_values: an explicit parameter, or **kwargs that reach
    a backbone (DiffusionLM.model, ...) that takes it or **kwargs itself. The first cached call
    still checks that a cache comes back."""
    seen = 0
    model = _unwrapped(model)
    while model is not None and seen < 8:
        # A Hugging Face or user backbone states whether it takes a cache only by its signature.
        forward = getattr(model, "forward", None) or (model if callable(model) else None)
        if forward is None:
            return False
        try:
            params = inspect.signature(forward).parameters
        except (TypeError, ValueError):
            return False
        if "past_key_values" in params:
            return True
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return False
        inner = getattr(model, "model", None)  # the backbone under a wrapper, if any
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
# Static storage: the batch's inputs and a preallocated KV buffer
# --------------------------------------------------------------------------------------------


class _RowInputs:
    """The model input of all B rows, stacked with their unconditional copy under guidance
    (R = 2B rows: cond, then uncond with every real prompt token replaced by mask_id).

    The batch never shrinks (module doc): the prompt is written once into an input buffer
    [R, P + W] and each step overwrites its completion part in place, so every call reads the
    same storage at the same shape.
    """

    def __init__(self, prompt_ids: Tensor, prompt_mask: Tensor | None, width: int, *, cfg_scale: float,
                 mask_id: int, slots: Tensor | None = None):
        prompt = prompt_ids  # [B, P]
        valid = torch.ones_like(prompt, dtype=torch.bool) if prompt_mask is None else prompt_mask
        if slots is None:
            slots = torch.ones(prompt.shape[0], width, dtype=torch.bool, device=prompt.device)  # [B, W]
        if cfg_scale > 0:
            prompt = torch.cat([prompt, prompt.masked_fill(valid, mask_id)], dim=0)  # [2B, P]
            valid = torch.cat([valid, valid], dim=0)
            slots = torch.cat([slots, slots], dim=0)
        self.cfg_scale = cfg_scale
        self.B, self.P = prompt_ids.shape[0], prompt.shape[1]
        completion = torch.zeros(prompt.shape[0], width, dtype=torch.long, device=prompt.device)
        self.buffer = torch.cat([prompt.long(), completion], dim=1)  # [R, P + W]
        self.valid = torch.cat([valid, slots[:, :width]], dim=1)  # [R, P + W] real prompt tokens and slots

    def ids(self, completion: Tensor) -> Tensor:
        """completion [B, W] -> [R, P + W], written into the input buffer."""
        P = self.P
        self.buffer[:self.B, P:] = completion
        if self.cfg_scale > 0:
            self.buffer[self.B:, P:] = completion
        return self.buffer

    def guide(self, logits: Tensor) -> Tensor:
        """[R, W, V] -> [B, W, V]."""
        if self.cfg_scale > 0:
            cond, uncond = logits.chunk(2, dim=0)
            return guided_logits(cond, uncond, self.cfg_scale)
        return logits


class _KVBuffer:
    """Per-layer keys/values [R, H, capacity, Dh], allocated once from the first cache the model
    returns (its rows, heads, head size, dtype and device) and written in place afterwards, so the
    past handed to the model is always a view [:, :, :length] of the same storage."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.layers: Layers | None = None

    def write(self, layers: Layers, lo: int, hi: int, source: int | None = None) -> None:
        """Buffer positions [lo, hi) <- positions [source, source + hi - lo) of `layers` (source = lo)."""
        source = lo if source is None else source
        if self.layers is None:
            self.layers = [(k.new_empty(*k.shape[:2], self.capacity, k.shape[3]),
                            v.new_empty(*v.shape[:2], self.capacity, v.shape[3])) for k, v in layers]
        if len(layers) != len(self.layers) or layers[0][0].shape[:2] != self.layers[0][0].shape[:2]:
            raise ValueError(f"the model returned a cache of {len(layers)} layers shaped {tuple(layers[0][0].shape)}, "
                             f"but the sampler's KV buffer holds {len(self.layers)} layers shaped "
                             f"{tuple(self.layers[0][0].shape)}; a model must return per layer [R, H, T, Dh] for "
                             f"the R rows it was fed")
        n = hi - lo
        for (bk, bv), (k, v) in zip(self.layers, layers):
            bk[:, :, lo:hi].copy_(k[:, :, source:source + n])
            bv[:, :, lo:hi].copy_(v[:, :, source:source + n])

    def view(self, length: int) -> Layers:
        """Positions [0, length) of every layer: views, no copy."""
        assert self.layers is not None  # write() came first
        return [(k[:, :, :length], v[:, :, :length]) for k, v in self.layers]


def _call(model: Any, ids: Tensor, **kwargs: Any) -> Any:
    """model(ids, **kwargs) without the None-valued arguments (so plain models need not take them)."""
    _begin_step(model)
    return model(ids, **{k: v for k, v in kwargs.items() if v is not None})


def _call_keep(model: Any, ids: Tensor, keep: int | Tensor, class_range: tuple[int, int] | None = None,
               **kwargs: Any) -> tuple[Any, Tensor]:
    """_call that computes logits only at `keep` (the last K fed positions, or those positions;
    ddrl.logits) when the model can, else slices: -> (output, logits [R, K, V]); with class_range
    (a, b) the ids [a, b) only, [R, K, b - a] (the model's own class_range, else sliced).

    The block's logits are all a step reads: at LLaDA's V = 126k the head over the whole sequence
    would be most of the call's memory."""
    inner = getattr(_unwrapped(model), "module", _unwrapped(model))  # DDP
    if class_range is not None and takes_argument(inner, "class_range"):
        kwargs["class_range"], class_range = class_range, None  # the model computes those ids alone
    if takes_argument(inner, "logits_to_keep"):
        out = _call(model, ids, logits_to_keep=keep, **kwargs)
        logits = out.logits
    else:
        out = _call(model, ids, **kwargs)
        logits = out.logits[:, keep] if isinstance(keep, Tensor) else out.logits[:, out.logits.shape[1] - keep:]
    return out, logits if class_range is None else logits[..., class_range[0]:class_range[1]]


# --------------------------------------------------------------------------------------------
# Strategies: begin_block(start, end), then block_logits(step, completion) per step, all B rows
# --------------------------------------------------------------------------------------------


class FullForward:
    """No cache, full attention: [prompt, completion] of every row every step (the reference)."""

    def __init__(self, model: Any, prompt_ids: Tensor, prompt_mask: Tensor | None, *, cfg_scale: float,
                 mask_id: int, class_range: tuple[int, int] | None = None):
        self.model, self.prompt_ids, self.prompt_mask = model, prompt_ids, prompt_mask
        self.cfg_scale, self.mask_id, self.class_range = cfg_scale, mask_id, class_range
        self.forward_tokens = 0  # rows x tokens fed to the model, summed over calls

    def begin_block(self, start: int, end: int) -> None:
        self.start, self.end = start, end

    def block_logits(self, step: int, completion: Tensor) -> Tensor:
        """completion [B, W] -> the (guided) logits of the block [B, end - start, V] (b - a ids: class_range)."""
        _begin_step(self.model)
        rows_fed = completion.shape[0] * (2 if self.cfg_scale > 0 else 1)
        self.forward_tokens += rows_fed * (self.prompt_ids.shape[1] + completion.shape[1])
        return completion_logits(self.model, self.prompt_ids, self.prompt_mask, completion, cfg_scale=self.cfg_scale,
                                 mask_id=self.mask_id, window=(self.start, self.end),
                                 class_range=self.class_range)  # [B, W_block, V]


class ApproxBlockCache:
    """Fast-dLLM's prefix ("prefix") or prefix + suffix ("dual") cache for full-attention models.

    The block's first step writes the past of the later steps into one preallocated buffer:
    prefix [0, a), or (dual) prefix then suffix, whose length P + W - context - block_length is
    the same for every block, so the later steps read a view of fixed storage.
    """

    def __init__(self, model: Any, prompt_ids: Tensor, prompt_mask: Tensor | None, *, cfg_scale: float,
                 mask_id: int, dual: bool, class_range: tuple[int, int] | None = None):
        self.model, self.prompt_ids, self.prompt_mask = model, prompt_ids, prompt_mask
        self.cfg_scale, self.mask_id, self.dual, self.class_range = cfg_scale, mask_id, dual, class_range
        self.context = 1 if model_view(model).logits_shifted else 0
        # No prompt mask (the sampler drops an all-ones one): every key is real, so no call passes a
        # mask and the model keeps its unmasked attention kernel; positions are then the default ones.
        self.all_valid = prompt_mask is None
        self.cached_tokens = 0  # fed by this strategy; the fallback counts its own
        self.fallback: FullForward | None = None
        self.inputs: _RowInputs | None = None  # built at the first call (W = the completion's width)
        self.kv: _KVBuffer | None = None
        self.like: Any = None

    @property
    def forward_tokens(self) -> int:
        return self.cached_tokens + (self.fallback.forward_tokens if self.fallback is not None else 0)

    def begin_block(self, start: int, end: int) -> None:
        self.start, self.end = start, end
        if self.fallback is not None:
            self.fallback.begin_block(start, end)
        self.past_len: int | None = None  # set by the block's first step

    def block_logits(self, step: int, completion: Tensor) -> Tensor:
        if self.fallback is not None:
            return self.fallback.block_logits(step, completion)
        if self.inputs is None:
            self.inputs = _RowInputs(self.prompt_ids, self.prompt_mask, completion.shape[1],
                                     cfg_scale=self.cfg_scale, mask_id=self.mask_id)
            self.positions = position_ids_from_mask(self.inputs.valid)  # [R, T]
            self.kv = _KVBuffer(self.inputs.valid.shape[1])
        assert self.kv is not None  # made with the inputs, on the first call
        inp, P, s, e = self.inputs, self.inputs.P, self.start, self.end
        ids, valid = inp.ids(completion), inp.valid  # [R, T]
        given = lambda m: None if self.all_valid else m  # noqa: E731  the attention_mask passed
        T = ids.shape[1]
        a = P + s - self.context  # first fed position of the later steps; the prefix is [0, a)
        if self.past_len is None:  # the block's first step: the whole sequence, keep its cache
            out, block = _call_keep(self.model, ids, torch.arange(P + s, P + e, device=ids.device), self.class_range,
                                    attention_mask=given(valid), use_cache=True)
            self.cached_tokens += ids.numel()
            layers = cache_layers(getattr(out, "past_key_values", None))  # a bare model's output may have none
            if layers is None:
                self._give_up("returned no past_key_values with use_cache=True", s, e)
            else:
                self.like = out.past_key_values
                self.kv.write(layers, 0, a)
                self.past_len = a
                if self.dual:  # keys listed as (prefix, suffix), then the block's own
                    self.kv.write(layers, a, a + T - (P + e), source=P + e)
                    self.past_len = a + T - (P + e)
                    self.order = torch.cat([valid[:, :a], valid[:, P + e:], valid[:, a:P + e]], dim=1)
            return inp.guide(block)
        past = as_model_cache(self.kv.view(self.past_len), self.like)
        c = self.context
        if not self.dual:  # the block and the suffix attend to the cached prefix
            _, block = _call_keep(self.model, ids[:, a:], torch.arange(c, c + e - s, device=ids.device),
                                  self.class_range, attention_mask=given(valid), past_key_values=past,
                                  use_cache=False)
            self.cached_tokens += ids[:, a:].numel()
        else:  # only the block (after the context token): the last e - s fed positions
            _, block = _call_keep(self.model, ids[:, a:P + e], e - s, self.class_range,
                                  attention_mask=given(self.order),
                                  position_ids=self.positions[:, a:P + e], past_key_values=past, use_cache=False)
            self.cached_tokens += ids[:, a:P + e].numel()
        return inp.guide(block)

    def _give_up(self, why: str, start: int, end: int) -> None:
        _warn_once(self.model, why)
        self.fallback = FullForward(self.model, self.prompt_ids, self.prompt_mask, cfg_scale=self.cfg_scale,
                                    mask_id=self.mask_id, class_range=self.class_range)
        self.fallback.begin_block(start, end)


class BlockCausalForward:
    """Block-causal model without cache: the whole sequence every step, under the block layout of
    ddrl.processes.block (module doc). The reference the exact cache is tested against.

    slots [B, W] bool: the completion slots that are decoded (None = all); gen_length = W.
    """

    def __init__(self, model: Any, prompt_ids: Tensor, prompt_mask: Tensor | None, *, cfg_scale: float,
                 mask_id: int, block_size: int, gen_length: int, slots: Tensor | None = None,
                 class_range: tuple[int, int] | None = None):
        self.model, self.prompt_ids, self.prompt_mask = model, prompt_ids, prompt_mask
        self.cfg_scale, self.mask_id, self.class_range = cfg_scale, mask_id, class_range
        self.block_size, self.gen_length, self.slots = block_size, gen_length, slots
        # The first window re-feeds the prompt's last tokens when some row's prompt ends inside a block.
        self.tail = 0 if slots is None else int(slots.int().argmax(dim=1).max())  # the largest offset
        self.forward_tokens = 0
        # The layout is the same for every block and step: built once, for all rows.
        self.inputs = _RowInputs(prompt_ids, prompt_mask, gen_length, cfg_scale=cfg_scale, mask_id=mask_id,
                                 slots=slots)
        self.positions = position_ids_from_mask(self.inputs.valid)  # [R, T]
        self.attend = block_attention(self.inputs.valid, block_size)  # [R, T, T] True = may attend

    def begin_block(self, start: int, end: int) -> None:
        self.start, self.end = start, end

    def block_logits(self, step: int, completion: Tensor) -> Tensor:
        ids = self.inputs.ids(completion)
        P = self.inputs.P
        _, block = _call_keep(self.model, ids, torch.arange(P + self.start, P + self.end, device=ids.device),
                              self.class_range, attention_mask=self.attend, position_ids=self.positions)
        self.forward_tokens += ids.numel()
        return self.inputs.guide(block)


class ExactBlockCache(BlockCausalForward):
    """Block-causal model with the cache of the prompt and every finished block (exact).

    The first step of block b feeds the tokens not cached yet (the previous block, now final, or
    the prompt at b = 0) together with block b, and writes the keys/values before block b into the
    preallocated buffer (in place); later steps feed block b only. So no extra call is spent on
    writing a finished block into the cache, and the past is always a view of the same storage.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.context = 1 if model_view(self.model).logits_shifted else 0
        self.kv = _KVBuffer(self.inputs.valid.shape[1])  # positions [0, self.cached) are final
        self.cached = 0
        self.like: Any = None
        self.use_cache = True

    def block_logits(self, step: int, completion: Tensor) -> Tensor:
        if not self.use_cache:
            return super().block_logits(step, completion)
        P, s, e = self.inputs.P, self.start, self.end
        ids = self.inputs.ids(completion)  # [R, T]
        a = P + s - self.context - (self.tail if s == 0 else 0)  # the cache ends before a after this block
        lo = self.cached if step == 0 else a  # first fed position
        past = None if lo == 0 else as_model_cache(self.kv.view(lo), self.like)
        want_cache = True if step == 0 else None  # None: not passed at all
        out, block = _call_keep(self.model, ids[:, lo:P + e], e - s, self.class_range,
                                attention_mask=self.attend[:, lo:P + e, :P + e],
                                position_ids=self.positions[:, lo:P + e], past_key_values=past, use_cache=want_cache)
        self.forward_tokens += ids[:, lo:P + e].numel()
        if step == 0:
            layers = cache_layers(getattr(out, "past_key_values", None))  # a bare model's output may have none
            if layers is None:
                _warn_once(self.model, "returned no past_key_values with use_cache=True")
                self.use_cache = False  # these logits are still right: this call saw blocks <= b
            else:
                self.like = out.past_key_values
                self.kv.write(layers, self.cached, a)  # the returned cache spans [0, P + e)
                self.cached = a
        return self.inputs.guide(block)  # the block is the last e - s fed positions


def block_forward(model: Any, prompt_ids: Tensor, prompt_mask: Tensor | None, *, cache: str, block_length: int,
                  gen_length: int, cfg_scale: float, mask_id: int, slots: Tensor | None = None,
                  compile: bool = False, class_range: tuple[int, int] | None = None):
    """The strategy for `cache` (none | prefix | dual | auto) and the model's attention (module doc);
    compile=True runs its model calls under torch.compile ("Compiled steps" in the module doc).
    class_range (a, b): every step's logits are those of ids [a, b) only (an image model's codebook).

    The settings were checked by the sampler's settings class (the cache choice; prefix/dual on a
    block-causal model need sampler blocks of whole model blocks); "auto" on unaligned blocks runs uncached."""
    common: dict[str, Any] = dict(cfg_scale=cfg_scale, mask_id=mask_id, class_range=class_range)
    view = model_view(model)
    block_size = view.block_size
    if view.completion_suffix or view.cfg_unconditional_prompt is not None:
        if block_size or cache not in ("none", "auto"):  # its suffix / guidance prompt live in completion_logits
            raise ValueError(f"this model's layout (a completion suffix, its own guidance prompt) runs without a KV "
                             f"cache on full-attention models only; set rollout.cache=none (got {cache!r})")
        return FullForward(model, prompt_ids, prompt_mask, **common)
    if block_size:
        aligned = block_length % int(block_size) == 0
        kind = ExactBlockCache if cache != "none" and aligned else BlockCausalForward
        if kind is ExactBlockCache and not accepts_cache(model):
            _warn_once(model, "its forward takes no past_key_values")
            kind = BlockCausalForward
        run = compiled_model(model, static=kind is BlockCausalForward) if compile else model
        return kind(run, prompt_ids, prompt_mask, block_size=int(block_size), gen_length=gen_length, slots=slots,
                    **common)
    if cache in ("none", "auto") or not accepts_cache(model):
        if cache not in ("none", "auto"):
            _warn_once(model, "its forward takes no past_key_values")
        return FullForward(compiled_model(model, static=True) if compile else model, prompt_ids, prompt_mask,
                           **common)
    dual = cache == "dual"
    return ApproxBlockCache(compiled_model(model, static=dual) if compile else model, prompt_ids, prompt_mask,
                            dual=dual, **common)


# --------------------------------------------------------------------------------------------
# Compiled steps (rollout.compile)
# --------------------------------------------------------------------------------------------


_cuda_graphed: "weakref.WeakSet[Any]" = weakref.WeakSet()  # compiled models whose calls replay CUDA graphs


def compiled_model(model: Any, *, static: bool) -> Any:
    """torch.compile(model) for one sampler call (module doc, "Compiled steps").

    static: the strategy's shapes are the same in every block (no cache, the dual cache, a block model
    without cache): dynamic=False, one graph per call shape. Otherwise (the exact cache's growing
    past) dynamo's automatic dynamic shapes: recompiled with symbolic sizes after the first change.
    A new wrapper per call costs nothing: dynamo keeps the compiled code with the model's forward, so
    the next sampler call on the same model reuses it."""
    # A plain callable has no parameters (it runs where its inputs are).
    cuda = any(p.is_cuda for p in model.parameters()) if hasattr(model, "parameters") else False
    compiled = torch.compile(model, mode="reduce-overhead" if cuda else None, dynamic=False if static else None)
    if cuda:
        _cuda_graphed.add(compiled)
    return compiled


def _begin_step(model: Any) -> None:
    """Before a model call: under CUDA graphs, tell torch a new step begins, so that the replay may
    reuse the memory of the last one's outputs (the sampler has read or copied them by now)."""
    if model in _cuda_graphed:
        torch.compiler.cudagraph_mark_step_begin()


def _unwrapped(model: Any) -> Any:
    """The module torch.compile wrapped (its forward's signature is the one to read), else the model."""
    return getattr(model, "_orig_mod", model)  # torch.compile's wrapper keeps the module there
