"""How a padding mask (and positions, and a KV cache) reach a backbone: one feed per backbone kind.

HFDiffusionLM looks its feed up by name (FamilyFacts.attention, or the "attention" key of a
ddrl-saved config.json) in FEEDS, once, when it is built:

  "native"    the masks, position_ids, past_key_values and use_cache are passed as given. For
              ddrl's native families (they honour 2-D and boolean 3-D/4-D masks, count positions
              over real tokens and return a cache) and for Hugging Face models, which take a 2-D
              mask themselves.
  "unpadded"  for remote code that ignores attention_mask (as LLaDA's hub code does: LLaDA issues
              #89/#90) and numbers positions 0..T-1: the backbone must never see a pad. Rows are
              grouped by mask pattern, the padded columns of each group removed, each group run as
              its own unpadded batch and its logits scattered back (padded positions get logits
              0, never read). A rollout group (G completions of one prompt) stays one batch; a
              micro-batch of k distinct prompt lengths costs k smaller calls. No KV cache. Chosen
              by writing "ddrl": {"attention": "unpadded"} into such a directory's config.json.
  "canvas"    DiffusionGemma (transformers' DiffusionGemmaForBlockDiffusion), an encoder-decoder
              block diffusion model: [prompt, completion] is split into the encoder's prompt and
              the decoder's canvas of the last canvas_length tokens; prompt positions get logits
              0. Rollouts need gen_length == canvas_length; no self-conditioning logits are passed
              (zeros, as at its own first denoising step) unless the caller gives them
              (self_conditioning_logits=, as ddrl.sampling.diffusion_gemma does). No KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from ddrl.models.native.base import positions_from_mask
from ddrl.registry import Registry


@dataclass(frozen=True)
class Feed:
    run: Callable[..., Any]  # (lm, input_ids [B, T_new], attention_mask, **kwargs) -> object with .logits
    takes_cache: bool  # past_key_values / use_cache reach the backbone


FEEDS: Registry[Feed] = Registry("attention feed")


@dataclass
class FeedOutput:
    logits: Tensor  # [B, T, V]; no cache


def _as_given(lm: Any, input_ids: Tensor, attention_mask: Tensor | None, **kwargs: Any) -> Any:
    return lm.model(input_ids, attention_mask=attention_mask, **kwargs)


def _unpadded(lm: Any, input_ids: Tensor, attention_mask: Tensor | None, **kwargs: Any) -> Any:
    """Rows grouped by mask pattern, padding columns removed: the backbone never sees a pad."""
    if attention_mask is None or bool(attention_mask.bool().all()):
        if kwargs:  # such remote code numbers positions 0..T-1 itself
            raise ValueError(f"the {lm.family!r} backbone takes no position_ids; pass unpadded rows only")
        return FeedOutput(lm.model(input_ids).logits)
    if attention_mask.dim() != 2:
        raise ValueError(f"the {lm.family!r} backbone ignores attention masks, so only a 2-D padding mask "
                         f"[B, T] can be honoured (by removing the padding); got shape {tuple(attention_mask.shape)}")
    if kwargs:
        raise ValueError(f"{sorted(kwargs)} cannot be combined with padding for the {lm.family!r} backbone; "
                         f"pass unpadded rows")
    valid = attention_mask.bool()  # [B, T]
    patterns, group_of = torch.unique(valid, dim=0, return_inverse=True)
    logits = None
    for g, pattern in enumerate(patterns):
        rows = (group_of == g).nonzero().squeeze(1)  # [n]
        cols = pattern.nonzero().squeeze(1)  # [t]
        if cols.numel() == 0:  # all-padding rows: nothing to run
            continue
        part = lm.model(input_ids[rows][:, cols]).logits  # [n, t, V]
        if logits is None:
            logits = part.new_zeros(*input_ids.shape, part.shape[-1])  # [B, T, V]
        logits = logits.index_put((rows[:, None], cols[None, :]), part)
    if logits is None:
        raise ValueError("every row of the batch is padding; pass at least one real token")
    return FeedOutput(logits)


def _canvas(lm: Any, input_ids: Tensor, attention_mask: Tensor | None, *,
            self_conditioning_logits: Tensor | None = None, **kwargs: Any) -> Any:
    """DiffusionGemma: encoder over the prefix, decoder over the last canvas_length tokens.

    self_conditioning_logits [B, C, V]: the previous denoising step's (temperature-scaled) canvas
    logits, which the decoder embeds as softmax(logits) @ E (ddrl.sampling.diffusion_gemma passes
    them); None = zeros, as at the model's first denoising step.
    """
    C = int(lm.canvas_length)
    B, T = input_ids.shape
    if T <= C:
        raise ValueError(f"DiffusionGemma needs a prompt before its canvas of {C} tokens, got a sequence of {T}; "
                         f"pass [prompt, completion] with gen_length == canvas_length == {C}")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"DiffusionGemma takes a 2-D padding mask [B, T], got shape {tuple(attention_mask.shape)}")
    if kwargs:
        raise ValueError(f"DiffusionGemma computes its own positions; do not pass {sorted(kwargs)}")
    if self_conditioning_logits is not None and tuple(self_conditioning_logits.shape[:2]) != (B, C):
        raise ValueError(f"self_conditioning_logits must be [B, canvas_length, V] = [{B}, {C}, V], got "
                         f"{list(self_conditioning_logits.shape)}")
    valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    prompt_valid = valid[:, :-C]  # [B, P]
    n_real = prompt_valid.sum(1, keepdim=True)  # [B, 1]
    out = lm.model(
        input_ids=input_ids[:, :-C], attention_mask=prompt_valid, position_ids=positions_from_mask(prompt_valid),
        decoder_input_ids=input_ids[:, -C:], decoder_attention_mask=valid,
        self_conditioning_logits=self_conditioning_logits,
        decoder_position_ids=n_real + torch.arange(C, device=input_ids.device))
    canvas_logits = out.logits  # [B, C, V]
    prompt_logits = canvas_logits.new_zeros(B, T - C, canvas_logits.shape[-1])
    return FeedOutput(torch.cat([prompt_logits, canvas_logits], dim=1))


FEEDS.register("native", Feed(_as_given, takes_cache=True))
FEEDS.register("unpadded", Feed(_unpadded, takes_cache=False))
FEEDS.register("canvas", Feed(_canvas, takes_cache=False))
