"""The trajectory record of the masked-diffusion samplers (ddrl.sampling.masked, ddrl.sampling.dream),
taken from the logits already computed: no extra model call.

  commit_step [B, L]  global 0-based step (model call) at which each completion position was
                      committed; -1 for positions filled with EOS by early exit.
  token_probs [B, S, L]  (None under return_trajectory=COMMIT_ORDER) softmax(logits)[final token], the model's (guided, temperature-1)
                      probability at step s of the token finally committed at the position:
                        * exact for every step of the block the position belongs to, up to its commit;
                        * after the commit step: the value at the commit step (Trajectory contract);
                        * steps before the position's block started: NaN (not recorded, see below);
                        * positions filled by early exit: NaN.
  step_times [S] (emerge only): 1 - s/T, the diffusion time entering each step of its block.
  states: None.

What to keep is the caller's choice (return_trajectory): COMMIT_ORDER keeps commit_step and
step_times only, nothing per step that scales with the vocabulary; this is all TraceRL's trace
estimator (and concrete_score's trace states) read, so a TraceRL rollout at LLaDA-8B's scale (32
rows, block 32, 32 steps per block, V = 126,464) no longer holds the 16.6 GB the fp32 [B, W, V]
buffer below would. True keeps token_probs too (DPS's weights, ddrl.estimators.dps):

The final token of a position is known only when it is committed, so exact values for earlier steps
need that step's whole distribution. Keeping it for every position at every step would cost
O(S * B * L * V); the recorder keeps it only for the block being decoded, as float32 [B, W, V] per
step, and gathers it when the block closes: peak extra memory steps_per_block * B * W * V * 4 bytes
(LLaDA, 6 rows, block 32, 16 steps per block: ~1.5 GB on the GPU; the emerge sampler's block is the
whole completion by default), freed after each block; the result is O(B * S * L).

S, and so commit_step, count the calls of the whole batch: under threshold decoding a block runs
until its slowest row is full, so a row's step indices depend on the rows decoded with it (its
tokens do not; ddrl.sampling.utils.StepNoise).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddrl.types import Trajectory


class ProbRecorder:
    """Keeps the current block's per-step distributions until its final tokens are known (module doc);
    with token_probs=False only the step times (commit_step is the sampler's own). offset: None when
    the logits it is given cover the vocabulary, else their first id (an image model's codebook
    [offset, offset + C): the emerge sampler's logits are those ids only; any other id has probability 0)."""

    def __init__(self, token_probs: bool = True, offset: int | None = None) -> None:
        self.token_probs, self.offset = token_probs, offset
        self.buffer: list[Tensor] = []  # per step of the current block: [B, W, V] float32
        self.blocks: list[tuple[int, int, Tensor]] = []  # (first slot, first step, [B, n, W])
        self.times: list[float | None] = []

    def add_step(self, logits: Tensor, time: float | None, live: Tensor | None = None) -> None:
        """logits [B, W, V] of every row (the guided ones the sampler draws from; their temperature-1
        softmax is kept); live [B] bool (None = every row). A row that is not live records NaN: it has
        no entry at all (a row finished by early exit, filled with EOS). Masked on the device, without
        reading `live` on the host."""
        self.times.append(time)
        if not self.token_probs:
            return
        probs = torch.softmax(logits.float(), dim=-1)  # [B, W, V]
        if live is not None:
            probs = probs.masked_fill(~live[:, None, None], float("nan"))
        self.buffer.append(probs)

    def close_block(self, start: int, first_step: int, final: Tensor) -> None:
        """The block of slots [start, start + W) is done; final [B, W] its tokens."""
        if not self.buffer:
            return
        index = final[..., None]  # [B, W, 1]
        if self.offset is not None:  # columns of the codebook's distributions; an id outside them has probability 0
            index = index - self.offset
            inside = (index >= 0) & (index < self.buffer[0].shape[-1])
            gathered = torch.stack([_probability(p, index, inside) for p in self.buffer], dim=1)  # [B, n, W]
        else:
            gathered = torch.stack([p.gather(-1, index).squeeze(-1) for p in self.buffer], dim=1)  # [B, n, W]
        self.blocks.append((start, first_step, gathered))
        self.buffer = []

    def trajectory(self, commit_step: Tensor, num_steps: int) -> Trajectory:
        """commit_step [B, W] -> the Trajectory over the W slots and num_steps steps (module doc)."""
        times = None
        if self.times and all(t is not None for t in self.times):
            times = torch.tensor(self.times, dtype=torch.float32)
        if not self.token_probs:
            return Trajectory(commit_step=commit_step, token_probs=None, states=None, step_times=times)
        B, L = commit_step.shape
        probs = torch.full((B, num_steps, L), float("nan"), device=commit_step.device)  # [B, S, L]
        for start, first, gathered in self.blocks:
            n, W = gathered.shape[1:]
            probs[:, first:first + n, start:start + W] = gathered
        at_commit = probs.gather(1, commit_step.clamp(min=0)[:, None, :])  # [B, 1, L]
        steps = torch.arange(num_steps, device=probs.device)[None, :, None]
        after_commit = (steps > commit_step[:, None, :]) & (commit_step >= 0)[:, None, :]  # [B, S, L]
        probs = torch.where(after_commit, at_commit, probs)
        return Trajectory(commit_step=commit_step, token_probs=probs, states=None, step_times=times)


def _probability(probs: Tensor, index: Tensor, inside: Tensor) -> Tensor:
    """probs [B, W, K] at columns index [B, W, 1] -> [B, W]; 0 where not inside (NaN stays NaN: a row
    early exit filled records NaN whatever its token)."""
    got = probs.gather(-1, index.clamp(0, probs.shape[-1] - 1))
    return torch.where(inside, got, got * 0).squeeze(-1)


def take_positions(trajectory: Trajectory, take: Tensor) -> Trajectory:
    """The trajectory at completion slots `take` [B, L] (block models: each row's own L tokens out of
    the W slots of the shifted layout, ddrl.sampling.cache module doc)."""
    probs = trajectory.token_probs  # [B, S, W] or None
    return Trajectory(commit_step=trajectory.commit_step.gather(1, take),
                      token_probs=None if probs is None else probs.gather(2, take[:, None, :].expand(
                          -1, probs.shape[1], -1)),
                      states=None, step_times=trajectory.step_times)
