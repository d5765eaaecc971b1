"""The MDLM DNA denoiser of DRAKES / SEPO: a dilated 1-D CNN over one-hot bases, ddrl's own code.

Reference: ozekri/SEPO @ 4a4a40f, GRPO_MDLM_DNA/models/dnaconv.py `CNNModel` (from HannesStark/
dirichlet-flow-matching), as DRAKES configures it (configs_gosai/model/dnaconv.yaml: hidden 128,
4 stacks, length 200, dropout 0, clean_data False, no classifier-free guidance). Golden test:
tests/unit/test_mdlm_dna.py against tests/fixtures/make_sepo_dna.py (logits to 1e-5 in float32).

    h0   = relu(conv_k9(one_hot(x, 5)))                       5 classes: A C G T + mask (id 4)
    e    = relu(W_t [sin(2π σ w), cos(2π σ w)] + b_t)         Gaussian Fourier features of σ (w fixed)
    for layer i (5 * stacks):  h = relu(conv_i(LayerNorm_i(h + Dense_i(e)))) ; h += h_prev
    logits = conv_1x1(relu(conv_1x1(h)))                      [B, L, 5]

Layer i's conv has kernel 9 and dilation (1, 1, 4, 16, 64)[i // stacks]: the released code repeats each
of the five convolutions `stacks` times in a row (with 4 stacks: 1,1,1,1, 1,1,1,1, 4,4,4,4, ...), not
the pattern per stack. Padding keeps the length. DRAKES runs it with time_conditioning False: σ is
zeroed, so e is a constant (cos(0) = 1) that still shifts every layer; it is kept.

The weight names are theirs (the Lightning checkpoint's `backbone.*` without the prefix), so their
state dict loads as it is.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

DILATIONS = (1, 1, 4, 16, 64)
MODEL_TYPE = "mdlm_dna"


@dataclass
class MDLMDNAConfig:
    hidden_dim: int = 128  # channels
    num_cnn_stacks: int = 4  # each of the five dilated convolutions is repeated this many times
    length: int = 200  # sequence length the model was trained on (the CNN itself takes any length)
    alphabet_size: int = 5  # A C G T + mask
    dropout: float = 0.0
    time_conditioning: bool = False  # False (DRAKES): σ is zeroed before the Fourier features
    noise_eps: float = 1e-3  # the log-linear schedule's eps: move chance (1 - eps) t

    @property
    def vocab_size(self) -> int:
        return self.alphabet_size

    @property
    def max_seq_len(self) -> int:
        return self.length


@dataclass
class MDLMDNAOutput:
    logits: Tensor  # [B, L, 5]


class GaussianFourierProjection(nn.Module):
    """Fixed random features of a scalar time: [sin(2π σ w), cos(2π σ w)]; w is a non-trainable parameter."""

    def __init__(self, embed_dim: int):
        super().__init__()
        self.W = nn.Parameter(torch.zeros(embed_dim // 2), requires_grad=False)

    def forward(self, sigma: Tensor) -> Tensor:
        proj = sigma[:, None] * self.W[None, :] * 2 * math.pi  # [B, D/2]
        return torch.cat([torch.sin(proj), torch.cos(proj)], dim=-1)


class Dense(nn.Module):
    def __init__(self, dim_in: int, dim_out: int):
        super().__init__()
        self.dense = nn.Linear(dim_in, dim_out)

    def forward(self, x: Tensor) -> Tensor:
        return self.dense(x)


class MDLMDNABackbone(nn.Module):
    """`model(input_ids, attention_mask=None, sigma=None).logits` -> [B, L, 5] (raw, before MDLM's subs)."""

    def __init__(self, config: MDLMDNAConfig):
        super().__init__()
        self.config = config
        d, n = config.hidden_dim, 5 * config.num_cnn_stacks
        self.linear = nn.Conv1d(config.alphabet_size, d, kernel_size=9, padding=4)
        self.time_embedder = nn.Sequential(GaussianFourierProjection(d), nn.Linear(d, d))
        self.convs = nn.ModuleList(
            nn.Conv1d(d, d, kernel_size=9, dilation=dil, padding=4 * dil)
            for dil in DILATIONS for _ in range(config.num_cnn_stacks))
        self.time_layers = nn.ModuleList(Dense(d, d) for _ in range(n))
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(n))
        self.final_conv = nn.Sequential(nn.Conv1d(d, d, kernel_size=1), nn.ReLU(),
                                        nn.Conv1d(d, config.alphabet_size, kernel_size=1))
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, *, sigma: Tensor | None = None,
                **unused: Any) -> MDLMDNAOutput:
        """input_ids [B, L] long (or one-hot / soft [B, L, 5]); sigma [B] total noise (ignored, i.e. zero,
        unless config.time_conditioning). attention_mask is accepted and ignored: every row is full length."""
        if input_ids.ndim == 2:
            x = F.one_hot(input_ids, self.config.alphabet_size).to(self.linear.weight.dtype)
        else:
            x = input_ids.to(self.linear.weight.dtype)
        b = x.shape[0]
        if sigma is None or not self.config.time_conditioning:
            sigma = torch.zeros(b, device=x.device, dtype=x.dtype)
        time_emb = F.relu(self.time_embedder(sigma.reshape(b).to(x.dtype)))  # [B, D]
        feat = F.relu(self.linear(x.permute(0, 2, 1)))  # [B, D, L]
        for conv, time_layer, norm in zip(self.convs, self.time_layers, self.norms):
            h = self.dropout(feat) + time_layer(time_emb)[:, :, None]
            h = norm(h.permute(0, 2, 1)).permute(0, 2, 1)
            feat = F.relu(conv(h)) + feat
        logits = self.final_conv(feat).permute(0, 2, 1)  # [B, L, 5]
        return MDLMDNAOutput(logits=logits)

    # ddrl layout: config.json (model_type mdlm_dna) + model.safetensors with the released names
    def save_pretrained(self, directory: str | Path) -> None:
        import json

        from safetensors.torch import save_file

        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        config = {"model_type": MODEL_TYPE, **asdict(self.config)}
        (path / "config.json").write_text(json.dumps(config, indent=1) + "\n")
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, str(path / "model.safetensors"))
