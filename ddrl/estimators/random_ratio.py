"""Random-ratio masking: UniGRPO's log-prob proxy (MMaDA).

Yang et al., "MMaDA: Multimodal Large Diffusion Language Models", arXiv 2505.15809; the RL code is
Gen-Verse/dLLM-RL @ 10b4fd1c train/rl_llada.py (`method: random_masking`, `mask_times_per_sample`).

    t ~ U(lower, upper) per copy and sequence;  mask each real completion token iid with prob t
    log pi(x^i) := log p_theta(x^i | x_t, c)  on masked tokens only (no 1/t weight)

The prompt stays clean. As in dLLM-RL (`tail_pad` positions), tokens after the first EOS are
always masked and never scored. In dLLM-RL every copy is its own training row with its own ratio:
extras["copy_token_logp"] [C, B, L] (0 where unscored) and extras["copy_mask"] [C, B, L] keep the
copies for objectives that score rows (UniGRPO's row_token_mean). token_logp is, for the others,
a token's mean over the copies that masked it; a token no copy masked carries no signal (mask
False). seq_logp is the mean over the scored tokens (0 if none was masked).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from ddrl.estimators.common import generator_from_seed, masked_mean, noised_forward, uniform
from ddrl.registry import ESTIMATORS
from ddrl.types import EstimatorOutput, RolloutBatch


@ESTIMATORS.register("random_ratio")
@dataclass
class RandomRatio:
    lower: float = 0.1  # smallest mask ratio t (dLLM-RL lower_p)
    upper: float = 0.9  # largest mask ratio t (dLLM-RL upper_p)
    copies: int = 1  # masked copies per sequence (dLLM-RL mask_times_per_sample), batched in one call
    rows_per_call: int | None = None  # at most this many sequences per forward call (memory); None = one call

    name: ClassVar[str] = "random_ratio"
    paper: ClassVar[str] = "UniGRPO / MMaDA (Yang et al. 2025, arXiv 2505.15809)"
    formula: ClassVar[str] = "t~U(0.1,0.9); log pi(x^i) = log p(x^i | x_t) on masked tokens, no 1/t"
    passes: ClassVar[str] = "copies"
    needs_trajectory: ClassVar[bool] = False

    def __call__(self, model, batch: RolloutBatch, seed: int) -> EstimatorOutput:
        if not 0.0 <= self.lower <= self.upper <= 1.0:
            raise ValueError(f"random_ratio needs 0 <= lower <= upper <= 1, got {self.lower}, {self.upper}")
        g = generator_from_seed(seed)
        C, (B, L) = self.copies, batch.completion_ids.shape
        device = batch.completion_ids.device
        t = self.lower + (self.upper - self.lower) * uniform((C, B, 1), g, device)  # [C, B, 1]
        masked = uniform((C, B, L), g, device) < t  # [C, B, L]
        out = self.score(model, batch, masked)
        out.extras["t"] = t[..., 0].mean(0)
        return out

    def score(self, model, batch: RolloutBatch, masked: Tensor) -> EstimatorOutput:
        """The estimate for given masks [C, B, L] bool (True = masked); post-EOS is masked on top."""
        real = batch.completion_mask.bool()
        masked = masked.to(real.device) | ~real  # post-EOS always masked
        lp = noised_forward(model, batch, None, masked, rows_per_call=self.rows_per_call)  # [C, B, L]
        scored = masked & real  # [C, B, L]
        token_logp = masked_mean(lp, scored, dim=0)  # [B, L], mean over the copies that masked i
        mask = scored.any(0)
        return EstimatorOutput(token_logp=token_logp * mask, seq_logp=masked_mean(token_logp, mask, dim=1), mask=mask,
                               extras={"copy_token_logp": lp * scored, "copy_mask": scored})
