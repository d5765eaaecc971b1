"""Pretraining speed of the shipped tiny configs: optimizer steps per second on this machine.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_pretrain.py --steps 40
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--configs", default="mini_sudoku_masked,digits_uniform")
    args = p.parse_args()
    from ddrl.training.logging import read_metrics
    from ddrl.training.pretrain import pretrain

    for name in args.configs.split(","):
        with tempfile.TemporaryDirectory() as out:
            start = time.perf_counter()
            pretrain(ROOT / f"configs/pretrain/{name}.yaml",
                     [f"train.steps={args.steps}", f"output_dir={out}", "train.progress=false",
                      f"train.eval_every={10 * args.steps}", "data.n_train=512", "data.n_heldout=64"])
            rows = read_metrics(Path(out) / "metrics.jsonl")
            loop = rows[-1]["time/elapsed"]
            print(json.dumps({"config": name, "steps": args.steps, "steps_per_s": round(args.steps / loop, 2),
                              "total_s_with_data_and_setup": round(time.perf_counter() - start, 1)}))


if __name__ == "__main__":
    main()
