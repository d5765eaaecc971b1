"""Rewards bounded by CPU time, not wall time (issue 23, item 5; ddrl/rewards/cpu_budget.py).

math-verify's own timeouts are wall-clock alarms, so on a busy machine a completion that takes a
second of CPU timed out and scored 0 where an idle machine scored it 1. The worker's budget counts
CPU time: wall time (sleeping, waiting for a CPU) is free, computing is not.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddrl.rewards import cpu_budget
from ddrl.rewards.cpu_budget import CPUBudgetWorker, Outcome
from ddrl.rewards.math import math_correct, math_correctness_reward

JOBS = "tests.unit.cpu_budget_jobs"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def worker():
    w = CPUBudgetWorker()
    yield w
    w.close()


def test_wall_time_is_free_cpu_time_is_not(worker):
    assert worker.map(f"{JOBS}:sleep", [[1.0]], budget_s=0.2) == [Outcome("ok", "slept")]
    before = cpu_budget.over_budget_count()
    assert worker.map(f"{JOBS}:spin", [[0.05], [30.0], [0.05]], budget_s=0.5) == \
        [Outcome("ok", 0.05), Outcome("over_budget"), Outcome("ok", 0.05)]
    assert cpu_budget.over_budget_count() == before + 1


def test_a_job_that_swallows_the_interruption_is_still_over_budget(worker):
    """Library code with a bare `except` may catch the budget's exception and carry on."""
    assert worker.map(f"{JOBS}:swallow", [[1.0]], budget_s=0.2) == [Outcome("over_budget")]


def test_a_c_loop_the_timer_cannot_interrupt_is_ended_by_rlimit_cpu(worker):
    """A key derivation inside OpenSSL never returns to the interpreter; the kernel's RLIMIT_CPU ends the
    worker a few CPU seconds past the budget, and the jobs after it run in a fresh worker."""
    worker.map(f"{JOBS}:spin", [[0.0]], budget_s=1.0)
    first_pid = worker.pid
    before = cpu_budget.over_budget_count()
    out = worker.map(f"{JOBS}:c_loop", [[], []], budget_s=0.1)
    assert out == [Outcome("over_budget"), Outcome("over_budget")]
    assert cpu_budget.over_budget_count() == before + 2
    assert worker.map(f"{JOBS}:sleep", [[0.0]], budget_s=1.0) == [Outcome("ok", "slept")]
    assert worker.pid != first_pid


def test_setup_errors_are_errors_not_verdicts(worker):
    with pytest.raises(RuntimeError, match="cannot run tests.unit.cpu_budget_jobs:nothing_here"):
        worker.map(f"{JOBS}:nothing_here", [[]], budget_s=1.0)
    with pytest.raises(ValueError, match="budget_s must be > 0"):
        worker.map(f"{JOBS}:sleep", [[0.0]], budget_s=0)
    assert worker.map(f"{JOBS}:sleep", [[0.0]], budget_s=1.0) == [Outcome("ok", "slept")]


def test_a_completion_over_the_math_budget_scores_none(monkeypatch):
    monkeypatch.setattr("ddrl.rewards.math.CPU_BUDGET_S", 0.01)
    gold, answer = _hard_case(7)  # a fresh gold: its parse is not in the worker's cache
    assert math_correctness_reward([answer, "<answer>\\boxed{1}</answer>"], answer=[gold, None]) == [None, None]


def _hard_case(n: int) -> tuple[str, str]:
    """A gold answer whose parse takes about a second of CPU time ((x+y+z)^n expanded, n=12: 91
    terms, 1,864 characters; ~1.3 s on this machine), and a completion that gives it factored."""
    import sympy

    x, y, z = sympy.symbols("x y z")
    return sympy.latex(sympy.expand((x + y + z) ** n)), f"<answer>\\boxed{{(x + y + z)^{{{n}}}}}</answer>"


_SCORE = "import sys; from ddrl.rewards.math import math_correct; print(math_correct(sys.argv[1], sys.argv[2]))"


def _score_in_fresh_process(gold: str, answer: str, cpu: int) -> str:
    """math_correct in a new Python process on one CPU (its worker inherits the CPU): no cache is warm."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", _SCORE, answer, gold], env=env, capture_output=True, text=True,
                          preexec_fn=lambda: os.sched_setaffinity(0, {cpu}), timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_verdict_is_the_same_on_a_busy_machine():
    """The same hard completion, scored once with its CPU to itself and once sharing that CPU with
    two busy processes (a third of the CPU or less: each second of CPU takes three or more of wall
    time, past math-verify's old 2 s alarm). Pinning everything to one CPU makes the load the same
    on any machine. It cannot flake: the verdict depends on no clock but CPU time, and the budget
    (5 CPU s) is over three times what the case uses (1.3-1.5 s, busy or idle)."""
    cpu = min(os.sched_getaffinity(0))
    gold, answer = _hard_case(12)
    idle = _score_in_fresh_process(gold, answer, cpu)
    burn = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                             preexec_fn=lambda: os.sched_setaffinity(0, {cpu})) for _ in range(2)]
    try:
        busy = _score_in_fresh_process(gold, answer, cpu)
    finally:
        for p in burn:
            p.kill()
            p.wait()
    assert idle == busy == "1.0"


def test_math_correct_runs_in_the_worker_off_the_main_thread():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(math_correct, ["<answer>1/2</answer>", "<answer>3</answer>"] * 4, ["0.5", "4"] * 4))
    assert got == [1.0, 0.0] * 4
