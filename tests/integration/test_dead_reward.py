"""A reward that dies mid-run (issue 32): after train.max_invalid_steps steps whose rewards are all
None/NaN the run stops with an error (exit code 3 from `ddrl train`); no optimizer step is taken on
such a step (AdamW's momentum moved the weights on a zero gradient); keep_checkpoints rotation
never removes the newest checkpoint made with valid rewards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from ddrl.training.checkpoint import list_checkpoints, load_trainer_state
from ddrl.training.trainer import DeadRewardError, train
from tests.integration.conftest import ROOT, rl_overrides

CFG = ROOT / "configs/rl/grpo_mini_sudoku.yaml"


def _overrides(model, out, steps, *extra):
    return rl_overrides(model, out, steps=steps) + ["eval.n=0", "eval.before=false", "train.save_every=1",
                                                     "train.keep_checkpoints=2", *extra]


def _weights(checkpoint):
    return load_file(checkpoint / "model.safetensors")


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_all_invalid_steps_stop_the_run_without_moving_the_weights(tiny_sudoku_model, tmp_path):
    out = tmp_path / "run"
    task = ["task.name=tests.integration.failing_reward_task:make_dying", "task.args.works_for=3"]
    with pytest.raises(DeadRewardError) as stopped:
        train(CFG, _overrides(tiny_sudoku_model, out, 10, "train.max_invalid_steps=2", *task))
    message = str(stopped.value)
    assert "step 5" in message and "4-5" in message and "reward server down" in message
    assert "checkpoint-5 holds the weights after step 3" in message and "checkpoint-3" in message
    # keep_checkpoints=2 keeps the newest two and the newest made with valid rewards
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-3", "checkpoint-4", "checkpoint-5"]
    assert _same(_weights(out / "checkpoint-3"), _weights(out / "checkpoint-5"))  # no update on a dead step
    assert not _same(_weights(tiny_sudoku_model), _weights(out / "checkpoint-3"))  # the valid steps did learn
    state = load_trainer_state(out / "checkpoint-5")
    assert (state["rewards_valid"], state["last_valid_step"], state["valid_checkpoint"]) == (False, 3, 3)
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["reward/all_invalid"] for r in rows] == [0, 0, 0, 1, 1]
    assert [r["reward/invalid_frac"] for r in rows][3:] == [1, 1]
    assert "ddrl: error: step 5" in (out / "train.log").read_text()


def test_max_invalid_steps_0_never_stops_and_still_skips_the_update(tiny_sudoku_model, tmp_path):
    out = tmp_path / "run"
    task = ["task.name=tests.integration.failing_reward_task:make_dying", "task.args.works_for=1"]
    train(CFG, _overrides(tiny_sudoku_model, out, 3, "train.max_invalid_steps=0", *task))
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert _same(_weights(out / "checkpoint-1"), _weights(out / "checkpoint-3"))


def test_a_reward_server_killed_mid_run_stops_ddrl_train_and_keeps_the_last_valid_checkpoint(tiny_sudoku_model,
                                                                                               tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen([sys.executable, "-m", "ddrl", "serve-reward", "--reward",
                               "tests.integration.failing_reward_task:cell_accuracy", "--port", "0"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = tmp_path / "run"
    try:
        url = server.stdout.readline().split(" at ")[1].split()[0]  # "serving reward ... at http://...:PORT (...)"
        run = subprocess.Popen([sys.executable, "-m", "ddrl", "train", str(CFG),
                                *_overrides(tiny_sudoku_model, out, 40, "train.max_invalid_steps=2",
                                            "task.name=tests.integration.failing_reward_task:make_served",
                                            f"task.args.url={url}")],
                               cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while not (out / "checkpoint-2").exists() and time.time() < deadline and run.poll() is None:
            time.sleep(0.05)
        server.kill()  # the reward server dies mid-run
        _, stderr = run.communicate(timeout=180)
    finally:
        server.kill()
        server.wait()
    assert run.returncode == 3, stderr[-3000:]
    assert "is the reward server down" in stderr and "gave no rewards" in stderr
    rows = _rows(out)
    last_valid = max(r["step"] for r in rows if not r["reward/all_invalid"])
    stopped = rows[-1]["step"]
    assert stopped < 40 and [r["reward/all_invalid"] for r in rows[-2:]] == [1, 1]
    kept = [p.name for p in list_checkpoints(out)]
    assert kept == [f"checkpoint-{last_valid}", f"checkpoint-{stopped - 1}", f"checkpoint-{stopped}"]
    assert load_trainer_state(out / kept[0])["rewards_valid"] is True
    assert _same(_weights(out / kept[0]), _weights(out / kept[-1]))
    log = (out / "train.log").read_text()
    assert "gave no rewards" in log and "ddrl: error:" in log and "\r" not in log
