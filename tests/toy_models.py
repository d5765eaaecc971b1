"""Tiny deterministic stand-ins for a denoiser, for unit tests of samplers and estimators.

They meet the model contract (`model(input_ids, attention_mask=None).logits`, [B, T, V];
docs/architecture.md#model) without depending on ddrl.models, so each layer can be tested on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Output:
    logits: torch.Tensor  # [B, T, V]


class ToyDenoiser(nn.Module):
    """Embedding -> one full-attention layer -> vocabulary logits. Bidirectional, padding-aware."""

    def __init__(self, vocab_size: int = 12, d: int = 16, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.emb = nn.Parameter(torch.randn(vocab_size, d, generator=g))
        self.pos = nn.Parameter(torch.randn(64, d, generator=g) * 0.5)
        self.qkv = nn.Parameter(torch.randn(d, 3 * d, generator=g) / d**0.5)
        self.out = nn.Parameter(torch.randn(d, vocab_size, generator=g) / d**0.5 * 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Output:
        B, T = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)
        attention_mask = attention_mask.bool()
        positions = (attention_mask.long().cumsum(1) - 1).clamp(min=0)  # left padding does not shift positions
        h = self.emb[input_ids] + self.pos[positions]  # [B, T, d]
        q, k, v = (h @ self.qkv).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / q.shape[-1] ** 0.5  # [B, T, T]
        scores = scores.masked_fill(~attention_mask[:, None, :], float("-inf"))
        h = h + torch.softmax(scores, -1) @ v
        return Output(logits=h @ self.out)


class ToyDiffusionLM(nn.Module):
    """A ToyDenoiser wearing the DiffusionLM attributes the rest of ddrl reads."""

    def __init__(self, vocab_size: int = 12, mask_token_id: int = 11, pad_token_id: int = 0,
                 eos_token_id: int = 1, seed: int = 0):
        super().__init__()
        self.model = ToyDenoiser(vocab_size, seed=seed)
        self.vocab_size = vocab_size
        self.mask_token_id = mask_token_id
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.logits_shifted = False
        self.block_size = None
        self.tokenizer = None
        self.process = None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Output:
        out = self.model(input_ids, attention_mask)
        # A proper denoiser never predicts the mask token.
        logits = out.logits.clone()
        logits[..., self.mask_token_id] = float("-inf")
        return Output(logits=logits)
