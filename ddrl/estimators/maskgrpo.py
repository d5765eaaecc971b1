"""MaskGRPO's importance estimation: a deterministic mask ratio per inner iteration, AR-like fading masks.

Ma et al., "Consolidating Reinforcement Learning for Multimodal Discrete Diffusion Models" (MaskGRPO),
arXiv 2510.02880 (martian422/MaskGRPO grpo/mask_grpo_trainer.py `_get_per_token_logps_uni`,
`remask_ar`, `remask_t2t`). ALGORITHMS.md §5.

Inner iteration k in {0..mu-1} uses an evenly spaced ratio truncated to [gamma, 1):

    ratio_k = min(gamma + (1 - gamma) (k+1) / mu, 0.999)
    arlike:  keep_prob(j) = clamp(c_j * (1 - ratio_k) * Lc / sum_j c_j, max=1),  c = linspace(1, 0, Lc)
             (= (1 - j/(Lc-1)) * 2(1 - ratio_k) for Lc >= 2);  mask j iff U_j > keep_prob(j)
    uniform: mask j iid with probability ratio_k (UniGRPO-style `remasking='random'`, and images)
    log pi(x^i) := log p_theta(x^i | x_masked, c)  at masked positions only (no 1/t weight)

For ratio_k >= 0.5 no keep-probability is clamped and the expected masked fraction is exactly
ratio_k. The prompt is never masked.

Which k. The estimator sees only (model, batch, seed): k is batch.extras["inner_iteration"] when
the trainer sets it, else the position of `seed` in batch.mask_seeds (old, ref and current passes
of iteration k all use mask_seeds[k], so this keeps their masks and ratio identical), else 0.
mu is the `num_iterations` field, or len(batch.mask_seeds) when it is None.

Deviation: the code spreads the AR curve over the padded completion length; we spread it over
each row's real length Lc (tokens up to the first EOS), so a short answer is not left entirely
visible; post-EOS positions are always masked and never scored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ddrl.estimators.common import completion_lengths, generator_from_seed, masked_mean, noised_forward, uniform
from ddrl.registry import ESTIMATORS
from ddrl.types import EstimatorOutput, RolloutBatch


def maskgrpo_ratio(k: int, mu: int, gamma: float) -> float:
    """MaskGRPO's mask ratio of inner iteration k of mu: min(gamma + (1-gamma)(k+1)/mu, 0.999)."""
    return min(gamma + (1.0 - gamma) * (k + 1) / mu, 0.999)


def arlike_keep_prob(lengths: Tensor, L: int, ratio: float) -> Tensor:
    """AR-like fading keep probabilities [B, L] over each row's real length (0 beyond it)."""
    j = torch.arange(L, device=lengths.device, dtype=torch.float32)[None]  # [1, L]
    Lc = lengths.float()[:, None]  # [B, 1]
    curve = (1.0 - j / (Lc - 1).clamp(min=1)).clamp(min=0) * (j < Lc)  # linspace(1, 0, Lc), zero-padded
    scale = (1.0 - ratio) * Lc / curve.sum(1, keepdim=True).clamp(min=1e-8)
    return (curve * scale).clamp(max=1.0)


@ESTIMATORS.register("maskgrpo")
@dataclass
class MaskGRPO:
    gamma: float = 0.6  # min_mask_rate, the timestep truncation (MaskGRPO text: 0.6, images: 0.8)
    mode: str = "arlike"  # arlike (AR-like fading, text) | uniform (iid at ratio_k, images / UniGRPO-style)
    num_iterations: int | None = None  # mu of the ratio schedule; None = len(batch.mask_seeds)

    name: ClassVar[str] = "maskgrpo"
    paper: ClassVar[str] = "MaskGRPO (Ma et al. 2025, arXiv 2510.02880)"
    formula: ClassVar[str] = "ratio_k = min(g+(1-g)(k+1)/mu, .999); log p(x^i | AR-fading mask at ratio_k), masked i"
    passes: ClassVar[str] = "1"
    needs_trajectory: ClassVar[bool] = False

    def iteration(self, batch: RolloutBatch, seed: int) -> tuple[int, int]:
        """(k, mu) for this call; see the module docstring."""
        mu = self.num_iterations or max(1, len(batch.mask_seeds))
        if "inner_iteration" in batch.extras:
            return int(batch.extras["inner_iteration"]), mu
        hits = (batch.mask_seeds.cpu() == int(seed)).nonzero()
        return (int(hits[0, 0]) if len(hits) else 0), mu

    def draw_mask(self, batch: RolloutBatch, ratio: float, seed: int) -> Tensor:
        """[B, L] bool, True = masked; post-EOS always masked."""
        if self.mode not in ("arlike", "uniform"):
            raise ValueError(f"maskgrpo mode must be 'arlike' or 'uniform', got {self.mode!r}")
        g = generator_from_seed(seed)
        B, L = batch.completion_ids.shape
        u = uniform((B, L), g, batch.completion_ids.device)
        real = batch.completion_mask.bool()
        if self.mode == "arlike":
            masked = u > arlike_keep_prob(completion_lengths(batch), L, ratio)
        else:
            masked = u < ratio
        return masked | ~real

    def __call__(self, model, batch: RolloutBatch, seed: int) -> EstimatorOutput:
        k, mu = self.iteration(batch, seed)
        ratio = maskgrpo_ratio(k, mu, self.gamma)
        masked = self.draw_mask(batch, ratio, seed)
        lp = noised_forward(model, batch, None, masked)  # [B, L]
        scored = masked & batch.completion_mask.bool()
        token_logp = lp * scored
        return EstimatorOutput(token_logp=token_logp, seq_logp=masked_mean(lp, scored, dim=1), mask=scored,
                               extras={"ratio": torch.tensor(ratio)})
