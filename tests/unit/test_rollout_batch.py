"""RolloutBatch.index cuts what is per row and only that: the typed per-row fields and the extras named in
ROW_EXTRAS, each checked to have the batch's rows; the batch's own values (counts, the planner's groups,
any other extra, whatever its shape) go to the sub-batch as they are."""

from __future__ import annotations

import pytest
import torch

from ddrl.types import ROW_EXTRAS, RolloutBatch

B, L = 4, 3


def batch(**fields) -> RolloutBatch:
    return RolloutBatch(prompt_ids=torch.zeros(B, 2, dtype=torch.long), prompt_mask=torch.ones(B, 2, dtype=torch.bool),
                        completion_ids=torch.arange(B * L).reshape(B, L), completion_mask=torch.ones(B, L, dtype=torch.bool),
                        group_ids=torch.tensor([0, 0, 1, 1]), rewards=torch.arange(B).float(), advantages=torch.zeros(B),
                        mask_seeds=torch.tensor([5]), completions=list("abcd"), **fields)


def test_per_row_values_are_cut_and_the_batchs_values_kept():
    weights = torch.arange(B * L).float().reshape(B, L)
    table = torch.arange(B) * 10  # the batch's: a [B'] tensor whose B' happens to equal B
    b = batch(examples=[{"i": i} for i in range(B)], reward_invalid=torch.tensor([True, False, True, False]),
              reward_inputs={"images": torch.arange(B).float()[:, None]}, nfe=7, forward_tokens=9, groups=[3, 4],
              extras={"dps_weights": weights, "table": table, "inner_iteration": 1})
    for rows in (slice(2, 4), torch.tensor([2, 3])):
        sub = b.index(rows)
        assert sub.completions == ["c", "d"] and sub.examples == [{"i": 2}, {"i": 3}]
        assert sub.reward_invalid.tolist() == [True, False] and sub.reward_inputs["images"].flatten().tolist() == [2, 3]
        assert torch.equal(sub.extras["dps_weights"], weights[2:])  # a declared per-row extra
        assert torch.equal(sub.extras["table"], table)  # not per row: kept whole although its length is B
        assert (sub.nfe, sub.forward_tokens, sub.groups, sub.extras["inner_iteration"]) == (7, 9, [3, 4], 1)
        assert sub.reward_failed is None


@pytest.mark.parametrize("key", sorted(ROW_EXTRAS))
def test_a_per_row_extra_of_another_length_is_refused(key):
    with pytest.raises(ValueError, match=rf"extras\['{key}'\] has shape \[3, 2\] but is per row"):
        batch(extras={key: torch.zeros(B - 1, 2)}).index(slice(0, 2))
    with pytest.raises(ValueError, match="per row"):
        batch(extras={key: 1.0}).index(slice(0, 2))


def test_a_typed_per_row_field_of_another_length_is_refused():
    with pytest.raises(ValueError, match=r"RolloutBatch.reward_failed has shape \[5\]"):
        batch(reward_failed=torch.zeros(B + 1, dtype=torch.bool)).index(slice(0, 2))
    with pytest.raises(ValueError, match="RolloutBatch.examples is per row and must be .* a list of 4, got list of 2"):
        batch(examples=[{}, {}]).index(slice(0, 2))
