"""StableDRL's "exploding weights" stress test as held-out reward curves (issue 17; docs/seed_claims.md).

StableDRL (Zhong et al.) claims that its unconditional clip and group self-normalised weights keep
learning when the importance ratios are noisy, where PPO-style conditional clipping (GRPO, ESPO)
lets an A < 0 sample with a huge ratio through. Here GRPO, ESPO and StableDRL, each from its
shipped configs/rl/<method>_mini_sudoku.yaml (its paper's estimator), train on the shipped 4x4
Sudoku model for 2-step decoding with and without Gaussian noise of std `--noise` added to every
log-ratio (method.objective_args.ratio_noise_std, ddrl.objectives.base.inject_ratio_noise). Every run: same seed,
prompts and budget; dev solve rate every 10 steps (n=256, the same puzzles); final sealed-test
solve rate (n=1000) paired against the base over solution grids.

    OMP_NUM_THREADS=1 .venv/bin/python bench/stress_ratio_noise.py            # the study (~15 CPU-min)
    OMP_NUM_THREADS=1 .venv/bin/python bench/stress_ratio_noise.py --quick    # a smoke run (< 20 s)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _claims import (QUICK, Budget, Run, paired_difference, picture_path, plot_study, run_study,  # noqa: E402
                     run_table, write_json)

METHODS = ("grpo", "espo", "stable_drl")


def study_runs(methods: list[str], noise: float) -> list[Run]:
    return [Run(f"{m}-noise{s:g}", f"configs/rl/{m}_mini_sudoku.yaml",
                [f"method.objective_args.ratio_noise_std={s}"], {"method": m, "noise": s})
            for m in methods for s in (0.0, noise)]


def noise_effects(study: dict[str, Any], noise: float) -> dict[str, dict[str, Any]]:
    """Per method: noisy minus clean final test solve rate on the same puzzles (95% paired interval)."""
    finals, out = study["finals"], {}
    for m in {r["method"] for r in study["runs"]}:
        clean, noisy = finals.get(f"{m}-noise0"), finals.get(f"{m}-noise{noise:g}")
        if clean is not None and noisy is not None:
            out[m] = paired_difference(clean, noisy, study["clusters"], study["budget"]["seed"])
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 tiny steps per run, small evaluations (smoke test)")
    p.add_argument("--steps", type=int, default=Budget.steps)
    p.add_argument("--prompts", type=int, default=Budget.prompts)
    p.add_argument("--noise", type=float, default=3.0, help="std of the Gaussian noise added to log-ratios")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--out", default="runs/seed_claims/stress")
    p.add_argument("--png", default=None, help="picture path (default docs/stress_ratio_noise.png; --quick: in --out)")
    args = p.parse_args(argv)
    budget = QUICK if args.quick else Budget(steps=args.steps, prompts=args.prompts)
    out = Path(args.out)
    study = run_study(study_runs(args.methods.split(","), args.noise), budget, out, name="stress")
    study["noise_effect"] = noise_effects(study, args.noise)
    write_json(out / "results.json", study)
    png = picture_path(args.png, args.quick, out, "stress_ratio_noise.png")
    plot_study(study, png, color_by="method", style_by="noise",
               title=f"log-ratio noise std {args.noise:g} (dashed) vs none (solid); "
                     f"base test {study['base_test_text']}")
    print(f"base on test: {study['base_test_text']}")
    print(run_table(study, ["method", "noise"]))
    for m, eff in sorted(study["noise_effect"].items()):
        print(f"{m}: noisy - clean on test: {eff['verdict']}")
    return study


if __name__ == "__main__":
    main()
