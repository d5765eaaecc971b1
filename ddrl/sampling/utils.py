"""Pieces every sampler shares: explicit-generator noise, Gumbel-max sampling, guided logits and
the one model call that returns the completion's logits.

These are pure functions of their inputs (randomness comes in as already drawn uniforms or an
explicit torch.Generator), so each sampler reads as one loop over steps.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddrl.logits import kept_logits
from ddrl.processes.draws import uniform_draw


class RowNoise:
    """Uniform draws for all B rows of a batch, of which only the rows still running are kept.

    A sampler that stops computing finished rows (early exit) still draws noise for them, so the
    numbers a row receives never depend on which other rows already finished: early exit changes
    cost, not samples.
    """

    def __init__(self, generator: torch.Generator | None, batch_size: int, rows: Tensor, device: torch.device):
        self.generator = generator
        self.batch_size = batch_size
        self.rows = rows  # [A] long, indices of the running rows
        self.device = device

    def __call__(self, *tail: int) -> Tensor:
        """[A, *tail] float64 uniforms."""
        # float64 as in LLaDA's reference: from float32 uniforms the Gumbel tail -log U is coarse,
        # which biases low-temperature sampling. uniform_draw refuses a missing generator.
        u = uniform_draw((self.batch_size, *tail), generator=self.generator, device=self.device, dtype=torch.float64)
        return u[self.rows.to(self.device)]


def gumbel_argmax(logits: Tensor, temperature: float, uniforms: Tensor | None) -> Tensor:
    """A draw from softmax(logits / temperature) by the Gumbel-max trick; argmax when temperature is 0.

    logits [..., V], uniforms [..., V] in [0, 1) (ignored at temperature 0) -> [...] long.

    LLaDA's reference computes argmax(exp(logits) / (-log U)^temperature) in float64. Its log,
    argmax(logits - temperature * log(-log U)), picks the same token from the same U without
    overflowing exp() for logits above ~709 (or underflowing all of them to 0 below ~-745).
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    if uniforms is None or uniforms.shape != logits.shape:
        raise ValueError(f"uniforms must have the logits' shape {list(logits.shape)} when temperature > 0")
    scores = logits.double() - temperature * torch.log(-torch.log(uniforms))
    return scores.argmax(dim=-1)


def guided_logits(cond: Tensor, uncond: Tensor, cfg_scale: float) -> Tensor:
    """Classifier-free guidance with weight w: uncond + (w + 1)(cond - uncond).

    This is LLaDA's form (docs/diffusion.md#classifier-free-guidance); MaskGIT/MMaDA's
    (1 + w) cond - w uncond is the same expression expanded, so one function serves both samplers.
    Computed in the logits' dtype, as the reference does.
    A token that either pass forbids (logit -inf, e.g. the mask token of a SUBS denoiser) stays
    forbidden; the bare formula would make it NaN (-inf - -inf) and argmax would pick it.
    """
    guided = uncond + (cfg_scale + 1.0) * (cond - uncond)
    return guided.masked_fill(torch.isneginf(cond) | torch.isneginf(uncond), float("-inf"))


def completion_logits(model, prompt_ids: Tensor, prompt_mask: Tensor | None, completion: Tensor, *,
                      cfg_scale: float, mask_id: int, window: tuple[int, int] | None = None) -> Tensor:
    """One model call on [prompt, completion]; returns the logits of the completion positions [A, L, V].

    prompt_ids [A, P] (left-padded), prompt_mask [A, P] bool (True on real tokens) or None (no mask
    is passed to the model, like the reference), completion [A, L]. window=(lo, hi): only the
    completion positions [lo, hi) are computed and returned ([A, hi - lo, V], a sampler's block).
    With cfg_scale > 0 the conditional and unconditional inputs go through the model as one batch
    of 2A rows; the unconditional input has every real prompt token replaced by mask_id (padding is
    left as it is, the attention mask hides it).
    The logits must be aligned (position i predicts the clean token at i): DiffusionLM realigns a
    Dream backbone's shifted logits itself (ddrl.models.diffusion_lm), so the last L positions are
    read here whatever `logits_shifted` says; reading them one position earlier again would shift twice.
    """
    P, L = prompt_ids.shape[1], completion.shape[1]
    x = torch.cat([prompt_ids, completion], dim=1)  # [A, T]
    attn = None
    if prompt_mask is not None:
        attn = torch.cat([prompt_mask, torch.ones_like(completion, dtype=torch.bool)], dim=1)  # [A, T]
    if cfg_scale > 0:
        real = prompt_mask if prompt_mask is not None else torch.ones_like(prompt_ids, dtype=torch.bool)
        uncond = torch.cat([prompt_ids.masked_fill(real, mask_id), completion], dim=1)
        x = torch.cat([x, uncond], dim=0)  # [2A, T]
        attn = None if attn is None else torch.cat([attn, attn], dim=0)
    if window is None:  # [A or 2A, L, V]: the LM head on the completion only
        logits = kept_logits(model, x, attn, logits_to_keep=L)
    else:  # [A or 2A, hi - lo, V]: only completion positions [lo, hi) (a sampler's block)
        lo, hi = window
        logits = kept_logits(model, x, attn, logits_to_keep=torch.arange(P + lo, P + hi, device=x.device))
    if cfg_scale > 0:
        cond, uncond_logits = logits.chunk(2, dim=0)
        logits = guided_logits(cond, uncond_logits, cfg_scale)
    return logits  # [A, L, V]
