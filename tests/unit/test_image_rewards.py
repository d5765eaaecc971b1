"""Image rewards with real components: PickScore / CLIP score through transformers' CLIPModel from a
local directory (a tiny random CLIP saved in the official layout), scoring decoded images."""

from __future__ import annotations

import pytest
import torch

from ddrl.rewards import CompositeReward
from ddrl.rewards.model_based import CLIPImageReward, clip_score_reward, pickscore_reward
from ddrl.rewards.pixels import to_pil, to_uint8
from tests.tiny_clip import write_tiny_clip


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return write_tiny_clip(tmp_path_factory.mktemp("clip"))


def test_pickscore_is_logit_scale_times_cosine_over_26(clip_dir):
    from transformers import CLIPModel, CLIPProcessor

    images = torch.rand(3, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    prompts = ["a red cat", "a dog", "the sun"]
    scores = pickscore_reward(clip_dir)([""] * 3, images=images, prompt=prompts)
    # the same numbers from CLIP's own forward (logits_per_image = logit_scale * cos), an independent path
    model, processor = CLIPModel.from_pretrained(clip_dir).eval(), CLIPProcessor.from_pretrained(clip_dir)
    inputs = processor(text=prompts, images=to_pil(images), return_tensors="pt", padding=True)
    with torch.no_grad():
        expected = model(**inputs).logits_per_image.diag() / 26.0
    torch.testing.assert_close(torch.tensor(scores), expected, rtol=1e-5, atol=1e-6)
    clip = clip_score_reward(clip_dir)([""] * 3, images=images, prompt=prompts)
    torch.testing.assert_close(torch.tensor(clip), expected * 26.0 / 100.0, rtol=1e-5, atol=1e-6)


def test_image_rewards_weigh_into_a_composite(clip_dir):
    images = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    pick = pickscore_reward(clip_dir)
    brightness = lambda completions, images=None, **_: images.mean(dim=(1, 2, 3)).tolist()  # noqa: E731
    composite = CompositeReward([("pickscore", pick, 2.0), ("brightness", brightness, 0.5)])
    scored = composite.score(["", ""], images=images, prompt=["a cat", "a dog"])
    total, parts = scored.scores, scored.parts
    for i in range(2):
        assert total[i] == pytest.approx(2.0 * parts["pickscore"][i] + 0.5 * parts["brightness"][i])


def test_clip_reward_needs_images_and_a_local_directory(clip_dir, tmp_path):
    reward = CLIPImageReward(clip_dir)
    assert reward(["a", "b"], prompt=["x", "y"]) == [None, None]  # a text task: not applicable, never raises
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        CLIPImageReward(tmp_path / "missing")


def test_to_uint8_and_to_pil_round_trip():
    images = torch.tensor([0.0, 0.5, 1.0, 0.25]).view(1, 1, 2, 2).expand(1, 3, 2, 2)
    assert to_uint8(images)[0, 0].flatten().tolist() == [0, 128, 255, 64]
    picture = to_pil(images)[0]
    assert picture.size == (2, 2) and picture.getpixel((1, 0)) == (128, 128, 128)
