"""`ddrl compare`: every method on the same tiny task, budget and seeds; one table, one picture.

The small-scale version of the seed papers' tables: final and best held-out solve rate, the first
step reaching the target, wall time, and whether the run collapsed (held-out score ending well
below the base model's, or a non-finite stop).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ddrl.config import RLConfig, load_config
from ddrl.training.logging import read_metrics

TEXT_METHODS = ["grpo", "wd1", "spg", "espo", "tracerl", "unigrpo", "coupled_grpo", "maskgrpo", "stable_drl",
                "gdsd", "gdsd_tlc", "daca_grpo", "dipod", "fpo", "sepo"]


def run_compare(config: str, methods: list[str] | None = None, steps: int = 30,
                output_dir: str = "runs/compare", target: float | None = None,
                extra_overrides: list[str] | None = None) -> list[dict[str, Any]]:
    from ddrl.training.trainer import NonFiniteError, Trainer

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for method in methods or TEXT_METHODS:
        overrides = [f"method.objective={method}", f"train.steps={steps}", f"output_dir={out / method}",
                     *(extra_overrides or [])]
        cfg = load_config(config, overrides, RLConfig)
        start = time.perf_counter()
        collapsed_nonfinite = False
        trainer = Trainer(cfg)
        try:
            trainer.run()
        except NonFiniteError:
            collapsed_nonfinite = True
        results.append(_summarise(method, trainer, time.perf_counter() - start, collapsed_nonfinite, target))
        print(json.dumps(results[-1]))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text(format_table(results))
    plot_curves(out, [r["method"] for r in results])
    print(format_table(results))
    return results


def _summarise(method: str, trainer: Any, seconds: float, nonfinite: bool, target: float | None) -> dict[str, Any]:
    """base / final: the sealed report split before and after (with n and 95% intervals); best and
    steps to target: the periodic evaluations on eval.split (dev), which are for choosing."""
    hist = trainer.eval_history
    report = trainer.report
    first = report.get("before") or (hist[0] if hist else None)
    last = report.get("after") or (hist[-1] if hist else None)
    base = first["accuracy"] if first else float("nan")
    final = last["accuracy"] if last else float("nan")
    best = max((h["accuracy"] for h in hist), default=float("nan"))
    dev_base = hist[0]["accuracy"] if hist else base
    goal = target if target is not None else dev_base + 0.5 * (1 - dev_base)  # halfway to perfect
    reached = next((h["step"] for h in hist if h["accuracy"] >= goal and h["step"] > 0), None)
    return {"method": method, "base": base, "final": final, "best": best, "target": round(goal, 3),
            "steps_to_target": reached, "seconds": round(seconds, 1),
            "collapsed": bool(nonfinite or final < base - 0.10),
            "report_split": last["split"] if last else None, "n": last["n"] if last else None,
            "base_interval": first.get("accuracy_interval") if first else None,
            "final_interval": last.get("accuracy_interval") if last else None}


def format_table(results: list[dict[str, Any]]) -> str:
    lines = ["| method | base (report split) | final (report split) | best (dev) | steps to target (dev) | "
             "wall time (s) | collapsed |",
             "| --- | --- | --- | --- | --- | --- | --- |"]

    def score(value: float, interval: list[float] | None) -> str:
        return f"{value:.1%}" + (f" [{interval[0]:.1%}, {interval[1]:.1%}]" if interval else "")

    for r in results:
        lines.append(f"| {r['method']} | {score(r['base'], r.get('base_interval'))} | "
                     f"{score(r['final'], r.get('final_interval'))} | {r['best']:.1%} | "
                     f"{r['steps_to_target'] if r['steps_to_target'] is not None else '-'} (>= {r['target']:.0%}) | "
                     f"{r['seconds']:.0f} | {'yes' if r['collapsed'] else 'no'} |")
    return "\n".join(lines) + "\n"


def plot_curves(out: Path, methods: list[str], key: str = "reward/mean") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for m in methods:
        rows = read_metrics(out / m / "metrics.jsonl")
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), label=m, alpha=0.85)
    ax.set_xlabel("RL step")
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    path = out / "curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
