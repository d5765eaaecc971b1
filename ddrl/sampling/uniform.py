"""Ancestral sampler for uniform discrete diffusion: UDLM / Duo (docs/diffusion.md#uniform-diffusion).

    x_1 ~ Uniform(N classes)^L
    for k = 0 .. S-1, t = 1 - k/S, s = 1 - (k+1)/S:
        x_theta = softmax(logits[..., offset:offset+N] / temperature)     (one-hot argmax if temperature = 0)
        x_s ~ q(x_s | x_t, x_0 = x_theta)                                 (Duo's posterior, UniformProcess.posterior)
    last step (s = 0): x_0 ~ x_theta directly (argmax if temperature = 0)

Unlike the masked samplers, a uniform-diffusion token can change at every step, so the
trajectory's commit_step is the last step at which a token changed (0 if it never did).

Classifier-free guidance, LLaDA form (docs/diffusion.md#classifier-free-guidance): the
unconditional input has the prompt tokens replaced by the mask token, and logits = uncond +
(1 + w)(cond - uncond); both halves go through the model in one batched call (counted as one
function evaluation).

Time convention: t = 1 is noise (UDLM/Duo). URSA counts the other way; its metric-path CTMC jump
sampler is not this one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from ddrl.logits import kept_logits
from ddrl.contract import model_view
from ddrl.processes.draws import randint_draw, sample_categorical
from ddrl.processes.uniform import UniformProcess
from ddrl.sampling.base import SampleOutput
from ddrl.sampling.checks import check_prompts
from ddrl.sampling.settings import GuidedSettings, register_sampler
from ddrl.types import Trajectory


@dataclass
class UniformSettings(GuidedSettings):
    """What rollout.name=uniform reads: the sizes, the temperature and the guidance weight."""

    why_not: ClassVar[str] = ("uniform diffusion updates every token at every step, without blocks, cache or a commit "
                              "rule")


def _class_logits(model: Any, process: UniformProcess, prompt_ids: Tensor, uncond_prompt: Tensor | None,
                  completion: Tensor, attention_mask: Tensor, cfg_scale: float) -> Tensor:
    """The model's logits over the N classes at the completion positions, [B, L, N] float32, with CFG."""
    L = completion.shape[1]
    lo, hi = process.offset, process.offset + process.num_classes
    if uncond_prompt is None:
        ids = torch.cat([prompt_ids, completion], dim=1)  # [B, T]
        return kept_logits(model, ids, attention_mask, logits_to_keep=L)[..., lo:hi].float()  # the head on L only
    ids = torch.cat([torch.cat([prompt_ids, completion], dim=1), torch.cat([uncond_prompt, completion], dim=1)])
    logits = kept_logits(model, ids, attention_mask.repeat(2, 1), logits_to_keep=L)[..., lo:hi].float()  # [2B, L, N]
    # -inf logits (impossible tokens) would give inf - inf = NaN in the extrapolation; a large finite
    # floor keeps a token impossible under both passes impossible.
    cond, uncond = logits.clamp_min(-1e9).chunk(2, dim=0)
    return uncond + (1.0 + cfg_scale) * (cond - uncond)


def _x0_distribution(logits: Tensor, temperature: float) -> Tensor:
    """x_theta [B, L, N]: softmax at the given temperature, or one-hot argmax at temperature 0."""
    if temperature == 0.0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    return torch.softmax(logits / temperature, dim=-1)


def _check_inputs(model: Any, prompt_ids: Tensor, prompt_mask: Tensor | None,
                  section: Any) -> tuple[UniformProcess, UniformSettings]:
    process = model_view(model).process
    if not isinstance(process, UniformProcess):
        raise ValueError(f"the uniform sampler needs model.process to be a UniformProcess, got {process!r}; "
                         f"use a model pretrained with model.process=uniform, or another sampler")
    if process.offset + process.num_classes > model.vocab_size:
        raise ValueError(f"model.process covers ids {process.offset}..{process.offset + process.num_classes - 1} "
                         f"but model.vocab_size is {model.vocab_size}; fix the process's num_classes/offset")
    cfg = UniformSettings.read(section, "rollout", name="uniform")
    if cfg.cfg_scale > 0 and not 0 <= model.mask_token_id < model.vocab_size:
        raise ValueError(f"cfg_scale > 0 replaces the prompt by model.mask_token_id={model.mask_token_id}, "
                         f"which is outside the vocabulary of {model.vocab_size}; set cfg_scale=0")
    check_prompts(prompt_ids, prompt_mask)
    return process, cfg


@register_sampler("uniform", UniformSettings)
@torch.no_grad()
def sample_uniform(model: Any, prompt_ids: Tensor, prompt_mask: Tensor | None, cfg: Any, *,
                   generator: torch.Generator, return_trajectory: bool = False) -> SampleOutput:
    """Generate cfg.gen_length tokens per prompt with cfg.steps ancestral steps (module docstring).

    prompt_ids: [B, P] left-padded; prompt_mask: [B, P] bool (None = no padding). Returns the
    completion [B, L] in full-vocabulary ids (class + offset). With return_trajectory, also
    states [B, S, L] (the completion entering each step), step_times [S] (t entering each step),
    token_probs [B, S, L] (x_theta of the final token at each step) and commit_step [B, L].
    Recording token_probs keeps x_theta of every step, S*B*L*N floats.
    """
    process, cfg = _check_inputs(model, prompt_ids, prompt_mask, cfg)
    device = prompt_ids.device
    B, L, S, N = prompt_ids.shape[0], cfg.gen_length, cfg.steps, process.num_classes
    prompt_mask = torch.ones_like(prompt_ids, dtype=torch.bool) if prompt_mask is None else prompt_mask.bool()
    attention_mask = torch.cat([prompt_mask, torch.ones(B, L, dtype=torch.bool, device=device)], dim=1)  # [B, T]
    uncond_prompt = None
    if cfg.cfg_scale > 0:
        uncond_prompt = torch.where(prompt_mask, torch.full_like(prompt_ids, model.mask_token_id), prompt_ids)

    x = randint_draw(N, (B, L), generator=generator, device=device)  # classes, x_1 ~ uniform prior
    last_change = torch.zeros(B, L, dtype=torch.long, device=device)
    states, x0_history = [], []
    for k in range(S):
        t, s = 1.0 - k / S, 1.0 - (k + 1) / S
        logits = _class_logits(model, process, prompt_ids, uncond_prompt, x + process.offset, attention_mask,
                               cfg.cfg_scale)  # [B, L, N]
        x0_probs = _x0_distribution(logits, cfg.temperature)
        if k == S - 1:  # s = 0: the clean sample comes straight from the x0 prediction
            x_next = x0_probs.argmax(-1) if cfg.temperature == 0.0 else sample_categorical(x0_probs, generator=generator)
        else:
            x_next = sample_categorical(process.posterior(x0_probs, x, t, s), generator=generator)
        if return_trajectory:
            states.append(x + process.offset)
            x0_history.append(x0_probs)
        last_change = torch.where(x_next != x, torch.full_like(last_change, k), last_change)
        x = x_next

    trajectory = None
    if return_trajectory:
        x0_all = torch.stack(x0_history, dim=1)  # [B, S, L, N]
        final = x[:, None, :, None].expand(B, S, L, 1)
        trajectory = Trajectory(
            commit_step=last_change,
            token_probs=x0_all.gather(-1, final).squeeze(-1),  # [B, S, L]
            states=torch.stack(states, dim=1),  # [B, S, L]
            step_times=torch.tensor([1.0 - k / S for k in range(S)], device=device),  # [S]
        )
    return SampleOutput(completion_ids=x + process.offset, trajectory=trajectory, nfe=S)
