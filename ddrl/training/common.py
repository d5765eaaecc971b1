"""Small pieces the training loops share: devices, derived seeds, optimizers, LR schedules, phase
clocks, dropout switches."""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from ddrl.config import BF16_TRAINING


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_RANK", 0))
            return torch.device("cuda", local)
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda was requested but no CUDA device is visible; use device=cpu or device=auto")
    return torch.device(name)


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed from any parts, e.g. derive_seed(cfg.seed, "rollout", step, rank).

    Library randomness is always derived this way (never from global RNG state), so a resumed run
    replays exactly the draws of an uninterrupted one.
    """
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def build_optimizer(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float,
                    betas: tuple[float, float] = (0.9, 0.99)) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters (check the LoRA target_modules)")
    if any(p.dtype in (torch.bfloat16, torch.float16) for p in params):
        raise ValueError(BF16_TRAINING)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas)


def build_scheduler(opt: torch.optim.Optimizer, *, schedule: str, warmup_steps: int, total_steps: int,
                    min_lr_ratio: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup, then constant, cosine or linear decay to min_lr_ratio * lr."""

    def factor(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if schedule == "cosine":
            return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return min_lr_ratio + (1 - min_lr_ratio) * (1 - progress)

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def check_writable(directory: str | Path, need_mb: int = 50) -> Path:
    """Fail at start, not after an hour: the run directory must be creatable, writable, with space."""
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe-{os.getpid()}"  # per process: torchrun ranks probe at once
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"run directory {str(path)!r} is not writable ({e.strerror}); choose another output_dir") from None
    free_mb = shutil.disk_usage(path).free / 2**20
    if free_mb < need_mb:
        raise ValueError(f"only {free_mb:.0f} MB free under {str(path)!r} (need >= {need_mb} MB); free space or choose another output_dir")
    return path


class Clock:
    """`with clock("rollout"):` adds the block's wall time to timings["rollout"]."""

    def __init__(self, timings: dict[str, float]):
        self.timings = timings

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - start


# Attention layers apply dropout functionally (scaled_dot_product_attention's dropout_p) from a float
# attribute; these are the names the native families and the built-in Denoiser use.
_FUNCTIONAL_DROPOUT = ("attention_dropout", "dropout", "attn_dropout")


def disable_dropout(model: torch.nn.Module) -> None:
    """p = 0 in every dropout layer (LoRA's included) and every functional attention dropout, so the
    RL passes compute a deterministic function. Eval mode would do it too, but it would also switch
    off per-layer activation checkpointing, which keys on `training`."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name in _FUNCTIONAL_DROPOUT:
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)


def finite_sum_count(values: list[Any]) -> tuple[float, float]:
    """(sum, count) of the finite values (None and NaN left out): a mean that can be summed over ranks."""
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return sum(xs), float(len(xs))
