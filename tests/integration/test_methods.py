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
    assert "eval_before/accuracy" in rows[0]  # the model before RL, logged with the first step
    for r in rows:
        assert math.isfinite(r["loss"]), r
        assert r["reward/mean"] is not None and 0.0 <= r["reward/mean"] <= 1.0
        assert r["time/rollout"] > 0 and r["time/update"] > 0
    assert _moved(tiny_sudoku_model, run / "checkpoint-2") > 0, "parameters did not change"
    assert (run / "config.yaml").exists() and (run / "reward_curve.png").exists()
    assert "eval/accuracy" in rows[-1]


@pytest.mark.parametrize("objective", ["grpo", "stable_drl"])
def test_skipping_zero_advantage_groups_keeps_the_update(objective, tiny_sudoku_model, tmp_path):
    """Groups whose advantages are all 0 are left out of the passes; the parameters are the same.

    grpo's mean-field estimate has no random masks (prompt masking off), so skipping must give the
    same parameters up to float summation order; stable_drl draws masks per row, so only the
    bookkeeping (fraction of rows kept, finite loss) is checked for it.
    """
    runs = {}
    for skip in (True, False):
        runs[skip] = train(ROOT / f"configs/rl/{objective}_mini_sudoku.yaml", [
            *rl_overrides(tiny_sudoku_model, tmp_path / str(skip), steps=3),
            "task.name=tests.integration.dense_task:make_many_ones", "task.args={k: 2}",
            "train.prompts_per_step=6", "train.group_size=4", "train.lr=1e-3",
            "method.estimator_args={p_mask_prompt: 0.0}" if objective == "grpo" else "method.estimator_args={}",
            "method.objective_args={beta: 0.0}" if objective == "grpo" else "method.objective_args={}",
            f"train.skip_uninformative={str(skip).lower()}", "eval.before=false"])
    rows = {s: [json.loads(line) for line in (r / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
            for s, r in runs.items()}
    kept = [r["update/rows_frac"] for r in rows[True] if r["advantage/abs_mean"] > 0]
    assert all(r["update/rows_frac"] == 1.0 for r in rows[False])
    assert any(0 < f < 1 for f in kept), f"no step had both informative and uninformative groups: {kept}"
    assert all(math.isfinite(r["loss"]) for r in rows[True])
    if objective == "grpo":
        for a, b in zip(rows[True], rows[False]):
            assert a["reward/mean"] == b["reward/mean"]  # same rollouts: the updates so far agree
        assert _moved(runs[True] / "checkpoint-3", runs[False] / "checkpoint-3") < 1e-5
        assert _moved(tiny_sudoku_model, runs[True] / "checkpoint-3") > 1e-4  # and they did learn


def test_prompt_pool_cycles_the_first_prompts_and_eval_can_score_them(tiny_sudoku_model, tmp_path):
    """train.prompt_pool=N trains on the first N training prompts again and again; eval.split=train
    scores those same prompts (the 'can RL fit what it saw' check in docs/methods.md)."""
    from ddrl.config import RLConfig, load_config
    from ddrl.training.trainer import Trainer

    overrides = [*rl_overrides(tiny_sudoku_model, tmp_path, steps=2), "train.prompt_pool=2", "eval.split=train",
                 "eval.n=2", "eval.every=2", "eval.before=false"]
    trainer = Trainer(load_config(ROOT / "configs/rl/grpo_mini_sudoku.yaml", overrides, RLConfig))
    prompts = [trainer.example(i)["prompt"] for i in range(6)]
    assert prompts[0] != prompts[1] and prompts == prompts[:2] * 3
    run = trainer.run()
    scored = [json.loads(line)["prompt"] for line in (run / "eval" / "step-2.jsonl").read_text().splitlines()]
    assert scored == prompts[:2]
