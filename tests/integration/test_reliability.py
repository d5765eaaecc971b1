"""Resume after a kill, non-finite steps, bad input: the behaviours that keep runs safe."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from ddrl.training import trainer as trainer_mod
from ddrl.training.trainer import NonFiniteError, Trainer, train
from tests.integration.conftest import ROOT, rl_overrides

CFG = ROOT / "configs/rl/grpo_mini_sudoku.yaml"


def _weights(d):
    return load_file(d / "model.safetensors")


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def _base(model, out):
    return rl_overrides(model, out, steps=4) + ["train.save_every=1", "train.keep_checkpoints=10",
                                                 "train.num_iterations=2", "eval.before=false"]


def test_resume_after_crash_gives_the_uninterrupted_parameters(tiny_sudoku_model, tmp_path, monkeypatch):
    ref = train(CFG, _base(tiny_sudoku_model, tmp_path / "a"))
    original = Trainer.train_step

    def crash_at_3(self, step):
        if step == 3:
            raise KeyboardInterrupt  # stands in for a kill in the middle of step 3
        return original(self, step)

    monkeypatch.setattr(Trainer, "train_step", crash_at_3)
    with pytest.raises(KeyboardInterrupt):
        train(CFG, _base(tiny_sudoku_model, tmp_path / "b"))
    monkeypatch.setattr(Trainer, "train_step", original)
    assert not (tmp_path / "b" / "checkpoint-3").exists()
    resumed = train(CFG, _base(tiny_sudoku_model, tmp_path / "b") + ["resume=true"])
    assert _same(_weights(ref / "checkpoint-4"), _weights(resumed / "checkpoint-4"))
    steps = [int(line.split('"step": ')[1].split(",")[0]) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_sigkill_then_resume(tiny_sudoku_model, tmp_path):
    ref = train(CFG, _base(tiny_sudoku_model, tmp_path / "a"))
    out = tmp_path / "b"
    cmd = [sys.executable, "-m", "ddrl", "train", str(CFG), *_base(tiny_sudoku_model, out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (out / "checkpoint-2").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed = train(CFG, _base(tiny_sudoku_model, out) + ["resume=true"])
    assert _same(_weights(ref / "checkpoint-4"), _weights(resumed / "checkpoint-4"))


def test_nonfinite_steps_are_skipped_then_stop(tiny_sudoku_model, tmp_path, monkeypatch):
    calls = {"n": 0}
    real_build = trainer_mod.build_method

    def nan_method(cfg):
        method = real_build(cfg)
        objective = method.objective
        real_call = objective.__call__

        class NaNObjective(type(objective)):
            def __call__(self, *a, **kw):
                out = real_call(*a, **kw)
                calls["n"] += 1
                out.loss = out.loss * float("nan")
                return out

        objective.__class__ = NaNObjective
        return method

    monkeypatch.setattr(trainer_mod, "build_method", nan_method)
    before = _weights(tiny_sudoku_model)
    with pytest.raises(NonFiniteError, match="non-finite loss or gradient"):
        train(CFG, rl_overrides(tiny_sudoku_model, tmp_path, steps=10) + ["train.max_bad_steps=3", "eval.before=false", "train.num_iterations=1"])
    assert calls["n"] == 3
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2 and '"nonfinite_steps": 1.0' in lines[0]  # two skipped steps logged, third stops
    del before


@pytest.mark.parametrize("override,message", [
    ("objective=nope", "method.objective='nope' is not valid"),
    ("task.name=nope", "task.name='nope' is not valid"),
    ("train.lrr=1", "unknown config key 'train.lrr'"),
    ("rollout.block_length=5", "not divisible by rollout.block_length=5"),
])
def test_bad_config_is_one_line_error_before_compute(override, message, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ddrl", "train", str(CFG), override, f"output_dir={tmp_path}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_missing_model_dir_is_a_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ddrl", "train", str(CFG), f"model.path={tmp_path}/none",
                           f"output_dir={tmp_path}/run"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_gradient_checkpointing_on_a_model_without_it_is_an_error(tiny_sudoku_model, tmp_path):
    """A memory setting the model cannot honour is refused at load, not ignored until the first OOM."""
    from ddrl.config import RLConfig, load_config
    from ddrl.models import load_model
    from ddrl.training.trainer import Provided

    def without_checkpointing(path, **kwargs):
        model = load_model(path, **kwargs)
        model.gradient_checkpointing_enable = None  # as a user's module that lacks the method
        return model

    cfg = load_config(CFG, rl_overrides(tiny_sudoku_model, tmp_path / "run") + ["model.gradient_checkpointing=true"],
                      RLConfig)
    with pytest.raises(ValueError, match="model.gradient_checkpointing=true"):
        Trainer(cfg, Provided(load_model=without_checkpointing))
    assert not (tmp_path / "run").exists()
