"""A user's own task: load one by name or import path, or wrap prompts + a reward function.

    task = load_task("mini_sudoku", max_empty=10)               # a registered task
    task = load_task("my_pkg.tasks:make_task", level=3)         # any factory returning a Task

    task = FunctionTask("parity", reward_fn=my_reward,
                        train_examples=[{"prompt": "1011", "answer": "1"}, ...],
                        dev_examples=[{"prompt": "1100", "answer": "0"}, ...],   # or dev_fraction=0.1
                        test_examples=[{"prompt": "0110", "answer": "0"}, ...])

`reward_fn` follows the reward contract, `reward(completions, **columns) -> list[float | None]`;
the columns are the example keys other than "prompt". FunctionTask shields the trainer from a
reward that raises or returns the wrong number of scores (it scores 0.0 instead).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Sequence

from ddrl.registry import TASKS
from ddrl.tasks.base import RewardFn, Task, held_out_sample, split_fixed_rows, train_cycle

ExamplesFn = Callable[[int, int], list[dict[str, Any]]]


def load_task(name_or_path: str, **kwargs: Any) -> Task:
    """A registered task name, or "package.module:factory" (a Task subclass or a function returning a Task)."""
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ValueError(f"a task is named by a non-empty string, got {name_or_path!r}")
    if ":" not in name_or_path:
        return TASKS.get(name_or_path)(**kwargs)  # an unknown name lists the registered ones
    module_name, _, attr = name_or_path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ValueError(f"cannot import {module_name!r} for task {name_or_path!r}: {e}") from None
    factory = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r} (task {name_or_path!r})")
        factory = getattr(factory, part)
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
                 gen_length: int = 256, success_threshold: float = 1.0, format: str = "chat",
                 symbols: Sequence[str] | None = None, pretrain_pairs: ExamplesFn | None = None,
                 uniform_symbols: Sequence[str] | None = None):
        if not callable(reward_fn):
            raise TypeError(f"reward_fn must be callable, got {reward_fn!r}")
        if dev_examples is not None and dev_fraction:
            raise ValueError(f"task {name!r}: pass dev_examples= or dev_fraction=, not both")
        if dev_fraction and callable(train_examples):
            raise ValueError(f"task {name!r}: dev_fraction= holds out part of a train list; with a train "
                             f"function, pass dev_examples=")
        self.name = name
        self.reward_fn = reward_fn
        self.gen_length = gen_length
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
        n = len(completions)
        try:
            scores = list(self.reward_fn(completions, **columns))
        except Exception:  # noqa: BLE001 - a user's reward must not crash the trainer
            return [0.0] * n
        if len(scores) != n:
            return [0.0] * n
        out: list[float | None] = []
        for s in scores:
            try:
                out.append(None if s is None else float(s))
            except (TypeError, ValueError):
                out.append(0.0)
        return out

    def symbols(self) -> list[str]:
        if self._symbols is None:
            return super().symbols()
        return list(self._symbols)

    def pretrain_pairs(self, n: int, seed: int = 0) -> list[dict[str, str]]:
        if self._pretrain_pairs is None:
            return super().pretrain_pairs(n, seed)
        return list(self._pretrain_pairs(n, seed))


def _examples_or_fn(examples: Sequence[dict[str, Any]] | ExamplesFn | None,
                    held_prompts: set[Any]) -> list[dict[str, Any]] | ExamplesFn | None:
    """A split as given: a function as is, a list copied without the prompts of sealed splits."""
    if examples is None or callable(examples):
        return examples
    return [dict(e) for e in examples if e.get("prompt") not in held_prompts]


def _prompts(split: list[dict[str, Any]] | ExamplesFn | None) -> set[Any]:
    return {e.get("prompt") for e in split} if isinstance(split, list) else set()
