"""Pixels for image rewards: what a reward receives and how to turn it into what a scorer wants.

An image task's reward is called as `reward(completions, images=images, **columns)`, with `images`
a float tensor [n, 3, H, W] in [0, 1], row i decoded from completion i by the model's own decoder
(`model.decode_images`; ddrl.data.task_completions). A scorer that wants PIL images (CLIP and
PickScore processors, OCR engines) converts them with `to_pil`; a reward server receives PNGs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor


def to_uint8(images: Tensor) -> Tensor:
    """[..., 3, H, W] float in [0, 1] -> uint8 0..255 (round to nearest, as PIL and torchvision save)."""
    return (images.detach().float().clamp(0.0, 1.0) * 255.0).round().to(torch.uint8)


def to_pil(images: Tensor) -> list[Any]:
    """[n, 3, H, W] float in [0, 1] (or uint8) -> n RGB PIL images, for scorers that take PIL input."""
    from PIL import Image

    if images.dim() != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be [n, 3, H, W], got {list(images.shape)}")
    pixels = images if images.dtype == torch.uint8 else to_uint8(images)
    return [Image.fromarray(img.permute(1, 2, 0).cpu().numpy(), mode="RGB") for img in pixels]


def save_image_grid(images: Tensor, path: str | Path, *, captions: Sequence[str] | None = None,
                    columns: int = 4, scale: int | None = None) -> Path:
    """Write images [n, 3, H, W] (float in [0, 1] or uint8) as one PNG grid, each tile captioned with
    its prompt (cut to fit). Small images (digits are 8x8) are scaled up by whole pixels to ~96 px."""
    from PIL import Image, ImageDraw

    tiles = to_pil(images)
    h, w = images.shape[-2:]
    scale = scale or max(1, 96 // max(h, w))
    cell_w, cell_h, caption_h = w * scale, h * scale, 12 if captions else 0
    rows = -(-len(tiles) // columns)
    grid = Image.new("RGB", (columns * cell_w, rows * (cell_h + caption_h)), "white")
    draw = ImageDraw.Draw(grid)
    for i, tile in enumerate(tiles):
        x, y = (i % columns) * cell_w, (i // columns) * (cell_h + caption_h)
        grid.paste(tile.resize((cell_w, cell_h), Image.Resampling.NEAREST), (x, y))
        if captions:
            text = captions[i][: max(1, cell_w // 6)]
            draw.text((x + 1, y + cell_h), text, fill="black")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.png")
    grid.save(tmp)
    tmp.replace(path)  # never a half-written picture
    return path
