"""The memory model against a measured peak: one `ddrl train` step of a 75M-parameter float32 model
on the CPU (weights, gradients, AdamW and the reference copy dominate), within 20% of the estimate;
and a one-process FSDP2 run with dist.cpu_offload trains."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.integration.conftest import ROOT

ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
RL = ["train.steps=1", "train.prompts_per_step=2", "train.group_size=4", "eval.n=0", "eval.before=false",
      "train.progress=false", "train.tensorboard=false"]


def test_estimate_is_within_20_percent_of_the_measured_cpu_peak(tmp_path):
    from ddrl.training.pretrain import pretrain

    model = pretrain(ROOT / "configs/pretrain/mini_sudoku_masked.yaml",
                     ["model.d_model=1024", "model.n_layers=6", "model.n_heads=8", "train.steps=1",
                      "train.batch_size=4", "data.n_train=64", "data.n_heldout=8", "train.eval_every=1000",
                      "train.progress=false", f"output_dir={tmp_path / 'model'}"])
    done = subprocess.run([sys.executable, "-m", "tests.integration.memory_peak_worker",
                           str(ROOT / "configs/rl/grpo_mini_sudoku.yaml"), f"model.path={model}",
                           f"output_dir={tmp_path / 'run'}", *RL], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["measured"] > 1.2e9, "the state must dominate (75M params x 16-20 B): test is void"
    assert result["estimate"] == pytest.approx(result["measured"], rel=0.2), result["report"]


def test_one_process_fsdp_with_cpu_offload_trains(tiny_sudoku_model, tmp_path):
    done = subprocess.run([sys.executable, "-m", "ddrl", "train", str(ROOT / "configs/rl/grpo_mini_sudoku.yaml"),
                           f"model.path={tiny_sudoku_model}", f"output_dir={tmp_path}", "dist.strategy=fsdp",
                           "dist.cpu_offload=true", "model.mixed_precision=bf16", *RL],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "checkpoint-1" / "sharded_state").is_dir()  # FSDP2 ran, and saved sharded
