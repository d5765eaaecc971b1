"""PreemptionGuard: SIGTERM inside the guard is a request to stop, not a kill; outside it, the
handler installed before is back. (A 2-process agreement test and the SIGTERM-then-resume run of
`ddrl train` are in tests/integration/test_preemption.py.)"""

from __future__ import annotations

import os
import signal
import threading

import torch

from ddrl.training.distributed import DistInfo
from ddrl.training.preemption import PreemptionGuard

CPU = torch.device("cpu")


def test_sigterm_inside_the_guard_is_recorded_and_the_previous_handler_comes_back():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with PreemptionGuard() as guard:
            assert not guard.requested(DistInfo(), CPU)
            os.kill(os.getpid(), signal.SIGTERM)  # without the guard: the handler above, or death
            os.kill(os.getpid(), signal.SIGTERM)  # a second one (scheduler + launcher) is not fatal either
            assert guard.requested(DistInfo(), CPU) and guard.received == signal.SIGTERM
        assert seen == []  # the guard's handler took them
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM]  # restored on exit
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_handler_is_restored_when_the_block_raises():
    before = signal.getsignal(signal.SIGTERM)
    try:
        with PreemptionGuard():
            assert signal.getsignal(signal.SIGTERM) is not before
            raise KeyError("boom")
    except KeyError:
        pass
    assert signal.getsignal(signal.SIGTERM) is before


def test_other_signals_can_be_guarded():
    with PreemptionGuard(signals=(signal.SIGUSR1,)) as guard:
        os.kill(os.getpid(), signal.SIGUSR1)  # SIGUSR1's default action would end the process
        assert guard.received == signal.SIGUSR1


def test_outside_the_main_thread_the_guard_installs_nothing():
    before = signal.getsignal(signal.SIGTERM)
    inside = []

    def run() -> None:
        with PreemptionGuard() as guard:
            inside.append((signal.getsignal(signal.SIGTERM), guard.requested(DistInfo(), CPU)))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert inside == [(before, False)]


def test_ctrl_c_is_recorded_like_sigterm_and_a_second_one_aborts_at_once():
    before = signal.getsignal(signal.SIGINT)
    with PreemptionGuard() as guard:  # SIGTERM and SIGINT by default
        os.kill(os.getpid(), signal.SIGINT)  # without the guard: KeyboardInterrupt here
        assert guard.requested(DistInfo(), CPU) and guard.name == "SIGINT"
        try:
            os.kill(os.getpid(), signal.SIGINT)
            raise AssertionError("a second Ctrl-C must abort at once")
        except KeyboardInterrupt:
            pass
    assert signal.getsignal(signal.SIGINT) is before
    try:
        guard.reraise()  # after the checkpoint: the interrupt it was
        raise AssertionError("reraise must raise KeyboardInterrupt after a Ctrl-C")
    except KeyboardInterrupt:
        pass
