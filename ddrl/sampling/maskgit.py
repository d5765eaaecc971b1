"""MMaDA's MaskGIT sampler for images (rollout.name=maskgit).

MMaDA generates images as MaskGIT does (Chang et al. 2022; Gen-Verse/MMaDA @ 3cdb870
models/modeling_mmada.py:118-212 `t2i_generate`, models/sampling.py `mask_by_random_topk`). All L
image slots start masked; each of T steps, with ratio r = (s + 1) / T:

    p        = softmax(logits over the codebook)               (guided: (1 + w) cond - w uncond)
    x        ~ p at every masked slot; decided slots keep their code
    conf     = log p(x) + tau (1 - r) * Gumbel                 (decided slots: log of float32 max)
    n        = max(1, min(#masked - 1, floor(L * cos(pi r / 2))))
    re-mask the slots whose conf is below the n-th smallest; the last step returns every x

The code draw is a Gumbel-max draw from the step's uniforms (ddrl.sampling.utils.StepNoise), not
torch.multinomial's stream, so a seed gives other tokens than the authors' (the draw's law is the
same); the re-masking rule itself is theirs, exactly (tests/unit/test_mmada_t2i_golden.py, with
their uniforms injected). `rollout.temperature` is tau, the annealed Gumbel temperature (MMaDA's
`temperature`, 1.0 as released); the codes are drawn at temperature 1, as theirs. The prompt layout,
its completion suffix and the guidance input are the model's (ddrl.sampling.utils.completion_logits).
An image model (utils.codebook_range) is asked for the codebook's logits only (class_range: no
[B, L, V] logits and suppressed copy, twice under guidance); the numbers are the slice's, and the
draws were always over the N codes, so a seed gives the same tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from ddrl.contract import model_view
from ddrl.sampling.base import SampleOutput, model_mask_id
from ddrl.sampling.checks import check_generator_given, check_prompts
from ddrl.sampling.settings import GuidedSettings, register_sampler
from ddrl.sampling.utils import StepNoise, codebook_range, completion_logits, gumbel_argmax


@dataclass
class MaskgitSettings(GuidedSettings):
    """What rollout.name=maskgit reads: the sizes, the temperature and the guidance weight."""

    why_not: ClassVar[str] = ("MMaDA's MaskGIT decodes the whole image each step by its cosine schedule, without blocks "
                              "or cache")


def _log(t: Tensor) -> Tensor:
    return torch.log(t.clamp(min=1e-20))  # their models/sampling.py log()


def maskgit_remask(selected_probs: Tensor, mask_len: Tensor, temperature: float, uniforms: Tensor) -> Tensor:
    """mask_by_random_topk with its uniforms given: selected_probs [B, L] (decided slots: float32 max),
    mask_len [B, 1] long, uniforms [B, L] in [0, 1) -> [B, L] bool, True = masked again."""
    confidence = _log(selected_probs) + temperature * -_log(-_log(uniforms))  # log p + tau * Gumbel
    cut_off = torch.sort(confidence, dim=-1).values.gather(1, mask_len.long())
    return confidence < cut_off


@register_sampler("maskgit", MaskgitSettings)
@torch.no_grad()
def sample_maskgit(model, prompt_ids: Tensor, prompt_mask: Tensor | None, cfg: Any, *,
                   generator: Any, return_trajectory: bool = False) -> SampleOutput:
    """MMaDA's MaskGIT sampler (module doc): cfg.steps model calls over cfg.gen_length slots, completion [B, L]."""
    if return_trajectory:
        raise ValueError("rollout.name=maskgit records no trajectory; use an estimator that needs none, or "
                         "rollout.name=emerge")
    check_prompts(prompt_ids, prompt_mask)
    check_generator_given(generator, True, "rollout.name=maskgit (it draws codes and Gumbel noise)")
    steps, L = int(cfg.steps), int(cfg.gen_length)
    if steps < 1 or L < 1:
        raise ValueError(f"rollout.steps={steps} and rollout.gen_length={L} must be >= 1")
    cfg = MaskgitSettings.read(cfg, "rollout", name="maskgit")
    mask_id = model_mask_id(model)
    B, device = prompt_ids.shape[0], prompt_ids.device
    codes = codebook_range(model)  # an image model is asked for its codebook's logits only
    lo, hi = codes or model_view(model).logits_range or (0, model.vocab_size)  # the codebook's ids
    noise = StepNoise(generator, B, device)
    mask = None if prompt_mask is None else prompt_mask.bool()
    completion = torch.full((B, L), mask_id, dtype=torch.long, device=device)  # [B, L] vocabulary ids
    temperature = float(cfg.temperature)
    sampled = completion
    for step in range(steps):
        noise.begin_step(0, step)
        logits = completion_logits(model, prompt_ids, mask, completion, cfg_scale=float(cfg.cfg_scale),
                                   mask_id=mask_id, class_range=codes)  # [B, L, N], or [B, L, V] without codes
        logits = (logits if codes else logits[..., lo:hi]).float()  # [B, L, N]
        probs = logits.softmax(dim=-1)
        unknown = completion == mask_id  # [B, L]
        draw = gumbel_argmax(logits, 1.0, noise(L, hi - lo), consume=True) + lo  # x ~ p
        sampled = torch.where(unknown, draw, completion)
        ratio = (step + 1) / steps
        selected = probs.gather(-1, (sampled - lo)[..., None])[..., 0]
        del logits, probs  # [B, L, N] fp32 each: not held through the next step's model call (training.memory)
        selected = torch.where(unknown, selected, torch.finfo(selected.dtype).max)
        kept = (L * torch.cos(torch.tensor(ratio) * math.pi * 0.5)).floor()  # float32, as their cosine_schedule
        mask_len = torch.full((B, 1), int(kept), device=device)
        mask_len = mask_len.clamp(max=unknown.sum(dim=-1, keepdim=True) - 1).clamp(min=1)
        masking = maskgit_remask(selected, mask_len, temperature * (1.0 - ratio), noise(L))
        completion = torch.where(masking, mask_id, sampled)
    return SampleOutput(completion_ids=sampled, trajectory=None, nfe=steps,
                        forward_tokens=steps * B * (2 if cfg.cfg_scale > 0 else 1) * (prompt_ids.shape[1] + L))
