"""A few-step run of every method on a tiny model: finite loss, parameters moved, reward logged."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from ddrl.training.trainer import train
from tests.integration.conftest import ROOT, rl_overrides

TEXT_METHODS = ["grpo", "wd1", "spg", "espo", "tracerl", "unigrpo", "coupled_grpo", "maskgrpo", "stable_drl",
                "gdsd", "gdsd_tlc", "daca_grpo", "dipod", "fpo", "sepo"]


def _moved(a_dir, b_dir) -> float:
    a, b = load_file(a_dir / "model.safetensors"), load_file(b_dir / "model.safetensors")
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("method", TEXT_METHODS)
def test_method_trains_a_few_steps(method, tiny_sudoku_model, tmp_path):
    run = train(ROOT / f"configs/rl/{method}_mini_sudoku.yaml", rl_overrides(tiny_sudoku_model, tmp_path))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["loss"]), r
        assert r["reward/mean"] is not None and 0.0 <= r["reward/mean"] <= 1.0
        assert r["time/rollout"] > 0 and r["time/update"] > 0
    assert _moved(tiny_sudoku_model, run / "checkpoint-2") > 0, "parameters did not change"
    assert (run / "config.yaml").exists() and (run / "reward_curve.png").exists()
    assert "eval/accuracy" in rows[-1]
