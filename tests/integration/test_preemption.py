"""Preemption, tested the way the SIGKILL test is (test_reliability.py): `ddrl train` in a
subprocess gets SIGTERM mid-run, finishes its step, writes a checkpoint and exits with code 0;
resume=true then ends with the weights and metrics of an uninterrupted run. And under 2 processes
a signal that reaches one rank stops both after the same step.

The 2-process worker is this module run under torchrun: `python -m tests.integration.test_preemption`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.integration.conftest import ROOT, rl_overrides

CFG = ROOT / "configs/rl/grpo_mini_sudoku.yaml"
STEPS = 8


def _base(model: Path, out: Path) -> list[str]:
    # save_every=0: the only checkpoint before the last step is the one preemption writes
    return rl_overrides(model, out, steps=STEPS) + ["train.save_every=0", "train.keep_checkpoints=10",
                                                     "train.num_iterations=2", "eval.before=false"]


def _rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_sigterm_finishes_the_step_checkpoints_exits_cleanly_and_resume_loses_nothing(tiny_sudoku_model, tmp_path):
    from ddrl.training.checkpoint import list_checkpoints
    from ddrl.training.trainer import train

    ref = train(CFG, _base(tiny_sudoku_model, tmp_path / "a"))
    out = tmp_path / "b"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = tmp_path / "stderr.txt"
    with log.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "ddrl", "train", str(CFG), *_base(tiny_sudoku_model, out)],
                                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        deadline = time.time() + 180
        while not _rows(out) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # mid-run: step 1 is logged, a later one is under way
        proc.wait(timeout=180)
    assert proc.returncode == 0, log.read_text()[-3000:]
    assert "SIGTERM received" in log.read_text()
    logged = [row["step"] for row in _rows(out)]
    stopped = logged[-1]
    assert stopped < STEPS, "the run ended before the signal arrived: the test is void"
    assert [p.name for p in list_checkpoints(out)] == [f"checkpoint-{stopped}"]  # the step it stopped after

    resumed = train(CFG, _base(tiny_sudoku_model, out) + ["resume=true"])
    final = f"checkpoint-{STEPS}"
    want, got = load_file(ref / final / "model.safetensors"), load_file(resumed / final / "model.safetensors")
    assert all(torch.equal(want[k], got[k]) for k in want)
    rows, ref_rows = _rows(resumed), _rows(ref)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # no step lost, none repeated
    for key in ("reward/mean", "loss", "grad_norm"):
        assert [r[key] for r in rows] == [r[key] for r in ref_rows], key


def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "tests.integration.test_preemption", str(tmp_path / "stopped.json")]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads((tmp_path / "stopped.json").read_text()) == [2, 2]


def _agreement_worker(out: str) -> None:
    """Rank 1 alone is signalled during step 2; both ranks must see the request after step 2."""
    import torch.distributed as tdist

    from ddrl.training.distributed import end_process_group, init_distributed
    from ddrl.training.preemption import PreemptionGuard

    cpu = torch.device("cpu")
    info = init_distributed(None, cpu)
    stopped = None
    with PreemptionGuard() as guard:
        for step in range(1, 6):
            if step == 2 and info.rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            if guard.requested(info, cpu):
                stopped = step
                break
    every: list = [None] * info.world_size
    tdist.all_gather_object(every, stopped)
    if info.is_main:
        Path(out).write_text(json.dumps(every))
    end_process_group()


if __name__ == "__main__":
    from ddrl.training.distributed import exit_without_finalizing

    _agreement_worker(sys.argv[1])
    exit_without_finalizing(0)  # gloo's threads can abort the interpreter's exit (SIGABRT): its docstring
