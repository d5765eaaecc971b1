"""d1's verdict on LLaDA-8B-Instruct's own published generations, against the d1 presets' metric.

d1 publishes its baseline evaluation generations (eval/eval_baselines/*_generations.json: GSM8K,
MATH500, Countdown, Sudoku at 128/256/512 tokens, every shard). They are d1's data, so they are not
committed; this check reads them from a file made outside the repository by the fixture script,
which runs d1's own parsers for the verdicts:

    /tmp/ref-d1/bin/python tests/fixtures/make_d1_rewards.py --ref /tmp/src-d1-15 --published-out /tmp/d1_published.json.xz
    OMP_NUM_THREADS=1 .venv/bin/python bench/check_d1_generations.py /tmp/d1_published.json.xz

It prints, per task and per generation file, how many items the d1 preset scores as d1 does, the
d1 accuracy on the 256-token shard 0 (the numbers the issue quotes) and what ddrl's default task
reward would give; it exits 1 if any verdict differs.
"""

from __future__ import annotations

import json
import lzma
import re
import sys
from collections import defaultdict
from pathlib import Path

from ddrl.tasks.presets import get_preset


def columns_of(task: str, items: list[dict]) -> dict[str, list]:
    """The task's example columns from d1's recorded ground truth."""
    cols: dict[str, list] = defaultdict(list)
    for item in items:
        gt = item["ground_truth"]
        if task == "gsm8k":  # d1's float gold, written as a task writes the bare answer
            cols["answer"].append(None if gt is None else (str(int(gt)) if float(gt).is_integer() else repr(gt)))
        elif task == "math500":
            cols["answer"].append(gt)
        elif task == "countdown":
            cols["numbers"].append(gt[0])
            cols["target"].append(gt[1])
        else:
            cols["puzzle"].append(re.search(r"Sudoku puzzle: ([0-9]{16})", item["question"]).group(1))
            cols["solution"].append(gt)
    return dict(cols)


def main(path: str) -> int:
    files = json.loads(lzma.decompress(Path(path).read_bytes()))["files"]
    agree: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for name, f in sorted(files.items()):
        task, items = f["task"], f["items"]
        got = get_preset("d1", task).metric([x["generations"] for x in items], **columns_of(task, items))
        same = sum(g == x["verdict"] for g, x in zip(got, items))
        agree[task][0] += same
        agree[task][1] += len(items)
        if f["gen_length"] == 256 and f["shard"] == 0:
            acc = 100 * sum(x["verdict"] for x in items) / len(items)
            print(f"{name}: n={len(items)} d1 accuracy {acc:.1f}%, preset {100 * sum(got) / len(items):.1f}%")
    for task, (same, n) in sorted(agree.items()):
        print(f"{task}: the d1 preset gives d1's verdict on {same} of {n} published generations")
    return 0 if all(s == n for s, n in agree.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
