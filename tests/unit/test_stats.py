"""Interval statistics (ddrl/stats.py) against published values and known distributions, not
against the module's own formulas: Wilson intervals from Newcombe (1998), bootstrap coverage on
data whose mean is known, the cluster bootstrap on correlated clusters."""

from __future__ import annotations

import numpy as np
import pytest

from ddrl.stats import (Estimate, bootstrap_interval, gain_estimate, mean_estimate, normal_quantile,
                             paired_bootstrap_diff, rate_estimate, score_estimate, wilson_interval)

# Newcombe (1998), "Two-sided confidence intervals for the single proportion", Statistics in
# Medicine 17:857-872, Table I, method 3 (score interval without continuity correction), and the
# textbook 8/10.
NEWCOMBE = [((81, 263), (0.2553, 0.3662)), ((15, 148), (0.0624, 0.1605)), ((0, 20), (0.0, 0.1611)),
            ((1, 29), (0.0061, 0.1718)), ((8, 10), (0.4902, 0.9433))]


@pytest.mark.parametrize("counts,expected", NEWCOMBE)
def test_wilson_matches_published_values(counts, expected):
    lo, hi = wilson_interval(*counts)
    assert lo == pytest.approx(expected[0], abs=6e-5) and hi == pytest.approx(expected[1], abs=6e-5)


def test_wilson_bounds_levels_and_errors():
    assert normal_quantile(0.95) == pytest.approx(1.959964, abs=1e-6)
    assert wilson_interval(10, 10)[1] == 1.0 and wilson_interval(0, 10)[0] == 0.0
    narrow, wide = wilson_interval(8, 10, level=0.9), wilson_interval(8, 10, level=0.99)
    assert wide[0] < 0.4902 < narrow[0] and narrow[1] < 0.9433 < wide[1]
    for bad in [(1, 0), (11, 10), (-1, 10)]:
        with pytest.raises(ValueError, match="n >= 1|successes"):
            wilson_interval(*bad)
    with pytest.raises(ValueError, match="level"):
        wilson_interval(5, 10, level=95)


def _coverage(datasets, truth, **kwargs) -> tuple[float, float]:
    """(share of intervals containing truth, mean width)."""
    intervals = [bootstrap_interval(d, seed=i, **kwargs) for i, d in enumerate(datasets)]
    return (float(np.mean([lo <= truth <= hi for lo, hi in intervals])),
            float(np.mean([hi - lo for lo, hi in intervals])))


def test_bootstrap_covers_a_known_mean():
    rng = np.random.default_rng(0)
    datasets = rng.binomial(1, 0.3, size=(400, 200)).astype(float)  # a rate: true mean 0.3
    coverage, width = _coverage(datasets, 0.3, n_boot=1000)
    assert 0.92 <= coverage <= 0.98  # 0.95 +- 3 standard errors of 400 intervals
    assert width == pytest.approx(2 * 1.96 * np.sqrt(0.3 * 0.7 / 200), rel=0.1)  # the normal interval's width
    uniform = rng.uniform(size=(400, 100))  # a partial-credit score: true mean 0.5
    assert 0.92 <= _coverage(uniform, 0.5, n_boot=1000)[0] <= 0.98


def test_cluster_bootstrap_covers_where_the_iid_one_is_too_narrow():
    # 30 clusters of 10 examples sharing a cluster effect (intra-cluster correlation 0.8), true mean 0:
    # the iid bootstrap counts 300 examples, the data hold about 30 independent pieces of information
    rng = np.random.default_rng(1)
    clusters = np.repeat(np.arange(30), 10)
    datasets = rng.normal(size=(300, 30))[:, clusters] + rng.normal(scale=0.5, size=(300, 300))
    iid_coverage, iid_width = _coverage(datasets, 0.0, n_boot=500)
    cluster_coverage, cluster_width = _coverage(datasets, 0.0, clusters=clusters, n_boot=500)
    assert cluster_coverage >= 0.88 and iid_coverage <= 0.7
    assert cluster_width > 2.3 * iid_width  # design effect 1 + 9 * 0.8: width ratio ~2.9


def test_bootstrap_is_seeded_and_clusters_of_one_are_the_iid_bootstrap():
    values = np.random.default_rng(2).normal(size=50)
    assert bootstrap_interval(values, seed=3) == bootstrap_interval(values, seed=3)
    assert bootstrap_interval(values, seed=3) != bootstrap_interval(values, seed=4)
    assert bootstrap_interval(values, seed=np.random.default_rng(3)) == bootstrap_interval(values, seed=3)
    assert bootstrap_interval(values, clusters=list(range(50)), seed=5) == bootstrap_interval(values, seed=5)
    assert bootstrap_interval([0.7] * 20) == pytest.approx((0.7, 0.7))


def test_cluster_means_weigh_examples_not_clusters():
    # a cluster of 3 ones and a cluster of 1 zero: the mean is 0.75, and resamples of the two
    # clusters give means 1, 0.75 or 0 (never the 0.5 a mean of cluster means would give)
    lo, hi = bootstrap_interval([1.0, 1.0, 1.0, 0.0], clusters=["a", "a", "a", "b"], level=0.5, n_boot=4000)
    assert (lo, hi) == (0.75, 0.75)
    assert mean_estimate([1.0, 1.0, 1.0, 0.0], clusters=["a", "a", "a", "b"]).clusters == 2


def test_paired_gain_cancels_what_examples_share():
    rng = np.random.default_rng(4)
    difficulty = rng.uniform(size=1000)
    before = (rng.uniform(size=1000) > difficulty).astype(float)
    after = np.maximum(before, rng.uniform(size=1000) < 0.06)  # fixes ~6% of the examples, breaks none
    diff, lo, hi = paired_bootstrap_diff(before, after, seed=0)
    assert diff == pytest.approx(after.mean() - before.mean(), abs=1e-12) and lo < diff < hi and lo > 0
    d = after - before
    assert hi - lo == pytest.approx(2 * 1.96 * d.std() / np.sqrt(1000), rel=0.15)  # the paired normal width
    unpaired = 2 * 1.96 * np.sqrt(before.var() / 1000 + after.var() / 1000)
    assert hi - lo < 0.6 * unpaired  # pairing is what makes a 3-point gain measurable here


def test_paired_gain_covers_a_known_shift():
    rng = np.random.default_rng(5)
    hits = 0
    for i in range(300):
        base = rng.normal(size=80)
        before, after = base + rng.normal(scale=0.3, size=80), base + 0.1 + rng.normal(scale=0.3, size=80)
        _, lo, hi = paired_bootstrap_diff(before, after, n_boot=500, seed=i)
        hits += lo <= 0.1 <= hi
    assert 0.91 <= hits / 300 <= 0.985


def test_estimates_format_and_verdicts():
    gain = Estimate(0.051, 0.027, 0.076, 1000, method="paired_bootstrap")
    assert gain.excludes_zero and gain.verdict() == "+5.1 pt [+2.7, +7.6], n=1000"
    flat = Estimate(0.004, -0.012, 0.020, 1000)
    assert not flat.excludes_zero and flat.verdict() == "no measurable gain (+0.4 pt [-1.2, +2.0], n=1000)"
    loss = Estimate(-0.03, -0.05, -0.01, 500, clusters=288)
    assert loss.excludes_zero and loss.verdict() == "-3.0 pt [-5.0, -1.0], n=500, 288 clusters"
    rate = rate_estimate(756, 1000)
    assert rate.method == "wilson" and rate.format() == "75.6% [72.8, 78.2], n=1000"
    assert rate.as_dict() == {"mean": 0.756, "lo": rate.lo, "hi": rate.hi, "n": 1000, "clusters": None,
                              "method": "wilson", "level": 0.95}


def test_score_estimate_picks_the_interval_the_protocol_asks_for():
    verdicts = [1.0, 0.0, 1.0, 1.0] * 25
    assert score_estimate(verdicts).method == "wilson"
    assert score_estimate(verdicts).lo == pytest.approx(wilson_interval(75, 100)[0])
    assert score_estimate([0.5, 0.25, 1.0, 0.0] * 25).method == "bootstrap"  # partial credit
    clustered = score_estimate(verdicts, clusters=[i // 4 for i in range(100)])
    assert clustered.method == "cluster_bootstrap_or_wilson" and clustered.clusters == 25
    assert clustered.lo <= wilson_interval(75, 100)[0] and clustered.hi >= wilson_interval(75, 100)[1]
    solved = score_estimate([1.0] * 64, clusters=[i // 2 for i in range(64)])  # every verdict agrees
    assert solved.hi == 1.0 and solved.lo == pytest.approx(wilson_interval(64, 64)[0])  # not the bootstrap's point
    assert score_estimate([0.5, 0.25, 1.0, 0.0] * 25, clusters=[i // 4 for i in range(100)]).method == "cluster_bootstrap"
    gain = gain_estimate([0.0] * 50 + [1.0] * 50, [1.0] * 100)
    assert gain.mean == 0.5 and gain.excludes_zero and gain.method == "paired_bootstrap"


def test_bad_scores_fail_naming_the_fix():
    with pytest.raises(ValueError, match="None"):
        bootstrap_interval([1.0, None])
    with pytest.raises(ValueError, match="finite"):
        bootstrap_interval([1.0, float("nan")])
    with pytest.raises(ValueError, match="one key per value"):
        bootstrap_interval([1.0, 0.0], clusters=["a"])
    with pytest.raises(ValueError, match="same examples"):
        paired_bootstrap_diff([1.0], [1.0, 0.0])
    with pytest.raises(ValueError, match="at least one"):
        mean_estimate([])


def test_pass_at_k_carries_intervals():
    from ddrl.eval.runner import pass_at_k

    rows = [{"correct": c} for c in ([True, False, False, False], [True] * 4, [False] * 4)] * 20  # 60 examples
    out = pass_at_k(rows, 4)
    assert out["pass@4"] == pytest.approx(2 / 3) and out["pass@1"] == pytest.approx(1.25 / 3)  # by hand
    for name in ("pass@4", "pass@1"):
        lo, hi = out[f"{name}_interval"]
        assert lo < out[name] < hi and hi - lo < 0.5
    # clusters: 3 clusters of 20 identical examples make the interval far wider than 60 independent ones
    width = lambda r: r["pass@4_interval"][1] - r["pass@4_interval"][0]  # noqa: E731
    clustered = pass_at_k(rows, 4, clusters=[("cluster", i % 3) for i in range(60)])
    assert width(clustered) > width(out)
