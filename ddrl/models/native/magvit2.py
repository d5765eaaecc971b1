"""MAGVIT-v2's image decoder (MMaDA's VQ model, showlab/magvitv2), without its authors' code.

MMaDA (Yang et al. 2025) generates images as 32 x 32 grids of codes of MAGVIT-v2 (Yu et al. 2024,
"Language Model Beats Diffusion"), a look-up-free quantiser (LFQ) over 13 bits, 8192 codes, and a
VQGAN decoder that upsamples 16 times (512 px from 32 x 32 codes). Read from its official directory:

    config.json                  {"_class_name": "MAGVITv2", ...}: the class name only (no size arguments)
    pytorch_model.safetensors    encoder.*, decoder.*, quantize.* (ddrl reads decoder.* only)

**The decoder, as Gen-Verse/MMaDA @ 3cdb870 models/modeling_magvitv2.py (MAGVITv2.decode_code) computes it:**
  * LFQ lookup: code c -> z[c] in {-1, 1}^13 with z[c, j] = 2 * bit_{12-j}(c) - 1 (the most significant bit
    first), laid out [B, 13, h, w].
  * post_quant_conv (1x1, 13 -> 13), conv_in (3x3, 13 -> 512), mid (ResnetBlock, attention, ResnetBlock),
    then five levels from ch_mult [1, 1, 2, 2, 4] (ch 128) from the last: num_res_blocks [4, 4, 3, 4, 3]
    ResnetBlocks each, a nearest 2x upsample + 3x3 conv after every level but the first (four: 16x),
    GroupNorm(32, eps 1e-6), swish, conv_out (3x3 -> 3). Their attn_resolutions [5] is never met
    (the lowest resolution is 256 // 16 = 16), so no level has attention.
  * ResnetBlock: x + conv2(swish(norm2(conv1(swish(norm1(x)))))), with a 1x1 nin_shortcut when the
    width changes. Attention: single head over pixels, q/k/v/proj_out 1x1 convs, scale 1/sqrt(C).
  * Pixels come out in about [-1, 1]; MMaDA's scripts map them to clamp((x + 1) / 2, 0, 1), which
    `MAGVITv2Decoder.pixels` returns.

Where this differs: attention runs through scaled_dot_product_attention (the same function as their
bmm + softmax; float rounding). Their diffusers-based `from_pretrained` breaks on diffusers >= 0.39;
this reads the safetensors directly.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ddrl.models.io import ModelDirectoryError, read_json
from ddrl.models.native.conv_layers import Upsample, load_frozen_decoder

CLASS_NAME = "MAGVITv2"
WEIGHTS = "pytorch_model.safetensors"
CODE_BITS = 13  # LFQ codebook_dim: 2**13 = 8192 codes
CH, CH_MULT, NUM_RES_BLOCKS = 128, (1, 1, 2, 2, 4), (4, 4, 3, 4, 3)  # VQGANDecoder's defaults (no config args)


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    def __init__(self, dim: int, out_dim: int):
        super().__init__()
        self.norm1, self.conv1 = _norm(dim), nn.Conv2d(dim, out_dim, 3, 1, 1)
        self.norm2, self.conv2 = _norm(out_dim), nn.Conv2d(out_dim, out_dim, 3, 1, 1)
        if dim != out_dim:
            self.nin_shortcut = nn.Conv2d(dim, out_dim, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x) + h


class AttnBlock(nn.Module):
    """Single-head self-attention over the pixels of a feature map (1x1-conv projections)."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = _norm(dim)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(dim, dim, 1) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        B, C, H, W = x.shape
        h = self.norm(x)
        q, k, v = (f(h).flatten(2).transpose(1, 2)[:, None] for f in (self.q, self.k, self.v))  # [B, 1, HW, C]
        o = F.scaled_dot_product_attention(q, k, v)[:, 0]  # [B, HW, C]
        return x + self.proj_out(o.transpose(1, 2).reshape(B, C, H, W))


class _Level(nn.Module):
    """One resolution of the decoder: `block` ResnetBlocks, then (all but level 0) `upsample`."""

    def __init__(self, dim: int, out_dim: int, depth: int, upsample: bool):
        super().__init__()
        self.block = nn.ModuleList(ResnetBlock(dim if i == 0 else out_dim, out_dim) for i in range(depth))
        self.attn = nn.ModuleList()  # attn_resolutions [5] never occurs: kept for the weight names
        if upsample:
            self.upsample = Upsample(out_dim)


class _Mid(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.block_1, self.attn_1, self.block_2 = ResnetBlock(dim, dim), AttnBlock(dim), ResnetBlock(dim, dim)


class VQGANDecoder(nn.Module):
    """z [B, 13, h, w] -> pixels [B, 3, 16h, 16w] in about [-1, 1]. Parameter names are the checkpoint's
    under decoder.*."""

    def __init__(self):
        super().__init__()
        top = CH * CH_MULT[-1]
        self.post_quant_conv = nn.Conv2d(CODE_BITS, CODE_BITS, 1)
        self.conv_in = nn.Conv2d(CODE_BITS, top, 3, 1, 1)
        self.mid = _Mid(top)
        levels, dim = [], top
        for i in reversed(range(len(CH_MULT))):  # built from the lowest resolution up, stored by level
            out_dim = CH * CH_MULT[i]
            levels.insert(0, _Level(dim, out_dim, NUM_RES_BLOCKS[i], upsample=i != 0))
            dim = out_dim
        self.up = nn.ModuleList(levels)
        self.norm_out = _norm(dim)
        self.conv_out = nn.Conv2d(dim, 3, 3, 1, 1)

    def forward(self, z: Tensor) -> Tensor:
        h = self.conv_in(self.post_quant_conv(z))
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        for level in reversed(self.up):
            for block in level.block:
                h = block(h)
            if hasattr(level, "upsample"):
                h = level.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


def lfq_codes(codes: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """LFQ lookup: codes [B, h, w] (long, in [0, 8192)) -> z [B, 13, h, w], z[c, j] = 2 * bit_{12-j}(c) - 1."""
    shifts = torch.arange(CODE_BITS - 1, -1, -1, device=codes.device)  # [13] most significant bit first
    bits = (codes.long()[..., None] >> shifts) & 1  # [B, h, w, 13]
    return (bits.to(dtype) * 2 - 1).permute(0, 3, 1, 2).contiguous()


class MAGVITv2Decoder(nn.Module):
    """MAGVIT-v2's decoding half (module docstring): codes [B, h, w] -> pixels [B, 3, 16h, 16w]."""

    codebook_size = 2 ** CODE_BITS

    def __init__(self):
        super().__init__()
        self.decoder = VQGANDecoder()

    def forward(self, codes: Tensor) -> Tensor:
        """decode_code: pixels in about [-1, 1]."""
        return self.decoder(lfq_codes(codes, self.decoder.conv_in.weight.dtype))

    def pixels(self, codes: Tensor) -> Tensor:
        """codes [B, h, w] -> [B, 3, H, W] float32 in [0, 1]: clamp((x + 1) / 2, 0, 1), as MMaDA's scripts."""
        return self(codes).float().add(1.0).div(2.0).clamp(0.0, 1.0)

    @classmethod
    def from_pretrained(cls, directory: str | Path, *, device: torch.device | str | None = None,
                        dtype: torch.dtype | None = torch.float32) -> "MAGVITv2Decoder":
        """The official directory (config.json naming MAGVITv2 + pytorch_model.safetensors): decoder.* only."""
        path = Path(directory)
        if not (path / "config.json").is_file() or not (path / WEIGHTS).is_file():
            raise ModelDirectoryError(f"{str(path)!r} is not a MAGVIT-v2 directory: it needs config.json and {WEIGHTS} "
                                      f"(showlab/magvitv2 as released)")
        name = read_json(path / "config.json").get("_class_name")
        if name != CLASS_NAME:
            raise ModelDirectoryError(f"{str(path / 'config.json')!r} names class {name!r}; ddrl decodes MMaDA's "
                                      f"{CLASS_NAME} (showlab/magvitv2) only")
        return load_frozen_decoder(cls, path, WEIGHTS, "MAGVIT-v2's decoder", dtype=dtype, device=device)
