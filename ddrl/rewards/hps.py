"""HPSv2 (Wu et al. 2023, Human Preference Score v2): an image reward from a fine-tuned open_clip model.

The score of an image for a caption is the cosine of the model's normalized image and text features,
exactly what hpsv2's `img_score.score` returns (tgxs002/HPSv2 @ 866735e: `image_features @
text_features.T`, the diagonal, with features from the model's forward, normalized) and what MaskGRPO
rewards with as it is, unscaled (grpo/reward_func.py `hpsv2` @ b74ba3c). Scores sit near 0.2-0.35.

Model: open_clip's ViT-H-14 (the default `arch`) with HPS_v2_compressed.pt or HPS_v2.1_compressed.pt
(the weights under the checkpoint's "state_dict" key). Everything is local: open_clip builds the
architecture with pretrained=None (it downloads nothing) and ddrl loads the checkpoint itself.
`arch` may also be an open_clip model-config JSON file ({"embed_dim", "vision_cfg", "text_cfg"}),
registered under its file stem. open_clip is used in `load_open_clip_hps` only; `HPSv2Reward` scores
with any module that has open_clip's `encode_image(pixels)` / `encode_text(tokens)` and a tokenizer.

Preprocessing runs on the tensors a reward receives (`images=[n, 3, H, W]` in [0, 1]), as hpsv2's
validation transform does on an image file: 8-bit pixels (the image as saved, `to_uint8`), bicubic
antialiased resize of the longest side to the model's size and zero padding to a square (hpsv2 builds
its transform with light_augmentation=True, i.e. resize_longest_max; open_clip's resize_mode "longest"),
then the model's mean/std. hpsv2 resizes the float tensor (ToTensor comes first in its transform), as
here; square images (every generator here) are simply resized. resize_mode="shortest" gives open_clip's
default instead (shortest side, then a center crop).

Precision: hpsv2 runs under CUDA autocast (fp16); so does this reward on CUDA unless amp=False.
Install: pip install 'ddrl[hps]' (open_clip_torch).
"""

from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from ddrl.rewards.model_based import ModelReward

INSTALL_HINT = "pip install 'ddrl[hps]'"
# OpenAI CLIP's pixel statistics (open_clip's OPENAI_DATASET_MEAN/STD), which ViT-H-14 and HPSv2 use
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


def import_open_clip() -> Any:
    try:
        import open_clip
    except ImportError as e:
        raise ImportError(f"the hpsv2 reward needs open_clip ({e}); install it with: {INSTALL_HINT}") from None
    except RuntimeError as e:  # torchvision (open_clip imports it) fails this way when built for another torch
        raise ImportError(f"open_clip could not import torchvision ({e}): torchvision must be the build for this "
                          f"torch ({torch.__version__}; a CUDA torchvision beside a CPU torch fails so)") from None
    return open_clip


def open_clip_arch(arch: str | Path) -> str:
    """An open_clip model name: a built-in one as it is, or a model-config JSON file registered under its stem."""
    open_clip = import_open_clip()
    path = Path(arch)
    if path.suffix == ".json":
        if not path.is_file():
            raise FileNotFoundError(f"open_clip model config {path} does not exist")
        config = json.loads(path.read_text())
        if not {"embed_dim", "vision_cfg", "text_cfg"} <= set(config):
            raise ValueError(f"{path} is not an open_clip model config: it needs embed_dim, vision_cfg and text_cfg")
        open_clip.add_model_config(path)
        return path.stem
    if str(arch) not in open_clip.list_models():
        raise ValueError(f"open_clip has no model {arch!r}: pass a built-in name (HPSv2 is ViT-H-14) or the path of "
                         f"a model-config .json file")
    return str(arch)


def clip_preprocess(images: Tensor, size: int, mean: tuple[float, ...], std: tuple[float, ...], *,
                    resize_mode: str = "longest", fill: float = 0.0) -> Tensor:
    """[n, 3, H, W] in [0, 1] -> [n, 3, size, size] normalized pixels, as hpsv2's (resize_mode "longest")
    or open_clip's default (resize_mode "shortest") validation transform does on the saved image."""
    from ddrl.rewards.pixels import to_uint8

    if images.dim() != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be [n, 3, H, W], got {list(images.shape)}")
    x = to_uint8(images).float() / 255.0  # the 8-bit image hpsv2 would read from a file
    h, w = x.shape[-2:]
    # torchvision's resize of a float tensor is this interpolate call; torch's own keeps torchvision optional
    resize = functools.partial(torch.nn.functional.interpolate, mode="bicubic", align_corners=False, antialias=True)
    if resize_mode == "longest":
        ratio = max(h, w) / size  # open_clip's ResizeKeepRatio(longest=1): each side round(side / ratio)
        new_h, new_w = round(h / ratio), round(w / ratio)
        if (new_h, new_w) != (h, w):
            x = resize(x, size=(new_h, new_w))
        pad_h, pad_w = size - new_h, size - new_w  # a longest side already at `size` is still padded
        x = torch.nn.functional.pad(x, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2), value=fill)
    elif resize_mode == "shortest":
        scale = size / min(h, w)
        if scale != 1.0:  # torchvision's Resize(int): the shortest side to size, the other int(size * long / short)
            new_h, new_w = (size, int(size * w / h)) if h <= w else (int(size * h / w), size)
            x = resize(x, size=(new_h, new_w))
        top, left = int(round((x.shape[-2] - size) / 2.0)), int(round((x.shape[-1] - size) / 2.0))
        x = x[..., top:top + size, left:left + size]
    else:
        raise ValueError(f"resize_mode must be 'longest' (hpsv2) or 'shortest' (open_clip's default), "
                         f"got {resize_mode!r}")
    mean_t = torch.tensor(mean, dtype=x.dtype).view(1, 3, 1, 1)
    std_t = torch.tensor(std, dtype=x.dtype).view(1, 3, 1, 1)
    return (x - mean_t) / std_t


class HPSv2Reward(ModelReward):
    """HPSv2 score cos(image, caption) of a CLIP model's features (module docstring).

    model:       a module with open_clip's encode_image(pixels [n, 3, size, size]) -> [n, d] and
                 encode_text(tokens) -> [n, d] (`load_open_clip_hps` builds HPSv2's; `hpsv2_reward` does both)
    tokenizer:   texts -> token tensor, as open_clip's get_tokenizer gives
    size, mean, std: the model's input side and pixel normalisation (ViT-H-14's: 224, OpenAI CLIP's)
    text_column: the column with the text the image should show ("caption"; "prompt" on a direct call)
    resize_mode: "longest" (hpsv2) or "shortest" (open_clip's default); amp: CUDA autocast fp16 as hpsv2
    """

    def __init__(self, model: nn.Module, tokenizer: Callable[[list[str]], Tensor], *, size: int = 224,
                 mean: Sequence[float] = OPENAI_MEAN, std: Sequence[float] = OPENAI_STD,
                 text_column: str = "caption", batch_size: int = 16, on_error: float | None = None,
                 resize_mode: str = "longest", amp: bool = True):
        super().__init__(batch_size=batch_size, on_error=on_error)
        if not (isinstance(model, nn.Module) and callable(getattr(model, "encode_image", None))
                and callable(getattr(model, "encode_text", None))):
            raise TypeError(f"model must be a torch module with open_clip's encode_image and encode_text, got "
                            f"{type(model).__name__}; build HPSv2's with hpsv2_reward(checkpoint)")
        if not callable(tokenizer):
            raise TypeError(f"tokenizer must be callable (texts -> token tensor), got {type(tokenizer).__name__}")
        if resize_mode not in ("longest", "shortest"):
            raise ValueError(f"resize_mode must be 'longest' (hpsv2) or 'shortest', got {resize_mode!r}")
        if len(mean) != 3 or len(std) != 3:
            raise ValueError(f"mean and std need one value per RGB channel, got {list(mean)} and {list(std)}")
        self.model: Any = model  # open_clip's model (untyped)
        self.tokenizer = tokenizer
        self.size, self.mean, self.std = int(size), tuple(mean), tuple(std)
        self.text_column, self.resize_mode, self.amp = text_column, resize_mode, amp

    @torch.no_grad()
    def score_pixels(self, pixels: Tensor, texts: list[str]) -> Tensor:
        """hpsv2's score of preprocessed pixels [n, 3, size, size] with their texts: the cosine of the
        normalized image and text features (the diagonal of image_features @ text_features.T)."""
        tokens = self.tokenizer([str(t) for t in texts]).to(self.device)
        autocast = (torch.autocast("cuda", dtype=torch.float16) if self.amp and self.device.type == "cuda"
                    else contextlib.nullcontext())
        with autocast:
            image = nn.functional.normalize(self.model.encode_image(pixels.to(self.device)).float(), dim=-1)
            text = nn.functional.normalize(self.model.encode_text(tokens).float(), dim=-1)
        return (image * text).sum(-1)

    def score_batch(self, completions: list[str], columns: dict[str, list[Any]]) -> Tensor:
        images = columns.get("images")
        texts = columns.get(self.text_column) or columns.get("prompt")  # a direct call may name it prompt
        if images is None or any(im is None for im in images):
            raise ValueError("the hpsv2 reward scores images: call it on an image task (images=[n, 3, H, W])")
        if texts is None or any(t is None for t in texts):
            raise ValueError(f"the hpsv2 reward needs the {self.text_column!r} column")
        pixels = clip_preprocess(torch.stack(list(images)).cpu(), self.size, self.mean, self.std,
                                 resize_mode=self.resize_mode)
        return self.score_pixels(pixels, texts)


def load_hps_weights(model: nn.Module, state: Any, source: str, arch: str) -> None:
    """An HPS checkpoint's weights ({"state_dict": ...}, DDP's "module." prefixes allowed) into `model`,
    which must take every one of them at its shape; anything else is an error naming what differs."""
    if not isinstance(state, dict) or "state_dict" not in state:
        raise ValueError(f"{source} is not an HPSv2 checkpoint: it has no 'state_dict' key (found "
                         f"{sorted(state)[:5] if isinstance(state, dict) else type(state).__name__})")
    weights = {k.removeprefix("module."): v for k, v in state["state_dict"].items()}  # DDP-saved copies
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    missing, unexpected = sorted(set(shapes) - set(weights)), sorted(set(weights) - set(shapes))
    resized = sorted(k for k in set(shapes) & set(weights) if tuple(weights[k].shape) != tuple(shapes[k]))
    if missing or unexpected or resized:
        raise ValueError(f"{source} does not fit {arch}: missing {missing[:3]}, unexpected {unexpected[:3]}, "
                         f"other shapes {resized[:3]}; pass the arch it was trained as (arch=; HPSv2 is ViT-H-14)")
    model.load_state_dict(weights)  # into the float32 model, whatever the checkpoint's dtype


def load_open_clip_hps(checkpoint: str | Path, arch: str | Path = "ViT-H-14") -> tuple[nn.Module, Any, dict]:
    """open_clip's `arch` with the weights of a local HPS checkpoint ({"state_dict": ...}), its tokenizer,
    and its preprocessing {size, mean, std}: everything of HPSv2 that open_clip builds."""
    checkpoint = Path(checkpoint)
    if not checkpoint.is_file():
        raise FileNotFoundError(f"HPSv2 checkpoint {checkpoint} does not exist; nothing is downloaded: pass a "
                                f"local copy of HPS_v2.1_compressed.pt (or HPS_v2_compressed.pt, from xswu/HPSv2)")
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    open_clip = import_open_clip()
    name = open_clip_arch(arch)
    model = open_clip.create_model(name, pretrained=None)  # the architecture only
    load_hps_weights(model, state, f"{checkpoint}", f"open_clip {name}")
    cfg = model.visual.preprocess_cfg
    size = cfg["size"] if isinstance(cfg["size"], int) else cfg["size"][0]
    return model.eval(), open_clip.get_tokenizer(name), {"size": int(size), "mean": cfg["mean"], "std": cfg["std"]}


def hpsv2_reward(checkpoint: str | Path, *, arch: str | Path = "ViT-H-14", device: str | None = None,
                 **kwargs: Any) -> HPSv2Reward:
    """HPSv2 from a local HPS_v2(.1)_compressed.pt (reward name `hpsv2`; args: checkpoint, arch, device,
    and HPSv2Reward's text_column, batch_size, on_error, resize_mode, amp)."""
    model, tokenizer, preprocess = load_open_clip_hps(checkpoint, arch)
    reward = HPSv2Reward(model, tokenizer, **preprocess, **kwargs)
    return reward.to(device or ("cuda" if torch.cuda.is_available() else "cpu"))
