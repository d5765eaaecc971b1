"""Where the time of one RL step goes: seconds per phase, reference sampler against the fast one.

One tiny-model RL step (ddrl.training.trainer.Trainer.train_step) per variant, variants interleaved
and repeated in one process, best time per phase kept. For each phase it also counts the tokens
the model was run on (a forward hook on the policy and the reference model) and turns them into
model FLOPs, 2 * params * tokens for a forward pass and 3x that for forward + backward (weight
matmuls only; attention's T^2 term is left out), compared with this machine's measured
matrix-multiply rate (one large torch.matmul, same thread count).

    python bench/bench_rl_step.py [--config configs/rl/grpo_mini_sudoku.yaml] [--model DIR]
                                  [--set KEY=VALUE ...] [--repeats 2] [--threads 1] [--json]

Without --model a tiny 4x4 Sudoku model is pretrained first (as tests/integration/conftest.py
does, ~30 s), into runs/bench/tiny-mini-sudoku. "reference" is the config with rollout.cache=none
rollout.threshold=null; "fast" is the config as shipped (its rollout defaults); --set overrides
apply to both (e.g. --set train.group_size=8).

**Against another commit, in one run** (issue 16's target: the d1 setting at least as fast as at da5c705):

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_rl_step.py --against da5c705 --rounds 6 --steps 4

The commit's files are extracted once with `git archive` into /tmp/ddrl-bench-<sha> (the repository
is not touched). Each round runs one worker process per tree, the order alternating round by round
(ABBA), all with the same interpreter, one torch thread and the same overrides. A worker imports
ddrl from its own tree, loads the tree's own config and shipped checkpoint (relative paths resolve in
the tree; a difference between the two trees' files is reported), runs one warm-up step, then
--steps timed Trainer.train_step calls (wall clock around each). The ratio is median(current) /
median(commit) over all timed steps: < 1 means the working tree is faster.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
# A --worker imports ddrl from the tree it measures (DDRL_BENCH_TREE), not from this file's.
sys.path.insert(0, os.environ.get("DDRL_BENCH_TREE", str(ROOT)))
D1_CONFIG = "configs/rl/grpo_mini_sudoku.yaml"  # the shipped diffu-GRPO (d1) config on the tiny Sudoku model
WORKER_TAG = "BENCH_WORKER_JSON "

TINY_MODEL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "data.n_train=256", "data.n_heldout=16",
              "train.batch_size=32", "train.eval_every=1000", "train.progress=false", "train.steps=30"]
PHASES = ("rollout", "reward", "advantage", "old", "ref", "update")


def tiny_model(out: Path) -> Path:
    final = out / "final"
    if not (final / "config.json").is_file():
        from ddrl.training.pretrain import pretrain

        pretrain(ROOT / "configs/pretrain/mini_sudoku_masked.yaml", [f"output_dir={out}", *TINY_MODEL])
    return final


def matmul_flops(n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class TokenCounter:
    """Forward pre-hooks: tokens run through a model, per phase, without / with autograd."""

    def __init__(self) -> None:
        self.phase = "other"
        self.tokens: dict[str, list[int]] = {}  # phase -> [forward-only tokens, forward+backward tokens]

    def hook(self, module, args, kwargs) -> None:
        ids = args[0] if args else kwargs["input_ids"]
        counts = self.tokens.setdefault(self.phase, [0, 0])
        counts[1 if torch.is_grad_enabled() else 0] += ids.numel()

    def tag(self, phase: str, fn):
        def tagged(*args, **kwargs):
            before, self.phase = self.phase, phase
            try:
                return fn(*args, **kwargs)
            finally:
                self.phase = before
        return tagged


def one_step(config: str, overrides: list[str]) -> tuple[dict[str, float], dict[str, list[int]], int]:
    from ddrl.config import RLConfig, load_config
    from ddrl.training.trainer import Trainer

    cfg = load_config(config, overrides, RLConfig)
    trainer = Trainer(cfg)
    counter = TokenCounter()
    trainer.model.register_forward_pre_hook(counter.hook, with_kwargs=True)
    if trainer.ref_model is not None:
        trainer.ref_model.register_forward_pre_hook(counter.hook, with_kwargs=True)
    # The old and ref passes share behaviour_passes: the phase is the name it times the pass under.
    trainer.rollout = counter.tag("rollout", trainer.rollout)
    trainer.score = counter.tag("reward", trainer.score)
    trainer.update = counter.tag("update", trainer.update)
    original = trainer.behaviour_passes

    def behaviour_passes(batch, step, clock):
        class Tagging:
            def __call__(self, name):
                counter.phase = name
                return clock(name)
        try:
            return original(batch, step, Tagging())
        finally:
            counter.phase = "other"

    trainer.behaviour_passes = behaviour_passes
    metrics = trainer.train_step(1)
    n_params = sum(p.numel() for p in trainer.model.parameters())
    times = {p: float(metrics.get(f"time/{p}", 0.0)) for p in PHASES}
    times["step"] = float(metrics.get("time/step", sum(times.values())))
    times["model_calls"] = float(metrics.get("rollout/model_calls", 0.0))
    times["reward_mean"] = float(metrics.get("reward/mean", float("nan")))
    return times, counter.tokens, n_params


def phases_main(args: argparse.Namespace):
    """Reference sampler against the fast one, phase by phase, in this tree."""
    model = Path(args.model) if args.model else tiny_model(ROOT / "runs/bench/tiny-mini-sudoku")
    peak = matmul_flops()
    variants = {"reference": ["rollout.cache=none", "rollout.threshold=null"], "fast": list(args.fast)}
    best: dict[str, dict[str, float]] = {}
    tokens: dict[str, dict[str, list[int]]] = {}
    n_params = 0
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for name, extra in variants.items():
                overrides = [f"model.path={model}", "train.steps=1", "train.progress=false", "train.tensorboard=false",
                             "eval.n=0", f"output_dir={tmp}/{name}-{r}", *args.set, *extra]
                times, counts, n_params = one_step(args.config, overrides)
                b = best.setdefault(name, {})
                for k, v in times.items():
                    b[k] = min(b.get(k, float("inf")), v) if k in (*PHASES, "step") else v
                tokens[name] = counts

    rows = []
    for name in variants:
        for phase in (*PHASES, "step"):
            sec = best[name][phase]
            if phase == "step":
                fwd = sum(c[0] for c in tokens[name].values())
                bwd = sum(c[1] for c in tokens[name].values())
            else:
                fwd, bwd = tokens[name].get(phase, [0, 0])
            flops = 2 * n_params * fwd + 6 * n_params * bwd
            rows.append({"variant": name, "phase": phase, "seconds": sec,
                         "vs_reference": sec / best["reference"][phase] if best["reference"][phase] else float("nan"),
                         "share_of_step": sec / best[name]["step"], "fwd_tokens": fwd, "fwd_bwd_tokens": bwd,
                         "GFLOP_per_s": flops / sec / 1e9 if sec else 0.0,
                         "pct_of_matmul_peak": 100 * flops / sec / peak if sec else 0.0})
    print(f"\nRL step ({Path(args.config).name}, model {model}, {n_params / 1e6:.3f}M params, "
          f"threads {torch.get_num_threads()}); matmul peak {peak / 1e9:.1f} GFLOP/s")
    for name in variants:
        b = best[name]
        print(f"  {name}: rollout model calls {b['model_calls']:.0f}, reward/mean {b['reward_mean']:.3f}")
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()) + " |")
    fast = [r for r in rows if r["variant"] == "fast" and r["phase"] != "step"]
    largest = max(fast, key=lambda r: r["seconds"])
    print(f"largest remaining cost (fast): {largest['phase']} ({100 * largest['share_of_step']:.0f}% of the step)")
    if args.json:
        print(json.dumps({"peak_flops": peak, "n_params": n_params, "rows": rows}))
    return rows


# --------------------------------------------------------------------------------------------
# Side by side with another commit
# --------------------------------------------------------------------------------------------


def commit_tree(commit: str) -> tuple[Path, str]:
    """(directory holding `commit`'s files, full sha): git archive into the temp dir, made once."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{commit}^{{commit}}"], check=True,
                         capture_output=True, text=True).stdout.strip()
    tree = Path(tempfile.gettempdir()) / f"ddrl-bench-{sha[:12]}"
    if not (tree / "ddrl" / "__init__.py").is_file():
        partial = tree.with_name(tree.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", sha], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(partial)], input=archive, check=True)
        shutil.rmtree(tree, ignore_errors=True)
        partial.rename(tree)
    return tree, sha


def worker(config: str, overrides: list[str], steps: int, first_step: int) -> dict[str, Any]:
    """In a tree's own process: one warm-up train_step (step 1), then steps first_step, ... timed."""
    import ddrl
    from ddrl.config import RLConfig, load_config
    from ddrl.training.trainer import Trainer

    trainer = Trainer(load_config(config, overrides, RLConfig))
    trainer.train_step(1)
    walls: list[float] = []
    phases: dict[str, list[float]] = defaultdict(list)
    rewards: list[float] = []
    rows: list[float] = []
    for step in range(first_step, first_step + steps):
        start = time.perf_counter()
        metrics = trainer.train_step(step)
        walls.append(time.perf_counter() - start)
        rewards.append(float(metrics.get("reward/mean", float("nan"))))
        rows.append(float(metrics.get("update/rows_frac", float("nan"))))
        for key, value in metrics.items():
            if key.startswith("time/"):
                phases[key[len("time/"):]].append(float(value))
    return {"ddrl": str(Path(ddrl.__file__).resolve().parent), "step_s": walls, "phases": dict(phases),
            "reward_mean": rewards, "rows_frac": rows}


def run_worker(tree: Path, args: argparse.Namespace, out: Path, first_step: int) -> dict[str, Any]:
    env = {**os.environ, "DDRL_BENCH_TREE": str(tree), "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(args.threads),
           "MKL_NUM_THREADS": str(args.threads)}
    overrides = ["train.progress=false", "train.tensorboard=false", "eval.n=0", f"output_dir={out}", *args.set]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--config", args.config,
           "--steps", str(args.steps), "--first-step", str(first_step), "--threads", str(args.threads),
           "--set", *overrides]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(WORKER_TAG)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the worker in {tree} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(lines[-1][len(WORKER_TAG):])
    if Path(result["ddrl"]) != (tree / "ddrl").resolve():
        raise RuntimeError(f"the worker for {tree} imported ddrl from {result['ddrl']}")
    return result


def differing_inputs(a: Path, b: Path, config: str) -> list[str]:
    """The config and the checkpoint it names, where the two trees' copies differ."""
    import yaml

    names = [config]
    model_path = ((yaml.safe_load((a / config).read_text()) or {}).get("model") or {}).get("path")
    if model_path and not Path(model_path).is_absolute():
        names += [str(Path(model_path) / f.name) for f in sorted((a / model_path).glob("*")) if f.is_file()]
    return [n for n in names if not (b / n).is_file() or not filecmp.cmp(a / n, b / n, shallow=False)]


def against_main(args: argparse.Namespace) -> dict[str, Any]:
    """The working tree against `args.against`, alternating worker processes, median of all steps."""
    old_tree, sha = commit_tree(args.against)
    trees = {"current": ROOT, args.against: old_tree}
    results: dict[str, dict[str, Any]] = {name: {"step_s": [], "phases": defaultdict(list), "reward_mean": [],
                                                 "rows_frac": []} for name in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = list(trees) if r % 2 == 0 else list(trees)[::-1]  # ABBA: drift hits both alike
            for name in order:
                # round r times steps 2 + r * steps, ...: both trees the same steps, each round new data
                got = run_worker(trees[name], args, Path(tmp) / f"{name}-{r}".replace("/", "_"), 2 + r * args.steps)
                for key in ("step_s", "reward_mean", "rows_frac"):
                    results[name][key] += got[key]
                for phase, values in got["phases"].items():
                    results[name]["phases"][phase] += values
                print(f"round {r + 1}/{args.rounds} {name}: median step {statistics.median(got['step_s']):.3f} s",
                      flush=True)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True).stdout.strip())
    summary = summarise(results, args)
    summary.update(commit=sha, current=f"{head}{' + uncommitted changes' if dirty else ''}",
                   differing_inputs=differing_inputs(ROOT, old_tree, args.config))
    print_against(summary, args)
    return summary


def summarise(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    rows = {}
    for name, res in results.items():
        q = statistics.quantiles(res["step_s"], n=4) if len(res["step_s"]) > 1 else [res["step_s"][0]] * 3
        rows[name] = {"median_step_s": statistics.median(res["step_s"]), "q1": q[0], "q3": q[2],
                      "steps": len(res["step_s"]), "reward_mean": statistics.fmean(res["reward_mean"]),
                      "rows_frac": statistics.fmean(res["rows_frac"]),
                      "phases": {p: statistics.median(v) for p, v in sorted(res["phases"].items())}}
    current, old = rows["current"], rows[args.against]
    return {"config": args.config, "rounds": args.rounds, "steps_per_worker": args.steps, "threads": args.threads,
            "rows": rows, "ratio_current_over_commit": current["median_step_s"] / old["median_step_s"]}


def print_against(summary: dict[str, Any], args: argparse.Namespace) -> None:
    rows = summary["rows"]
    phases = sorted({p for r in rows.values() for p in r["phases"]} - {"step"})
    print(f"\nRL step, {summary['config']}: {summary['rounds']} rounds x {summary['steps_per_worker']} timed steps per "
          f"tree, alternating processes, {summary['threads']} thread(s); current = {summary['current']}")
    print("| tree | median step s | q1 | q3 | steps | reward/mean | rows updated | "
          + " | ".join(f"{p} s" for p in phases) + " |")
    print("|" + "---|" * (7 + len(phases)))
    for name, r in rows.items():
        print(f"| {name} | {r['median_step_s']:.3f} | {r['q1']:.3f} | {r['q3']:.3f} | {r['steps']} | "
              f"{r['reward_mean']:.3f} | {r['rows_frac']:.2f} | " + " | ".join(f"{r['phases'].get(p, float('nan')):.3g}" for p in phases)
              + " |")
    ratio = summary["ratio_current_over_commit"]
    print(f"current / {args.against} = {ratio:.3f} ({'current faster' if ratio < 1 else 'current slower'})")
    if summary["differing_inputs"]:
        print(f"note: these inputs differ between the trees: {', '.join(summary['differing_inputs'])}")
    if args.json:
        print(json.dumps(summary))


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help=f"RL config (default: {D1_CONFIG}; with --against, relative to "
                                                   f"each tree)")
    p.add_argument("--model", help="model directory (default: a tiny 4x4 Sudoku model, pretrained if missing)")
    p.add_argument("--set", nargs="*", default=[], help="extra dotted overrides for both variants / trees")
    p.add_argument("--fast", nargs="*", default=[], help="overrides for the fast variant only")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true")
    p.add_argument("--against", metavar="COMMIT", help="time the working tree against this commit, side by side")
    p.add_argument("--rounds", type=int, default=5, help="--against: worker processes per tree")
    p.add_argument("--steps", type=int, default=4, help="--against: timed train steps per worker (after a warm-up)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--first-step", type=int, default=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.worker:
        print(WORKER_TAG + json.dumps(worker(args.config, args.set, args.steps, args.first_step)), flush=True)
        return None
    if args.against:
        args.config = args.config or D1_CONFIG
        if args.model:
            args.set = [f"model.path={Path(args.model).resolve()}", *args.set]
        return against_main(args)
    args.config = args.config or str(ROOT / D1_CONFIG)
    return phases_main(args)


if __name__ == "__main__":
    main()
