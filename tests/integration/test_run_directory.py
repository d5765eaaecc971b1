"""Nothing lost (issue 32): Ctrl-C checkpoints like SIGTERM; resume=true with nothing to resume is an
error (resume=auto starts fresh); a corrupt newest checkpoint falls back to the one before; a resumed
run logs each step once; a new run does not overwrite a run directory; a failed start leaves no empty
directory; the run directory keeps train.log."""

from __future__ import annotations

import json
import os
import signal

import pytest

from ddrl.training.checkpoint import list_checkpoints
from ddrl.training.trainer import Trainer, train
from tests.integration.conftest import ROOT, rl_overrides

CFG = ROOT / "configs/rl/grpo_mini_sudoku.yaml"


def _base(model, out, steps=3, *extra):
    return rl_overrides(model, out, steps=steps) + ["eval.n=0", "eval.before=false", *extra]


def _steps(run):
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_ctrl_c_finishes_the_step_writes_a_checkpoint_then_interrupts(tiny_sudoku_model, tmp_path, monkeypatch):
    original = Trainer.train_step

    def ctrl_c_at_2(self, step):
        out = original(self, step)
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # the default save_every=0: no checkpoint before the last step
        return out

    monkeypatch.setattr(Trainer, "train_step", ctrl_c_at_2)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(CFG, _base(tiny_sudoku_model, out, 4, "train.save_every=0"))
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2"] and _steps(out) == [1, 2]
    monkeypatch.setattr(Trainer, "train_step", original)
    train(CFG, _base(tiny_sudoku_model, out, 4, "train.save_every=0", "resume=true"))
    assert _steps(out) == [1, 2, 3, 4]


@pytest.mark.parametrize("make", [False, True])
def test_resume_true_with_nothing_to_resume_is_an_error_naming_the_directory(tiny_sudoku_model, tmp_path, make):
    out = tmp_path / "misspelt"
    if make:
        out.mkdir()
    with pytest.raises(ValueError, match=f"resume=true but output_dir '{out}'.*nothing to resume.*resume=auto"):
        train(CFG, _base(tiny_sudoku_model, out, 1, "resume=true"))
    assert out.exists() == make  # nothing made


def test_resume_auto_starts_fresh_and_a_new_run_refuses_an_existing_run(tiny_sudoku_model, tmp_path):
    out = tmp_path / "run"
    train(CFG, _base(tiny_sudoku_model, out, 1, "resume=auto"))
    assert _steps(out) == [1]
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match=f"output_dir '{out}' already holds a run .*resume=true.*overwrite=true"):
        train(CFG, _base(tiny_sudoku_model, out, 2))
    assert (out / "metrics.jsonl").read_text() == before
    train(CFG, _base(tiny_sudoku_model, out, 2, "overwrite=true", "train.save_every=2"))
    assert _steps(out) == [1, 2] and [p.name for p in list_checkpoints(out)] == ["checkpoint-2"]


def test_a_failed_start_leaves_no_empty_run_directory(tiny_sudoku_model, tmp_path):
    out = tmp_path / "runs" / "new"
    with pytest.raises(ValueError):
        train(CFG, _base(tiny_sudoku_model, out, 1) + [f"model.path={tmp_path / 'no-model'}"])
    assert not (tmp_path / "runs").exists()


def test_a_corrupt_newest_checkpoint_falls_back_and_resumed_steps_are_logged_once(tiny_sudoku_model, tmp_path):
    out = tmp_path / "run"
    train(CFG, _base(tiny_sudoku_model, out, 3, "train.save_every=1", "train.keep_checkpoints=5"))
    weights = out / "checkpoint-3" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # a copy cut short
    train(CFG, _base(tiny_sudoku_model, out, 4, "train.save_every=1", "train.keep_checkpoints=5", "resume=true"))
    assert _steps(out) == [1, 2, 3, 4]  # steps 3 and 4 run again from checkpoint-2, each logged once
    log = (out / "train.log").read_text()
    assert f"'{weights}' is truncated" in log and "falling back" in log
    assert "resume: continuing from" in log and "checkpoint-2" in log


def test_train_log_holds_what_the_run_printed_and_a_line_per_step(tiny_sudoku_model, tmp_path):
    out = tmp_path / "run"
    train(CFG, _base(tiny_sudoku_model, out, 2, "train.progress=true"))
    log = (out / "train.log").read_text()
    assert "length: train.steps=2" in log and "step 1/2: reward/mean" in log and "step 2/2:" in log
    assert "\r" not in log
