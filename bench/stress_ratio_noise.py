"""StableDRL's "exploding weight" stress test in miniature: reward curves and gradient norms of
StableDRL vs ESPO vs GRPO on the tiny Sudoku model, with and without Gaussian noise injected into
the log importance ratios (method.ratio_noise). Writes a table and one picture.

    .venv/bin/python bench/stress_ratio_noise.py --steps 20 --noise 3.0 --out runs/stress
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--noise", type=float, default=3.0, help="std of the noise added to log-ratios")
    p.add_argument("--methods", default="stable_drl,espo,grpo")
    p.add_argument("--out", default="runs/stress")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    args = p.parse_args()

    from ddrl.training.logging import read_metrics
    from ddrl.training.trainer import NonFiniteError, train

    out = Path(args.out)
    rows = []
    for method in args.methods.split(","):
        for noise in (0.0, args.noise):
            run = out / f"{method}-noise{noise:g}"
            overrides = [f"train.steps={args.steps}", f"train.prompts_per_step={args.prompts}",
                         f"train.group_size={args.group}", "eval.n=64", f"eval.every={args.steps}",
                         f"method.ratio_noise={noise}", f"output_dir={run}", "train.progress=false",
                         "train.tensorboard=false"]
            status = "ok"
            try:
                train(ROOT / f"configs/rl/{method}_mini_sudoku.yaml", overrides)
            except NonFiniteError:
                status = "non-finite stop"
            m = read_metrics(run / "metrics.jsonl")
            evals = [r["eval/accuracy"] for r in m if r.get("eval/accuracy") is not None]
            gn = sorted(r["grad_norm"] for r in m if r.get("grad_norm") is not None)
            rows.append({"method": method, "noise": noise, "status": status,
                         "reward_first5": sum(r["reward/mean"] for r in m[:5]) / max(1, len(m[:5])),
                         "reward_last5": sum(r["reward/mean"] for r in m[-5:]) / max(1, len(m[-5:])),
                         "final_accuracy": evals[-1] if evals else None,
                         "grad_norm_max": gn[-1] if gn else None,
                         "grad_norm_median": gn[len(gn) // 2] if gn else None})
            print(json.dumps(rows[-1]))
    (out / "stress.json").write_text(json.dumps(rows, indent=1))
    plot(out, rows)
    print("| method | ratio noise | reward (first 5 steps) | reward (last 5) | final held-out | max grad norm |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        acc = "-" if r["final_accuracy"] is None else f"{r['final_accuracy']:.1%}"
        print(f"| {r['method']} | {r['noise']:g} | {r['reward_first5']:.3f} | {r['reward_last5']:.3f} | {acc} | "
              f"{r['grad_norm_max']:.3g} |")


def plot(out: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ddrl.training.logging import read_metrics

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, noisy in zip(axes, (False, True)):
        for r in rows:
            if (r["noise"] > 0) != noisy:
                continue
            m = read_metrics(out / f"{r['method']}-noise{r['noise']:g}" / "metrics.jsonl")
            ax.plot([x["step"] for x in m], [x["reward/mean"] for x in m], label=r["method"])
        ax.set_title("with log-ratio noise" if noisy else "no injected noise")
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("reward/mean")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(out / "stress.png", dpi=110)


if __name__ == "__main__":
    main()
