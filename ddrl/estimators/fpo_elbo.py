"""FPO's few-sample sequence ELBO: the proxy of DiPOD's FPO variant.

Jiang et al., "DiPOD: Diffusion Policy Optimization without Drifting Apart", arXiv 2606.13795
(Astro-Eric/DiPOD-release language/d1/diffu-grpo/diffu_grpo_trainer.py `_get_sequence_elbo`).
See docs/methods.md.

    u_n ~ U(0, 1),  k_n = max(min_masked, floor(u_n * Lc)),  S_n = k_n uniformly random real completion positions
    ELBO(x) = mean_{n=1..num_samples} (Lc / max(k_n, 1)) * sum_{i in S_n} log p_theta(x^i | x with S_n masked, c)

As in the code: the prompt and the post-EOS fill stay clean, and with min_masked = 0 (default, the
code) a draw with k_n = 0 masks nothing and contributes 0 (its weight's denominator is clamped to
1); min_masked = 1 masks at least one token, giving k = 1 probability 2/Lc. Since u < 1, k_n < Lc:
the fully-masked count is never drawn. So with min_masked = 0 the estimator is unbiased for
    sum_{k=1..Lc-1} (1/k) E_{|S|=k}[ sum_{i in S} log p(x^i | x_{-S}) ],
LLaDA's discrete ELBO without its k = Lc term (tested by exact enumeration).
token_logp holds each token's share (Lc/k_n) log p averaged over draws (0 where never masked), so it
sums to seq_logp.

exclude_eos=True: as released, whose completion mask stops BEFORE the first EOS, the EOS token is
never masked nor scored and Lc counts the tokens before it (a row without EOS keeps all L). The
stop ids are the model's (`ddrl.data.model_stop_ids`). FPO and DiPOD set it by default
(their default_estimator_args). The released trainer draws these masks once per rollout and
reuses them for every inner iteration (the objectives' `reuse_masks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ddrl.data import is_stop, model_stop_ids
from ddrl.estimators.common import generator_from_seed, noised_forward, random_subset_mask, uniform
from ddrl.registry import ESTIMATORS
from ddrl.types import EstimatorOutput, RolloutBatch


@ESTIMATORS.register("fpo_elbo")
@dataclass
class FPOElbo:
    num_samples: int = 4  # random masks per sequence (DiPOD: elbo_num_samples = 4)
    min_masked: int = 0  # k_n = max(min_masked, floor(u_n Lc)); 0 = DiPOD's code (k = 0 draws contribute 0)
    exclude_eos: bool = False  # True = released: the first stop token is neither masked nor counted in Lc
    rows_per_call: int | None = None  # at most this many sequences per forward call (memory); None = one call

    name: ClassVar[str] = "fpo_elbo"
    paper: ClassVar[str] = "DiPOD-FPO (Jiang et al. 2026, arXiv 2606.13795)"
    formula: ClassVar[str] = "ELBO = mean_n (Lc/k_n) sum_{i in S_n} log p(x^i | x_-S_n), k_n = floor(u_n Lc)"
    passes: ClassVar[str] = "num_samples"
    needs_trajectory: ClassVar[bool] = False

    @property
    def copies_per_row(self) -> int:
        """Copies of a row in one call's forward and backward graph (ddrl.training.memory's k)."""
        return self.num_samples

    def eligible(self, batch: RolloutBatch, model=None) -> Tensor:
        """[B, L] bool: the positions a draw may mask (the completion, without its EOS if exclude_eos)."""
        real = batch.completion_mask.bool()
        if not self.exclude_eos:
            return real
        if model is None:
            raise ValueError("fpo_elbo with exclude_eos=True needs the model, whose stop ids mark the EOS")
        return real & ~is_stop(batch.completion_ids, model_stop_ids(model))

    def draw_masks(self, batch: RolloutBatch, seed: int, model=None) -> Tensor:
        """The draws' masked sets S_n, [num_samples, B, L] bool (model: for exclude_eos's stop ids)."""
        g = generator_from_seed(seed)
        B = batch.completion_ids.shape[0]
        eligible = self.eligible(batch, model)
        lengths = eligible.long().sum(1)  # [B] Lc
        k = (uniform((self.num_samples, B), g, lengths.device) * lengths).long()  # [N, B] in {0..Lc-1}
        k = k.clamp(min=self.min_masked)
        return random_subset_mask(k, eligible[None].expand(self.num_samples, -1, -1), g)

    def score(self, model, batch: RolloutBatch, masks: Tensor) -> EstimatorOutput:
        """The ELBO for given masked sets S_n [N, B, L] (k_n = |S_n|)."""
        eligible = self.eligible(batch, model)
        masks = masks & eligible[None]
        lp = noised_forward(model, batch, None, masks, rows_per_call=self.rows_per_call)  # [N, B, L]
        k = masks.float().sum(-1, keepdim=True)  # [N, B, 1]
        weight = eligible.float().sum(1)[None, :, None] / k.clamp(min=1)
        token_logp = torch.where(masks, lp * weight, 0.0).mean(0)  # [B, L]
        seq = token_logp.sum(1)
        return EstimatorOutput(token_logp=token_logp, seq_logp=seq, mask=masks.any(0), extras={"elbo": seq})

    def __call__(self, model, batch: RolloutBatch, seed: int) -> EstimatorOutput:
        return self.score(model, batch, self.draw_masks(batch, seed, model))
