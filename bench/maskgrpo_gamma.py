"""MaskGRPO's timestep-truncation sweep: gamma (min mask rate) on the honest protocol (issue 17;
docs/seed_claims.md).

MaskGRPO (Ma et al., arXiv 2510.02880) scores inner iteration k of mu with masks at ratio
min(gamma + (1 - gamma)(k+1)/mu, 0.999) (ddrl/estimators/maskgrpo.py) and says truncating the
low-noise end (gamma = 0.6 for text) helps. Here configs/rl/maskgrpo_mini_sudoku.yaml (mu = 2: the
two ratios are (1 + gamma)/2 and 0.999) trains with each gamma on the same seed, prompts and budget:
dev solve rate every 10 steps (n=256, the same puzzles), final sealed-test solve rate (n=1000)
paired against the base over solution grids, and each gamma paired against gamma = 0.6.

    OMP_NUM_THREADS=1 .venv/bin/python bench/maskgrpo_gamma.py            # the study (~8 CPU-min)
    OMP_NUM_THREADS=1 .venv/bin/python bench/maskgrpo_gamma.py --quick    # a smoke run (< 20 s)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _claims import (QUICK, Budget, Run, paired_difference, picture_path, plot_study, run_study,  # noqa: E402
                     run_table, write_json)

GAMMAS = (0.0, 0.2, 0.4, 0.6, 0.8)
PAPER_GAMMA = 0.6


def study_runs(gammas: list[float]) -> list[Run]:
    return [Run(f"gamma{g:g}", "configs/rl/maskgrpo_mini_sudoku.yaml", [f"method.estimator_args.gamma={g}"],
                {"gamma": g}) for g in gammas]


def against_paper(study: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each gamma's final test solve rate minus the paper's gamma = 0.6 run's, same puzzles (95% paired)."""
    finals = study["finals"]
    ref = finals.get(f"gamma{PAPER_GAMMA:g}")
    if ref is None:
        return {}
    return {label: paired_difference(ref, scores, study["clusters"], study["budget"]["seed"])
            for label, scores in finals.items() if label != f"gamma{PAPER_GAMMA:g}"}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 tiny steps per run, small evaluations (smoke test)")
    p.add_argument("--steps", type=int, default=Budget.steps)
    p.add_argument("--prompts", type=int, default=Budget.prompts)
    p.add_argument("--gammas", default=",".join(f"{g:g}" for g in GAMMAS))
    p.add_argument("--out", default="runs/seed_claims/maskgrpo_gamma")
    p.add_argument("--png", default=None, help="picture path (default docs/maskgrpo_gamma.png; --quick: in --out)")
    args = p.parse_args(argv)
    budget = QUICK if args.quick else Budget(steps=args.steps, prompts=args.prompts)
    gammas = [float(g) for g in args.gammas.split(",")]
    if args.quick:
        gammas = [g for g in gammas if g in (0.0, PAPER_GAMMA)] or gammas[:2]
    out = Path(args.out)
    study = run_study(study_runs(gammas), budget, out, name="maskgrpo_gamma")
    study["vs_paper_gamma"] = against_paper(study)
    write_json(out / "results.json", study)
    png = picture_path(args.png, args.quick, out, "maskgrpo_gamma.png")
    plot_study(study, png, color_by="gamma", style_by=None,
               title=f"MaskGRPO truncation gamma (paper: {PAPER_GAMMA}); base test {study['base_test_text']}")
    print(f"base on test: {study['base_test_text']}")
    print(run_table(study, ["gamma"]))
    for label, d in sorted(study["vs_paper_gamma"].items()):
        print(f"{label} - gamma{PAPER_GAMMA:g} on test: {d['verdict']}")
    return study


if __name__ == "__main__":
    main()
