"""Text <-> token batches: left-padded prompts, EOS-terminated completions; rollout ids -> what a
task scores (text, or decoded pixels for image tasks: `task_completions`); a model and a task whose
modalities do not meet, refused before any compute (`check_modality`).

Shared by pretraining, RL rollouts and evaluation, so that the three see prompts the same way.

**Stop tokens.** A completion ends at its first *stop token*: the model's EOS, or another id
that ends a turn (a chat checkpoint's <|im_end|>, listed in its generation_config.json; see
DiffusionLM.stop_token_ids). `model_stop_ids(model)` is the one place that reads them; the
samplers' early exit, the completion mask and the decoded text all go through it.

**Prompt length.** The model takes max_seq_len tokens, so a prompt may have max_seq_len - gen_length
(`prompt_budget`). A longer prompt is an error unless `max_prompt_length` is set: then each longer
prompt keeps its last max_prompt_length tokens (`truncate_prompts`), as TRL and d1 do. The RL
trainer cuts the step's prompts once, so the sampler and every likelihood pass see the same tokens.

**Prompts** are a `str` (one user message) or a `ddrl.tasks.base.ChatPrompt` (a system message and
assistant text pre-filled after the chat template's generation prompt, as d1's evaluation does).
A Hugging Face tokenizer renders both through its chat template (HFTokenizer.encode_prompt); the
compact SymbolTokenizer has no template, so it takes a ChatPrompt only when it is one user message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from ddrl.contract import CapabilityError, model_view


class ChatPrompt(Protocol):
    """What this module reads of a chat prompt. ddrl.data sits below ddrl.tasks, so it names the
    attributes of ddrl.tasks.base.ChatPrompt (the dataclass tasks build) instead of importing it."""

    @property
    def user(self) -> str: ...
    @property
    def system(self) -> str | None: ...
    @property
    def prefill(self) -> str: ...


def prompt_parts(prompt: str | ChatPrompt) -> tuple[str, str | None, str]:
    """(user, system, prefill) of a prompt: a str is one user message, without system or pre-fill."""
    if isinstance(prompt, str):
        return prompt, None, ""
    try:
        return prompt.user, prompt.system, prompt.prefill
    except AttributeError:
        raise TypeError(f"a prompt is a str or a ddrl.tasks.base.ChatPrompt, got {type(prompt).__name__}") from None


def encode_prompts(tokenizer: Any, prompts: Sequence[str | ChatPrompt], *, max_length: int | None = None,
                   max_prompt_length: int | None = None, add_bos: bool = True,
                   device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """Tokenise and LEFT-pad prompts (str or ChatPrompt). Returns prompt_ids [B, P] long, prompt_mask [B, P] bool.

    max_prompt_length: keep the last that many tokens of a longer prompt (truncate_prompts);
    max_length: the most prompt tokens the model accepts, a longer prompt is an error (pad_prompts).
    """
    rows, _ = truncate_prompts(tokenize_prompts(tokenizer, prompts, add_bos=add_bos), max_prompt_length)
    return pad_prompts(rows, tokenizer.pad_token_id, max_length=max_length, device=device)


def prompt_budget(model: Any, sampler: Any, option: str = "rollout.max_prompt_length",
                  length_option: str = "rollout.gen_length") -> int | None:
    """The most prompt tokens the model takes next to sampler.gen_length completion tokens
    (max_seq_len - gen_length; None when the model states no limit), after checking that
    sampler.max_prompt_length fits in it: a cut that still leaves prompts too long is refused here,
    before any compute, not at the first long prompt. option, length_option: the settings' names
    in the caller's words (a config key, or `ddrl eval`'s flags)."""
    max_seq_len = model_view(model).max_seq_len
    if not max_seq_len:
        return None
    budget = max_seq_len - sampler.gen_length
    if budget < 0:  # no prompt fits, not even an empty one
        raise ValueError(f"{length_option}={sampler.gen_length} does not fit: the model accepts max_seq_len="
                         f"{max_seq_len} tokens in all; set {length_option} to at most {max_seq_len} (the task's "
                         f"completions are that long or shorter)")
    n = getattr(sampler, "max_prompt_length", None)
    if n is not None and n > budget:
        raise ValueError(f"{option}={n} does not fit: the model accepts max_seq_len={max_seq_len} tokens and "
                         f"{length_option}={sampler.gen_length} leaves {budget} for the prompt; set {option} to at "
                         f"most {budget}")
    return budget


def tokenize_prompts(tokenizer: Any, prompts: Sequence[str | ChatPrompt], *, add_bos: bool = True) -> list[list[int]]:
    """Each prompt's token ids, chat template (and BOS) included, unpadded."""
    rows = []
    for prompt in prompts:
        if hasattr(tokenizer, "encode_prompt"):  # HF wrapper: chat template, system message, pre-fill
            ids = list(tokenizer.encode_prompt(prompt))
        else:
            text, system, prefill = prompt_parts(prompt)
            if system is not None or prefill:
                raise ValueError(
                    f"{type(tokenizer).__name__} has no chat template, so a ChatPrompt's system message or "
                    f"assistant pre-fill cannot be encoded (system={system!r}, prefill={prefill!r}); give this "
                    f"model str prompts (task.format=compact) or use a Hugging Face model with a chat template")
            ids = list(tokenizer.encode(text))
            bos = getattr(tokenizer, "bos_token_id", None)
            if add_bos and bos is not None:
                ids = [bos] + ids
        rows.append(ids)
    return rows


def truncate_prompts(rows: list[list[int]], max_prompt_length: int | None) -> tuple[list[list[int]], int]:
    """(rows, how many were cut): each row longer than max_prompt_length keeps its LAST
    max_prompt_length tokens, as TRL's GRPOTrainer and d1 do (`prompt_ids[:, -max_prompt_length:]`
    on the left-padded batch): the end of the prompt, next to the completion, is kept, and the start
    (BOS, system turn, the chat template's header) is what goes. None = no truncation."""
    if max_prompt_length is None:
        return rows, 0
    cut = sum(len(r) > max_prompt_length for r in rows)
    return [r[-max_prompt_length:] for r in rows], cut


def pad_prompts(rows: list[list[int]], pad_token_id: int, *, max_length: int | None = None,
                device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """Left-pad token rows to the widest: prompt_ids [B, P] long, prompt_mask [B, P] bool.

    max_length: the most prompt tokens the model accepts (max_seq_len - gen_length); a longer row
    is refused rather than cut, unless the caller truncated it (max_prompt_length)."""
    width = max(len(r) for r in rows) if rows else 0
    if max_length is not None and width > max_length:
        raise ValueError(
            f"a prompt is {width} tokens long but the model accepts at most {max_length} prompt tokens "
            f"(max_seq_len minus gen_length); shorten the prompt, use a model with a longer context, or keep "
            f"each prompt's last {max_length} tokens as TRL and d1 do: max_prompt_length={max_length} "
            f"(rollout.max_prompt_length in a training config, --max-prompt-length for ddrl eval and sample)"
        )
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r):] = True
    return ids.to(device), mask.to(device)


def encode_completions(tokenizer: Any, completions: list[str], gen_length: int,
                       device: torch.device | str = "cpu") -> Tensor:
    """Gold completions for pretraining: tokens, then EOS, EOS-padded to gen_length. [B, L] long.

    A completion exactly gen_length tokens long gets no EOS (fixed-length tasks such as Sudoku); a tokenizer
    without EOS (DNA) needs every completion to be exactly gen_length tokens.
    """
    eos = tokenizer.eos_token_id
    out = torch.full((len(completions), gen_length), 0 if eos is None else eos, dtype=torch.long)
    for i, text in enumerate(completions):
        ids = list(tokenizer.encode(text))
        if len(ids) > gen_length:
            raise ValueError(
                f"a gold completion is {len(ids)} tokens but gen_length is {gen_length}; "
                f"raise sampler.gen_length to at least {len(ids)}"
            )
        if eos is None and len(ids) != gen_length:
            raise ValueError(f"a gold completion is {len(ids)} tokens, and the tokenizer has no EOS to pad it: "
                             f"set sampler.gen_length to the completions' length ({gen_length} now)")
        out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out.to(device)


def as_stop_ids(ids: int | Iterable[int] | None) -> tuple[int, ...]:
    """An id, a collection of ids or None -> a tuple of distinct ints, first occurrence first."""
    if ids is None:
        return ()
    if isinstance(ids, Tensor):
        ids = ids.reshape(-1).tolist()
    elif not isinstance(ids, Iterable):
        ids = [ids]
    return tuple(dict.fromkeys(int(i) for i in ids))


def model_stop_ids(model: Any) -> tuple[int, ...]:
    """The ids that end a completion: model.stop_token_ids, else (model.eos_token_id,), else ()."""
    view = model_view(model)
    ids = view.stop_token_ids
    return as_stop_ids(ids if ids is not None else view.eos_token_id)


def is_stop(completion_ids: Tensor, stop_ids: int | Iterable[int] | None) -> Tensor:
    """[B, L] long -> [B, L] bool: True where the token is one of stop_ids."""
    ids = as_stop_ids(stop_ids)
    if len(ids) == 1:
        return completion_ids == ids[0]
    return torch.isin(completion_ids, torch.tensor(ids, dtype=completion_ids.dtype, device=completion_ids.device))


def completion_mask(completion_ids: Tensor, eos_token_id: int | Iterable[int] | None) -> Tensor:
    """[B, L] bool: True on tokens up to and including the first stop token (all True without one).

    eos_token_id: one id (the EOS) or several (model_stop_ids(model)); None or () = no stop token.
    """
    ids = as_stop_ids(eos_token_id)
    if not ids:
        return torch.ones_like(completion_ids, dtype=torch.bool)
    stop = is_stop(completion_ids, ids).long()  # [B, L]
    before_first = (stop.cumsum(1) - stop) == 0  # no stop token strictly before
    return before_first


def encode_image_codes(model: Any, codes: Sequence[Sequence[int]], gen_length: int,
                       device: torch.device | str = "cpu") -> Tensor:
    """Gold image completions for pretraining: codebook indices -> vocabulary ids, code c at
    model.image_token_range[0] + c. [B, gen_length] long."""
    first, end = (int(v) for v in model.image_token_range)
    out = torch.tensor([list(row) for row in codes], dtype=torch.long)  # [B, L]
    if out.dim() != 2 or out.shape[1] != gen_length or bool(((out < 0) | (out >= end - first)).any()):
        raise ValueError(f"image codes must be {gen_length} codebook indices in [0, {end - first}) per example, "
                         f"got shape {list(out.shape)}")
    return (out + first).to(device)


def decode_completions(tokenizer: Any, completion_ids: Tensor,
                       stop_token_ids: int | Iterable[int] | None = None) -> list[str]:
    """Decode each row up to (not including) its first stop token, without special tokens.

    stop_token_ids: the ids that end a completion (model_stop_ids(model)); None = the tokenizer's EOS.
    """
    ids = set(as_stop_ids(stop_token_ids if stop_token_ids is not None else getattr(tokenizer, "eos_token_id", None)))
    texts = []
    for row in completion_ids.tolist():
        first = next((j for j, token in enumerate(row) if token in ids), None)
        if first is not None:
            row = row[:first]
        texts.append(tokenizer.decode(row, skip_special_tokens=True))
    return texts


# --------------------------------------------------------------------------------------------
# Rollout ids -> what the task scores
# --------------------------------------------------------------------------------------------
#
# A completion is what the task scores: a string for text (and DNA), an image for text-to-image.
# The task names its modality (`task.modality`, "text" when absent); the model family owns the
# decoder (`model.decode_images`, `model.image_token_range`). Rewards keep their plain-function
# shape, `reward(completions, images=..., **columns)`: the images ride along as a keyword, so a
# trainer or evaluator never branches on the modality, it passes `reward_inputs()` through.


@dataclass
class TaskCompletions:
    """What a task scores, decoded from a batch of completion ids [n, L]."""

    # [n] text up to the first stop token; for an image, "" or the task's image_texts(images) (a caption of
    # the pixels that evaluation rows keep: the digits toy writes its gray levels)
    texts: list[str]
    images: Tensor | None = None  # [n, 3, H, W] float32 in [0, 1], model.decode_images(codes); image tasks

    def reward_inputs(self) -> dict[str, Any]:
        """The keyword arguments a reward takes beside completions and columns: images=... or none."""
        return {} if self.images is None else {"images": self.images}


def _text_completions(model: Any, task: Any, completion_ids: Tensor) -> TaskCompletions:
    return TaskCompletions(decode_completions(model.tokenizer, completion_ids, model_stop_ids(model)))


def _image_completions(model: Any, task: Any, completion_ids: Tensor) -> TaskCompletions:
    images = decode_image_ids(model, completion_ids, task_image_grid(task))
    describe = getattr(task, "image_texts", None)
    return TaskCompletions(describe(images) if describe is not None else [""] * len(completion_ids), images)


MODALITIES: dict[str, Callable[[Any, Any, Tensor], TaskCompletions]] = {
    "text": _text_completions,
    "image": _image_completions,
}


def task_modality(task: Any) -> str:
    """What the task scores: task.modality ("text" when absent), one of MODALITIES."""
    modality = getattr(task, "modality", "text")
    if modality not in MODALITIES:
        raise ValueError(f"task {getattr(task, 'name', task)!r} has modality {modality!r}; ddrl scores "
                         f"{', '.join(MODALITIES)}")
    return modality


def task_completions(model: Any, task: Any, completion_ids: Tensor) -> TaskCompletions:
    """The one function that turns rollout ids into task completions (training, eval, sample)."""
    return MODALITIES[task_modality(task)](model, task, completion_ids)


def task_image_grid(task: Any) -> tuple[int, int]:
    """(h, w) of an image task's token grid: its completion is h * w image codes, row-major."""
    grid = getattr(task, "image_grid", None)
    if grid is None or len(grid) != 2 or not all(isinstance(v, int) and v > 0 for v in grid):
        raise ValueError(f"image task {getattr(task, 'name', task)!r} must say its token grid as "
                         f"task.image_grid = (h, w), got {grid!r}")
    return int(grid[0]), int(grid[1])


# Where a model and a task meet (the trainer, evaluation, `ddrl sample`), `check_modality` refuses a pair
# that cannot work before any compute: without it an image-only model on a text task trains on empty
# completions, and a text model on an image task fails only after its first rollout.
#
# What a model generates: images when it has a decoder (model.decode_images and model.image_token_range:
# URSA, MMaDA loaded with a vq_path); text unless it samples image codes only (logits_range =
# image_token_range, as both of those do). Where a model lays its codes on a known grid it says so as
# `model.image_shape`: (h, w), or None for a square grid (URSA's 3-D rotary positions); a model
# without the attribute (MMaDA's 1-D positions) takes any grid.

# What to do instead, by the modality the task scores.
MODALITY_FIXES = {
    "text": "score images with an image task (text_to_image with task.args.image_grid and task.args.reward, or "
            "FunctionTask(..., modality=\"image\", image_grid=(h, w)), whose reward receives images=[n, 3, H, W]; "
            "`ddrl eval --task text_to_image` writes them as a PNG grid), or load a text model",
    "image": "load a model with an image decoder (URSA, or MMaDA with its VQ model: model.vq_path in a config, "
             "--vq-path on the command line, load_model(..., vq_path=DIR)), or use a text task",
}


def model_modalities(model: Any) -> tuple[str, ...]:
    """What a model's completions can be, of MODALITIES: ("text",), ("image",) or ("text", "image")."""
    view = model_view(model)
    image = view.image_codec is not None
    codes_only = (image and view.logits_range is not None
                  and tuple(view.logits_range) == tuple(view.image_token_range or ()))
    return tuple(m for m, ok in (("text", not codes_only), ("image", image)) if ok)


def check_modality(model: Any, task: Any) -> None:
    """Refuse, before any compute, a task whose completions the model cannot generate: the modality, and
    an image task's grid where the model knows its own (the comment above)."""
    wanted, name = task_modality(task), getattr(task, "name", type(task).__name__)
    family = model_view(model).family or type(model).__name__
    offered = model_modalities(model)
    if wanted not in offered:
        raise ValueError(f"modality mismatch: the {family} model generates {' and '.join(offered)} but task {name!r} "
                         f"scores {wanted}; {MODALITY_FIXES[wanted]}")
    if wanted != "image":
        return
    h, w = task_image_grid(task)
    grid = model_view(model).image_grid
    if grid is None:  # the model takes the task's grid
        return
    shape = grid.image_shape
    if shape is None and h != w:
        raise ValueError(f"task {name!r} asks for a {h}x{w} image grid, but the {family} model lays its image codes "
                         f"on a square grid (model.image_shape is None); use a square image_grid (e.g. "
                         f"[{max(h, w)}, {max(h, w)}]), or set model.image_shape = ({h}, {w}) from Python")
    if shape is not None and tuple(int(v) for v in shape) != (h, w):
        raise ValueError(f"task {name!r} asks for a {h}x{w} image grid, but the {family} model generates "
                         f"{shape[0]}x{shape[1]} (model.image_shape); set the task's image_grid to "
                         f"[{shape[0]}, {shape[1]}]")


@torch.no_grad()
def decode_image_ids(model: Any, completion_ids: Tensor, grid: tuple[int, int]) -> Tensor:
    """[n, h*w] image-token ids -> [n, 3, H, W] float32 pixels in [0, 1] through the model's decoder.

    The model's image tokens are ids image_token_range = (first, end): code c is id first + c."""
    view = model_view(model)
    codec = view.image_codec
    if codec is None:
        raise CapabilityError("image_codec", f"an image task needs a model with an image decoder "
                              f"(model.decode_images and "
                         f"model.image_token_range: URSA, MMaDA with its VQ model); this {view.family or ''} "
                         f"model has none")
    span = view.require("image_token_range")  # an ImageCodec's is set (ModelView.image_codec)
    (h, w), (n, length) = grid, completion_ids.shape
    if length != h * w:
        raise ValueError(f"the completion has {length} tokens but the task's image grid {h}x{w} needs {h * w}; "
                         f"set rollout.gen_length={h * w}")
    first, end = int(span[0]), int(span[1])
    codes = completion_ids - first  # [n, h*w]
    if bool(((codes < 0) | (codes >= end - first)).any()):  # one host read per batch of images
        raise ValueError(f"completion ids outside the image codebook [{first}, {end}): the sampler must draw "
                         f"image codes only (the model's logits_range)")
    pixels = codec.decode_images(codes.view(n, h, w))  # [n, 3, H, W]
    return pixels.float().clamp(0.0, 1.0)
