"""Rollout speed and accuracy: LLaDA's reference sampler against the fast variants (Fast-dLLM, §1.8).

Every variant samples the same prompts with the same model and seed, in one process, variants
interleaved and repeated, and the best time of each is kept (shared machines: compare ratios).

    python bench/bench_sampler.py sudoku  [--model DIR] [--n 128] [--batch 64] [--block 27] [--split test]
                                          [--dump FILE] [--quick]
    python bench/bench_sampler.py random  [--d-model 128] [--n-layers 4] [--gen 256] [--block 32] [--batch 8]
    python bench/bench_sampler.py percall [--d-model 128] [--n-layers 4] [--batch 8]
    (all: [--threads 1] [--repeats 2] [--json])

sudoku   9x9 Sudoku (81-token answers), greedy, the built-in model `checkpoints/sudoku-masked`
         (else runs/pretrain/sudoku-masked/final; make it with
         `ddrl pretrain configs/pretrain/sudoku_masked.yaml output_dir=runs/pretrain/sudoku-masked`),
         puzzles of the sealed test split (--split) at its pretraining difficulty. Reports tokens/s,
         the wall-clock speedup, model calls and the call ratio (reference calls / calls), tokens fed
         and the fed-token ratio (reference / variant; both independent of the machine's load),
         accuracy (solved, Wilson 95% interval), cell accuracy, token agreement with the reference,
         and each variant's solve rate minus the reference's on the same puzzles with a paired
         bootstrap 95% interval over puzzles (clusters: the solution grid; ddrl/stats.py).
         --dump writes every puzzle's completion and verdict per variant (JSON), to compare runs
         across commits puzzle by puzzle. --quick: 8 puzzles, two variants (a smoke test).
random   a random-weight built-in model, gen 256 in blocks of 32, one token per step: raw speed of
         the cache modes (a random model is never confident, so thresholds do not apply).
percall  one forward call's time against the number of tokens fed: the fixed cost per call that
         bounds the speedup of a tiny model on a CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddrl.config import SamplerConfig  # noqa: E402
from ddrl.data import decode_completions, model_stop_ids, encode_prompts  # noqa: E402
from ddrl.registry import SAMPLERS  # noqa: E402


@dataclass
class Variant:
    label: str
    cache: str = "none"
    threshold: float | None = None
    factor: float | None = None


def variants(full: bool) -> list[Variant]:
    """The reference first; then cache modes, thresholds and factors (with and without the cache)."""
    out = [Variant("reference"), Variant("prefix", "prefix"), Variant("dual", "dual")]
    if not full:
        return out
    for cache in ("none", "dual"):
        tag = "" if cache == "none" else "dual+"
        out += [Variant(f"{tag}t{t}", cache, threshold=t) for t in (0.99, 0.95, 0.9, 0.8, 0.7)]
        out += [Variant(f"{tag}factor{f}", cache, factor=f) for f in (1.0, 2.0)]
    out += [Variant("prefix+t0.9", "prefix", threshold=0.9)]
    return out


def sampler_config(base: SamplerConfig, v: Variant) -> SamplerConfig:
    cfg = replace(base, cache=v.cache, threshold=v.threshold)
    if v.factor is not None:
        cfg.factor = v.factor  # read by the masked sampler when present (no SamplerConfig field yet)
    return cfg


def run_variant(model: Any, batches: list[tuple[torch.Tensor, torch.Tensor]], cfg: SamplerConfig, seed: int) -> dict:
    sample = SAMPLERS.get(cfg.name)
    outs, nfe, fed = [], 0, 0
    start = time.perf_counter()
    for i, (ids, mask) in enumerate(batches):
        out = sample(model, ids, mask, cfg, generator=torch.Generator().manual_seed(seed + i))
        outs.append(out.completion_ids)
        nfe += out.nfe
        fed += out.forward_tokens or 0
    return {"seconds": time.perf_counter() - start, "completions": torch.cat(outs), "nfe": nfe, "fed": fed}


def compare(model: Any, batches: list, base: SamplerConfig, vs: list[Variant], repeats: int, seed: int = 0) -> dict:
    """Each variant `repeats` times, interleaved; best time kept."""
    results: dict[str, dict] = {}
    for _ in range(repeats):
        for v in vs:
            r = run_variant(model, batches, sampler_config(base, v), seed)
            best = results.get(v.label)
            if best is None or r["seconds"] < best["seconds"]:
                results[v.label] = r
    return results


def table(results: dict, generated: int, extra: dict[str, dict] | None = None) -> list[dict]:
    """One row per variant. `speedup` is wall-clock (moves with the machine's load); `calls_ratio`
    (reference model calls / calls) and `fed_ratio` (reference fed tokens / fed tokens) are counts."""
    ref = results["reference"]
    rows = []
    for label, r in results.items():
        row = {
            "variant": label,
            "tokens_per_s": generated / r["seconds"],
            "speedup": ref["seconds"] / r["seconds"],
            "model_calls": r["nfe"],
            "calls_ratio": ref["nfe"] / r["nfe"],
            "fed_tokens_vs_ref": r["fed"] / ref["fed"],
            "fed_ratio": ref["fed"] / r["fed"] if r["fed"] else float("nan"),
            "agree_with_ref": (r["completions"] == ref["completions"]).float().mean().item(),
            "seconds": r["seconds"],
        }
        row.update((extra or {}).get(label, {}))
        rows.append(row)
    return rows


def print_table(rows: list[dict], title: str) -> None:
    cols = list(dict.fromkeys(k for row in rows for k in row))
    print(f"\n{title}")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        cells = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in (row.get(c, "") for c in cols)]
        print("| " + " | ".join(cells) + " |")


# --------------------------------------------------------------------------------------------
# The three benchmarks
# --------------------------------------------------------------------------------------------


def default_model_dir() -> Path:
    for path in (ROOT / "checkpoints/sudoku-masked", ROOT / "runs/pretrain/sudoku-masked/final"):
        if (path / "config.json").is_file():
            return path
    raise SystemExit("no Sudoku model: run `.venv/bin/ddrl pretrain configs/pretrain/sudoku_masked.yaml "
                     "output_dir=runs/pretrain/sudoku-masked` first, or pass --model DIR")


def solve_rate_rows(task: Any, examples: list[dict], solved: dict[str, list[bool]]) -> dict[str, dict]:
    """Per variant: accuracy with its Wilson 95% interval, and the paired change against the
    reference on the same puzzles (bootstrap over puzzles, or over solution grids where a task's
    puzzles share grids), in points."""
    from ddrl.stats import gain_estimate, rate_estimate
    from ddrl.tasks.base import cluster_keys

    clusters = cluster_keys(task, examples)
    ref = [float(s) for s in solved["reference"]]
    out = {}
    for label, verdicts in solved.items():
        acc = rate_estimate(sum(verdicts), len(verdicts))
        row = {"accuracy": acc.mean, "accuracy_95": f"[{acc.lo:.3f}, {acc.hi:.3f}]"}
        if label != "reference":
            gain = gain_estimate(ref, [float(v) for v in verdicts], clusters=clusters)
            row.update({"vs_ref_pt": gain.mean * 100, "vs_ref_95": f"[{gain.lo * 100:+.1f}, {gain.hi * 100:+.1f}]",
                        "vs_ref_lo_pt": gain.lo * 100, "vs_ref_hi_pt": gain.hi * 100,
                        "only_ref_solved": sum(r and not v for r, v in zip(solved["reference"], verdicts)),
                        "only_variant_solved": sum(v and not r for r, v in zip(solved["reference"], verdicts))})
        out[label] = row
    return out


def bench_sudoku(args: argparse.Namespace) -> list[dict]:
    """9x9 Sudoku (or, with --task mini_sudoku, the 4x4 task of the shipped RL configs)."""
    from ddrl.models import load_model
    from ddrl.tasks import get_task

    model = load_model(args.model or default_model_dir()).eval()
    task = get_task(args.task, min_empty=args.min_empty, max_empty=args.max_empty)
    cells = get_task(args.task, min_empty=args.min_empty, max_empty=args.max_empty, reward="partial")
    examples = task.examples(args.split, n=args.n, seed=0)  # the same puzzles for every --seed
    L = task.gen_length
    block = args.block or (27 if L == 81 else L)
    batches = [encode_prompts(model.tokenizer, [ex["prompt"] for ex in examples[lo:lo + args.batch]])
               for lo in range(0, len(examples), args.batch)]
    base = SamplerConfig(name="masked", steps=L, gen_length=L, block_length=block, temperature=args.temperature,
                         early_exit=False)
    chosen = [v for v in variants(full=True) if not args.only or v.label in ("reference", *args.only)]
    results = compare(model, batches, base, chosen, args.repeats, seed=args.seed)
    columns = {c: [ex[c] for ex in examples] for c in ("puzzle", "solution")}
    solved, cell_scores = {}, {}
    for label, r in results.items():
        texts = decode_completions(model.tokenizer, r["completions"], model_stop_ids(model))
        solved[label] = list(task.correct(texts, **columns))
        cell_scores[label] = cells.reward(texts, **columns)
    extra = solve_rate_rows(task, examples, solved)
    for label in results:
        extra[label]["cell_accuracy"] = statistics.mean(cell_scores[label])
    rows = table(results, len(examples) * L, extra)
    if args.dump:
        Path(args.dump).write_text(json.dumps({
            "args": {k: v for k, v in vars(args).items()}, "puzzles": columns["puzzle"],
            "variants": {label: {"completions": r["completions"].tolist(), "solved": solved[label],
                                 "nfe": r["nfe"], "fed": r["fed"], "seconds": r["seconds"]}
                         for label, r in results.items()}}))
    print_table(rows, f"{args.task}: {len(examples)} {args.split} puzzles ({args.min_empty}-{args.max_empty} blanks), "
                      f"gen {L}, block {block}, {L} steps (reference), temperature {args.temperature}, batch {args.batch}, "
                      f"threads {torch.get_num_threads()}")
    return rows


def random_model(d_model: int, n_layers: int, max_seq_len: int, block_size: int | None = None):
    from ddrl.models import Denoiser, DenoiserConfig, DiffusionLM

    V = 64
    backbone = Denoiser(DenoiserConfig(vocab_size=V, d_model=d_model, n_layers=n_layers, n_heads=max(2, d_model // 64),
                                       max_seq_len=max_seq_len, block_size=block_size), seed=0)
    return DiffusionLM(backbone, mask_token_id=V - 1, pad_token_id=0, eos_token_id=1, vocab_size=V,
                       block_size=block_size, suppress_mask_logit=True).eval()


def random_prompts(batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=g)
    ids = torch.randint(2, 62, (batch, length), generator=g)
    mask = torch.arange(length)[None, :] >= (length - lengths)[:, None]  # left padding
    return ids.masked_fill(~mask, 0), mask


def bench_random(args: argparse.Namespace) -> list[dict]:
    L, W = args.gen, args.block
    model = random_model(args.d_model, args.n_layers, args.prompt + L)
    batches = [random_prompts(args.batch, args.prompt)]
    base = SamplerConfig(name="masked", steps=L, gen_length=L, block_length=W, temperature=0.0, early_exit=False)
    results = compare(model, batches, base, variants(full=False), args.repeats)
    rows = table(results, args.batch * L)
    n_params = sum(p.numel() for p in model.parameters())
    print_table(rows, f"random full-attention model ({n_params / 1e6:.2f}M params, d {args.d_model}, {args.n_layers} "
                      f"layers): prompt <= {args.prompt}, gen {L}, block {W}, {L} steps, batch {args.batch}, "
                      f"threads {torch.get_num_threads()}")
    block_model = random_model(args.d_model, args.n_layers, args.prompt + L, block_size=W)
    base_block = replace(base, name="block", block_length=None)
    block_results = compare(block_model, batches, base_block, [Variant("reference"), Variant("exact cache", "auto")],
                            args.repeats)
    block_rows = table(block_results, args.batch * L)
    print_table(block_rows, f"random block-causal model (block_size {W}), same sizes: exact block cache")
    return rows + [{**r, "variant": f"block: {r['variant']}"} for r in block_rows]


def _best_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


@torch.no_grad()
def bench_percall(args: argparse.Namespace) -> list[dict]:
    """Full calls on T tokens, and dual-cache calls: W = --block new tokens attending T - W cached keys."""
    model = random_model(args.d_model, args.n_layers, 1024)
    n_params = sum(p.numel() for p in model.parameters())
    W, repeats = args.block, max(5, args.repeats * 3)
    rows = []
    for T in (8, 16, 32, 64, 128, 256, 512, 1024):
        ids = torch.randint(2, 62, (args.batch, T))
        full = _best_time(lambda: model(ids), repeats)
        row = {"tokens_per_row": T, "full_ms": full * 1e3, "full_us_per_token": full / (args.batch * T) * 1e6,
               "full_GFLOP_per_s": 2 * n_params * args.batch * T / full / 1e9}
        if T > W:
            past = model(ids[:, :T - W], use_cache=True).past_key_values
            cached = _best_time(lambda: model(ids[:, T - W:], past_key_values=past), repeats)
            row.update({f"cached_{W}_ms": cached * 1e3, "full/cached": full / cached, "tokens_ratio": T / W})
        rows.append(row)
    print_table(rows, f"one forward call, batch {args.batch}, {n_params / 1e6:.2f}M params, "
                      f"threads {torch.get_num_threads()}; cached = {W} new tokens over T - {W} cached keys")
    return rows


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("which", choices=("sudoku", "random", "percall"))
    p.add_argument("--model", help="sudoku: model directory")
    p.add_argument("--task", default="sudoku", choices=("sudoku", "mini_sudoku"), help="sudoku: the task")
    p.add_argument("--temperature", type=float, default=0.0, help="sudoku: sampling temperature (RL uses 1.0)")
    p.add_argument("--n", type=int, default=128, help="sudoku: held-out puzzles")
    p.add_argument("--split", default="test", choices=("test", "dev"),
                   help="sudoku: the puzzles (test: the sealed split of reported numbers; dev: for choices)")
    p.add_argument("--dump", help="sudoku: write each puzzle's completion and verdict per variant to this JSON file")
    p.add_argument("--quick", action="store_true",
                   help="sudoku: a smoke run (8 puzzles, reference and dual+t0.99, one repeat)")
    p.add_argument("--min-empty", type=int, default=20, help="sudoku: blanks (the model's pretraining range)")
    p.add_argument("--max-empty", type=int, default=35)
    p.add_argument("--batch", type=int, default=None, help="rows per sampler call (sudoku 64, random/percall 8)")
    p.add_argument("--block", type=int, default=None, help="semi-AR block length (sudoku 27, random 32)")
    p.add_argument("--gen", type=int, default=256, help="random: completion length")
    p.add_argument("--prompt", type=int, default=64, help="random: longest prompt")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="sudoku: sampler generator seed (temperature > 0)")
    p.add_argument("--only", nargs="*", help="sudoku: only these variants (labels; the reference is always run)")
    p.add_argument("--json", action="store_true", help="also print the rows as one JSON object")
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.repeats = 8, 1
        args.batch = args.batch or 8
        args.only = args.only or ["dual+t0.99"]
    torch.set_num_threads(args.threads)
    if args.batch is None:
        args.batch = 64 if args.which == "sudoku" else 8
    if args.block is None and args.which != "sudoku":
        args.block = 32
    rows = {"sudoku": bench_sudoku, "random": bench_random, "percall": bench_percall}[args.which](args)
    if args.json:
        print(json.dumps({"benchmark": args.which, "args": vars(args), "rows": rows}))
    return rows


if __name__ == "__main__":
    main()
