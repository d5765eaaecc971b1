"""Memory that fits: a replicated full fine-tune of a model too big for one device is refused before
any of it reaches the device, with the fix named (dist.strategy=fsdp or LoRA)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ddrl.config import RLConfig, load_config
from ddrl.training import trainer as trainer_mod
from ddrl.training.distributed import check_memory_fits, training_state_bytes

ROOT = Path(__file__).resolve().parents[2]
GB = 10**9
LLADA_8B = 8_000_000_000


def test_an_8b_full_fine_tune_does_not_replicate_on_an_80gb_device():
    state = 16 * LLADA_8B  # fp32 weights + gradients + AdamW's two moments
    reference = 4 * LLADA_8B  # the frozen fp32 reference copy
    for strategy in ("ddp", "none"):
        with pytest.raises(ValueError, match=r"replicates the model.*dist\.strategy=fsdp.*model\.lora\.rank"):
            check_memory_fits(state, reference, 80 * GB, strategy=strategy, world_size=8)
    check_memory_fits(state, reference, 80 * GB, strategy="fsdp", world_size=8)  # 20 GB per device
    with pytest.raises(ValueError, match=r"FSDP over 2 devices.*need >= 3"):  # 80 GB each on 2 of 70 GB
        check_memory_fits(state, reference, 70 * GB, strategy="fsdp", world_size=2)
    check_memory_fits(state, reference, None, strategy="ddp", world_size=8)  # the CPU: not checked
    # LoRA: a frozen bf16 base (2 bytes per weight) and a few trainable fp32 adapters fit replicated
    check_memory_fits(2 * LLADA_8B + 16 * 50_000_000, 0, 80 * GB, strategy="ddp", world_size=8)


def test_training_state_counts_16_bytes_per_trainable_fp32_weight():
    model = torch.nn.Linear(10, 10, bias=False)  # 100 weights
    assert training_state_bytes(model, reference_copy=False) == (1600, 0)
    assert training_state_bytes(model, reference_copy=True) == (1600, 400)
    model.weight.requires_grad_(False)
    model.to(torch.bfloat16)
    assert training_state_bytes(model, reference_copy=False) == (200, 0)  # a frozen bf16 base


def test_the_trainer_refuses_a_model_its_device_cannot_hold(tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_mod, "device_memory", lambda device: 1_000_000)  # a 1 MB device
    cfg = load_config(ROOT / "configs/rl/grpo_mini_sudoku.yaml",
                      [f"output_dir={tmp_path}", "eval.n=0", "train.progress=false", "train.tensorboard=false"],
                      RLConfig)
    # the full estimate (ddrl.training.memory), its terms listed, the fixes named
    with pytest.raises(ValueError, match=r"(?s)needs ~.* GB per device.*weights.*dist\.strategy=fsdp.*dist\.cpu_offload"):
        trainer_mod.Trainer(cfg)
