"""Rollout statistics are sums and counts, reduced over ranks before they are divided (issue 34):
a rank's RowSums add up to the global mean and sample std of all rows, whatever the split."""

from __future__ import annotations

import math

import pytest
import torch

from ddrl.training.distributed import DistInfo, RowSums, reduce_mean_dict

ONE = DistInfo(rank=0, world_size=1, local_rank=0)


def row_sums(x: list[float]) -> dict[str, RowSums]:
    t = torch.tensor(x, dtype=torch.float64)
    return {"mean": RowSums(t.sum(), float(len(x))), "std": RowSums(t.sum(), float(len(x)), squares=(t * t).sum()),
            "tokens": RowSums(t.sum())}


def test_row_sums_give_the_mean_std_and_sum_of_the_rows():
    out = reduce_mean_dict(row_sums([1.0, 0.0, 0.0, 1.0, 1.0]), ONE, torch.device("cpu"))
    assert out["mean"] == pytest.approx(0.6)
    assert out["std"] == pytest.approx(math.sqrt(0.3))  # sum of squared deviations 1.2 over n - 1 = 4
    assert out["tokens"] == 3.0


def test_no_rows_give_a_nan_mean_and_a_zero_std():
    out = reduce_mean_dict({"mean": RowSums(0.0, 0.0), "std": RowSums(0.0, 1.0, squares=4.0)}, ONE,
                           torch.device("cpu"))
    assert math.isnan(out["mean"]) and out["std"] == 0.0


def test_two_ranks_rows_reduce_to_the_one_process_values(monkeypatch):
    """Two ranks' tables summed (what all_reduce does) give one process's values; a mean of the ranks'
    own means and stds (what was logged before) does not: 0.25 and 0.5 here, not 0.2 and ~0.447."""
    import ddrl.training.distributed as d

    ranks = [row_sums([1.0, 0.0, 0.0, 0.0]), row_sums([0.0])]
    rows = [torch.cat([d._table_rows(r[k], *d._layout(r[k]), torch.device("cpu")) for k in sorted(r)]) for r in ranks]
    summed = (rows[0] + rows[1]).tolist()
    keys, at, out = sorted(ranks[0]), 0, {}
    for k in keys:
        kind, n = d._layout(ranks[0][k])
        out[k], at = d._finish(kind, summed[at:at + n]), at + n
    one = reduce_mean_dict(row_sums([1.0, 0.0, 0.0, 0.0, 0.0]), ONE, torch.device("cpu"))
    assert out == pytest.approx(one)
    assert one["mean"] == pytest.approx(0.2) and one["std"] == pytest.approx(math.sqrt(0.2))
