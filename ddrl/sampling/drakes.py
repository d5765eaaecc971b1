"""The DRAKES / SEPO sampler of the MDLM DNA model: MDLM's DDPM ancestral steps with soft final steps.

Reference: ozekri/SEPO @ 4a4a40f, GRPO_MDLM_DNA/diffusion_gosai_update_new.py `_sample_no_gradient`
(grpo_train.py's rollouts), `_ddpm_update` and `_ddpm_update_finetune_gradient` (:695-738 and above).
Golden transition probabilities: tests/fixtures/make_sepo_dna.py, tests/unit/test_drakes_sampler.py.

    x = [mask] * L;  t_i = linspace(1, 1e-5, S + 1)[i],  dt = (1 - 1e-5) / S,  m(t) = 1 - alpha(t)
    step i:  p_x0 = softmax(subs logits at x)                     [B, L, 5], the mask never predicted
             q    = p_x0 * (m(t_i) - m(t_i - dt));  q[mask] = m(t_i - dt)    (unnormalised)
             hard steps (i < S - soft_steps): masked positions draw x ~ q / sum q; others keep their base
             soft steps (the last soft_steps = 3, config finetuning.truncate_steps): the state becomes the
               expected distribution  x <- c x + (1 - c) q / sum q  with c = 1 - x[mask]  (no draw)
    output: argmax over A, C, G, T of the final state (their straight-through argmax, value only)

With m(t) = (1 - 1e-3) t (loglinear). The soft state is fed to the CNN as a soft one-hot; MDLM's subs keeps
a position's argmax when it is not the mask. The released loop keeps the soft steps in its no-gradient
rollouts too, so rollouts are "hard until the last 3 steps, then their expectation, then argmax".
temperature 0: argmax instead of the draws (not in the released code). The model is unconditional: the
prompt must be empty (rollout.gen_length = the sequence length).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from ddrl.processes.draws import sample_categorical
from ddrl.sampling.base import SampleOutput, model_mask_id
from ddrl.sampling.settings import SamplerSettings, register_sampler
from ddrl.types import Trajectory

EPS = 1e-5  # _sample_no_gradient's eps: the last time is 1e-5
SOFT_STEPS = 3  # configs_gosai finetuning.truncate_steps


@dataclass
class DrakesSettings(SamplerSettings):
    """What rollout.name=drakes reads: the sizes and the temperature."""

    why_not: ClassVar[str] = ("the DRAKES DDPM sampler decodes the whole sequence each step, without a prompt, blocks, "
                              "cache or guidance")


def move_chance(model: Any, t: float) -> float:
    """m(t) = 1 - alpha(t) of the model's process (loglinear: (1 - 1e-3) t)."""
    return float(1.0 - model.process.alpha(torch.tensor(float(t), dtype=torch.float64)))


def subs_probs(logits: Tensor, state: Tensor, mask_id: int) -> Tensor:
    """MDLM's subs parameterisation as probabilities: softmax without the mask class, and a position whose
    (arg-max) state is not the mask carried over as its one-hot. logits [B, L, V]; state [B, L] ids or
    [B, L, V] (soft) -> [B, L, V]."""
    logits = logits.float().clone()
    logits[..., mask_id] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    ids = state.argmax(-1) if state.ndim == 3 else state
    keep = ids != mask_id
    carried = torch.nn.functional.one_hot(ids, probs.shape[-1]).to(probs.dtype)
    return torch.where(keep[..., None], carried, probs)


def ddpm_transition(p_x0: Tensor, m_t: float, m_s: float, mask_id: int) -> Tensor:
    """q_xs = p_x0 * (m_t - m_s) with the mask class set to m_s: [B, L, V], unnormalised (theirs)."""
    q = p_x0 * (m_t - m_s)
    q[..., mask_id] = m_s
    return q


def soft_update(current: Tensor, q: Tensor, mask_id: int) -> Tensor:
    """A soft step: c x + (1 - c) q / sum q with c = 1 - x[mask] (their copy_flag_temp None). [B, L, V]."""
    q = q.clamp(min=1e-10)
    q = q / q.sum(-1, keepdim=True)
    copy = 1 - current[..., mask_id:mask_id + 1]
    return copy * current + (1 - copy) * q


def _state_logits(model: Any, state: Tensor) -> Tensor:
    return model(state).logits  # [B, L, V]; a soft state [B, L, V] goes in as a soft one-hot


@register_sampler("drakes", DrakesSettings)
@torch.no_grad()
def sample_drakes(model: Any, prompt_ids: Tensor, prompt_mask: Tensor | None, cfg: Any, *,
                  generator: torch.Generator, return_trajectory: bool = False,
                  soft_steps: int = SOFT_STEPS) -> SampleOutput:
    """cfg.steps DDPM steps (the last `soft_steps` soft) for cfg.gen_length positions per row (docstring).
    Returns completion_ids [B, L] in 0..3; with return_trajectory, commit_step [B, L] (the step a base was
    drawn; the soft steps count as the final step S - 1) and token_probs [B, S, L] of the final base."""
    if prompt_ids.shape[1] != 0:
        raise ValueError(f"the drakes sampler is for the unconditional MDLM DNA model: the prompt must be empty, "
                         f"got {prompt_ids.shape[1]} prompt tokens")
    cfg = DrakesSettings.read(cfg, "rollout", name="drakes")
    mask_id = model_mask_id(model)
    B, L, S = prompt_ids.shape[0], int(cfg.gen_length), int(cfg.steps)
    V, device = int(model.vocab_size), prompt_ids.device
    temperature = float(cfg.temperature)
    times = torch.linspace(1, EPS, S + 1, dtype=torch.float64).tolist()
    dt = (1 - EPS) / S
    x = torch.full((B, L), mask_id, dtype=torch.long, device=device)
    soft: Tensor | None = None  # [B, L, V] once the soft steps start
    commit = torch.full((B, L), -1, dtype=torch.long, device=device)
    probs_per_step = []
    for i in range(S):
        m_t, m_s = move_chance(model, times[i]), move_chance(model, times[i] - dt)
        state = x if soft is None else soft
        logits = _state_logits(model, state)
        p_x0 = subs_probs(logits if temperature in (0.0, 1.0) else logits / temperature, state, mask_id)
        q = ddpm_transition(p_x0, m_t, m_s, mask_id)  # [B, L, V]
        if return_trajectory:
            probs_per_step.append(p_x0)
        if i < S - soft_steps:
            draw = q.argmax(-1) if temperature == 0.0 else sample_categorical(q, generator=generator)
            masked = x == mask_id
            x = torch.where(masked, draw, x)
            commit = torch.where(masked & (x != mask_id), torch.full_like(commit, i), commit)
        else:  # soft: the expected distribution (their _natural_sample_categorical_distrib)
            current = torch.nn.functional.one_hot(x, V).to(q.dtype) if soft is None else soft
            soft = soft_update(current, q, mask_id)
    final_state = soft if soft is not None else torch.nn.functional.one_hot(x, V).float()
    keep = torch.ones(V, dtype=torch.bool, device=device)
    keep[mask_id] = False
    completion = final_state[..., keep].argmax(-1)  # ids of the bases (mask id 4 is last: 0..3 unchanged)
    commit = torch.where(commit < 0, torch.full_like(commit, S - 1), commit)
    trajectory = None
    if return_trajectory:
        p = torch.stack(probs_per_step, dim=1)  # [B, S, L, V]
        trajectory = Trajectory(commit_step=commit,
                                token_probs=p.gather(-1, completion[:, None, :, None].expand(B, S, L, 1)).squeeze(-1))
    return SampleOutput(completion_ids=completion, trajectory=trajectory, nfe=S)
