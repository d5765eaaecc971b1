"""`ddrl compare`: every method on the same tiny task, budget and seeds; one table, one picture.

The small-scale version of the seed papers' tables, reported the honest way:
- every method trains with the same training seeds (`--seeds`, >= 3 for a claim); each run is
  scored before and after on the sealed report split (eval.report_split, eval.report_n examples,
  the same examples for every run: eval.seed is fixed), and its paired gain carries a 95% interval;
- the table gives, per method, the mean and spread over seeds of the final score and of the gain,
  the gain of all seeds pooled (per-example scores averaged over seeds, one paired bootstrap over
  examples or their clusters) and how many seeds' own intervals exclude zero;
- best and steps to target come from the periodic evaluations on eval.split (dev), which are for
  choosing; the picture plots those dev curves (mean over seeds, band = min..max) and the smoothed
  rollout reward, never raw per-step rewards, which move with each step's prompt batch.

Each finished run appends one line to runs.jsonl, so a study that is stopped keeps what it has and
`aggregate(output_dir)` can rebuild table and picture from the files.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from ddrl.config import RLConfig, load_config
from ddrl.training.logging import read_metrics

TEXT_METHODS = ["grpo", "wd1", "spg", "espo", "tracerl", "unigrpo", "coupled_grpo", "maskgrpo", "stable_drl",
                "gdsd", "gdsd_tlc", "daca_grpo", "dipod", "fpo", "sepo"]


def run_compare(config: str, methods: list[str] | None = None, steps: int = 30,
                output_dir: str = "runs/compare", target: float | None = None,
                extra_overrides: list[str] | None = None, seeds: list[int] | None = None) -> list[dict[str, Any]]:
    """Train every method once per seed; returns the per-method summaries (see `aggregate`)."""
    from ddrl.training.trainer import NonFiniteError, Trainer

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    methods = methods or TEXT_METHODS
    seeds = [0] if seeds is None else seeds
    configs = {}
    for seed in seeds:  # seed-major: a study cut short still has every method at its first seeds
        for method in methods:  # and every config is checked before any run starts
            overrides = [f"method.objective={method}", f"train.steps={steps}", f"seed={seed}",
                         f"output_dir={run_dir(out, method, seed)}", "overwrite=true",  # a stopped run starts again
                         *(extra_overrides or [])]
            configs[method, seed] = load_config(config, overrides, RLConfig)
    done = {(r["method"], r["seed"]) for r in read_runs(out)}
    for (method, seed), cfg in configs.items():
        if (method, seed) in done:  # a stopped study resumes where it was
            continue
        start = time.perf_counter()
        nonfinite = False
        trainer = Trainer(cfg)
        try:
            trainer.run()
        except NonFiniteError:
            nonfinite = True
        if not nonfinite and trainer.step < cfg.train.steps:  # preempted (SIGTERM): checkpointed, not finished
            print(f"compare: {method} seed {seed} stopped at step {trainer.step}; rerun the same command: finished runs "
                  "are kept, this one starts again")
            break
        record = run_record(method, seed, trainer, time.perf_counter() - start, nonfinite)
        with (out / "runs.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps({k: record[k] for k in ("method", "seed", "base", "final", "gain", "seconds")}))
    results = aggregate(out, methods, target=target)
    print(format_table(results))
    return results


def run_dir(out: Path, method: str, seed: int) -> Path:
    return out / method / f"seed-{seed}"


def read_runs(out: Path) -> list[dict[str, Any]]:
    path = Path(out) / "runs.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def run_record(method: str, seed: int, trainer: Any, seconds: float, nonfinite: bool) -> dict[str, Any]:
    """One run: the sealed report before/after with intervals and the paired gain, the dev history."""
    from ddrl.demo import paired_gain

    report, hist = trainer.report, trainer.eval_history
    before, after = report.get("before"), report.get("after")
    gain = None
    if before and after and not nonfinite:
        gain = paired_gain(trainer.run_dir / "eval", before["step"], after["step"], tag="report").as_dict()
    return {"method": method, "seed": seed, "seconds": round(seconds, 1), "nonfinite": nonfinite,
            "report_split": (after or before or {}).get("split"), "n": (after or before or {}).get("n"),
            "base": before["accuracy"] if before else None, "final": after["accuracy"] if after else None,
            "base_interval": before.get("accuracy_interval") if before else None,
            "final_interval": after.get("accuracy_interval") if after else None,
            "gain": gain, "dev": [{"step": h["step"], "accuracy": h["accuracy"]} for h in hist],
            "run_dir": str(trainer.run_dir)}


def aggregate(out: str | Path, methods: list[str] | None = None, target: float | None = None,
              plot: bool = True) -> list[dict[str, Any]]:
    """Per-method summaries over seeds from runs.jsonl; writes results.json, table.md, curves.png."""
    out = Path(out)
    runs = read_runs(out)
    methods = methods or list(dict.fromkeys(r["method"] for r in runs))
    results = [summarise(m, [r for r in runs if r["method"] == m], target) for m in methods
               if any(r["method"] == m for r in runs)]
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text(format_table(results))
    if plot:
        plot_curves(out, runs, [r["method"] for r in results])
    return results


def summarise(method: str, runs: list[dict[str, Any]], target: float | None = None) -> dict[str, Any]:
    """Mean and spread over seeds, the seed-pooled paired gain, best and steps to target on dev."""
    finals = [r["final"] for r in runs if r["final"] is not None and not r["nonfinite"]]
    gains = [r["gain"] for r in runs if r["gain"] is not None]
    dev_base = statistics.fmean(r["dev"][0]["accuracy"] for r in runs) if all(r["dev"] for r in runs) else None
    goal = target if target is not None else (None if dev_base is None else dev_base + 0.5 * (1 - dev_base))
    curve = mean_dev_curve(runs)
    reached = next((step for step, acc in curve if goal is not None and acc >= goal and step > 0), None)
    base = statistics.fmean(r["base"] for r in runs if r["base"] is not None) if runs[0]["base"] is not None \
        else float("nan")
    return {"method": method, "seeds": [r["seed"] for r in runs], "n": runs[0]["n"],
            "report_split": runs[0]["report_split"], "base": base,
            "final_mean": _mean(finals), "final_sd": _sd(finals),
            "gain_mean": _mean([g["mean"] for g in gains]), "gain_sd": _sd([g["mean"] for g in gains]),
            "seeds_with_gain": sum(g["lo"] > 0 for g in gains), "seeds_with_loss": sum(g["hi"] < 0 for g in gains),
            "pooled_gain": pooled_gain([Path(r["run_dir"]) for r in runs if r["gain"] is not None]),
            "best_dev": max((acc for _, acc in curve), default=float("nan")),
            "target": None if goal is None else round(goal, 3), "steps_to_target": reached,
            "seconds_mean": _mean([r["seconds"] for r in runs]),
            "collapsed": sum(bool(r["nonfinite"] or (r["final"] is not None and r["final"] < r["base"] - 0.10))
                             for r in runs)}


def method_difference(out: str | Path, a: str, b: str) -> dict[str, Any]:
    """Method a's final report score minus method b's, on the same examples: each example's final
    score averaged over each method's seeds, then one paired bootstrap over examples or clusters
    (the seed papers' "A beats B" claims, e.g. GDSD against ESPO and SPG)."""
    from ddrl.stats import gain_estimate

    runs = read_runs(Path(out))
    scores = {}
    for method in (a, b):
        dirs = [Path(r["run_dir"]) for r in runs if r["method"] == method and r["gain"] is not None]
        if not dirs:
            raise ValueError(f"{out}: no finished run of {method!r} to compare")
        scores[method] = _report_scores(dirs)
    (prompts_a, after_a, clusters), (prompts_b, after_b, _) = scores[a][1:], scores[b][1:]
    if prompts_a != prompts_b:
        raise ValueError(f"{out}: {a} and {b} scored other report examples; fix eval.seed for a study")
    return gain_estimate(after_b, after_a, clusters=clusters).as_dict()


def _report_scores(run_dirs: list[Path]) -> tuple[list[float], list[str], list[float], list[str] | None]:
    """(before, prompts, after, clusters) of the runs' first and last report, per example averaged
    over the runs, which must have scored the same examples."""
    from ddrl.eval.runner import first_scores

    befores, afters, prompts, clusters = [], [], None, None
    for d in run_dirs:
        files = sorted((d / "eval").glob("report-step-*.jsonl"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
        b, a = ([json.loads(line) for line in f.read_text().splitlines()] for f in (files[0], files[-1]))
        if prompts is not None and [r["prompt"] for r in b] != prompts:
            raise ValueError(f"{d}: scored other report examples than {run_dirs[0]}; fix eval.seed for a study")
        prompts = [r["prompt"] for r in b]
        befores.append(first_scores(b))
        afters.append(first_scores(a))
        clusters = [r["cluster"] for r in b] if all("cluster" in r for r in b) else None
    mean = lambda cols: [statistics.fmean(v) for v in zip(*cols)]  # noqa: E731  per example, over runs
    assert prompts is not None  # run_dirs is not empty (the caller checked)
    return mean(befores), prompts, mean(afters), clusters


def pooled_gain(run_dirs: list[Path]) -> dict[str, Any] | None:
    """The gain of all seeds together: each example's before and after scores averaged over the
    seeds' runs (they scored the same examples), then one paired bootstrap over examples or
    clusters. Seed-to-seed spread is reported beside it (gain_sd), not inside it."""
    from ddrl.stats import gain_estimate

    if not run_dirs:
        return None
    before, _, after, clusters = _report_scores(run_dirs)
    return gain_estimate(before, after, clusters=clusters).as_dict()


def mean_dev_curve(runs: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(step, mean dev accuracy over the seeds evaluated at that step)."""
    by_step: dict[int, list[float]] = {}
    for r in runs:
        for h in r["dev"]:
            by_step.setdefault(h["step"], []).append(h["accuracy"])
    return [(step, statistics.fmean(v)) for step, v in sorted(by_step.items())]


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def _sd(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else float("nan")


def format_table(results: list[dict[str, Any]]) -> str:
    lines = ["| method | seeds | base (report) | final (report), mean ± sd | gain per seed, mean ± sd | "
             "seeds: gain / loss | seeds pooled: gain [95%] | best (dev) | steps to target (dev) | "
             "s per run | collapsed |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def pt(v: float) -> str:
        return f"{100 * v:+.1f}"

    for r in results:
        pooled = r["pooled_gain"]
        pooled_text = "-" if pooled is None else (
            f"{pt(pooled['mean'])} [{pt(pooled['lo'])}, {pt(pooled['hi'])}]"
            + ("" if pooled["lo"] > 0 or pooled["hi"] < 0 else " (none measurable)"))
        reached = "-" if r["steps_to_target"] is None else str(r["steps_to_target"])
        if r["target"] is not None:
            reached += f" (>= {r['target']:.0%})"
        lines.append(
            f"| {r['method']} | {len(r['seeds'])} | {r['base']:.1%} | {r['final_mean']:.1%} ± {100 * r['final_sd']:.1f} | "
            f"{pt(r['gain_mean'])} ± {100 * r['gain_sd']:.1f} pt | {r['seeds_with_gain']} / {r['seeds_with_loss']} | "
            f"{pooled_text} | {r['best_dev']:.1%} | {reached} | {r['seconds_mean']:.0f} | "
            f"{r['collapsed']} of {len(r['seeds'])} |")
    n = results[0]["n"] if results else None
    lines.append(f"\nreport split: {results[0]['report_split'] if results else '-'}, n={n} per run; "
                 "a gain counts when its 95% interval excludes zero.")
    return "\n".join(lines) + "\n"


def plot_curves(out: Path, runs: list[dict[str, Any]], methods: list[str], window: int = 5) -> Path:
    """Left: dev accuracy over steps (mean over seeds, band min..max). Right: rollout reward, moving
    average over `window` steps, mean over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax_dev, ax_reward) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = [plt.get_cmap("tab20")(i) for i in range(20)]  # 20 distinct colours (RGBA): up to 20 methods
    for i, m in enumerate(methods):
        style = {"color": colors[i % len(colors)], "linestyle": "-" if i < len(colors) else "--"}
        mine = [r for r in runs if r["method"] == m]
        steps = sorted({h["step"] for r in mine for h in r["dev"]})
        if steps:
            grid = np.array([[next((h["accuracy"] for h in r["dev"] if h["step"] == s), np.nan) for s in steps]
                             for r in mine])  # [seeds, points]
            ax_dev.plot(steps, np.nanmean(grid, 0), label=m, alpha=0.9, **style)
            ax_dev.fill_between(steps, np.nanmin(grid, 0), np.nanmax(grid, 0), color=style["color"], alpha=0.08)
        curves = []
        for r in mine:
            rows = read_metrics(Path(r["run_dir"]) / "metrics.jsonl")
            values = [row["reward/mean"] for row in rows if row.get("reward/mean") is not None]
            if len(values) >= window:
                curves.append(np.convolve(values, np.ones(window) / window, mode="valid"))
        if curves:
            length = min(len(c) for c in curves)
            ax_reward.plot(np.arange(window, window + length), np.mean([c[:length] for c in curves], 0), label=m,
                           alpha=0.9, **style)
    ax_dev.set(xlabel="RL step", ylabel="dev accuracy", title="dev split: mean over seeds, band min..max")
    ax_reward.set(xlabel="RL step", ylabel="rollout reward",
                  title=f"rollout reward: {window}-step moving average, mean over seeds")
    for ax in (ax_dev, ax_reward):
        ax.grid(alpha=0.3)
    ax_dev.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    path = out / "curves.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
