"""Gradient checkpointing in the paper's LoRA recipes is on exactly where the memory model
(ddrl.training.memory) says a step needs it: it recomputes every block's forward in backward, a
third of the update's compute, so a recipe that fits without it leaves it off. A full fine-tuning
recipe that only fits through row chunks (UniGRPO's 35 masked copies) says so."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddrl.config import RLConfig, load_config
from ddrl.training.memory import GB, estimate_memory, model_shape

ROOT = Path(__file__).resolve().parents[2]
BUDGET = 70 * GB  # an 80 GB GPU less ~10 GB for the CUDA context, NCCL and fragmentation (not modelled)
LORA = [p for p in sorted((ROOT / "configs/paper").rglob("*.yaml"))
        if load_config(p, [], RLConfig).model.lora.rank > 0]


@pytest.mark.parametrize("config", LORA, ids=lambda p: str(p.relative_to(ROOT / "configs/paper")))
def test_lora_recipes_checkpoint_only_when_they_must(config):
    cfg = load_config(config, [], RLConfig)
    without = load_config(config, ["model.gradient_checkpointing=false"], RLConfig)
    shape = model_shape(cfg.model.path)
    worlds = [w for w in (1, 8) if cfg.train.prompts_per_step % w == 0]
    fits = all(estimate_memory(without, shape, w).total <= BUDGET for w in worlds)
    assert cfg.model.gradient_checkpointing == (not fits), (
        f"{config.name}: without gradient checkpointing the estimate is "
        f"{[round(estimate_memory(without, shape, w).total / GB) for w in worlds]} GB at {worlds} GPUs")
    if cfg.model.gradient_checkpointing:
        assert all(estimate_memory(cfg, shape, w).total <= BUDGET for w in worlds)
    text = config.read_text()  # the reason, in its header or in its base's
    base = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("base:")), None)
    if base is not None:
        text += (config.parent / base).read_text()
    assert "Memory: gradient checkpointing" in text


def test_unigrpo_recipe_fits_8_gpus_only_through_its_copy_row_chunks():
    """35 masked copies of a group's 8 rows in one forward/backward held ~92 GB of checkpointed
    activations per rank; the recipe cuts them into train.micro_batch_rows chunks (same gradient:
    tests/unit/test_random_ratio_row_chunks.py) and its header says why."""
    path = ROOT / "configs/paper/unigrpo_llada8b.yaml"
    cfg = load_config(path, [], RLConfig)
    shape = model_shape(cfg.model.path)
    uncut = load_config(path, ["train.micro_batch_rows=null", "train.micro_batch_size=8"], RLConfig)
    assert estimate_memory(uncut, shape, 8).total > 80 * GB
    est = estimate_memory(cfg, shape, 8)
    assert est.total <= BUDGET, est.report()
    assert est.phases["update"]["activations (checkpointed)"] < 0.3 * estimate_memory(
        uncut, shape, 8).phases["update"]["activations (checkpointed)"]
    assert "Memory: backward runs per micro-batch of train.micro_batch_rows" in path.read_text()
