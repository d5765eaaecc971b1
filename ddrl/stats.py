"""Interval statistics for reported numbers: every score carries n and a 95% interval.

A score on a few hundred held-out examples moves by a few points from the examples alone, so a
number without its interval cannot say whether a method helped. The rules (issue 17):

- a rate (accuracy: k successes of n independent examples) gets a Wilson score interval
  (Wilson 1927), which stays inside [0, 1] and keeps its coverage near 0 and 1, where the normal
  approximation p +- z sqrt(p(1-p)/n) does not;
- a mean of anything else (a reward, a partial-credit metric) gets a percentile bootstrap;
- examples that are not independent (the puzzles of one 4x4 Sudoku grid; `Task.cluster_key`)
  are resampled as whole clusters (the cluster bootstrap, Davison & Hinkley 1997, sec. 3.8):
  resampling single puzzles would treat 1000 puzzles from 288 grids as 1000 independent draws
  and give an interval that is too narrow;
- a gain is measured on the same examples before and after (a paired bootstrap of the per-example
  differences), and is claimed only when its interval excludes zero; otherwise it is reported as
  "no measurable gain".

Randomness is explicit: a seed or a numpy Generator, never the global RNG.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from statistics import NormalDist
from typing import Any, Hashable, Sequence

import numpy as np

RandomSource = int | np.random.Generator


@dataclass(frozen=True)
class Estimate:
    """A reported number: its point value, the interval [lo, hi] at `level`, n examples, the
    number of clusters resampled (None: examples were independent) and the method."""

    mean: float
    lo: float
    hi: float
    n: int
    clusters: int | None = None
    # "wilson" | "bootstrap" | "cluster_bootstrap" | "cluster_bootstrap_or_wilson" | "paired_bootstrap" | ...
    method: str = "bootstrap"
    level: float = 0.95

    @property
    def excludes_zero(self) -> bool:
        """Whether the interval excludes 0: the only case in which a gain may be claimed."""
        return self.lo > 0.0 or self.hi < 0.0

    def format(self, *, scale: float = 100.0, unit: str = "%", signed: bool = False, digits: int = 1) -> str:
        """'75.6% [72.8, 78.2], n=1000' (clusters added when resampled: ', 288 clusters')."""
        sign = "+" if signed else ""
        value = f"{self.mean * scale:{sign}.{digits}f}"
        lo, hi = f"{self.lo * scale:{sign}.{digits}f}", f"{self.hi * scale:{sign}.{digits}f}"
        spaced = unit if unit in ("%", "") else f" {unit}"
        text = f"{value}{spaced} [{lo}, {hi}], n={self.n}"
        return text + (f", {self.clusters} clusters" if self.clusters is not None else "")

    def verdict(self, *, scale: float = 100.0, unit: str = "pt", digits: int = 1) -> str:
        """A gain as it may be reported: '+5.1 pt [+2.7, +7.6], n=1000' when the interval excludes
        zero, else 'no measurable gain (+0.4 pt [-1.2, +2.0], n=1000)'."""
        text = self.format(scale=scale, unit=unit, signed=True, digits=digits)
        return text if self.excludes_zero else f"no measurable gain ({text})"

    def as_dict(self) -> dict[str, Any]:
        """For JSON logs (`ddrl eval --json`, the trainer's metrics)."""
        return asdict(self)


def normal_quantile(level: float) -> float:
    """z with P(|Z| <= z) = level for a standard normal Z (1.959964 at 0.95)."""
    _check_level(level)
    return NormalDist().inv_cdf(0.5 + level / 2.0)


def wilson_interval(successes: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of a rate of `successes` in `n` independent trials.

    center = (p + z^2/2n) / (1 + z^2/n),  half = z / (1 + z^2/n) * sqrt(p(1-p)/n + z^2/4n^2).
    """
    if n <= 0:
        raise ValueError(f"a rate needs n >= 1 trials, got n={n}")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, n={n}], got {successes}")
    z, p = normal_quantile(level), successes / n
    denom = 1.0 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1.0 - p) / n + z * z / (4 * n * n))
    # exactly 0 (1) when no (every) trial succeeds: center - half is 0 there but for rounding
    lo = 0.0 if successes == 0 else max(0.0, center - half)
    hi = 1.0 if successes == n else min(1.0, center + half)
    return lo, hi


def bootstrap_interval(values: Sequence[float] | np.ndarray, *, clusters: Sequence[Hashable] | None = None,
                       level: float = 0.95, n_boot: int = 2000, seed: RandomSource = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values`.

    clusters: a key per value (e.g. the Sudoku solution grid); whole clusters are resampled with
    replacement and the mean is total / count over the resampled clusters, so a big cluster
    weighs as much as its examples. None: every value is its own cluster (the iid bootstrap).
    """
    sums, counts = _cluster_totals(values, clusters)
    means = _bootstrap_means(sums, counts, n_boot, _rng(seed))
    return _percentiles(means, level)


def paired_bootstrap_diff(before: Sequence[float], after: Sequence[float], *,
                          clusters: Sequence[Hashable] | None = None, level: float = 0.95, n_boot: int = 2000,
                          seed: RandomSource = 0) -> tuple[float, float, float]:
    """(mean(after) - mean(before), lo, hi) for a gain measured on the same examples.

    The examples (or clusters) are resampled once for both scores, so what is common to an
    example (its difficulty) cancels; the interval is that of the mean per-example difference.
    """
    if len(before) != len(after):
        raise ValueError(f"paired scores need one before and one after per example, got {len(before)} and "
                         f"{len(after)}; score both models on the same examples")
    diffs = _as_values(after) - _as_values(before)  # [n]
    lo, hi = bootstrap_interval(diffs, clusters=clusters, level=level, n_boot=n_boot, seed=seed)
    return float(diffs.mean()), lo, hi


def rate_estimate(successes: int, n: int, level: float = 0.95) -> Estimate:
    """A rate with its Wilson interval (independent examples)."""
    lo, hi = wilson_interval(successes, n, level)
    return Estimate(successes / n, lo, hi, n, None, "wilson", level)


def mean_estimate(values: Sequence[float] | np.ndarray, *, clusters: Sequence[Hashable] | None = None, level: float = 0.95,
                  n_boot: int = 2000, seed: RandomSource = 0) -> Estimate:
    """A mean with its bootstrap interval (over clusters when given)."""
    array = _as_values(values)
    lo, hi = bootstrap_interval(array, clusters=clusters, level=level, n_boot=n_boot, seed=seed)
    return Estimate(float(array.mean()), lo, hi, len(array), _n_clusters(clusters),
                    "cluster_bootstrap" if clusters is not None else "bootstrap", level)


def gain_estimate(before: Sequence[float], after: Sequence[float], *, clusters: Sequence[Hashable] | None = None,
                  level: float = 0.95, n_boot: int = 2000, seed: RandomSource = 0) -> Estimate:
    """A paired gain (after - before on the same examples); `.verdict()` is how to report it."""
    diff, lo, hi = paired_bootstrap_diff(before, after, clusters=clusters, level=level, n_boot=n_boot, seed=seed)
    method = "paired_cluster_bootstrap" if clusters is not None else "paired_bootstrap"
    return Estimate(diff, lo, hi, len(before), _n_clusters(clusters), method, level)


def score_estimate(values: Sequence[float], *, clusters: Sequence[Hashable] | None = None, level: float = 0.95,
                   n_boot: int = 2000, seed: RandomSource = 0) -> Estimate:
    """The interval a reported score gets: Wilson when the values are 0/1 verdicts of independent
    examples, else the (cluster) bootstrap."""
    array = _as_values(values)
    binary = bool(np.isin(array, (0.0, 1.0)).all())
    if clusters is None and binary:
        return rate_estimate(int(array.sum()), len(array), level)
    boot = mean_estimate(array, clusters=clusters, level=level, n_boot=n_boot, seed=seed)
    if not binary:
        return boot
    # 0/1 verdicts in clusters: the bootstrap collapses to a point when every verdict agrees (100%
    # solved), so the interval is the wider of the cluster bootstrap and Wilson's (never narrower
    # than the independent-examples interval).
    wilson = rate_estimate(int(array.sum()), len(array), level)
    return replace(boot, lo=min(boot.lo, wilson.lo), hi=max(boot.hi, wilson.hi),
                   method="cluster_bootstrap_or_wilson")


# --------------------------------------------------------------------------- internals


def _check_level(level: float) -> None:
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), e.g. 0.95, got {level}")


def _rng(seed: RandomSource) -> np.random.Generator:
    return seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)


def _as_values(values: Sequence[float] | np.ndarray) -> np.ndarray:
    if any(v is None for v in values):
        raise ValueError("a score is None (a reward that abstained); score it (e.g. as 0.0) or drop the example "
                         "before computing an interval")
    array = np.asarray(values, dtype=np.float64).reshape(-1)  # [n]
    if array.size == 0:
        raise ValueError("an interval needs at least one value")
    if not np.isfinite(array).all():
        raise ValueError("scores must be finite to compute an interval; found NaN or inf")
    return array


def _n_clusters(clusters: Sequence[Hashable] | None) -> int | None:
    return None if clusters is None else len(set(clusters))


def _cluster_totals(values: Sequence[float] | np.ndarray, clusters: Sequence[Hashable] | None) -> tuple[np.ndarray, np.ndarray]:
    """(sum, count) per cluster: [K], [K]; K = n without clusters."""
    array = _as_values(values)
    if clusters is None:
        return array, np.ones_like(array)
    if len(clusters) != len(array):
        raise ValueError(f"clusters needs one key per value: {len(clusters)} keys for {len(array)} values")
    index: dict[Hashable, int] = {}
    ids = np.fromiter((index.setdefault(c, len(index)) for c in clusters), dtype=np.int64, count=len(array))
    return np.bincount(ids, weights=array), np.bincount(ids).astype(np.float64)


def _bootstrap_means(sums: np.ndarray, counts: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """Means of n_boot resamples of the K clusters with replacement: [n_boot]."""
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    k = len(sums)
    means = np.empty(n_boot)
    rows = max(1, 2**22 // k)  # resample in chunks of [rows, K] indices (~32 MB)
    for start in range(0, n_boot, rows):
        draw = rng.integers(0, k, size=(min(rows, n_boot - start), k))  # [r, K]
        means[start:start + len(draw)] = sums[draw].sum(axis=1) / counts[draw].sum(axis=1)
    return means


def _percentiles(means: np.ndarray, level: float) -> tuple[float, float]:
    _check_level(level)
    lo, hi = np.quantile(means, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return float(lo), float(hi)
