"""Text <-> token batches: left-padded prompts, EOS-terminated completions.

Shared by pretraining, RL rollouts and evaluation, so that the three see prompts the same way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def encode_prompts(tokenizer: Any, prompts: list[str], *, max_length: int | None = None,
                   add_bos: bool = True, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """Tokenise and LEFT-pad prompts. Returns prompt_ids [B, P] long and prompt_mask [B, P] bool."""
    rows = []
    for text in prompts:
        if hasattr(tokenizer, "encode_prompt"):  # HF wrapper: chat template etc.
            ids = list(tokenizer.encode_prompt(text))
        else:
            ids = list(tokenizer.encode(text))
            bos = getattr(tokenizer, "bos_token_id", None)
            if add_bos and bos is not None:
                ids = [bos] + ids
        rows.append(ids)
    width = max(len(r) for r in rows) if rows else 0
    if max_length is not None and width > max_length:
        raise ValueError(
            f"a prompt is {width} tokens long but the model accepts at most {max_length} prompt tokens "
            f"(max_seq_len minus gen_length); shorten the prompt or use a model with a longer context"
        )
    pad = tokenizer.pad_token_id
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r):] = True
    return ids.to(device), mask.to(device)


def encode_completions(tokenizer: Any, completions: list[str], gen_length: int,
                       device: torch.device | str = "cpu") -> Tensor:
    """Gold completions for pretraining: tokens, then EOS, EOS-padded to gen_length. [B, L] long.

    A completion exactly gen_length tokens long gets no EOS (fixed-length tasks such as Sudoku).
    """
    eos = tokenizer.eos_token_id
    out = torch.full((len(completions), gen_length), eos, dtype=torch.long)
    for i, text in enumerate(completions):
        ids = list(tokenizer.encode(text))
        if len(ids) > gen_length:
            raise ValueError(
                f"a gold completion is {len(ids)} tokens but gen_length is {gen_length}; "
                f"raise sampler.gen_length to at least {len(ids)}"
            )
        out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out.to(device)


def completion_mask(completion_ids: Tensor, eos_token_id: int | None) -> Tensor:
    """[B, L] bool: True on tokens up to and including the first EOS (all True without EOS)."""
    if eos_token_id is None:
        return torch.ones_like(completion_ids, dtype=torch.bool)
    is_eos = completion_ids == eos_token_id
    before_first = (is_eos.long().cumsum(1) - is_eos.long()) == 0  # no EOS strictly before
    return before_first


def decode_completions(tokenizer: Any, completion_ids: Tensor) -> list[str]:
    """Decode each row up to its first EOS, without special tokens."""
    eos = getattr(tokenizer, "eos_token_id", None)
    texts = []
    for row in completion_ids.tolist():
        if eos is not None and eos in row:
            row = row[: row.index(eos)]
        texts.append(tokenizer.decode(row, skip_special_tokens=True))
    return texts
