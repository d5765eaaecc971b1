"""Coupled three-pass token log-probs: coupled-GRPO's proxy (DiffuCoder).

Gong et al., "DiffuCoder", arXiv 2506.20639; code apple/ml-diffucoder @ f735e01,
src/open_r1/coupled_grpo.py (`forward_process`, `_get_per_token_logps`, `selective_log_softmax`).

    t ~ U(t_min, t_max);  S = {i : u_i < t},  u_i ~ U[0, 1)
    p0: completion fully masked;  p1: S masked;  p2: the complement of S masked
    log pi(x^i) := 1/2 [ log p0(x^i) + 1[i in S] log p1(x^i) / t + 1[i not in S] log p2(x^i) / (1 - t) ]

Every token is predicted once by the coupled pair (p1, p2) and once by the mean-field pass p0.
As in the released code, S is drawn over all L completion positions (post-EOS fill included), the
prompt is never masked by default, and every completion position goes through all three passes;
scoring then keeps the real completion (tokens up to and including the first EOS).

One t per row or per call. The released code draws one t (Python `random.uniform(0.2, 0.8)`)
per call, shared by every row of the batch; `shared_t=True` does the same (the draw comes first
from the seeded generator, so every micro-batch of a step, called with the same seed, gets the same
t, as in the released code). The default draws one t per row: same expectation, and a row's masks
do not depend on how many rows share its call.

Golden test: tests/unit/test_golden_coupled_grpo.py injects the masks and t drawn by the released
code (`coupled_log_probs`) and reproduces its per-token log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ddrl.estimators.common import generator_from_seed, noised_forward, prompt_noise, uniform
from ddrl.registry import ESTIMATORS
from ddrl.types import EstimatorOutput, RolloutBatch


def coupled_log_probs(model, batch: RolloutBatch, t: Tensor, coupled_mask: Tensor, prompt_mask: Tensor | None = None,
                      *, rows_per_call: int | None = None) -> EstimatorOutput:
    """The three passes for given noise: t [B, 1] mask ratios, coupled_mask S [B, L] bool (True = masked in
    p1, visible in p2), prompt_mask [B, P] bool or None (prompt tokens masked in all three passes).

    Split out so that a test can inject the masks a reference implementation drew.
    """
    S = coupled_mask.bool()
    passes = torch.stack([torch.ones_like(S), S, ~S])  # [3, B, L] True = masked
    pmasks = None if prompt_mask is None else prompt_mask[None].expand(3, -1, -1)
    lp0, lp1, lp2 = noised_forward(model, batch, pmasks, passes, rows_per_call=rows_per_call)  # [B, L] each
    t = t.to(lp0.dtype)
    coupled = torch.where(S, lp1 / t, lp2 / (1 - t))
    real = batch.completion_mask.bool()
    token_logp = 0.5 * (lp0 + coupled) * real
    return EstimatorOutput(token_logp=token_logp, seq_logp=token_logp.sum(1), mask=real, extras={"t": t[:, 0]})


@ESTIMATORS.register("coupled_three_pass")
@dataclass
class CoupledThreePass:
    t_min: float = 0.2  # smallest mask ratio t (DiffuCoder: U(0.2, 0.8))
    t_max: float = 0.8  # largest mask ratio t
    shared_t: bool = False  # True: one t for every row of the call (the released code); False: one t per row
    p_mask_prompt: float = 0.0  # probability of masking each real prompt token, same in all 3 passes (DiffuCoder: 0)
    rows_per_call: int | None = None  # at most this many sequences per forward call (memory); None = one call

    name: ClassVar[str] = "coupled_three_pass"
    paper: ClassVar[str] = "coupled-GRPO / DiffuCoder (Gong et al. 2025, arXiv 2506.20639)"
    formula: ClassVar[str] = "log pi(x^i) = 1/2[log p_full + 1[i in S] log p_S / t + 1[i notin S] log p_Sc / (1-t)]"
    passes: ClassVar[str] = "3"
    copies_per_row: ClassVar[int] = 3  # copies of a row in one call's graph (memory's k)
    needs_trajectory: ClassVar[bool] = False

    def draw(self, batch: RolloutBatch, seed: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """(t [B, 1], S [B, L] bool, prompt mask [B, P] bool or None), all from `seed`."""
        if not 0.0 < self.t_min <= self.t_max < 1.0:
            raise ValueError(f"coupled_three_pass needs 0 < t_min <= t_max < 1, got {self.t_min}, {self.t_max}")
        g = generator_from_seed(seed)
        B, L = batch.completion_ids.shape
        device = batch.completion_ids.device
        u = uniform((1, 1) if self.shared_t else (B, 1), g, device).expand(B, 1)  # [B, 1]
        t = self.t_min + (self.t_max - self.t_min) * u
        S = uniform((B, L), g, device) < t  # [B, L]
        return t, S, prompt_noise(batch, self.p_mask_prompt, g)

    def __call__(self, model, batch: RolloutBatch, seed: int) -> EstimatorOutput:
        t, S, pmask = self.draw(batch, seed)
        return coupled_log_probs(model, batch, t, S, pmask, rows_per_call=self.rows_per_call)
