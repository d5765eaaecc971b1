"""Hugging Face tokenizers: the wrapper the rest of ddrl reads, and loading one from a directory.

    hf = load_tokenizer(directory, native=True)   # no code from the directory, ever
    tokenizer = HFTokenizer(hf, mask_token_id=126336)

**Native families** (ddrl.models.families) read the tokenizer with transformers' own classes and
no remote code: tokenizer.json -> PreTrainedTokenizerFast (LLaDA, MMaDA, SDAR/TraDo), else
vocab.json + merges.txt -> Qwen2Tokenizer (Dream: its tokenizer_config.json names a
DreamTokenizer in auto_map, which AutoTokenizer would have to run; DreamTokenizer is Qwen2's
byte-level BPE). Special tokens, added tokens and the chat template come from
tokenizer_config.json (and chat_template.jinja) as transformers reads them. Other directories
go through AutoTokenizer, running a tokenizer's own code only with trust_remote_code.

A directory without tokenizer files loads without a tokenizer (tensor-only use); a caller that
needs one (training, generation from text) asks with `require_tokenizer` in the loader, which
fails before any weights are read.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor

from ddrl.data import prompt_parts
from ddrl.models.io import ModelDirectoryError

if TYPE_CHECKING:
    from ddrl.tasks.base import ChatPrompt

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class HFTokenizer:
    """A Hugging Face tokenizer with the attributes and methods the rest of ddrl reads.

    encode(text) adds no special tokens; encode_prompt(prompt) renders a str (one user turn) or a
    ChatPrompt (system turn, user turn, assistant pre-fill) with the chat template when the tokenizer
    has one, else prepends BOS (encode_prompt's docstring). Prompts are left-padded (padding_side),
    like the built-in SymbolTokenizer's. decode skips ids the tokenizer does not have (a model
    vocabulary padded past the tokenizer's, as Dream's is).
    """

    padding_side = "left"

    def __init__(self, tokenizer: Any, *, mask_token_id: int | None = None):
        self.tokenizer = tokenizer
        self.mask_token_id = mask_token_id if mask_token_id is not None else tokenizer.mask_token_id
        self.eos_token_id = _single_id(tokenizer.eos_token_id)
        self.bos_token_id = _single_id(tokenizer.bos_token_id)
        pad = _single_id(tokenizer.pad_token_id)
        self.pad_token_id = pad if pad is not None else self.eos_token_id  # LLaMA-style tokenizers have no pad

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def __len__(self) -> int:
        return len(self.tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_prompt(self, prompt: str | ChatPrompt) -> list[int]:
        """The ids the model is conditioned on, ending where its completion starts.

        With a chat template: [system turn] + user turn + the generation prompt, rendered as text,
        then the pre-fill appended to that text and the whole tokenised at once, so the completion
        continues the pre-filled assistant text (d1's evaluation: `tokenizer(rendered + "<reasoning>")`).
        The template writes its own BOS. A template that refuses a system turn (it raises) or drops it
        is an error: put the system text into the user message instead, as d1 does. Without a
        template: BOS + user text + pre-fill; a system message is an error.
        """
        user, system, prefill = prompt_parts(prompt)
        if not self.has_chat_template:
            if system is not None:
                raise ValueError(f"this tokenizer ({type(self.tokenizer).__name__}) has no chat template, so a "
                                 f"ChatPrompt's system message cannot be placed; put it into the user text")
            ids = self.encode(user + prefill)
            return ids if self.bos_token_id is None else [self.bos_token_id] + ids
        messages = [{"role": "user", "content": user}]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        from jinja2 import TemplateError  # transformers renders chat templates with jinja2

        try:
            rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except (TemplateError, ValueError) as e:  # a template's raise_exception("System role not supported")
            if system is None:
                raise
            raise ValueError(f"the chat template of this tokenizer does not take a system message ({e}); "
                             f"put the system text into the user message (ChatPrompt(user=system + '\\n\\n' + "
                             f"user))") from None
        if system is not None and system.strip() not in rendered:
            raise ValueError("the chat template of this tokenizer drops the system message; put the system text "
                             "into the user message (ChatPrompt(user=system + '\\n\\n' + user))")
        return self.encode(rendered + prefill)

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        n = len(self.tokenizer)
        ids = [i for i in ids if 0 <= int(i) < n]  # ids past the tokenizer (padded vocabulary) have no text
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: Any, skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(s, skip_special_tokens=skip_special_tokens) for s in sequences]

    def save_pretrained(self, directory: str | Path) -> None:
        self.tokenizer.save_pretrained(str(directory))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("padding_side", self.padding_side)
        return self.tokenizer(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # convert_tokens_to_ids, get_vocab, ...
        if name == "tokenizer":  # not set yet (copy/pickle): no recursion
            raise AttributeError(name)
        return getattr(self.tokenizer, name)

    def __repr__(self) -> str:
        return f"HFTokenizer({type(self.tokenizer).__name__}, vocab_size={self.vocab_size}, mask={self.mask_token_id})"


def _single_id(value: Any) -> int | None:
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def has_tokenizer_files(directory: Path) -> bool:
    return any((directory / f).is_file() for f in TOKENIZER_FILES)


def missing_tokenizer_error(directory: Path, why: str) -> ModelDirectoryError:
    return ModelDirectoryError(
        f"{str(directory)!r} has no tokenizer that ddrl can read ({why}): copy the tokenizer files of the hub "
        f"checkpoint next to its config.json (tokenizer.json, or vocab.json + merges.txt, with tokenizer_config.json), "
        f"or save one there with tokenizer.save_pretrained")


def load_tokenizer(directory: Path, *, native: bool, trust_remote_code: bool = False) -> Any:
    """The directory's Hugging Face tokenizer (None without tokenizer files); module docstring."""
    if not has_tokenizer_files(directory):
        return None
    try:
        if native:
            return _load_without_code(directory)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as e:
        if isinstance(e, ModelDirectoryError):
            raise
        needs_code = not native and not trust_remote_code and _tokenizer_auto_map(directory)
        if needs_code:
            raise ModelDirectoryError(
                f"the tokenizer in {str(directory)!r} ships its own code (tokenizer_config.json auto_map: "
                f"{', '.join(needs_code)}); read it, then pass model.trust_remote_code=true "
                f"(--trust-remote-code) to run it, or save a tokenizer.json there") from None
        raise ModelDirectoryError(f"the tokenizer in {str(directory)!r} does not load ({type(e).__name__}: {e}); "
                                  f"save one there with tokenizer.save_pretrained") from None


def _tokenizer_auto_map(directory: Path) -> list[str]:
    """The code files a tokenizer_config.json's auto_map names ([] when it names none)."""
    import json

    path = directory / "tokenizer_config.json"
    try:
        auto_map = json.loads(path.read_text()).get("auto_map") if path.is_file() else None
    except (OSError, ValueError):
        return []
    if isinstance(auto_map, dict):
        auto_map = auto_map.get("AutoTokenizer")
    refs = auto_map if isinstance(auto_map, (list, tuple)) else [auto_map]
    return sorted({f"{str(r).split('.')[0]}.py" for r in refs if r})


def _load_without_code(directory: Path) -> Any:
    """transformers' own tokenizer classes on the directory's files; its auto_map is never read."""
    if (directory / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)
    if (directory / "vocab.json").is_file() and (directory / "merges.txt").is_file():
        from transformers import Qwen2Tokenizer  # byte-level BPE: Dream's DreamTokenizer, Qwen's slow layout

        return Qwen2Tokenizer.from_pretrained(str(directory), local_files_only=True)
    raise missing_tokenizer_error(directory, "a native family's tokenizer is read from tokenizer.json or "
                                             "vocab.json + merges.txt")
