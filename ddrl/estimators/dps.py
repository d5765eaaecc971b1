"""Denoising Progress Scores (DPS): DACA-GRPO's per-token credit weights [INFERRED].

Karimi Monsefi et al., "DACA-GRPO", arXiv 2605.16342. The paper's abstract says DPS are per-token
importance weights read from the rollout's intermediate predictions at no extra forward cost. No
code was released and the full text was not available, so the formulas below are ddrl's
reconstruction from the abstract (docs/methods.md, "DACA-GRPO"), not the authors' method.

With q_s(i) = trajectory.token_probs[b, s, i], the model's probability at sampler step s of the
token finally committed at i, and c_i its commit step:

    kind="progress":     DPS_i = Σ_{s ≤ c_i} max(0, q_s(i) - q_{s-1}(i))  over recorded pairs (s-1, s)
    kind="uncertainty":  DPS_i = 1 - q_{c_i - 1}(i), or 1 - q_{c_i}(i) when c_i is i's first recorded step

Only RECORDED steps count. The block samplers write NaN for the steps before a token's block
begins (ddrl.sampling.trajectory): the token is not being denoised then, so those steps
carry no progress, and the first recorded probability is the baseline, not a gain from zero.
Two tokens with the same history therefore get the same score whichever block they sit in.

Weights. A token the model was sure of from its first recorded step scores 0; to keep every token
trainable the scores are mixed with a uniform floor: w_i = (1 - floor)·n·DPS_i / Σ_j DPS_j + floor
over the n scored positions of a row, so each row's weights average exactly 1 over its completion
mask (a row whose DPS are all 0 gets w = 1). Probabilities are clamped to [0, 1]. Positions outside
the completion mask, or without trajectory information (commit_step -1), get weight 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddrl.types import Trajectory

DPS_KINDS = ("progress", "uncertainty")


def denoising_progress_scores(trajectory: Trajectory, completion_mask: Tensor, kind: str = "progress",
                              floor: float = 0.1) -> Tensor:
    """Per-token DACA weights [B, L], averaging 1 over each row's scored positions (see module doc)."""
    if kind not in DPS_KINDS:
        raise ValueError(f"kind must be one of {', '.join(DPS_KINDS)}, got {kind!r}")
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"floor must be in [0, 1], got {floor}")
    if trajectory.token_probs is None:
        raise ValueError("DPS weights need trajectory.token_probs: sample with return_trajectory=True, not "
                         "COMMIT_ORDER")
    raw = trajectory.token_probs.float()  # [B, S, L], NaN where not recorded
    recorded = torch.isfinite(raw)
    q = torch.where(recorded, raw, torch.zeros_like(raw)).clamp(0.0, 1.0)
    S = q.shape[1]
    commit = trajectory.commit_step.to(q.device)
    valid = completion_mask.bool().to(q.device) & (commit >= 0)
    c = commit.clamp(0, S - 1)  # [B, L]
    if kind == "progress":
        gain = (q[:, 1:] - q[:, :-1]).clamp(min=0)  # [B, S-1, L] gain from step s-1 to s
        both = recorded[:, 1:] & recorded[:, :-1]  # a gain needs both ends recorded
        s = torch.arange(1, S, device=q.device)[None, :, None]
        score = (gain * (both & (s <= c[:, None]))).sum(1)  # [B, L]
    else:
        before = (c - 1).clamp(min=0)
        seen = recorded.gather(1, before[:, None]).squeeze(1) & (c > 0)
        at = torch.where(seen, before, c)  # the step before the commit, if it was recorded
        score = 1.0 - q.gather(1, at[:, None]).squeeze(1)
    score = score * valid
    n = valid.float().sum(1, keepdim=True)  # [B, 1]
    total = score.sum(1, keepdim=True)
    normalised = torch.where(total > 0, score * n / total.clamp(min=1e-12), 1.0)
    return ((1.0 - floor) * normalised + floor) * valid
