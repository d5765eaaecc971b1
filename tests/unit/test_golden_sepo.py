"""SEPO's objective with clip="released" against the released `_compute_loss_sepo` (ozekri/SEPO @ 4a4a40f).

The fixture (tests/fixtures/methods/make_sepo.py) ran the authors' loss on G = 3 rollout batches of
B = 4 DNA sequences (L = 6, 4 bases + mask) with a tiny copy of their CNN backbone, combined as
grpo_train.py does (Σ_g loss_g / G), and recorded the per-neighbour log-scores (with grad), the SNIS
neighbour probabilities of the current and old model, the old scores, the advantages, the loss and
d loss / d log-scores. ddrl's objective gets exactly those tensors as estimator extras.
"""

from __future__ import annotations


import torch

import ddrl.objectives  # noqa: F401  (registers the objectives)
from ddrl.objectives import AggregationCounts
from ddrl.objectives.advantages import compute_advantages
from ddrl.objectives.sepo import rank_in_group, released_surrogates
from ddrl.registry import OBJECTIVES
from ddrl.types import EstimatorOutput, RolloutBatch
from tests.fixtures.methods.method_common import load


TENSORS, META = load("sepo")
G, B, L = META["settings"]["G"], META["settings"]["B"], META["settings"]["L"]


def rows(t: torch.Tensor) -> torch.Tensor:
    """[G, B, ...] -> [B*G, ...], group-major: row b*G + g is sample b of rollout batch g (group b, rank g).

    The released loop z-scores sample index b over the G batches, so ddrl's prompt group is b and the
    released rollout batch g is the rank inside the group.
    """
    return t.transpose(0, 1).reshape(G * B, *t.shape[2:])


def golden_batch() -> RolloutBatch:
    n = G * B
    return RolloutBatch(
        prompt_ids=torch.zeros(n, 1, dtype=torch.long), prompt_mask=torch.ones(n, 1, dtype=torch.bool),
        completion_ids=rows(TENSORS["x"]), completion_mask=torch.ones(n, L, dtype=torch.bool),
        group_ids=torch.arange(B).repeat_interleave(G), rewards=rows(TENSORS["rewards"]),
        advantages=rows(TENSORS["advantages"]), mask_seeds=torch.tensor([0]))


def estimator_output(log_scores: torch.Tensor, weights: torch.Tensor) -> EstimatorOutput:
    n = log_scores.shape[0]
    probes = torch.ones(n, L, dtype=torch.bool)
    extras = {"log_scores": log_scores, "neighbour_weights": weights, "probe_valid": probes,
              "probe_positions": torch.arange(L).expand(n, L)}
    return EstimatorOutput(torch.zeros(n, L, dtype=log_scores.dtype), None, probes, extras)


def released_setup():
    batch = golden_batch()
    log_scores = rows(TENSORS["log_scores"]).clone().requires_grad_(True)  # [B*G, L, V]
    new = estimator_output(log_scores, rows(TENSORS["neighbour_weights"]))
    old = estimator_output(rows(TENSORS["old_log_scores"]), rows(TENSORS["old_neighbour_weights"]))
    return batch, log_scores, new, old


def test_fixture_exercises_both_branches_of_the_batch_min():
    assert set(META["batch_branches"]) == {"clipped", "unclipped"}, META["batch_branches"]
    assert META["commit"].startswith("4a4a40f")


def test_released_loss_and_gradient_match_the_authors_code():
    batch, log_scores, new, old = released_setup()
    objective = OBJECTIVES.get("sepo")(clip="released", epsilon=META["settings"]["epsilon"])
    out = objective(batch, new, old, None, counts=AggregationCounts.from_batch(batch))
    torch.testing.assert_close(out.loss.detach(), TENSORS["loss"], atol=1e-9, rtol=1e-6)
    out.loss.backward()
    torch.testing.assert_close(log_scores.grad, rows(TENSORS["grad_log_scores"]), atol=1e-9, rtol=1e-6)
    assert abs(out.stats["clipped_batches"].item() - 2 / 3) < 1e-6  # matches META["batch_branches"]


def test_each_rollout_batch_value_matches():
    """The per-batch min(U_g, C_g) of the released code, one rollout batch (= one rank in the groups) at a time."""
    batch, _, new, old = released_setup()
    unclipped, clipped, _ = released_surrogates(new.extras, old.extras, META["settings"]["epsilon"])
    rank = rank_in_group(batch.group_ids)
    adv = batch.advantages.double()
    for g in range(G):
        rows_g = rank == g
        value = torch.minimum((adv[rows_g] * unclipped[rows_g]).sum(), (adv[rows_g] * clipped[rows_g]).sum()) / B
        torch.testing.assert_close(value.detach(), TENSORS["batch_losses"][g], atol=1e-9, rtol=1e-6)


def test_the_batch_level_min_is_not_a_per_sample_min():
    """The fixture tells the released batch-level min from a per-row min (the test above would catch a swap)."""
    batch, _, new, old = released_setup()
    unclipped, clipped, _ = released_surrogates(new.extras, old.extras, META["settings"]["epsilon"])
    adv = batch.advantages.double()
    per_row = torch.minimum(adv * unclipped, adv * clipped).sum() / (G * B)
    assert (per_row.detach() - TENSORS["loss"]).abs() > 1e-3


def test_released_advantages_are_ddrls_zscore_with_sample_std_and_eps_1e8():
    batch = golden_batch()
    adv = compute_advantages(batch.rewards, batch.group_ids, "zscore", eps=1e-8, std="sample")
    torch.testing.assert_close(adv, batch.advantages, atol=1e-9, rtol=1e-7)
