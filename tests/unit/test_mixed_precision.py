"""Mixed precision that learns: fp32 master weights (and AdamW state) with bf16 compute.

bf16 parameters cannot hold an lr-1e-6 update (it is below half a bf16 ulp at |w| ~ 0.02), so full
fine-tuning keeps fp32 parameters: under FSDP2 fully_shard gets MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32), elsewhere the passes run under torch.autocast(bf16). FSDP2 runs here on a
one-rank gloo group, in this process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ddrl.config import RLConfig, load_config
from ddrl.training import trainer as trainer_mod
from ddrl.training.distributed import compute_context, is_sharded, shard_model

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "checkpoints/mini_sudoku-masked"
RUN = ROOT / "configs/rl/grpo_mini_sudoku.yaml"  # 8-12 blanks; decoded in one step below: rewards vary
FULL_FT_RECIPES = sorted(p.name for p in (ROOT / "configs/paper").glob("*.yaml")
                         if load_config(p, cls=RLConfig).model.lora.rank == 0)


def _overrides(tmp_path: Path, *extra: str) -> list[str]:
    return [f"model.path={MODEL}", "task.name=tests.integration.dense_task:make", "rollout.steps=1", "train.steps=4",
            "train.prompts_per_step=2", "train.group_size=4", "train.lr=1e-6", "train.max_grad_norm=0",
            "train.num_iterations=1", "train.skip_uninformative=false", "eval.n=0", "eval.before=false",
            "train.progress=false", "train.tensorboard=false", f"output_dir={tmp_path}", *extra]


def _recipe_precision(name: str) -> list[str]:
    model = load_config(ROOT / "configs/paper" / name, cls=RLConfig).model
    return [f"model.dtype={model.dtype}", f"model.mixed_precision={model.mixed_precision}"]


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/process-group", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_full_fine_tuning_recipes_compute_in_bf16_over_fp32_weights():
    assert {"stable_drl_llada8b.yaml", "coupled_grpo_llada8b.yaml", "tracerl_llada8b.yaml",
            "udm_grpo_ursa.yaml"} <= set(FULL_FT_RECIPES)
    for name in FULL_FT_RECIPES:
        assert _recipe_precision(name) == ["model.dtype=float32", "model.mixed_precision=bf16"], name


@pytest.mark.parametrize("recipe", ["stable_drl_llada8b.yaml", "tracerl_llada8b.yaml"])
def test_a_full_fine_tune_step_at_lr_1e6_moves_the_weights(recipe, tmp_path):
    trainer = trainer_mod.Trainer(load_config(RUN, _overrides(tmp_path, *_recipe_precision(recipe)), RLConfig))
    assert trainer.autocast is not None and all(p.dtype == torch.float32 for p in trainer.model.parameters())
    for step in range(1, 5):  # the first step whose rewards vary within a group (a gradient to follow)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        if trainer.train_step(step)["grad_norm"] > 0:
            break
    else:
        raise AssertionError("no step had a gradient: test is void")
    moved = {n: p.detach() != before[n] for n, p in trainer.model.named_parameters()}
    weights = [n for n in moved if n.endswith("proj.weight")]  # attention / MLP matrices
    assert weights and all(moved[n].float().mean() > 0.5 for n in weights), "fp32 master weights must take the step"
    # the same update applied to bf16 weights: rounded away almost everywhere
    for n in weights:
        w, w1 = before[n], trainer.model.get_parameter(n).detach()
        kept = (w.bfloat16().float() + (w1 - w)).bfloat16() == w.bfloat16()
        assert kept.float().mean() > 0.95


def test_autocast_only_where_fsdp_does_not_cast():
    x = torch.randn(2, 3)
    with compute_context(torch.device("cpu"), "bf16", "ddp"):
        assert (x @ x.T).dtype == torch.bfloat16
    with compute_context(torch.device("cpu"), "bf16", "fsdp"):  # the policy casts the parameters instead
        assert (x @ x.T).dtype == torch.float32
    with compute_context(torch.device("cpu"), "none", "none"):
        assert (x @ x.T).dtype == torch.float32


def test_fsdp_computes_in_bf16_over_fp32_shards(one_rank_group):
    from ddrl.models import load_model

    model = load_model(MODEL)
    seen: list[torch.dtype] = []
    linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    linear.register_forward_pre_hook(lambda module, args: seen.append(module.weight.dtype))
    shard_model(model, torch.device("cpu"), "bf16")
    logits = model(torch.tensor([[3, 4, 5, 1, 1]])).logits
    logits.float().logsumexp(-1).sum().backward()
    assert seen == [torch.bfloat16] and logits.dtype == torch.bfloat16  # compute in bf16
    for p in model.parameters():  # what AdamW updates: fp32 shards with fp32 gradients
        assert isinstance(p, DTensor) and p.dtype == torch.float32 and p.grad.dtype == torch.float32


def test_trainer_shards_policy_and_reference_alike_and_learns_at_lr_1e6(one_rank_group, tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_mod, "resolve_strategy", lambda strategy, info: "fsdp")  # FSDP2 on one rank
    cfg = load_config(RUN, _overrides(tmp_path, "model.mixed_precision=bf16", "method.objective_args.beta=0.04",
                                       "train.sync_ref_every=1", "dist.strategy=fsdp"), RLConfig)
    trainer = trainer_mod.Trainer(cfg)
    assert is_sharded(trainer.model) and is_sharded(trainer.ref_model)  # no full reference copy per rank
    for step in range(1, 5):  # the first step whose rewards vary within a group
        before = [p.to_local().clone() for p in trainer.model.parameters()]
        if trainer.train_step(step)["grad_norm"] > 0:
            break
    else:
        raise AssertionError("no step had a gradient: test is void")
    assert any(not torch.equal(p.to_local(), b) for p, b in zip(trainer.model.parameters(), before))
    trainer.sync_reference()
    for r, p in zip(trainer.ref_model.parameters(), trainer.model.parameters()):
        assert isinstance(r, DTensor) and torch.equal(r.to_local(), p.to_local())
