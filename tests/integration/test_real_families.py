"""Done-when of real checkpoints: every family, in its official checkpoint layout, loads natively,
samples with the reference and the fast path, trains 2 steps (full and LoRA) and saves/reloads.

The checkpoints are the tiny official-format ones of tests/fixtures/<family>/model (config.json
with the authors' field names, their weight names, their tokenizer layout), written by
tests/fixtures/make_<family>.py from the authors' own code; their logits and samplers are checked
against the authors' outputs in tests/unit/test_native_<family>.py.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ddrl
from ddrl.models.native.base import read_weights
from ddrl.training.trainer import train
from tests.integration.conftest import ROOT

FIXTURES = ROOT / "tests" / "fixtures"
FAMILIES = ["llada", "mmada", "dream", "sdar", "llada2"]
MODEL_DIRS = {"llada2": "llada2/model-2.0"}  # LLaDA2.0 (2.1's tiny checkpoint differs only in seed)
BLOCK_FAMILIES = ("sdar", "llada2")
# LoRA targets by the family's own module names (LLaDA's blocks have no o_proj / gate_proj / down_proj).
LORA_TARGETS = {"llada": "[q_proj, k_proj, v_proj, attn_out, ff_proj, up_proj, ff_out]",
                "mmada": "[q_proj, k_proj, v_proj, attn_out, ff_proj, up_proj, ff_out]",
                "dream": "[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]",
                "sdar": "[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]",
                # LLaDA2: attention, dense MLP, shared and routed experts; the router (mlp.gate) is no Linear
                "llada2": "[query_key_value, dense, gate_proj, up_proj, down_proj]"}


@pytest.fixture(params=FAMILIES)
def checkpoint(request, tmp_path) -> tuple[str, Path]:
    family = request.param
    target = tmp_path / family
    shutil.copytree(FIXTURES / MODEL_DIRS.get(family, f"{family}/model"), target)
    return family, target


def _prompts(model) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [model.tokenizer.encode_prompt(t) for t in ("Say a", "Write the letter a please")]
    P = max(len(r) for r in rows)
    ids = torch.tensor([[model.pad_token_id] * (P - len(r)) + r for r in rows])
    mask = torch.tensor([[False] * (P - len(r)) + [True] * len(r) for r in rows])
    return ids, mask


def test_loads_natively_samples_and_round_trips(checkpoint, tmp_path):
    family, path = checkpoint
    model = ddrl.load_model(path).eval()
    assert model.family == family
    assert not any(type(m).__module__.startswith("transformers_modules") for m in model.modules())  # no remote code
    ids, mask = _prompts(model)
    block = model.block_size or 8
    kwargs = dict(steps=8, gen_length=8, block_length=block if model.block_size else 8, temperature=0.0,
                  mask_id=model.mask_token_id)
    reference = ddrl.generate(model, ids, mask, cache="none", **kwargs)
    fast = ddrl.generate(model, ids, mask, cache="auto" if model.block_size else "dual", **kwargs)
    for out in (reference, fast):
        assert out.shape == (2, ids.shape[1] + 8)
        assert int(out.max()) < len(model.tokenizer)  # sampling stays in the tokenizer's vocabulary
    if model.block_size:
        assert torch.equal(fast, reference)  # the block cache is exact
    assert isinstance(model.tokenizer.decode(reference[0, ids.shape[1]:]), str)

    seq = torch.cat([ids, reference[:, ids.shape[1]:]], 1)
    attn = torch.cat([mask, torch.ones(2, 8, dtype=torch.bool)], 1)
    with torch.no_grad():
        before = model(seq, attention_mask=attn).logits
    model.save_pretrained(tmp_path / "saved")
    again = ddrl.load_model(tmp_path / "saved").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(seq, attention_mask=attn).logits, before, atol=0, rtol=0)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_two_step_train_gives_a_finite_loss_and_moves_parameters(checkpoint, lora, tmp_path):
    family, path = checkpoint
    block_model = family in BLOCK_FAMILIES
    overrides = [f"model.path={path}", "task.name=tests.integration.text_task:make", "task.args={}", "train.steps=2",
                 "train.prompts_per_step=2", "train.group_size=2", "train.lr=1e-2", "train.save_every=2",
                 "eval.n=2", "eval.every=0", "eval.before=false", "train.progress=false",
                 "train.tensorboard=false", f"output_dir={tmp_path / 'run'}",
                 f"rollout.name={'block' if block_model else 'masked'}", "rollout.gen_length=8", "rollout.steps=8",
                 "rollout.block_length=null" if block_model else "rollout.block_length=8",
                 "method.estimator_args={p_mask_prompt: 0.0}"]
    if lora:
        overrides += ["model.lora.rank=4", "model.lora.alpha=8", f"model.lora.target_modules={LORA_TARGETS[family]}"]
    run = train(ROOT / "configs/rl/grpo_mini_sudoku.yaml", overrides)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in rows), rows
    saved = run / "checkpoint-2"
    if lora:
        adapter = load_file(saved / "adapter" / "adapter_model.safetensors")
        assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapter.items())
        assert not any("transformer.ff_out" in k and "blocks" not in k for k in adapter)  # never the LM head
        assert not any("mlp.gate." in k for k in adapter)  # never the router
    else:
        a, b = read_weights(path), read_weights(saved)  # single or sharded safetensors
        assert set(a) == set(b)  # the official weight names are kept
        assert max((a[k].float() - b[k].float()).abs().max().item() for k in a) > 0
        if family == "llada2":  # full fine-tuning trains the router; its expert_bias is a buffer
            assert (a["model.layers.1.mlp.gate.weight"] != b["model.layers.1.mlp.gate.weight"]).any()
            assert torch.equal(a["model.layers.1.mlp.gate.expert_bias"], b["model.layers.1.mlp.gate.expert_bias"])
    reloaded = ddrl.load_model(saved)
    assert reloaded.family == family


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_diffusion_gemma_two_step_train(lora, tmp_path):
    """DiffusionGemma stays on transformers' own class (pinned 5.24.0): a 2-step UDM-GRPO run on its
    uniform process, full and LoRA (text layers only, the vision tower excluded)."""
    from tests.unit.test_hf_models import CANVAS, write_tiny_diffusion_gemma

    path = write_tiny_diffusion_gemma(tmp_path / "dg")
    overrides = [f"model.path={path}", "task.name=tests.integration.text_task:make", "task.args={}", "train.steps=2",
                 "train.prompts_per_step=2", "train.group_size=2", "train.lr=1e-2", "train.save_every=2",
                 "eval.n=2", "eval.every=0", "eval.before=false", "train.progress=false",
                 f"output_dir={tmp_path / 'run'}", f"rollout.gen_length={CANVAS}", "rollout.steps=2"]
    if lora:
        overrides += ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.target_modules=[q_proj, v_proj]",
                      "model.lora.exclude_modules=['re:.*vision.*']"]
    run = train(ROOT / "configs/rl/udm_grpo_digits.yaml", overrides)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows), rows
    saved = run / "checkpoint-2"
    if lora:
        adapter = load_file(saved / "adapter" / "adapter_model.safetensors")
        assert adapter and not any("vision" in k for k in adapter)
        assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapter.items())
    else:
        a, b = load_file(path / "model.safetensors"), load_file(saved / "model.safetensors")
        assert max((a[k].float() - b[k].float()).abs().max().item() for k in a if k in b) > 0
    assert ddrl.load_model(saved).family == "diffusion_gemma"


@pytest.mark.parametrize("family,sampler_args", [
    ("dream", ["--sampler", "dream", "--alg", "entropy", "--top-p", "0.95"]),
    ("sdar", ["--remasking", "sdar_dynamic", "--threshold", "0.9"]),
    ("llada", ["--cache", "dual"]),
    ("llada2", []),  # rollout.name auto: the block sampler (2.0); 2.1's is checked in test_native_llada2
])
def test_eval_json_runs_each_family_with_its_own_sampler(family, sampler_args, capsys):
    """`ddrl eval --json` on an official-format directory, with the family's own sampler settings."""
    from ddrl.cli import main

    code = main(["eval", "--model", str(FIXTURES / MODEL_DIRS.get(family, f"{family}/model")), "--task", "tests.integration.text_task:make",
                 "--n", "2", "--steps", "8", "--gen-length", "8", "--json", *sampler_args])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code in (0, None) and result["n"] == 2 and 0.0 <= result["mean_reward"] <= 1.0
