"""URSA (BAAI, "Uniform discrete diffusion with metric path for video generation", 2025): the native
transformer and VQ decoder of an URSA pipeline directory (ddrl.models.ursa reads the directory).

Reference: URSA's diffnext as carried by Yovecent/UDM-GRPO @ d1bec49 (= baaivision/URSA @ 29284bb):
models/transformers/transformer_ursa.py, models/text_encoders/qwen3.py, models/embeddings.py,
models/autoencoders/{autoencoder_vq,autoencoder_kl,quantizers}.py, pipelines/ursa/pipeline_ursa.py.
Golden outputs: tests/fixtures/make_ursa.py.

**The transformer** (`URSATransformer3DModel`, transformer/ of the pipeline) is a Qwen3 decoder used
bidirectionally (every layer non-causal): ddrl.models.native.qwen3's layers, with weight names
`model.*` and an `lm_head` over the image codebook only (lm_head_size = codebook size outputs).
Its input is one sequence:

    [text ids left-padded to max_prompt_length (no attention mask: pads are attended), <bov>,
     lm_vocab_size + code for each latent cell in raster order]

and position j's logits score token j + 1 (their pipeline samples codes from logits[:, -(N+1):-1]).
RoPE is 3-D (FlexRotaryEmbedding): each token has a position (t, h, w):

    text token i -> (i, i, i);  <bov> -> (L, L, L);  image cell (y, x) -> (L + 1, y, x)

where L is the number of text tokens. Of the Dh/2 rotary frequencies (inv_freq_j = theta^(-2j/Dh)),
the first 3*Dh/8 take their position from t, h, w in turn (j mod 3), the remaining Dh/8 from h, w in
turn. Their kernel writes the rotated halves interleaved; the same permutation of q and k leaves every
dot product unchanged, so the layers' rotate_half form computes the same attention.

config.json is diffusers' (`_class_name` URSATransformer3DModel): fields the reference reads through
Qwen3Config.from_dict, so a missing head_dim, rms_norm_eps, max_position_embeddings is Qwen3's default
(128, 1e-6, 32768; their save_pretrained drops head_dim, so it is 128 even where hidden_size /
num_attention_heads is not).

Here (deviations, none in the function on their inputs):
  * logits are the full vocabulary [B, T, vocab_size]: the codebook logits at ids lm_vocab_size + c and
    ddrl.ops.logprobs.SUPPRESSED_LOGIT elsewhere (`lm_head` is `CodebookHead`, weight name lm_head.weight),
    so ddrl's samplers and estimators index them like any family's; DiffusionLM realigns the shift;
  * a 2-D attention mask removes the keys it marks as padding and positions count real tokens only,
    so a left-padded row gets the logits of the row unpadded (ddrl's padding invariance). The text's
    own max_prompt_length padding is real input to URSA: pass it with mask 1 (ddrl.models.ursa's
    encode_prompts does);
  * the image grid (h, w) is `image_shape` when set, else the square of the image token count;
  * no KV cache: text and image attend each other both ways.

**The VQ decoder** (`AutoencoderVQ` with VQuantizer, vae/): codes [B, h, w] -> embedding -> post_quant_conv
-> Decoder (conv_in, mid block of ResBlock/attention/ResBlock, up blocks of ResBlocks with nearest x2
upsampling, GroupNorm(32)/SiLU/conv_out) -> pixels in about [-1, 1]. Only the decoder half is read
(encoder.* and quant_conv.* are not needed to decode); module names are the weight names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ddrl.models.io import ModelDirectoryError, read_json, write_json
from ddrl.models.native.base import (NATIVE_FAMILIES, BackboneOutput, KVCache, LayerCheckpointing, check_weight_names,
                                     finish_mask, head_output, read_weights, run_layers, weight_names, write_weights)
from ddrl.models.native.qwen3 import Qwen3Decoder, additive_mask, rope_tables
from ddrl.models.native.conv_layers import Upsample, load_frozen_decoder
from ddrl.ops.logprobs import SUPPRESSED_LOGIT

TRANSFORMER_CLASS = "URSATransformer3DModel"
VAE_CLASS = "AutoencoderVQ"
WEIGHTS = "diffusion_pytorch_model.safetensors"  # diffusers' component weight file
CONFIG = "config.json"

# Qwen3Config's defaults: the reference builds its decoder with Qwen3Config.from_dict(config.json).
QWEN3_DEFAULTS = {"head_dim": 128, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "attention_bias": False,
                  "rope_theta": 10000.0, "hidden_act": "silu"}


@dataclass(frozen=True)
class URSAConfig:
    """transformer/config.json of an URSA pipeline; `raw` keeps the whole file for save_pretrained."""

    vocab_size: int  # lm_vocab_size + codebook size: the input embedding's rows
    lm_vocab_size: int  # text ids [0, lm_vocab_size); code c is token lm_vocab_size + c
    lm_head_size: int  # codebook size: the LM head's outputs
    bov_token_id: int  # <|vision_start|>, between the text and the image codes
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    attention_bias: bool = False
    pad_token_id: int | None = None
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "transformer/config.json") -> "URSAConfig":
        if raw.get("_class_name") != TRANSFORMER_CLASS:
            raise ModelDirectoryError(f"{where} has _class_name {raw.get('_class_name')!r}, not {TRANSFORMER_CLASS!r}; "
                                      f"ddrl reads URSA pipelines only")
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "vocab_size", "lm_vocab_size", "lm_head_size", "bov_token_id") if k not in raw]
        if missing:
            raise ModelDirectoryError(f"{where} lacks {missing}; the checkpoint is damaged, use another one")
        get: Callable[[str], Any] = lambda name: raw.get(name) if raw.get(name) is not None else QWEN3_DEFAULTS[name]  # noqa: E731
        if get("hidden_act") != "silu" or (raw.get("rope_scaling") or {}).get("rope_type", "default") != "default":
            raise ModelDirectoryError(f"{where} sets hidden_act={raw.get('hidden_act')!r} / rope_scaling="
                                      f"{raw.get('rope_scaling')!r}; the native URSA transformer implements silu and "
                                      f"URSA's 3-D RoPE only")
        heads = int(raw["num_attention_heads"])
        config = cls(vocab_size=int(raw["vocab_size"]), lm_vocab_size=int(raw["lm_vocab_size"]),
                     lm_head_size=int(raw["lm_head_size"]), bov_token_id=int(raw["bov_token_id"]),
                     hidden_size=int(raw["hidden_size"]), intermediate_size=int(raw["intermediate_size"]),
                     num_hidden_layers=int(raw["num_hidden_layers"]), num_attention_heads=heads,
                     num_key_value_heads=int(raw.get("num_key_value_heads") or heads), head_dim=int(get("head_dim")),
                     rms_norm_eps=float(get("rms_norm_eps")), rope_theta=float(get("rope_theta")),
                     max_position_embeddings=int(get("max_position_embeddings")),
                     attention_bias=bool(get("attention_bias")), pad_token_id=raw.get("pad_token_id"), raw=dict(raw))
        if config.lm_vocab_size + config.lm_head_size > config.vocab_size:
            raise ModelDirectoryError(f"{where}: lm_vocab_size {config.lm_vocab_size} + lm_head_size "
                                      f"{config.lm_head_size} codes exceed vocab_size {config.vocab_size}")
        if config.head_dim % 16:
            raise ModelDirectoryError(f"{where}: head_dim {config.head_dim} must be a multiple of 16 (URSA's 3-D RoPE "
                                      f"splits its frequencies in eighths of head_dim / 2)")
        return config

    @property
    def image_token_range(self) -> tuple[int, int]:
        """(first id, end id) of the image codes in the vocabulary."""
        return self.lm_vocab_size, self.lm_vocab_size + self.lm_head_size


class CodebookHead(nn.Module):
    """URSA's lm_head (weight [codebook, D], no bias) laid into the full vocabulary: logits [..., vocab_size]
    with the codebook's at [lm_vocab_size, lm_vocab_size + codebook) and SUPPRESSED_LOGIT elsewhere."""

    def __init__(self, hidden_size: int, codebook: int, vocab_size: int, offset: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(codebook, hidden_size))
        self.vocab_size, self.offset = vocab_size, offset

    def code_logits(self, hidden: Tensor) -> Tensor:
        """hidden [..., D] -> [..., codebook]: what URSA's own head returns."""
        return F.linear(hidden, self.weight)

    def range_logits(self, hidden: Tensor, lo: int, hi: int) -> Tensor:
        """hidden [..., D] -> forward(hidden)[..., lo:hi], computing only those columns when [lo, hi) is
        the codebook (DiffusionLM's class_range: the metric_path sampler's logits without a
        [..., vocab_size] tensor; same numbers, as the padding only copies them)."""
        if (lo, hi) == (self.offset, self.offset + self.weight.shape[0]):
            return self.code_logits(hidden)
        return self.forward(hidden)[..., lo:hi]

    def forward(self, hidden: Tensor) -> Tensor:
        codes = self.code_logits(hidden)
        right = self.vocab_size - self.offset - codes.shape[-1]
        return F.pad(codes, (self.offset, right), value=SUPPRESSED_LOGIT)


# --------------------------------------------------------------------------------------------
# 3-D rotary positions
# --------------------------------------------------------------------------------------------


def rope_positions(input_ids: Tensor, valid: Tensor, bov_token_id: int,
                   image_shape: tuple[int, int] | None) -> Tensor:
    """[B, T] ids and real-token mask -> (t, h, w) positions [B, T, 3] (module docstring).

    Tokens are counted over real ones only; the last real <bov> of a row separates text from image
    (a row without one is all text). The image cells after it run in raster order over image_shape
    (h, w), else over a square grid."""
    B, T = input_ids.shape
    rank = (valid.long().cumsum(1) - 1).clamp(min=0)  # [B, T] index among real tokens
    is_bov = (input_ids == bov_token_id) & valid
    has_bov = is_bov.any(1)  # [B]
    last = torch.where(is_bov, torch.arange(T, device=input_ids.device), -1).max(1).values  # [B]
    text_len = torch.where(has_bov, rank.gather(1, last.clamp(min=0)[:, None])[:, 0], rank.max(1).values + 1)
    n_image = torch.where(has_bov, valid.sum(1) - text_len - 1, torch.zeros_like(text_len))  # [B]
    width = image_width(n_image[has_bov], image_shape)
    k = (rank - text_len[:, None] - 1).clamp(min=0)  # image cell index
    L = text_len[:, None].expand(B, T)
    text = rank[..., None].expand(B, T, 3)
    image = torch.stack([L + 1, k // width, k % width], dim=-1)
    is_image = rank > text_len[:, None]  # after the bov (rows without one: never)
    pos = torch.where(is_image[..., None], image, text)
    return torch.where((rank == text_len[:, None])[..., None], L[..., None].expand(B, T, 3), pos)


def image_width(n_image: Tensor, image_shape: tuple[int, int] | None) -> int:
    """The grid's width for rows with n_image image tokens each (set image_shape for non-square grids)."""
    counts = sorted({int(n) for n in n_image.tolist()} - {0})
    if len(counts) > 1 and image_shape is None:
        raise ValueError(f"rows hold different numbers of image tokens ({counts}); batch images of one size, or set "
                         f"model.image_shape = (h, w)")
    if image_shape is not None:
        h, w = (int(v) for v in image_shape)
        if any(n > h * w for n in counts):
            raise ValueError(f"a row holds {max(counts)} image tokens after <bov>, more than image_shape {h}x{w}")
        return w
    for n in counts:
        side = math.isqrt(n)
        if side * side != n:
            raise ValueError(f"a row holds {n} image tokens, not a square grid; set model.image_shape = (h, w) "
                             f"(URSA's latent grid: height and width / the VAE's spatial stride)")
    return math.isqrt(counts[-1]) if counts else 1


def rope_angles(positions: Tensor, head_dim: int, theta: float) -> Tensor:
    """(t, h, w) positions [B, T, 3] -> rotation angles [B, T, head_dim / 2] in float32, as
    FlexRotaryEmbedding.get_func: frequency j reads t, h, w in turn for j < 3*Dh/8, then h, w in turn."""
    half, first = head_dim // 2, head_dim // 8 * 3
    j = torch.arange(half, device=positions.device)
    axis = torch.where(j < first, j % 3, 1 + (j - first) % 2)  # [Dh/2] in {0: t, 1: h, 2: w}
    scale = torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim
    inv_freq = torch.pow(float(theta), scale).reciprocal()
    return positions[..., axis].float() * inv_freq  # [B, T, Dh/2]


# --------------------------------------------------------------------------------------------
# The transformer
# --------------------------------------------------------------------------------------------


@NATIVE_FAMILIES.register("ursa")
class URSABackbone(LayerCheckpointing, nn.Module):
    """URSATransformer3DModel's parameters (model.*, lm_head) behind ddrl's backbone contract.

    image_shape: the latent grid (h, w) of the image tokens, or None for a square grid.
    """

    image_shape: tuple[int, int] | None = None

    def __init__(self, config: URSAConfig):
        super().__init__()
        self.config = config
        self.model = Qwen3Decoder(config)
        lo, _ = config.image_token_range
        self.lm_head = CodebookHead(config.hidden_size, config.lm_head_size, config.vocab_size, lo)

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                past_key_values: KVCache | None = None, use_cache: bool = False,
                logits_to_keep: int | Tensor | None = None, compute_logits: bool = True) -> BackboneOutput:
        """input_ids [B, T] -> logits [B, T, vocab_size], position j scoring token j + 1 (URSA's own).

        attention_mask: None; [B, T] padding mask (1 = real); or boolean [B, (1,) T, T] used as given.
        position_ids: None (derived: module docstring) or explicit (t, h, w) positions [B, T, 3] / [T, 3].
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
        if past_key_values:
            raise ValueError("URSA's text and image tokens attend each other both ways, so it runs without a KV "
                             "cache; do not pass past_key_values (set rollout.cache=none)")
        B, T = input_ids.shape
        allowed, valid = self._attention(attention_mask, B, T, input_ids.device)
        if position_ids is None:
            positions = rope_positions(input_ids, valid, self.config.bov_token_id, self.image_shape)
        else:
            if position_ids.shape[-2:] != (T, 3) or position_ids.dim() not in (2, 3):
                raise ValueError(f"position_ids for URSA are (t, h, w) positions [B, T, 3] or [T, 3], got shape "
                                 f"{tuple(position_ids.shape)}")
            positions = position_ids.to(input_ids.device).expand(B, T, 3)
        h = self.model.embed_tokens(input_ids)  # [B, T, D]
        cos, sin = rope_tables(rope_angles(positions, self.config.head_dim, self.config.rope_theta), h.dtype)
        mask = None if allowed is None else additive_mask(allowed, h.dtype)
        h, _ = run_layers(self.layers, h, cos, sin, mask, past_key_values=None, use_cache=False,
                          checkpointing=self.checkpointing_now)
        hidden = self.model.norm(h)  # [B, T, D]
        return BackboneOutput(logits=head_output(self.lm_head, hidden, logits_to_keep, compute_logits),
                              past_key_values=None, hidden_states=hidden)

    @staticmethod
    def _attention(attention_mask: Tensor | None, B: int, T: int,
                   device: torch.device) -> tuple[Tensor | None, Tensor]:
        """-> (boolean [B, 1, T, T] mask or None = attend everything, real-token mask [B, T])."""
        valid = torch.ones(B, T, dtype=torch.bool, device=device)
        if attention_mask is None:
            return None, valid
        if attention_mask.dim() == 2:
            if tuple(attention_mask.shape) != (B, T):
                raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected [B, T] = {(B, T)}")
            valid = attention_mask.bool()
            if bool(valid.all()):
                return None, valid
            return finish_mask(valid[:, None, None, :].expand(B, 1, T, T)), valid
        if attention_mask.dim() in (3, 4) and attention_mask.dtype == torch.bool:
            explicit = attention_mask if attention_mask.dim() == 4 else attention_mask[:, None]
            if explicit.shape[0] != B or tuple(explicit.shape[-2:]) != (T, T):
                raise ValueError(f"a 3-D/4-D attention_mask must be boolean [B, (1,) T, T] = [{B}, {T}, {T}], got "
                                 f"{tuple(attention_mask.shape)}")
            return finish_mask(explicit.expand(B, 1, T, T)), valid
        raise ValueError(f"attention_mask must be a 2-D padding mask or a boolean 3-D/4-D mask, got "
                         f"{attention_mask.dtype} {tuple(attention_mask.shape)}")

    # ------------------------------------------------------------------ persistence (transformer/)

    @classmethod
    def from_pretrained(cls, directory: str | Path, *, device: torch.device | str | None = None,
                        dtype: torch.dtype | None = None) -> "URSABackbone":
        """Read a pipeline's transformer/ directory (config.json + diffusion_pytorch_model.safetensors);
        dtype None keeps the stored dtype."""
        path = Path(directory)
        if not (path / CONFIG).is_file():
            raise ModelDirectoryError(f"{str(path)!r} has no {CONFIG}; an URSA pipeline's transformer/ holds one")
        config = URSAConfig.from_dict(read_json(path / CONFIG), f"{str(path / CONFIG)!r}")
        with torch.device("meta"):
            model = cls(config)
        check_weight_names(path, "URSA transformer", weight_names(path, WEIGHTS), set(model.state_dict()))
        state = read_weights(path, WEIGHTS)
        if dtype is not None:
            state = {k: v.to(dtype) for k, v in state.items()}
        try:
            model.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as e:
            raise ModelDirectoryError(f"the weights in {str(path)!r} do not fit its config.json: {e}") from e
        return model.to(device) if device is not None else model

    def save_pretrained(self, directory: str | Path, state_dict: dict[str, Tensor] | None = None) -> None:
        """Write transformer/ as the reference reads it: config.json (every loaded field) + safetensors."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        write_json(directory / CONFIG, self.config.raw)
        write_weights(directory, dict(self.state_dict() if state_dict is None else state_dict), file=WEIGHTS)


# --------------------------------------------------------------------------------------------
# The VQ decoder (vae/)
# --------------------------------------------------------------------------------------------


def _group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, channels, eps=1e-6)  # the reference hard-codes 32 groups


class ResBlock(nn.Module):
    def __init__(self, dim: int, out_dim: int):
        super().__init__()
        self.norm1, self.conv1 = _group_norm(dim), nn.Conv2d(dim, out_dim, 3, 1, 1)
        self.norm2, self.conv2 = _group_norm(out_dim), nn.Conv2d(out_dim, out_dim, 3, 1, 1)
        self.conv_shortcut = nn.Conv2d(dim, out_dim, 1) if out_dim != dim else None

    def forward(self, x: Tensor) -> Tensor:
        shortcut = self.conv_shortcut(x) if self.conv_shortcut is not None else x
        x = self.conv1(F.silu(self.norm1(x)))
        return self.conv2(F.silu(self.norm2(x))) + shortcut


class Attention(nn.Module):
    """Single-head self-attention over the pixels of a feature map (the VAE's mid block)."""

    def __init__(self, dim: int):
        super().__init__()
        self.group_norm = _group_norm(dim)
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])

    def forward(self, x: Tensor) -> Tensor:
        B, C, H, W = x.shape
        h = self.group_norm(x).flatten(2).transpose(1, 2)  # [B, HW, C]
        q, k, v = (f(h)[:, None] for f in (self.to_q, self.to_k, self.to_v))  # [B, 1, HW, C]
        o = F.scaled_dot_product_attention(q, k, v)[:, 0]
        return self.to_out[0](o).transpose(1, 2).reshape(B, C, H, W)


class UpBlock(nn.Module):
    def __init__(self, dim: int, out_dim: int, depth: int, upsample: bool):
        super().__init__()
        self.resnets = nn.ModuleList(ResBlock(dim if i == 0 else out_dim, out_dim) for i in range(depth))
        self.attentions = nn.ModuleList()
        self.upsamplers = nn.ModuleList([Upsample(out_dim)]) if upsample else nn.ModuleList()

    def forward(self, x: Tensor) -> Tensor:
        for i, resnet in enumerate(self.resnets):
            x = resnet(x)
            if i < len(self.attentions):
                x = self.attentions[i](x) + x
        return self.upsamplers[0](x) if len(self.upsamplers) else x


class MidBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.resnets = nn.ModuleList([ResBlock(dim, dim), ResBlock(dim, dim)])
        self.attentions = nn.ModuleList([Attention(dim)])

    def forward(self, x: Tensor) -> Tensor:
        x = self.resnets[0](x)
        return self.resnets[1](self.attentions[0](x) + x)


class Decoder(nn.Module):
    def __init__(self, latent_channels: int, out_channels: int, block_out_channels: list[int], layers_per_block: int,
                 attn_up_block: bool):
        super().__init__()
        dims = list(reversed(block_out_channels))
        self.conv_in = nn.Conv2d(latent_channels, dims[0], 3, 1, 1)
        self.mid_block = MidBlock(dims[0])
        self.up_blocks = nn.ModuleList(UpBlock(dims[max(i - 1, 0)], d, layers_per_block + 1, i < len(dims) - 1)
                                       for i, d in enumerate(dims))
        if attn_up_block:
            cast(UpBlock, self.up_blocks[0]).attentions.extend(Attention(block_out_channels[-1]) for _ in range(layers_per_block + 1))
        self.conv_norm_out = _group_norm(dims[-1])
        self.conv_out = nn.Conv2d(dims[-1], out_channels, 3, 1, 1)

    def forward(self, x: Tensor) -> Tensor:
        x = self.mid_block(self.conv_in(x))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(F.silu(self.conv_norm_out(x)))


class Codebook(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self.embedding = nn.Embedding(size, dim)


class VQDecoder(nn.Module):
    """The decoding half of URSA's AutoencoderVQ: codes [B, h, w] -> pixels [B, 3, H, W] in about [-1, 1]."""

    def __init__(self, config: dict[str, Any]):
        super().__init__()
        self.config = dict(config)
        get: Callable[[str, Any], Any] = lambda name, default: config.get(name, default)  # noqa: E731  (AutoencoderVQ's defaults)
        channels = list(get("block_out_channels", (128, 256, 512, 512)))
        latent, vq_dim = int(get("latent_channels", 16)), int(get("vq_embed_dim", 8))
        self.quantizer = Codebook(int(get("num_vq_embeddings", 16384)), vq_dim)
        self.post_quant_conv = nn.Conv2d(vq_dim, latent, 1)
        self.decoder = Decoder(latent, int(get("out_channels", 3)), channels, int(get("layers_per_block", 2)),
                               bool(get("attn_up_block", False)))

    @property
    def codebook_size(self) -> int:
        return self.quantizer.embedding.num_embeddings

    def forward(self, codes: Tensor) -> Tensor:
        z = self.quantizer.embedding(codes).permute(0, 3, 1, 2)  # [B, D, h, w]
        x = self.post_quant_conv(z)
        return self.decoder(x.to(self.decoder.conv_in.weight.dtype))

    @classmethod
    def from_pretrained(cls, directory: str | Path, *, device: torch.device | str | None = None,
                        dtype: torch.dtype | None = torch.float32) -> "VQDecoder":
        """Read a pipeline's vae/ directory (AutoencoderVQ config.json + safetensors): the decoder weights only."""
        path = Path(directory)
        if not (path / CONFIG).is_file():
            raise ModelDirectoryError(f"{str(path)!r} has no {CONFIG}; pass an URSA pipeline's vae/ directory "
                                      f"(AutoencoderVQ) as the VQ decoder")
        config = read_json(path / CONFIG)
        if config.get("_class_name") != VAE_CLASS:
            raise ModelDirectoryError(f"{str(path / CONFIG)!r} has _class_name {config.get('_class_name')!r}; ddrl "
                                      f"decodes URSA's {VAE_CLASS} (VQ codebook) only")
        quantizer = config.get("_quantizer_name", "VQuantizer")
        if quantizer != "VQuantizer":
            raise ModelDirectoryError(f"{str(path / CONFIG)!r} uses {quantizer}; ddrl's VQ decoder implements the "
                                      f"VQuantizer (embedding codebook) of AutoencoderVQ only")
        return load_frozen_decoder(lambda: cls(config), path, WEIGHTS, f"an {VAE_CLASS} decoder's for its config.json",
                                   dtype=dtype, device=device)
