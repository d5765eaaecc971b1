"""UDM-GRPO's prompt-following headline in miniature, on the honest protocol (issue 17, item 2).

A *recipe* is configs/rl/udm_grpo_digits.yaml plus overrides. For each training seed, the bench
drives the Trainer step by step (its own evaluations off) and scores the policy with the shipped
evaluation sampler (uniform, 16 steps, T=1, no guidance):

- on the dev split at the curve steps (what a recipe may be chosen on): prompt following with its
  Wilson 95% interval, per-class rate and same-class diversity (DigitsTask.eval_breakdown);
- on the sealed test split, the base once and each seed's final model: the paired bootstrap gain on
  the same prompts and sampler seeds.

Dev and test use different example seeds and sampler seeds (digits prompts are the ten class
symbols on every split; DigitsTask's docstring). Each recipe's result is one JSON under --out,
written as soon as it finishes; `--report` turns every JSON there into markdown tables and the
pictures docs/udm_digits_curve.png and docs/udm_digits_samples.png.

    OMP_NUM_THREADS=1 .venv/bin/python bench/udm_digits.py --name main --seeds 0 1 2 -- train.steps=140 train.lr=5e-4
    OMP_NUM_THREADS=1 .venv/bin/python bench/udm_digits.py --name naive --seeds 0 -- train.steps=140 train.lr=5e-4 \\
        method.estimator_args.forward_process=false method.estimator_args.clean_target=false
    OMP_NUM_THREADS=1 .venv/bin/python bench/udm_digits.py --report
    OMP_NUM_THREADS=1 .venv/bin/python bench/udm_digits.py --quick     # < 20 s: a 2-step smoke run

Times: train wall and process CPU seconds of the training steps only (evaluations excluded), and the
rollout's share (the trainer's time/rollout) per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs/rl/udm_grpo_digits.yaml"
DEV_SEED, TEST_SEED, GRID_SEED = 11, 22, 33  # example and sampler seeds: distinct streams per use
GRID_PER_CLASS = 8
DOCS = ROOT / "docs"


class Protocol(NamedTuple):
    """What every recipe is scored with; one source for the full and the --quick run. (A NamedTuple:
    the bench is also loaded as a bare file, outside sys.modules, where a dataclass cannot resolve.)"""

    dev_n: int = 500
    test_n: int = 1000
    eval_steps: int = 16
    batch_size: int = 250


def eval_sampler(steps: int) -> Any:
    """The shipped evaluation sampler: uniform, 64 tokens, T=1, no guidance (the paper evaluates CFG-free)."""
    from ddrl.config import SamplerConfig

    return SamplerConfig(name="uniform", steps=steps, gen_length=64, block_length=64, temperature=1.0,
                         cfg_scale=0.0)


def score(model: Any, task: Any, examples: list[dict], seed: int, proto: Protocol) -> dict[str, Any]:
    """evaluate() on the given examples: accuracy with its interval, the digits breakdown, and the
    per-example 0/1 scores (for a paired gain on the same examples)."""
    from ddrl.eval import evaluate
    from ddrl.eval.runner import first_scores

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.jsonl"
        result = evaluate(model, task, examples=examples, sampler=eval_sampler(proto.eval_steps), seed=seed,
                          batch_size=proto.batch_size, output_jsonl=path)
        rows = [json.loads(line) for line in path.read_text().splitlines()]
    b = result["breakdown"]
    return {"accuracy": result["accuracy"], "interval": result["accuracy_interval"], "n": result["n"],
            "mean_reward": result["mean_reward"], "eval_s": result["seconds"],
            "per_class": {c: v["rate"] for c, v in b["per_class"].items()}, "min_class": b["min_class"],
            "min_class_rate": b["min_class_rate"], "distinct_frac": b.get("distinct_frac_mean"),
            "pairwise_hamming": b.get("pairwise_hamming_mean"), "pairwise_hamming_min": b.get("pairwise_hamming_min"),
            "scores": first_scores(rows)}


def sample_grid(model: Any, task: Any, proto: Protocol) -> list[list[list[int]]]:
    """GRID_PER_CLASS images [64] for each class 0..9 (fixed sampler seed), for the before/after picture."""
    from ddrl.eval.runner import sample_and_score, task_scoring
    from ddrl.rewards.image import CLASS_SYMBOLS, N_CLASSES, decode_image

    examples = [{"prompt": CLASS_SYMBOLS[c], "label": c} for c in range(N_CLASSES) for _ in range(GRID_PER_CLASS)]
    rows, _ = sample_and_score(model, examples, eval_sampler(proto.eval_steps), task_scoring(task), seed=GRID_SEED,
                               batch_size=proto.batch_size)
    images = [decode_image(r["completions"][0]) or [0] * 64 for r in rows]  # a malformed image shows black
    return [images[c * GRID_PER_CLASS:(c + 1) * GRID_PER_CLASS] for c in range(N_CLASSES)]


def _public(s: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in s.items() if k != "scores"}


def train_seed(overrides: list[str], seed: int, curve_at: set[int], base_test: dict[str, Any],
               proto: Protocol, out: Path, grid: bool, test_at: set[int] = frozenset()) -> dict[str, Any]:
    """One training seed of a recipe: dev curve, final test score and its paired gain over the base.

    test_at: earlier steps also scored on test, for reporting only (a shorter budget's number that
    other recipes are compared with); nothing is chosen on them."""
    from ddrl.config import RLConfig, load_config
    from ddrl.stats import gain_estimate
    from ddrl.training.trainer import Trainer

    cfg = load_config(CONFIG, ["eval.every=0", "eval.before=false", "eval.n=0", "train.progress=false",
                               "train.tensorboard=false", "train.save_every=0", f"seed={seed}",
                               f"output_dir={out}", *overrides], RLConfig)
    cfg.model.path = str(ROOT / cfg.model.path) if not Path(cfg.model.path).is_absolute() else cfg.model.path
    trainer = Trainer(cfg)  # naive GRPO on UDM: the estimator reads each step's output off the trajectory
    task, model = trainer.task, trainer.model
    dev = task.dev_examples(proto.dev_n, seed=DEV_SEED)
    curve: list[dict[str, Any]] = []
    if 0 in curve_at:
        curve.append({"step": 0, "train_wall_s": 0.0, "train_cpu_s": 0.0,
                      **_public(score(model, task, dev, DEV_SEED, proto))})
    wall = cpu = rollout = 0.0
    rewards: list[float] = []
    tests_at: list[dict[str, Any]] = []
    for step in range(1, cfg.train.steps + 1):
        w0, c0 = time.perf_counter(), time.process_time()
        trainer.step = step
        metrics = trainer.train_step(step)
        wall += time.perf_counter() - w0
        cpu += time.process_time() - c0
        rollout += float(metrics.get("time/rollout", 0.0))
        rewards.append(float(metrics.get("reward/mean", 0.0)))
        if step in curve_at or step == cfg.train.steps:
            d = _public(score(model, task, dev, DEV_SEED, proto))
            curve.append({"step": step, "train_wall_s": round(wall, 1), "train_cpu_s": round(cpu, 1),
                          "rollout_reward": statistics.fmean(rewards[-10:]), **d})
            print(f"  seed {seed} step {step}: dev {d['accuracy']:.3f} min class {d['min_class_rate']:.2f} "
                  f"hamming {d['pairwise_hamming']:.1f} (train {wall:.0f}s wall, {cpu:.0f}s CPU)", flush=True)
        if step in test_at and step != cfg.train.steps:
            early = score(model, task, task.test_examples(proto.test_n, seed=TEST_SEED), TEST_SEED, proto)
            g = gain_estimate(base_test["scores"], early["scores"], seed=0)
            tests_at.append({"step": step, "test": _public(early), "gain": g.as_dict(), "verdict": g.verdict()})
    final = score(model, task, task.test_examples(proto.test_n, seed=TEST_SEED), TEST_SEED, proto)
    gain = gain_estimate(base_test["scores"], final["scores"], seed=0)
    row = {"seed": seed, "steps": cfg.train.steps, "train_wall_s": round(wall, 1), "train_cpu_s": round(cpu, 1),
           "rollout_s_per_step": rollout / cfg.train.steps, "train_s_per_step": wall / cfg.train.steps,
           "curve": curve, "test": _public(final), "gain": gain.as_dict(), "verdict": gain.verdict(),
           "test_at": tests_at}
    if grid:
        row["grid_after"] = sample_grid(model, task, proto)
    print(f"  seed {seed} TEST {final['accuracy']:.3f} gain {gain.verdict()}", flush=True)
    return row


def base_scores(proto: Protocol, out: Path) -> dict[str, Any]:
    """The base model on the test split (cached per protocol: every recipe's gains pair with it)."""
    from ddrl import load_model
    from ddrl.tasks import get_task

    path = out / f"base-test{proto.test_n}-s{proto.eval_steps}.json"
    if path.exists():
        return json.loads(path.read_text())
    task, model = get_task("digits"), load_model(ROOT / "checkpoints/digits-uniform")
    base = score(model, task, task.test_examples(proto.test_n, seed=TEST_SEED), TEST_SEED, proto)
    base["grid"] = sample_grid(model, task, proto)
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(base))
    return base


def run_recipe(name: str, overrides: list[str], seeds: list[int], curve_at: set[int], proto: Protocol,
               out: Path, test_at: set[int] = frozenset()) -> dict[str, Any]:
    base = base_scores(proto, out)
    result: dict[str, Any] = {"name": name, "overrides": overrides, "protocol": proto._asdict(),
                              "base_test": _public({k: v for k, v in base.items() if k != "grid"}), "seeds": []}
    for i, seed in enumerate(seeds):
        result["seeds"].append(train_seed(overrides, seed, curve_at, base, proto, out / name / f"seed-{seed}",
                                          grid=i == 0, test_at=test_at))
        result["summary"] = summarize(result["seeds"])
        (out / f"{name}.json").write_text(json.dumps(result, indent=1))  # a partial result survives
    return result


def summarize(seeds: list[dict[str, Any]]) -> dict[str, Any]:
    """Test accuracy mean and sample sd over training seeds (sd None with one seed)."""
    accs = [s["test"]["accuracy"] for s in seeds]
    return {"n_seeds": len(accs), "test_mean": statistics.fmean(accs),
            "test_sd": statistics.stdev(accs) if len(accs) > 1 else None,
            "gain_mean": statistics.fmean(s["gain"]["mean"] for s in seeds),
            "train_cpu_s_mean": statistics.fmean(s["train_cpu_s"] for s in seeds),
            "rollout_s_per_step": statistics.fmean(s["rollout_s_per_step"] for s in seeds)}


# ----------------------------------------------------------------------------- report

def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def report_tables(results: list[dict[str, Any]]) -> str:
    """Markdown: one row per (recipe, seed) on test, and each recipe's dev curve."""
    lines = ["| recipe | seed | steps | train CPU s | rollout s/step | test PF % [95%], n | paired gain (pt) | "
             "per-class % (0..9) | distinct | Hamming mean (min class) |", "|" + "---|" * 10]
    if results:
        b = results[0]["base_test"]
        lines.append(f"| base | - | 0 | - | - | {_pct(b['accuracy'])} [{_pct(b['interval'][0])}, "
                     f"{_pct(b['interval'][1])}], {b['n']} | - | {' '.join(f'{100 * v:.0f}' for v in b['per_class'].values())}"
                     f" | {b['distinct_frac']:.2f} | {b['pairwise_hamming']:.1f} ({b['pairwise_hamming_min']:.1f}) |")
    for r in results:
        for s in r["seeds"]:
            early = [(e["step"], "-", e["test"], e["verdict"]) for e in s.get("test_at", [])]
            for step, cpu, t, verdict in early + [(s["steps"], f"{s['train_cpu_s']:.0f}", s["test"], s["verdict"])]:
                lines.append(f"| {r['name']} | {s['seed']} | {step} | {cpu} | "
                             f"{s['rollout_s_per_step']:.2f} | {_pct(t['accuracy'])} [{_pct(t['interval'][0])}, "
                             f"{_pct(t['interval'][1])}], {t['n']} | {verdict} | "
                             f"{' '.join(f'{100 * v:.0f}' for v in t['per_class'].values())} | {t['distinct_frac']:.2f} | "
                             f"{t['pairwise_hamming']:.1f} ({t['pairwise_hamming_min']:.1f}) |")
    lines += ["", "| recipe | seeds | test PF mean ± sd (%) | mean paired gain (pt) | train CPU s | rollout s/step |",
              "|---|---|---|---|---|---|"]
    for r in results:
        m = r["summary"]
        sd = "" if m["test_sd"] is None else f" ± {100 * m['test_sd']:.1f}"
        lines.append(f"| {r['name']} | {m['n_seeds']} | {_pct(m['test_mean'])}{sd} | {100 * m['gain_mean']:+.1f} | "
                     f"{m['train_cpu_s_mean']:.0f} | {m['rollout_s_per_step']:.2f} |")
    for r in results:
        lines += ["", f"Dev curve, {r['name']} (n={r['protocol']['dev_n']} per point; per seed: PF % [95%], "
                  "min class %, Hamming mean):", "", "| step | " + " | ".join(f"seed {s['seed']}" for s in r["seeds"])
                  + " | mean (min..max) |", "|---|" + "---|" * (len(r["seeds"]) + 1)]
        for i, point in enumerate(r["seeds"][0]["curve"]):
            cells = []
            for s in r["seeds"]:
                p = s["curve"][i]
                cells.append(f"{_pct(p['accuracy'])} [{_pct(p['interval'][0])}, {_pct(p['interval'][1])}], "
                             f"{100 * p['min_class_rate']:.0f}, {p['pairwise_hamming']:.1f}")
            accs = [100 * s["curve"][i]["accuracy"] for s in r["seeds"]]
            cells.append(f"{statistics.fmean(accs):.1f} ({min(accs):.1f}..{max(accs):.1f})")
            lines.append(f"| {point['step']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def second_judge(grid: list[list[list[int]]]) -> dict[str, float]:
    """The sample grid judged by something the policy never optimised: a 5-nearest-neighbour
    classifier on the real generator-split digits (does it still read as the prompted digit?), the
    L1 distance (gray levels) to the nearest real digit, and the fraction of near-saturated pixels
    (level >= 15). A policy that exploits the reward's linear classifier scores high on the reward
    and drifts away from real digits on these."""
    import numpy as np
    from sklearn.neighbors import KNeighborsClassifier

    from ddrl.rewards.image import N_LEVELS, digits_classifier, digits_splits

    real, labels = digits_splits()["generator"]  # [N, 64], [N]
    images = np.asarray([im for row in grid for im in row])  # [10 * GRID_PER_CLASS, 64]
    prompted = np.repeat(np.arange(len(grid)), len(grid[0]))
    knn = KNeighborsClassifier(n_neighbors=5).fit(real, labels)
    nearest = np.abs(images[:, None, :] - real[None]).sum(-1).min(1)  # [M]
    reward_pf = digits_classifier().predict(images / (N_LEVELS - 1)) == prompted  # the reward's own reading
    return {"knn_prompt_following": float((knn.predict(images) == prompted).mean()), "n": len(images),
            "reward_prompt_following": float(reward_pf.mean()),
            "nearest_real_l1": float(nearest.mean()), "saturated_frac": float((images >= 15).mean())}


def judge_table(base_grid: list[list[list[int]]], results: list[dict[str, Any]]) -> str:
    """Markdown: second_judge of the base grid and of each recipe's first seed's final grid."""
    from ddrl.stats import rate_estimate

    lines = ["| samples (10 classes x 8) | reward classifier PF % | kNN-on-real PF % [95%], n | nearest real digit, L1 | "
             "pixels at level >= 15 |", "|---|---|---|---|---|"]
    grids = [("base", base_grid)] + [(f"{r['name']} seed {r['seeds'][0]['seed']}, step {r['seeds'][0]['steps']}",
                                      r["seeds"][0]["grid_after"]) for r in results if "grid_after" in r["seeds"][0]]
    for name, grid in grids:
        j = second_judge(grid)
        est = rate_estimate(round(j["knn_prompt_following"] * j["n"]), j["n"])
        lines.append(f"| {name} | {100 * j['reward_prompt_following']:.1f} | {est.format()} | {j['nearest_real_l1']:.0f} | {100 * j['saturated_frac']:.1f}% |")
    return "\n".join(lines) + "\n"


def plot_curves(results: list[dict[str, Any]], path: Path) -> None:
    """Dev prompt following vs step: each recipe's mean over seeds, shaded min..max over seeds, and
    the 95% Wilson band of a single seed's point (dotted) where there is one seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=100)
    for r in results:
        steps = [p["step"] for p in r["seeds"][0]["curve"]]
        acc = [[s["curve"][i]["accuracy"] for s in r["seeds"]] for i in range(len(steps))]
        mean = [100 * statistics.fmean(a) for a in acc]
        label = f"{r['name']} ({len(r['seeds'])} seed{'s' if len(r['seeds']) > 1 else ''})"
        line, = ax.plot(steps, mean, marker="o", ms=3, label=label)
        if len(r["seeds"]) > 1:
            ax.fill_between(steps, [100 * min(a) for a in acc], [100 * max(a) for a in acc], color=line.get_color(),
                            alpha=0.2)
        else:
            c = r["seeds"][0]["curve"]
            ax.fill_between(steps, [100 * p["interval"][0] for p in c], [100 * p["interval"][1] for p in c],
                            color=line.get_color(), alpha=0.1)
    ax.axhline(90, color="gray", ls="--", lw=0.8)
    ax.text(0, 91, "target 90%", fontsize=7, color="gray")
    ax.set_xlabel("training step")
    ax.set_ylabel("dev prompt following (%)")
    ax.set_ylim(0, 100)
    ax.set_title("UDM-GRPO on digits: dev split (band: seed min..max, or one seed's 95% Wilson)", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_samples(before: list[list[list[int]]], after: list[list[list[int]]], path: Path, title: str) -> None:
    """Two 10 x GRID_PER_CLASS grids (rows: prompted class 0..9), base left, trained right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    def canvas(grid: list[list[list[int]]]) -> np.ndarray:
        rows = [np.concatenate([np.pad(np.asarray(im).reshape(8, 8), 1) for im in row], axis=1) for row in grid]
        return np.concatenate(rows, axis=0)  # [10 * 10, GRID_PER_CLASS * 10]

    fig, axes = plt.subplots(1, 2, figsize=(6.4, 4.2), dpi=100)
    for ax, grid, name in zip(axes, (before, after), ("base", title)):
        ax.imshow(canvas(grid), cmap="gray_r", vmin=0, vmax=16, interpolation="nearest")
        ax.set_title(name, fontsize=8)
        ax.set_yticks([10 * c + 5 for c in range(10)], [str(c) for c in range(10)], fontsize=7)
        ax.set_xticks([])
        ax.set_ylabel("prompted class", fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def report(out: Path, docs: Path, order: list[str]) -> str:
    """Tables (printed and written to out/tables.md) and the two pictures, from every JSON in out."""
    found = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json")) if not p.stem.startswith("base-")}
    for name in [n for n in found if "_seeds" in n]:  # more seeds of a recipe, run later: NAME_seedsXY
        extra, into = found.pop(name), found.get(name.split("_seeds")[0])
        if into is not None and extra["overrides"] == into["overrides"]:
            into["seeds"] += extra["seeds"]
            into["summary"] = summarize(into["seeds"])
        else:
            found[name] = extra
    results = [found[n] for n in order if n in found] + [r for n, r in found.items() if n not in order]
    text = report_tables(results)
    bases = sorted(out.glob("base-*.json"))
    if bases and results:
        text += "\nSecond judge of the sample grids (not the reward):\n\n" + judge_table(
            json.loads(bases[0].read_text())["grid"], results)
    (out / "tables.md").write_text(text)
    curve_names = {"main", "naive"}
    plotted = [r for r in results if r["name"] in curve_names] or results
    if plotted:
        docs.mkdir(parents=True, exist_ok=True)
        plot_curves(plotted, docs / "udm_digits_curve.png")
        main = plotted[0]
        base = json.loads(next(out.glob("base-*.json")).read_text())
        plot_samples(base["grid"], main["seeds"][0]["grid_after"], docs / "udm_digits_samples.png",
                     f"{main['name']}, seed {main['seeds'][0]['seed']}, {main['seeds'][0]['steps']} steps")
    print(text)
    return text


QUICK = ["train.steps=2", "train.prompts_per_step=2", "train.group_size=2", "rollout.steps=2"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", default="main", help="the recipe's name (its JSON: OUT/NAME.json)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--curve-at", default="0,35,70,105,140", help="dev-scored steps (0 = base; the last step always)")
    ap.add_argument("--test-at", default="", help="earlier steps also scored on test (reporting only)")
    ap.add_argument("--out", default=str(ROOT / "runs/bench_udm_digits"))
    ap.add_argument("--docs", default=str(DOCS), help="where --report writes the pictures")
    ap.add_argument("--report", action="store_true", help="tables and pictures from every JSON in --out")
    ap.add_argument("--quick", action="store_true", help="a 2-step smoke run at tiny n into a temporary --out")
    ap.add_argument("overrides", nargs="*", help="config overrides on configs/rl/udm_grpo_digits.yaml")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    order = ["main", "naive", "rollout4", "rollout16", "cfg"]
    if args.quick:
        proto = Protocol(dev_n=20, test_n=20, eval_steps=2, batch_size=20)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            result = run_recipe("main", QUICK + args.overrides, [0], {0, 1, 2}, proto, out, test_at={1})
            result["tables"] = report(out, out / "docs", order)
            result["pictures"] = sorted(p.name for p in (out / "docs").glob("*.png"))
        return result
    out = Path(args.out)
    if args.report:
        return {"tables": report(out, Path(args.docs), order)}
    curve_at = {int(s) for s in args.curve_at.split(",") if s}
    test_at = {int(s) for s in args.test_at.split(",") if s}
    result = run_recipe(args.name, args.overrides, args.seeds, curve_at, Protocol(), out, test_at)
    report(out, Path(args.docs), order)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
