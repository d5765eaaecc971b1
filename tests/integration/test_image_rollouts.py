"""Images are first-class rollouts: an image task's completion ids go through the model's own decoder
(model.decode_images) and the reward receives the pixels, reward(completions, images=[n, 3, H, W] in
[0, 1], **columns), in training and in evaluation; evaluations write a PNG grid with the prompts.

The model is the shipped digits model (a uniform process over 17 gray levels, ids 14..30) given a
decoder by the test: code c is gray level c / 16. The native image families (URSA, MMaDA) bring
their own decoders; this pins the path every one of them takes."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ddrl.config import RLConfig, load_config
from ddrl.data import task_completions
from ddrl.models.diffusion_lm import DiffusionLM
from ddrl.tasks.digits import DigitsTask
from tests.integration.conftest import ROOT

FIRST_GRAY = 14  # the digits model's gray-level ids: 14 .. 30


def gray_decoder(self, codes: torch.Tensor) -> torch.Tensor:
    """codes [B, h, w] -> [B, 3, h, w] in [0, 1]: gray level c / 16 on every channel."""
    return (codes.float() / 16.0)[:, None].expand(-1, 3, -1, -1)


@pytest.fixture
def image_decoder(monkeypatch):
    monkeypatch.setattr(DiffusionLM, "decode_images", gray_decoder, raising=False)
    monkeypatch.setattr(DiffusionLM, "image_token_range", (FIRST_GRAY, FIRST_GRAY + 17), raising=False)


class BrightDigits(DigitsTask):
    """Digits as an image task: the reward is the image's mean brightness, read from the pixels."""

    name = "bright_digits"
    modality = "image"
    image_grid = (8, 8)

    def __init__(self):
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def reward(self, completions, *, images=None, **columns):
        assert images is not None, "an image task's reward must receive the decoded images"
        self.seen.append(images)
        return images.mean(dim=(1, 2, 3)).tolist()

    def correct(self, completions, *, images=None, **columns):
        return [bool(v > 0.25) for v in images.mean(dim=(1, 2, 3))]


def make():
    return BrightDigits()


def _overrides(tmp_path, *extra):
    return ["task.name=tests.integration.test_image_rollouts:make", "train.steps=2", "train.prompts_per_step=2",
            "train.group_size=4", "rollout.steps=2", "eval.n=4", "eval.every=0", "eval.before=false",
            "eval.report_n=4", "train.progress=false", "train.tensorboard=false", f"output_dir={tmp_path}", *extra]


def test_the_reward_receives_the_models_decoded_pixels(image_decoder, tmp_path):
    from ddrl.training.trainer import Trainer

    trainer = Trainer(load_config(ROOT / "configs/rl/udm_grpo_digits.yaml", _overrides(tmp_path), RLConfig))
    batch = trainer.rollout(1)
    trainer.score(batch)
    images = trainer.task.seen[-1]
    assert images.shape == (8, 3, 8, 8) and images.dtype == torch.float32
    expected = (batch.completion_ids - FIRST_GRAY).float().view(8, 1, 8, 8).expand(-1, 3, -1, -1) / 16
    torch.testing.assert_close(images, expected, rtol=0, atol=0)  # row i is completion i, decoded
    torch.testing.assert_close(batch.rewards, expected.mean(dim=(1, 2, 3)))
    assert batch.completions == [""] * 8  # an image has no text


def test_two_step_training_on_an_image_task_saves_picture_grids(image_decoder, tmp_path):
    from ddrl.training.trainer import train

    run = train(ROOT / "configs/rl/udm_grpo_digits.yaml", _overrides(tmp_path))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    samples = [json.loads(line) for line in (run / "eval" / "step-2.jsonl").read_text().splitlines()]
    assert [s["image"] for s in samples] == [f"step-2.png#{i}" for i in range(4)]
    from PIL import Image

    grid = Image.open(run / "eval" / "step-2.png")
    assert grid.size[0] == 4 * 96 and grid.size[1] >= 96  # 4 tiles of 8 px scaled x12, captioned


def test_evaluate_scores_an_image_task(image_decoder):
    import ddrl

    model = ddrl.load_model(ROOT / "checkpoints/digits-uniform")
    result = ddrl.evaluate(model, BrightDigits(), n=6, sampler={"steps": 2, "temperature": 1.0})
    assert result["n"] == 6 and 0.0 <= result["mean_reward"] <= 1.0 and 0.0 <= result["accuracy"] <= 1.0


def test_image_tasks_refuse_models_and_lengths_that_do_not_fit(image_decoder, monkeypatch):
    import ddrl

    model = ddrl.load_model(ROOT / "checkpoints/digits-uniform")
    ids = torch.full((2, 64), FIRST_GRAY)
    with pytest.raises(ValueError, match=r"image grid 8x8 needs 64; set rollout.gen_length=64"):
        task_completions(model, BrightDigits(), ids[:, :60])
    with pytest.raises(ValueError, match=r"outside the image codebook \[14, 31\)"):
        task_completions(model, BrightDigits(), ids - 1)
    monkeypatch.delattr(DiffusionLM, "decode_images")
    with pytest.raises(ValueError, match="needs a model with an image decoder"):
        task_completions(model, BrightDigits(), ids)
