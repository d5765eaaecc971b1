"""The GPU check: LLaDA-8B-shaped rollouts and update steps on one GPU, in at most 8 minutes.

    bash bench/gpu/check.sh [--out DIR]        # on one H200 (141 GB); writes DIR/report.json + report.md
    bash bench/gpu/check.sh --tiny             # the same code paths at a tiny shape on the CPU, in seconds

What it measures, in this order (each section is written to the report as soon as it ends, so a run
stopped by its time limit still leaves every finished number):

  matmul    the peak bf16 matrix-multiply rate of this device (one big square matmul, median of
            several, after warm-up): the denominator of every MFU below.
  rollout   ddrl's masked sampler on LLaDA's native backbone (ddrl.models.native.llada, the path a
            real LLaDA checkpoint takes) with random bf16 weights: the reference (rollout.cache=none)
            against Fast-dLLM's dual cache at equal steps, one batched call over several prompt
            groups with one device generator per group (ddrl.processes.draws.RowGenerators), each
            variant warmed up first (one step per block), peak memory reset just before the timed
            call. A random model is never confident, so threshold decoding cannot fire here: its
            speed-up stays a CPU measurement on the trained built-in models (bench/RESULTS.md).
  lora      one update step (d1's mean-field estimator with grad -> diffu-GRPO loss -> backward ->
            AdamW) with LoRA rank 128 on every linear layer of all 32 blocks, bf16 base, fp32
            adapters, bf16 autocast: step time, peak memory, MFU.
  full      the same step with full fine-tuning: fp32 master weights and AdamW state (~16 bytes per
            parameter), bf16 compute through FSDP2 on one GPU (a 1-process nccl group,
            MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)). 32 blocks need ~128 GB before
            activations, so it runs at two reduced depths and reports per-layer figures (the
            difference between the depths) and their projection to 32 blocks. It also checks that
            one AdamW step at lr 1e-6 moves the fp32 master weights (it would not in bf16).
  offload   the full step at the larger reduced depth through ddrl's own sharding with
            dist.cpu_offload (FSDP2's CPUOffloadPolicy: fp32 master, gradients and AdamW state in
            host memory, the optimizer step on the CPU): how full fine-tuning of 8B fits one H200.
            It clips the gradients as the trainer does (train.max_grad_norm: clip_grad_norm_ and
            full_tensor on the host-memory gradients) in the trainer's process group for offload
            (cpu:gloo,cuda:nccl, ddrl.training.distributed.process_group_backend).
            32 blocks would hold ~128 GB of host memory, about all the lent machine has.
  memory    the measured peaks of the LoRA and offload steps against ddrl.training.memory's
            estimate of the same setting (held state + the update phase), as a ratio.

With --rehearsal FILE (the rehearsal.json of `ddrl train configs/paper/diffu_grpo_llada8b.yaml --rehearse
--world-size 1` with rehearsal_overrides(): the lora step's setting, rehearsed on fake tensors on any CPU)
it prints the measured peak and step time beside the rehearsal's prediction (issue 33).

A section whose ddrl code is not in this tree (dist.cpu_offload, ddrl.training.memory) is reported
as "skipped: ..." and the others run. Every section builds what it needs inside its guard, the
model included, so one failure (an import, out of memory) costs that section only.

MFU = model FLOPs / (seconds x the measured matmul peak). Model FLOPs count the weight matmuls: the
transformer blocks' linear layers for every token fed, the LM head for every scored (completion)
position; 2 N per token for a forward, 4 N for a LoRA step (no weight gradients for the frozen
weights), 6 N for a full step; embeddings (a lookup), attention's T^2 term, the adapters' own small
matmuls and activation recomputation are not counted, so the MFU is a lower bound.

"8B-shaped" is LLaDA-8B-Instruct's config.json (d_model 4096, 32 heads, 32 blocks, MLP 12288,
vocabulary 126,464): the same fields the native loader reads, random weights, nothing downloaded.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import socket
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SECTIONS = ("matmul", "rollout", "lora", "full", "offload", "memory")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out"]  # LLaDA's names


# --------------------------------------------------------------------------------------------
# What is measured: the model's shape and the workload
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """A LLaDA config.json's sizes (the authors' field names are written by `llada_fields`)."""

    d_model: int
    n_heads: int
    n_layers: int
    mlp_hidden_size: int
    vocab_size: int
    mask_token_id: int
    eos_token_id: int


LLADA_8B = Shape(d_model=4096, n_heads=32, n_layers=32, mlp_hidden_size=12288, vocab_size=126464,
                 mask_token_id=126336, eos_token_id=126081)
TINY = Shape(d_model=32, n_heads=2, n_layers=2, mlp_hidden_size=64, vocab_size=256, mask_token_id=250,
             eos_token_id=251)


@dataclass(frozen=True)
class Workload:
    prompts: int  # prompt groups in one rollout call and one update step
    group_size: int  # completions per prompt (G)
    prompt_length: int  # widest prompt; group g is left-padded by g * prompt_pad_step tokens
    prompt_pad_step: int
    gen_length: int
    block_length: int
    steps: int  # sampler model calls (equal for every cache variant)
    micro_batch: int  # rows per forward/backward of the update step
    lora_rank: int
    full_depths: tuple[int, int]  # the two reduced depths of the full fine-tuning step
    repeats: int  # timed update steps (median)
    lr: float = 1e-6  # the paper recipes' learning rate: what bf16 weights cannot absorb
    max_grad_norm: float = 1.0  # the offload step clips as the recipes do (train.max_grad_norm)

    @property
    def rows(self) -> int:
        return self.prompts * self.group_size


# d1's setting at 8B (prompt ~200, 256 generated in blocks of 32, 128 steps, G=8), two groups per call.
GPU_WORKLOAD = Workload(prompts=2, group_size=8, prompt_length=200, prompt_pad_step=24, gen_length=256,
                        block_length=32, steps=128, micro_batch=8, lora_rank=128, full_depths=(4, 8), repeats=3)
TINY_WORKLOAD = Workload(prompts=2, group_size=2, prompt_length=8, prompt_pad_step=2, gen_length=16, block_length=8,
                         steps=8, micro_batch=2, lora_rank=4, full_depths=(1, 2), repeats=2)


def llada_fields(shape: Shape, n_layers: int | None = None) -> dict[str, Any]:
    """LLaDA-8B-Instruct's config.json fields, sizes from `shape` (depth `n_layers` when given)."""
    return {
        "model_type": "llada", "architectures": ["LLaDAModelLM"], "activation_type": "silu", "alibi": False,
        "attention_dropout": 0.0, "attention_layer_norm": False, "block_group_size": 1, "block_type": "llama",
        "d_model": shape.d_model, "embedding_dropout": 0.0, "embedding_size": shape.vocab_size,
        "eos_token_id": shape.eos_token_id, "include_bias": False, "include_qkv_bias": False,
        "input_emb_norm": False, "layer_norm_type": "rms", "layer_norm_with_affine": True,
        "mask_token_id": shape.mask_token_id, "max_sequence_length": 4096,
        "mlp_hidden_size": shape.mlp_hidden_size, "n_heads": shape.n_heads, "n_kv_heads": shape.n_heads,
        "n_layers": n_layers or shape.n_layers, "pad_token_id": shape.eos_token_id, "residual_dropout": 0.0,
        "rms_norm_eps": 1e-5, "rope": True, "rope_full_precision": True, "rope_theta": 500000.0,
        "scale_logits": False, "vocab_size": shape.vocab_size, "weight_tying": False,
    }


# --------------------------------------------------------------------------------------------
# Building the model: native LLaDA, random weights drawn on the device
# --------------------------------------------------------------------------------------------


def build_llada(shape: Shape, device: torch.device, dtype: torch.dtype, *, n_layers: int | None = None,
                seed: int = 0):
    """ddrl's native LLaDA backbone at `shape`, wrapped as load_model wraps a LLaDA directory.

    Built on the meta device and filled on `device` from a generator there: N(0, 0.02) for every
    matrix, 1 for the RMSNorm weights (drawing 8B numbers on a CPU generator takes minutes)."""
    from ddrl.models.diffusion_lm import make_process_spec
    from ddrl.models.hf import HFDiffusionLM
    from ddrl.models.native.llada import LLaDABackbone, LLaDAConfig

    config = LLaDAConfig.from_dict(llada_fields(shape, n_layers), source="bench/gpu/check.py")
    with torch.device("meta"):
        backbone = LLaDABackbone(config).to(dtype)  # on meta: no memory, so no fp32 copy of 8B on the device
    backbone = backbone.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in backbone.named_parameters():
            if name.endswith("norm.weight") or ".ln_f." in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return HFDiffusionLM(backbone, None, attention="native", mask_token_id=shape.mask_token_id,
                         vocab_size=shape.vocab_size, eos_token_id=shape.eos_token_id,
                         pad_token_id=shape.eos_token_id, family="llada",
                         process_spec=make_process_spec("masked", mask_token_id=shape.mask_token_id))


@dataclass(frozen=True)
class MatmulParams:
    """Weight-matmul parameters: of the transformer blocks (used per token fed) and of the LM head
    (per scored position). Adapters (LoRA) are not counted."""

    blocks: int
    head: int

    def flops(self, tokens: float, head_positions: float, per_param: int) -> float:
        """per_param: 2 (forward), 4 (LoRA step), 6 (full step) FLOPs per parameter and token."""
        return per_param * (self.blocks * tokens + self.head * head_positions)


def matmul_params(model) -> MatmulParams:
    from ddrl.models.backbone import base_model, output_projection, transformer_blocks

    blocks = sum(m.weight.numel() for block in transformer_blocks(model.model) for name, m in block.named_modules()
                 if isinstance(m, torch.nn.Linear) and "lora_" not in name)
    head = output_projection(base_model(model.model))
    return MatmulParams(blocks=blocks, head=head[1].weight.numel() if head is not None else 0)


# --------------------------------------------------------------------------------------------
# Device helpers: synchronised clocks, memory, the matmul peak
# --------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, fn()) with the device drained before and after."""
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_gb(device: torch.device) -> float | None:
    """torch.cuda.max_memory_allocated since the last reset_peak; None on the CPU (no allocator stats)."""
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def allocated_gb(device: torch.device) -> float | None:
    return torch.cuda.memory_allocated(device) / 1e9 if device.type == "cuda" else None


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int, repeats: int) -> dict[str, Any]:
    """The measured matrix-multiply rate: median seconds of an n x n x n product after warm-up."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)  # random data: zeros run faster
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    for _ in range(3):
        a @ b
    seconds = [timed(device, lambda: a @ b)[0] for _ in range(repeats)]
    median = statistics.median(seconds)
    return {"n": n, "dtype": str(dtype).replace("torch.", ""), "seconds": median, "flops_per_s": 2 * n**3 / median,
            "tflops": 2 * n**3 / median / 1e12}


class TokenCount:
    """Tokens fed to a model (input_ids elements per forward call), by a forward pre-hook."""

    def __init__(self, model: torch.nn.Module):
        self.tokens = 0
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs) -> None:
        ids = args[0] if args else kwargs["input_ids"]
        self.tokens += ids.numel()

    def close(self) -> None:
        self._handle.remove()


# --------------------------------------------------------------------------------------------
# Inputs: left-padded prompt groups, a synthetic rollout batch
# --------------------------------------------------------------------------------------------


def prompts(shape: Shape, wl: Workload, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """prompt_ids [B, P] and prompt_mask [B, P]: group g left-padded by g * prompt_pad_step tokens,
    ids drawn below the special tokens."""
    g = torch.Generator().manual_seed(seed)
    P = wl.prompt_length
    ids = torch.randint(0, shape.mask_token_id - 64, (wl.prompts, P), generator=g)  # [n_prompts, P]
    pad = torch.tensor([min(i * wl.prompt_pad_step, P - 1) for i in range(wl.prompts)])  # [n_prompts]
    mask = torch.arange(P)[None, :] >= pad[:, None]  # [n_prompts, P], True on real tokens
    ids = ids.masked_fill(~mask, shape.eos_token_id)
    rows = lambda x: x.repeat_interleave(wl.group_size, 0).to(device)  # noqa: E731  [B, P]
    return rows(ids), rows(mask)


def rollout_batch(shape: Shape, wl: Workload, device: torch.device, seed: int = 0):
    """A RolloutBatch of wl.rows random completions with group-mean advantages."""
    from ddrl.objectives import compute_advantages
    from ddrl.types import RolloutBatch

    prompt_ids, prompt_mask = prompts(shape, wl, device, seed)
    g = torch.Generator().manual_seed(seed + 1)
    B, L = wl.rows, wl.gen_length
    completion_ids = torch.randint(0, shape.mask_token_id - 64, (B, L), generator=g).to(device)
    rewards = torch.rand(B, generator=g).to(device)
    group_ids = torch.arange(wl.prompts, device=device).repeat_interleave(wl.group_size)
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                        completion_mask=torch.ones(B, L, dtype=torch.bool, device=device), group_ids=group_ids,
                        rewards=rewards, advantages=compute_advantages(rewards, group_ids, "mean"),
                        mask_seeds=torch.tensor([7]), completions=[""] * B)


def group_generators(wl: Workload, device: torch.device, seed: int):
    """One generator per prompt group, on the model's device (what the trainer passes the sampler)."""
    from ddrl.processes.draws import RowGenerators

    gens = [torch.Generator(device=device).manual_seed(seed * 1000 + i) for i in range(wl.prompts)]
    return RowGenerators(gens, wl.group_size)


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast: the recipes' compute precision over fp32 (or bf16) weights, on CUDA and CPU alike."""
    return torch.autocast(device.type, dtype=torch.bfloat16)


def rollout_section(model, shape: Shape, wl: Workload, device: torch.device, caches: list[str],
                    record: Callable[[dict], None]) -> dict[str, Any]:
    """Each cache variant: a warm-up call (one step per block), then one timed call at wl.steps."""
    import ddrl.sampling  # noqa: F401  (registers the samplers)
    from ddrl.config import SamplerConfig
    from ddrl.registry import SAMPLERS

    sampler = SAMPLERS.get("masked")
    prompt_ids, prompt_mask = prompts(shape, wl, device)
    blocks = wl.gen_length // wl.block_length
    weights = allocated_gb(device)
    out: dict[str, Any] = {"rows": wl.rows, "prompt_length": wl.prompt_length, "gen_length": wl.gen_length,
                           "block_length": wl.block_length, "steps": wl.steps, "weights_gb": weights, "variants": {}}
    model.eval()
    for cache in caches:
        cfg = SamplerConfig(steps=wl.steps, gen_length=wl.gen_length, block_length=wl.block_length, temperature=1.0,
                            threshold=None, cache=cache, early_exit=False)
        warm = replace(cfg, steps=blocks)
        with torch.no_grad():
            sampler(model, prompt_ids, prompt_mask, warm, generator=group_generators(wl, device, 0))
            reset_peak(device)
            seconds, result = timed(device, lambda: sampler(model, prompt_ids, prompt_mask, cfg,
                                                            generator=group_generators(wl, device, 1)))
        peak = peak_gb(device)
        out["variants"][cache] = {
            "seconds": seconds, "tokens_per_s": wl.rows * wl.gen_length / seconds, "model_calls": int(result.nfe),
            "forward_tokens": int(result.forward_tokens), "peak_gb": peak,
            "peak_above_weights_gb": None if peak is None else peak - weights}
        ref = out["variants"].get("none")
        if ref is not None:
            for name, v in out["variants"].items():
                v["speedup_vs_reference"] = ref["seconds"] / v["seconds"]
        record(out)
    return out


def update_step(model, estimator, objective, batch, opt, micro_batch: int, device: torch.device,
                max_grad_norm: float | None = None, norms: list[float] | None = None) -> torch.Tensor:
    """estimator (grad) -> objective -> backward per micro-batch -> [clip] -> one optimizer step.
    old = sg(new) and ref = sg(new) (ratio 1, KL 0: the passes that produce them are timed as
    `score_pass`). max_grad_norm: clip as the trainer does, the pre-clip norm appended to `norms`."""
    from ddrl.objectives import AggregationCounts

    counts = AggregationCounts(tokens=float(batch.completion_mask.sum()), sequences=float(len(batch)))
    opt.zero_grad(set_to_none=True)
    loss = torch.zeros((), device=device)
    for lo in range(0, len(batch), micro_batch):
        mb = batch.index(slice(lo, lo + micro_batch))
        with autocast(device):
            new = estimator(model, mb, 7)
            part = objective(mb, new, new.detach(), new.detach(), counts=counts).loss
        part.backward()
        loss = loss + part.detach()
    if max_grad_norm is not None:  # the trainer's clip: a norm over the (possibly host-memory) sharded gradients
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        if norms is not None:
            norms.append(float(norm))
    opt.step()
    return loss


def score_pass(model, estimator, batch, micro_batch: int, device: torch.device) -> None:
    """The no-grad estimator pass of the old and reference log-probs."""
    with torch.no_grad(), autocast(device):
        for lo in range(0, len(batch), micro_batch):
            estimator(model, batch.index(slice(lo, lo + micro_batch)), 7)


def measure_update(model, shape: Shape, wl: Workload, device: torch.device, opt, per_param: int,
                   peak_flops: float, after_warmup: Callable[[], None] | None = None,
                   max_grad_norm: float | None = None) -> dict[str, Any]:
    """One warm-up step (then `after_warmup()`), wl.repeats timed steps (median), peak memory over the
    timed steps; a timed no-grad score pass; model FLOPs and MFU of both. max_grad_norm: every step
    clips (the pre-clip norms are reported)."""
    import ddrl.estimators  # noqa: F401  (registration)
    import ddrl.objectives  # noqa: F401
    from ddrl.registry import ESTIMATORS, OBJECTIVES

    estimator = ESTIMATORS.get("mean_field")(p_mask_prompt=0.15)
    objective = OBJECTIVES.get("grpo")()
    batch = rollout_batch(shape, wl, device)
    params = matmul_params(model)
    model.train()
    norms: list[float] = []
    loss = update_step(model, estimator, objective, batch, opt, wl.micro_batch, device, max_grad_norm, norms)  # warm-up
    if after_warmup is not None:
        after_warmup()
    steady = allocated_gb(device)
    counter = TokenCount(model)
    reset_peak(device)
    seconds = [timed(device, lambda: update_step(model, estimator, objective, batch, opt, wl.micro_batch,
                                                 device, max_grad_norm, norms))[0] for _ in range(wl.repeats)]
    peak = peak_gb(device)
    tokens = counter.tokens / wl.repeats
    counter.tokens = 0
    score_s, _ = timed(device, lambda: score_pass(model, estimator, batch, wl.micro_batch, device))
    score_tokens = counter.tokens
    counter.close()
    T = wl.prompt_length + wl.gen_length
    step_s = statistics.median(seconds)
    step_flops = params.flops(tokens, tokens * wl.gen_length / T, per_param)
    score_flops = params.flops(score_tokens, score_tokens * wl.gen_length / T, 2)
    return {"rows": wl.rows, "micro_batch": wl.micro_batch, "tokens_per_row": T, "tokens_per_step": tokens,
            "step_s": step_s, "step_s_all": seconds, "peak_gb": peak, "steady_gb": steady,
            "model_flops_per_step": step_flops, "mfu": step_flops / step_s / peak_flops,
            "score_pass_s": score_s, "score_pass_mfu": score_flops / score_s / peak_flops,
            "matmul_params_blocks": params.blocks, "matmul_params_head": params.head,
            "loss": float(loss), "loss_finite": math.isfinite(float(loss)),
            **({} if max_grad_norm is None else {"max_grad_norm": max_grad_norm, "grad_norms": norms,
                                                 "grad_norms_finite": all(map(math.isfinite, norms))})}


def lora_section(model, shape: Shape, wl: Workload, device: torch.device, peak_flops: float) -> dict[str, Any]:
    """LoRA rank wl.lora_rank on every linear layer of every block, over the bf16 base."""
    from ddrl.config import LoraConfig
    from ddrl.models.lora import apply_lora
    from ddrl.training.common import build_optimizer

    model = apply_lora(model, LoraConfig(rank=wl.lora_rank, alpha=2 * wl.lora_rank, target_modules=LORA_TARGETS))
    trainable = [p for p in model.parameters() if p.requires_grad]
    adapted = sum(1 for name, _ in model.named_modules() if name.endswith(".lora_A"))
    opt = build_optimizer(trainable, wl.lr, 0.0)  # refuses bf16 trainable parameters
    out = {"rank": wl.lora_rank, "layers": shape.n_layers, "adapted_linears": adapted,
           "params_b": sum(p.numel() for p in model.parameters()) / 1e9,
           "trainable_m": sum(p.numel() for p in trainable) / 1e6,
           "adapter_dtype": str(trainable[0].dtype).replace("torch.", ""), "flops_per_param_token": 4}
    out.update(measure_update(model, shape, wl, device, opt, 4, peak_flops))
    return out


@contextlib.contextmanager
def one_process_group(device: torch.device, cpu_offload: bool = False) -> Iterator[None]:
    """A 1-process nccl (CUDA) or gloo (CPU) group on a free local port, so FSDP2 runs as on N GPUs;
    with cpu_offload, the trainer's group for dist.cpu_offload (cpu:gloo,cuda:nccl on CUDA)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device.type == "cuda" else "gloo"
    if cpu_offload:
        from ddrl.training.distributed import process_group_backend

        backend = process_group_backend(None, device, cpu_offload=True)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def shard_mixed_precision(model, device: torch.device) -> None:
    """FSDP2 as the trainer shards (each block, then the root), fp32 master weights, bf16 compute,
    fp32 gradient reduction."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ddrl.models.backbone import transformer_blocks

    import torch.distributed as dist

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in transformer_blocks(model.model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def full_depth(shape: Shape, wl: Workload, device: torch.device, depth: int, peak_flops: float, *,
               cpu_offload: bool = False, max_grad_norm: float | None = None) -> dict[str, Any]:
    from ddrl.training.common import build_optimizer

    model = build_llada(shape, device, torch.float32, n_layers=depth)
    params = sum(p.numel() for p in model.parameters())
    if cpu_offload:
        shard_with_cpu_offload(model, device)
    else:
        shard_mixed_precision(model, device)
    opt = build_optimizer(model.parameters(), wl.lr, 0.0)
    probe = next(p for n, p in model.named_parameters() if n.endswith("blocks.0.q_proj.weight"))
    local = lambda: (probe.to_local() if hasattr(probe, "to_local") else probe).detach().float()  # noqa: E731
    before = local().clone()
    out: dict[str, Any] = {"layers": depth, "params_b": params / 1e9, "lr": wl.lr, "compute_dtype": "bfloat16",
                           "master_dtype": str(probe.dtype).replace("torch.", ""), "flops_per_param_token": 6}

    def first_update() -> None:  # AdamW's first step moves every weight by ~lr: visible in fp32, lost in bf16
        moved = float((local() - before).abs().max())
        out.update(master_update_max_abs=moved, weights_moved=moved > 0)

    out.update(measure_update(model, shape, wl, device, opt, 6, peak_flops, after_warmup=first_update,
                              max_grad_norm=max_grad_norm))
    return out  # the model and its optimizer go with this frame; full_section releases the memory


def shard_with_cpu_offload(model, device: torch.device) -> None:
    """The trainer's own sharding (ddrl.training.distributed.shard_model) with dist.cpu_offload."""
    import inspect

    from ddrl.training.distributed import shard_model

    if "cpu_offload" not in inspect.signature(shard_model).parameters:
        raise Skip("ddrl.training.distributed.shard_model has no cpu_offload (dist.cpu_offload) in this tree")
    shard_model(model, device, "bf16", cpu_offload=True)


def offload_section(shape: Shape, wl: Workload, device: torch.device, peak_flops: float) -> dict[str, Any]:
    """Full fine-tuning, fp32 master weights, FSDP2 on one process with CPU offload, at the larger
    reduced depth: what stays on the GPU is the gathered bf16 blocks and the activations."""
    depth = wl.full_depths[1]
    import torch.distributed as dist

    with one_process_group(device, cpu_offload=True):
        backend = str(dist.get_backend())
        out = full_depth(shape, wl, device, depth, peak_flops, cpu_offload=True, max_grad_norm=wl.max_grad_norm)
    return {"strategy": "fsdp2 + CPUOffloadPolicy (dist.cpu_offload), 1 process", "process_group": backend, **out}


def memory_section(shape: Shape, wl: Workload, data: dict[str, Any]) -> dict[str, Any]:
    """ddrl.training.memory's estimate of the LoRA and offloaded full steps this check ran (held state
    + the larger of the update and optimizer phases), against their measured peaks."""
    try:
        from ddrl.training import memory
    except ImportError as e:
        raise Skip(f"ddrl.training.memory is not in this tree ({e})") from None
    from ddrl.config import RLConfig, load_config

    setting = [f"train.prompts_per_step={wl.prompts}", f"train.group_size={wl.group_size}",
               f"train.micro_batch_size={wl.micro_batch}", f"rollout.gen_length={wl.gen_length}",
               f"rollout.block_length={wl.block_length}", f"rollout.steps={wl.steps}",
               f"rollout.max_prompt_length={wl.prompt_length}", "model.gradient_checkpointing=false",
               "model.mixed_precision=bf16"]
    runs = {"lora": ([f"model.lora.rank={wl.lora_rank}", f"model.lora.target_modules=[{','.join(LORA_TARGETS)}]",
                      "model.dtype=bfloat16", "dist.strategy=none"], shape.n_layers),
            "offload": (["model.lora.rank=0", "model.dtype=float32", "dist.strategy=fsdp", "dist.cpu_offload=true"],
                        wl.full_depths[1])}
    out: dict[str, Any] = {}
    for name, (overrides, layers) in runs.items():
        cfg = load_config(ROOT / "configs/paper/diffu_grpo_llada8b.yaml", setting + overrides, RLConfig)
        model_shape = memory.ModelShape(d_model=shape.d_model, n_layers=layers, n_heads=shape.n_heads,
                                        n_kv_heads=shape.n_heads, ffn=shape.mlp_hidden_size, vocab=shape.vocab_size)
        est = memory.estimate_memory(cfg, model_shape, 1, prompt_tokens=wl.prompt_length)
        step = sum(est.held.values()) + max(sum(est.phases["update"].values()),
                                            sum(est.phases.get("optimizer", {}).values()))
        measured = data.get(name, {}).get("peak_gb")
        out[name] = {"layers": layers, "estimate_step_gb": step / memory.GB, "estimate_total_gb": est.total / memory.GB,
                     "measured_peak_gb": measured,
                     "measured_over_estimate": None if measured is None else measured / (step / memory.GB),
                     "estimate": est.report()}
    return out


def full_section(shape: Shape, wl: Workload, device: torch.device, peak_flops: float,
                 record: Callable[[dict], None], in_budget: Callable[[], bool]) -> dict[str, Any]:
    out: dict[str, Any] = {"depths": {}, "strategy": "fsdp2, 1 process", "reduce_dtype": "float32"}
    with one_process_group(device):
        for depth in wl.full_depths:
            if not in_budget():
                out["depths"][str(depth)] = {"status": "skipped: time budget"}
                break
            try:
                out["depths"][str(depth)] = full_depth(shape, wl, device, depth, peak_flops)
            except Exception as e:  # noqa: BLE001  (say, out of memory at the larger depth: keep the smaller)
                out["depths"][str(depth)] = {"status": f"error: {type(e).__name__}: {str(e)[:500]}"}
                print(traceback.format_exc(), file=sys.stderr)
            release(device)
            record(out)
    done = [out["depths"][str(d)] for d in wl.full_depths if "step_s" in out["depths"].get(str(d), {})]
    if not done:
        raise RuntimeError(f"no depth of the full fine-tuning step ran: {out['depths']}")
    if len(done) == 2:
        out["per_layer"] = per_layer(done[0], done[1])
        out["projected"] = {f"{shape.n_layers}_layers": project(done[1], out["per_layer"], shape.n_layers)}
    return out


def per_layer(small: dict[str, Any], large: dict[str, Any]) -> dict[str, Any]:
    """What one more block costs: the difference of the two depths' figures per block."""
    layers = large["layers"] - small["layers"]
    slope = lambda key: None if small.get(key) is None else (large[key] - small[key]) / layers  # noqa: E731
    return {"step_s": slope("step_s"), "peak_gb": slope("peak_gb"), "steady_gb": slope("steady_gb"),
            "params_b": slope("params_b"), "model_flops_per_step": slope("model_flops_per_step")}


def project(large: dict[str, Any], slope: dict[str, Any], layers: int) -> dict[str, Any]:
    extra = layers - large["layers"]
    at = lambda key: None if slope.get(key) is None else large[key] + extra * slope[key]  # noqa: E731
    return {"step_s": at("step_s"), "peak_gb": at("peak_gb"), "steady_gb": at("steady_gb"), "params_b": at("params_b")}


# --------------------------------------------------------------------------------------------
# The report: JSON + markdown, rewritten after every measurement
# --------------------------------------------------------------------------------------------


class Skip(Exception):
    """A section that cannot run in this tree (its ddrl code is missing): reported, not an error."""


@dataclass
class Report:
    directory: Path
    data: dict[str, Any] = field(default_factory=dict)

    def save(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.data["elapsed_s"] = time.perf_counter() - self.data.get("_start", time.perf_counter())
        public = {k: v for k, v in self.data.items() if not k.startswith("_")}
        for name, text in (("report.json", json.dumps(public, indent=2, default=str) + "\n"),
                           ("report.md", markdown(public))):
            tmp = self.directory / f".{name}.tmp"
            tmp.write_text(text)
            os.replace(tmp, self.directory / name)  # a reader (or a kill) never sees half a file


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def markdown(data: dict[str, Any]) -> str:
    lines = [f"# GPU check ({'tiny, ' if data.get('tiny') else ''}{data.get('device_name', '?')})", "",
             f"torch {data.get('torch')}, shape {data.get('shape')}, finished: {data.get('finished')}, "
             f"{_fmt(data.get('elapsed_s'))} s", ""]
    mm = data.get("matmul", {})
    lines += [f"matmul peak ({mm.get('dtype')}, n={mm.get('n')}): {_fmt(mm.get('tflops'))} TFLOP/s "
              f"[{mm.get('status')}]", ""]
    ro = data.get("rollout", {})
    lines += [f"## Rollout [{ro.get('status')}]", "",
              f"{ro.get('rows')} rows, prompt {ro.get('prompt_length')}, {ro.get('gen_length')} generated in blocks "
              f"of {ro.get('block_length')}, {ro.get('steps')} steps, weights {_fmt(ro.get('weights_gb'))} GB", "",
              "| cache | seconds | tokens/s | speed-up | model calls | fed tokens | peak GB | peak above weights GB |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, v in ro.get("variants", {}).items():
        lines.append(f"| {name} | {_fmt(v['seconds'])} | {_fmt(v['tokens_per_s'])} | "
                     f"{_fmt(v.get('speedup_vs_reference'))} | {v['model_calls']} | {v['forward_tokens']} | "
                     f"{_fmt(v['peak_gb'])} | {_fmt(v['peak_above_weights_gb'])} |")
    lines += ["", "## Update steps", "",
              "| run | layers | params B | trainable | step s | MFU | peak GB | steady GB | score pass s | score MFU |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lora = data.get("lora", {})
    if "step_s" in lora:
        lines.append(f"| LoRA r{lora['rank']} | {lora['layers']} | {_fmt(lora['params_b'])} | "
                     f"{_fmt(lora['trainable_m'])} M | {_fmt(lora['step_s'])} | {_fmt(lora['mfu'])} | "
                     f"{_fmt(lora['peak_gb'])} | {_fmt(lora['steady_gb'])} | {_fmt(lora['score_pass_s'])} | "
                     f"{_fmt(lora['score_pass_mfu'])} |")
    full = data.get("full", {})
    for depth, v in full.get("depths", {}).items():
        if "step_s" in v:
            lines.append(f"| full, fp32 master | {depth} | {_fmt(v['params_b'])} | all | {_fmt(v['step_s'])} | "
                         f"{_fmt(v['mfu'])} | {_fmt(v['peak_gb'])} | {_fmt(v['steady_gb'])} | "
                         f"{_fmt(v['score_pass_s'])} | {_fmt(v['score_pass_mfu'])} |")
    off = data.get("offload", {})
    if "step_s" in off:
        lines.append(f"| full, fp32 master, CPU offload | {off['layers']} | {_fmt(off['params_b'])} | all | "
                     f"{_fmt(off['step_s'])} | {_fmt(off['mfu'])} | {_fmt(off['peak_gb'])} | {_fmt(off['steady_gb'])} | "
                     f"{_fmt(off['score_pass_s'])} | {_fmt(off['score_pass_mfu'])} |")
    if "per_layer" in full:
        pl = full["per_layer"]
        lines.append(f"| full, per layer | 1 | {_fmt(pl['params_b'])} | all | {_fmt(pl['step_s'])} | | "
                     f"{_fmt(pl['peak_gb'])} | {_fmt(pl['steady_gb'])} | | |")
        for name, v in full.get("projected", {}).items():
            lines.append(f"| full, projected | {name} | {_fmt(v['params_b'])} | all | {_fmt(v['step_s'])} | | "
                         f"{_fmt(v['peak_gb'])} | {_fmt(v['steady_gb'])} | | |")
    lines += ["", f"LoRA [{lora.get('status')}], full [{full.get('status')}]; full fine-tuning: master weights "
              f"{_first(full, 'master_dtype')}, one AdamW step at lr {_first(full, 'lr')} moved them by up to "
              f"{_fmt(_first(full, 'master_update_max_abs'))}", ""]
    mem = data.get("memory", {})
    lines += [f"## Memory model [{mem.get('status')}]", "", "| run | layers | measured peak GB | estimate GB | "
              "measured / estimate |", "| --- | --- | --- | --- | --- |"]
    for name in ("lora", "offload"):
        if name in mem:
            m = mem[name]
            lines.append(f"| {name} | {m['layers']} | {_fmt(m['measured_peak_gb'])} | {_fmt(m['estimate_step_gb'])} | "
                         f"{_fmt(m['measured_over_estimate'])} |")
    lines.append("")
    errors = [f"- {k}: {v['status']}" for k, v in data.items() if isinstance(v, dict)
              and str(v.get("status", "ok")) != "ok"]
    errors += [f"- full at {depth} layers: {v['status']}" for depth, v in full.get("depths", {}).items() if "status" in v]
    if errors:
        lines += ["## Not measured", "", *errors, ""]
    return "\n".join(lines)


def _first(full: dict[str, Any], key: str) -> Any:
    return next((v[key] for v in full.get("depths", {}).values() if key in v), None)


# --------------------------------------------------------------------------------------------
# The rehearsal's prediction of the same step (issue 33 item 6)
# --------------------------------------------------------------------------------------------


def rehearsal_overrides(wl: Workload) -> list[str]:
    """The lora section's step as overrides of configs/paper/diffu_grpo_llada8b.yaml, for
    `ddrl train configs/paper/diffu_grpo_llada8b.yaml --rehearse --world-size 1 OVERRIDES` (on any CPU):
    its output_dir/rehearsal/rehearsal.json is what --rehearsal compares this GPU's step with."""
    return [f"train.prompts_per_step={wl.prompts}", f"train.group_size={wl.group_size}",
            f"train.micro_batch_size={wl.micro_batch}", f"rollout.gen_length={wl.gen_length}",
            f"rollout.block_length={wl.block_length}", f"rollout.steps={wl.steps}",
            f"rollout.max_prompt_length={wl.prompt_length}", "model.gradient_checkpointing=false",
            "model.mixed_precision=bf16", f"model.lora.rank={wl.lora_rank}",
            f"model.lora.target_modules=[{','.join(LORA_TARGETS)}]", "model.dtype=bfloat16", "dist.strategy=none",
            "train.num_iterations=1"]


def compare_with_rehearsal(measured: dict[str, Any], rehearsal: dict[str, Any]) -> dict[str, Any]:
    """This GPU's update step (the lora section: peak_gb, step_s) beside the rehearsal's prediction
    (rehearsal.json: MemTracker's peak of the whole step, the roofline time of its update). The peak
    of a GPU adds the CUDA context and the allocator's fragmentation; the roofline has no launch
    overhead and no collectives, so measured / predicted time is at least 1."""
    peak, step = measured.get("peak_gb"), measured.get("step_s")
    predicted_peak = rehearsal["peak_bytes"] / 1e9
    predicted_update = rehearsal["update_s"]
    return {"recipe": rehearsal.get("config"), "world_size": rehearsal.get("world_size"),
            "layers": rehearsal.get("layers"), "measured_peak_gb": peak, "predicted_peak_gb": predicted_peak,
            "predicted_rollout_peak_gb": rehearsal.get("rollout_peak_bytes", 0.0) / 1e9,
            "peak_measured_over_predicted": None if peak is None else peak / predicted_peak,
            "measured_step_s": step, "predicted_update_s": predicted_update,
            "time_measured_over_predicted": None if step is None or not predicted_update else step / predicted_update}


def comparison_lines(c: dict[str, Any]) -> list[str]:
    """The comparison as the check prints it: measured and predicted side by side."""
    return [f"rehearsal vs this GPU: {c['recipe']} ({c['layers']} layers, world size {c['world_size']})",
            f"  peak memory   measured {_fmt(c['measured_peak_gb'])} GB   rehearsal {_fmt(c['predicted_peak_gb'])} GB"
            f"   measured / rehearsal {_fmt(c['peak_measured_over_predicted'])}",
            f"  update step   measured {_fmt(c['measured_step_s'])} s    rehearsal (roofline) "
            f"{_fmt(c['predicted_update_s'])} s   measured / rehearsal {_fmt(c['time_measured_over_predicted'])}"]


def rehearsal_comparison(report: Report, path: str) -> None:
    """--rehearsal FILE: the comparison into the report and on stdout (nothing when lora did not run)."""
    lora = report.data.get("lora", {})
    if lora.get("status") != "ok":
        report.data["rehearsal"] = {"status": f"skipped: the lora section did not finish ({lora.get('status')})"}
        return
    c = compare_with_rehearsal(lora, json.loads(Path(path).read_text()))
    report.data["rehearsal"] = {"status": "ok", **c}
    print("\n".join(comparison_lines(c)), flush=True)


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def run_section(report: Report, name: str, fn: Callable[[Callable[[dict], None]], dict], in_budget: Callable[[], bool],
                device: torch.device) -> dict[str, Any] | None:
    """Run one section; its result (or error, or skip) is in the report on disk when this returns.
    An error ends the section, not the check."""
    if not in_budget():
        report.data[name] = {"status": "skipped: time budget"}
        report.save()
        return None

    def record(partial: dict) -> None:  # intermediate numbers reach the disk at once
        report.data[name] = {"status": "running", **partial}
        report.save()

    start = time.perf_counter()
    try:
        result = fn(record)
        report.data[name] = {"status": "ok", **result, "section_s": time.perf_counter() - start}
    except Skip as e:
        report.data[name] = {"status": f"skipped: {e}"}
        result = None
    except Exception as e:  # noqa: BLE001  (an OOM or a bug in one section must not lose the others)
        kept = {k: v for k, v in report.data.get(name, {}).items() if k != "status"}
        report.data[name] = {**kept, "status": f"error: {type(e).__name__}: {str(e)[:500]}",
                             "traceback": traceback.format_exc()[-3000:], "section_s": time.perf_counter() - start}
        print(report.data[name]["traceback"], file=sys.stderr)
        result = None
    finally:
        release(device)
    report.save()
    print(f"[check] {name}: {report.data[name]['status']} ({time.perf_counter() - start:.1f} s)", flush=True)
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # set_device and the nccl group need the index
    shape = TINY if args.tiny else LLADA_8B
    wl = TINY_WORKLOAD if args.tiny else GPU_WORKLOAD
    overrides = {k: getattr(args, k) for k in ("prompts", "steps", "lora_rank", "repeats") if getattr(args, k)}
    if args.full_depths:
        overrides["full_depths"] = tuple(args.full_depths)
    wl = replace(wl, **overrides)
    if len(wl.full_depths) != 2 or wl.full_depths[0] >= wl.full_depths[1]:
        raise SystemExit(f"--full-depths needs two increasing depths, got {wl.full_depths}")
    start = time.perf_counter()
    in_budget = lambda: time.perf_counter() - start < args.budget_s  # noqa: E731
    report = Report(Path(args.out))
    report.data.update({
        "_start": start, "schema": 1, "tiny": args.tiny, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "shape": asdict(shape), "workload": asdict(wl), "budget_s": args.budget_s,
        "finished": False, "sections": list(args.only)})
    report.save()
    try:
        sections(args, report, device, shape, wl, in_budget)
    except KeyboardInterrupt:  # check.sh's time limit (SIGINT): what finished is already on disk
        report.data["stopped"] = "interrupted (time limit)"
        report.save()
        raise SystemExit(124)
    if args.rehearsal:
        rehearsal_comparison(report, args.rehearsal)
    report.data["finished"] = True
    report.save()
    print((Path(args.out) / "report.md").read_text())
    return {k: v for k, v in report.data.items() if not k.startswith("_")}


def sections(args: argparse.Namespace, report: Report, device: torch.device, shape: Shape, wl: Workload,
             in_budget: Callable[[], bool]) -> None:
    only = set(args.only)
    mm = run_section(report, "matmul", lambda rec: matmul_peak(device, torch.bfloat16, args.matmul_n or
                                                               (256 if args.tiny else 8192), 10), in_budget, device)
    peak_flops = mm["flops_per_s"] if mm else float("nan")
    built: dict[str, Any] = {}

    def bf16_model():  # built inside the first section that needs it (its guard), shared by rollout and LoRA
        if "model" not in built:
            built["model"] = build_llada(shape, device, torch.bfloat16)
        return built["model"]

    if "rollout" in only:
        run_section(report, "rollout", lambda rec: rollout_section(bf16_model(), shape, wl, device, args.caches, rec),
                    in_budget, device)
    if "lora" in only:
        run_section(report, "lora", lambda rec: lora_section(bf16_model(), shape, wl, device, peak_flops), in_budget,
                    device)
    built.clear()
    release(device)
    if "full" in only:
        run_section(report, "full", lambda rec: full_section(shape, wl, device, peak_flops, rec, in_budget),
                    in_budget, device)
    if "offload" in only:
        run_section(report, "offload", lambda rec: offload_section(shape, wl, device, peak_flops), in_budget, device)
    if "memory" in only:
        run_section(report, "memory", lambda rec: memory_section(shape, wl, report.data), in_budget, device)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shape on the CPU (seconds): the test runs this")
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "runs" / "gpu_check"),
                   help="report directory (default $OUT, else runs/gpu_check)")
    p.add_argument("--device", default=None, help="default: cuda when visible (cpu with --tiny)")
    p.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no section after this many seconds (default 420; 120 with --tiny)")
    p.add_argument("--caches", nargs="+", default=["none", "dual"], help="rollout variants (rollout.cache values)")
    p.add_argument("--prompts", type=int, help="prompt groups per rollout / update step")
    p.add_argument("--steps", type=int, help="sampler model calls")
    p.add_argument("--lora-rank", type=int)
    p.add_argument("--repeats", type=int, help="timed update steps")
    p.add_argument("--full-depths", type=int, nargs=2, help="the two reduced depths of the full fine-tuning step")
    p.add_argument("--matmul-n", type=int, help="side of the peak-rate matmul (default 8192; 256 with --tiny)")
    p.add_argument("--rehearsal", default=None,
                   help="a rehearsal.json of the lora section's step (ddrl train configs/paper/diffu_grpo_llada8b.yaml "
                        "--rehearse --world-size 1 with rehearsal_overrides): printed beside the measured peak and time")
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    if args.budget_s is None:
        args.budget_s = 120.0 if args.tiny else 420.0
    if "matmul" not in args.only:
        args.only = ["matmul", *args.only]  # every MFU needs the peak
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run(parse(argv))


if __name__ == "__main__":
    main()
