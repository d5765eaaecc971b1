"""Peak memory and time of one RL step: full fine-tuning vs LoRA, each without / with gradient checkpointing.

    python bench/bench_memory.py                    # CPU: a 6-layer d=256 model on 9x9 Sudoku (163 tokens)
    python bench/bench_memory.py --device cuda --d-model 1024 --layers 16
    python bench/bench_memory.py --tiny --only lora+gc   # seconds; what the test runs

Each configuration runs in its own process (peak RSS only grows), through the real trainer
(ddrl.training.trainer.Trainer.train_step, diffu-GRPO with its k3 KL, so full fine-tuning holds a
reference copy and LoRA uses the adapter-disabled base instead). Reported per configuration:

    resident MB   memory held after setup, above the bare interpreter with torch imported
                  (model, reference copy, data)
    step peak MB  the step's peak above that (activations, gradients, AdamW state, rollout)
    step s        wall time of the second step (the first allocates the optimizer state), and the
                  trainer's own timers of its rollout, reference and update phases

On the CPU memory is the process's peak RSS (getrusage); on a GPU torch.cuda.max_memory_allocated.
The model has random weights (memory and time do not depend on them). Shared machines vary a lot
in time: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = {
    "full": [],
    "full+gc": ["model.gradient_checkpointing=true"],
    "lora": ["model.lora.rank=16", "model.lora.alpha=32",
             "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"],
    "lora+gc": ["model.lora.rank=16", "model.lora.alpha=32", "model.gradient_checkpointing=true",
                "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"],
}


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_model(directory: Path, args: argparse.Namespace) -> None:
    """A randomly initialised built-in model for the task, saved like a pretrained one."""
    from ddrl.config import ModelConfig
    from ddrl.models import SymbolTokenizer, build_model
    from ddrl.tasks import get_task

    task = get_task(args.task)
    tokenizer = SymbolTokenizer(task.symbols())
    cfg = ModelConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, max_seq_len=args.max_seq_len)
    build_model(cfg, tokenizer).save_pretrained(directory)


def worker(args: argparse.Namespace) -> dict:
    """One configuration, in this process: setup, two RL steps, measurements as JSON."""
    import torch

    import peft  # noqa: F401  (imported by every configuration, so that it is part of the baseline)

    from ddrl.config import RLConfig, load_config
    from ddrl.training.trainer import Trainer

    base = rss_mb()
    overrides = [f"model.path={args.model_dir}", f"task.name={args.task}", "task.args={}", f"device={args.device}",
                 f"rollout.gen_length={args.gen_length}", f"rollout.block_length={args.gen_length}",
                 f"rollout.steps={args.sampler_steps}", "rollout.threshold=null", "rollout.cache=none",
                 f"train.prompts_per_step={args.prompts}",
                 f"train.group_size={args.group_size}", "train.num_iterations=1", "train.progress=false",
                 "train.tensorboard=false", "eval.n=0", "eval.before=false", f"output_dir={args.out}",
                 *CONFIGS[args.worker]]
    cfg = load_config(ROOT / "configs/rl/grpo_mini_sudoku.yaml", overrides, RLConfig)
    trainer = Trainer(cfg)
    cuda = trainer.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
    else:
        resident = rss_mb() - base
    trainer.train_step(1)
    start = time.perf_counter()
    metrics = trainer.train_step(2)
    if cuda:
        torch.cuda.synchronize()
    step_s = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**20 - resident if cuda else peak_rss_mb() - base - resident
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in trainer.model.parameters() if not p.requires_grad) + trainable
    return {"config": args.worker, "params_M": total / 1e6, "trainable_M": trainable / 1e6,
            "resident_MB": resident, "step_peak_MB": peak, "step_s": step_s,
            "rollout_s": metrics["time/rollout"], "update_s": metrics["time/update"],
            "ref_s": metrics.get("time/ref", 0.0)}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--task", default="sudoku", help="sudoku (9x9: 82 + 81 tokens) or mini_sudoku (17 + 16)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--prompts", type=int, default=2, help="prompt groups per step")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--sampler-steps", type=int, default=8)
    p.add_argument("--only", nargs="*", choices=list(CONFIGS), help="run only these configurations")
    p.add_argument("--tiny", action="store_true", help="a tiny model on 4x4 Sudoku (seconds)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON lines too")
    p.add_argument("--inline", action="store_true",
                   help="run the configurations in this process (a smoke test: memory is then not isolated)")
    p.add_argument("--worker", choices=list(CONFIGS), help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (1 is steadier on a shared machine; default: torch's choice)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tiny:
        args.task, args.d_model, args.layers, args.heads, args.prompts, args.group_size = "mini_sudoku", 32, 1, 2, 1, 2
        args.sampler_steps = 2
    args.gen_length = 16 if args.task == "mini_sudoku" else 81
    args.max_seq_len = 48 if args.task == "mini_sudoku" else 192
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return []
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        make_model(model_dir, args)
        for name in args.only or list(CONFIGS):
            if args.inline:
                rows.append(worker(argparse.Namespace(**{**vars(args), "worker": name, "model_dir": str(model_dir),
                                                          "out": str(Path(tmp) / name)})))
                continue
            cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--worker", name,
                   "--model-dir", str(model_dir), "--out", str(Path(tmp) / name)]
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if done.returncode != 0:
                raise RuntimeError(f"configuration {name} failed:\n{done.stderr[-3000:]}")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"One RL step (diffu-GRPO), {args.task}, d_model={args.d_model}, {args.layers} layers, "
          f"{args.prompts}x{args.group_size} rows, {args.device}")
    print("| config | params (M) | trainable (M) | resident MB | step peak MB | step s | rollout s | ref s | update s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['config']} | {r['params_M']:.2f} | {r['trainable_M']:.3f} | {r['resident_MB']:.0f} | "
              f"{r['step_peak_MB']:.0f} | {r['step_s']:.2f} | {r['rollout_s']:.2f} | {r['ref_s']:.2f} | "
              f"{r['update_s']:.2f} |")
        if args.json:
            print(json.dumps(r))
    return rows


if __name__ == "__main__":
    main()
