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
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

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


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs/rl/grpo_mini_sudoku.yaml"))
    p.add_argument("--model", help="model directory (default: a tiny 4x4 Sudoku model, pretrained if missing)")
    p.add_argument("--set", nargs="*", default=[], help="extra dotted overrides for both variants")
    p.add_argument("--fast", nargs="*", default=[], help="overrides for the fast variant only")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

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


if __name__ == "__main__":
    main()
