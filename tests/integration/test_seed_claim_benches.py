"""The seed-claim benches (docs/seed_claims.md) run in --quick mode and write what the doc reads."""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import pytest

from tests.integration.conftest import ROOT


@pytest.fixture(autouse=True)
def registry_restored():
    """The DiPOD bench registers its own tiny task; keep it out of the registry other tests see
    (tests/unit/test_splits.py checks every registered task)."""
    from ddrl.registry import TASKS

    TASKS.names()  # load the built-ins first, so the snapshot has them
    saved = dict(TASKS._items)
    yield
    TASKS._items.clear()
    TASKS._items.update(saved)


def load_bench(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses with string annotations look their module up there
    spec.loader.exec_module(module)
    return module


def check_study(study: dict, out, labels: list[str]) -> None:
    """A Sudoku study: every run has a dev curve from the base, its test rate and paired gain with
    intervals on the same test puzzles as the base, and results.json holds the same runs."""
    n = study["budget"]["test_n"]
    assert [r["label"] for r in study["runs"]] == labels
    assert study["base_test"]["n"] == n and 0 <= study["base_test"]["lo"] <= study["base_test"]["hi"] <= 1
    for r in study["runs"]:
        assert r["dev"][0]["step"] == 0 and r["dev"][-1]["step"] == study["budget"]["steps"]
        assert r["test"]["lo"] <= r["test"]["mean"] <= r["test"]["hi"] and r["test"]["n"] == n
        assert r["gain"]["lo"] <= r["gain"]["mean"] <= r["gain"]["hi"]
        assert len(study["finals"][r["label"]]) == n
        assert all(g is None or math.isfinite(g) for g in r["grad_norm"])
    saved = json.loads((out / "results.json").read_text())
    assert [r["label"] for r in saved["runs"]] == labels


def test_stress_ratio_noise_quick(tmp_path, capsys):
    out = tmp_path / "stress"
    study = load_bench("stress_ratio_noise").main(["--quick", "--out", str(out)])
    labels = [f"{m}-noise{s}" for m in ("grpo", "espo", "stable_drl") for s in ("0", "3")]
    check_study(study, out, labels)
    assert set(study["noise_effect"]) == {"grpo", "espo", "stable_drl"}
    assert (out / "stress_ratio_noise.png").stat().st_size > 0
    assert "| stable_drl | 3.0 |" in capsys.readouterr().out


def test_maskgrpo_gamma_quick(tmp_path):
    out = tmp_path / "gamma"
    study = load_bench("maskgrpo_gamma").main(["--quick", "--out", str(out)])
    check_study(study, out, ["gamma0", "gamma0.6"])
    assert list(study["vs_paper_gamma"]) == ["gamma0"]
    assert (out / "maskgrpo_gamma.png").stat().st_size > 0


def test_dipod_elbo_gap_quick(tmp_path):
    """The enumerated policy is a distribution, the bound holds (gap >= 0) at every measured point,
    and the curves cover every measured step of both arms."""
    out = tmp_path / "dipod"
    result = load_bench("dipod_elbo_gap").main(["--quick", "--out", str(out)])
    assert result["base"]["pi_total_max_error"] < 1e-9
    for run in result["runs"]:
        for point in run["curve"]:
            assert point["gap_on_policy"] >= -1e-9 and point["gap_fixed"] >= -1e-9
            assert 0.0 <= point["reward"] <= 1.0
    assert set(result["summary"]) == {"fpo", "dipod"}
    assert [p["step"] for p in result["runs"][0]["curve"]] == [0, 1, 2]
    assert (out / "dipod_elbo_gap.png").stat().st_size > 0


def test_dipod_exact_elbo_is_the_mean_over_orders(tmp_path):
    """The subset form of the ELBO equals E_sigma[log p_sigma(x)] (the any-order identity the bench
    relies on), log pi >= ELBO for every completion, and pi sums to one over the vocabulary."""
    import torch

    from ddrl.models import load_model

    bench = load_bench("dipod_elbo_gap")
    model = load_model(bench.pretrain_base(tmp_path, steps=20))
    lp = bench.masked_logprobs(model, list(bench.SYMBOLS), bench.all_completions(model))
    q = bench.exact_quantities(lp)
    torch.testing.assert_close(q["elbo"], bench.order_logprobs(lp).mean(0), rtol=0, atol=1e-10)
    assert bool((q["log_pi"] >= q["elbo"] - 1e-12).all())
    torch.testing.assert_close(q["log_pi"].exp().sum(1), torch.ones(3, dtype=torch.float64), rtol=0, atol=1e-12)
    assert float((q["log_pi"] - q["elbo"]).max()) > 1e-6  # a non-trivial model: the orders disagree
