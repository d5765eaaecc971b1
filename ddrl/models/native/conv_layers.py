"""What the native image decoders share (URSA's AutoencoderVQ, MMaDA's MAGVIT-v2): the upsampling layer
(nearest-neighbour doubling then a 3x3 convolution, weight name `conv`) and the frozen load of decoder
weights from a file that may hold more (the encoder)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ddrl.models.io import ModelDirectoryError


class Upsample(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.conv = nn.Conv2d(dim, dim, 3, 1, 1)

    def forward(self, x: Tensor) -> Tensor:  # [B, C, H, W] -> [B, C, 2H, 2W]
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


M = TypeVar("M", bound=nn.Module)


def load_frozen_decoder(build: Callable[[], M], path: Path, weights_file: str, what: str, *,
                        dtype: torch.dtype | None, device: torch.device | str | None) -> M:
    """build() on the meta device, filled with the names it has from `path/weights_file` (the rest, such as
    an encoder, is not read into it), in eval mode and without grad: decoders turn codes into pixels for
    rewards and never train. Missing or misshapen weights are a ModelDirectoryError naming `what`."""
    from ddrl.models.native.base import read_weights, weight_names

    with torch.device("meta"):
        model = build()
    expected = set(model.state_dict())
    missing = sorted(expected - weight_names(path, weights_file))
    if missing:
        raise ModelDirectoryError(f"the weights in {str(path)!r} are not {what}: missing "
                                  f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
    state = {k: v for k, v in read_weights(path, weights_file).items() if k in expected}
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise ModelDirectoryError(f"the weights in {str(path)!r} do not fit {what}: {e}") from e
    model.eval().requires_grad_(False)
    return model.to(device) if device is not None else model
