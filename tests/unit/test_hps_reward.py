"""HPSv2 (ddrl/rewards/hps.py) against open_clip's own code, recorded in tests/fixtures/hps/ by
tests/fixtures/make_hps.py: a tiny open_clip model in HPSv2's checkpoint layout, PNG inputs, open_clip's
validation-transform pixels of them and the scores of open_clip's forward with hpsv2's formula.

Without open_clip (it is the optional `hps` extra): ddrl's tensor preprocessing is checked against the
recorded pixels, and the scoring against a stand-in model with open_clip's interface whose scores are
written out here. With open_clip: the committed checkpoint through ddrl's loader gives the recorded scores.
"""

from __future__ import annotations

import importlib.abc
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from ddrl.rewards.hps import HPSv2Reward, clip_preprocess, hpsv2_reward

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "hps"
META = json.loads((FIXTURE / "golden.json").read_text())
GOLDEN = load_file(FIXTURE / "golden.safetensors")
NAMES, CAPTIONS = META["images"], META["captions"]
SIZE = 24  # TinyHPS.json's image_size
MEAN = (0.48145466, 0.4578275, 0.40821073)  # open_clip's OPENAI_DATASET_MEAN / STD, TinyHPS's defaults
STD = (0.26862954, 0.26130258, 0.27577711)

# PIL resizes 8-bit pixels in two separable passes and rounds each pass's output to 8 bits; the tensor
# path keeps floats. So they differ by up to about one gray level (half a level per pass, the second
# pass's filter gain slightly above 1): 1.25/255 before the normalisation, / 0.2613 (the smallest std)
# ~ 0.019 after it: atol 0.02. Rounding is unbiased, so the mean difference stays far smaller.
PIXEL_ATOL = 0.02


def image(name: str) -> torch.Tensor:
    """[1, 3, H, W] in [0, 1]: the PNG open_clip read, as a decoder would hand it to the reward."""
    from PIL import Image

    with Image.open(FIXTURE / f"{name}.png") as im:
        return torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1)[None].float() / 255.0


def recorded_pixels(names: list[str], mode: str = "longest") -> torch.Tensor:
    return torch.stack([GOLDEN[f"{mode}/{n}"] for n in names])


@pytest.mark.parametrize("key", sorted(k for k in GOLDEN if "/" in k))
def test_tensor_preprocessing_is_open_clips_transform(key):
    mode, name = key.split("/")
    got = clip_preprocess(image(name), SIZE, MEAN, STD, resize_mode=mode)
    expected = GOLDEN[key][None]
    assert got.shape == expected.shape == (1, 3, SIZE, SIZE)
    torch.testing.assert_close(got, expected, atol=PIXEL_ATOL, rtol=0)
    assert (got - expected).abs().mean() < 0.006, (got - expected).abs().mean()


class StandInClip(nn.Module):
    """open_clip's interface with features simple enough to write out (`features` below): an image
    gives each channel's mean, top-half minus bottom-half and left-half minus right-half means (so
    padding and its side show), times 3; a caption gives a fixed random row, times 0.5 (scores must
    not depend on the features' norms). Its tokenizer gives the caption's index."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(len(CAPTIONS), 9, generator=torch.Generator().manual_seed(0)))

    @staticmethod
    def tokenize(texts: list[str]) -> torch.Tensor:
        return torch.tensor([[CAPTIONS.index(t)] for t in texts])

    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        half = pixels.shape[-1] // 2
        top, left = pixels[..., :half, :].mean((-2, -1)), pixels[..., :, :half].mean((-2, -1))
        bottom, right = pixels[..., half:, :].mean((-2, -1)), pixels[..., :, half:].mean((-2, -1))
        return 3.0 * torch.cat([pixels.mean((-2, -1)), top - bottom, left - right], dim=-1)

    def encode_text(self, tokens: torch.Tensor) -> torch.Tensor:
        return 0.5 * self.table[tokens[:, 0]]


def expected_scores(pixels: torch.Tensor, captions: list[str], table: np.ndarray) -> np.ndarray:
    """hpsv2's score for the stand-in, in float64 numpy: cos(image features, caption row)."""
    p = pixels.double().numpy()
    h = p.shape[-1] // 2
    feats = np.concatenate([p.mean((-2, -1)), p[..., :h, :].mean((-2, -1)) - p[..., h:, :].mean((-2, -1)),
                            p[..., :, :h].mean((-2, -1)) - p[..., :, h:].mean((-2, -1))], axis=-1)
    rows = table[[CAPTIONS.index(c) for c in captions]].astype(np.float64)
    return (feats * rows).sum(-1) / np.linalg.norm(feats, axis=-1) / np.linalg.norm(rows, axis=-1)


def test_hpsv2_scores_the_cosine_of_the_models_features():
    model = StandInClip()
    table = model.table.detach().numpy()
    reward = HPSv2Reward(model, model.tokenize, size=SIZE, mean=MEAN, std=STD, batch_size=2)
    # on open_clip's own pixels: the formula alone, exact
    pixels = recorded_pixels(NAMES)
    torch.testing.assert_close(reward.score_pixels(pixels, CAPTIONS).double(),
                               torch.from_numpy(expected_scores(pixels, CAPTIONS, table)), rtol=0, atol=1e-6)
    # on images, in batches of 2 (three rows: one batch split), each row with its own caption
    squares = torch.cat([image("square_a"), image("square_b"), image("square_a")])
    captions = [CAPTIONS[0], CAPTIONS[1], CAPTIONS[1]]
    scores = reward(["", "", ""], images=squares, caption=captions)
    expected = expected_scores(recorded_pixels(["square_a", "square_b", "square_a"]), captions, table)
    # each feature averages >= 144 pixels whose errors (within PIXEL_ATOL) are unbiased roundings:
    # the cosines move by <= 4e-4 (measured); 2e-3 still fails a wrong resize, crop or padding side
    assert scores == pytest.approx(expected.tolist(), abs=2e-3)
    assert abs(scores[0] - scores[2]) > 0.05  # the caption matters: not one score per image
    for i, name in enumerate(NAMES[2:], start=2):  # the non-square images, one by one
        got = reward([""], images=image(name), caption=[CAPTIONS[i]])
        assert got == pytest.approx(expected_scores(recorded_pixels([name]), [CAPTIONS[i]], table).tolist(), abs=2e-3)
    # a direct call may name the text column prompt; a text task (no images) scores None, never raises
    assert reward(["", "", ""], images=squares, prompt=captions) == pytest.approx(scores, abs=1e-6)
    assert reward(["a"], prompt=["x"]) == [None]


def test_hpsv2_reward_checks_its_parts():
    with pytest.raises(TypeError, match="encode_image and encode_text"):
        HPSv2Reward(nn.Linear(2, 2), StandInClip.tokenize)
    with pytest.raises(ValueError, match="resize_mode"):
        HPSv2Reward(StandInClip(), StandInClip.tokenize, resize_mode="squash")
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        hpsv2_reward(FIXTURE / "HPS_v2.1_compressed.pt")


class _Refuse(importlib.abc.MetaPathFinder):
    """Makes `import open_clip` fail as a CUDA torchvision beside CPU torch does (a RuntimeError)."""

    def find_spec(self, name, path=None, target=None):
        if name == "open_clip":
            raise RuntimeError("operator torchvision::nms does not exist")
        return None


def test_hpsv2_without_open_clip_says_how_to_install_it(monkeypatch):
    from ddrl.rewards.catalog import image_reward_factory

    monkeypatch.setitem(sys.modules, "open_clip", None)  # import open_clip now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'ddrl\[hps\]'"):
        image_reward_factory("hpsv2")(checkpoint=FIXTURE / "hps.pt", arch=FIXTURE / "TinyHPS.json")
    monkeypatch.delitem(sys.modules, "open_clip")
    monkeypatch.setattr(sys, "meta_path", [_Refuse(), *sys.meta_path])
    with pytest.raises(ImportError, match="torchvision must be the build for this torch"):
        hpsv2_reward(FIXTURE / "hps.pt", arch=FIXTURE / "TinyHPS.json")


def test_importing_the_rewards_loads_no_open_clip():
    code = ("import sys, ddrl.rewards, ddrl.rewards.hps\n"
            "from ddrl.rewards.catalog import image_reward_factory\n"
            "ddrl.rewards.HPSv2Reward, image_reward_factory('hpsv2')\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('open_clip', 'torchvision', 'timm')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_hpsv2_through_open_clip_gives_the_recorded_scores():
    """The committed checkpoint through ddrl's real loader (open_clip builds TinyHPS) gives open_clip's scores.

    Skips where open_clip is not installed. It is the optional `hps` extra, not in `dev`: the only
    torchvision 0.28.0 wheel reachable on the CPU test machines is the CUDA build, which cannot import
    beside CPU torch, and an installed torchvision that cannot import would also break transformers'
    image processors (CLIP, PickScore) for everything else. It runs wherever `pip install 'ddrl[hps]'`
    gets the torchvision build matching torch."""
    pytest.importorskip("open_clip")
    reward = hpsv2_reward(FIXTURE / "hps.pt", arch=FIXTURE / "TinyHPS.json", device="cpu")
    assert (reward.size, reward.mean, reward.std) == (SIZE, MEAN, STD)
    recorded = GOLDEN["scores"]
    # open_clip's own pixels: the loaded weights and tokenizer alone, float32 exact up to summation order
    torch.testing.assert_close(reward.score_pixels(recorded_pixels(NAMES), CAPTIONS), recorded, rtol=1e-5, atol=1e-6)
    # from the images: the pixel differences above (PIL's 8-bit passes) move this random model's cosines
    # by up to 8e-4 (measured); the scores of different images differ by >= 0.03
    scores = [reward([""], images=image(n), caption=[c])[0] for n, c in zip(NAMES, CAPTIONS)]
    assert scores == pytest.approx(recorded.tolist(), abs=2e-3)
    with pytest.raises(ValueError, match="open_clip has no model"):
        hpsv2_reward(FIXTURE / "hps.pt", arch="ViT-Nonexistent")


def _module_with(shapes: dict) -> torch.nn.Module:
    """A module whose state_dict has exactly these dotted names and shapes (zeros): open_clip's layout
    of the committed checkpoint, without open_clip."""
    root = torch.nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        node = root
        for part in path:
            if not hasattr(node, part):
                node.add_module(part, torch.nn.Module())
            node = getattr(node, part)
        node.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape)))
    return root


def test_hpsv2_loads_only_a_checkpoint_that_fits(tmp_path):
    """The committed HPS checkpoint goes into a model of its layout whole (DDP's module. prefixes too);
    a file without HPS's state_dict wrapper, or a model it does not fit, is an error naming the cause."""
    from ddrl.rewards.hps import load_hps_weights

    state = torch.load(FIXTURE / "hps.pt", weights_only=True)
    shapes = {k: v.shape for k, v in state["state_dict"].items()}
    model = _module_with(shapes)
    load_hps_weights(model, {"state_dict": {"module." + k: v for k, v in state["state_dict"].items()}}, "hps.pt", "x")
    for k, v in model.state_dict().items():
        assert torch.equal(v, state["state_dict"][k].float()), k
    with pytest.raises(ValueError, match="no 'state_dict' key"):
        load_hps_weights(model, state["state_dict"], "bare.pt", "x")  # weights without HPS's wrapper
    wider = {k: (v[0] + 1, *v[1:]) if k == next(iter(shapes)) else v for k, v in shapes.items()}
    with pytest.raises(ValueError, match="does not fit Wider: missing \\[\\], unexpected \\[\\], other shapes"):
        load_hps_weights(_module_with(wider), state, "hps.pt", "Wider")
    fewer = dict(list(shapes.items())[1:])
    with pytest.raises(ValueError, match="unexpected \\['" + next(iter(shapes))):
        load_hps_weights(_module_with(fewer), state, "hps.pt", "Fewer")
    missing = tmp_path / "absent.pt"
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        hpsv2_reward(missing)