"""One RL step at LLaDA-8B's shape, phase by phase: rollout tokens/s, RL step time, peak memory.

    python bench/bench_8b.py                          # GPU: LLaDA-8B's shape, bf16 base + LoRA r128
    python bench/bench_8b.py --mode full --layers 8   # full fine-tuning: fp32 master weights, bf16 autocast
    python bench/bench_8b.py --cache dual             # the rollout through Fast-dLLM's dual cache
    python bench/bench_8b.py --tiny                   # small dims, runs on the CPU in seconds (the test does)

The model is ddrl's native LLaDA backbone (the path a LLaDA-8B-Instruct directory takes through
ddrl.load_model) built from LLaDA-8B-Instruct's config.json fields (d_model 4096, 32 blocks, 32
heads, MLP 12288, vocabulary 126,464; ~8.0B parameters) with random weights drawn on the device, so
nothing is downloaded. The pieces are bench/gpu/check.py's, which measures the update step's MFU and
the cache speed-up on their own; this script times the whole diffu-GRPO step (mean-field estimator,
k3 KL to the reference) on a rollout it generated:

    rollout   the masked sampler, one batched call over --prompts groups, each group drawing its
              noise on the device from its own generator (as the trainer does); a warm-up call first
    ref       the no-grad reference pass (LoRA: the adapter disabled; full fine-tuning: a frozen
              bf16 copy of the model). With one inner iteration the old pass is sg(current): none.
    update    estimator with grad -> objective -> backward per micro-batch -> AdamW step

Precision is what the recipes use: LoRA adapters in fp32 over the bf16 base; full fine-tuning with
fp32 master weights and AdamW state under bf16 autocast (bf16 weights would not learn at lr 1e-6).
One warm-up RL step runs before the timed one. Peak memory is torch.cuda.max_memory_allocated
since just before the timed rollout (so it covers the rollout and the step); the CPU has none.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def load_check():
    """bench/gpu/check.py as a module (bench/ is not a package)."""
    if "gpu_check" in sys.modules:
        return sys.modules["gpu_check"]
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu" / "check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run(args: argparse.Namespace) -> dict:
    import ddrl.estimators  # noqa: F401  (registration)
    import ddrl.objectives  # noqa: F401
    import ddrl.sampling  # noqa: F401
    from ddrl.config import LoraConfig, SamplerConfig
    from ddrl.data import completion_mask, model_stop_ids
    from ddrl.models.lora import apply_lora
    from ddrl.objectives import AggregationCounts, compute_advantages
    from ddrl.registry import ESTIMATORS, OBJECTIVES, SAMPLERS
    from ddrl.training.common import build_optimizer
    from ddrl.types import RolloutBatch

    check = load_check()
    device = torch.device(args.device)
    shape = check.TINY if args.tiny else check.LLADA_8B
    wl = check.Workload(prompts=args.prompts, group_size=args.group_size, prompt_length=args.prompt_length,
                        prompt_pad_step=max(1, args.prompt_length // 8), gen_length=args.gen_length,
                        block_length=args.block_length, steps=args.steps, micro_batch=args.micro_batch or args.group_size,
                        lora_rank=args.lora_rank, full_depths=(1, 2), repeats=1)
    lora = args.mode == "lora"
    model = check.build_llada(shape, device, torch.bfloat16 if lora else torch.float32, n_layers=args.layers)
    params = sum(p.numel() for p in model.parameters())
    ref_model = None
    if lora:
        model = apply_lora(model, LoraConfig(rank=args.lora_rank, alpha=2 * args.lora_rank,
                                             target_modules=check.LORA_TARGETS))
    else:
        ref_model = copy.deepcopy(model).to(torch.bfloat16).eval().requires_grad_(False)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(trainable, 1e-6, 0.0)
    prompt_ids, prompt_mask = check.prompts(shape, wl, device)
    sampler = SAMPLERS.get("masked")
    sampler_cfg = SamplerConfig(steps=args.steps, gen_length=wl.gen_length, block_length=wl.block_length,
                                temperature=1.0, threshold=args.threshold, cache=args.cache, early_exit=False)
    estimator, objective = ESTIMATORS.get("mean_field")(), OBJECTIVES.get("grpo")()

    def rollout(steps: int, seed: int):
        model.eval()
        with torch.no_grad(), check.autocast(device):
            out = sampler(model, prompt_ids, prompt_mask, replace(sampler_cfg, steps=steps),
                          generator=check.group_generators(wl, device, seed))
        model.train()
        return out

    def rl_step(out) -> tuple[dict, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        rewards = torch.rand(wl.rows, generator=g).to(device)
        group_ids = torch.arange(wl.prompts, device=device).repeat_interleave(wl.group_size)
        batch = RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=out.completion_ids,
                             completion_mask=completion_mask(out.completion_ids, model_stop_ids(model)),
                             group_ids=group_ids, rewards=rewards, advantages=compute_advantages(rewards, group_ids,
                                                                                                 "mean"),
                             mask_seeds=torch.tensor([7]), completions=[""] * wl.rows)
        counts = AggregationCounts(tokens=float(batch.completion_mask.sum()), sequences=float(wl.rows))
        micro = [batch.index(slice(lo, lo + wl.micro_batch)) for lo in range(0, wl.rows, wl.micro_batch)]
        ref_s, refs = check.timed(device, lambda: [reference_pass(mb) for mb in micro])
        opt.zero_grad(set_to_none=True)

        def update() -> torch.Tensor:
            total = torch.zeros((), device=device)
            for mb, ref in zip(micro, refs):
                with check.autocast(device):
                    new = estimator(model, mb, 7)
                    loss = objective(mb, new, new.detach(), ref, counts=counts).loss
                loss.backward()
                total = total + loss.detach()
            opt.step()
            return total

        update_s, loss = check.timed(device, update)
        return {"ref_s": ref_s, "update_s": update_s}, loss

    def reference_pass(mb):
        with torch.no_grad(), check.autocast(device):
            if ref_model is not None:
                return estimator(ref_model, mb, 7).detach()
            with model.disable_adapter():
                return estimator(model, mb, 7).detach()

    blocks = wl.gen_length // wl.block_length
    rl_step(rollout(blocks, 0))  # warm-up: kernels, allocator, AdamW state
    check.reset_peak(device)
    rollout_s, out = check.timed(device, lambda: rollout(args.steps, 1))
    rollout_peak = check.peak_gb(device)
    phases, loss = rl_step(out)
    peak = check.peak_gb(device)
    return {"mode": args.mode, "gc": args.gradient_checkpointing, "params_M": params / 1e6,
            "trainable_M": sum(p.numel() for p in trainable) / 1e6, "rollout_tok_s": wl.rows * wl.gen_length / rollout_s,
            "rollout_s": rollout_s, **phases, "rl_step_s": phases["ref_s"] + phases["update_s"],
            "rollout_peak_MB": None if rollout_peak is None else rollout_peak * 1e3,
            "peak_MB": None if peak is None else peak * 1e3, "rows": wl.rows, "tokens": wl.prompt_length + wl.gen_length,
            "nfe": out.nfe, "loss": float(loss)}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="small dims (CPU, seconds)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--mode", choices=["lora", "full"], default="lora")
    p.add_argument("--layers", type=int, default=None, help="depth (default 32; fewer keeps the widths)")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--lora-rank", type=int, default=128)
    p.add_argument("--prompts", type=int, default=2, help="prompt groups per step (one batched sampler call)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-length", type=int, default=200)
    p.add_argument("--gen-length", type=int, default=256)
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument("--steps", type=int, default=128, help="sampler model calls")
    p.add_argument("--threshold", type=float, default=None, help="confidence-threshold parallel decoding")
    p.add_argument("--cache", default="none", help="block KV cache: none | prefix | dual")
    p.add_argument("--micro-batch", type=int, default=None, help="rows per forward/backward (default: one group)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (1 is steadier on a shared machine; default: torch's choice)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tiny:
        args.prompt_length, args.gen_length, args.block_length, args.steps = 8, 16, 8, 8
        args.group_size, args.lora_rank = 4, 4
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    row = run(args)
    peak = "n/a" if row["peak_MB"] is None else f"{row['peak_MB']:.0f}"
    print(f"LLaDA-8B-shaped RL step ({'tiny dims' if args.tiny else 'full dims'}, {args.device}, "
          f"{row['params_M']:.2f}M params, {row['rows']} rows x {row['tokens']} tokens, cache {args.cache})")
    print("| mode | grad ckpt | trainable (M) | rollout tok/s | rollout s | ref s | update s | RL step s | peak MB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {row['mode']} | {row['gc']} | {row['trainable_M']:.2f} | {row['rollout_tok_s']:.1f} | "
          f"{row['rollout_s']:.2f} | {row['ref_s']:.2f} | {row['update_s']:.2f} | {row['rl_step_s']:.2f} | {peak} |")
    return row


if __name__ == "__main__":
    main()
