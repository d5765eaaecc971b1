"""Shared machinery of the seed-claim benches (issue 17, item 3; docs/seed_claims.md).

bench/stress_ratio_noise.py and bench/maskgrpo_gamma.py are lists of runs on the shipped 4x4
Sudoku model; this module trains each run with the project's own trainer and scores it on the
honest protocol:

- every run has the same training seed, prompts and budget, and is evaluated every `eval_every`
  steps on the same DEV puzzles with the same sampler (2-step greedy, the rollout's setting); the
  dev curve is what a reader may use to compare runs while they train;
- the final model of each run is scored once on the sealed TEST split (n puzzles), paired against
  the base model on the same puzzles (a paired cluster bootstrap over solution grids,
  ddrl.stats.gain_estimate): the only numbers the verdicts quote;
- results are written to `<out>/results.json` after every run, so a cut study keeps what it ran.

bench/dipod_elbo_gap.py shares the timing, the JSON writing and the plotting helpers.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
BASE_MODEL = ROOT / "checkpoints" / "mini_sudoku-masked"


@dataclass
class Budget:
    """What every run of a study gets: one training seed, the same prompts, the same evaluations."""

    steps: int = 50  # RL steps (rollouts)
    prompts: int = 16  # prompts per step
    group: int = 8  # completions per prompt
    eval_every: int = 10  # dev evaluation every N steps
    dev_n: int = 256  # dev puzzles per evaluation (the same ones for every run)
    test_n: int = 1000  # sealed test puzzles, scored once per final model
    seed: int = 0  # training seed (prompts, rollouts, masks) and evaluation seed

    def overrides(self) -> list[str]:
        return [f"train.steps={self.steps}", f"train.prompts_per_step={self.prompts}",
                f"train.group_size={self.group}", f"eval.every={self.eval_every}", f"eval.n={self.dev_n}",
                "eval.split=dev", "eval.report_split=null", f"seed={self.seed}", "train.progress=false",
                "train.tensorboard=false", "train.save_every=0"]


QUICK = Budget(steps=1, prompts=2, group=4, eval_every=1, dev_n=16, test_n=32)


@dataclass
class Run:
    """One training run of a study: a label, the shipped config it starts from, its own overrides."""

    label: str
    config: str  # path relative to the repository root
    overrides: list[str] = field(default_factory=list)
    tags: dict[str, Any] = field(default_factory=dict)  # what the plot groups by (method, noise, gamma ...)


class Clock:
    """Wall and process-CPU seconds of a block (wall is inflated by other jobs on a shared machine)."""

    def __enter__(self) -> "Clock":
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wall = time.perf_counter() - self.wall0
        self.cpu = time.process_time() - self.cpu0


def picture_path(given: str | None, quick: bool, out: Path, name: str) -> Path:
    """--png if given; else docs/<name> for a study and <out>/<name> for a --quick smoke run (which
    must not overwrite the documented picture)."""
    if given:
        return Path(given)
    return out / name if quick else ROOT / "docs" / name


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1))


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start): the per-step rollout
    reward moves with the prompt batch, which every run shares, so only its trend is readable."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


# --------------------------------------------------------------------------- scoring


@dataclass
class SplitScores:
    """Per-puzzle scores of one model on the sealed test split, with each puzzle's grid."""

    scores: list[float]  # [n] 1.0 = solved (first greedy sample)
    clusters: list[Any] | None  # [n] solution-grid keys (the bootstrap resamples grids)


def sudoku_sampler(rollout: Any) -> Any:
    """The trainer's evaluation sampler: the rollout's, greedy (eval.temperature 0, eval.steps None)."""
    from ddrl.config import SamplerConfig

    return SamplerConfig(**{**vars(rollout), "temperature": 0.0})


def score_test_split(model: Any, task: Any, sampler: Any, n: int, seed: int) -> SplitScores:
    """Score `model` on test puzzles 0..n-1 of `seed`: the same puzzles for every model of a study."""
    from ddrl.eval.runner import first_scores, sample_and_score, task_scoring
    from ddrl.tasks.base import cluster_keys, split_examples

    examples = split_examples(task, "test", n, seed)
    rows, _ = sample_and_score(model, examples, sampler, task_scoring(task), seed=seed)
    return SplitScores(first_scores(rows), cluster_keys(task, examples))


def summarize_test(base: SplitScores, final: SplitScores, seed: int) -> dict[str, Any]:
    """The final model's test solve rate and its paired gain over the base, both with 95% intervals."""
    from ddrl.stats import gain_estimate, score_estimate

    rate = score_estimate(final.scores, clusters=final.clusters, seed=seed)
    gain = gain_estimate(base.scores, final.scores, clusters=final.clusters, seed=seed)
    return {"test": rate.as_dict(), "gain": gain.as_dict(), "gain_verdict": gain.verdict(),
            "test_text": rate.format()}


def paired_difference(a: list[float], b: list[float], clusters: list[Any] | None, seed: int) -> dict[str, Any]:
    """b - a on the same test puzzles (e.g. noisy vs clean run of one method), 95% paired interval."""
    from ddrl.stats import gain_estimate

    est = gain_estimate(a, b, clusters=clusters, seed=seed)
    return {**est.as_dict(), "text": est.format(unit="pt", signed=True),
            "verdict": est.verdict().replace("no measurable gain", "no measurable difference")}


# --------------------------------------------------------------------------- a study


def dev_curve(metrics: list[dict[str, Any]]) -> list[dict[str, float]]:
    """[{step, acc, lo, hi}] of the dev evaluations: the base's (step 0) then every eval.every steps."""
    curve = []
    for row in metrics:
        if row.get("eval_before/accuracy") is not None:
            curve.append({"step": 0, "acc": row["eval_before/accuracy"], "lo": row.get("eval_before/accuracy_lo"),
                          "hi": row.get("eval_before/accuracy_hi")})
        if row.get("eval/accuracy") is not None:
            curve.append({"step": row["step"], "acc": row["eval/accuracy"], "lo": row.get("eval/accuracy_lo"),
                          "hi": row.get("eval/accuracy_hi")})
    return curve


def train_one(run: Run, budget: Budget, out: Path) -> tuple[Any, dict[str, Any]]:
    """Train one run; returns (final model, its record: dev curve, per-step reward and grad norm,
    status, seconds). A run stopped for non-finite losses keeps the model it had."""
    from ddrl.config import RLConfig, load_config
    from ddrl.training.logging import read_metrics
    from ddrl.training.trainer import NonFiniteError, Trainer

    run_dir = out / run.label
    cfg = load_config(ROOT / run.config, [*budget.overrides(), *run.overrides, f"output_dir={run_dir}"], RLConfig)
    status = "ok"
    with Clock() as clock:
        trainer = Trainer(cfg)
        try:
            trainer.run()
        except NonFiniteError as why:
            status = f"stopped: {why}"
    metrics = read_metrics(run_dir / "metrics.jsonl")
    record = {"label": run.label, "config": run.config, "overrides": run.overrides, **run.tags, "status": status,
              "dev": dev_curve(metrics),
              "steps": [r["step"] for r in metrics],
              "reward": [r.get("reward/mean") for r in metrics],
              "grad_norm": [r.get("grad_norm") for r in metrics],
              "train_wall_s": round(clock.wall, 1), "train_cpu_s": round(clock.cpu, 1)}
    return trainer.model, record


def run_study(runs: list[Run], budget: Budget, out: Path, *, name: str) -> dict[str, Any]:
    """Train every run, score each final model on the sealed test split paired with the base.

    Writes `<out>/results.json` after the base and after every run (a cut study keeps its runs)."""
    from ddrl.config import RLConfig, load_config, task_kwargs
    from ddrl.stats import score_estimate
    from ddrl.models import load_model
    from ddrl.tasks import get_task

    out.mkdir(parents=True, exist_ok=True)
    first = load_config(ROOT / runs[0].config, budget.overrides(), RLConfig)
    task = get_task(first.task.name, **task_kwargs(first.task))
    sampler = sudoku_sampler(first.rollout)
    study: dict[str, Any] = {"name": name, "budget": vars(budget), "sampler": vars(sampler), "runs": []}
    with Clock() as clock:
        base = score_test_split(load_model(ROOT / first.model.path), task, sampler, budget.test_n, budget.seed)
    base_rate = score_estimate(base.scores, clusters=base.clusters, seed=budget.seed)
    study["base_test"], study["base_test_text"] = base_rate.as_dict(), base_rate.format()
    study["base_eval_cpu_s"] = round(clock.cpu, 1)
    write_json(out / "results.json", study)
    print(f"[{name}] base on test: {study['base_test_text']}", flush=True)
    finals: dict[str, SplitScores] = {}
    for run in runs:
        model, record = train_one(run, budget, out)
        with Clock() as clock:
            finals[run.label] = score_test_split(model, task, sampler, budget.test_n, budget.seed)
        record.update(summarize_test(base, finals[run.label], budget.seed))
        record["test_cpu_s"] = round(clock.cpu, 1)
        study["runs"].append(record)
        write_json(out / "results.json", study)
        dev_last = record["dev"][-1]["acc"] if record["dev"] else float("nan")
        print(f"[{name}] {run.label}: dev(last) {dev_last:.1%}, test {record['test_text']}, gain "
              f"{record['gain_verdict']}, {record['train_cpu_s']} CPU-s ({record['status']})", flush=True)
    study["finals"] = {label: s.scores for label, s in finals.items()}
    study["clusters"] = [str(c) for c in base.clusters] if base.clusters is not None else None
    write_json(out / "results.json", study)
    return study


# --------------------------------------------------------------------------- tables and pictures


def pct(est: dict[str, Any]) -> str:
    return f"{est['mean']:.1%} [{est['lo']:.1%}, {est['hi']:.1%}]"


def pt(est: dict[str, Any]) -> str:
    return f"{100 * est['mean']:+.1f} pt [{100 * est['lo']:+.1f}, {100 * est['hi']:+.1f}]"


def run_table(study: dict[str, Any], tag_columns: list[str]) -> str:
    """Markdown: one row per run with its tags, dev curve endpoints, test rate and paired gain."""
    head = [*tag_columns, "dev: base -> last", "test (n, 95%)", "gain over base (paired, 95%)", "max grad norm",
            "status", "CPU s"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    n = study["budget"]["test_n"]
    for r in study["runs"]:
        dev = r["dev"]
        dev_text = f"{dev[0]['acc']:.1%} -> {dev[-1]['acc']:.1%}" if dev else "-"
        gains = [g for g in r["grad_norm"] if g is not None and math.isfinite(g)]
        measurable = r["gain"]["lo"] > 0 or r["gain"]["hi"] < 0
        gain_text = pt(r["gain"]) if measurable else f"no measurable gain ({pt(r['gain'])})"
        cells = [str(r.get(c, "-")) for c in tag_columns]
        cells += [dev_text, f"{pct(r['test'])}, n={n}", gain_text, f"{max(gains):.3g}" if gains else "-",
                  "ok" if r["status"] == "ok" else "non-finite stop", f"{r['train_cpu_s'] + r['test_cpu_s']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_study(study: dict[str, Any], path: Path, *, color_by: str, style_by: str | None, title: str,
               window: int = 5) -> Path:
    """Three panels: dev solve rate with its 95% band, rollout reward (moving average), grad norm (log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {}
    styles = {}
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for r in study["runs"]:
        c = colors.setdefault(r.get(color_by), f"C{len(colors)}")
        s = styles.setdefault(r.get(style_by), ["-", "--", ":", "-."][len(styles) % 4]) if style_by else "-"
        dev = r["dev"]
        xs = [d["step"] for d in dev]
        axes[0].plot(xs, [d["acc"] for d in dev], s, color=c, marker="o", ms=3, label=r["label"])
        if dev and dev[0]["lo"] is not None:
            axes[0].fill_between(xs, [d["lo"] for d in dev], [d["hi"] for d in dev], color=c, alpha=0.08)
        rewards = [x if x is not None else float("nan") for x in r["reward"]]
        axes[1].plot(r["steps"], moving_average(rewards, window), s, color=c)
        axes[2].plot(r["steps"], [g if g is not None else float("nan") for g in r["grad_norm"]], s, color=c, lw=0.9)
    b = study["budget"]
    axes[0].set_title(f"dev solve rate (n={b['dev_n']}, 95% band)")
    axes[1].set_title(f"rollout reward, {window}-step moving average")
    axes[2].set_title("grad norm (before clipping)")
    if any(g is not None and g > 0 for r in study["runs"] for g in r["grad_norm"]):
        axes[2].set_yscale("log")  # a smoke run may have no positive norm (every group uninformative)
    for ax in axes:
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
