"""Task = dataset + prompt format + reward + metric.

A task yields examples as plain dicts: "prompt" (the text the model is conditioned on) plus the
columns its reward needs ("solution", "answer", "tests", "label" ...). Rewards follow the reward
contract (docs/architecture.md#reward): `reward(completions: list[str], **columns) ->
list[float | None]`, and never raise or hang.

Splits. Every task serves three disjoint splits (`SPLITS`): "train" (what RL and pretraining see),
"dev" (for every choice: recipes, learning rates, checkpoints, sampler settings) and "test"
(sealed: only for reported numbers, never for a choice). Which examples land where is decided by
a SHA-256 of each example's split key (`is_test_key`, `is_dev_key`: two independent 64-bit words
of one digest), so the decision is stable across runs, seeds, sizes and file orders. Procedural
generators split their held-out keys between dev and test; fixed datasets hold dev out of their
train rows and keep the paper's test file as test (ddrl/tasks/__init__.py, paper_data.py).
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ddrl.rewards.composite import RewardResult

RewardFn = Callable[..., list[float | None]]

SPLITS = ("train", "dev", "test")


def _key_word(key: str, index: int) -> int:
    """The index-th 64-bit word of SHA-256(key): words 0 and 1 are independent uniform draws."""
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[8 * index:8 * index + 8], "big")


def is_test_key(key: str, test_fraction: float) -> bool:
    """Whether an example with this split key is held out of train (stable across runs): a
    procedural task's dev or test side, a hash-split file's test rows."""
    return _key_word(key, 0) < test_fraction * 2**64


def is_dev_key(key: str, dev_fraction: float) -> bool:
    """Whether a key falls in the `dev_fraction` share of its side that is dev. It reads the
    digest's second word, so it is independent of `is_test_key` and does not move any key across
    the train/held-out boundary: adding dev left every train stream as it was."""
    return _key_word(key, 1) < dev_fraction * 2**64


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)} "
                         f"(dev for choices, test only for reported numbers)")
    return split


def split_examples(task: Any, split: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """n examples of `split` from any task object, a user's duck-typed one without the Task base
    included (load_task accepts those): what evaluation and training call to read a split."""
    method = getattr(task, f"{check_split(split)}_examples", None)
    if not callable(method):
        raise ValueError(f"task {getattr(task, 'name', task)!r} has no {split} split: implement "
                         f"{split}_examples(n, seed) (dev for choices, test only for reported numbers)")
    return method(n, seed)


def cluster_keys(task: Any, examples: Sequence[dict[str, Any]]) -> list[Any] | None:
    """One cluster key per example for the bootstrap (ddrl/stats.py), or None when every
    example is independent. An example whose key is None is a cluster of its own."""
    key = getattr(task, "cluster_key", None)
    keys = [key(e) for e in examples] if callable(key) else [None] * len(examples)
    if all(k is None for k in keys):
        return None
    return [("example", i) if k is None else ("cluster", k) for i, k in enumerate(keys)]


def split_fixed_rows(rows: Sequence[dict[str, Any]], key: Callable[[dict[str, Any]], str],
                     dev_fraction: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, dev) of a fixed dataset's train rows: dev is the `dev_fraction` share by key hash.
    Fixed datasets take dev from train, never from the test file, so the paper's test set stays
    whole and sealed."""
    if not 0.0 <= dev_fraction < 1.0:
        raise ValueError(f"dev_fraction must be in [0, 1), got {dev_fraction}")
    in_dev = [is_dev_key(key(r), dev_fraction) for r in rows]
    return [r for r, d in zip(rows, in_dev) if not d], [r for r, d in zip(rows, in_dev) if d]


def train_cycle(rows: Sequence[dict[str, Any]], n: int, key: str) -> list[dict[str, Any]]:
    """n rows (fresh dicts) in seeded permutations of `rows`, one epoch after another: the training
    stream of a fixed dataset. `key` seeds it ("<task>-train-<seed>")."""
    rng = random.Random(key)
    out: list[dict[str, Any]] = []
    while rows and len(out) < n:
        order = list(range(len(rows)))
        rng.shuffle(order)
        out.extend(dict(rows[i]) for i in order[: n - len(out)])
    return out


def held_out_sample(rows: Sequence[dict[str, Any]], n: int, key: str) -> list[dict[str, Any]]:
    """min(n, len(rows)) distinct rows (fresh dicts) in a seeded order ("<task>-test-<seed>")."""
    order = list(range(len(rows)))
    random.Random(key).shuffle(order)
    return [dict(rows[i]) for i in order[: max(0, n)]]


@dataclass(frozen=True)
class ChatPrompt:
    """A prompt for a chat model, beyond one user message: a system message and assistant text that
    is pre-filled after the chat template's generation prompt, so decoding continues it (d1's
    evaluation starts the answer with "<reasoning>"). A plain `str` prompt is one user message."""

    user: str
    system: str | None = None
    prefill: str = ""


class Task:
    """Base class of every task. Subclasses fill the attributes and the example generators."""

    name: str = "task"
    #: Suggested completion length (tokens) for the built-in compact format.
    gen_length: int = 16
    #: Reward at or above which a completion counts as correct (accuracy / solve rate).
    success_threshold: float = 1.0
    #: Prompt format: "compact" (symbol-level, for the built-in tiny models) or "chat" (HF models).
    format: str = "compact"
    #: What a completion is (ddrl.data.MODALITIES): "text", or "image": the completion is
    #: image_grid = (h, w) image codes that the model's decoder turns into pixels, and reward,
    #: correct and metric also receive images=[n, 3, H, W] float in [0, 1].
    modality: str = "text"
    #: (h, w) of an image task's token grid (its completion is h * w codes, row-major); None for text.
    image_grid: tuple[int, int] | None = None

    def train_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        """n training examples, deterministic in seed."""
        raise NotImplementedError

    def dev_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        """n dev examples, deterministic in seed, disjoint from every train and test split: the
        split every choice is made on (recipes, learning rates, checkpoints)."""
        raise NotImplementedError(f"task {self.name!r} has no dev split: implement dev_examples(n, seed) "
                                  f"with examples disjoint from train and test")

    def test_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        """n sealed test examples, deterministic in seed, disjoint from every train and dev split:
        only for reported numbers, never for a choice."""
        raise NotImplementedError

    def examples(self, split: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
        """n examples of `split` ("train" | "dev" | "test"), deterministic in seed."""
        return split_examples(self, split, n, seed)

    def cluster_key(self, example: dict[str, Any]) -> str | None:
        """What makes examples dependent, for the bootstrap over clusters (ddrl/stats.py): the
        puzzles of one 4x4 Sudoku grid are not independent draws. None = independent examples."""
        return None

    def all_test_examples(self) -> list[dict[str, Any]] | None:
        """Every test example in the test set's own order, when the task has a fixed test set (a
        paper's test file; what its tables score); None for a procedural generator."""
        return None

    def reward(self, completions: list[str], **columns: list[Any]) -> list[float | None]:
        """One score per completion; columns are lists aligned with completions."""
        raise NotImplementedError

    def score(self, completions: list[str], **columns: list[Any]) -> RewardResult:
        """The reward's scores with its per-part breakdown (the trainer logs each part as
        reward/<part>). Default: `reward`'s scores, no parts; a task with a CompositeReward gives its parts."""
        return RewardResult(list(self.reward(completions, **columns)))

    def correct(self, completions: list[str], **columns: list[Any]) -> list[bool]:
        """Whether each completion solves its example (the task's accuracy metric): a None or non-finite
        score (an invalid reward, inf included) never does."""
        scores = self.reward(completions, **columns)
        return [s is not None and math.isfinite(s) and s >= self.success_threshold for s in scores]

    def metric(self, completions: list[str], **columns: list[Any]) -> list[float]:
        """Each completion's accuracy in [0, 1], averaged by evaluation: 1/0 for a verdict (the
        default, from `correct`), or a fraction where the paper scores partial credit (d1's
        Sudoku: correct cells / blank cells)."""
        return [1.0 if c else 0.0 for c in self.correct(completions, **columns)]

    # ---- for the built-in tiny models (compact format) ----
    def symbols(self) -> list[str]:
        """The alphabet of the compact format, for a SymbolTokenizer (specials excluded)."""
        raise NotImplementedError(f"task {self.name!r} has no compact symbol format")

    def pretrain_pairs(self, n: int, seed: int = 0) -> list[dict[str, str]]:
        """n {"prompt", "completion"} pairs with gold completions, for supervised pretraining."""
        raise NotImplementedError(f"task {self.name!r} has no gold completions for pretraining")

    #: For uniform diffusion: the symbols the process diffuses over (a contiguous run in the
    #: tokenizer's vocabulary); None for tasks that are not uniform-diffusion tasks.
    uniform_symbols: list[str] | None = None
