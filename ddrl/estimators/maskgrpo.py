"""MaskGRPO's importance estimation: a deterministic mask ratio per inner iteration, AR-like fading masks.

Ma et al., "Consolidating Reinforcement Learning for Multimodal Discrete Diffusion Models" (MaskGRPO),
arXiv 2510.02880 (martian422/MaskGRPO grpo/mask_grpo_trainer.py `_get_per_token_logps_uni`,
`remask_ar`, `remask_t2t`). See docs/methods.md.

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

form="paper" (default), as the paper describes: the AR curve spans each row's real length Lc
(tokens up to the first EOS), post-EOS positions are masked but never scored, and only this
iteration's masked real tokens are scored.

form="released" reproduces the released trainer (golden test tests/unit/test_golden_maskgrpo.py):
  * its remask_ar reads the prompt length as prompt_index[0].sum() = 1 (prompt_index is 1-D), so
    the AR curve spans P + L - 1 positions of prompt and padded completion and the completion gets
    its tail: keep_prob(j) = clamp(2 (1 - ratio_k) (1 - (P-1+j)/(P+L-2)), max=1), P = the row's real
    prompt length; the completion is masked more than ratio_k;
  * every completion position can be masked and is scored, post-EOS filler included;
  * the masks of all mu iterations ([mu, B, L], drawn from batch.mask_seeds) are what compute_loss
    multiplies the loss by, so a position is scored when any iteration masked it, weighted by how
    many did: extras["position_weights"] [B, L]; the log-probs are still those of iteration k's
    forward. Pair it with the objective's aggregation="group_weighted_token_mean".
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


def released_keep_prob(prompt_lengths: Tensor, L: int, ratio: float) -> Tensor:
    """The released remask_ar's keep probabilities [B, L] of the completion positions.

    Its curve is linspace(1, 0, n) over n = P + L - 1 positions (prompt from its second token, then
    the padded completion), scaled by (1 - ratio) n / sum; completion position j sits at P - 1 + j.
    """
    n = (prompt_lengths.float() + L - 1)[:, None]  # [B, 1]
    m = prompt_lengths.float()[:, None] - 1 + torch.arange(L, device=prompt_lengths.device, dtype=torch.float32)
    curve = 1.0 - m / (n - 1).clamp(min=1)  # linspace(1, 0, n)[m]
    total = torch.where(n > 1, n / 2, torch.ones_like(n))  # sum of linspace(1, 0, n)
    return (curve * (1.0 - ratio) * n / total).clamp(max=1.0)


FORMS = ("paper", "released")


@ESTIMATORS.register("maskgrpo")
@dataclass
class MaskGRPOEstimator:
    gamma: float = 0.6  # min_mask_rate, the timestep truncation (MaskGRPO text: 0.6, images: 0.8)
    mode: str = "arlike"  # arlike (AR-like fading, text) | uniform (iid at ratio_k, images / UniGRPO-style)
    num_iterations: int | None = None  # mu of the ratio schedule; None = len(batch.mask_seeds)
    form: str = "paper"  # paper | released: the released trainer's masks and scored positions (module doc)

    name: ClassVar[str] = "maskgrpo"
    paper: ClassVar[str] = "MaskGRPO (Ma et al. 2025, arXiv 2510.02880)"
    formula: ClassVar[str] = "ratio_k = min(g+(1-g)(k+1)/mu, .999); log p(x^i | AR-fading mask at ratio_k), masked i"
    passes: ClassVar[str] = "1"
    copies_per_row: ClassVar[int] = 1  # copies of a row in one call's graph (memory's k)
    needs_trajectory: ClassVar[bool] = False

    def iteration(self, batch: RolloutBatch, seed: int) -> tuple[int, int]:
        """(k, mu) for this call; see the module docstring."""
        mu = self.num_iterations or max(1, len(batch.mask_seeds))
        if "inner_iteration" in batch.extras:
            return int(batch.extras["inner_iteration"]), mu
        hits = (batch.mask_seeds.cpu() == int(seed)).nonzero()
        return (int(hits[0, 0]) if len(hits) else 0), mu

    def __post_init__(self) -> None:
        if self.mode not in ("arlike", "uniform"):
            raise ValueError(f"maskgrpo mode must be 'arlike' or 'uniform', got {self.mode!r}")
        if self.form not in FORMS:
            raise ValueError(f"maskgrpo form must be one of {', '.join(FORMS)}, got {self.form!r}")

    def keep_prob(self, batch: RolloutBatch, ratio: float) -> Tensor:
        """arlike keep probabilities [B, L] of this form."""
        L = batch.completion_ids.shape[1]
        if self.form == "released":
            return released_keep_prob(batch.prompt_mask.long().sum(1), L, ratio)
        return arlike_keep_prob(completion_lengths(batch), L, ratio)

    def mask_from_uniforms(self, batch: RolloutBatch, u: Tensor, ratio: float) -> Tensor:
        """[B, L] bool, True = masked, from uniforms u [B, L] (form paper: post-EOS always masked)."""
        masked = u > self.keep_prob(batch, ratio) if self.mode == "arlike" else u < ratio
        return masked if self.form == "released" else masked | ~batch.completion_mask.bool()

    def draw_mask(self, batch: RolloutBatch, ratio: float, seed: int) -> Tensor:
        """[B, L] bool, True = masked, drawn from `seed`."""
        u = uniform(tuple(batch.completion_ids.shape), generator_from_seed(seed), batch.completion_ids.device)
        return self.mask_from_uniforms(batch, u, ratio)

    def iteration_masks(self, batch: RolloutBatch, seed: int) -> tuple[Tensor, int]:
        """(masks, k): this call's mask [1, B, L], or with form="released" those of all mu iterations
        [mu, B, L] (iteration j from batch.mask_seeds[j], this one from `seed`)."""
        k, mu = self.iteration(batch, seed)
        if self.form != "released":
            return self.draw_mask(batch, maskgrpo_ratio(k, mu, self.gamma), seed)[None], 0
        if len(batch.mask_seeds) < mu:
            raise ValueError(f"maskgrpo form='released' scores the masks of all {mu} iterations, but the batch "
                             f"has {len(batch.mask_seeds)} mask seeds; give one seed per inner iteration")
        seeds = [seed if j == k else int(batch.mask_seeds[j]) for j in range(mu)]
        return torch.stack([self.draw_mask(batch, maskgrpo_ratio(j, mu, self.gamma), s)
                            for j, s in enumerate(seeds)]), k

    def score(self, model, batch: RolloutBatch, masks: Tensor, k: int) -> EstimatorOutput:
        """The estimate for given masks [K, B, L] of which masks[k] feeds this forward.

        paper: K = 1, scored = masks[0] on real tokens. released: scored = any mask, weighted by
        the number of masks covering the position (extras["position_weights"]).
        """
        current = masks[k].bool()
        lp = noised_forward(model, batch, None, current)  # [B, L]
        extras: dict[str, Tensor] = {}
        if self.form == "released":
            weights = masks.to(lp.dtype).sum(0)  # [B, L] iterations masking each position
            scored = weights > 0
            extras["position_weights"] = weights
        else:
            scored = current & batch.completion_mask.bool()
        return EstimatorOutput(token_logp=lp * scored, seq_logp=masked_mean(lp, current & scored, dim=1),
                               mask=scored, extras=extras)

    def __call__(self, model, batch: RolloutBatch, seed: int) -> EstimatorOutput:
        masks, k = self.iteration_masks(batch, seed)
        out = self.score(model, batch, masks, k)
        out.extras["ratio"] = torch.tensor(maskgrpo_ratio(*self.iteration(batch, seed), self.gamma))
        return out
