"""The rollout engine: prompts in, completions out, the one path that RL rollouts (`Trainer.rollout`),
evaluation (`ddrl eval`, `ddrl.evaluate`, the trainer's in-run evaluations) and `ddrl sample` share.

    engine = RolloutEngine(model, settings, sampler="masked", task=task)
    prompts = engine.encode(texts)          # tokenized, cut to settings.max_prompt_length, left-padded
    out = engine.generate(prompts.ids, prompts.mask, generator, rows_per_prompt=G)
    out.completion_ids, out.completion_mask, out.trajectory, out.completions.texts

As nanochat's `Engine.generate_batch` serves both its RL loop and its evaluations, one engine here
means training and evaluation see prompts the same way (the same template, the same cut of a long
prompt, the same padding) and draw the same tokens from the same generators: a difference between a
rollout and an evaluation sample is a difference of settings or seeds, never of code.

What stays with the caller: which prompts, which seeds (the trainer's (seed, step, group), the
evaluation's (seed, example)), and the sampler settings, which the engine passes through to the
sampler untouched. Randomness is explicit: `generate` takes a torch.Generator, or a RowGenerators of
one generator per prompt (its rows_per_prompt rows), so a prompt's completions do not depend on the
batch it is sampled in (ddrl.processes.draws).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ContextManager

import torch
from torch import Tensor

from ddrl.data import (ChatPrompt, TaskCompletions, completion_mask, model_stop_ids, pad_prompts, prompt_budget,
                       task_completions, tokenize_prompts, truncate_prompts)
from ddrl.processes.draws import RowGenerators
from ddrl.registry import SAMPLERS
from ddrl.sampling.base import sample_in_chunks
from ddrl.types import Trajectory


@dataclass
class EncodedPrompts:
    """Prompts as the model takes them."""

    ids: Tensor  # [N, P] long, left-padded with the pad id
    mask: Tensor  # [N, P] bool, True on real prompt tokens
    truncated: int  # how many of the N were longer than max_prompt_length and kept their last tokens


@dataclass
class Rollout:
    """The completions of one `generate` call, row i from prompt i // rows_per_prompt."""

    prompt_ids: Tensor  # [B, P] long, each prompt repeated rows_per_prompt times
    prompt_mask: Tensor  # [B, P] bool
    completion_ids: Tensor  # [B, L] long, the generated tokens
    completion_mask: Tensor  # [B, L] bool, True up to and including the first stop token
    trajectory: Trajectory | None  # recorded when asked (return_trajectory)
    completions: TaskCompletions  # what the task scores: texts, and images for an image task
    nfe: int  # model calls the sampler made
    forward_tokens: int | None  # rows x tokens fed to the model over the calls (None = not counted)


class RolloutEngine:
    """Samples completions of a model with fixed sampler settings.

    model:        the policy (the unwrapped module: the sampler calls it directly).
    settings:     the sampler settings, passed to the sampler as they are; the engine reads its
                  max_prompt_length and gen_length (the prompt budget) and batch_rows (sample_in_chunks).
    sampler:      the registered sampler's name (already resolved for this model).
    task:         whose modality turns ids into completions (ddrl.data.task_completions); None = text.
    device:       where the prompts go; the model's parameters' device by default.
    context:      entered around the sampler calls only (the trainer's autocast and FSDP all-gather);
                  the completions are decoded outside it.
    option_names: the names of max_prompt_length and gen_length in the caller's words, for the errors
                  (config keys, or the command line's flags).
    """

    def __init__(self, model: Any, settings: Any, *, sampler: str, task: Any = None,
                 device: torch.device | str | None = None, context: Callable[[], ContextManager] | None = None,
                 option_names: tuple[str, str] = ("rollout.max_prompt_length", "rollout.gen_length")):
        self.model, self.settings, self.sampler, self.task = model, settings, sampler, task
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.context = context or contextlib.nullcontext
        # the most prompt tokens the model takes beside gen_length; a max_prompt_length that does not fit
        # is refused here, before any compute (ddrl.data.prompt_budget)
        self.max_prompt = prompt_budget(model, settings, *option_names)

    def encode(self, prompts: Sequence[str | ChatPrompt]) -> EncodedPrompts:
        """Tokenize (chat template and BOS included), keep the last max_prompt_length tokens of a longer
        prompt (as TRL and d1 do), left-pad to the widest; a prompt still over the budget is an error."""
        tokenizer = self.model.tokenizer
        rows, truncated = truncate_prompts(tokenize_prompts(tokenizer, prompts),
                                           getattr(self.settings, "max_prompt_length", None))
        ids, mask = pad_prompts(rows, tokenizer.pad_token_id, max_length=self.max_prompt, device=self.device)
        return EncodedPrompts(ids, mask, truncated)

    @torch.no_grad()
    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, generator: torch.Generator | RowGenerators, *,
                 rows_per_prompt: int = 1, return_trajectory: Any = False) -> Rollout:
        """rows_per_prompt completions of each prompt [N, P]: B = N x rows_per_prompt rows, sampled in
        calls of at most settings.batch_rows rows (sample_in_chunks), in eval mode (no dropout; the
        model's mode is restored after)."""
        prompt_ids = prompt_ids.repeat_interleave(rows_per_prompt, 0)  # [B, P]
        prompt_mask = prompt_mask.repeat_interleave(rows_per_prompt, 0)
        was_training = self.model.training
        self.model.eval()
        try:
            with self.context():
                out = sample_in_chunks(SAMPLERS.get(self.sampler), self.model, prompt_ids, prompt_mask, self.settings,
                                       generator=generator, return_trajectory=return_trajectory)
        finally:
            self.model.train(was_training)
        ids = out.completion_ids
        return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=ids,
                       completion_mask=completion_mask(ids, model_stop_ids(self.model)), trajectory=out.trajectory,
                       completions=task_completions(self.model, self.task, ids), nfe=out.nfe,
                       forward_tokens=out.forward_tokens)
