"""Dead rewards: a reward that gives None/NaN for every completion (a reward server that died, a
reward function that raises) must not be trained on, must not stop silently, and must not cost the
checkpoints made while it worked.

    a step whose rewards are all invalid, on every rank   no optimizer step (the trainer skips the update:
                                                          AdamW's momentum moves the weights on a zero gradient)
    train.max_invalid_steps such steps in a row          the run stops with DeadRewardError, after a checkpoint
    checkpoint rotation (train.keep_checkpoints)          keeps `valid_checkpoint`, the newest checkpoint made
                                                          at a step with valid rewards

The watch's counters live in the trainer state, so a resumed run still knows its valid checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class DeadRewardError(RuntimeError):
    """train.max_invalid_steps rollout steps in a row whose rewards were all invalid (None/NaN)."""


@dataclass
class RewardWatch:
    limit: int  # train.max_invalid_steps (0: never stop)
    streak: int = 0  # steps in a row whose rewards were all invalid
    last_valid_step: int = 0  # the newest step with a valid reward
    valid_checkpoint: int | None = None  # the newest checkpoint made with valid rewards: never rotated away

    def record(self, step: int, all_invalid: bool) -> bool:
        """The step's verdict (the same on every rank); True when the run must stop."""
        if not all_invalid:
            self.streak, self.last_valid_step = 0, step
            return False
        self.streak += 1
        return bool(self.limit) and self.streak >= self.limit

    def checkpoint(self, step: int) -> dict[str, Any]:
        """A checkpoint of `step` is being written: its trainer-state entries."""
        valid = self.last_valid_step == step
        if valid:
            self.valid_checkpoint = step
        return {"rewards_valid": valid, "last_valid_step": self.last_valid_step,
                "valid_checkpoint": self.valid_checkpoint}

    def resume(self, state: dict[str, Any], step: int) -> None:
        """From a trainer state; one of an older ddrl recorded nothing: its step is taken as valid."""
        self.last_valid_step = int(state.get("last_valid_step", step))
        self.valid_checkpoint = state.get("valid_checkpoint", step)

    def error(self, step: int) -> DeadRewardError:
        """What stopped the run, which checkpoint holds what, and the fix."""
        n, valid = self.streak, self.last_valid_step
        weights = (f"the weights after step {valid}, the last with a valid reward" if valid else
                   "the initial weights (no step had a valid reward)")
        kept = (f"checkpoint-{self.valid_checkpoint}, the newest made with valid rewards, is kept too"
                if self.valid_checkpoint else "no checkpoint was made with valid rewards")
        return DeadRewardError(
            f"step {step}: all rewards of the last {n} steps ({step - n + 1}-{step}) were invalid (None/NaN, "
            f"invalid fraction 1.0): is the reward server down (see the warnings above), or does the reward "
            f"function raise? No optimizer step was taken on those steps, so checkpoint-{step} holds {weights}; "
            f"{kept}. Fix the reward, then resume=true continues from checkpoint-{step} "
            f"(train.max_invalid_steps=0 never stops)")
