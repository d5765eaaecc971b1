"""train.minibatches is rank-invariant: 1 process and 8 processes (gloo, CPU, DDP) make the same
optimizer steps on the same groups, so the TraceRL and UniGRPO recipes' loop options (minibatches of
one or two groups, mu = 2, micro-batches, group filtering) give the same parameters.

Before, each rank cut its OWN groups into train.minibatches shares: with 8 prompts on 8 ranks every
rank held one group, 7 of its 8 shares were empty, and a rollout made one optimizer step of 8 groups
instead of 8 steps of one group (the paper recipes: 32 prompts, minibatches 32, 8 GPUs: 4 steps of 8
groups instead of 32 of one). Any world size with fewer groups per rank than minibatches shows it;
8 processes is the machine the recipes are written for.

Equality needs every random draw to be independent of the split (see test_distributed): rollouts
draw per group; TraceRL's estimator has no noise; UniGRPO's random-ratio masks are drawn per
micro-batch from the shared seed, so its micro-batches are one group each (micro_batch_size = G) in
both runs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.integration.conftest import ROOT
from tests.integration.test_distributed import max_diff, weights

RECIPES = {
    # TraceRL (configs/paper/tracerl_llada8b.yaml): one group per optimizer step, trace-state
    # micro-batches, groups outside [0, 0.9] dropped (FilteredMiniSudoku drops some at seed 0).
    "tracerl": ["train.minibatches=8", "train.micro_batch_rows=8", "train.num_iterations=2",
                "task.name=tests.integration.test_distributed:filtered_mini_sudoku", "train.group_filter=[0.0,0.9]"],
    # UniGRPO (configs/paper/unigrpo_llada8b.yaml's loop, mu = 2 as configs/rl): two groups per
    # optimizer step, spread over two ranks under 8 processes; masks drawn per group (micro_batch_size),
    # backward per chunk of 5 (sample, copy) rows that split a sample's 3 copies.
    "unigrpo": ["train.minibatches=4", "train.micro_batch_size=4", "train.micro_batch_rows=5",
                "method.estimator_args.copies=3", "train.num_iterations=2",
                "task.name=tests.integration.test_distributed:dense_mini_sudoku"],
}


def run(recipe: str, model_dir, out, processes: int) -> None:
    args = [f"model.path={model_dir}", "train.steps=1", "train.prompts_per_step=8", "train.group_size=4",
            "train.lr=1e-3", "train.save_every=1", "eval.n=0", "eval.before=false", "train.progress=false",
            "train.tensorboard=false", "rollout.threshold=null", "dist.strategy=ddp", f"output_dir={out}",
            *RECIPES[recipe]]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"] if processes > 1 else []
    config = ROOT / f"configs/rl/{recipe}_mini_sudoku.yaml"
    command = [sys.executable, *launcher, "-m", "ddrl", "train", str(config), *args]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    first = ""
    if processes > 1 and killed_by_abort(done):
        # Once in ~17 runs here (a full CI run, never reproduced in 16 direct ones) one of the 8 gloo
        # ranks died of SIGABRT with no Python traceback and the others were stopped. A collective that
        # is really mismatched aborts every time, so one relaunch tells a transport failure from a bug;
        # the first attempt's log is kept in the message if the relaunch fails too.
        first = "first attempt (SIGABRT):\n" + done.stderr[:2000] + "\n...\n"
        shutil.rmtree(out, ignore_errors=True)
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, first + done.stdout[-2000:] + done.stderr[:3000] + "\n...\n" + done.stderr[-3000:]


def killed_by_abort(done: subprocess.CompletedProcess) -> bool:
    """torchrun failed because a rank was killed by SIGABRT, and no rank raised a Python exception."""
    return done.returncode != 0 and "SIGABRT" in done.stderr and not re.search(r"exitcode\s*:\s*[1-9]", done.stderr)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_eight_processes_make_the_one_process_optimizer_steps(recipe, tiny_sudoku_model, tmp_path):
    run(recipe, tiny_sudoku_model, tmp_path / "one", processes=1)
    run(recipe, tiny_sudoku_model, tmp_path / "eight", processes=8)
    one, eight = (json.loads((tmp_path / d / "metrics.jsonl").read_text().splitlines()[0]) for d in ("one", "eight"))
    if recipe == "tracerl":
        assert 0 < one["update/groups_kept_frac"] < 1, "the filter must drop some groups: test is void"
    # mu x minibatches optimizer steps (fewer when the filter empties a share), the same in both runs
    assert eight["optimizer_steps"] == one["optimizer_steps"] >= 4
    assert max_diff(weights(tmp_path / "one" / "checkpoint-1"), weights(tiny_sudoku_model)) > 1e-4, "void: no update"
    assert max_diff(weights(tmp_path / "eight" / "checkpoint-1"), weights(tmp_path / "one" / "checkpoint-1")) < 1e-5
