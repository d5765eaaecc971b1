"""URSA's sampler: the reverse CTMC of the metric path (ddrl.processes.metric_path), with its
classifier-free guidance. Yovecent/UDM-GRPO @ d1bec49, diffnext/schedulers/scheduling_dfm.py
(KineticOptimalScheduler.step, MetricDiscreteProbPath.get_velocity) and pipelines/ursa/pipeline_ursa.py
(the denoising loop); docs/diffusion.md#ursa-metric-path. Golden transition probabilities:
tests/fixtures/make_ursa.py.

    x ~ Uniform(N classes)^L                                      (flow time s(0) = 0: noise)
    for i = 0 .. S-1, s = s(i), s' = s(i + 1)   (process.inference_flow_times(S): URSA's shifted grid)
        z = the guided logits over the N classes at the completion positions
        last step (i = S-1):  x ~ softmax(z)                      (x1 sampled directly)
        else, per position:   x1^ ~ softmax(z);  v = velocity(x1^, x, s)  (v at x itself is 0)
                              jump with probability 1 - exp(-(s' - s) sum v); then x ~ v / sum v

`transition_probs` is the exact law of one such step (summed over the candidates x1^), what the
golden test compares; `ctmc_step` draws from it. The first step (s = 0, beta' = 0) never jumps, as
in theirs. Fewer steps than the model was evaluated with is UDM-GRPO's "Reduced-Step" rollout:
just a smaller rollout.steps.

Guidance (their loop): z = u + g (c - u) with g = URSA's guidance_scale while s < guidance_trunc
(0.9), z = c after; the unconditional prompt is "" (the text all padding: `unconditional_prompt`).
ddrl's cfg_scale w is the LLaDA form u + (1 + w)(c - u), so g = 1 + w: URSA's default g = 7 is
cfg_scale = 6, UDM-GRPO's rollouts (g = 1) are cfg_scale = 0 (one pass, no guidance). temperature
divides z before the softmaxes (1.0 = URSA's; 0 = argmax x1^ and argmax at the last step).

Time convention: flow time inside (s = 0 noise); the trajectory's step_times are ddrl's t = 1 - s.

Memory (ddrl.training.memory, metric_path): the model is asked for the N classes' logits only
(kept_logits' class_range; URSA's head then computes no [B, L, V] tensor), z is dropped once
softmax(z) is taken, x1^'s and the target's cdfs overwrite the probabilities they come from, and
process.velocity works in place: a step holds at most three float32 [B, L, N] tensors. Every
in-place op is the out-of-place one on the same operands, so tokens and probabilities are those of
the plain formulas bit for bit (tests/unit/test_ursa_seeded.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from ddrl.logits import kept_logits
from ddrl.contract import model_view
from ddrl.processes.draws import randint_draw, sample_categorical, uniform_draw
from ddrl.processes.metric_path import MetricPathProcess
from ddrl.sampling.base import SampleOutput
from ddrl.sampling.checks import check_prompts
from ddrl.sampling.settings import GuidedSettings, register_sampler
from ddrl.types import Trajectory

GUIDANCE_TRUNC = 0.9  # URSAPipeline's guidance_trunc: no guidance from flow time 0.9 on


@dataclass
class MetricPathSettings(GuidedSettings):
    """What rollout.name=metric_path reads: the sizes (gen_length image tokens), the temperature and URSA's
    guidance weight."""

    why_not: ClassVar[str] = "URSA's CTMC updates every image token at every step, without blocks or cache"


def x1_distribution(logits: Tensor, temperature: float = 1.0, *, in_place: bool = False) -> Tensor:
    """softmax(z / temperature) [..., N], or one-hot argmax at temperature 0. in_place: divide the
    logits themselves (a caller's own tensor, not read again), with no second [..., N] copy."""
    if temperature == 0.0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    if temperature != 1.0:  # z / 1 is z exactly: no copy
        logits = logits.div_(temperature) if in_place else logits / temperature
    return torch.softmax(logits, dim=-1)


def _jump_law(process: MetricPathProcess, x1: Tensor, xt: Tensor, s: float, dt: float) -> tuple[Tensor, Tensor]:
    """-> (jump probability [...], target weights v [..., N] with v[x_t] = 0) for candidates x1."""
    v = process.velocity(x1, xt, s).scatter_(-1, xt[..., None], 0.0)  # velocity's own tensor
    return 1 - torch.exp(-dt * v.sum(-1)), v


def transition_probs(process: MetricPathProcess, logits: Tensor, xt: Tensor, s: float, s_next: float | None, *,
                     temperature: float = 1.0, chunk: int = 64) -> Tensor:
    """The exact law of one sampler step: logits z [B, L, N] (guided), classes x_t [B, L] at flow time s
    -> P(x_next = y) [B, L, N] in float64. s_next None = the last step (P = softmax(z)). Sums over all N
    candidates x1^ (N x the cost of a step): for tests and small codebooks."""
    p1 = x1_distribution(logits.double(), temperature)  # [B, L, N]
    if s_next is None:
        return p1
    N = p1.shape[-1]
    dt = float(s_next) - float(s)
    stay = torch.nn.functional.one_hot(xt, N).double()
    out = torch.zeros_like(p1)
    for lo in range(0, N, chunk):
        cand = torch.arange(lo, min(lo + chunk, N), device=xt.device)  # [k]
        x1 = cand.view(-1, 1, 1).expand(-1, *xt.shape)  # [k, B, L]
        jump, v = _jump_law(process, x1, xt.expand_as(x1), s, dt)  # [k, B, L], [k, B, L, N]
        jump, v = jump.double(), v.double()
        total = v.sum(-1, keepdim=True)
        move = torch.where(total > 0, jump[..., None] * v / total.clamp_min(1e-300), torch.zeros_like(v))
        law = move + stay * (1 - jump[..., None])  # [k, B, L, N]
        out += (p1[..., lo:lo + len(cand)].permute(2, 0, 1)[..., None] * law).sum(0)
    return out


def ctmc_step(process: MetricPathProcess, logits: Tensor, xt: Tensor, s: float, s_next: float | None, *,
              generator: torch.Generator, temperature: float = 1.0) -> Tensor:
    """One draw from transition_probs: classes x_t [B, L] -> x_next [B, L] (draws: x1^, then the jump
    uniforms, then the targets, each through `generator`). logits are not modified."""
    x1 = draw_x1(x1_distribution(logits.float(), temperature), temperature, generator=generator, in_place=True)
    return x1 if s_next is None else jump_from(process, x1, xt, s, s_next, generator=generator)


def draw_x1(p1: Tensor, temperature: float, *, generator: torch.Generator, in_place: bool = False) -> Tensor:
    """x1^ ~ p1 [..., N] (argmax at temperature 0); in_place: p1 becomes its cdf (not read again)."""
    return p1.argmax(-1) if temperature == 0.0 else sample_categorical(p1, generator=generator, in_place=in_place)


def jump_from(process: MetricPathProcess, x1: Tensor, xt: Tensor, s: float, s_next: float, *,
              generator: torch.Generator) -> Tensor:
    """The step's jump towards candidates x1 [B, L] from x_t [B, L]: at most three [B, L, N] float32
    tensors at once, those of process.velocity (v, then its cdf, in place)."""
    jump, v = _jump_law(process, x1, xt, s, float(s_next) - float(s))
    u = uniform_draw(xt.shape, generator=generator, device=xt.device, dtype=jump.dtype)
    target = sample_categorical(v, generator=generator, in_place=True)  # rows with v = 0 never jump (jump = 0)
    return torch.where(u < jump, target, xt)


def unconditional_prompt(model: Any, prompt_ids: Tensor) -> Tensor:
    """The prompt "" in the layout of prompt_ids [B, P]: every text token is the pad id, <bov> (model.bov_token_id,
    when it has one) stays, as URSA's tokenizer pads "" to max_prompt_length."""
    view = model_view(model)
    pad = model.mask_token_id if view.pad_token_id is None else view.pad_token_id
    keep = torch.zeros_like(prompt_ids, dtype=torch.bool)
    bov = view.bov_token_id
    if bov is not None:
        keep = prompt_ids == bov
    return torch.where(keep, prompt_ids, torch.full_like(prompt_ids, int(pad)))


def guided_logits(model: Any, process: MetricPathProcess, prompt_ids: Tensor, uncond_prompt: Tensor | None,
                  completion: Tensor, attention_mask: Tensor, guidance_scale: float) -> Tensor:
    """Logits over the N classes at the completion positions [B, L, N] (float32): z = u + g (c - u), or the
    conditional logits alone when uncond_prompt is None or g == 1 (one pass). The model is asked for
    the N classes' logits only (kept_logits' class_range: URSA's head then computes no others)."""
    L, classes = completion.shape[1], (process.offset, process.offset + process.num_classes)
    cond_ids = torch.cat([prompt_ids, completion], dim=1)
    if uncond_prompt is None or guidance_scale == 1.0:
        return kept_logits(model, cond_ids, attention_mask, logits_to_keep=L, class_range=classes).float()
    ids = torch.cat([cond_ids, torch.cat([uncond_prompt, completion], dim=1)])
    logits = kept_logits(model, ids, attention_mask.repeat(2, 1), logits_to_keep=L, class_range=classes).float()
    cond, uncond = logits.chunk(2, dim=0)
    return (cond - uncond).mul_(guidance_scale).add_(uncond)  # = u + g (c - u) bit for bit, one temporary


def _check_inputs(model: Any, prompt_ids: Tensor, prompt_mask: Tensor | None,
                  section: Any) -> tuple[MetricPathProcess, MetricPathSettings]:
    process = model_view(model).process
    if not isinstance(process, MetricPathProcess):
        raise ValueError(f"the metric_path sampler needs model.process to be a MetricPathProcess (URSA, or a "
                         f"model whose process_spec names 'metric_path'), got {process!r}")
    cfg = MetricPathSettings.read(section, "rollout", name="metric_path")
    if cfg.gen_length <= 0:
        raise ValueError(f"rollout.gen_length must be the number of image tokens, got {cfg.gen_length}")
    check_prompts(prompt_ids, prompt_mask)
    return process, cfg


@register_sampler("metric_path", MetricPathSettings)
@torch.no_grad()
def sample_metric_path(model: Any, prompt_ids: Tensor, prompt_mask: Tensor | None, cfg: Any, *,
                       generator: torch.Generator, return_trajectory: bool = False,
                       guidance_trunc: float = GUIDANCE_TRUNC) -> SampleOutput:
    """Generate cfg.gen_length class tokens per prompt with cfg.steps CTMC steps (module docstring).

    prompt_ids [B, P] (URSA: the text padded to max_prompt_length, then <bov>); prompt_mask [B, P] or None.
    Returns the completion [B, L] in vocabulary ids (class + offset). With return_trajectory: states
    [B, S, L] entering each step, step_times [S] (ddrl t = 1 - s), token_probs [B, S, L] (softmax(z) of
    the final token at each step) and commit_step [B, L] (the last step that changed each position).
    """
    process, cfg = _check_inputs(model, prompt_ids, prompt_mask, cfg)
    device = prompt_ids.device
    B, L, S, N = prompt_ids.shape[0], cfg.gen_length, cfg.steps, process.num_classes
    prompt_mask = torch.ones_like(prompt_ids, dtype=torch.bool) if prompt_mask is None else prompt_mask.bool()
    attention_mask = torch.cat([prompt_mask, torch.ones(B, L, dtype=torch.bool, device=device)], dim=1)
    scale = 1.0 + float(cfg.cfg_scale)
    uncond = unconditional_prompt(model, prompt_ids) if scale > 1.0 else None
    grid = process.inference_flow_times(S).tolist()  # [S + 1]
    temperature = float(cfg.temperature)

    x = randint_draw(N, (B, L), generator=generator, device=device)  # classes at s = 0
    last_change = torch.zeros(B, L, dtype=torch.long, device=device)
    states, probs = [], []
    for i in range(S):
        s = grid[i]
        g = scale if s < guidance_trunc else 1.0
        z = guided_logits(model, process, prompt_ids, uncond, x + process.offset, attention_mask, g)  # [B, L, N]
        # ctmc_step, with each [B, L, N] tensor dropped once read: z before the velocity's temporaries,
        # p1 (unless recorded) as it becomes its own cdf (ddrl.training.memory, metric_path)
        p1 = x1_distribution(z, temperature, in_place=True)
        del z
        if return_trajectory:
            states.append(x + process.offset)
            probs.append(p1)
        x1 = draw_x1(p1, temperature, generator=generator, in_place=not return_trajectory)
        del p1
        x_next = x1 if i == S - 1 else jump_from(process, x1, x, s, grid[i + 1], generator=generator)
        last_change = torch.where(x_next != x, torch.full_like(last_change, i), last_change)
        x = x_next

    trajectory = None
    if return_trajectory:
        final = x[..., None]  # [B, L, 1]: each record read at the final tokens, no stacked [B, S, L, N] copy
        trajectory = Trajectory(commit_step=last_change,
                                token_probs=torch.stack([p.gather(-1, final).squeeze(-1) for p in probs], dim=1),
                                states=torch.stack(states, dim=1),  # [B, S, L]
                                step_times=1 - torch.tensor(grid[:S], device=device))  # [S]
    return SampleOutput(completion_ids=x + process.offset, trajectory=trajectory, nfe=S)
