"""The image samplers' seeded outputs on a text-to-image MMaDA are pinned bit for bit (CPU): emerge in
ddrl's rng layout (guided or not, one block or two, row generators, MaskGRPO's attended padding), in the
released layout, and maskgit, tokens and the emerge trajectories, and one text MMaDA run, as main @
41138da computed them, before the samplers asked the model for the codebook's logits only
(tests/fixtures/make_mmada_t2i_seeded.py made the data and says how). The laws themselves are checked
against the authors' code in test_mmada_t2i_golden.py and test_emerge_released.py; this file checks
that computing fewer logits changed no number."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
EXPECTED = load_file(str(FIXTURES / "mmada_t2i" / "seeded" / "expected.safetensors"))
META = json.loads((FIXTURES / "mmada_t2i" / "seeded" / "expected.json").read_text())
_spec = importlib.util.spec_from_file_location("make_mmada_t2i_seeded", FIXTURES / "make_mmada_t2i_seeded.py")
MAKE = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(MAKE)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    vq = MAKE.magvit_dir(tmp_path_factory.mktemp("magvit"))
    return {key: MAKE.load(*key, vq) for key in {(kind, dtype) for kind, dtype, *_ in MAKE.RUNS.values()}}


@pytest.mark.parametrize("name", list(MAKE.RUNS))
def test_seeded_run_is_unchanged(models, name):
    kind, dtype, settings, rows, seed, row_generators, trajectory = MAKE.RUNS[name]
    assert META["runs"][name]["seed"] == seed  # the run the data was made with
    with torch.no_grad():
        got = MAKE.run(models[kind, dtype], settings, rows, seed, row_generators, trajectory)
    keys = [k.split("/", 1)[1] for k in EXPECTED if k.startswith(f"{name}/")]
    assert sorted(keys) == sorted(got)
    for key in keys:
        # bit for bit; NaN where the trajectory has no entry (steps before a position's block)
        torch.testing.assert_close(got[key], EXPECTED[f"{name}/{key}"], rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m: f"{name}/{key} changed: {m}")
