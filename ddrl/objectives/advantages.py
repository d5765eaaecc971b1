"""Group-relative advantages: each completion's reward relative to the other completions of its prompt.

With r_g the valid rewards of one prompt's group (n of them):
    mean    A = r - mean(r)                          d1, wd1, SPG, StableDRL
    zscore  A = (r - mean(r)) / (std(r) + eps)       MaskGRPO, UDM-GRPO (then clipped to ±5), TraceRL, SEPO
    loo     A_g = r_g - (Σ r - r_g)/(n - 1)          ESPO, GDSD, coupled-GRPO (scale_rewards=false)

A reward of NaN means None (the reward did not apply) or invalid. Two policies (`invalid`):
  "drop" (default)  the row is left out of its group's statistics and gets advantage 0, so it carries
                    no policy-gradient signal (the objectives also leave rows with a NaN reward out of
                    the loss, via batch.reward_valid).
  "zero"            the reward counts as 0 and the row stays in the group like any other, as d1's and
                    wd1's trainers do (TRL's nansum over reward functions turns an all-None row into
                    0). The row must then also count in the loss: the trainer stores the reward as 0 in
                    batch.rewards, so that batch.reward_valid is True for it.
A group with fewer than two valid members, or whose valid rewards are all equal, gets 0 for every
row (no relative information). Computed on the whole step batch (all groups complete) before it is
cut into micro-batches. docs/methods.md lists each method's kind and std.
"""

from __future__ import annotations

import torch
from torch import Tensor

ADVANTAGE_KINDS = ("mean", "zscore", "loo")


def groups_in_band(rewards: Tensor, group_ids: Tensor, lo: float, hi: float) -> Tensor:
    """[B] bool: rows whose group's mean valid reward lies in [lo, hi] (`train.group_filter`).

    dLLM-RL trains only on prompts whose fraction correct is within [0.2, 0.8] (reward/rl_reward.py):
    the others carry almost no signal under its z-score. A group without a valid reward is dropped.
    """
    valid = torch.isfinite(rewards)
    r = torch.where(valid, rewards, torch.zeros_like(rewards)).to(torch.float64)
    _, index = torch.unique(group_ids, return_inverse=True)
    n_groups = int(index.max()) + 1 if index.numel() else 0
    total = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add(0, index, r)
    n = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add(0, index, valid.to(r.dtype))
    mean = total / n.clamp(min=1)
    return ((mean >= lo) & (mean <= hi) & (n > 0))[index]
INVALID_REWARD_POLICIES = ("drop", "zero")


def compute_advantages(rewards: Tensor, group_ids: Tensor, kind: str = "mean", *, eps: float = 1e-4,
                       std: str = "sample", clip: float | None = None, invalid: str = "drop") -> Tensor:
    """rewards [B] (NaN = None/invalid), group_ids [B] -> advantages [B] (float, same dtype as rewards).

    std: "sample" (n - 1 in the denominator, torch's default) or "population" (n; TraceRL).
    clip: clamp advantages to [-clip, clip] afterwards (UDM-GRPO: 5).
    invalid: "drop" (non-finite rows leave their group, advantage 0) or "zero" (they count as reward 0; d1, wd1).
    """
    if kind not in ADVANTAGE_KINDS:
        raise ValueError(f"unknown advantage {kind!r}; valid: {', '.join(ADVANTAGE_KINDS)}")
    if std not in ("sample", "population"):
        raise ValueError(f"std must be 'sample' or 'population', got {std!r}")
    if invalid not in INVALID_REWARD_POLICIES:
        raise ValueError(f"invalid={invalid!r}; valid: {', '.join(INVALID_REWARD_POLICIES)}")
    rewards = rewards.float() if not rewards.is_floating_point() else rewards
    if invalid == "zero":
        rewards = torch.nan_to_num(rewards, nan=0.0, posinf=0.0, neginf=0.0)
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
