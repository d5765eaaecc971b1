"""A fresh tiny URSA pipeline over a codebook of gray levels, for `ddrl pretrain` (model.process=metric_path).

The toy of UDM-GRPO's own system (docs/udm_digits_ursa.md): the same diffusers pipeline folder that
ddrl.models.ursa reads for URSA-1.7B, shrunk to 8x8 gray images, so the digits story runs on the real
path (URSA's transformer, metric path, CTMC sampler, VQ decoder, pixel reward). What it writes:

    model_index.json  URSAPipeline, its component classes
    transformer/      URSATransformer3DModel config + random weights (N(0, 0.02); norms 1)
    vae/              AutoencoderVQ whose decoder maps code k to the gray level k / (levels - 1) exactly
    scheduler/        KineticOptimalScheduler config (alpha, c, shift) + scheduler_model.pth {"path.emb"}
    tokenizer/        a word-level tokenizer: <|endoftext|> (pad), <|vision_start|> (bov), the task's words

**The codebook** (the metric path's "path.emb"): level g = k / (levels - 1) in [0, 1] sits at
(cos(pi g / 2), sin(pi g / 2)). URSA L2-normalises the codebook, so a 1-D embedding would collapse to
+-1; on the quarter circle the distance d = 2 - 2 cos(pi (g - g') / 2) grows with |g - g'|, and the
path's noise lands mostly on nearby gray levels.

**The decoder** is URSA's AutoencoderVQ layout (ddrl.models.native.ursa.VQDecoder) with weights set by
hand, not a new decoder form: an exact map is possible because a GroupNorm over a group whose
channels are (u, -u) with u = +-1 has mean 0 and variance 1 whatever the image is. So:

    quantizer.embedding   code k -> its bits as u_b = 2 bit_b(k) - 1, b < n_bits       [levels, n_bits]
    post_quant_conv       u -> (u_0, -u_0, u_1, -u_1, ...)                             [2 n_bits channels]
    decoder.conv_in       copies them into the first 2 n_bits of 64 channels (centre tap); the rest are 0
    mid / up blocks       identity (every ResBlock's conv2 and the attention's to_out are zero)
    conv_norm_out         GroupNorm(32 groups of 2 channels): each pair (u, -u) -> (u, -u) / sqrt(1 + eps)
    conv_out              silu(a) - silu(-a) = a, so weights (+w_b, -w_b) on a pair give w_b u_b linearly:
                          x = sum_b 2^b u_b / (levels - 1) + (2^n_bits - 1) / (levels - 1) - 1 = 2 g - 1

and decode_images' x / 2 + 1/2 is g, to float32 rounding (ddrl.rewards.image.pixels_to_levels rounds it
back). No encoder weights are written (ddrl never encodes; the authors' AutoencoderVQ would need them).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

import torch

from ddrl.models.io import write_json
from ddrl.models.native.base import write_weights
from ddrl.models.native.ursa import VAE_CLASS, WEIGHTS, URSABackbone, URSAConfig, VQDecoder

PAD, BOV = "<|endoftext|>", "<|vision_start|>"  # Qwen3's names for URSA's pad and <bov>
DECODER_CHANNELS = 64  # GroupNorm(32) needs >= 2 channels per group for the exact map (module docstring)
SCHEDULER = {"alpha": 0.9, "c": 3.0, "shift": 1.0, "eps": 1e-5}  # URSA's alpha and c; no time shift at 8x8
MODEL_INDEX = {"_class_name": "URSAPipeline", "_diffusers_version": "0.39.0",
               "scheduler": ["diffnext.schedulers.scheduling_dfm", "KineticOptimalScheduler"],
               "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
               "transformer": ["diffnext.models.transformers.transformer_ursa", "URSATransformer3DModel"],
               "vae": ["diffnext.models.autoencoders.autoencoder_vq", "AutoencoderVQ"]}


def gray_codebook(levels: int) -> torch.Tensor:
    """[levels, 2]: level k at (cos(pi g / 2), sin(pi g / 2)), g = k / (levels - 1)."""
    angle = torch.arange(levels, dtype=torch.float64) / (levels - 1) * math.pi / 2
    return torch.stack([angle.cos(), angle.sin()], -1).float()


def gray_level_vae(levels: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(vae/config.json, decoder weights) of the exact code -> gray-level decoder (module docstring)."""
    n_bits = max(1, (levels - 1).bit_length())
    config = {"_class_name": VAE_CLASS, "_diffusers_version": "0.39.0", "_quantizer_name": "VQuantizer",
              "act_fn": "silu", "attn_up_block": False, "block_out_channels": [DECODER_CHANNELS],
              "in_channels": 3, "out_channels": 3, "latent_channels": 2 * n_bits, "layers_per_block": 0,
              "norm_num_groups": 32, "num_vq_embeddings": levels, "vq_embed_dim": n_bits, "spatial_stride": 1,
              "temporal_stride": 1, "sample_size": 8}
    decoder = VQDecoder(config)
    state = {k: torch.zeros_like(v) for k, v in decoder.state_dict().items()}
    for name in state:  # GroupNorm scales 1 (identity affine)
        if "norm" in name and name.endswith("weight"):
            state[name].fill_(1.0)
    codes = torch.arange(levels)
    bits = (codes[:, None] >> torch.arange(n_bits)) & 1  # [levels, n_bits]
    state["quantizer.embedding.weight"] = (2.0 * bits - 1).float()
    pair = torch.zeros(2 * n_bits, n_bits)
    pair[0::2] = torch.eye(n_bits)
    pair[1::2] = -torch.eye(n_bits)
    state["post_quant_conv.weight"] = pair[:, :, None, None]
    state["decoder.conv_in.weight"][torch.arange(2 * n_bits), torch.arange(2 * n_bits), 1, 1] = 1.0
    gn_gain = math.sqrt(1.0 + 1e-6)  # undoes GroupNorm's 1 / sqrt(var + eps) with var = 1
    weight = torch.tensor([2.0 ** b for b in range(n_bits)]) / (levels - 1) * gn_gain
    out = state["decoder.conv_out.weight"]  # [3, 64, 3, 3]
    out[:, 0:2 * n_bits:2, 1, 1] = weight
    out[:, 1:2 * n_bits:2, 1, 1] = -weight
    state["decoder.conv_out.bias"].fill_((2 ** n_bits - 1) / (levels - 1) - 1)
    return config, state


def write_tokenizer(directory: Path, words: Sequence[str], max_prompt_length: int) -> int:
    """A word-level tokenizer (whitespace-split) over [PAD, BOV, *words]; returns its length (lm_vocab_size).
    model_max_length = max_prompt_length, which ddrl.models.ursa reads as the prompt's length."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate([PAD, BOV, *words])}
    core = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, unk_token=PAD,
                                  model_max_length=max_prompt_length, padding_side="left")
    tok.save_pretrained(str(directory))
    return len(vocab)


def init_transformer(config: dict[str, Any], seed: int) -> URSABackbone:
    """URSABackbone with N(0, 0.02) matrices and embeddings (PyTorch's std-1 embedding init stalls a tiny
    model: docs/DESIGN facts), unit norms."""
    model = URSABackbone(URSAConfig.from_dict(config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
    return model


def write_gray_level_pipeline(directory: str | Path, *, words: Sequence[str], levels: int, hidden_size: int,
                              num_layers: int, num_heads: int, ffn_mult: float, max_prompt_length: int,
                              seed: int, max_position_embeddings: int = 512) -> Path:
    """Write the pipeline folder (module docstring) for prompts made of `words` and `levels` gray codes."""
    directory = Path(directory)
    for name in ("transformer", "vae", "scheduler", "tokenizer"):
        (directory / name).mkdir(parents=True, exist_ok=True)
    lm_vocab = write_tokenizer(directory / "tokenizer", words, max_prompt_length)
    head_dim = hidden_size // num_heads
    transformer = {"_class_name": "URSATransformer3DModel", "_diffusers_version": "0.39.0",
                   "hidden_size": hidden_size, "intermediate_size": int(round(ffn_mult * hidden_size / 8) * 8),
                   "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
                   "num_key_value_heads": num_heads, "head_dim": head_dim, "max_window_layers": num_layers,
                   "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": max_position_embeddings,
                   "vocab_size": lm_vocab + levels, "lm_vocab_size": lm_vocab, "lm_head_size": levels,
                   "bov_token_id": 1}
    init_transformer(transformer, seed).save_pretrained(directory / "transformer")
    vae_config, vae_state = gray_level_vae(levels)
    write_json(directory / "vae" / "config.json", vae_config)
    write_weights(directory / "vae", vae_state, file=WEIGHTS)
    write_json(directory / "scheduler" / "scheduler_config.json",
               {"_class_name": "KineticOptimalScheduler", "_diffusers_version": "0.39.0", **SCHEDULER})
    torch.save({"path.emb": gray_codebook(levels)}, directory / "scheduler" / "scheduler_model.pth")
    (directory / "model_index.json").write_text(json.dumps(MODEL_INDEX, indent=2) + "\n")
    return directory
