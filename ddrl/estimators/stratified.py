"""Stratified masking likelihood (SML): DACA-GRPO's pseudo-likelihood [INFERRED].

Karimi Monsefi et al., "DACA-GRPO: Denoising-Aware Credit Assignment", arXiv 2605.16342. No code
and no full text were available: the construction below is ddrl's [INFERRED] reading of the abstract
(docs/methods.md#daca-grpo), a design choice and not the authors' verified method.

    a random permutation of each row's real completion positions, cut into K near-equal strata S_1..S_K
    pass k masks only S_k (prompt clean):  log pi(x^i) := log p_theta(x^i | x with S_k masked),  i in S_k

Every real token is scored exactly once, with about (1 - 1/K) of the completion visible, so the
sum is a pseudo-log-likelihood that replaces d1's fully-masked (mean-field) log-probs at K passes
instead of 1. Post-EOS positions are masked in every pass and never scored. The K passes are
batched into one call. Use with the DPS token weights of ddrl.estimators.dps for full DACA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ddrl.estimators.common import completion_lengths, generator_from_seed, noised_forward, uniform
from ddrl.registry import ESTIMATORS
from ddrl.types import EstimatorOutput, RolloutBatch


@ESTIMATORS.register("stratified")
@dataclass
class Stratified:
    num_strata: int = 4  # K: strata = forward passes per call
    rows_per_call: int | None = None  # at most this many sequences per forward call (memory); None = one call

    name: ClassVar[str] = "stratified"
    paper: ClassVar[str] = "DACA-GRPO SML (Karimi Monsefi et al. 2026, arXiv 2605.16342) [INFERRED]"
    formula: ClassVar[str] = "log pi(x^i) = log p(x^i | x with its stratum S_k masked), K random strata"
    passes: ClassVar[str] = "num_strata"
    needs_trajectory: ClassVar[bool] = False

    @property
    def copies_per_row(self) -> int:
        """Copies of a row in one call's forward and backward graph (ddrl.training.memory's k)."""
        return self.num_strata

    def strata(self, batch: RolloutBatch, seed: int) -> Tensor:
        """Stratum id in {0..K-1} of each real completion position, -1 elsewhere. [B, L] long."""
        if self.num_strata < 1:
            raise ValueError(f"num_strata must be >= 1, got {self.num_strata}")
        g = generator_from_seed(seed)
        real = batch.completion_mask.bool()
        keys = uniform(tuple(real.shape), g, real.device).masked_fill(~real, 2.0)
        rank = keys.argsort(1).argsort(1)  # [B, L] position's place in a random order of the real positions
        stratum = rank * self.num_strata // completion_lengths(batch).clamp(min=1)[:, None]
        return torch.where(real, stratum, -1)

    def __call__(self, model, batch: RolloutBatch, seed: int) -> EstimatorOutput:
        stratum = self.strata(batch, seed)
        k = torch.arange(self.num_strata, device=stratum.device)[:, None, None]  # [K, 1, 1]
        in_k = stratum[None] == k  # [K, B, L]
        real = batch.completion_mask.bool()
        lp = noised_forward(model, batch, None, in_k | ~real[None], rows_per_call=self.rows_per_call)  # [K, B, L]
        token_logp = torch.where(in_k, lp, 0.0).sum(0)  # each real token from the one pass that masked it
        return EstimatorOutput(token_logp=token_logp, seq_logp=token_logp.sum(1), mask=real)
