"""Denoising Progress Scores (DPS): DACA-GRPO's per-token credit weights [INFERRED].

Karimi Monsefi et al., "DACA-GRPO", arXiv 2605.16342. The paper's abstract says DPS are per-token
importance weights read from the rollout's intermediate predictions at no extra forward cost; the
formulas below are ALGORITHMS.md §8's [INFERRED] reconstruction, not the authors' code.

With q_s(i) = trajectory.token_probs[b, s, i], the model's probability at sampler step s of the
token finally committed at i, and c_i its commit step:

    kind="progress":     DPS_i = sum_{s=1..c_i} max(0, q_s(i) - q_{s-1}(i))   (confidence gained while denoising)
    kind="uncertainty":  DPS_i = 1 - q_{c_i - 1}(i)  (uncertainty one step before commit; c_i = 0 uses q_0)

Choices. Progress starts at q_0 (no q_{-1} = 0 term), so a token the model was sure of from the
first step scores 0; to keep every token trainable the weights are mixed with a uniform floor:
w_i = (1 - floor) * n * DPS_i / sum_j DPS_j + floor over the n scored positions of a row, so each
row's weights average exactly 1 over its completion mask (a row whose DPS are all 0 gets w = 1).
NaN/inf probabilities are read as 0 and probabilities are clamped to [0, 1]. Positions outside the
completion mask, or without trajectory information (commit_step -1), get weight 0 and do not count.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddrl.types import Trajectory


def denoising_progress_scores(trajectory: Trajectory, completion_mask: Tensor, kind: str = "progress",
                              floor: float = 0.1) -> Tensor:
    """Per-token DACA weights [B, L], averaging 1 over each row's scored positions (see module doc)."""
    if kind not in ("progress", "uncertainty"):
        raise ValueError(f"kind must be 'progress' or 'uncertainty', got {kind!r}")
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"floor must be in [0, 1], got {floor}")
    q = torch.nan_to_num(trajectory.token_probs.float(), nan=0.0, posinf=0.0, neginf=0.0).clamp(0.0, 1.0)  # [B, S, L]
    S = q.shape[1]
    commit = trajectory.commit_step.to(q.device)
    valid = completion_mask.bool().to(q.device) & (commit >= 0)
    c = commit.clamp(0, S - 1)  # [B, L]
    if kind == "progress":
        gain = (q[:, 1:] - q[:, :-1]).clamp(min=0)  # [B, S-1, L] gain from step s-1 to s
        s = torch.arange(1, S, device=q.device)[None, :, None]
        score = (gain * (s <= c[:, None])).sum(1)  # [B, L]
    else:
        before = (c - 1).clamp(min=0)
        score = 1.0 - q.gather(1, before[:, None]).squeeze(1)
    score = score * valid
    n = valid.float().sum(1, keepdim=True)  # [B, 1]
    total = score.sum(1, keepdim=True)
    normalised = torch.where(total > 0, score * n / total.clamp(min=1e-12), 1.0)
    return ((1.0 - floor) * normalised + floor) * valid
