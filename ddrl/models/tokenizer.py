"""A symbol-level tokenizer for the built-in tiny models (Sudoku digits, gray levels, ...).

Ids 0..3 are the specials pad, mask, eos, bos; the symbols follow in the order given, so a run of
symbols (e.g. the 16 gray levels of the digits task) is a contiguous id range. A uniform-diffusion
process relies on that: it corrupts tokens within [offset, offset + num_classes).

Text is split by greedy longest match, so multi-character symbols such as "<c3>" coexist with
single characters. The special strings themselves are matched too, so a prompt may spell "<eos>".
The tokenizer is called like a Hugging Face one (`tok(texts, padding=True, return_tensors="pt")`),
left-padding by default, so code that feeds prompts to a model works with either.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_TYPE = "ddrl_symbol"
DEFAULT_SPECIALS = ("<pad>", "<mask>", "<eos>", "<bos>")


class SymbolTokenizer:
    """Maps a fixed list of symbols (strings) to ids after four special tokens."""

    padding_side = "left"  # prompts are left-padded so that completions line up on the right
    # ids of the specials, fixed by position in `specials`
    pad_token_id = 0
    mask_token_id = 1
    eos_token_id = 2
    bos_token_id = 3

    def __init__(self, symbols: Sequence[str], specials: Sequence[str] = DEFAULT_SPECIALS):
        symbols, specials = list(symbols), list(specials)
        if len(specials) != 4:
            raise ValueError(
                f"specials must name exactly 4 tokens (pad, mask, eos, bos), got {len(specials)}: {specials}"
            )
        if not symbols:
            raise ValueError("symbols is empty; pass the list of symbols the texts are made of")
        tokens = specials + symbols
        for t in tokens:
            if not isinstance(t, str) or t == "":
                raise ValueError(f"every symbol must be a non-empty string, got {t!r}")
        seen: set[str] = set()
        for t in tokens:
            if t in seen:
                raise ValueError(f"symbol {t!r} appears twice in specials + symbols; each must be unique")
            seen.add(t)
        self.specials = specials
        self.symbols = symbols
        self._id_of = {t: i for i, t in enumerate(tokens)}
        self._tokens = tokens
        # Longest match first: try the longest candidate length at each position.
        self._lengths = sorted({len(t) for t in tokens}, reverse=True)

    @property
    def pad_token(self) -> str:
        return self.specials[0]

    @property
    def mask_token(self) -> str:
        return self.specials[1]

    @property
    def eos_token(self) -> str:
        return self.specials[2]

    @property
    def bos_token(self) -> str:
        return self.specials[3]

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def __len__(self) -> int:
        return self.vocab_size

    def get_vocab(self) -> dict[str, int]:
        return dict(self._id_of)

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str) -> list[int]:
        """Greedy longest match over specials + symbols; an unknown character is an error."""
        if not isinstance(text, str):
            raise ValueError(f"encode expects a string, got {type(text).__name__}")
        ids, i = [], 0
        while i < len(text):
            for n in self._lengths:
                piece = text[i : i + n]
                if len(piece) == n and piece in self._id_of:
                    ids.append(self._id_of[piece])
                    i += n
                    break
            else:
                raise ValueError(
                    f"character {text[i]!r} at position {i} of {text!r} is not a symbol of this tokenizer; "
                    f"known symbols: {' '.join(self.symbols)}"
                )
        return ids

    def decode(self, ids: Iterable[int] | torch.Tensor, skip_special_tokens: bool = True, stop_at_eos: bool = True) -> str:
        """ids -> text. stop_at_eos drops the first EOS and everything after it."""
        if isinstance(ids, torch.Tensor):
            if ids.dim() != 1:
                raise ValueError(f"decode expects a 1-D sequence of ids, got shape {tuple(ids.shape)}; use batch_decode")
            ids = ids.tolist()
        special_ids = range(len(self.specials))
        out = []
        for i in ids:
            i = int(i)
            if stop_at_eos and i == self.eos_token_id:
                break
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
            if skip_special_tokens and i in special_ids:
                continue
            out.append(self._tokens[i])
        return "".join(out)

    def batch_decode(self, sequences: Iterable[Iterable[int]] | torch.Tensor, skip_special_tokens: bool = True,
                     stop_at_eos: bool = True) -> list[str]:
        return [self.decode(s, skip_special_tokens=skip_special_tokens, stop_at_eos=stop_at_eos) for s in sequences]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | list[int]:
        if isinstance(tokens, str):
            if tokens not in self._id_of:
                raise ValueError(f"token {tokens!r} is not in the vocabulary; known symbols: {' '.join(self.symbols)}")
            return self._id_of[tokens]
        return [self.convert_tokens_to_ids(t) for t in tokens]  # type: ignore[misc]

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        if isinstance(ids, int):
            if not 0 <= ids < self.vocab_size:
                raise ValueError(f"token id {ids} is outside the vocabulary [0, {self.vocab_size})")
            return self._tokens[ids]
        return [self.convert_ids_to_tokens(int(i)) for i in ids]  # type: ignore[misc]

    def __call__(self, text: str | Sequence[str], padding: bool | str = False, padding_side: str | None = None,
                 return_tensors: str | None = None, **unused: Any) -> dict[str, Any]:
        """Hugging Face-style batch encoding: {"input_ids", "attention_mask"}, left-padded by default.

        Extra Hugging Face keyword arguments (add_special_tokens, ...) are accepted and ignored:
        this tokenizer adds no special tokens on its own.
        """
        single = isinstance(text, str)
        texts = [text] if isinstance(text, str) else list(text)
        ids = [self.encode(t) for t in texts]
        side = padding_side or self.padding_side
        if side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {side!r}")
        if return_tensors is not None and return_tensors != "pt":
            raise ValueError(f"return_tensors must be None or 'pt', got {return_tensors!r}")
        width = max((len(x) for x in ids), default=0)
        if not padding:
            if return_tensors == "pt" and any(len(x) != width for x in ids):
                raise ValueError("texts encode to different lengths; pass padding=True to pad them")
            width = 0  # no padding: each row keeps its own length
        masks, padded = [], []
        for x in ids:
            fill = max(width - len(x), 0)
            if side == "left":
                padded.append([self.pad_token_id] * fill + x)
                masks.append([0] * fill + [1] * len(x))
            else:
                padded.append(x + [self.pad_token_id] * fill)
                masks.append([1] * len(x) + [0] * fill)
        ids = padded
        if return_tensors == "pt":
            return {"input_ids": torch.tensor(ids, dtype=torch.long).reshape(len(ids), -1),
                    "attention_mask": torch.tensor(masks, dtype=torch.long).reshape(len(ids), -1)}
        if single:
            return {"input_ids": ids[0], "attention_mask": masks[0]}
        return {"input_ids": ids, "attention_mask": masks}

    # ------------------------------------------------------------------ persistence

    def save_pretrained(self, directory: str | Path) -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        data = {"type": TOKENIZER_TYPE, "version": 1, "specials": self.specials, "symbols": self.symbols}
        (path / TOKENIZER_FILE).write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> "SymbolTokenizer":
        """Read DIR/tokenizer.json (or the file itself) written by save_pretrained."""
        path = Path(directory)
        file = path / TOKENIZER_FILE if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"tokenizer file {str(file)!r} does not exist; save one with SymbolTokenizer.save_pretrained")
        try:
            data = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"tokenizer file {str(file)!r} is not valid JSON ({e}); the file is damaged") from None
        if not isinstance(data, dict) or data.get("type") != TOKENIZER_TYPE:
            found = data.get("type") if isinstance(data, dict) else None
            raise ValueError(
                f"{str(file)!r} is not a ddrl symbol tokenizer (type {found!r}, expected {TOKENIZER_TYPE!r}); "
                f"load a Hugging Face tokenizer through ddrl.load_model instead"
            )
        return cls(data["symbols"], specials=data["specials"])

    def __repr__(self) -> str:
        return f"SymbolTokenizer(vocab_size={self.vocab_size}, symbols={self.symbols!r})"
