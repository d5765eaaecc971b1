"""Rehearse every paper recipe (configs/paper/**/*.yaml) at its real size on fake tensors: rank 0 of
--world-size ranks (or, for a recipe whose prompt groups do not split over them, as gdsd's 20, the
largest world size below that they do: the row says so), the trainer's own step (ddrl.training.rehearse),
extrapolated to full depth from rehearsals at EXTRAPOLATE_LAYERS (4 and 6) at full width (the CPU time
of 10 layers; the line equals a full-depth rehearsal: tests/integration/test_rehearse.py). Writes a table to bench/RESULTS.md under a section marked
as estimates.

    nice -n 10 python bench/rehearse_all.py [KEY=VALUE ...] [--world-size 8] [--only SUBSTRING ...] [--quick]

KEY=VALUE: config overrides applied to every recipe, as `ddrl train CONFIG KEY=VALUE` takes them
(e.g. `dist.strategy=fsdp dist.cpu_offload=true`); each row names them after the recipe. Give them
before --only, which takes every word after it.

--quick: 8 sampler steps (one per block) and 2 iterations of mu: neither changes a shape (TraceRL's
states, which the sampler's steps set, are the recipe's: rehearse's recipe_steps) or the
memory peak (the second iteration's backward already holds AdamW's state), only the roofline time,
which is then scaled back to the recipe's rollout.steps and num_iterations (linear: each sampler step
is one forward of the same width; each iteration the same passes).
--hand-only: the hand model's column alone (ddrl.training.memory at the rows' world sizes, full depth and
prompt width, with --quick's overrides when given), in seconds, printed and not written: the cross-check
to rerun after a change to the hand model.

A recipe that fails is listed with the first line of its error (a family fake tensors cannot run, or
a config the rehearsal cannot stand in for).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddrl.training.memory import GB  # noqa: E402
from ddrl.training.rehearse import (DEVICE, EXTRAPOLATE_LAYERS, HEADROOM, full_depth_hand,  # noqa: E402
                                    rehearse_extrapolated)

SECTION = "## Issue 33: every paper recipe rehearsed at its real size (estimates (rehearsal on fake tensors, CPU))"
HEADER = ("| recipe | world | strategy | tracker peak GB/rank | hand-model GB | tracker/hand | fits 141 GB -10% | "
          "host syncs | est. rollout s | est. update s |\n|---|---|---|---|---|---|---|---|---|---|")


def recipes(only: list[str]) -> list[Path]:
    paths = sorted((ROOT / "configs" / "paper").rglob("*.yaml"))
    return [p for p in paths if not only or any(s in str(p) for s in only)]


def quick_overrides(config: Path, overrides: tuple[str, ...] = ()) -> tuple[list[str], float, float]:
    """(overrides, rollout time factor, update time factor) of --quick for this recipe (with the
    bench's own overrides)."""
    from ddrl.config import RLConfig, load_config

    cfg = load_config(config, list(overrides), RLConfig)
    r, t = cfg.rollout, cfg.train
    blocks = -(-r.gen_length // (r.block_length or r.gen_length))
    steps = max(blocks, 1)
    iterations = min(t.num_iterations, 2)
    return ([f"rollout.steps={steps}", f"train.num_iterations={iterations}"],
            (r.steps or steps) / steps, t.num_iterations / iterations)


def recipe_steps(config: Path, overrides: tuple[str, ...] = ()) -> int | None:
    """The recipe's rollout.steps (before --quick's): TraceRL's training states come from it."""
    from ddrl.config import RLConfig, load_config

    return load_config(config, list(overrides), RLConfig).rollout.steps


def has_rows(config: Path, overrides: tuple[str, ...] = ()) -> bool:
    """Whether the recipe cuts its estimator's own rows (train.micro_batch_rows: TraceRL, UniGRPO), whose
    rehearsal --quick makes one optimizer step's share long (rehearse's one_share)."""
    from ddrl.config import RLConfig, load_config

    return bool(load_config(config, list(overrides), RLConfig).train.micro_batch_rows)


def recipe_world_size(config: Path, asked: int, overrides: tuple[str, ...] = ()) -> tuple[int, str]:
    """(world size, note): `asked`, or the largest that the recipe's prompt groups split over evenly
    (each process holds whole groups: train.prompts_per_step % world == 0), with a note saying why."""
    from ddrl.config import RLConfig, load_config

    prompts = load_config(config, list(overrides), RLConfig).train.prompts_per_step
    world = max(n for n in range(1, asked + 1) if prompts % n == 0)
    note = "" if world == asked else f" ({prompts} prompt groups do not split over {asked}: the recipe's own {world})"
    return world, note


def row(config: Path, asked_world_size: int, quick: bool, overrides: tuple[str, ...] = ()) -> str:
    """One table row: the recipe with `overrides` (the bench's KEY=VALUE words, named after it), then
    --quick's own (computed from the overridden config, so that its time factors are that config's)."""
    name = " ".join([str(config.relative_to(ROOT)), *overrides])
    quick_words, rollout_x, update_x = quick_overrides(config, overrides) if quick else ([], 1.0, 1.0)
    world_size, note = recipe_world_size(config, asked_world_size, overrides)
    try:
        r = rehearse_extrapolated(config, [*overrides, *quick_words, "output_dir=/tmp/ddrl-rehearse-all"],
                                  world_size, check_fit=False, recipe_steps=recipe_steps(config, overrides),
                                  one_share=quick and has_rows(config, overrides))
    except Exception as e:  # a failing recipe is a row of the table, not the end of the bench
        traceback.print_exc()
        first = (str(e).strip().splitlines() or [type(e).__name__])[-1][:160].replace("|", "/")
        return f"| {name} | {world_size}{note} | | failed: {type(e).__name__}: {first} | | | | | | |"
    ratio = r.peak_bytes / r.hand_total_bytes if r.hand_total_bytes else float("nan")
    fits = "yes" if r.fits else f"NO (> {HEADROOM * DEVICE.memory_bytes / GB:.0f} GB)"
    return (f"| {name} | {world_size}{note} | {r.strategy} | {r.peak_bytes / GB:.1f} | {r.hand_total_bytes / GB:.1f} | "
            f"{ratio:.2f} | {fits} | {sum(r.host_reads.values())} | {r.rollout_s * rollout_x:.1f} | "
            f"{r.update_s * update_x:.1f} |")


def hand_row(config: Path, asked_world_size: int, quick: bool, overrides: tuple[str, ...] = ()) -> str:
    """The hand model's figure for the row `row` would rehearse (its world size, --quick's overrides)."""
    from ddrl.config import RLConfig, load_config

    quick_words = quick_overrides(config, overrides)[0] if quick else []
    world_size, note = recipe_world_size(config, asked_world_size, overrides)
    hand = full_depth_hand(load_config(config, [*overrides, *quick_words], RLConfig), world_size)
    figure = f"{hand.estimate.total / GB:.1f}" if hand else "(a checkpoint file: the rehearsal counts the built module)"
    return f"| {' '.join([str(config.relative_to(ROOT)), *overrides])} | {world_size}{note} | {figure} |"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="config overrides for every recipe (e.g. dist.cpu_offload=true), before --only")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--only", nargs="*", default=[])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--hand-only", action="store_true", help="the hand model's column only (seconds), printed")
    p.add_argument("--out", default=str(ROOT / "bench" / "RESULTS.md"))
    args = p.parse_args(argv)
    if any("=" in s for s in args.only):
        p.error(f"--only takes recipe path substrings, got {[s for s in args.only if '=' in s]}: put KEY=VALUE "
                f"overrides before --only")
    if any("=" not in s for s in args.overrides):
        p.error(f"overrides are KEY=VALUE words, got {[s for s in args.overrides if '=' not in s]}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.hand_only:
        print("| recipe | world | hand-model GB |\n|---|---|---|")
        for config in recipes(args.only):
            print(hand_row(config, args.world_size, args.quick, tuple(args.overrides)), flush=True)
        return 0
    command = " ".join(["bench/rehearse_all.py", *args.overrides, *(["--quick"] if args.quick else [])])
    intro = (f"\n{SECTION}\n\n`{command}`: rank 0 of "
             f"{args.world_size} H200s, each recipe's own step on fake tensors, full width, memory "
             f"extrapolated to full depth from rehearsals at {' and '.join(map(str, EXTRAPOLATE_LAYERS))} layers "
             f"(MemTracker's peak; the hand model "
             f"is ddrl.training.memory at full depth). Times: RuntimeEstimator's roofline (989 TFLOP/s bf16, "
             f"4.8 TB/s), no collectives, no launch overhead: a lower bound, not a prediction. Host syncs: "
             f"data-dependent reads per step, counted by call site (see `ddrl train CONFIG --rehearse`).\n\n"
             f"{HEADER}\n")
    with open(args.out, "a") as f:  # row by row: a long bench leaves what it finished
        f.write(intro)
    for config in recipes(args.only):
        start = time.time()
        line = row(config, args.world_size, args.quick, tuple(args.overrides))
        print(line, f"({time.time() - start:.0f} s on this CPU)", flush=True)
        with open(args.out, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
