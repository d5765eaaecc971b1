"""N ranks train, log and fail as one: every method at N gloo processes (CPU) against one process,
under DDP and FSDP2 (issue 34).

    OMP_NUM_THREADS=1 python bench/world_size.py                          # 8 processes, every text method
                                                                          # (+ per-group masks of 3 estimators)
    OMP_NUM_THREADS=1 python bench/world_size.py --processes 2 --methods stable_drl grpo --strategies fsdp

Each method's configs/rl/<method>_mini_sudoku.yaml on the shipped checkpoints/mini_sudoku-masked
model and task: 16 prompts x G = 4, one RL step of mu = 2 inner iterations x 2 minibatch shares of
the step's global groups (4 optimizer steps; at 8 processes each share lies on 4 ranks, the other 4
only pad it), one group per micro-batch (train.micro_batch_size = G: every estimator draws its masks
per micro-batch from the step's seed, StableDRL's fresh ones from the micro-batch's global group, so
equal micro-batches make every draw independent of the split), train.max_grad_norm small enough to
clip. Compared with one process: the weights after the step, the optimizer-step count, the
pre-clip gradient norm, the logged loss/total, loss/kl, ratio/mean, clip_ratio/region_mean and
update/rows, and the rollout's reward mean and std, invalid fraction, completion length, |advantage|,
tokens fed and kept fractions. Prints a table and writes bench/results/world_size.json.
tests/integration/test_world_size.py runs the same
comparison at 2 processes on a tiny model in `make test`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.test_distributed import max_diff, weights  # noqa: E402
from tests.integration.test_minibatch_ranks import killed_by_abort  # noqa: E402

METHODS = ("grpo", "wd1", "spg", "espo", "tracerl", "unigrpo", "coupled_grpo", "maskgrpo", "stable_drl", "gdsd",
           "gdsd_tlc", "daca_grpo", "dipod", "fpo", "sepo")
# Per-group masks (an estimator's mask_per_group option): each group's masks from its step-global index.
PER_GROUP = ["method.estimator_args.mask_per_group=true"]
VARIANTS = {"unigrpo_per_group": "unigrpo", "espo_per_group": "espo", "spg_per_group": "spg"}  # -> its config
# An estimator's own training rows cut into micro-batches (train.micro_batch_rows), as their recipes do.
METHOD_ARGS = {"tracerl": ["train.micro_batch_rows=8"], "unigrpo": ["train.micro_batch_rows=5"],
               "unigrpo_per_group": ["train.micro_batch_rows=5", *PER_GROUP], "espo_per_group": PER_GROUP,
               "spg_per_group": PER_GROUP}
STRATEGIES = {"ddp": ["dist.strategy=ddp"], "fsdp": ["dist.strategy=fsdp"],
              # FSDP2's CPUOffloadPolicy: the clip's norm over gradients in host memory
              "fsdp_offload": ["dist.strategy=fsdp", "dist.cpu_offload=true"]}
METRICS = ("loss/total", "loss/kl", "ratio/mean", "clip_ratio/region_mean", "update/rows", "grad_norm",
           # the rollout's statistics of rows (RowSums): a mean of rank means and a mean of rank stds before
           "reward/mean", "reward/std", "reward/invalid_frac", "completions/mean_length", "advantage/abs_mean",
           "rollout/forward_tokens", "update/rows_frac", "update/groups_kept_frac")
MAX_GRAD_NORM = 1e-3  # below every method's gradient norm here: every optimizer step clips
WEIGHT_TOL, METRIC_REL = 1e-5, 1e-4


def overrides(model_dir: Path, out: Path, prompts: int, task: str | None) -> list[str]:
    return [f"model.path={model_dir}", "train.steps=1", f"train.prompts_per_step={prompts}", "train.group_size=4",
            "train.micro_batch_size=4", "train.minibatches=2", "train.num_iterations=2", "train.lr=1e-3",
            f"train.max_grad_norm={MAX_GRAD_NORM}", "train.save_every=1", "train.sharded_checkpoints=false",
            "eval.n=0", "eval.before=false", "train.progress=false", "train.tensorboard=false",
            "rollout.threshold=null", f"output_dir={out}", *([f"task.name={task}"] if task else [])]


def train_run(method: str, processes: int, strategy: str, out: Path, model_dir: Path, *, prompts: int,
              task: str | None = None) -> float:
    """`ddrl train` of one RL step in fresh processes (torchrun for N > 1, one thread each); seconds."""
    args = overrides(model_dir, out, prompts, task) + METHOD_ARGS.get(method, [])
    if processes > 1:
        args += STRATEGIES[strategy]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"] if processes > 1 else []
    config = ROOT / f"configs/rl/{VARIANTS.get(method, method)}_mini_sudoku.yaml"
    command = [sys.executable, *launcher, "-m", "ddrl", "train", str(config), *args]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if processes > 1 and killed_by_abort(done):  # a gloo transport failure, not a bug: relaunch once
        shutil.rmtree(out, ignore_errors=True)
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{method} at {processes} processes ({strategy}) failed:\n{done.stdout[-2000:]}\n"
                           f"{done.stderr[:2000]}\n...\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def logged(run: Path) -> dict[str, Any]:
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[0])


def compare(one: Path, many: Path, initial: Path) -> dict[str, Any]:
    """What an N-process run must share with the 1-process one, and the differences."""
    a, b = logged(one), logged(many)
    metrics = {}
    for name in METRICS:
        if name in a or name in b:
            x, y = a.get(name), b.get(name)
            same = x is not None and y is not None and math.isclose(x, y, rel_tol=METRIC_REL, abs_tol=1e-6)
            metrics[name] = {"one": x, "many": y, "same": same}
    moved = max_diff(weights(one / "checkpoint-1"), weights(initial))
    diff = max_diff(weights(many / "checkpoint-1"), weights(one / "checkpoint-1"))
    return {"weights_moved": moved, "weights_max_diff": diff, "optimizer_steps": [a["optimizer_steps"],
                                                                                  b["optimizer_steps"]],
            "clipped": a["grad_norm"] > MAX_GRAD_NORM, "metrics": metrics,
            "ok": (moved > 1e-4 and diff < WEIGHT_TOL and a["optimizer_steps"] == b["optimizer_steps"]
                   and all(m["same"] for m in metrics.values()))}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=8)
    ap.add_argument("--methods", nargs="+", default=[*METHODS, *VARIANTS], choices=[*METHODS, *VARIANTS])
    ap.add_argument("--strategies", nargs="+", default=["ddp", "fsdp"], choices=sorted(STRATEGIES))
    ap.add_argument("--model", type=Path, default=ROOT / "checkpoints/mini_sudoku-masked")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/world_size.json")
    args = ap.parse_args(argv)
    prompts = 2 * args.processes  # two groups per rank
    results: dict[str, Any] = {"processes": args.processes, "prompts_per_step": prompts, "group_size": 4,
                               "methods": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods:
            row: dict[str, Any] = {}
            one = Path(tmp) / method / "one"
            row["one_s"] = train_run(method, 1, "none", one, args.model, prompts=prompts)
            for strategy in args.strategies:
                many = Path(tmp) / method / strategy
                seconds = train_run(method, args.processes, strategy, many, args.model, prompts=prompts)
                row[strategy] = {**compare(one, many, args.model), "seconds": seconds}
                r = row[strategy]
                print(f"| {method} | {strategy} | {'ok' if r['ok'] else 'DIFFERS'} | {r['weights_max_diff']:.1e} | "
                      f"{r['optimizer_steps']} | "
                      + ", ".join(f"{k} {m['one']}/{m['many']}" for k, m in r["metrics"].items()) + " |",
                      flush=True)
            results["methods"][method] = row
    results["all_ok"] = all(r[s]["ok"] for r in results["methods"].values() for s in args.strategies)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"all methods agree with one process: {results['all_ok']} ({args.out})")
    return results


if __name__ == "__main__":
    sys.exit(0 if main()["all_ok"] else 1)
