"""Task = dataset + prompt format + reward + metric.

A task yields examples as plain dicts: "prompt" (the text the model is conditioned on) plus the
columns its reward needs ("solution", "answer", "tests", "label" ...). Rewards follow the reward
contract (docs/architecture.md#reward): `reward(completions: list[str], **columns) ->
list[float | None]`, and never raise or hang.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

RewardFn = Callable[..., list[float | None]]


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

    def train_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        """n training examples, deterministic in seed."""
        raise NotImplementedError

    def test_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        """n held-out examples, deterministic in seed, disjoint from every train split."""
        raise NotImplementedError

    def all_test_examples(self) -> list[dict[str, Any]] | None:
        """Every test example in the test set's own order, when the task has a fixed test set (a
        paper's test file; what its tables score); None for a procedural generator."""
        return None

    def reward(self, completions: list[str], **columns: list[Any]) -> list[float | None]:
        """One score per completion; columns are lists aligned with completions."""
        raise NotImplementedError

    def correct(self, completions: list[str], **columns: list[Any]) -> list[bool]:
        """Whether each completion solves its example (the task's accuracy metric)."""
        scores = self.reward(completions, **columns)
        return [s is not None and s >= self.success_threshold for s in scores]

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
