"""Group-relative advantages (ALGORITHMS.md §1.7).

With r_g the valid rewards of one prompt's group (n of them):
    mean    A = r - mean(r)                          d1, wd1, SPG, StableDRL
    zscore  A = (r - mean(r)) / (std(r) + eps)       MaskGRPO, UDM-GRPO (then clipped to ±5), TraceRL, SEPO
    loo     A_g = r_g - (Σ r - r_g)/(n - 1)          ESPO, GDSD, coupled-GRPO (scale_rewards=false)

Rows whose reward is NaN (None, or invalid) are left out of their group's statistics and get
advantage 0, so they carry no policy-gradient signal. A group with fewer than two valid members,
or whose valid rewards are all equal, gets 0 for every row (no relative information). Computed on
the whole step batch (all groups complete) before it is cut into micro-batches.
"""

from __future__ import annotations

import torch
from torch import Tensor

ADVANTAGE_KINDS = ("mean", "zscore", "loo")


def compute_advantages(rewards: Tensor, group_ids: Tensor, kind: str = "mean", *, eps: float = 1e-4,
                       std: str = "sample", clip: float | None = None) -> Tensor:
    """rewards [B] (NaN = invalid), group_ids [B] -> advantages [B] (float, same dtype as rewards).

    std: "sample" (n - 1 in the denominator, torch's default) or "population" (n; TraceRL).
    clip: clamp advantages to [-clip, clip] afterwards (UDM-GRPO: 5).
    """
    if kind not in ADVANTAGE_KINDS:
        raise ValueError(f"unknown advantage {kind!r}; valid: {', '.join(ADVANTAGE_KINDS)}")
    if std not in ("sample", "population"):
        raise ValueError(f"std must be 'sample' or 'population', got {std!r}")
    rewards = rewards.float() if not rewards.is_floating_point() else rewards
    valid = torch.isfinite(rewards)
    r = torch.where(valid, rewards, torch.zeros_like(rewards))
    _, index = torch.unique(group_ids, return_inverse=True)  # [B] dense group index
    n_groups = int(index.max()) + 1 if index.numel() else 0

    def group_sum(x: Tensor) -> Tensor:  # [B] -> [n_groups]
        return torch.zeros(n_groups, dtype=x.dtype, device=x.device).index_add(0, index, x)

    n = group_sum(valid.to(r.dtype))[index]  # valid members of each row's group
    mean = group_sum(r)[index] / n.clamp(min=1)
    centred = torch.where(valid, r - mean, torch.zeros_like(r))
    big = torch.finfo(r.dtype).max
    hi = torch.full((n_groups,), -big, dtype=r.dtype, device=r.device).scatter_reduce(
        0, index, torch.where(valid, r, torch.full_like(r, -big)), reduce="amax")
    lo = torch.full((n_groups,), big, dtype=r.dtype, device=r.device).scatter_reduce(
        0, index, torch.where(valid, r, torch.full_like(r, big)), reduce="amin")
    informative = valid & (n >= 2) & (hi[index] > lo[index])

    if kind == "mean":
        adv = centred
    elif kind == "loo":
        adv = centred * n / (n - 1).clamp(min=1)  # r - (Σr - r)/(n-1) = n/(n-1)·(r - mean)
    else:
        dof = n - 1 if std == "sample" else n
        sd = (group_sum(centred.square())[index] / dof.clamp(min=1)).sqrt()
        adv = centred / (sd + eps)
    adv = torch.where(informative, adv, torch.zeros_like(adv))
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return adv
