"""The 9x9 fast path at two commits, puzzle by puzzle (issue 23, item 8).

Runs the masked sampler's reference and dual-cache + threshold variants on a fixed puzzle file with
whatever ddrl is first on PYTHONPATH (it uses only APIs that b13b987 already had), dumps every
puzzle's completion, and compares two dumps: identical tokens per variant, and each variant's solve
rate against the reference with a paired 95% interval (ddrl/stats.py, graded by this tree).

    # the puzzles, from this tree's sealed test split
    python bench/fastpath_across_commits.py puzzles --n 512 --out puzzles.json
    # the same puzzles at another commit (git worktree add /tmp/old-<sha> <sha>)
    PYTHONPATH=/tmp/old-<sha> python bench/fastpath_across_commits.py run --puzzles puzzles.json \\
        --model /tmp/old-<sha>/checkpoints/sudoku-masked --out old.json
    PYTHONPATH=. python bench/fastpath_across_commits.py run --puzzles puzzles.json --out new.json
    python bench/fastpath_across_commits.py compare --puzzles puzzles.json old.json new.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

VARIANTS = {"reference": ("none", None), "dual": ("dual", None), "t0.95": ("none", 0.95),
            "dual+t0.99": ("dual", 0.99), "dual+t0.95": ("dual", 0.95), "dual+t0.9": ("dual", 0.9)}
MODEL = Path(__file__).resolve().parents[1] / "checkpoints" / "sudoku-masked"


def puzzles(a: argparse.Namespace) -> None:
    from ddrl.tasks import get_task

    task = get_task("sudoku", min_empty=a.min_empty, max_empty=a.max_empty)
    exs = task.examples(a.split, n=a.n, seed=0)
    Path(a.out).write_text(json.dumps([{k: e[k] for k in ("prompt", "puzzle", "solution")} for e in exs]))


def run(a: argparse.Namespace) -> None:
    import torch

    from ddrl.config import SamplerConfig
    from ddrl.data import encode_prompts
    from ddrl.models import load_model
    from ddrl.registry import SAMPLERS

    torch.set_num_threads(a.threads)
    model = load_model(a.model).eval()
    exs = json.loads(Path(a.puzzles).read_text())
    batches = [encode_prompts(model.tokenizer, [e["prompt"] for e in exs[lo:lo + a.batch]])
               for lo in range(0, len(exs), a.batch)]
    base = SamplerConfig(name="masked", steps=81, gen_length=81, block_length=27, temperature=0.0,
                         early_exit=a.early_exit)
    out = {"code": sys.modules["ddrl"].__file__, "n": len(exs), "variants": {}}
    for label in a.variants:
        cache, threshold = VARIANTS[label]
        cfg = replace(base, cache=cache, threshold=threshold)
        comps, nfe, fed, start = [], 0, 0, time.perf_counter()
        for i, (ids, mask) in enumerate(batches):
            o = SAMPLERS.get("masked")(model, ids, mask, cfg, generator=torch.Generator().manual_seed(i))
            comps += o.completion_ids.tolist()
            nfe, fed = nfe + o.nfe, fed + (o.forward_tokens or 0)
        out["variants"][label] = {"completions": comps, "nfe": nfe, "fed": fed,
                                  "seconds": time.perf_counter() - start}
        print(f"{label}: {out['variants'][label]['seconds']:.1f}s, {nfe} calls, {fed} fed tokens", flush=True)
    Path(a.out).write_text(json.dumps(out))


def compare(a: argparse.Namespace) -> None:
    import torch

    from ddrl.data import decode_completions
    from ddrl.stats import gain_estimate, rate_estimate
    from ddrl.models import load_model
    from ddrl.tasks import get_task

    task = get_task("sudoku", min_empty=a.min_empty, max_empty=a.max_empty)
    tokenizer = load_model(MODEL).tokenizer
    exs = json.loads(Path(a.puzzles).read_text())
    columns = {c: [e[c] for e in exs] for c in ("puzzle", "solution")}
    dumps = [json.loads(Path(f).read_text()) for f in a.dumps]
    for name, d in zip(a.dumps, dumps):
        solved = {k: task.correct(decode_completions(tokenizer, torch.tensor(v["completions"])), **columns)
                  for k, v in d["variants"].items()}
        ref = [float(s) for s in solved["reference"]]
        print(f"\n{name} ({d['code']}), n={len(ref)}")
        for label, s in solved.items():
            line = f"  {label:12s} solved {rate_estimate(sum(s), len(s)).format()}"
            if label != "reference":
                gain = gain_estimate(ref, [float(x) for x in s])
                line += f"; vs reference {gain.format(unit='pt', signed=True)}"
            print(line)
    if len(dumps) == 2:
        first, second = (d["variants"] for d in dumps)
        for label in first.keys() & second.keys():
            same = sum(x == y for x, y in zip(first[label]["completions"], second[label]["completions"]))
            print(f"identical tokens, {label}: {same}/{len(first[label]['completions'])} puzzles")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("puzzles", "run", "compare"):
        s = sub.add_parser(name)
        s.add_argument("--min-empty", type=int, default=12)
        s.add_argument("--max-empty", type=int, default=16)
        if name == "puzzles":
            s.add_argument("--n", type=int, default=512)
            s.add_argument("--split", default="test", choices=("test", "dev"))
            s.add_argument("--out", required=True)
        elif name == "run":
            s.add_argument("--puzzles", required=True)
            s.add_argument("--model", default=str(MODEL))
            s.add_argument("--out", required=True)
            s.add_argument("--batch", type=int, default=64)
            s.add_argument("--threads", type=int, default=1)
            s.add_argument("--early-exit", action="store_true")
            s.add_argument("--variants", nargs="*", default=["reference", "dual+t0.99", "dual+t0.95", "dual+t0.9"],
                           choices=list(VARIANTS))
        else:
            s.add_argument("--puzzles", required=True)
            s.add_argument("dumps", nargs="+")
    a = p.parse_args(argv)
    {"puzzles": puzzles, "run": run, "compare": compare}[a.cmd](a)


if __name__ == "__main__":
    main()
