"""Reward plumbing: per-completion scorers that never raise, and weighted sums of named parts.

Every reward in ddrl has the signature of the reward contract (docs/architecture.md#reward),
`reward(completions: list[str], **columns) -> list[float | None]`, where each column is a list
aligned with the completions (None = not applicable). Two helpers build such functions:

- `per_completion(score)` lifts `score(completion, **row) -> float | None` to a batched reward
  that catches every error of a single completion (the completion then scores `on_error`), so one
  pathological sample never takes down a training step.
- `CompositeReward([(name, fn, weight), ...])` sums weighted parts. Called, it is a plain reward;
  `.score(completions, **columns)` returns a `RewardResult`: the same scores and each part's
  (unweighted) scores, so a trainer logs `reward/correctness` and `reward/format` separately (d1
  logs its five reward functions the same way). `score_parts(reward, ...)` gives a `RewardResult`
  for any reward: a plain function's has no parts.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

RewardFn = Callable[..., list[float | None]]


@dataclass(frozen=True)
class RewardResult:
    """A reward's scores of one call, with the breakdown a composite reward logs."""

    scores: list[float | None]  # one per completion; None = not applicable
    parts: dict[str, list[float | None]] = field(default_factory=dict)  # part name -> its unweighted scores,
    # aligned with `scores` (a plain reward function has none)


def column_value(column: Any, i: int) -> Any:
    """Row i of a column: a list/tuple, or a tensor's first dimension (images=[n, 3, H, W]), is indexed
    (None past its end); anything else is broadcast."""
    if isinstance(column, (list, tuple)) or (hasattr(column, "dim") and column.dim() > 0):
        return column[i] if i < len(column) else None
    return column


def row_texts(columns: dict[str, Any], column: str, n: int, reward: str) -> list[str]:
    """Each of the n rows' text from `column` ("caption": the text-to-image task's prompt text), or from
    "prompt" on a direct call that names it so; a row without one is an error naming the reward."""
    texts = columns.get(column, columns.get("prompt"))
    rows = [column_value(texts, i) for i in range(n)]
    if any(t is None for t in rows):
        raise ValueError(f"the {reward} reward needs the {column!r} column")
    return [str(t) for t in rows]


def per_completion(score: Callable[..., float | None] | None = None, *, on_error: float | None = 0.0) -> Any:
    """Decorator: `score(completion, **row)` -> a batched reward that never raises.

    `row` holds this completion's value of every column. A score that raises, or is not a number,
    becomes `on_error` (0.0: a malformed completion earns nothing).
    """

    def lift(fn: Callable[..., float | None]) -> RewardFn:
        @functools.wraps(fn)
        def reward(completions: list[str], **columns: Any) -> list[float | None]:
            out: list[float | None] = []
            for i, completion in enumerate(completions):
                try:
                    value = fn(completion, **{k: column_value(v, i) for k, v in columns.items()})
                    out.append(None if value is None else float(value))
                except Exception:  # noqa: BLE001 - a reward never raises (docs/architecture.md#reward)
                    out.append(on_error)
            return out

        return reward

    return lift(score) if score is not None else lift


class CompositeReward:
    """Weighted sum of named rewards; `score` returns the sum with each part's scores.

    A part that returns None for a completion does not contribute to it; a completion for which
    every part is None scores None. A part that raises (it should not) scores 0.0 for the batch.
    """

    def __init__(self, parts: Sequence[tuple[str, RewardFn, float]]):
        names = [name for name, _, _ in parts]
        if not parts:
            raise ValueError("CompositeReward needs at least one (name, reward_fn, weight) part")
        if len(set(names)) != len(names):
            raise ValueError(f"CompositeReward part names must be unique, got {names}")
        for name, fn, weight in parts:
            if not callable(fn):
                raise TypeError(f"part {name!r}: reward function {fn!r} is not callable")
            if not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ValueError(f"part {name!r}: weight must be a finite number, got {weight!r}")
        self.parts = [(name, fn, float(weight)) for name, fn, weight in parts]

    @property
    def weights(self) -> dict[str, float]:
        return {name: weight for name, _, weight in self.parts}

    def __call__(self, completions: list[str], **columns: Any) -> list[float | None]:
        return self.score(completions, **columns).scores

    def score(self, completions: list[str], **columns: Any) -> RewardResult:
        n = len(completions)
        total = [0.0] * n
        applicable = [False] * n
        parts: dict[str, list[float | None]] = {}
        for name, fn, weight in self.parts:
            try:
                scores = list(fn(completions, **columns))
            except Exception:  # noqa: BLE001
                scores = [0.0] * n
            scores = (scores + [None] * n)[:n]  # a part of the wrong length must not misalign rows
            parts[name] = scores
            for i, s in enumerate(scores):
                if s is not None:
                    total[i] += weight * s
                    applicable[i] = True
        return RewardResult([t if a else None for t, a in zip(total, applicable)], parts)

    def __repr__(self) -> str:
        inner = ", ".join(f"{name}*{weight:g}" for name, _, weight in self.parts)
        return f"CompositeReward({inner})"


def score_parts(reward: RewardFn, completions: list[str], **columns: Any) -> RewardResult:
    """`reward`'s scores with its parts: a CompositeReward's breakdown, none for a plain function."""
    if isinstance(reward, CompositeReward):
        return reward.score(completions, **columns)
    return RewardResult(list(reward(completions, **columns)))


def d1_math_reward(correctness_weight: float = 2.0, format_weight: float = 0.5,
                   strict: bool = False) -> CompositeReward:
    """d1's preset (Zhao et al. 2025, diffu-GRPO): math correctness x2.0 + answer-format x0.5.

    d1 sums five functions (xmlcount, soft, strict, int, correctness); we keep its two
    load-bearing ones with its weights. strict=True uses the strict format regex instead of the soft one.
    """
    from ddrl.rewards.format import soft_format_reward, strict_format_reward
    from ddrl.rewards.math import math_correctness_reward

    fmt = strict_format_reward if strict else soft_format_reward
    return CompositeReward([("correctness", math_correctness_reward, correctness_weight),
                            ("format", fmt, format_weight)])
