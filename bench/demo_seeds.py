"""The demo's gain across training seeds, on both held-out splits, with large n (issue 17).

For each seed: `ddrl train configs/rl/demo_mini_sudoku.yaml seed=S` (the demo's recipe; its own
periodic evaluations switched off), then the base and the final model are scored with the demo's
2-step greedy sampler on the same N dev and N sealed-test puzzles (example seed 1000, independent
of the training seed), and the paired gain is bootstrapped over solution grids.

    OMP_NUM_THREADS=1 .venv/bin/python bench/demo_seeds.py --seeds 0 1 2 --n 1000
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    from ddrl import load_model
    from ddrl.config import RLConfig, load_config
    from ddrl.eval import evaluate
    from ddrl.eval.runner import first_scores
    from ddrl.stats import gain_estimate
    from ddrl.tasks import get_task
    from ddrl.training.trainer import Trainer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--example-seed", type=int, default=1000)
    ap.add_argument("--out", default="runs/bench_demo_seeds")
    args = ap.parse_args()
    out = ROOT / args.out
    cfg0 = load_config(ROOT / "configs/rl/demo_mini_sudoku.yaml", [], RLConfig)
    task = get_task(cfg0.task.name, **cfg0.task.args)
    sampler = replace(cfg0.rollout, temperature=0.0)  # the demo's held-out sampler: 2 steps, greedy

    def score(model, split: str, path: Path) -> tuple[list[float], list[str], dict]:
        result = evaluate(model, task, n=args.n, sampler=sampler, seed=args.example_seed, split=split,
                          output_jsonl=path)
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        return first_scores(rows), [r.get("cluster", str(i)) for i, r in enumerate(rows)], result

    base = load_model(ROOT / cfg0.model.path)
    base_scores = {s: score(base, s, out / f"base-{s}.jsonl") for s in ("dev", "test")}
    summary = []
    for seed in args.seeds:
        run = out / f"seed-{seed}"
        cfg = load_config(ROOT / "configs/rl/demo_mini_sudoku.yaml",
                          [f"seed={seed}", f"output_dir={run}", "eval.n=0", "train.progress=false"], RLConfig)
        cfg.model.path = str(ROOT / cfg.model.path)
        trainer = Trainer(cfg)
        trainer.run()
        row = {"seed": seed}
        for split in ("dev", "test"):
            after, clusters, result = score(trainer.model, split, run / f"final-{split}.jsonl")
            before = base_scores[split][0]
            gain = gain_estimate(before, after, clusters=clusters)
            row[split] = {"before": sum(before) / len(before), "after": result["accuracy"],
                          "after_interval": result["accuracy_interval"], "gain": gain.as_dict(),
                          "verdict": gain.verdict()}
            print(f"seed {seed} {split}: {row[split]['before']:.1%} -> {row[split]['after']:.1%}  {gain.verdict()}",
                  flush=True)
        summary.append(row)
    for split in ("dev", "test"):
        gains = [r[split]["gain"]["mean"] for r in summary]
        spread = statistics.stdev(gains) if len(gains) > 1 else 0.0
        print(f"{split}: mean gain over {len(gains)} seeds {statistics.mean(gains) * 100:+.1f} pt "
              f"(sd {spread * 100:.1f} pt), n={args.n} per split")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
