"""Per-group masks (issue 34, item 6): an estimator's `mask_per_group` option draws each group's masks
from (seed, the group's step-global index), so the groups of one step get different masks and a
group's masks do not depend on how the step is cut into micro-batches. Without it (the default, as
the released trainers do) every micro-batch of one group draws the same masks from the step's seed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ddrl.estimators  # noqa: F401  (registration)
from ddrl.config import load_config, RLConfig
from ddrl.registry import ESTIMATORS
from ddrl.training.method import build_method
from ddrl.types import RolloutBatch

G, L, P = 3, 10, 4
ESTIMATOR_ARGS = {"random_ratio": {"copies": 2}, "coupled_elbo": {"num_mc": 2}, "spg": {"num_t": 2, "block_length": 4}}


def two_groups() -> RolloutBatch:
    """Two groups of G rows with the same prompts and completions: only the seed can tell them apart."""
    g = torch.Generator().manual_seed(0)
    completion = torch.randint(0, 50, (G, L), generator=g).repeat(2, 1)
    mask = torch.ones(2 * G, L, dtype=torch.bool)
    mask[:, 7:] = False
    prompt = torch.randint(0, 50, (G, P), generator=g).repeat(2, 1)
    return RolloutBatch(prompt_ids=prompt, prompt_mask=torch.ones_like(prompt, dtype=torch.bool),
                        completion_ids=completion, completion_mask=mask,
                        group_ids=torch.arange(2).repeat_interleave(G), rewards=torch.zeros(2 * G),
                        advantages=torch.zeros(2 * G), mask_seeds=torch.tensor([11]))


def draws(estimator, batch: RolloutBatch, groups: list[int]) -> list[torch.Tensor]:
    batch.groups = groups  # what the trainer's planner names: step-global group indices
    out = estimator.draw_masks(batch, 1234)
    return [t for t in (out if isinstance(out, tuple) else (out,)) if t is not None]


def per_micro_batch(estimator) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Masks of group 0 and of group 1, each drawn as its own micro-batch with the step's seed."""
    batch = two_groups()
    return (draws(estimator, batch.index(slice(0, G)), [0]), draws(estimator, batch.index(slice(G, 2 * G)), [1]))


@pytest.mark.parametrize("name", sorted(ESTIMATOR_ARGS))
def test_without_the_option_every_group_of_a_step_gets_the_same_masks(name):
    first, second = per_micro_batch(ESTIMATORS.get(name)(**ESTIMATOR_ARGS[name]))
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("name", sorted(ESTIMATOR_ARGS))
def test_with_the_option_groups_get_their_own_masks_whatever_the_split(name):
    estimator = ESTIMATORS.get(name)(**ESTIMATOR_ARGS[name], mask_per_group=True)
    first, second = per_micro_batch(estimator)
    assert any(not torch.equal(a, b) for a, b in zip(first, second))
    whole = draws(estimator, two_groups(), [0, 1])  # both groups in one micro-batch
    for w, a, b in zip(whole, first, second):
        assert torch.equal(w, torch.cat([a, b], dim=1))
    shifted = draws(estimator, two_groups(), [4, 5])  # other step-global groups: other masks
    assert any(not torch.equal(w, s) for w, s in zip(whole, shifted))


def test_the_option_is_a_typed_estimator_argument_the_planner_reads():
    cfg = load_config("configs/rl/espo_mini_sudoku.yaml", ["method.estimator_args.mask_per_group=true"], RLConfig)
    method = build_method(cfg)
    assert method.estimator.mask_per_group is True and method.masks_per_group
    assert not build_method(dataclasses.replace(cfg, method=dataclasses.replace(
        cfg.method, estimator_args={}))).masks_per_group
    with pytest.raises(Exception, match="mask_per_grup"):
        load_config("configs/rl/espo_mini_sudoku.yaml", ["method.estimator_args.mask_per_grup=true"], RLConfig)
