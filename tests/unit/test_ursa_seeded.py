"""The metric_path sampler's seeded outputs are pinned (tests/fixtures/make_ursa_seeded.py made the data and
says how): tokens, the trajectory's states and softmax(z) at the final tokens, and process.velocity. The
law itself is checked against the authors' code in test_ursa.py; this file checks that no change to the
sampler moves a number, on any x86-64 CPU (issue 32).

What is compared how, measured under ATEN_CPU_CAPABILITY=default, avx2 and the native AVX512 against
data made under AVX512 (OMP_NUM_THREADS=1; capping MKL and oneDNN too, as test_portable_pins does,
changes the float64 runs' spreads by nothing):
  - float64 runs (plain, cfg, cfg_tempered, argmax, row_generators): token ids (completion, states,
    commit_step) bit for bit: 0 of them differed under any capability. token_probs within
    PROBS_ATOL = 3e-5, ten times the largest spread (2.8e-6 cfg, 2.3e-6 cfg_tempered under default;
    1.8e-7 under avx2; the sampler casts logits to float32). A real change is far larger: temperature
    1 -> 0.999 flips 19 of 128 cfg tokens, and teacher-forced moves token_probs by 6.7e-4.
  - the bf16 run, teacher-forced (make_ursa_seeded.teacher_forced_probs): each step's probabilities
    from the pinned state entering it. Free-running, its tokens are not portable (138 of 256 differ
    under avx2, 143 under default: a bf16 ulp in a logit, x7 by guidance, flips a draw and the rest
    follows). Teacher-forced, the mean |diff| of token_probs is 2.3e-3 (avx2) / 2.2e-3 (default), 2.4e-3
    with MKL and oneDNN capped to SSE as well (test_portable_pins), so BF16_MEAN_ATOL = 0.02 (8.3x);
    the max is not bounded (0.21 / 0.25: one ulp at a steep softmax).
    Feeding step k the state of step k+1 gives a mean of 0.22, dropping guidance 0.09; small changes
    (cfg 6 -> 5.5: 2.2e-3) are left to the float64 runs, which resolve them.
  - velocity (float32 whatever the weights): relative spread 4.4e-7, so VELOCITY_RTOL = 5e-6;
    moving s by 1e-4 changes it by 1.2e-3 (s = 0.3) to 0.21 (s = 0.97) relative.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.pinned  # re-run under other CPU kernel sets by test_portable_pins.py

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
EXPECTED = load_file(str(FIXTURES / "ursa" / "seeded" / "expected.safetensors"))
META = json.loads((FIXTURES / "ursa" / "seeded" / "expected.json").read_text())
_spec = importlib.util.spec_from_file_location("make_ursa_seeded", FIXTURES / "make_ursa_seeded.py")
MAKE = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(MAKE)

PROBS_ATOL = 3e-5
BF16_MEAN_ATOL = 0.02
VELOCITY_RTOL = 5e-6
FLOAT64_RUNS = [name for name, run in MAKE.RUNS.items() if run[0] == "float64"]
BF16_RUNS = [name for name, run in MAKE.RUNS.items() if run[0] == "bfloat16"]


@pytest.fixture(scope="module")
def models():
    return {dtype: MAKE.load(dtype) for dtype in ("float64", "bfloat16")}


def expected(name: str) -> dict[str, torch.Tensor]:
    return {k.split("/", 1)[1]: v for k, v in EXPECTED.items() if k.startswith(f"{name}/")}


@pytest.mark.parametrize("name", FLOAT64_RUNS)
def test_seeded_run_is_unchanged(models, name):
    dtype, settings, rows, seed, row_generators, trajectory = MAKE.RUNS[name]
    assert META["runs"][name]["seed"] == seed and META["runs"][name]["dtype"] == dtype  # the data's run
    with torch.no_grad():
        got = MAKE.run(models[dtype], settings, rows, seed, row_generators, trajectory)
    want = expected(name)
    assert sorted(want) == sorted(got)
    for key, value in want.items():
        if value.is_floating_point():
            torch.testing.assert_close(got[key], value, rtol=0, atol=PROBS_ATOL, msg=lambda m: f"{name}/{key}: {m}")
        else:  # ids of a float64 run: exact
            assert torch.equal(got[key], value), f"{name}/{key} changed"


@pytest.mark.parametrize("name", BF16_RUNS)
def test_bf16_steps_are_unchanged(models, name):
    """Teacher-forced (module doc): the sampler runs and records the states it was fed; each step's
    softmax(z) from the pinned state matches the pinned trajectory on average."""
    dtype, settings, rows, seed, row_generators, trajectory = MAKE.RUNS[name]
    want = expected(name)
    with torch.no_grad():
        got = MAKE.run(models[dtype], settings, rows, seed, row_generators, trajectory)
        forced = MAKE.teacher_forced_probs(models[dtype], settings, rows, want["states"], want["completion_ids"])
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in want.items()}
    gap = (forced - want["token_probs"]).abs().mean().item()
    assert gap <= BF16_MEAN_ATOL, f"{name}: teacher-forced token_probs are {gap:.2e} away on average"


def test_teacher_forcing_replays_the_sampler(models):
    """teacher_forced_probs is the sampler's own record when fed the sampler's own states (same
    machine, same test: exact), so the bf16 check above compares like with like."""
    dtype, settings, rows, seed, row_generators, _ = MAKE.RUNS["cfg"]
    with torch.no_grad():
        got = MAKE.run(models[dtype], settings, rows, seed, row_generators, True)
        forced = MAKE.teacher_forced_probs(models[dtype], settings, rows, got["states"], got["completion_ids"])
    assert torch.equal(forced, got["token_probs"])


def test_velocity_is_unchanged(models):
    process = models["float64"].process
    x1, xt = EXPECTED["velocity_x1"], EXPECTED["velocity_xt"]
    for s in META["velocity_s"]:
        torch.testing.assert_close(process.velocity(x1, xt, s), EXPECTED[f"velocity_s{s}"], rtol=VELOCITY_RTOL,
                                   atol=0, msg=lambda m: f"s={s}: {m}")
