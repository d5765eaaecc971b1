"""A tiny random-weight CLIP directory (transformers CLIPModel + CLIPProcessor), the stand-in for
PickScore's and CLIP score's checkpoints in tests: 16 x 16 images, a 54-token character vocabulary."""

from __future__ import annotations

from pathlib import Path

import torch


def write_tiny_clip(out: Path, seed: int = 0) -> Path:
    """Write a random CLIP model and its processor to `out` (created); returns `out`."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    out.mkdir(parents=True, exist_ok=True)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in "abcdefghijklmnopqrstuvwxyz":
        vocab[c], vocab[c + "</w>"] = len(vocab), len(vocab) + 1
    processor = CLIPProcessor(tokenizer=CLIPTokenizer(vocab=vocab, merges=[]),
                              image_processor=CLIPImageProcessor(size={"shortest_edge": 16},
                                                                 crop_size={"height": 16, "width": 16}))
    config = CLIPConfig(text_config=dict(vocab_size=len(vocab), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=77,
                                         bos_token_id=0, eos_token_id=1, pad_token_id=1),
                        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=16, patch_size=8), projection_dim=8)
    torch.manual_seed(seed)
    CLIPModel(config).save_pretrained(out)
    processor.save_pretrained(out)
    return out
