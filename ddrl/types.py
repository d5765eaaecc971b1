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


# The RolloutBatch.extras keys whose value is per row: a [B, ...] tensor whose row i belongs to row i of
# the batch. RolloutBatch.index slices these and only these, and refuses one whose first dimension is
# not the batch's; every other extra belongs to the whole batch and a sub-batch keeps it as it is,
# whatever its shape (a [B', ...] tensor whose B' happens to equal B is not cut). A method that adds a
# per-row extra names it here.
ROW_EXTRAS: frozenset[str] = frozenset({
    "dps_weights",  # [B, L] float: DACA's denoising-progress token weights (TokenPPO.prepare, objectives/ppo.py)
    "trace_states",  # [B, S] bool: the trace states a TraceRL micro-batch computes (estimators/trace.py row_selection)
    "copy_rows",  # [B, C] bool: the masked copies a UniGRPO micro-batch computes (estimators/random_ratio.py)
    "step_predictions",  # [B, S, L] long: each sampler step's output, when a caller records its own (estimators/udm.py)
})


@dataclass
class RolloutBatch:
    """G completions for each of a few prompts, with what RL needs to learn from them.

    Rows are grouped: rows [g*G, (g+1)*G) share a prompt and group id g. Every field says whether it is
    per row (its first dimension or length is B; `index` cuts it) or the batch's (a sub-batch keeps it).
    """

    prompt_ids: Tensor  # [B, P] long, left-padded with the pad id
    prompt_mask: Tensor  # [B, P] bool, True on real prompt tokens
    completion_ids: Tensor  # [B, L] long, generated tokens (after EOS: EOS/pad fill)
    completion_mask: Tensor  # [B, L] bool, True on tokens up to and including the first EOS
    group_ids: Tensor  # [B] long, which prompt group the row belongs to
    rewards: Tensor  # [B] float, NaN where the reward was not applicable (None) or invalid
    advantages: Tensor  # [B] float, 0 for rows with an invalid reward
    mask_seeds: Tensor  # [K] long, one estimator-noise seed per inner iteration (the batch's)
    completions: list[str] = field(default_factory=list)  # [B] decoded completions
    trajectory: Trajectory | None = None  # per row; recorded by the sampler when the method needs it

    # The rollout's and the reward's (Trainer.rollout, Trainer.score), per row.
    examples: list[dict[str, Any]] = field(default_factory=list)  # [B] the task example of each row (reward columns)
    reward_inputs: dict[str, Tensor] = field(default_factory=dict)  # name -> [B, ...]: images=[B, 3, H, W] for image
    #                                                                  tasks; emptied once the reward has read it
    reward_failed: Tensor | None = None  # [B] bool, the reward itself gave None/NaN; None before scoring
    reward_invalid: Tensor | None = None  # [B] bool, failed or cut off (train.truncated_reward=null), before
    #                                       method.invalid_reward=zero scores it 0; None before scoring
    # The rollout's and the reward's, the batch's.
    nfe: int = 0  # sampler model calls (rollout/model_calls)
    forward_tokens: int = 0  # rows x tokens the sampler fed the model (rollout/forward_tokens)
    truncated_prompts: int = 0  # of the whole step's prompts, how many were cut to rollout.max_prompt_length
    reward_parts: dict[str, tuple[float, float]] = field(default_factory=dict)  # composite reward part ->
    #                                                 (sum, count) of its finite scores over the rows (reward/<part>)
    # The update planner's (ddrl.training.update_plan), the micro-batch's.
    groups: list[int] | None = None  # its groups' step-global indices in row order (mask seeds); None = not planned
    padding: bool = False  # a zero-weight micro-batch: it runs the passes and collectives, its loss is 0
    # Method-specific values: per row exactly the keys in ROW_EXTRAS, the batch's otherwise
    # ("inner_iteration": int, which inner iteration an estimator call serves, read by MaskGRPO).
    extras: dict[str, Any] = field(default_factory=dict)

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
        """A sub-batch (micro-batch) of rows: every per-row value cut to them, the batch's values kept."""
        cut = lambda name, value: None if value is None else self._rows(name, value, rows)  # noqa: E731
        return RolloutBatch(
            prompt_ids=self.prompt_ids[rows],
            prompt_mask=self.prompt_mask[rows],
            completion_ids=self.completion_ids[rows],
            completion_mask=self.completion_mask[rows],
            group_ids=self.group_ids[rows],
            rewards=self.rewards[rows],
            advantages=self.advantages[rows],
            mask_seeds=self.mask_seeds,
            completions=self._rows("completions", self.completions, rows) if self.completions else [],  # [] = none
            trajectory=None if self.trajectory is None else self.trajectory.index(rows),
            examples=self._rows("examples", self.examples, rows) if self.examples else [],
            reward_inputs={k: self._rows(f"reward_inputs[{k!r}]", v, rows) for k, v in self.reward_inputs.items()},
            reward_failed=cut("reward_failed", self.reward_failed),
            reward_invalid=cut("reward_invalid", self.reward_invalid),
            nfe=self.nfe, forward_tokens=self.forward_tokens, truncated_prompts=self.truncated_prompts,
            reward_parts=self.reward_parts, groups=self.groups, padding=self.padding,
            extras={k: cut(f"extras[{k!r}]", v) if k in ROW_EXTRAS else v for k, v in self.extras.items()},
        )

    def _rows(self, name: str, value: Any, rows: Tensor | slice) -> Any:
        """value[rows] for a per-row value; an error naming it when its length is not the batch's."""
        n = len(self)
        if isinstance(value, Tensor):
            if value.dim() == 0 or value.shape[0] != n:
                raise ValueError(f"RolloutBatch.{name} has shape {list(value.shape)} but is per row: its first "
                                 f"dimension must be the batch's {n} rows (a value of the whole batch belongs in "
                                 f"extras under a key outside ROW_EXTRAS)")
            return value[rows]
        if not isinstance(value, list) or len(value) != n:
            raise ValueError(f"RolloutBatch.{name} is per row and must be a [{n}, ...] tensor or a list of {n}, got "
                             f"{type(value).__name__}{f' of {len(value)}' if isinstance(value, list) else ''}")
        return [value[i] for i in rows.tolist()] if isinstance(rows, Tensor) else value[rows]


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
