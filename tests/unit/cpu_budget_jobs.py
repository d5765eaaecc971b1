"""Jobs for tests/unit/test_cpu_budget.py, imported by the CPU-budget worker process (not tests)."""

from __future__ import annotations

import time


def sleep(wall_s: float) -> str:
    time.sleep(wall_s)  # wall time passes, no CPU time is used
    return "slept"


def spin(cpu_s: float) -> float:
    """Use `cpu_s` seconds of CPU time in the interpreter (where a signal can interrupt it)."""
    start = time.process_time()
    while time.process_time() - start < cpu_s:
        pass
    return cpu_s


def swallow(cpu_s: float) -> str:
    """Spin, catching everything, as careless library code does: the budget must still hold."""
    start = time.process_time()
    while time.process_time() - start < cpu_s:
        try:
            sum(range(1000))
        except BaseException:  # noqa: BLE001
            pass
    return "finished"


def c_loop() -> str:
    """Minutes of CPU inside one C call (OpenSSL's PBKDF2), which never returns to the interpreter,
    so no signal handler can run until it ends."""
    import hashlib

    return hashlib.pbkdf2_hmac("sha256", b"password", b"salt", 2_000_000_000).hex()[:8]
