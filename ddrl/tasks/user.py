"""A user's own task: load one by name or import path, or wrap prompts + a reward function.

    task = load_task("mini_sudoku", max_empty=10)               # a registered task
    task = load_task("my_pkg.tasks:make_task", level=3)         # any factory returning a Task

    task = FunctionTask("parity", reward_fn=my_reward,
                        train_examples=[{"prompt": "1011", "answer": "1"}, ...],
                        dev_examples=[{"prompt": "1100", "answer": "0"}, ...],   # or dev_fraction=0.1
                        test_examples=[{"prompt": "0110", "answer": "0"}, ...])

`reward_fn` follows the reward contract, `reward(completions, **columns) -> list[float | None]`;
the columns are the example keys other than "prompt". An image task says so in the constructor,
`FunctionTask(..., modality="image", image_grid=(h, w))`: its completions are h * w image codes that
the model decodes, and reward_fn also receives `images=[n, 3, H, W]` in [0, 1].

A bug in reward_fn is visible, never a score: FunctionTask keeps the trainer running, but a reward that
raises, returns another number of scores than completions, or a value that is not a finite number
(a string, inf, nan) scores None for those rows (invalid: method.invalid_reward says what the trainer
does with them, and evaluation counts them as not correct), and each kind of failure is logged once
per task with its first example (`RewardFailures`).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Sequence

from ddrl.data import MODALITIES
from ddrl.registry import TASKS, import_object
from ddrl.tasks.base import RewardFn, Task, held_out_sample, split_fixed_rows, train_cycle

ExamplesFn = Callable[[int, int], list[dict[str, Any]]]

log = logging.getLogger(__name__)


def load_task(name_or_path: str, **kwargs: Any) -> Task:
    """A registered task name, or "package.module:factory" (a Task subclass or a function returning a Task)."""
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ValueError(f"a task is named by a non-empty string, got {name_or_path!r}")
    if ":" not in name_or_path:
        return TASKS.get(name_or_path)(**kwargs)  # an unknown name lists the registered ones
    factory = import_object(name_or_path, f"task {name_or_path!r}")
    if not callable(factory):
        raise ValueError(f"{name_or_path!r} is not callable; point it at a Task class or a factory function")
    task = factory(**kwargs)
    needed = ("train_examples", "test_examples", "reward", "correct")
    missing = [m for m in needed if not callable(getattr(task, m, None))]
    if missing:
        raise TypeError(f"{name_or_path!r} returned {type(task).__name__}, which lacks {', '.join(missing)}; "
                        f"return a ddrl.tasks.base.Task (FunctionTask wraps prompts + a reward function)")
    return task


class FunctionTask(Task):
    """Prompts + a reward function as a Task.

    train_examples / dev_examples / test_examples: a list of example dicts (each with "prompt" and
    the reward's columns) or a function (n, seed) -> such a list. Lists are kept apart by prompt:
    train drops dev and test prompts, dev drops test prompts, so test stays sealed and dev held
    out. The lists are the user's own splits, so nothing moves between them unless asked:
    without dev_examples the task has no dev split, unless `dev_fraction` > 0 holds that share of
    a train list out as dev (by a hash of the prompt, as the file tasks do).
    """

    def __init__(self, name: str, reward_fn: RewardFn, train_examples: Sequence[dict[str, Any]] | ExamplesFn,
                 test_examples: Sequence[dict[str, Any]] | ExamplesFn | None = None, *,
                 dev_examples: Sequence[dict[str, Any]] | ExamplesFn | None = None, dev_fraction: float = 0.0,
                 gen_length: int | None = None, success_threshold: float = 1.0, format: str = "chat",
                 symbols: Sequence[str] | None = None, pretrain_pairs: ExamplesFn | None = None,
                 uniform_symbols: Sequence[str] | None = None, modality: str = "text",
                 image_grid: Sequence[int] | None = None):
        if not callable(reward_fn):
            raise TypeError(f"reward_fn must be callable, got {reward_fn!r}")
        if dev_examples is not None and dev_fraction:
            raise ValueError(f"task {name!r}: pass dev_examples= or dev_fraction=, not both")
        if dev_fraction and callable(train_examples):
            raise ValueError(f"task {name!r}: dev_fraction= holds out part of a train list; with a train "
                             f"function, pass dev_examples=")
        self.name = name
        self.reward_fn = reward_fn
        self.modality, self.image_grid = _modality_and_grid(name, modality, image_grid)
        self.gen_length = _gen_length(name, gen_length, self.image_grid)
        self.failures = RewardFailures(name)
        self.success_threshold = success_threshold
        self.format = format
        self._symbols = list(symbols) if symbols is not None else None
        self._pretrain_pairs = pretrain_pairs
        self.uniform_symbols = list(uniform_symbols) if uniform_symbols is not None else None
        self._test = _examples_or_fn(test_examples, held_prompts=set())
        self._dev = _examples_or_fn(dev_examples, held_prompts=_prompts(self._test))
        self._train = _examples_or_fn(train_examples, held_prompts=_prompts(self._test) | _prompts(self._dev))
        if dev_fraction:
            assert isinstance(self._train, list)
            self._train, self._dev = split_fixed_rows(self._train, lambda e: str(e.get("prompt")), dev_fraction)
        for split in (self._train, self._dev, self._test):
            if isinstance(split, list) and any("prompt" not in e for e in split):
                raise ValueError(f"task {name!r}: every example needs a 'prompt' key")

    def train_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        if callable(self._train):
            return list(self._train(n, seed))
        assert self._train is not None  # train_examples is a required argument
        return train_cycle(self._train, n, f"{self.name}-train-{seed}")

    def dev_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        if self._dev is None or (isinstance(self._dev, list) and not self._dev):
            raise ValueError(f"task {self.name!r} has no dev split (for choices; test is only for reported "
                             f"numbers): pass dev_examples= (a list or an (n, seed) function), or dev_fraction=0.1 "
                             f"to hold part of the train list out")
        if callable(self._dev):
            return list(self._dev(n, seed))
        return held_out_sample(self._dev, n, f"{self.name}-dev-{seed}")

    def test_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        if self._test is None:
            raise ValueError(f"task {self.name!r} has no test examples; pass test_examples=")
        if callable(self._test):
            return list(self._test(n, seed))
        return held_out_sample(self._test, n, f"{self.name}-test-{seed}")

    def reward(self, completions: list[str], **columns: Any) -> list[float | None]:
        """reward_fn's scores, with None (and one log line per kind of failure) where it failed."""
        n = len(completions)
        try:
            scores = self.reward_fn(completions, **columns)
        except Exception as e:  # noqa: BLE001 - a user's reward must not crash the trainer
            return self.failures.all_rows("raised", f"raised {type(e).__name__}: {e}", n)
        try:
            scores = list(scores)
        except TypeError:
            return self.failures.all_rows("wrong_count", f"returned a {type(scores).__name__}, not a list of "
                                                         f"{n} scores", n)
        if len(scores) != n:
            return self.failures.all_rows("wrong_count", f"returned {len(scores)} scores for {n} completions", n)
        return [self.failures.score(s) for s in scores]

    def symbols(self) -> list[str]:
        if self._symbols is None:
            return super().symbols()
        return list(self._symbols)

    def pretrain_pairs(self, n: int, seed: int = 0) -> list[dict[str, str]]:
        if self._pretrain_pairs is None:
            return super().pretrain_pairs(n, seed)
        return list(self._pretrain_pairs(n, seed))


class RewardFailures:
    """How a user's reward failed, each kind logged once per task, with its first example.

    kinds: raised (the exception's message), wrong_count (the lengths), not_a_number (a string, a
    list ...), not_finite (inf, nan). The rows concerned score None (invalid), never a number: a 0.0
    would pass for a real score and inf for a perfect one."""

    def __init__(self, task_name: str):
        self.task_name = task_name
        self.seen: dict[str, int] = {}  # kind -> rows that failed that way so far

    def note(self, kind: str, example: str, rows: int = 1) -> None:
        if kind not in self.seen:
            log.warning("task %r: the reward %s; those completions score None (invalid). Logged once per kind of "
                        "failure (%s); fix the reward function", self.task_name, example, kind)
        self.seen[kind] = self.seen.get(kind, 0) + rows

    def all_rows(self, kind: str, example: str, n: int) -> list[float | None]:
        self.note(kind, example, n)
        return [None] * n

    def score(self, value: Any) -> float | None:
        """One returned value as a score: None stays None (not applicable), a finite number is itself."""
        if value is None:
            return None
        try:
            if isinstance(value, (str, bytes)):
                raise TypeError
            score = float(value)
        except (TypeError, ValueError):
            self.note("not_a_number", f"returned {value!r} ({type(value).__name__}), not a number")
            return None
        if not math.isfinite(score):
            self.note("not_finite", f"returned {value!r}, not a finite number")
            return None
        return score


def _modality_and_grid(name: str, modality: str,
                       image_grid: Sequence[int] | None) -> tuple[str, tuple[int, int] | None]:
    """The constructor's modality and image_grid, checked: an image task needs its (h, w), a text task has none."""
    if modality not in MODALITIES:
        raise ValueError(f"task {name!r}: modality={modality!r}; choose one of {', '.join(MODALITIES)}")
    if modality != "image":
        if image_grid is not None:
            raise ValueError(f"task {name!r}: image_grid={image_grid!r} is for an image task; pass modality=\"image\" "
                             f"with it, or drop it")
        return modality, None
    grid = tuple(image_grid) if isinstance(image_grid, (list, tuple)) else ()
    if len(grid) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in grid):
        raise ValueError(f"task {name!r}: an image task needs image_grid=(h, w), its completion's image codes "
                         f"(positive ints; URSA at 512 px over a 16x VQ: (32, 32)), got {image_grid!r}")
    return modality, (int(grid[0]), int(grid[1]))


def _gen_length(name: str, gen_length: int | None, image_grid: tuple[int, int] | None) -> int:
    """Completion tokens: 256 by default for text, h * w codes for an image."""
    if image_grid is None:
        return 256 if gen_length is None else gen_length
    codes = image_grid[0] * image_grid[1]
    if gen_length is not None and gen_length != codes:
        raise ValueError(f"task {name!r}: gen_length={gen_length} but image_grid {image_grid[0]}x{image_grid[1]} "
                         f"is {codes} codes; drop gen_length (an image task's is h * w)")
    return codes


def _examples_or_fn(examples: Sequence[dict[str, Any]] | ExamplesFn | None,
                    held_prompts: set[Any]) -> list[dict[str, Any]] | ExamplesFn | None:
    """A split as given: a function as is, a list copied without the prompts of sealed splits."""
    if examples is None or callable(examples):
        return examples
    return [dict(e) for e in examples if e.get("prompt") not in held_prompts]


def _prompts(split: list[dict[str, Any]] | ExamplesFn | None) -> set[Any]:
    return {e.get("prompt") for e in split} if isinstance(split, list) else set()
