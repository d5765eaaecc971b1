"""LLaDA-8B-shaped throughput and memory: rollout tokens/s, RL step time, peak memory.

    python bench/bench_8b.py                       # GPU: random weights of LLaDA-8B's shape, bf16, LoRA
    python bench/bench_8b.py --mode full --gradient-checkpointing
    python bench/bench_8b.py --layers 4            # the same widths at reduced depth
    python bench/bench_8b.py --tiny                # small dims, runs on the CPU in seconds (the test does)

The model is the built-in Denoiser at LLaDA-8B-Instruct's dimensions (hidden 4096, 32 layers,
32 heads, SwiGLU 12288, vocabulary 126464; ~8.0B parameters) with random weights, so nothing is
downloaded; LLaDA's remote code has the same matrix shapes, so time and memory carry over up to
its kernels. One RL step is the trainer's phases on a synthetic rollout batch (random prompts,
rewards), with diffu-GRPO (mean-field estimator, k3 KL to the reference):

    rollout   the masked sampler (LLaDA semi-AR low-confidence, or --threshold / --cache)
    old, ref  no-grad estimator passes (ref = adapter disabled under LoRA; full fine-tuning keeps a
              bf16 copy of the model as reference, as the trainer does)
    update    estimator with grad -> objective -> backward -> AdamW step

Peak memory is torch.cuda.max_memory_allocated on a GPU, the process's peak RSS on the CPU.
"""

from __future__ import annotations

import argparse
import copy
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LLADA_8B = dict(vocab_size=126464, d_model=4096, n_layers=32, n_heads=32, ffn_hidden=12288, mask_token_id=126336)
TINY = dict(vocab_size=512, d_model=64, n_layers=2, n_heads=2, ffn_hidden=128, mask_token_id=511)


def build(dims: dict, layers: int | None, seq: int, device: torch.device, dtype: torch.dtype):
    """The built-in Denoiser at `dims`, random N(0, 0.02) weights drawn on `device` (drawing 8B
    parameters from a CPU generator, as Denoiser.reset_parameters does, takes minutes)."""
    from ddrl.models import DiffusionLM
    from ddrl.models.transformer import Denoiser, DenoiserConfig

    class RandomDenoiser(Denoiser):
        def reset_parameters(self, seed: int = 0) -> None:  # filled below, on the device
            pass

    cfg = DenoiserConfig(vocab_size=dims["vocab_size"], d_model=dims["d_model"], n_layers=layers or dims["n_layers"],
                         n_heads=dims["n_heads"], ffn_hidden=dims["ffn_hidden"], max_seq_len=seq)
    with torch.device("meta"):
        backbone = RandomDenoiser(cfg)
    backbone = backbone.to_empty(device=device).to(dtype)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in backbone.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, cfg.init_std, generator=g)
    return DiffusionLM(backbone, None, mask_token_id=dims["mask_token_id"], vocab_size=dims["vocab_size"],
                       eos_token_id=dims["vocab_size"] - 2, pad_token_id=dims["vocab_size"] - 3, family="llada")


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args: argparse.Namespace) -> dict:
    import ddrl.estimators  # noqa: F401  (registration)
    import ddrl.objectives  # noqa: F401
    import ddrl.sampling  # noqa: F401
    from ddrl.config import LoraConfig, SamplerConfig
    from ddrl.data import completion_mask, model_stop_ids
    from ddrl.objectives import AggregationCounts, compute_advantages
    from ddrl.registry import ESTIMATORS, OBJECTIVES, SAMPLERS
    from ddrl.types import RolloutBatch

    device = torch.device(args.device)
    dims = TINY if args.tiny else LLADA_8B
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    P, L, G, n_prompts = args.prompt_length, args.gen_length, args.group_size, args.prompts
    B = G * n_prompts
    model = build(dims, args.layers, P + L, device, dtype)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    params = sum(p.numel() for p in model.parameters())
    ref_model = None
    if args.mode == "lora":
        from ddrl.models.lora import apply_lora

        model = apply_lora(model, LoraConfig(rank=args.lora_rank, alpha=2 * args.lora_rank,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"]))
    else:
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(0, dims["vocab_size"] - 8, (n_prompts, P), generator=g).repeat_interleave(G, 0)
    prompt_ids, prompt_mask = prompt_ids.to(device), torch.ones(B, P, dtype=torch.bool, device=device)

    # rollout
    sampler_cfg = SamplerConfig(steps=args.steps, gen_length=L, block_length=args.block_length, temperature=1.0,
                                threshold=args.threshold, cache=args.cache, early_exit=False)
    model.eval()
    sync(device)
    start = time.perf_counter()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        out = SAMPLERS.get("masked")(model, prompt_ids, prompt_mask, sampler_cfg,
                                     generator=torch.Generator().manual_seed(1))
    sync(device)
    rollout_s = time.perf_counter() - start
    model.train()

    # one RL step on the rollout
    estimator, objective = ESTIMATORS.get("mean_field")(), OBJECTIVES.get("grpo")()
    rewards = torch.rand(B, generator=g).to(device)
    group_ids = torch.arange(n_prompts, device=device).repeat_interleave(G)
    batch = RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=out.completion_ids,
                         completion_mask=completion_mask(out.completion_ids, model_stop_ids(model)), group_ids=group_ids,
                         rewards=rewards, advantages=compute_advantages(rewards, group_ids, "mean"),
                         mask_seeds=torch.tensor([7]), completions=[""] * B, trajectory=None)
    counts = AggregationCounts(tokens=float(batch.completion_mask.sum()), sequences=float(B))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    start = time.perf_counter()
    rows = args.micro_batch or B
    opt.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        for lo in range(0, B, rows):
            mb = batch.index(slice(lo, lo + rows))
            with torch.no_grad():
                if ref_model is not None:
                    ref = estimator(ref_model, mb, 7).detach()
                else:
                    with model.disable_adapter():
                        ref = estimator(model, mb, 7).detach()
            new = estimator(model, mb, 7)
            loss = objective(mb, new, new.detach(), ref, counts=counts).loss
            loss.backward()
    opt.step()
    sync(device)
    step_s = time.perf_counter() - start
    return {"mode": args.mode, "gc": args.gradient_checkpointing, "params_M": params / 1e6,
            "trainable_M": trainable / 1e6, "rollout_tok_s": B * L / rollout_s, "rollout_s": rollout_s,
            "rl_step_s": step_s, "peak_MB": peak_memory_mb(device), "rows": B, "tokens": P + L,
            "nfe": out.nfe, "loss": float(loss.detach())}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="small dims (CPU, seconds)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--mode", choices=["lora", "full"], default="lora")
    p.add_argument("--layers", type=int, default=None, help="depth (default 32; fewer keeps the widths)")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--prompts", type=int, default=1, help="prompt groups per step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-length", type=int, default=128)
    p.add_argument("--gen-length", type=int, default=256)
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument("--steps", type=int, default=128, help="sampler model calls")
    p.add_argument("--threshold", type=float, default=None, help="confidence-threshold parallel decoding")
    p.add_argument("--cache", default="none", help="block KV cache: none | prefix | dual")
    p.add_argument("--micro-batch", type=int, default=None, help="rows per forward/backward (default: all)")
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
    print(f"LLaDA-8B-shaped bench ({'tiny dims' if args.tiny else 'full dims'}, {args.device}, "
          f"{row['params_M']:.2f}M params, {row['rows']} rows x {row['tokens']} tokens)")
    print("| mode | grad ckpt | trainable (M) | rollout tok/s | rollout s | RL step s | peak MB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {row['mode']} | {row['gc']} | {row['trainable_M']:.2f} | {row['rollout_tok_s']:.1f} | "
          f"{row['rollout_s']:.2f} | {row['rl_step_s']:.2f} | {row['peak_MB']:.0f} |")
    return row


if __name__ == "__main__":
    main()
