"""bench/gpu/prepare.sh and check.sh on a machine with Python and torch but no package index (the lent
H200): the wheel list holds pyproject's pins, and check.sh --tiny passes in a fresh venv that has
only torch (and what torch brings) plus the prepared wheels."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
from pathlib import Path

import pytest

from tests.integration.conftest import ROOT

WHEELS_TXT = ROOT / "bench/gpu/wheels.txt"
TORCH_OWN = ("torch", "torchgen", "filelock", "fsspec", "jinja2", "markupsafe", "mpmath", "networkx", "sympy",
             "typing_extensions")  # torch and the packages it installs with itself: the machine's own


def pins(lines: list[str]) -> dict[str, str]:
    return {re.split(r"==", line)[0].lower().replace("_", "-"): line.split("==")[1].strip()
            for line in lines if "==" in line and not line.lstrip().startswith("#")}


def test_the_wheel_list_holds_pyprojects_pins():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = pins(project["dependencies"] + project["optional-dependencies"]["gpu"])
    listed = pins(WHEELS_TXT.read_text().splitlines())
    for name in ("numpy", "pyyaml", "safetensors", "tqdm", "transformers", "peft", "accelerate", "liger-kernel"):
        assert listed[name] == pinned[name], f"{name}: wheels.txt {listed[name]}, pyproject {pinned[name]}"


def link_torch(site: Path) -> None:
    """The machine's own torch: this interpreter's torch and its own dependencies, linked (with their
    .dist-info) into the fresh venv's site-packages."""
    here = Path(sysconfig.get_paths()["purelib"])
    for entry in here.iterdir():
        stem = re.split(r"[-.]", entry.name)[0].lower()
        if stem in TORCH_OWN and not (site / entry.name).exists():
            (site / entry.name).symlink_to(entry)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_prepared_wheels_plus_torch_run_check_sh_tiny(tmp_path):
    """Downloads the wheels (needs the package index; prepare.sh's own job), so skipped offline."""
    wheels = tmp_path / "whl"
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    env = {**os.environ, "WHEELS": str(wheels), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    prepared = subprocess.run(["bash", str(ROOT / "bench/gpu/prepare.sh"), "--python-version", version], env=env,
                              capture_output=True, text=True, timeout=300)
    if prepared.returncode != 0 and re.search(r"(?i)connection|resolve|network|no matching distribution",
                                              prepared.stderr):
        pytest.skip(f"no package index: {prepared.stderr[-300:]}")
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    assert len(list(wheels.glob("*.whl"))) == len(pins(WHEELS_TXT.read_text().splitlines()))

    fresh = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(fresh)
    python = fresh / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    link_torch(site)
    bare = subprocess.run([python, "-c", "import torch, numpy"], capture_output=True, text=True)
    assert "No module named 'numpy'" in bare.stderr, "the venv must hold torch and nothing of ddrl's: test is void"

    out = tmp_path / "report"
    done = subprocess.run(["bash", str(ROOT / "bench/gpu/check.sh"), "--tiny", "--out", str(out)],
                          env={**env, "PYTHON": str(python), "SITE": str(tmp_path / "site")},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert f"wheels from {wheels} installed" in done.stdout
    report = json.loads((out / "report.json").read_text())
    assert {name: report[name]["status"] for name in ("matmul", "rollout", "lora", "full")} == dict.fromkeys(
        ("matmul", "rollout", "lora", "full"), "ok")
