"""Every paper recipe fits an 80 GB GPU at the GPU counts its header declares, by the memory model's own
estimate (ddrl.training.memory; `ddrl train --dry-run CONFIG --world-size N`), and gradient checkpointing in the LoRA recipes is on exactly where a step needs it: it recomputes every block's
forward in backward, a third of the update's compute, so a recipe that fits without it leaves it off.
A full fine-tuning recipe that only fits through row chunks (UniGRPO's 35 masked copies) says so."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ddrl.config import RLConfig, load_config
from ddrl.training.memory import GB, estimate_memory, model_shape

ROOT = Path(__file__).resolve().parents[2]
BUDGET = 70 * GB  # an 80 GB GPU less ~10 GB for the CUDA context, NCCL and fragmentation (not modelled)
PAPER = sorted((ROOT / "configs/paper").rglob("*.yaml"))
LORA = [p for p in PAPER if load_config(p, [], RLConfig).model.lora.rank > 0]
DEFAULT_GPUS = 8  # one node, when the header names no process counts


def header(config: Path, *, with_base: bool) -> str:
    """The recipe's text, and its base's (where an inherited setting's reason lives)."""
    text = config.read_text()
    base = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("base:")), None)
    return text + (config.parent / base).read_text() if with_base and base is not None else text


def declared_gpus(config: Path, cfg: RLConfig) -> list[int]:
    """The recipe's own "# Processes: run on 1, 2, 4, 5, 10 or 20" counts (a prompts_per_step that does
    not split over 8), one process for dist.strategy none (a one-GPU demo), else 8."""
    for line in header(config, with_base=False).splitlines():
        if line.startswith("# Processes: run on"):
            return [int(n) for n in re.findall(r"\d+", line.split("run on", 1)[1].split("(")[0])]
    return [1] if cfg.dist.strategy == "none" else [DEFAULT_GPUS]


@pytest.mark.parametrize("config", PAPER, ids=lambda p: str(p.relative_to(ROOT / "configs/paper")))
def test_every_recipe_fits_an_80gb_gpu_at_its_gpu_counts(config):
    """`torchrun --nproc_per_node N ddrl train RECIPE` at the recipe's N must not run out of memory: the
    estimate stays under BUDGET. A recipe that does not fit is bounded the way its authors' runs are,
    with their values, and its header's Memory line cites them."""
    cfg = load_config(config, [], RLConfig)
    shape = model_shape(cfg.model.path)
    for world in declared_gpus(config, cfg):
        assert cfg.train.prompts_per_step % world == 0, (
            f"{config.name}: train.prompts_per_step={cfg.train.prompts_per_step} does not split over {world} "
            f"GPUs; say which counts work in the header (# Processes: run on ...)")
        est = estimate_memory(cfg, shape, world)
        assert est.total <= BUDGET, (
            f"{config.name} needs ~{est.total / GB:.1f} GB per GPU at {world} GPUs, over the {BUDGET / GB:.0f} GB "
            f"budget (peak: the {est.peak_phase} phase). Bound it as the authors' runs do, with "
            f"their values, and cite them in a header Memory line: rollout.batch_rows (rows per sampler call) "
            f"for the rollout; train.micro_batch_size, train.micro_batch_rows (TraceRL, random_ratio) or "
            f"model.gradient_checkpointing for the update; dist.cpu_offload for the training state.\n"
            f"{est.report(80 * GB)}")
    bounded = cfg.rollout.batch_rows or cfg.train.micro_batch_rows or cfg.dist.cpu_offload
    assert not bounded or "# Memory:" in header(config, with_base=True), (
        f"{config.name}: rollout.batch_rows / train.micro_batch_rows / dist.cpu_offload is set; its header's "
        f"Memory line says why (the authors' line, or the memory arithmetic)")


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
    assert "Memory: gradient checkpointing" in header(config, with_base=True)  # the reason, its own or its base's


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
