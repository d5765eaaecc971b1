"""The scale benchmarks run at tiny size on the CPU, so they cannot rot."""

from __future__ import annotations

import importlib.util
import math
import sys

from tests.integration.conftest import ROOT


def load_bench(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(name, None)
    return module


def test_bench_8b_tiny_runs_on_cpu(capsys):
    row = load_bench("bench_8b").main(["--tiny", "--device", "cpu", "--mode", "full", "--gradient-checkpointing"])
    assert row["rollout_tok_s"] > 0 and row["rl_step_s"] > 0 and math.isfinite(row["loss"])
    assert "| full | True |" in capsys.readouterr().out


def test_bench_memory_tiny_runs_on_cpu(capsys):
    rows = load_bench("bench_memory").main(["--tiny", "--only", "lora+gc", "--inline"])
    assert [r["config"] for r in rows] == ["lora+gc"]
    assert 0 < rows[0]["trainable_M"] < rows[0]["params_M"] and rows[0]["step_s"] > 0
    assert "| lora+gc |" in capsys.readouterr().out


def test_sepo_dna_story_quick_runs_on_cpu(capsys):
    result = load_bench("sepo_dna_story").main(["--quick"])
    for name in ("base", "sepo", "diffu_grpo"):
        test = result[name]["test"]
        assert test["n"] == 16 and math.isfinite(test["loglik_mean"]) and test["loglik_mean"] < 0
    assert result["sepo"]["lr"] == 1e-3 and math.isfinite(result["sepo"]["gain"]["value"])
    assert "| sepo | 16 |" in capsys.readouterr().out


def test_bench_sampler_sudoku_quick_reports_paired_interval(tmp_path, capsys):
    """The 9x9 fast-path table: n puzzles of the sealed test split, each variant's solve rate
    against the reference's on the same puzzles with a paired interval, and per-puzzle dumps."""
    import json

    dump = tmp_path / "dump.json"
    rows = load_bench("bench_sampler").main(["sudoku", "--quick", "--min-empty", "12", "--max-empty", "16",
                                             "--dump", str(dump)])
    by_name = {r["variant"]: r for r in rows}
    assert set(by_name) == {"reference", "dual+t0.99"}
    fast = by_name["dual+t0.99"]
    assert fast["vs_ref_lo_pt"] <= fast["vs_ref_pt"] <= fast["vs_ref_hi_pt"]
    assert fast["vs_ref_pt"] == (fast["accuracy"] - by_name["reference"]["accuracy"]) * 100
    assert fast["calls_ratio"] > 1 and fast["fed_ratio"] > 1
    data = json.loads(dump.read_text())
    assert len(data["puzzles"]) == 8 and len(data["variants"]["dual+t0.99"]["solved"]) == 8
    assert "| dual+t0.99 |" in capsys.readouterr().out
