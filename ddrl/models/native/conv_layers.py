"""Layers the native image decoders share (URSA's AutoencoderVQ, MMaDA's MAGVIT-v2): both upsample a
feature map by nearest-neighbour doubling then a 3x3 convolution, under the weight name `conv`."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class Upsample(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.conv = nn.Conv2d(dim, dim, 3, 1, 1)

    def forward(self, x: Tensor) -> Tensor:  # [B, C, H, W] -> [B, C, 2H, 2W]
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))
