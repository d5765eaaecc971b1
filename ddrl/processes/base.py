"""What every forward (noising) process shares: time sampling, input checks, and the interface.

Masked, uniform and block diffusion are implementations of one small interface (the shape of
SEDD's `Graph` with its `Absorbing` and `Uniform` subclasses, which state their abstract methods):

    t = process.sample_t(B, generator=g, device=d)                  # [B]          every process
    xt, noised = process.noise(x0, t, generator=g, eligible=e)     # [B, L] x2    every process
    loss, stats = process.pretrain_loss(model, x0, eligible, attention_mask, generator=g)
    nelbo = process.nelbo(logits, x0, noised, t, xt=xt)            # [B]          ScheduledProcess
    a = process.alpha(t)                                            #              ScheduledProcess

`ForwardProcess` is what every process implements; `ScheduledProcess` adds a noise schedule
alpha(t) and a closed-form NELBO (masked, block, uniform). URSA's metric path
(ddrl.processes.metric_path) is a ForwardProcess without them: a caller that needs a NELBO or a
schedule takes a ScheduledProcess.

Times: t = 0 is clean, t = 1 is noise. `sample_t` draws t ~ U[eps, 1]: the NELBO weight blows up
as t -> 0 (1/t for the linear masked schedule), so like MDLM we truncate at eps; the estimate is then
of the NELBO with t restricted to [eps, 1] (normalised by 1/(1-eps)), which differs from the full one
by O(eps).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import Tensor

from ddrl.processes.draws import uniform_draw
from ddrl.processes.schedules import Schedule, get_schedule


class ForwardProcess(ABC):
    """A forward (noising) process over token ids: times, noise, and its pretraining loss."""

    name: str = ""  # the name it is registered under (ddrl.registry.PROCESSES)

    @abstractmethod
    def noise(self, x0: Tensor, t: Tensor, *, generator: torch.Generator,
              eligible: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x0 [B, L] ids, t [B] or [B, L] -> (xt [B, L], noised [B, L] bool: the positions the loss scores).
        Positions outside eligible (the prompt) are copied unchanged."""

    @abstractmethod
    def pretrain_loss(self, model: Any, x0: Tensor, eligible: Tensor, attention_mask: Tensor | None = None, *,
                      generator: torch.Generator, eps: float = 1e-3,
                      num_tokens: float | Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """The denoiser's pretraining loss per eligible token (a scalar to backpropagate) and its stats: one
        draw of t >= eps; num_tokens: the global eligible-token count (default: this batch's)."""

    def sample_t(self, batch_size: int, *, generator: torch.Generator, device: torch.device | str | None = None,
                 eps: float = 1e-3, stratified: bool = False) -> Tensor:
        """t ~ U[eps, 1], shape [batch_size].

        stratified=True is MDLM's low-discrepancy sampler: row i gets (u + i/B) mod 1, so one batch
        covers [0, 1) evenly (same marginal, lower variance of the batch mean).
        """
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if not 0.0 <= eps < 1.0:
            raise ValueError(f"eps must be in [0, 1), got {eps}; it is the smallest time drawn (1e-3 is usual)")
        if stratified:
            u = uniform_draw((1,), generator=generator, device=device)
            u = (u + torch.arange(batch_size, device=u.device, dtype=u.dtype) / batch_size) % 1.0
        else:
            u = uniform_draw((batch_size,), generator=generator, device=device)
        return eps + (1.0 - eps) * u

    def token_times(self, t: Tensor, shape: torch.Size | tuple[int, int]) -> Tensor:
        """Per-token times [B, L] from t [B] (one time per sequence) or [B, L] (already per token)."""
        B, L = shape
        if t.dim() == 1 and t.shape[0] == B:
            return t[:, None].expand(B, L)
        if t.dim() == 2 and tuple(t.shape) == (B, L):
            return t
        raise ValueError(f"t must have shape [B]=[{B}] or [B, L]=[{B}, {L}], got {list(t.shape)}")


class ScheduledProcess(ForwardProcess):
    """A process with a noise schedule alpha(t) (the probability a token is still clean at time t) and a
    closed-form continuous-time NELBO: masked, block and uniform diffusion."""

    def __init__(self, schedule: str | Schedule = "linear"):
        self.schedule = get_schedule(schedule)

    def alpha(self, t: Tensor) -> Tensor:
        return self.schedule.alpha(t)

    @abstractmethod
    def nelbo(self, logits: Tensor, x0: Tensor, noised: Tensor, t: Tensor, xt: Tensor | None = None) -> Tensor:
        """The NELBO per sequence [B] of x0 [B, L] from the denoiser's logits [B, L, V] on x_t, summed over
        the noised positions [B, L] (one draw of t [B] or [B, L]); xt: the noisy ids, where the process needs them."""


def check_tokens(x0: Tensor, name: str = "x0") -> None:
    if x0.dim() != 2 or x0.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must be a [B, L] integer tensor of token ids, got {x0.dtype} {list(x0.shape)}")


def check_eligible(eligible: Tensor | None, x0: Tensor) -> Tensor:
    """The [B, L] bool mask of positions the process may noise (all positions when None)."""
    if eligible is None:
        return torch.ones_like(x0, dtype=torch.bool)
    if tuple(eligible.shape) != tuple(x0.shape):
        raise ValueError(f"eligible must have the shape of x0 {list(x0.shape)}, got {list(eligible.shape)}")
    return eligible.to(device=x0.device, dtype=torch.bool)


def check_logits(logits: Tensor, x0: Tensor, noised: Tensor) -> None:
    if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(x0.shape):
        raise ValueError(f"logits must be [B, L, V] with [B, L] = x0's shape {list(x0.shape)}, got {list(logits.shape)}")
    if tuple(noised.shape) != tuple(x0.shape):
        raise ValueError(f"noised must have the shape of x0 {list(x0.shape)}, got {list(noised.shape)}")


def log_probs(logits: Tensor) -> Tensor:
    """log_softmax over the last axis, in float32 when the logits are half precision (bf16 CE is too coarse)."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return torch.log_softmax(logits, dim=-1)
