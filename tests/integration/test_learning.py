"""RL must climb a reward: the end-to-end sign check that loss tests on small tensors cannot give.

The reward (fraction of '1' cells, tests/integration/dense_task.py) is trivially learnable and
dense, so after a dozen steps every correct policy-gradient pipeline has raised it well above
where it started; a sign error, a detached proxy, advantages that do not reach the loss or an
optimizer that never steps leave it flat or push it down.
"""

import json

import pytest

from tests.integration.conftest import rl_overrides

METHODS = ["stable_drl", "grpo", "espo", "spg", "gdsd", "maskgrpo", "sepo", "wd1"]


@pytest.mark.parametrize("method", METHODS)
def test_rl_raises_a_learnable_reward(method, tiny_sudoku_model, tmp_path):
    from ddrl.training.trainer import train

    run = train("configs/rl/stable_drl_mini_sudoku.yaml", [
        *rl_overrides(tiny_sudoku_model, tmp_path / method, steps=12),
        "task.name=tests.integration.dense_task:make_ones", f"objective={method}", "method.estimator_args={}",
        "train.prompts_per_step=4", "train.group_size=8", "train.lr=1e-3", "train.warmup_steps=0",
        "eval.before=false", "rollout.temperature=1.0"])
    rewards = [json.loads(line)["reward/mean"] for line in (run / "metrics.jsonl").read_text().splitlines()
               if '"reward/mean"' in line]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.15, f"{method}: reward {first:.3f} -> {last:.3f} in 12 steps: {rewards}"
