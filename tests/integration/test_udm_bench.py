"""bench/udm_digits.py --quick: the UDM-GRPO digits study's code path at tiny size, so it cannot rot."""

from __future__ import annotations

import math

from tests.integration.test_benches import load_bench


def test_udm_digits_bench_quick_runs_and_reports():
    result = load_bench("udm_digits").main(["--quick"])
    (seed,) = result["seeds"]
    assert [p["step"] for p in seed["curve"]] == [0, 1, 2]  # dev points, the base first
    for point in seed["curve"]:
        lo, hi = point["interval"]
        assert lo <= point["accuracy"] <= hi and point["n"] == 20
        assert sorted(point["per_class"]) == [str(c) for c in range(10)]
        assert 0 <= point["pairwise_hamming_min"] <= point["pairwise_hamming"] <= 64
    test, gain = seed["test"], seed["gain"]
    assert test["n"] == 20 and "scores" not in test
    assert gain["method"] == "paired_bootstrap" and gain["lo"] <= gain["mean"] <= gain["hi"]
    assert math.isclose(gain["mean"], test["accuracy"] - result["base_test"]["accuracy"], abs_tol=1e-9)
    assert [t["step"] for t in seed["test_at"]] == [1]
    assert seed["train_cpu_s"] >= 0 and seed["rollout_s_per_step"] > 0
    assert len(seed["grid_after"]) == 10 and all(len(row) == 8 for row in seed["grid_after"])
    assert result["summary"]["n_seeds"] == 1 and result["summary"]["test_sd"] is None
    assert "| main | 0 | 2 |" in result["tables"] and "Dev curve, main" in result["tables"]
    assert "| base | " in result["tables"].split("Second judge")[1]  # the grids judged by kNN on real digits
    assert result["pictures"] == ["udm_digits_curve.png", "udm_digits_samples.png"]


def test_udm_digits_bench_quick_runs_the_naive_ablation():
    """Naive GRPO on UDM (rollout states in, each step's output as the action) runs through the
    bench: the estimator's clean_target=False finds the step actions the bench records."""
    result = load_bench("udm_digits").main(["--quick", "method.estimator_args.forward_process=false",
                                            "method.estimator_args.clean_target=false"])
    assert result["overrides"][-2:] == ["method.estimator_args.forward_process=false",
                                        "method.estimator_args.clean_target=false"]
    assert [p["step"] for p in result["seeds"][0]["curve"]] == [0, 1, 2]


