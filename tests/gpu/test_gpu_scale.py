"""GPU checks of what only shows at scale (issue 16, items 1 and 3-6), skipped without CUDA.

Each test fails on the code before issue 16 when run on a GPU:
  1. full fine-tuning with the paper recipes' precision settings learns at lr 1e-6 (bf16 weights
     round such updates to zero);
  4. the rollout draws its noise on the CUDA device, never a [B, W, V] float64 tensor;
  6. one sampler call per rollout step for all of a rank's groups;
  3/5. neither the estimator (forward + backward) nor the sampler materialises [rows, T, V]: their
     peak CUDA memory does not grow with the positions they do not score (measured with
     torch.cuda.max_memory_allocated at two lengths, so the model's own memory cancels out).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch.utils._pytree import tree_flatten
from torch.utils._python_dispatch import TorchDispatchMode

from tests.integration.conftest import ROOT, rl_overrides

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CUDA = torch.device("cuda")


def load_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu" / "check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def make_trainer(model_dir: Path, out: Path, extra: list[str] = ()):
    from ddrl.config import RLConfig, load_config
    from ddrl.training.trainer import Trainer

    overrides = rl_overrides(model_dir, out) + ["device=cuda", "train.prompts_per_step=4", *extra]
    return Trainer(load_config(ROOT / "configs/rl/grpo_mini_sudoku.yaml", overrides, RLConfig))


# ------------------------------------------------------------------ item 1: mixed precision that learns


def full_fine_tune_precisions() -> list[dict]:
    """The distinct model precision settings of the paper recipes that fine-tune every weight."""
    settings = []
    for path in sorted((ROOT / "configs/paper").glob("*.yaml")):
        model = (yaml.safe_load(path.read_text()) or {}).get("model") or {}
        if (model.get("lora") or {}).get("rank", 0):
            continue
        keys = {k: model[k] for k in ("dtype", "bf16_autocast", "mixed_precision") if k in model}
        if keys and keys not in settings:
            settings.append(keys)
    return settings


@pytest.mark.parametrize("precision", full_fine_tune_precisions(), ids=str)
def test_full_fine_tuning_recipes_learn_at_lr_1e6(precision, tiny_sudoku_model, tmp_path):
    from safetensors.torch import load_file

    from ddrl.training.trainer import train

    overrides = [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in precision.items()]
    run = train(ROOT / "configs/rl/grpo_mini_sudoku.yaml",
                rl_overrides(tiny_sudoku_model, tmp_path) + ["device=cuda", "train.lr=1e-6", "model.lora.rank=0",
                                                             *overrides])
    before = load_file(str(tiny_sudoku_model / "model.safetensors"))
    after = load_file(str(run / "checkpoint-2" / "model.safetensors"))
    matrices = [k for k, v in before.items() if v.dim() == 2 and "emb" not in k]
    moved = sum(bool((after[k].float() - before[k].float()).abs().max() > 0) for k in matrices)
    assert moved == len(matrices), f"{len(matrices) - moved} of {len(matrices)} weight matrices did not move at lr 1e-6"
    assert all(after[k].dtype == torch.float32 for k in matrices)  # fp32 master weights are what is saved


# ------------------------------------------------------------------ items 4 and 6: the rollout

RANDOM_OPS = {"rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "uniform", "uniform_", "normal",
              "normal_", "exponential", "exponential_", "bernoulli", "bernoulli_", "random_", "multinomial", "geometric_"}


class RecordTensors(TorchDispatchMode):
    """Every random draw (op, device, dtype, shape), and every float64 tensor with >= `big` elements."""

    def __init__(self, big: int):
        super().__init__()
        self.big = big
        self.draws: list[tuple[str, str, torch.dtype, tuple]] = []
        self.big_float64: list[tuple[str, str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            if name in RANDOM_OPS:
                self.draws.append((name, t.device.type, t.dtype, tuple(t.shape)))
            if t.dtype == torch.float64 and t.numel() >= self.big:
                self.big_float64.append((name, t.device.type, tuple(t.shape)))
        return out


def test_rollout_noise_is_drawn_on_the_gpu_in_float32(tiny_sudoku_model, tmp_path):
    trainer = make_trainer(tiny_sudoku_model, tmp_path)
    B = trainer.cfg.train.prompts_per_step * trainer.cfg.train.group_size
    V = trainer.model.vocab_size
    with RecordTensors(big=B * V) as rec:
        trainer.rollout(1)
    noise = [d for d in rec.draws if d[3] and d[3][-1] == V]  # draws over the vocabulary: the token noise
    assert noise, f"no draw over the vocabulary was seen (draws: {rec.draws[:5]})"
    assert all(device == "cuda" for _, device, _, _ in noise), f"noise drawn on the CPU: {noise[:3]}"
    assert all(dtype != torch.float64 for _, _, dtype, _ in noise), f"float64 noise: {noise[:3]}"
    assert not rec.big_float64, f"[B, W, V]-sized float64 tensors in the rollout: {rec.big_float64[:3]}"


def test_one_sampler_call_per_rollout_step(tiny_sudoku_model, tmp_path, monkeypatch):
    from ddrl.registry import SAMPLERS

    trainer = make_trainer(tiny_sudoku_model, tmp_path)
    calls = []
    inner = SAMPLERS.get(trainer.cfg.rollout.name)

    def counting(model, prompt_ids, *args, **kwargs):
        calls.append(prompt_ids.shape[0])
        return inner(model, prompt_ids, *args, **kwargs)

    monkeypatch.setitem(SAMPLERS._items, trainer.cfg.rollout.name, counting)
    batch = trainer.rollout(1)
    assert calls == [len(batch)], f"sampler calls (rows each): {calls}; want one call for all groups"


# ------------------------------------------------------------------ items 3 and 5: no [rows, T, V]

WIDE = dict(d_model=64, n_heads=2, n_layers=2, mlp_hidden_size=128, vocab_size=32768, mask_token_id=32000,
            eos_token_id=32001)


def wide_vocab_model(dtype: torch.dtype):
    check = load_check()
    return check, check.build_llada(check.Shape(**WIDE), CUDA, dtype)


def peak_above_start(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


def test_estimator_memory_does_not_grow_with_rows_times_length_times_vocab():
    import ddrl.estimators  # noqa: F401
    from ddrl.registry import ESTIMATORS

    check, model = wide_vocab_model(torch.float32)
    estimator = ESTIMATORS.get("mean_field")(p_mask_prompt=0.0)
    rows, V = 16, WIDE["vocab_size"]

    def step(gen_length: int) -> int:
        wl = check.Workload(prompts=2, group_size=rows // 2, prompt_length=16, prompt_pad_step=4, gen_length=gen_length,
                            block_length=gen_length, steps=1, micro_batch=rows, lora_rank=1, full_depths=(1, 2),
                            repeats=1)
        batch = check.rollout_batch(check.Shape(**WIDE), wl, CUDA)

        def fwd_bwd():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = estimator(model, batch, 7)
            out.token_logp.sum().backward()
        fwd_bwd()  # warm-up (allocator, kernels)
        model.zero_grad(set_to_none=True)
        peak = peak_above_start(fwd_bwd)
        model.zero_grad(set_to_none=True)
        return peak

    short, long = 64, 1024
    growth = step(long) - step(short)
    full_logits = rows * (long - short) * V * 4  # what [rows, L, V] float32 logits alone add
    assert growth < full_logits / 4, (f"estimator peak grew by {growth / 2**20:.0f} MiB from L={short} to {long}; "
                                      f"[rows, L, V] fp32 logits would add {full_logits / 2**20:.0f} MiB")


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_sampler_memory_does_not_grow_with_positions_outside_the_block(cache):
    """Only the current block's logits: the peak must not follow [rows, T, V] (or [rows, L, V]) as the
    prompt and the completion grow at a fixed block length."""
    import ddrl.sampling  # noqa: F401
    from ddrl.config import SamplerConfig
    from ddrl.registry import SAMPLERS

    check, model = wide_vocab_model(torch.bfloat16)
    sampler = SAMPLERS.get("masked")
    rows, V, block = 8, WIDE["vocab_size"], 8

    def rollout(prompt_length: int, gen_length: int) -> int:
        steps = gen_length // block  # one model call per block: the shapes, not the steps, are under test
        wl = check.Workload(prompts=2, group_size=rows // 2, prompt_length=prompt_length, prompt_pad_step=4,
                            gen_length=gen_length, block_length=block, steps=steps, micro_batch=rows, lora_rank=1,
                            full_depths=(1, 2), repeats=1)
        cfg = SamplerConfig(steps=steps, gen_length=gen_length, block_length=block, temperature=1.0, cache=cache,
                            early_exit=False)
        ids, mask = check.prompts(check.Shape(**WIDE), wl, CUDA)
        run = lambda: sampler(model, ids, mask, cfg, generator=check.group_generators(wl, CUDA, 0))  # noqa: E731
        with torch.no_grad():
            run()  # warm-up
            return peak_above_start(run)

    short, long = (64, 32), (512, 512)
    growth = rollout(*long) - rollout(*short)
    positions = (long[0] - short[0]) + (long[1] - short[1])
    full_logits = rows * positions * V * 2  # bf16 logits over every added position
    assert growth < full_logits / 4, (f"sampler peak grew by {growth / 2**20:.0f} MiB from (P, L)={short} to {long}; "
                                      f"logits over every added position would add {full_logits / 2**20:.0f} MiB")


# ------------------------------------------------------------------ the GPU check's own GPU paths


def test_gpu_check_runs_its_cuda_paths_at_the_tiny_shape(tmp_path):
    """bench/gpu/check.py at the tiny shape on the GPU: the nccl 1-process group, FSDP2 on CUDA, device
    generators and CUDA peak memory, in seconds, before the 8-minute run spends its device time."""
    report = load_check().main(["--tiny", "--device", "cuda", "--out", str(tmp_path)])
    assert {s: report[s]["status"] for s in ("matmul", "rollout", "lora", "full")} == dict.fromkeys(
        ("matmul", "rollout", "lora", "full"), "ok")
    assert report["rollout"]["variants"]["dual"]["peak_gb"] > 0 and report["lora"]["peak_gb"] > 0
    assert all(d["weights_moved"] and d["master_dtype"] == "float32" for d in report["full"]["depths"].values())
