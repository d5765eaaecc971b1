"""Coupled three-pass token log-probs: coupled-GRPO's proxy (DiffuCoder).

Gong et al., "DiffuCoder", arXiv 2506.20639 (apple/ml-diffucoder src/open_r1/coupled_grpo.py
`forward_process`, `selective_log_softmax`). ALGORITHMS.md §10.6.

    t ~ U(t_min, t_max);  S = {i : u_i < t}
    p0: completion fully masked;  p1: S masked;  p2: the complement of S masked
    log pi(x^i) := 1/2 [ log p0(x^i) + 1[i in S] log p1(x^i) / t + 1[i not in S] log p2(x^i) / (1 - t) ]

Every token is predicted once by the coupled pair (p1, p2) and once by the mean-field pass p0.
As in the code, S is drawn over all L completion positions (post-EOS fill included) and scoring
keeps the real completion. Deviation: the code draws one t per call for the whole batch; we draw
one t per sequence (same expectation, and a row's mask does not depend on its neighbours' t).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ddrl.estimators.common import generator_from_seed, noised_forward, prompt_noise, uniform
from ddrl.registry import ESTIMATORS
from ddrl.types import EstimatorOutput, RolloutBatch


@ESTIMATORS.register("coupled_three_pass")
@dataclass
class CoupledThreePass:
    t_min: float = 0.2  # smallest mask ratio t (DiffuCoder: U(0.2, 0.8))
    t_max: float = 0.8  # largest mask ratio t
    p_mask_prompt: float = 0.0  # probability of masking each real prompt token, same in all 3 passes (DiffuCoder: 0)
    rows_per_call: int | None = None  # at most this many sequences per forward call (memory); None = one call

    name: ClassVar[str] = "coupled_three_pass"
    paper: ClassVar[str] = "coupled-GRPO / DiffuCoder (Gong et al. 2025, arXiv 2506.20639)"
    formula: ClassVar[str] = "log pi(x^i) = 1/2[log p_full + 1[i in S] log p_S / t + 1[i notin S] log p_Sc / (1-t)]"
    passes: ClassVar[str] = "3"
    needs_trajectory: ClassVar[bool] = False

    def __call__(self, model, batch: RolloutBatch, seed: int) -> EstimatorOutput:
        if not 0.0 < self.t_min <= self.t_max < 1.0:
            raise ValueError(f"coupled_three_pass needs 0 < t_min <= t_max < 1, got {self.t_min}, {self.t_max}")
        g = generator_from_seed(seed)
        B, L = batch.completion_ids.shape
        device = batch.completion_ids.device
        t = self.t_min + (self.t_max - self.t_min) * uniform((B, 1), g, device)  # [B, 1]
        S = uniform((B, L), g, device) < t  # [B, L]
        pmask = prompt_noise(batch, self.p_mask_prompt, g)
        masks = torch.stack([torch.ones_like(S), S, ~S])  # [3, B, L]
        pmasks = None if pmask is None else pmask[None].expand(3, -1, -1)
        lp0, lp1, lp2 = noised_forward(model, batch, pmasks, masks, rows_per_call=self.rows_per_call)
        coupled = torch.where(S, lp1 / t, lp2 / (1 - t))
        real = batch.completion_mask.bool()
        token_logp = 0.5 * (lp0 + coupled) * real
        return EstimatorOutput(token_logp=token_logp, seq_logp=token_logp.sum(1), mask=real,
                               extras={"t": t[:, 0]})
