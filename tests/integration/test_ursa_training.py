"""UDM-GRPO's own system on the tiny URSA pipeline (tests/fixtures/ursa/model, made by the authors'
code): text-to-image prompts laid out as URSA's pipeline lays them, rollouts by the metric-path CTMC,
images decoded by the pipeline's VQ decoder and scored by PickScore (a tiny random CLIP) or by a
reward server on loopback, and a few UDM-GRPO steps that move the weights."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import ddrl
from ddrl.config import RLConfig, load_config
from tests.integration.conftest import ROOT
from tests.tiny_clip import write_tiny_clip

URSA = ROOT / "tests/fixtures/ursa/model"
PROMPTS = ["a red cat", "is it", "blue tree on a hill", "sun"]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return write_tiny_clip(tmp_path_factory.mktemp("clip"))


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    test = tmp_path / "test.txt"
    test.write_text("green sea\n")
    return path, test


def overrides(out: Path, train: Path, test: Path, reward: str, *extra: str) -> list[str]:
    return [f"model.path={URSA}", "model.dtype=float32", "model.mixed_precision=none", "task.name=text_to_image",
            f"task.args={{image_grid: [4, 4], train_path: {train}, test_path: {test}, dev_fraction: 0.0, "
            f"reward: {reward}}}",
            "rollout.name=metric_path", "rollout.gen_length=16", "rollout.steps=4", "rollout.cfg_scale=0.0",
            "method.objective=udm_grpo", "train.steps=2", "train.prompts_per_step=2", "train.group_size=2",
            "train.lr=1e-2", "eval.n=0", "eval.every=0", "eval.before=false", "train.progress=false",
            "train.tensorboard=false", "train.save_every=0", "dist.strategy=none", f"output_dir={out}", *extra]


def test_trainer_prompts_are_ursas_own_layout(prompt_file, clip_dir, tmp_path):
    """ddrl's trainer tokenizes and left-pads prompts with no URSA case: URSA's tokenizer gives every
    prompt the pipeline's fixed-length layout, so the batch is model.encode_prompts' (mask all ones)."""
    from ddrl.training.trainer import Trainer

    train, test = prompt_file
    reward = json.dumps("pickscore") + f", reward_args: {{model: {clip_dir}}}"
    trainer = Trainer(load_config(ROOT / "configs/rl/udm_grpo_digits.yaml",
                                  overrides(tmp_path / "run", train, test, reward), RLConfig))
    batch = trainer.rollout(1)
    texts = [ex["prompt"] for ex in batch.examples]
    ids, mask = trainer.model.encode_prompts(texts)
    assert ids.shape[1] == 320 + 1  # the released max_prompt_length, then <bov>
    assert torch.equal(batch.prompt_ids.cpu(), ids) and torch.equal(batch.prompt_mask.cpu().long(), mask)
    assert bool((batch.prompt_ids[:, -1] == trainer.model.bov_token_id).all())
    lo, hi = trainer.model.image_token_range
    codes = batch.completion_ids
    assert codes.shape == (4, 16) and bool(((codes >= lo) & (codes < hi)).all())


def test_tokenizer_encodes_the_pipeline_layout():
    model = ddrl.load_model(URSA)
    model.max_prompt_length = 8
    row = model.tokenizer.encode_prompt("red cat")
    hf = model.tokenizer.tokenizer("red cat").input_ids
    assert row == [model.pad_token_id] * (8 - len(hf)) + hf + [model.bov_token_id]
    long = model.tokenizer.encode_prompt("a very long caption of many words")
    assert len(long) == 9 and long[:-1] == model.tokenizer.tokenizer("a very long caption of many words").input_ids[:8]


def _moved(run: Path) -> float:
    """Largest change of any transformer weight between the fixture and the run's last checkpoint."""
    from safetensors.torch import load_file

    name = "transformer/diffusion_pytorch_model.safetensors"
    a, b = load_file(URSA / name), load_file(run / "checkpoint-2" / name)
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _check_run(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["reward/mean"]) for r in rows), rows
    assert _moved(run) > 0, "parameters did not change"
    return rows


def test_udm_grpo_trains_with_pickscore(prompt_file, clip_dir, tmp_path):
    """A 2-step UDM-GRPO run: metric-path rollouts decoded by the pipeline's VQ decoder, scored by PickScore
    (a tiny random CLIP), grid states re-noised by the metric path; finite loss, moved weights, and the
    run's last checkpoint is an URSA pipeline ddrl reloads."""
    from ddrl.training.trainer import train

    train_file, test_file = prompt_file
    reward = json.dumps("pickscore") + f", reward_args: {{model: {clip_dir}}}"
    run = train(ROOT / "configs/rl/udm_grpo_digits.yaml",
                overrides(tmp_path / "run", train_file, test_file, reward, "method.estimator_args={}"))
    _check_run(run)
    reloaded = ddrl.load_model(run / "checkpoint-2")
    assert reloaded.family == "ursa" and reloaded.tokenizer.encode_prompt("sun")[-1] == reloaded.bov_token_id


def test_udm_grpo_trains_with_a_served_reward(prompt_file, clip_dir, tmp_path):
    """The same with PickScore served over HTTP on loopback (ddrl serve-reward's server): the images travel
    as PNG, the caption as JSON."""
    from ddrl.rewards.model_based import pickscore_reward
    from ddrl.rewards.server import serve_reward
    from ddrl.training.trainer import train

    server = serve_reward(pickscore_reward(clip_dir), background=True)
    try:
        train_file, test_file = prompt_file
        reward = json.dumps("server") + f", reward_args: {{url: {server.url}}}"
        run = train(ROOT / "configs/rl/udm_grpo_digits.yaml",
                    overrides(tmp_path / "run", train_file, test_file, reward, "method.estimator_args={}"))
    finally:
        server.shutdown()
        server.server_close()
    _check_run(run)


def test_lora_reference_is_the_adapter_disabled(prompt_file, tmp_path):
    """With LoRA (their `disable_adapter` branch) the reference is the policy with its adapter off: no
    second copy, a KL of 0 at the first step and above 0 once the adapter has moved."""
    from ddrl.rewards.server import serve_reward
    from ddrl.training.trainer import Trainer

    server = serve_reward(lambda completions, images=None, **_: images.mean(dim=(1, 2, 3)).tolist(), background=True)
    try:
        train_file, test_file = prompt_file
        reward = json.dumps("server") + f", reward_args: {{url: {server.url}}}"
        trainer = Trainer(load_config(ROOT / "configs/rl/udm_grpo_digits.yaml", overrides(
            tmp_path / "run", train_file, test_file, reward, "method.estimator_args={}", "model.lora.rank=4",
            "model.lora.alpha=8"), RLConfig))
        assert trainer.ref_model is None
        first, second = trainer.train_step(1), trainer.train_step(2)
    finally:
        server.shutdown()
        server.server_close()
    assert first["loss/kl"] == 0.0 and second["loss/kl"] > 0 and math.isfinite(second["loss/total"])
