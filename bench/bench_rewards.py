"""Throughput of the code reward: HumanEval completions scored per second.

Scores the 164 canonical HumanEval solutions (as continuations of their prompts) with
code_reward, each in its own sandboxed process, for several pool sizes, and reports the cost of
one empty sandboxed run next to one plain subprocess (the sandbox's own overhead).

    python bench/bench_rewards.py [--n 164] [--workers 1 2 4] [--json]

Every gold solution must score 1.0; the script exits non-zero otherwise. Step times on shared
machines vary a lot between runs: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ddrl.rewards import sandbox
from ddrl.rewards.code import code_reward
from ddrl.tasks.code_tasks import HumanEvalTask


def bench_code_reward(n: int, workers: int, allow_unsandboxed: bool) -> dict[str, float]:
    examples = HumanEvalTask(format="completion").test_examples(n)
    completions = [ex["canonical_solution"] for ex in examples]
    start = time.perf_counter()
    scores = code_reward(
        completions,
        tests=[ex["tests"] for ex in examples],
        entry_point=[ex["entry_point"] for ex in examples],
        code_prompt=[ex["code_prompt"] for ex in examples],
        workers=workers,
        allow_unsandboxed=allow_unsandboxed,
    )
    seconds = time.perf_counter() - start
    return {"n": len(completions), "workers": workers, "seconds": seconds,
            "per_second": len(completions) / seconds, "mean_score": sum(scores) / len(scores)}  # fmt: skip


def bench_empty_run(repeats: int) -> dict[str, float]:
    """Median seconds of one `pass` program: sandboxed vs a plain subprocess with the same limits."""

    def median(fn) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    kwargs = dict(timeout_s=5.0, memory_mb=512, stdin=None, max_processes=64, max_output_bytes=65536)
    out = {"plain_s": median(lambda: sandbox._run("pass", sandbox=None, **kwargs))}
    if sandbox.sandbox_available():
        out["sandboxed_s"] = median(lambda: sandbox.run_in_sandbox("pass"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=164, help="HumanEval problems to score (max 164)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()

    available = sandbox.sandbox_available()
    print(f"sandbox: {sandbox.sandbox_reason()}", file=sys.stderr)
    rows = [bench_code_reward(args.n, w, allow_unsandboxed=not available) for w in args.workers]
    empty = bench_empty_run(repeats=20)
    result = {"sandboxed": available, "cpus": os.cpu_count(), "code_reward": rows, "empty_run": empty}
    if args.json:
        print(json.dumps(result))
    else:
        mode = "sandboxed (bwrap)" if available else "UNSANDBOXED (no bwrap here)"
        print(f"code_reward on HumanEval canonical solutions, {mode}, {os.cpu_count()} CPUs")
        print(f"{'workers':>8} {'n':>5} {'seconds':>8} {'compl/s':>8} {'mean score':>10}")
        for r in rows:
            print(f"{r['workers']:>8} {r['n']:>5} {r['seconds']:>8.2f} {r['per_second']:>8.1f} {r['mean_score']:>10.3f}")
        line = f"one empty run: plain subprocess {empty['plain_s'] * 1e3:.0f} ms"
        if "sandboxed_s" in empty:
            line += f", sandboxed {empty['sandboxed_s'] * 1e3:.0f} ms"
        print(line)
    if any(r["mean_score"] != 1.0 for r in rows):
        sys.exit("some canonical solutions did not score 1.0")


if __name__ == "__main__":
    main()
