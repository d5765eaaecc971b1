"""Local Hugging Face model directories -> DiffusionLM: LLaDA, MMaDA, Dream, SDAR/TraDo, DiffusionGemma.

    model = load_hf_model("/models/LLaDA-8B-Instruct", device="cuda", dtype=torch.bfloat16)
    model = ddrl.load_model(same_dir)      # load_model sends every non-built-in directory here

The only module of ddrl that imports transformers. Nothing is downloaded: directories are local
(`local_files_only=True`); modeling code shipped in a directory (config.json "auto_map") runs
only with trust_remote_code=True (ModelConfig.trust_remote_code).

**Family facts.** The family is read from config.json (model_type, architectures, auto_map):

| family          | mask id | logits       | attention (how a padding mask reaches the model)      | process |
| ---             | ---     | ---          | ---                                                     | ---     |
| llada           | 126336  | aligned      | "unpadded": the model ignores attention_mask, see below | masked  |
| mmada           | 126336  | aligned      | "unpadded" (LLaDA backbone); image codebook, see below  | masked  |
| dream           | 151666  | shifted by 1 | "dream": 4-D boolean mask + position ids, as Dream's    | masked  |
|                 |         |              | own generate() passes them                              |         |
| sdar (TraDo)    | tokenizer| aligned     | "block": block-causal 4-D boolean mask, block size 4    | block   |
| diffusion_gemma | tokenizer| aligned     | "canvas": encoder over the prompt, decoder over the     | uniform |
|                 |         |              | completion (the canvas)                                 |         |
| anything else   | config / tokenizer | aligned | "native": the 2-D mask is passed as is         | masked  |

The mask id is, in order: the mask_token_id argument (ModelConfig.mask_token_id), a value saved
by ddrl ("ddrl" section of config.json), config.json's own mask_token_id, the family's id above,
the tokenizer's mask token. An id outside the vocabulary is an error naming the override.

**LLaDA ignores attention_mask** (LLaDA issues #89/#90, dllm #15; ANCHORS complaint 5): its
remote code calls scaled_dot_product_attention with attn_mask=None and numbers positions
0..T-1, so a left-padded row attends to its padding and its real tokens sit at shifted rotary
positions; its logits differ from the unpadded row's. Neither re-padding (the pads are still
attended) nor an additive bias (the code drops it) fixes that. What is exact is never showing
the model a pad: "unpadded" mode groups the rows of a batch by their attention mask, removes the
padded columns of each group (the rows of one group share them), runs each group as its own
unpadded batch and scatters the logits back; padded positions get logits 0 (never read). A
rollout group (G completions of one prompt) has one prompt length, so it stays one batch; a
micro-batch of prompts of k distinct lengths costs k smaller forward calls instead of one.

**MMaDA images.** MMaDA's image tokens are an 8192-entry VQ codebook at a vocabulary offset
(config llm_vocab_size + num_new_special_tokens = 126464 for MMaDA-8B). The model exposes
`image_token_range = (offset, offset + codebook_size)` and `image_logits(logits)` (the
[..., offset:offset + 8192] slice, codebook-space ids). Setting `model.logits_range = (a, b)`
instead keeps full-vocabulary ids but gives every id outside [a, b) the suppressed logit, so
the ordinary samplers and estimators generate and score image tokens only.

**DiffusionGemma** (native in transformers: DiffusionGemmaForBlockDiffusion) is an
encoder-decoder block diffusion model: a causal encoder writes the prompt into a KV cache and a
bidirectional decoder denoises a canvas of uniform-noise tokens that reads it. ddrl calls it with
[prompt, completion]: the last `canvas_length` tokens are the canvas, everything before is the
encoder's input; prompt positions get logits 0. So rollouts need gen_length == canvas_length
(one canvas); ddrl's samplers do not pass self-conditioning logits (the model gets zeros, as at
its own first denoising step). Its process is uniform over the whole vocabulary.

**SDAR / TraDo**: 3-D/4-D boolean masks are passed through as given (with a head axis added):
ddrl's samplers and block ELBOs pass the block convention of ddrl.processes.block explicitly (the
prompt is block -1, completion blocks counted from its start). A caller that passes only a 2-D
padding mask gets the built-in denoiser's default instead (block = position // block_size,
positions counting real tokens). Checked against a tiny test model only: the real remote code must
accept a 4-D boolean mask and position_ids, as its own generate() passes them.

**KV cache**: past_key_values / use_cache reach the backbone in the "native", "dream" and "block"
modes; "unpadded" and "canvas" return no cache, so ddrl's cached samplers fall back to the
uncached (reference) path for LLaDA, MMaDA and DiffusionGemma.

**Gradient checkpointing** uses Hugging Face's when the backbone supports it, else (LLaDA's remote
code does not: LLaDA issue #51) wraps each transformer block's forward in
torch.utils.checkpoint (non-reentrant), found as the largest nn.ModuleList of the backbone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ddrl.models.diffusion_lm import (SUPPRESSED_LOGIT, DiffusionLM, DiffusionLMOutput, load_saved_adapter)
from ddrl.models.io import CONFIG_FILE, ModelDirectoryError, read_json

__all__ = ["FAMILIES", "FamilyFacts", "HFDiffusionLM", "HFTokenizer", "detect_family", "load_hf_model",
           "checkpoint_blocks", "transformer_blocks"]

ATTENTION_MODES = ("native", "unpadded", "dream", "block", "canvas")


@dataclass(frozen=True)
class FamilyFacts:
    mask_token_id: int | None = None  # the family's mask id; None = config.json / tokenizer
    logits_shifted: bool = False  # position i predicts token i + 1 (AR-initialised: Dream)
    block_size: int | None = None  # block diffusion block length (block-causal attention)
    attention: str = "native"  # one of ATTENTION_MODES (module docstring)
    process: str = "masked"  # masked | block | uniform
    image_codebook: bool = False  # MMaDA: image tokens at a vocabulary offset


FAMILIES: dict[str, FamilyFacts] = {
    "llada": FamilyFacts(mask_token_id=126336, attention="unpadded"),
    "mmada": FamilyFacts(mask_token_id=126336, attention="unpadded", image_codebook=True),
    "dream": FamilyFacts(mask_token_id=151666, logits_shifted=True, attention="dream"),
    "sdar": FamilyFacts(block_size=4, attention="block", process="block"),
    "diffusion_gemma": FamilyFacts(attention="canvas", process="uniform"),
    "generic": FamilyFacts(),
}

# Substrings of model_type / architectures / auto_map that name a family, tried in this order
# (MMaDA before LLaDA: MMaDA's classes mention both). TraDo models are SDAR models.
_FAMILY_NAMES = (("mmada", "mmada"), ("llada", "llada"), ("dream", "dream"), ("sdar", "sdar"), ("trado", "sdar"),
                 ("diffusion_gemma", "diffusion_gemma"), ("diffusiongemma", "diffusion_gemma"))

# MMaDA-8B's defaults when its config.json does not spell them out.
_MMADA_TEXT_VOCAB = 126464
_MMADA_CODEBOOK = 8192


def detect_family(config: dict[str, Any]) -> str:
    """config.json dict -> a key of FAMILIES ("generic" when nothing matches)."""
    names = [str(config.get("model_type", ""))] + [str(a) for a in config.get("architectures") or []]
    names += [str(v) for v in (config.get("auto_map") or {}).values()]
    text = " ".join(names).lower()
    for needle, family in _FAMILY_NAMES:
        if needle in text:
            return family
    return "generic"


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


class HFTokenizer:
    """A Hugging Face tokenizer with the attributes and methods the rest of ddrl reads.

    encode(text) adds no special tokens; encode_prompt(text) applies the chat template (one user
    turn + the generation prompt) when the tokenizer has one, else prepends BOS. Prompts are
    left-padded (padding_side), like the built-in SymbolTokenizer's.
    """

    padding_side = "left"

    def __init__(self, tokenizer: Any, *, mask_token_id: int | None = None):
        self.tokenizer = tokenizer
        self.mask_token_id = mask_token_id if mask_token_id is not None else tokenizer.mask_token_id
        self.eos_token_id = _single_id(tokenizer.eos_token_id)
        self.bos_token_id = _single_id(tokenizer.bos_token_id)
        pad = _single_id(tokenizer.pad_token_id)
        self.pad_token_id = pad if pad is not None else self.eos_token_id  # LLaMA-style tokenizers have no pad

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def __len__(self) -> int:
        return len(self.tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_prompt(self, text: str) -> list[int]:
        if self.has_chat_template:
            rendered = self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                          add_generation_prompt=True, tokenize=False)
            return self.encode(rendered)  # the template writes its own BOS
        ids = self.encode(text)
        return ids if self.bos_token_id is None else [self.bos_token_id] + ids

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: Any, skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(s, skip_special_tokens=skip_special_tokens) for s in sequences]

    def save_pretrained(self, directory: str | Path) -> None:
        self.tokenizer.save_pretrained(str(directory))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("padding_side", self.padding_side)
        return self.tokenizer(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # convert_tokens_to_ids, get_vocab, ...
        if name == "tokenizer":  # not set yet (copy/pickle): no recursion
            raise AttributeError(name)
        return getattr(self.tokenizer, name)

    def __repr__(self) -> str:
        return f"HFTokenizer({type(self.tokenizer).__name__}, vocab_size={self.vocab_size}, mask={self.mask_token_id})"


def _single_id(value: Any) -> int | None:
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return None if value is None else int(value)


# --------------------------------------------------------------------------------------------
# The model wrapper
# --------------------------------------------------------------------------------------------


class HFDiffusionLM(DiffusionLM):
    """DiffusionLM over a Hugging Face backbone: feeds it the way its family needs (module docstring).

    attention:         how a padding mask reaches the backbone, one of ATTENTION_MODES.
    image_token_range: (first, end) vocabulary ids of an image codebook (MMaDA) or None.
    logits_range:      (first, end) or None; when set, logits outside it are suppressed.
    canvas_length:     DiffusionGemma's canvas (block) length, for attention="canvas".
    """

    def __init__(self, model: nn.Module, tokenizer: Any = None, *, attention: str = "native",
                 image_token_range: tuple[int, int] | None = None, logits_range: tuple[int, int] | None = None,
                 canvas_length: int | None = None, **kwargs: Any):
        super().__init__(model, tokenizer, **kwargs)
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention={attention!r} is not valid; choose one of: {', '.join(ATTENTION_MODES)}")
        if attention == "block" and self.block_size is None:
            raise ValueError("attention='block' needs block_size (the block diffusion block length); pass it")
        if attention == "canvas" and not canvas_length:
            raise ValueError("attention='canvas' needs canvas_length (DiffusionGemma's config.canvas_length)")
        self.attention = attention
        self.image_token_range = None if image_token_range is None else tuple(int(i) for i in image_token_range)
        self.logits_range = None if logits_range is None else tuple(int(i) for i in logits_range)
        self.canvas_length = canvas_length

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                past_key_values: Any = None, use_cache: bool = False) -> DiffusionLMOutput:
        """input_ids [B, T_new] -> logits [B, T_new, V] aligned with the input (DiffusionLM's contract).

        attention_mask: None; [B, T_past + T_new] padding mask (1 = real); or a boolean
        [B, (1,) T_new, T_past + T_new] mask used as given (block families). position_ids [B, T_new].
        past_key_values / use_cache reach the backbone in the "native", "dream" and "block" modes;
        the "unpadded" and "canvas" modes return no cache (ddrl's samplers then run without one).
        """
        if past_key_values is not None and self.attention in ("unpadded", "canvas"):
            raise ValueError(f"the {self.family!r} backbone is run without a KV cache by ddrl; "
                             f"do not pass past_key_values (set rollout.cache=none)")
        kwargs: dict[str, Any] = {}
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        if self.attention in ("native", "dream", "block") and (past_key_values is not None or use_cache):
            kwargs.update(past_key_values=past_key_values, use_cache=use_cache)
        out = getattr(self, f"_feed_{self.attention}")(input_ids, attention_mask, **kwargs)
        logits = self.align_logits(out.logits)  # [B, T_new, V]
        if self.logits_range is not None:
            lo, hi = self.logits_range
            outside = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
            outside[lo:hi] = False
            logits = logits.masked_fill(outside, SUPPRESSED_LOGIT)
        cache = getattr(out, "past_key_values", None)
        if cache is None:
            cache = getattr(out, "cache", None)  # transformers >= 5 names it `cache`
        return DiffusionLMOutput(logits=logits, past_key_values=cache)

    def image_logits(self, logits: Tensor) -> Tensor:
        """[..., V] -> [..., codebook_size]: the image-codebook slice (MMaDA); index i = codebook entry i."""
        if self.image_token_range is None:
            raise ValueError(f"this {self.family!r} model has no image codebook (image_token_range is None)")
        lo, hi = self.image_token_range
        return logits[..., lo:hi]

    # ------------------------------------------------------------------ feeding the backbone
    # Each returns the backbone's output (an object with .logits [B, T_new, V], maybe .past_key_values).
    def _feed_native(self, input_ids: Tensor, attention_mask: Tensor | None, **kwargs: Any) -> Any:
        return self.model(input_ids, attention_mask=attention_mask, **kwargs)

    def _feed_unpadded(self, input_ids: Tensor, attention_mask: Tensor | None, **kwargs: Any) -> Any:
        """Rows grouped by mask pattern, padding columns removed: the backbone never sees a pad."""
        if attention_mask is None or bool(attention_mask.bool().all()):
            if kwargs:  # LLaDA numbers positions 0..T-1 itself
                raise ValueError(f"the {self.family!r} backbone takes no position_ids; pass unpadded rows only")
            return _Logits(self.model(input_ids).logits)
        if attention_mask.dim() != 2:
            raise ValueError(f"the {self.family!r} backbone ignores attention masks, so only a 2-D padding mask "
                             f"[B, T] can be honoured (by removing the padding); got shape {tuple(attention_mask.shape)}")
        if kwargs:
            raise ValueError(f"{sorted(kwargs)} cannot be combined with padding for the {self.family!r} backbone; "
                             f"pass unpadded rows")
        valid = attention_mask.bool()  # [B, T]
        patterns, group_of = torch.unique(valid, dim=0, return_inverse=True)
        logits = None
        for g, pattern in enumerate(patterns):
            rows = (group_of == g).nonzero().squeeze(1)  # [n]
            cols = pattern.nonzero().squeeze(1)  # [t]
            if cols.numel() == 0:  # all-padding rows: nothing to run
                continue
            part = self.model(input_ids[rows][:, cols]).logits  # [n, t, V]
            if logits is None:
                logits = part.new_zeros(*input_ids.shape, part.shape[-1])  # [B, T, V]
            logits = logits.index_put((rows[:, None], cols[None, :]), part)
        if logits is None:
            raise ValueError("every row of the batch is padding; pass at least one real token")
        return _Logits(logits)

    def _feed_dream(self, input_ids: Tensor, attention_mask: Tensor | None, **kwargs: Any) -> Any:
        """Dream's convention: a 4-D boolean [B, 1, T_new, T_keys] mask and position ids counting real tokens."""
        if attention_mask is None or attention_mask.dim() != 2:
            return self.model(input_ids, attention_mask=_as_4d(attention_mask), **kwargs)
        T_new = input_ids.shape[1]
        valid = attention_mask.bool()  # [B, T_keys] (cached keys, then the new tokens)
        allowed = valid[:, None, None, :] & valid[:, None, -T_new:, None]  # [B, 1, T_new, T_keys]
        allowed = allowed | ~allowed.any(-1, keepdim=True)  # pad queries attend all (never read; avoids NaN)
        kwargs.setdefault("position_ids", positions_from_mask(valid)[:, -T_new:])
        return self.model(input_ids, attention_mask=allowed, **kwargs)

    def _feed_block(self, input_ids: Tensor, attention_mask: Tensor | None, **kwargs: Any) -> Any:
        """Block-causal attention as the built-in denoiser builds it (block = position // block_size);
        3-D / 4-D boolean masks (the samplers' and the staircase ELBO's) are used as given."""
        if attention_mask is not None and attention_mask.dim() in (3, 4):
            return self.model(input_ids, attention_mask=_as_4d(attention_mask), **kwargs)
        if kwargs.get("past_key_values") is not None:
            raise ValueError("a cached call of a block model needs the boolean [B, T_new, T_past + T_new] mask "
                             "(ddrl's samplers pass it)")
        valid = (torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool())
        positions = kwargs.pop("position_ids", None)
        if positions is None:
            positions = positions_from_mask(valid)
        block = positions // self.block_size  # [B, T]
        allowed = (block[:, None, None, :] <= block[:, None, :, None]) & valid[:, None, None, :]  # [B, 1, T, T]
        allowed = allowed | ~allowed.any(-1, keepdim=True)
        return self.model(input_ids, attention_mask=allowed, position_ids=positions, **kwargs)

    def _feed_canvas(self, input_ids: Tensor, attention_mask: Tensor | None, **kwargs: Any) -> Any:
        """DiffusionGemma: encoder over the prefix, decoder over the last canvas_length tokens."""
        C = int(self.canvas_length)
        B, T = input_ids.shape
        if T <= C:
            raise ValueError(f"DiffusionGemma needs a prompt before its canvas of {C} tokens, got a sequence of {T}; "
                             f"pass [prompt, completion] with gen_length == canvas_length == {C}")
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(f"DiffusionGemma takes a 2-D padding mask [B, T], got shape {tuple(attention_mask.shape)}")
        if kwargs:
            raise ValueError(f"DiffusionGemma computes its own positions; do not pass {sorted(kwargs)}")
        valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        prompt_valid = valid[:, :-C]  # [B, P]
        n_real = prompt_valid.sum(1, keepdim=True)  # [B, 1]
        out = self.model(
            input_ids=input_ids[:, :-C], attention_mask=prompt_valid, position_ids=positions_from_mask(prompt_valid),
            decoder_input_ids=input_ids[:, -C:], decoder_attention_mask=valid,
            decoder_position_ids=n_real + torch.arange(C, device=input_ids.device))
        canvas_logits = out.logits  # [B, C, V]
        prompt_logits = canvas_logits.new_zeros(B, T - C, canvas_logits.shape[-1])
        return _Logits(torch.cat([prompt_logits, canvas_logits], dim=1))

    # ------------------------------------------------------------------ checkpointing, persistence
    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        """Hugging Face's (non-reentrant) when the backbone supports it, else per-block checkpointing."""
        base = _base_model(self.model)
        if getattr(base, "supports_gradient_checkpointing", False):
            kwargs = gradient_checkpointing_kwargs or {"use_reentrant": False}
            if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5
                base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        else:
            checkpoint_blocks(base)

    def gradient_checkpointing_disable(self) -> None:
        base = _base_model(self.model)
        if getattr(base, "supports_gradient_checkpointing", False):
            if hasattr(base, "activation_checkpointing_disable"):
                base.activation_checkpointing_disable()
            else:
                base.gradient_checkpointing_disable()
        else:
            checkpoint_blocks(base, enable=False)

    def ddrl_config(self) -> dict[str, Any]:
        return {**super().ddrl_config(), "attention": self.attention, "image_token_range": self.image_token_range,
                "logits_range": self.logits_range, "canvas_length": self.canvas_length}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, attention={self.attention!r}"


@dataclass
class _Logits:
    logits: Tensor  # [B, T, V]; no cache


def _as_4d(mask: Tensor | None) -> Tensor | None:
    """[B, T_new, T_keys] -> [B, 1, T_new, T_keys] (Hugging Face attention takes a head axis)."""
    return mask[:, None] if mask is not None and mask.dim() == 3 else mask


def positions_from_mask(valid: Tensor) -> Tensor:
    """[B, T] bool -> [B, T] positions counting real tokens only (left padding shifts nothing)."""
    return (valid.long().cumsum(1) - 1).clamp(min=0)


def _base_model(backbone: nn.Module) -> nn.Module:
    """The model under a peft wrapper (LoRA), or the backbone itself."""
    return backbone.get_base_model() if hasattr(backbone, "get_base_model") else backbone


# --------------------------------------------------------------------------------------------
# Gradient checkpointing for backbones without Hugging Face's
# --------------------------------------------------------------------------------------------


def transformer_blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a transformer: the children of its largest nn.ModuleList (by parameters)."""
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

        block._ddrl_forward = inner
        block.forward = forward


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def load_hf_model(path: str | Path, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                  trust_remote_code: bool = True, mask_token_id: int | None = None) -> HFDiffusionLM:
    """A local Hugging Face model directory -> HFDiffusionLM with its family's facts (module docstring)."""
    directory = Path(path)
    config = read_json(directory / CONFIG_FILE)
    saved = config.get("ddrl") or {}
    family = saved.get("family") or detect_family(config)
    facts = FAMILIES.get(family, FAMILIES["generic"])
    if config.get("auto_map") and not trust_remote_code:
        raise ValueError(f"{str(directory)!r} ships its own modeling code (config.json auto_map); read it, then pass "
                         f"trust_remote_code=True (model.trust_remote_code=true) to run it")
    backbone = _load_backbone(directory, config, dtype=dtype, trust_remote_code=trust_remote_code)
    hf_tokenizer = _load_tokenizer(directory, trust_remote_code)
    text_config = backbone.config.get_text_config() if hasattr(backbone.config, "get_text_config") else backbone.config
    vocab_size = int(saved.get("vocab_size") or text_config.vocab_size)

    mask_id = _first(mask_token_id, saved.get("mask_token_id"), config.get("mask_token_id"), facts.mask_token_id,
                     getattr(hf_tokenizer, "mask_token_id", None))
    if mask_id is None and facts.process == "uniform":
        mask_id = _first(getattr(hf_tokenizer, "pad_token_id", None), getattr(text_config, "pad_token_id", None))
    if mask_id is None:
        raise ValueError(f"no mask token id for {str(directory)!r} (family {family!r}): neither config.json nor the "
                         f"tokenizer names one; pass mask_token_id (model.mask_token_id=ID)")
    if not 0 <= int(mask_id) < vocab_size:
        raise ValueError(f"mask_token_id={mask_id} (from the {family!r} family rule or config) is outside the "
                         f"vocabulary [0, {vocab_size}) of {str(directory)!r}; pass the right id as mask_token_id "
                         f"(model.mask_token_id=ID)")
    tokenizer = HFTokenizer(hf_tokenizer, mask_token_id=int(mask_id)) if hf_tokenizer is not None else None

    block_size = saved.get("block_size", facts.block_size)
    if facts.attention == "block":
        block_size = int(config.get("block_length") or config.get("block_size") or block_size)
    canvas_length = saved.get("canvas_length") or config.get("canvas_length")
    kwargs: dict[str, Any] = dict(
        mask_token_id=int(mask_id), vocab_size=vocab_size, family=family,
        logits_shifted=saved.get("logits_shifted", facts.logits_shifted), block_size=block_size,
        process_spec=(saved.get("process_spec") if mask_token_id is None else None)  # an override rebuilds it
        or _process_spec(facts, int(mask_id), vocab_size, block_size),
        suppress_mask_logit=saved.get("suppress_mask_logit", False),
        attention=saved.get("attention", facts.attention),
        image_token_range=saved.get("image_token_range") or (_image_range(config) if facts.image_codebook else None),
        logits_range=saved.get("logits_range"), canvas_length=canvas_length,
    )
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        if saved.get(name) is not None:
            kwargs[name] = saved[name]
    model = HFDiffusionLM(backbone, tokenizer, **kwargs)
    model = load_saved_adapter(model, directory)
    return model.to(device=device) if device is not None else model


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _process_spec(facts: FamilyFacts, mask_id: int, vocab_size: int, block_size: int | None) -> dict[str, Any]:
    if facts.process == "uniform":
        return {"name": "uniform", "num_classes": vocab_size, "offset": 0}
    if facts.process == "block":
        return {"name": "block", "mask_token_id": mask_id, "block_size": block_size}
    return {"name": "masked", "mask_token_id": mask_id}


def _image_range(config: dict[str, Any]) -> tuple[int, int]:
    offset = int(config.get("llm_vocab_size", _MMADA_TEXT_VOCAB)) + int(config.get("num_new_special_tokens", 0))
    return offset, offset + int(config.get("codebook_size", _MMADA_CODEBOOK))


def _load_backbone(directory: Path, config: dict[str, Any], *, dtype: torch.dtype | None,
                   trust_remote_code: bool) -> nn.Module:
    """The model class named by auto_map (remote code) or by `architectures` (native), else the Auto classes."""
    import transformers

    kwargs: dict[str, Any] = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    if dtype is not None:
        kwargs["dtype"] = dtype
    auto_map = config.get("auto_map") or {}
    candidates: list[Any] = []
    for name in ("AutoModelForMaskedLM", "AutoModelForCausalLM", "AutoModel"):
        if name in auto_map:
            candidates.append(getattr(transformers, name))
    if not auto_map:
        candidates += [getattr(transformers, a) for a in config.get("architectures") or [] if hasattr(transformers, a)]
        candidates += [transformers.AutoModelForMaskedLM, transformers.AutoModelForCausalLM]
    errors = []
    for cls in candidates:
        try:
            model = cls.from_pretrained(str(directory), **kwargs)
        except (ValueError, KeyError) as e:  # this Auto class does not know the architecture
            errors.append(f"{getattr(cls, '__name__', cls)}: {e}")
            continue
        return model
    raise ModelDirectoryError(
        f"no transformers class can load {str(directory)!r} (model_type {config.get('model_type')!r}): "
        + "; ".join(errors[-3:]) + ". Pass a directory with an LM head (config.json architectures or auto_map)")


def _load_tokenizer(directory: Path, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    has_files = any((directory / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                                                         "vocab.json"))
    if not has_files:
        return None
    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ModelDirectoryError(f"the tokenizer in {str(directory)!r} does not load ({e}); "
                                  f"save one there with tokenizer.save_pretrained") from None

