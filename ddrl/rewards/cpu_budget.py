"""Reward code under a CPU-time budget, in a worker process, so that no verdict depends on machine load.

math-verify bounds a parse or a comparison with a wall-clock alarm (`signal.alarm`, its
`parsing_timeout` / `timeout_seconds`; main thread only) and scores a timed-out comparison False.
On a busy machine the same comparison then scores 0 where an idle one scores 1 (issue 23, item 5).
Here the bound is the CPU time of the process doing the work, which other processes do not consume:

- one persistent worker process per parent process, started on first use (about 2 s: it imports
  sympy); batches of jobs go to it over a pipe as JSON lines and one result line comes back a job;
- each job may use `budget_s` seconds of the worker's CPU time. An ITIMER_PROF timer (process CPU
  time, not wall time) raises `OverBudget`, a BaseException, so that math-verify's and sympy's
  `except Exception` cannot turn it into an ordinary False;
- a job stuck where the interpreter does not regain control (a C loop in big-integer arithmetic)
  is ended by RLIMIT_CPU: the kernel kills the worker a few CPU seconds past the budget, the job is
  over budget and the next job gets a fresh worker;
- the outcome of a job is "ok" (its value), "over_budget" (counted in `over_budget_count()` and
  logged; rewards score it None) or "error" (the job raised).

The budget is generous (math.CPU_BUDGET_S) because CPU time is not perfectly load-independent
either: cache and SMT contention stretch it by tens of percent, not by the factor of the load.
The one wall-clock bound left is a liveness guard: a worker that writes nothing for STALL_S seconds
is not computing (it is blocked, as a compute-bound job always ends by RLIMIT_CPU), and is killed.

Jobs name a function as "module:function", imported by the worker before its first job's budget
starts (the import is not charged to a job); arguments and results are JSON values.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

HARD_LIMIT_GRACE_S = 1  # RLIMIT_CPU kills the worker 1-2 CPU seconds past a job's budget
STALL_S = 600.0  # liveness guard: a worker silent this long (wall clock) is blocked, not computing

_over_budget = 0
_counter_lock = threading.Lock()


@dataclass(frozen=True)
class Outcome:
    status: str  # "ok", "over_budget" or "error"
    value: Any = None  # the job's return value when ok; the error's text when error


def over_budget_count() -> int:
    """Jobs that ran out of CPU budget in this process so far."""
    return _over_budget


def _count_over_budget(fn: str, budget_s: float) -> None:
    global _over_budget
    with _counter_lock:
        _over_budget += 1
        n = _over_budget
    logger.warning("%s used its whole CPU budget (%g s); scored None (%d so far in this process)", fn, budget_s, n)


class CPUBudgetWorker:
    """A persistent worker process that runs jobs each under a CPU-time budget (see the module doc)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one batch at a time: the pipe carries one conversation
        self._proc: subprocess.Popen | None = None
        self._buffer = b""

    def map(self, fn: str, jobs: list[list[Any]], budget_s: float) -> list[Outcome]:
        """fn(*args) for each args in jobs, in the worker, each with `budget_s` CPU seconds."""
        if not budget_s > 0:
            raise ValueError(f"budget_s must be > 0 CPU seconds, got {budget_s!r}")
        out: list[Outcome] = []
        with self._lock:
            try:
                while len(out) < len(jobs):
                    out.extend(self._run(fn, jobs[len(out):], budget_s))
            except BaseException:  # e.g. KeyboardInterrupt mid-batch: unread replies would answer the next batch
                self._stop()
                raise
        for outcome in out:
            if outcome.status == "over_budget":
                _count_over_budget(fn, budget_s)
        return out

    def close(self) -> None:
        """Stop the worker (the next `map` starts a fresh one)."""
        with self._lock:
            self._stop()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None or self._proc.poll() is not None else self._proc.pid

    # ------------------------------------------------------------------ parent side
    def _start(self) -> subprocess.Popen:
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (package_root, os.environ.get("PYTHONPATH")) if p), OMP_NUM_THREADS="1")
        self._buffer = b""
        return subprocess.Popen([sys.executable, "-c", "from ddrl.rewards.cpu_budget import serve; serve()"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)

    def _stop(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                if pipe is not None:
                    pipe.close()
        self._proc = None

    def _run(self, fn: str, jobs: list[list[Any]], budget_s: float) -> list[Outcome]:
        """Send the jobs; read results until all came back or the worker died (that job: over budget)."""
        if self._proc is None or self._proc.poll() is not None:
            self._stop()
            self._proc = self._start()
        proc = self._proc
        assert proc.stdin is not None  # started with stdin=PIPE
        try:
            proc.stdin.write((json.dumps({"fn": fn, "budget_s": budget_s, "jobs": jobs}) + "\n").encode())
            proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died: the read below sees EOF
        results: list[Outcome] = []
        for _ in jobs:
            line = self._read_line(proc)
            if line is None:  # killed by RLIMIT_CPU (or stalled): the job in progress is over budget
                self._stop()
                return results + [Outcome("over_budget")]
            reply = json.loads(line)
            if "fatal" in reply:  # the worker cannot run `fn` at all: not a verdict, a setup error
                self._stop()
                raise RuntimeError(f"reward worker cannot run {fn}: {reply['fatal']}")
            results.append(Outcome(reply["status"], reply.get("value")))
        return results

    def _read_line(self, proc: subprocess.Popen) -> bytes | None:
        assert proc.stdout is not None  # started with stdout=PIPE
        fd = proc.stdout.fileno()
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([fd], [], [], STALL_S)
            if not ready:
                logger.error("reward worker wrote nothing for %g s (blocked, not computing); restarting it", STALL_S)
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line


_worker: CPUBudgetWorker | None = None
_worker_pid: int | None = None
_worker_lock = threading.Lock()


def shared_worker() -> CPUBudgetWorker:
    """This process's worker (a forked child gets its own: it must not talk on its parent's pipe)."""
    global _worker, _worker_pid
    with _worker_lock:
        if _worker is None or _worker_pid != os.getpid():
            _worker, _worker_pid = CPUBudgetWorker(), os.getpid()
            atexit.register(_worker.close)
        return _worker


# ---------------------------------------------------------------------- worker side
class OverBudget(BaseException):
    """Raised in a job that used up its CPU budget (a BaseException: `except Exception` lets it pass)."""


_armed = False
_fired = False


def _on_cpu_timer(signum: int, frame: Any) -> None:
    global _fired
    _fired = True
    if _armed:
        raise OverBudget


def _run_job(fn: Any, args: list[Any], budget_s: float) -> dict[str, Any]:
    global _armed, _fired
    import resource

    # the kernel's backstop for code the timer cannot interrupt: SIGXCPU (default action: exit)
    limit = math.ceil(time.process_time() + budget_s) + HARD_LIMIT_GRACE_S
    resource.setrlimit(resource.RLIMIT_CPU, (limit, resource.RLIM_INFINITY))
    _fired = False
    try:
        _armed = True
        signal.setitimer(signal.ITIMER_PROF, budget_s)
        value = fn(*args)
        _armed = False
        reply = {"status": "ok", "value": value}
    except OverBudget:
        reply = {"status": "over_budget"}
    except Exception as e:  # noqa: BLE001 - reported to the parent, which decides what it scores
        reply = {"status": "error", "value": f"{type(e).__name__}: {e}"}
    finally:
        _armed = False
        signal.setitimer(signal.ITIMER_PROF, 0)
    if _fired:  # the budget ran out, even if the job swallowed OverBudget with a bare except
        reply = {"status": "over_budget"}
    return reply


def _resolve(name: str) -> Any:
    import importlib

    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


def serve() -> None:
    """The worker's loop: one JSON batch a line on stdin, one JSON result a line on the result pipe."""
    import resource

    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # a stray print in a job goes to stderr and cannot corrupt the result pipe
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU would otherwise dump core
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's; the worker ends at its stdin's EOF
    signal.signal(signal.SIGPROF, _on_cpu_timer)
    functions: dict[str, Any] = {}
    for line in sys.stdin:
        batch = json.loads(line)
        name = batch["fn"]
        if name not in functions:
            try:
                functions[name] = _resolve(name)  # imports happen here, outside every job's budget
            except Exception as e:  # noqa: BLE001
                results.write(json.dumps({"fatal": f"{type(e).__name__}: {e}"}) + "\n")
                results.flush()
                continue
        for args in batch["jobs"]:
            results.write(json.dumps(_run_job(functions[name], args, float(batch["budget_s"]))) + "\n")
            results.flush()
