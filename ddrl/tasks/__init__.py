"""Tasks: dataset + prompt format + reward + metric (see ddrl/tasks/base.py).

    task = ddrl.get_task("mini_sudoku", min_empty=8, max_empty=12)
    task = ddrl.get_task("my_pkg.tasks:make_task", n=100)      # a user's own factory

Built-in tasks register themselves in ddrl.registry.TASKS when this package is imported. The
held-out machinery shared by the procedural tasks lives here, above the imports of the task
modules (which use it):

Train/dev/test disjointness. A procedural generator (reasoning-gym) can produce the same puzzle
from two different seeds; separate seed ranges alone do not make a split held out. Every
generated example therefore has a split key (the puzzle string, the problem's numbers and target,
the question text) whose SHA-256 decides its split: a fixed fraction of the key space
(`test_fraction`) is held out, the rest train; the held-out keys are shared between dev and test,
half each (`DEV_SHARE`, by an independent word of the same digest). A stream skips the examples
whose key belongs to another split, so a dev or test example never appears in ANY train split,
nor a test example in any dev split, whatever the seeds or sizes. The train streams are the ones
from before dev existed (dev only divides the held-out side), so the shipped checkpoints were
trained on exactly today's train split. Dev and test streams cost 1/(test_fraction * DEV_SHARE)
generator calls per example.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator

from ddrl.tasks.base import SPLITS, Task, check_split, is_dev_key, is_test_key

# reasoning-gym seeds of a stream: SPLIT_SEED_BASES[split] + seed * SEED_STRIDE + index. Disjoint
# ranges are not what keeps splits apart (the key hash is); they keep the streams uncorrelated.
# "dev" starts where the test streams started before dev existed: puzzles that past choices were
# made on are dev puzzles or not drawn at all, and the sealed test streams are fresh draws.
SPLIT_SEED_BASES = {"train": 0, "dev": 10**15, "test": 2 * 10**15}
SEED_STRIDE = 10**8  # examples per stream before two seeds' streams would overlap
DEV_SHARE = 0.5  # of the held-out keys; the rest are test


def held_out_split(key: str, held_out_fraction: float) -> str:
    """The split of a procedural example's key: "train", or "dev" / "test" for held-out keys."""
    if not is_test_key(key, held_out_fraction):
        return "train"
    return "dev" if is_dev_key(key, DEV_SHARE) else "test"


def check_format(task: str, fmt: str, supported: tuple[str, ...]) -> str:
    if fmt not in supported:
        raise ValueError(f"task {task!r} does not support format={fmt!r}; supported: {', '.join(supported)} "
                         f"(set task.format={supported[0]})")
    return fmt


class ReasoningGymTask(Task):
    """A task drawn from a reasoning-gym procedural generator, split train/dev/test by key hash.

    Subclasses set `dataset_name`, `test_fraction`, and implement `_rg_config` (generator options),
    `_example` (reasoning-gym item -> example dict, or None to skip it) and `_split_key`.
    Examples of one (split, seed) form a stream: `train_examples(k, s)` is a prefix of
    `train_examples(n, s)` for k < n, and likewise for dev and test.
    """

    dataset_name: str = ""
    #: Share of the key space held out of train (dev and test together, DEV_SHARE of it dev).
    test_fraction: float = 0.1
    max_attempts_per_example: int = 200  # give up (with an error) on an exhausted generator

    def __init__(self) -> None:
        self._streams: dict[tuple[str, int], tuple[list[dict[str, Any]], Iterator[dict[str, Any] | None]]] = {}

    # ---- subclass hooks
    def _rg_config(self) -> dict[str, Any]:
        raise NotImplementedError

    def _example(self, item: dict[str, Any]) -> dict[str, Any] | None:
        raise NotImplementedError

    def _split_key(self, example: dict[str, Any]) -> str:
        raise NotImplementedError

    # ---- streams
    def _items(self, base_seed: int) -> Iterator[dict[str, Any] | None]:
        from reasoning_gym import create_dataset

        chunk = 256
        for c in range(SEED_STRIDE // chunk):
            # reasoning-gym draws item i of a dataset from Random(seed + i): consecutive chunks
            # continue one stream of seeds base_seed, base_seed + 1, ...
            ds = create_dataset(self.dataset_name, seed=base_seed + c * chunk, size=chunk, **self._rg_config())
            for i in range(chunk):
                try:
                    yield ds[i]
                except (ValueError, RuntimeError, ZeroDivisionError):  # generator gave up on this seed
                    yield None

    def split_of(self, example: dict[str, Any]) -> str:
        """The split an example's key belongs to, whichever stream produced it."""
        return held_out_split(self._split_key(example), self.test_fraction)

    def _split_stream(self, split: str, seed: int) -> Iterator[dict[str, Any] | None]:
        """One entry per generated item: the example if it belongs to `split`, else None."""
        base = SPLIT_SEED_BASES[check_split(split)] + int(seed) * SEED_STRIDE
        for item in self._items(base):
            example = None if item is None else self._example(item)
            yield example if example is not None and self.split_of(example) == split else None

    def _examples(self, split: str, n: int, seed: int) -> list[dict[str, Any]]:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        key = (split, int(seed))
        if key not in self._streams:
            self._streams[key] = ([], self._split_stream(split, seed))
        done, stream = self._streams[key]
        budget = self.max_attempts_per_example * max(n - len(done), 0) + 1000
        while len(done) < n:
            example = next(stream, None)
            budget -= 1
            if example is not None:
                done.append(example)
            elif budget <= 0:  # a generator whose outputs (nearly) all fall in the other split
                raise ValueError(f"task {self.name!r}: generated only {len(done)} of {n} {split} examples "
                                 f"within the attempt budget; widen the generator options")
        return copy.deepcopy(done[:n])  # callers may mutate their examples

    def train_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        return self._examples("train", n, seed)

    def dev_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        return self._examples("dev", n, seed)

    def test_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        return self._examples("test", n, seed)


def get_task(name: str, **kwargs: Any) -> Task:
    """A registered task by name, or a user's "package.module:factory"; kwargs go to the factory."""
    from ddrl.tasks.user import load_task

    return load_task(name, **kwargs)


# Built-in tasks (registration happens on import).
from ddrl.tasks import countdown, digits, dna, math_tasks, sudoku, text_to_image, user  # noqa: E402,F401

try:
    from ddrl.tasks import code_tasks  # noqa: F401  (written in parallel; absent in some checkouts)
except ModuleNotFoundError as e:
    if e.name != "ddrl.tasks.code_tasks":
        raise

__all__ = ["SPLITS", "Task", "ReasoningGymTask", "get_task", "held_out_split", "is_dev_key", "is_test_key"]
