"""`ddrl demo`: the main job on the CPU, told honestly.

1. Load the shipped tiny model and measure its held-out score (greedy).
2. Fine-tune it with RL (StableDRL by default) with a progress bar.
3. Measure again, print a before/after table, save the reward curve, name the run directory.

mini_sudoku: a converged 4x4 Sudoku model (99.6% of held-out puzzles solved with the 16-step
reference sampler) that solves far fewer when it must decode 8 tokens per model call (2 steps): RL
with 2-step rollouts and only the verifier's reward, scored on held-out puzzles with 2 steps; the
table also shows the 16-step score, which RL must not break. (Its first story, a model pretrained on
easy puzzles and RL'd on hard ones, did not generalise at this scale: docs/methods.md.)
digits: UDM-GRPO's own system in miniature: a tiny URSA pipeline (checkpoints/digits-ursa, a VQ
codebook of gray levels, the metric path and its CTMC sampler) whose decoded 8x8 pixels a held-out
classifier scores; UDM-GRPO optimises prompt following, which likelihood training does not optimise.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from ddrl.config import RLConfig, load_config
from ddrl.contract import model_view

if TYPE_CHECKING:
    from ddrl.stats import Estimate

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMOS = {
    "mini_sudoku": ("configs/rl/demo_mini_sudoku.yaml", "stable_drl"),
    "digits": ("configs/rl/demo_digits.yaml", "udm_grpo"),
}


def demo_config(task: str = "mini_sudoku", method: str | None = None, steps: int | None = None,
                output_dir: str | None = None, eval_n: int | None = None) -> RLConfig:
    if task not in DEMOS:
        raise ValueError(f"unknown demo task {task!r}; choose one of: {', '.join(DEMOS)}")
    rel, default_method = DEMOS[task]
    path = REPO_ROOT / rel
    if not path.is_file():
        raise ValueError(f"demo config {path} is missing; run `ddrl demo` from a ddrl source checkout")
    method = method or default_method
    overrides = [f"method.objective={method}"]
    if method != default_method:  # the demo's method-specific arguments belong to its default method
        overrides += ["method.objective_args={}", "method.estimator_args={}", "method.estimator=null"]
    if steps is not None:
        overrides.append(f"train.steps={steps}")
    if eval_n is not None:
        overrides += [f"eval.n={eval_n}", f"eval.report_n={eval_n}"]  # both evaluations, dev and sealed test
    overrides.append(f"output_dir={output_dir or f'runs/demo-{task}-{method}'}")
    overrides.append("overwrite=true")  # a demo run replaces the previous demo run in its directory
    cfg = load_config(path, overrides, RLConfig)
    model_path = Path(cfg.model.path)
    if not model_path.is_absolute():
        cfg.model.path = str(REPO_ROOT / model_path)
    return cfg


def run_demo(task: str = "mini_sudoku", method: str | None = None, steps: int | None = None,
             output_dir: str | None = None, eval_n: int | None = None) -> dict:
    from ddrl.training.trainer import Trainer

    cfg = demo_config(task, method, steps, output_dir, eval_n)
    metric = "solve rate" if task == "mini_sudoku" else "prompt following"
    print(f"ddrl demo: {cfg.method.objective} on {task}, model {cfg.model.path}")
    print(f"  {cfg.train.steps} RL steps x {cfg.train.prompts_per_step} prompts x G={cfg.train.group_size}, "
          f"scored on {cfg.eval.report_n or cfg.eval.n} sealed-test examples before and after, "
          f"{cfg.eval.n} dev examples along the way "
          f"({'greedy' if cfg.eval.temperature == 0 else f'temperature {cfg.eval.temperature:g}'})")
    start = time.perf_counter()
    trainer = Trainer(cfg)
    steps = cfg.eval.steps or cfg.rollout.steps  # sampler steps of the held-out score
    # parallel decoding (k tokens per call) has a one-token reference only where tokens are unmasked
    few_step = model_view(trainer.model).process_name in ("masked", "block") and steps < cfg.rollout.gen_length
    reference_before = reference_score(trainer) if few_step else None
    run_dir = trainer.run()
    elapsed = time.perf_counter() - start
    before, after = trainer.report["before"], trainer.report["after"]  # the sealed split (eval.report_split)
    header = ["", f"{metric}" + (f" ({steps} step{'s' * (steps > 1)})" if few_step else ""), "mean reward"]
    rows = [["before RL", f"{before['accuracy']:.1%}", f"{before['mean_reward']:.3f}"],
            [f"after {cfg.train.steps} steps", f"{after['accuracy']:.1%}", f"{after['mean_reward']:.3f}"]]
    reference_after = reference_score(trainer) if few_step else None
    if few_step:
        header.append(f"{metric} ({cfg.rollout.gen_length} steps, reference)")
        rows[0].append(f"{reference_before:.1%}")
        rows[1].append(f"{reference_after:.1%}")
    rows = [header, *rows]
    width = [max(len(r[i]) for r in rows) for i in range(len(header))]
    print()
    for r in rows:
        print(("  " + "  ".join(c.ljust(w) for c, w in zip(r, width))).rstrip())
    gain = paired_gain(run_dir / "eval", 0, cfg.train.steps, tag="report")
    print(f"\n  gain on the {cfg.eval.report_split} split, same {gain.n} examples before and after "
          f"({gain.method.replace('_', ' ')}, 95%): {gain.verdict()}")
    if trainer.eval_history and trainer.eval_history[0]["step"] == 0:  # the periodic evaluations: dev
        dev = paired_gain(run_dir / "eval", 0, cfg.train.steps)
        print(f"  the same run on the {trainer.eval_split} split (its periodic evaluations, {dev.n} examples): "
              f"{dev.verdict()}")
    print(f"  wall time {elapsed / 60:.1f} min; run directory {run_dir}")
    print(f"  reward curve: {run_dir / 'reward_curve.png'}; metrics: {run_dir / 'metrics.jsonl'}")
    return {"before": before, "after": after, "run_dir": str(run_dir), "seconds": elapsed,
            "reference_before": reference_before, "reference_after": reference_after, "gain": gain.as_dict()}


def paired_gain(eval_dir: Path, before_step: int, after_step: int, tag: str = "eval") -> "Estimate":
    """after - before on the same held-out examples, from the trainer's evaluation rows
    (eval/step-N.jsonl, or eval/report-step-N.jsonl for the sealed report), bootstrapped over
    examples, or over clusters (Sudoku's solution grids) when the rows name them: a gain is claimed
    only when its interval excludes zero."""
    import json

    from ddrl.eval.runner import first_scores
    from ddrl.stats import gain_estimate

    def rows(step: int) -> list[dict]:
        name = f"step-{step}.jsonl" if tag == "eval" else f"{tag}-step-{step}.jsonl"
        return [json.loads(line) for line in (eval_dir / name).read_text().splitlines()]

    before, after = rows(before_step), rows(after_step)
    if [r["prompt"] for r in before] != [r["prompt"] for r in after]:
        raise ValueError(f"{eval_dir}: the before and after evaluations scored different examples")
    clusters = [r["cluster"] for r in before] if all("cluster" in r for r in before) else None
    return gain_estimate(first_scores(before), first_scores(after), clusters=clusters)


def reference_score(trainer) -> float:
    """Held-out greedy solve rate with one token per model call (the slow reference sampler)."""
    from dataclasses import replace

    from ddrl.eval import evaluate

    cfg = trainer.cfg
    sampler = replace(cfg.rollout, temperature=0.0, steps=cfg.rollout.gen_length, threshold=None)
    return evaluate(trainer.model, trainer.task, n=cfg.eval.n, sampler=sampler, seed=cfg.seed,
                    split=cfg.eval.report_split or "test")["accuracy"]
