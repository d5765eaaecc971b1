"""Every method names the released code its golden test was made from, and the commit it names is
the one the committed fixture was recorded at (so `ddrl methods` and the fixtures cannot drift)."""

from __future__ import annotations

import re

import pytest

import ddrl.objectives  # noqa: F401  (registers the objectives)
from ddrl.registry import OBJECTIVES
from tests.fixtures.methods.method_common import load

FIXTURE_OF = {"grpo": "d1", "diffu_grpo": "d1", "wd1": "wd1", "spg": "spg", "stable_drl": "stable_drl",
              "espo": "espo", "gdsd": "gdsd", "gdsd_tlc": "gdsd_tlc", "tracerl": "tracerl", "unigrpo": "unigrpo",
              "coupled_grpo": "coupled_grpo", "maskgrpo": "maskgrpo", "fpo": "dipod", "dipod": "dipod",
              "udm_grpo": "udm_grpo", "sepo": "sepo"}


def test_every_method_has_a_golden_fixture_or_says_why_not():
    assert set(OBJECTIVES.names()) - set(FIXTURE_OF) == {"daca_grpo"}  # no released code
    assert "none released" in OBJECTIVES.get("daca_grpo").source


@pytest.mark.parametrize("name", sorted(FIXTURE_OF))
def test_source_names_the_fixture_commit_and_file(name):
    source = OBJECTIVES.get(name).source
    _, meta = load(FIXTURE_OF[name])
    commit = re.search(r"@([0-9a-f]{7,40})\b", source)
    assert commit, f"{name}.source should name repo@commit: {source!r}"
    assert str(meta["commit"]).startswith(commit.group(1)) or commit.group(1).startswith(str(meta["commit"]))
    files = str(meta["file"]).split(";")[0].strip()
    assert files.split("/")[-1] in source, (source, meta["file"])
