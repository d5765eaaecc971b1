"""DACA-GRPO's Denoising Progress Scores on trajectories the block sampler records.

DACA-GRPO has no public code, so the oracle is a hand-built trajectory with the sampler's own
convention: NaN for the steps before a token's block begins. Two tokens with the same history must
get the same weight whichever block they are in (the bug this guards against scored the first
recorded probability of a later block as progress from 0: weights 0.10 vs 1.90).
"""

from __future__ import annotations

import torch

from ddrl.estimators.dps import denoising_progress_scores
from ddrl.types import Trajectory

NAN = float("nan")


def two_block_trajectory() -> Trajectory:
    # 4 steps, 2 blocks of 1 token: token 0 is denoised at steps 0-1, token 1 at steps 2-3.
    # Both see 0.9 then 0.95 and are committed at the second step of their block; after the commit
    # the sampler repeats the committed value.
    probs = torch.tensor([[[0.90, NAN], [0.95, NAN], [0.95, 0.90], [0.95, 0.95]]])  # [B=1, S=4, L=2]
    return Trajectory(commit_step=torch.tensor([[1, 3]]), token_probs=probs)


def test_same_history_same_weight_in_any_block():
    cm = torch.ones(1, 2, dtype=torch.bool)
    for kind in ("progress", "uncertainty"):
        w = denoising_progress_scores(two_block_trajectory(), cm, kind, floor=0.1)
        torch.testing.assert_close(w, torch.ones(1, 2), msg=kind)  # equal scores: both weights 1


def test_progress_by_hand_with_unrecorded_steps():
    # token 0: block 0, q = .2 .5 .4 .9, committed at step 3: gains .3 + 0 + .5 = .8
    # token 1: block 1, starts at step 2 (NaN before), q = .6 .7, committed at 3: gain .1 (no gain from 0)
    # token 2: block 1, committed at its first step (2): no recorded gain, score 0
    probs = torch.tensor([[[0.2, NAN, NAN], [0.5, NAN, NAN], [0.4, 0.6, 0.8], [0.9, 0.7, 0.8]]])
    traj = Trajectory(commit_step=torch.tensor([[3, 3, 2]]), token_probs=probs)
    cm = torch.ones(1, 3, dtype=torch.bool)
    w = denoising_progress_scores(traj, cm, "progress", floor=0.0)
    dps = torch.tensor([0.8, 0.1, 0.0])
    torch.testing.assert_close(w, (dps * 3 / dps.sum())[None])
    # uncertainty one step before the commit; token 2's step before is unrecorded: its commit step is used
    w = denoising_progress_scores(traj, cm, "uncertainty", floor=0.0)
    unc = torch.tensor([1 - 0.4, 1 - 0.6, 1 - 0.8])
    torch.testing.assert_close(w, (unc * 3 / unc.sum())[None])


def test_weights_average_one_and_respect_masks():
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(4, 6, 9, generator=g)
    probs[:, :2, 5:] = NAN  # a second block that starts at step 2
    traj = Trajectory(commit_step=torch.randint(-1, 6, (4, 9), generator=g), token_probs=probs)
    cm = torch.arange(9)[None] < torch.tensor([[9], [5], [1], [7]])
    for kind in ("progress", "uncertainty"):
        w = denoising_progress_scores(traj, cm, kind)
        valid = cm & (traj.commit_step >= 0)
        torch.testing.assert_close(w.sum(1), valid.sum(1).float())
        assert (w[~valid] == 0).all() and (w[valid] > 0).all() and torch.isfinite(w).all()


def test_daca_objective_prepares_its_weights_with_its_own_settings():
    from ddrl.registry import OBJECTIVES
    from ddrl.types import RolloutBatch

    traj = two_block_trajectory()
    traj.token_probs[0, 2, 1] = 0.5  # token 1 now gains 0.45, token 0 0.05
    batch = RolloutBatch(prompt_ids=torch.zeros(1, 1, dtype=torch.long), prompt_mask=torch.ones(1, 1, dtype=torch.bool),
                         completion_ids=torch.zeros(1, 2, dtype=torch.long), completion_mask=torch.ones(1, 2, dtype=torch.bool),
                         group_ids=torch.zeros(1, dtype=torch.long), rewards=torch.zeros(1), advantages=torch.zeros(1),
                         mask_seeds=torch.zeros(1, dtype=torch.long), trajectory=traj)
    OBJECTIVES.get("daca_grpo")(dps_floor=0.0).prepare(batch)
    torch.testing.assert_close(batch.extras["dps_weights"], torch.tensor([[0.2, 1.8]]))
    # the option of every token-level objective, with the same settings
    batch.extras.clear()
    OBJECTIVES.get("unigrpo")(token_weights=True, dps_floor=0.0, aggregation="sequence_token_mean").prepare(batch)
    torch.testing.assert_close(batch.extras["dps_weights"], torch.tensor([[0.2, 1.8]]))
    batch.extras.clear()
    OBJECTIVES.get("grpo")().prepare(batch)  # off by default: nothing computed
    assert "dps_weights" not in batch.extras
