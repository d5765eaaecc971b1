"""GPU-only checks (skipped without CUDA): a bf16-autocast RL run, LoRA + gradient checkpointing on
the GPU, and the LLaDA-8B-shaped bench at reduced depth."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

from tests.integration.conftest import ROOT, rl_overrides

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def load_bench(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bf16_autocast_rl_steps_on_gpu(tiny_sudoku_model, tmp_path):
    from safetensors.torch import load_file

    from ddrl.training.trainer import train

    run = train(ROOT / "configs/rl/grpo_mini_sudoku.yaml",
                rl_overrides(tiny_sudoku_model, tmp_path) + ["device=cuda", "model.bf16_autocast=true",
                                                              "task.args.reward=partial", "train.lr=1e-3"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["loss"]) for r in rows)
    a, b = load_file(str(tiny_sudoku_model / "model.safetensors")), load_file(str(run / "checkpoint-2" / "model.safetensors"))
    assert all(v.dtype == torch.float32 for v in b.values())  # autocast keeps fp32 master weights
    assert a.keys() == b.keys()


def test_lora_gradient_checkpointing_same_gradients_on_gpu():
    from ddrl.config import LoraConfig
    from ddrl.models.lora import apply_lora
    from tests.unit.test_lora import ALL, IDS, _assert_same_grads, _grads, randomise_lora_b, tiny_builtin

    model = apply_lora(tiny_builtin(), LoraConfig(rank=4, alpha=8, target_modules=ALL)).cuda()
    randomise_lora_b(model)
    ids = IDS.cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        plain = _grads(model, ids)
        model.gradient_checkpointing_enable()
        checkpointed = _grads(model, ids)
    _assert_same_grads(plain, checkpointed)


def test_llada_8b_shaped_bench_at_reduced_depth():
    bench = load_bench("bench_8b")
    row = bench.main(["--layers", "2", "--prompt-length", "64", "--gen-length", "64", "--block-length", "32",
                      "--steps", "16", "--gradient-checkpointing"])
    assert row["rollout_tok_s"] > 0 and math.isfinite(row["loss"])
    assert row["params_M"] > 1000  # 2 layers at 4096 wide + the 126464-token embeddings and head
    assert row["peak_MB"] is not None and row["peak_MB"] < 60_000  # CUDA peak since before the rollout
