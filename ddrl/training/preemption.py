"""Preemption and Ctrl-C: on SIGTERM or SIGINT, finish the current step, write a checkpoint and stop.

SIGTERM (a scheduler) stops the run cleanly: `train` returns and `ddrl train` exits 0. SIGINT (Ctrl-C at
the terminal) stops it the same way, then raises KeyboardInterrupt (`ddrl train` exits 130, as an
interrupted program does, so that `ddrl train ... && next` does not go on); a second Ctrl-C aborts at
once, losing the step under way (the last checkpoint stays).

SLURM and Kubernetes announce a kill with SIGTERM and send SIGKILL a grace period later (SLURM's
KillWait, or `--signal=TERM@SECONDS` ahead of the time limit; Kubernetes'
terminationGracePeriodSeconds). Python's default for SIGTERM is to die on the spot, losing every
step since the last checkpoint; under the guard the signal is only recorded, and the loop asks
after each step:

    with PreemptionGuard() as preemption:
        while step < steps:
            train_step(step)
            if preemption.requested(dist, device):  # every rank, every step: a collective
                save(); return                      # resume=true continues from here, losing nothing

`requested` all-reduces the flag, so every rank stops after the same step even when the signal
reached only some of them (or reached them during different steps); the check costs one scalar
all-reduce per step. A second SIGTERM is recorded like the first, not fatal: a scheduler may send
one to every process of the job and a launcher forward another, and neither may cut the save short.
A second SIGINT is a person who will not wait: it raises KeyboardInterrupt at once.

Under torchrun the agent receives the signal, forwards SIGTERM to the workers and kills them 30 s
later (SIGKILL; the 30 s is fixed in torch.distributed.elastic's close(timeout=30), no flag changes
it): a step plus the save must fit in that. At 8B a rollout step takes minutes, so:

  * let the scheduler signal the workers themselves, early: SLURM `#SBATCH --signal=TERM@120` (SIGTERM
    120 s before the time limit) with one `srun` task per rank and no torchrun, each task exporting
    RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID MASTER_ADDR MASTER_PORT
    (init_distributed reads torchrun's variables); the guard then has the whole 120 s;
  * and launch with `torchrun --max-restarts 3 ... resume=auto`: workers killed mid-step or mid-save
    (the kill above, a node fault) are restarted and resume from the newest complete checkpoint
    (a checkpoint directory counts only once fully written), losing at most train.save_every steps;
  * keep saves short: under FSDP checkpoints are sharded by default (each rank writes its shard);
    a full save of 8B (~96 GB with AdamW, train.sharded_checkpoints=false) alone outlasts 30 s.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType, TracebackType
from typing import Any

import torch

from ddrl.training.distributed import DistInfo


class PreemptionGuard:
    """A context manager that turns the given signals into a request to stop after the step.

    Inside, the signals are recorded instead of killing the process; on exit the handlers that
    were installed before are restored. Outside the main thread (where Python cannot install
    signal handlers) the guard installs nothing and is never requested by a signal.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
        self.signals = tuple(signals)
        self.received: int | None = None  # the first signal recorded, if any
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "PreemptionGuard":
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            again = " (Ctrl-C again aborts at once, losing this step)" if signum == signal.SIGINT else ""
            print(f"{signal.Signals(signum).name} received: finishing this step, then writing a checkpoint and "
                  f"exiting (resume=true continues from it){again}", file=sys.stderr, flush=True)
            self.received = signum
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt("second Ctrl-C: aborted without finishing the step")

    @property
    def name(self) -> str:
        """The signal received, e.g. "SIGTERM" ("" when none was)."""
        return "" if self.received is None else signal.Signals(self.received).name

    def reraise(self) -> None:
        """After the checkpoint: a Ctrl-C goes on as the KeyboardInterrupt it would have been."""
        if self.received == signal.SIGINT:
            raise KeyboardInterrupt("Ctrl-C: stopped after a checkpoint; resume=true continues from it")

    def requested(self, dist: DistInfo, device: torch.device) -> bool:
        """Whether any rank received a signal. A collective when several processes run: call it on
        every rank at the same point of every step."""
        local = self.received is not None
        if not dist.enabled:
            return local
        import torch.distributed as tdist

        flag = torch.tensor([float(local)], device=device)
        tdist.all_reduce(flag, op=tdist.ReduceOp.MAX)
        return bool(flag.item())
