"""Peak memory and time of one RL step (full fine-tuning vs LoRA, each without / with gradient
checkpointing), and of the likelihood estimators at a realistic vocabulary (chunked LM head vs logits).

    python bench/bench_memory.py                    # CPU: a 6-layer d=256 model on 9x9 Sudoku (163 tokens)
    python bench/bench_memory.py --device cuda --d-model 1024 --layers 16
    python bench/bench_memory.py --tiny --only lora+gc   # seconds; what the test runs
    python bench/bench_memory.py --estimator        # V = 32,000 and 126,464: old (logits) vs new (chunked head)

**--estimator.** One estimator call plus its backward on a built-in model with the vocabulary of a
real LLM (32,000: LLaMA/Mistral; 126,464: LLaDA-8B), a prompt of --prompt-len and a completion of
--completion-len tokens, once through the unfused logits path (DiffusionLM.fused_logprobs = False:
the head over every completion position, a float32 log-softmax kept for backward, as before) and
once through the chunked head (ddrl.ops.logprobs). Memory is the peak of the tensors the call
and its backward allocate (parameter gradients included): on the CPU by tensor accounting
(LiveBytes), on a GPU by torch.cuda.max_memory_allocated; divided by the rows the estimator sends
through the model (copies x sequences). The trunk is small on purpose (its activations per row do
not depend on V), so the numbers isolate the vocabulary term that the issue measured at ~130 MB
per row at LLaDA-8B's vocabulary. Time is one call + backward without the accounting.

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
import weakref

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


# --------------------------------------------------------------------------------------------
# --estimator: peak memory per row of one estimator call + backward, logits path vs chunked head
# --------------------------------------------------------------------------------------------

ESTIMATOR_PATHS = ("old", "new")  # old: the logits path (fused_logprobs=False); new: the chunked head


class LiveBytes:
    """CPU tensor accounting: the peak bytes of tensor storage alive at once among the storages that
    ops allocate inside `with LiveBytes():` (forward and backward; parameters made before are not
    counted). A TorchDispatchMode sees every allocation; a finalizer on each storage sees it freed.
    Peak RSS would not do: the allocator keeps freed medium-sized blocks, so a chunked computation's
    pieces look resident long after they are gone."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        owner = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (tuple, list)) else [out]:
                    if isinstance(t, torch.Tensor):
                        owner.track(t.untyped_storage())
                return out

        self.mode, self.live, self.peak, self.alive = Mode(), 0, 0, set()

    def track(self, storage: torch.UntypedStorage) -> None:
        key, n = storage.data_ptr(), storage.nbytes()
        if n == 0 or key in self.alive:
            return
        self.alive.add(key)
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self.release, key, n)

    def release(self, key: int, n: int) -> None:
        self.alive.discard(key)
        self.live -= n

    def __enter__(self) -> "LiveBytes":
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.mode.__exit__(*exc)


def estimator_setup(args: argparse.Namespace, vocab: int, fused: bool) -> tuple:
    """A built-in model with `vocab` classes (random weights) and a batch of args.rows sequences."""
    import ddrl.estimators  # noqa: F401  (registers the estimators)
    from ddrl.models.diffusion_lm import DiffusionLM
    from ddrl.models.transformer import Denoiser, DenoiserConfig
    from ddrl.types import RolloutBatch

    device = torch.device(args.device)
    cfg = DenoiserConfig(vocab_size=vocab, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                         max_seq_len=args.prompt_len + args.completion_len)
    model = DiffusionLM(Denoiser(cfg, seed=0), mask_token_id=vocab - 1, suppress_mask_logit=True).to(device).train()
    model.fused_logprobs = fused
    g = torch.Generator().manual_seed(0)
    B, P, L = args.rows, args.prompt_len, args.completion_len
    on = lambda t: t.to(device)  # noqa: E731
    batch = RolloutBatch(
        prompt_ids=on(torch.randint(0, vocab - 1, (B, P), generator=g)),
        prompt_mask=on(torch.ones(B, P, dtype=torch.bool)),
        completion_ids=on(torch.randint(0, vocab - 1, (B, L), generator=g)),
        completion_mask=on(torch.ones(B, L, dtype=torch.bool)), group_ids=on(torch.zeros(B, dtype=torch.long)),
        rewards=on(torch.zeros(B)), advantages=on(torch.ones(B)), mask_seeds=torch.tensor([1]))
    return model, batch


def estimator_step(model, batch, estimator) -> None:
    """One estimator call and the backward of everything it returns with a gradient."""
    out = estimator(model, batch, seed=0)
    loss = sum(t.float().sum() for t in (out.token_logp, out.seq_logp, *out.extras.values())
               if isinstance(t, torch.Tensor) and t.requires_grad)
    loss.backward()


def estimator_run(args: argparse.Namespace, name: str, vocab: int, path: str) -> dict:
    """One (estimator, vocabulary, path): a timed call + backward, then one under memory accounting."""
    from ddrl.registry import ESTIMATORS

    model, batch = estimator_setup(args, vocab, fused=path == "new")
    rows: list[int] = []
    model.register_forward_pre_hook(lambda _m, inputs: rows.append(inputs[0].shape[0]))
    estimator = ESTIMATORS.get(name)()
    cuda = batch.completion_ids.is_cuda
    if cuda:
        estimator_step(model, batch, estimator)  # warm-up (kernels, allocator)
        torch.cuda.synchronize()
    rows.clear()
    start = time.perf_counter()
    estimator_step(model, batch, estimator)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    n_rows = sum(rows)  # forward rows of one call (copies x sequences)
    model.zero_grad(set_to_none=True)  # parameter gradients are part of the call's memory
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        estimator_step(model, batch, estimator)
        peak = torch.cuda.max_memory_allocated() - before
    else:
        with LiveBytes() as live:
            estimator_step(model, batch, estimator)
        peak = live.peak
    return {"estimator": name, "vocab": vocab, "path": path, "rows": n_rows, "peak_MB": peak / 2**20,
            "MB_per_row": peak / 2**20 / max(1, n_rows), "seconds": seconds}


def estimator_main(args: argparse.Namespace) -> list[dict]:
    rows = [estimator_run(args, name, vocab, path)
            for name in args.estimators for vocab in args.vocab for path in ESTIMATOR_PATHS]
    print(f"One estimator call + backward, built-in model d_model={args.d_model}, {args.layers} layers, "
          f"{args.rows} sequences of {args.prompt_len} + {args.completion_len} tokens, {args.device}; "
          f"old = logits path, new = chunked LM head; peak memory allocated by the call")
    print("| estimator | V | rows | old MB/row | new MB/row | lower by | old s | new s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for old, new in zip(rows[::2], rows[1::2]):
        ratio = old["MB_per_row"] / max(new["MB_per_row"], 1e-9)
        print(f"| {old['estimator']} | {old['vocab']:,} | {old['rows']} | {old['MB_per_row']:.1f} | "
              f"{new['MB_per_row']:.1f} | {ratio:.1f}x | {old['seconds']:.2f} | {new['seconds']:.2f} |")
    if args.json:
        for r in rows:
            print(json.dumps(r))
    return rows


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
    e = p.add_argument_group("--estimator: estimator memory at a realistic vocabulary")
    e.add_argument("--estimator", action="store_true", help="measure the estimators instead of an RL step")
    e.add_argument("--estimators", nargs="+", default=["mean_field", "spg"],
                   help="registered estimators (default: d1's, and SPG/StableDRL's with 2 masked copies)")
    e.add_argument("--vocab", nargs="+", type=int, default=[32_000, 126_464], help="vocabulary sizes")
    e.add_argument("--rows", type=int, default=8, help="sequences in the batch (spg sends 2 masked copies of each)")
    e.add_argument("--prompt-len", type=int, default=64)
    e.add_argument("--completion-len", type=int, default=256)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.estimator and args.d_model == p.get_default("d_model") and args.layers == p.get_default("layers"):
        args.d_model, args.layers = 64, 2  # a small trunk: the vocabulary term is what is measured
    if args.tiny:
        args.task, args.d_model, args.layers, args.heads, args.prompts, args.group_size = "mini_sudoku", 32, 1, 2, 1, 2
        args.sampler_steps = 2
        args.vocab, args.rows, args.prompt_len, args.completion_len = [2_000], 2, 8, 32
    args.gen_length = 16 if args.task == "mini_sudoku" else 81
    args.max_seq_len = 48 if args.task == "mini_sudoku" else 192
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse(argv)
    if args.estimator:
        return estimator_main(args)
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
