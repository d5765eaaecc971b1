"""Pinned numbers must hold on any x86-64 CPU torch supports, not only on the machine they were made on
(issue 32): a bit-for-bit float pin passes where it was recorded and fails on the next CPU type.

torch picks its vector kernels (softmax, exp, reductions, normal draws) by the CPU's capability, and
ATEN_CPU_CAPABILITY makes it use another set on this machine, as an AVX2-only or a pre-AVX2 CPU would;
MKL (float32/float64 matmuls) and oneDNN (bf16 matmuls) choose theirs too, capped by
MKL_ENABLE_INSTRUCTIONS and ONEDNN_MAX_CPU_ISA. So every test marked `pinned` (pyproject.toml: compares
numbers recorded on one machine) runs again here in a subprocess as on an AVX2 CPU and as on a pre-AVX2
one: a pin that only holds on the developer's CPU fails on the developer's machine. The two runs go
side by side, one thread each: on a machine with two free cores the check adds one run of the pinned
tests to `make test` (1-2 minutes).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent


def pinned_files() -> list[str]:
    """The test files that mark tests `pinned` (this one marks none: it would run itself)."""
    marker = "pytest.mark." + "pinned"  # split: this file's own text does not count
    return sorted(str(p.relative_to(ROOT)) for p in TESTS.rglob("test_*.py") if marker in p.read_text())


def test_the_seeded_pins_are_marked():
    assert {"tests/unit/test_ursa_seeded.py", "tests/unit/test_mmada_t2i_seeded.py"} <= set(pinned_files())


# ATEN_CPU_CAPABILITY -> the matching caps of MKL's and oneDNN's own dispatch
CAPABILITIES = {"avx2": dict(MKL_ENABLE_INSTRUCTIONS="AVX2", ONEDNN_MAX_CPU_ISA="AVX2"),
                "default": dict(MKL_ENABLE_INSTRUCTIONS="SSE4_2", ONEDNN_MAX_CPU_ISA="SSE41")}


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[str, subprocess.CompletedProcess]]:
    """capability -> (the capability torch reports, the pinned tests' run): both runs at once, one thread
    each, so on a machine with two cores or more the check costs one run's time."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "pinned", *pinned_files()]
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    envs = {c: dict(os.environ, ATEN_CPU_CAPABILITY=c, OMP_NUM_THREADS="1", **libs)
            for c, libs in CAPABILITIES.items()}
    started = {c: subprocess.Popen(cmd, cwd=ROOT, env=envs[c], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True) for c in CAPABILITIES}
    out = {}
    try:
        for c, proc in started.items():
            log = proc.communicate(timeout=900)[0]
            used = subprocess.run([sys.executable, "-c", probe], env=envs[c], capture_output=True, text=True,
                                  check=True).stdout.strip()
            out[c] = used, subprocess.CompletedProcess(cmd, proc.returncode, log, "")
    finally:  # a run past the timeout is not left behind
        for proc in started.values():
            if proc.poll() is None:
                proc.kill()
    return out


@pytest.mark.parametrize("capability", list(CAPABILITIES))
def test_pinned_tests_pass_under_other_cpu_kernels(runs, capability):
    used, done = runs[capability]
    assert used == capability.upper()  # torch honours the variable: the run is a real other-CPU run
    assert done.returncode == 0, (f"pinned tests fail under ATEN_CPU_CAPABILITY={capability} (as on another CPU): "
                                  f"a pin holds on this machine only; compare within the spread measured under "
                                  f"avx2, default and native\n{done.stdout[-6000:]}")
    assert " passed" in done.stdout
