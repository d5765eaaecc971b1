"""The fast path on each real family: how many tokens the KV cache saves, and whether tokens change.

For every tiny official-format checkpoint under tests/fixtures/<family>/model (LLaDA, MMaDA, Dream,
SDAR), loaded natively by ddrl.load_model, the same left-padded prompts are decoded greedily with
rollout.cache = none (the reference) and with each cache the family supports:

  full-attention families (LLaDA, MMaDA, Dream): prefix and dual (Fast-dLLM, approximate);
  block family (SDAR): auto (the exact cache of the prompt and finished blocks).

`fed_vs_none` = rows x tokens fed to the model (SampleOutput.forward_tokens) relative to cache=none;
`agree` = fraction of completion tokens equal to cache=none's. Tiny random models, so only the
ratios mean anything (the cost of a call on a CPU is not its cost on a GPU).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_families.py [--gen 64] [--block 16] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ddrl  # noqa: E402
from ddrl.config import SamplerConfig  # noqa: E402
from ddrl.registry import SAMPLERS  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"


def prompts(model, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """n left-padded prompts of different lengths (chat-templated, as rollouts are)."""
    texts = ["hello", "what is two plus two", "a b c", "count to five please now"][:n]
    rows = [model.tokenizer.encode_prompt(t) for t in texts]
    P = max(len(r) for r in rows)
    pad = model.pad_token_id if model.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (P - len(r)) + r for r in rows])
    mask = torch.tensor([[False] * (P - len(r)) + [True] * len(r) for r in rows])
    return ids, mask


def run(family: str, gen: int, block: int) -> list[dict]:
    model = ddrl.load_model(FIXTURES / family / "model").eval()
    ids, mask = prompts(model)
    block_model = model.block_size is not None
    name, block_length = ("block", None) if block_model else ("masked", block)
    steps = gen  # one token per step: the reference's cost, the cache's best case
    caches = ["none", "auto"] if block_model else ["none", "prefix", "dual"]
    rows, ref = [], None
    for cache in caches:
        cfg = SamplerConfig(name=name, steps=steps, gen_length=gen, block_length=block_length, temperature=0.0,
                            cache=cache, early_exit=False)
        start = time.perf_counter()
        with torch.no_grad():
            out = SAMPLERS.get(name)(model, ids, mask, cfg, generator=None)
        seconds = time.perf_counter() - start
        ref = out if ref is None else ref
        rows.append({"family": family, "cache": cache, "model_calls": out.nfe,
                     "fed_vs_none": round(out.forward_tokens / ref.forward_tokens, 3),
                     "agree": round((out.completion_ids == ref.completion_ids).float().mean().item(), 3),
                     "seconds": round(seconds, 2)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = []
    for family in ("llada", "mmada", "dream", "sdar"):
        if (FIXTURES / family / "model" / "config.json").is_file():
            results += run(family, args.gen, args.block)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    keys = list(results[0])
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in results:
        print("| " + " | ".join(str(r[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()
