"""HPSv2 with real components: open_clip_torch builds a tiny model saved as an HPS checkpoint; the
expected scores come from open_clip's own PIL transform, tokenizer and forward, and the hpsv2 formula
(diag(image_features @ text_features.T) of the normalized features) written out here."""

from __future__ import annotations

import sys

import pytest
import torch

from ddrl.rewards.pixels import to_pil
from tests.tiny_open_clip import import_open_clip, write_tiny_hps

open_clip = import_open_clip()

from ddrl.rewards.hps import HPSv2Reward, clip_preprocess  # noqa: E402 - after the torchvision guard


@pytest.fixture(scope="module")
def tiny_hps(tmp_path_factory):
    return write_tiny_hps(tmp_path_factory.mktemp("hps"))


def noise_images(n: int, h: int, w: int, seed: int) -> torch.Tensor:
    """Pixel noise inside [0.3, 0.7]: every filter detail shows (antialiasing, bicubic vs bilinear), and
    bicubic overshoot never reaches 0 or 1, where PIL clips and a float resize does not."""
    return torch.rand(n, 3, h, w, generator=torch.Generator().manual_seed(seed)) * 0.4 + 0.3


def open_clip_val(resize_mode: str):
    _, _, preprocess = open_clip.create_model_and_transforms("TinyHPS", pretrained=None,
                                                             image_resize_mode=resize_mode)
    return preprocess


# PIL resizes 8-bit pixels in two separable passes and rounds each pass's output to 8 bits; the tensor
# path keeps floats. So they differ by up to about one gray level (half a level per pass, the second
# pass's filter gain slightly above 1): 1.25/255 before the normalisation, / 0.2613 (the smallest std)
# ~ 0.019 after it: atol 0.02. Rounding is unbiased, so the mean difference stays far smaller.
PIXEL_ATOL = 0.02


@pytest.mark.parametrize("resize_mode,h,w", [("longest", 48, 48), ("longest", 40, 24), ("longest", 20, 28),
                                             ("shortest", 48, 48), ("shortest", 24, 40)])
def test_tensor_preprocessing_is_open_clips_pil_transform(tiny_hps, resize_mode, h, w):
    images = noise_images(2, h, w, seed=h + w)
    expected = torch.stack([open_clip_val(resize_mode)(p) for p in to_pil(images)])
    mean, std = open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD
    got = clip_preprocess(images, 32, mean, std, resize_mode=resize_mode)
    assert got.shape == expected.shape == (2, 3, 32, 32)
    torch.testing.assert_close(got, expected, atol=PIXEL_ATOL, rtol=0)
    assert (got - expected).abs().mean() < 0.006, (got - expected).abs().mean()


def test_hpsv2_is_the_cosine_of_open_clips_features(tiny_hps):
    config, checkpoint = tiny_hps
    reward = HPSv2Reward(checkpoint, arch=config)
    images = noise_images(3, 48, 48, seed=1)
    captions = ["a red cat on a mat", "two dogs", "the sun over the sea"]
    scores = torch.tensor(reward(["", "", ""], images=images, caption=captions))

    model, _, preprocess = open_clip.create_model_and_transforms("TinyHPS", pretrained=None, output_dict=True,
                                                                 image_resize_mode="longest")
    model.load_state_dict(torch.load(checkpoint, weights_only=True)["state_dict"])
    model.eval()
    tokens = open_clip.get_tokenizer("TinyHPS")(captions)
    with torch.no_grad():
        # hpsv2's img_score: the forward's (normalized) features, image_features @ text_features.T, diagonal
        out = model(torch.stack([preprocess(p) for p in to_pil(images)]), tokens)
        expected = torch.diagonal(out["image_features"] @ out["text_features"].T)
        # the same formula on ddrl's own pixels, from the unnormalized encoders: no preprocessing tolerance
        pixels = clip_preprocess(images, 32, open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD)
        image = torch.nn.functional.normalize(model.encode_image(pixels), dim=-1)
        text = torch.nn.functional.normalize(model.encode_text(tokens), dim=-1)
        exact = (image * text).sum(-1)
    torch.testing.assert_close(scores, exact, rtol=1e-5, atol=1e-6)
    # a pixel error of PIXEL_ATOL moves a cosine of this model by far less than 1e-3 (measured ~1e-4)
    torch.testing.assert_close(scores, expected, rtol=0, atol=1e-3)
    assert len(set(scores.tolist())) == 3  # the captions matter: not one constant
    # a direct call may name the text column prompt; a text task (no images) scores None, never raises
    assert reward(["", "", ""], images=images, prompt=captions) == pytest.approx(scores.tolist(), abs=1e-6)
    assert reward(["a"], prompt=["x"]) == [None]


def test_hpsv2_loads_only_local_hps_checkpoints(tiny_hps, tmp_path):
    config, checkpoint = tiny_hps
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        HPSv2Reward(tmp_path / "HPS_v2.1_compressed.pt", arch=config)
    bare = tmp_path / "bare.pt"
    torch.save(torch.load(checkpoint, weights_only=True)["state_dict"], bare)  # weights without the HPS wrapper
    with pytest.raises(ValueError, match="no 'state_dict' key"):
        HPSv2Reward(bare, arch=config)
    with pytest.raises(ValueError, match="does not fit open_clip ViT-B-32"):
        HPSv2Reward(checkpoint, arch="ViT-B-32")
    with pytest.raises(ValueError, match="open_clip has no model"):
        HPSv2Reward(checkpoint, arch="ViT-Nonexistent")


def test_hpsv2_without_open_clip_names_the_extra(tiny_hps, monkeypatch):
    monkeypatch.setitem(sys.modules, "open_clip", None)  # import open_clip now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'ddrl\[hps\]'"):
        HPSv2Reward(tiny_hps[1], arch=tiny_hps[0])
