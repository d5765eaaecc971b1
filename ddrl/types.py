"""Typed batches that flow between ddrl's layers.

Shape legend used in every docstring and comment:
    B  batch size (number of sequences; for RL, prompts x G)
    P  prompt length (left-padded)
    L  completion (generation) length
    T  P + L, the full sequence length the model sees
    V  vocabulary size
    S  number of sampler steps (model calls) in a rollout
    G  group size (completions per prompt)
    K  number of inner iterations (mu) / Monte-Carlo draws
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


# return_trajectory=COMMIT_ORDER: the sampler records commit_step (and step_times) only, token_probs
# None; nothing per step scales with the vocabulary (ddrl.sampling.trajectory). True records all.
COMMIT_ORDER = "commit_order"


@dataclass
class Trajectory:
    """What a sampler records about how each completion was generated, at no extra model cost.

    commit_step:  [B, L] long. Index (0-based) of the sampler step at which position i was
                  committed (unmasked for good). Positions never generated are -1.
    token_probs:  [B, S, L] float. The model's probability, at step s, of the token finally
                  committed at position i (read from logits already computed). Steps in which
                  the position was already committed hold the value at its commit step.
    states:       optional [B, S, L] long, the completion tokens *entering* each step (for the
                  uniform sampler and for UDM-GRPO's naive variant; None when not recorded).
    step_times:   optional [S] float, the diffusion time t of each step (uniform/emerge samplers).
    """

    commit_step: Tensor
    token_probs: Tensor | None  # None when sampled with return_trajectory=COMMIT_ORDER
    states: Tensor | None = None
    step_times: Tensor | None = None

    def step_outputs(self, final: Tensor) -> Tensor:
        """[B, S, L]: what each step produced, the state entering the next step, and `final` [B, L]
        (the completion) for the last one. Needs states."""
        if self.states is None:
            raise ValueError("step_outputs needs the recorded states: sample with return_trajectory=True")
        return torch.cat([self.states[:, 1:], final[:, None].to(self.states)], dim=1)

    def to(self, device: torch.device | str) -> "Trajectory":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Trajectory(self.commit_step.to(device), move(self.token_probs), move(self.states), move(self.step_times))

    def index(self, rows: Tensor | slice) -> "Trajectory":
        pick = lambda t: None if t is None else t[rows]  # noqa: E731
        step_times = self.step_times
        return Trajectory(self.commit_step[rows], pick(self.token_probs), pick(self.states), step_times)


@dataclass
class RolloutBatch:
    """G completions for each of a few prompts, with what RL needs to learn from them.

    Rows are grouped: rows [g*G, (g+1)*G) share a prompt and group id g.
    """

    prompt_ids: Tensor  # [B, P] long, left-padded with the pad id
    prompt_mask: Tensor  # [B, P] bool, True on real prompt tokens
    completion_ids: Tensor  # [B, L] long, generated tokens (after EOS: EOS/pad fill)
    completion_mask: Tensor  # [B, L] bool, True on tokens up to and including the first EOS
    group_ids: Tensor  # [B] long, which prompt group the row belongs to
    rewards: Tensor  # [B] float, NaN where the reward was not applicable (None) or invalid
    advantages: Tensor  # [B] float, 0 for rows with an invalid reward
    mask_seeds: Tensor  # [K] long, one estimator-noise seed per inner iteration
    completions: list[str] = field(default_factory=list)  # decoded completions, length B
    trajectory: Trajectory | None = None  # recorded by the sampler when the method needs it
    extras: dict[str, Any] = field(default_factory=dict)  # method-specific (e.g. UDM timesteps)

    @property
    def input_ids(self) -> Tensor:  # [B, T]
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:  # [B, T] bool; completion positions are always attended
        return torch.cat([self.prompt_mask, torch.ones_like(self.completion_mask)], dim=1)

    @property
    def reward_valid(self) -> Tensor:  # [B] bool
        return torch.isfinite(self.rewards)

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    def index(self, rows: Tensor | slice) -> "RolloutBatch":
        """A sub-batch (micro-batch) of rows; mask seeds are shared by all rows."""
        if isinstance(rows, Tensor):
            completions = [self.completions[i] for i in rows.tolist()] if self.completions else []
        else:
            completions = self.completions[rows]
        extras = {k: (v[rows] if isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] == len(self) else v)
                  for k, v in self.extras.items()}
        return RolloutBatch(
            prompt_ids=self.prompt_ids[rows],
            prompt_mask=self.prompt_mask[rows],
            completion_ids=self.completion_ids[rows],
            completion_mask=self.completion_mask[rows],
            group_ids=self.group_ids[rows],
            rewards=self.rewards[rows],
            advantages=self.advantages[rows],
            mask_seeds=self.mask_seeds,
            completions=completions,
            trajectory=None if self.trajectory is None else self.trajectory.index(rows),
            extras=extras,
        )


@dataclass
class EstimatorOutput:
    """A likelihood proxy for the completions of a batch, from one estimator call.

    token_logp:  [B, L] float or None. Per-token log-prob proxy log pi(x^i | ...), 0 where mask is False.
    seq_logp:    [B] float or None. Per-sequence proxy (ELBO, denoise log-prob, SPG bound ...).
    mask:        [B, L] bool. Positions whose token_logp carries signal (masked-and-scored tokens,
                 or the completion mask for one-step estimators).
    extras:      anything else a method may need: "elbo" [B], "eubo" [B], "logits" [B, L, V],
                 "weights" [B, L]; "per_draw" [B, M] (coupled_elbo: each Monte-Carlo draw, GDSD
                 regresses each); "copy_token_logp" / "copy_mask" [C, B, L] (random_ratio: every
                 masked copy, a training row of UniGRPO); "trace_step" [B, L] long (trace: the
                 state scoring each token, -1 unscored; a TraceRL training row per state) ...
    """

    token_logp: Tensor | None
    seq_logp: Tensor | None
    mask: Tensor
    extras: dict[str, Tensor] = field(default_factory=dict)

    def detach(self) -> "EstimatorOutput":
        d = lambda t: None if t is None else t.detach()  # noqa: E731
        return EstimatorOutput(d(self.token_logp), d(self.seq_logp), self.mask,
                               {k: v.detach() for k, v in self.extras.items()})


@dataclass
class LossOutput:
    """A scalar loss to backpropagate and detached statistics to log (tensors until logging)."""

    loss: Tensor  # [] float, with grad
    stats: dict[str, Tensor] = field(default_factory=dict)  # name -> detached [] tensor
