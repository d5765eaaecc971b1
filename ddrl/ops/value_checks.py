"""Checks of tensor values that never make the host wait for the device.

`if bool((ids >= V).any()): raise ...` reads a device value on the host: the CPU stops until the
accelerator has run everything queued before it, and the accelerator then idles while the CPU
queues the next kernels. Once per model call, in a decode step of a few hundred tokens, that wait
costs more than the step itself (issue 27). So the checks a model call makes on its inputs go
through `check_values(ok, message, detail)`:

  * by default the check is queued on the device with torch._assert_async: on the CPU a False
    value raises RuntimeError(message) at once; on CUDA it fails the stream with a device-side
    assertion at the next synchronising call (the message is not shown there, hence the hint);
  * with DDRL_SYNC_CHECKS=1 in the environment (debugging), the value is read on the host at once
    and a False one raises ValueError(message + detail()), naming the offending values.

The CPU runs the same path as the GPU, so a CPU test that counts host reads
(tests/unit/test_host_syncs.py) sees what a GPU run would wait for.
"""

from __future__ import annotations

import os
from typing import Callable

import torch
from torch import Tensor

SYNC_CHECKS_ENV = "DDRL_SYNC_CHECKS"


def sync_checks() -> bool:
    """Whether value checks read the host at once (DDRL_SYNC_CHECKS=1), with the offending values."""
    return os.environ.get(SYNC_CHECKS_ENV, "") not in ("", "0")


def check_values(ok: Tensor, message: str, detail: Callable[[], str] | None = None) -> None:
    """Fail when the 0-d bool tensor `ok` is False, without a host read unless DDRL_SYNC_CHECKS=1.

    detail() (host reads allowed) is appended to the message in the synchronous mode only."""
    if sync_checks():
        if not bool(ok):
            raise ValueError(message + (f" ({detail()})" if detail is not None else ""))
        return
    torch._assert_async(ok, f"{message} (run with {SYNC_CHECKS_ENV}=1 to see the values)")


def check_ids(ids: Tensor, size: int, name: str) -> None:
    """Every token id in [0, size), `name` saying what size is (a model's vocabulary or embedding rows)."""
    if ids.numel() == 0:
        return
    check_values(((ids >= 0) & (ids < size)).all(),
                 f"input_ids hold ids outside [0, {name}={size}); encode with this model's tokenizer",
                 lambda: f"min {int(ids.min())}, max {int(ids.max())}")
