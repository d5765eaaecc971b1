"""The metric_path sampler's seeded outputs are pinned bit for bit (CPU float32): tokens, the trajectory's
softmax(z) and process.velocity as main @ 37d3af6 computed them, before the CTMC step was rewritten to
hold fewer full-size temporaries (tests/fixtures/make_ursa_seeded.py made the data and says how). The
law itself is checked against the authors' code in test_ursa.py; this file checks that saving memory
changed no number."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
EXPECTED = load_file(str(FIXTURES / "ursa" / "seeded" / "expected.safetensors"))
META = json.loads((FIXTURES / "ursa" / "seeded" / "expected.json").read_text())
_spec = importlib.util.spec_from_file_location("make_ursa_seeded", FIXTURES / "make_ursa_seeded.py")
MAKE = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(MAKE)


@pytest.fixture(scope="module")
def models():
    return {dtype: MAKE.load(dtype) for dtype in ("float32", "bfloat16")}


@pytest.mark.parametrize("name", list(MAKE.RUNS))
def test_seeded_run_is_unchanged(models, name):
    dtype, settings, rows, seed, row_generators, trajectory = MAKE.RUNS[name]
    assert META["runs"][name]["seed"] == seed  # the run the data was made with
    with torch.no_grad():
        got = MAKE.run(models[dtype], settings, rows, seed, row_generators, trajectory)
    keys = [k.split("/", 1)[1] for k in EXPECTED if k.startswith(f"{name}/")]
    assert sorted(keys) == sorted(got)
    for key in keys:
        assert torch.equal(got[key], EXPECTED[f"{name}/{key}"]), f"{name}/{key} changed"


def test_velocity_is_unchanged(models):
    process = models["float32"].process
    x1, xt = EXPECTED["velocity_x1"], EXPECTED["velocity_xt"]
    for s in META["velocity_s"]:
        assert torch.equal(process.velocity(x1, xt, s), EXPECTED[f"velocity_s{s}"]), s
