"""Noise schedules alpha(t): the probability that a token is still clean at time t in [0, 1].

t = 0 is clean data and t = 1 is pure noise (the MDLM / UDLM convention; URSA counts time the
other way, see docs/diffusion.md#ursa-metric-path). Every process reads alpha(t) and its
derivative alpha'(t) from one of these, so masked, uniform and block diffusion share them.

    linear   alpha(t) = 1 - t            (LLaDA / MDLM: t is the mask ratio)
    cosine   alpha(t) = cos(pi t / 2)    (MDLM's CosineNoise without its eps floor)
    loglinear alpha(t) = 1 - (1 - 1e-3) t (MDLM's LogLinearNoise; DRAKES / SEPO's DNA model)

The cosine choice: MDLM defines alpha(t) = cos(pi t / 2), which keeps few tokens noisy at small t
(mask ratio ~ (pi t)^2 / 8). MaskGIT's "cosine" is the other one, mask ratio = cos(pi r / 2) in
the reverse progress r = 1 - t, i.e. alpha(t) = 1 - sin(pi t / 2); it is not provided here.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


class Schedule:
    """alpha(t) and alpha'(t), elementwise on a tensor of times in [0, 1]."""

    name: str = ""

    def alpha(self, t: Tensor) -> Tensor:
        raise NotImplementedError

    def alpha_prime(self, t: Tensor) -> Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class LinearSchedule(Schedule):
    name = "linear"

    def alpha(self, t: Tensor) -> Tensor:
        return 1.0 - t

    def alpha_prime(self, t: Tensor) -> Tensor:
        return torch.full_like(t, -1.0)


class CosineSchedule(Schedule):
    name = "cosine"

    def alpha(self, t: Tensor) -> Tensor:
        return torch.cos(0.5 * math.pi * t)

    def alpha_prime(self, t: Tensor) -> Tensor:
        return -0.5 * math.pi * torch.sin(0.5 * math.pi * t)


class LogLinearSchedule(Schedule):
    """MDLM's LogLinearNoise: total noise sigma(t) = -log(1 - (1 - eps) t), so the move chance
    1 - exp(-sigma) is (1 - eps) t and alpha(t) = 1 - (1 - eps) t (eps = 1e-3: never fully masked)."""

    name = "loglinear"
    eps = 1e-3

    def alpha(self, t: Tensor) -> Tensor:
        return 1.0 - (1.0 - self.eps) * t

    def alpha_prime(self, t: Tensor) -> Tensor:
        return torch.full_like(t, -(1.0 - self.eps))


_SCHEDULES: dict[str, type[Schedule]] = {"linear": LinearSchedule, "cosine": CosineSchedule,
                                         "loglinear": LogLinearSchedule}


def get_schedule(name: str | Schedule) -> Schedule:
    """The schedule called `name` (linear | cosine); a Schedule instance is returned as is."""
    if isinstance(name, Schedule):
        return name
    if name not in _SCHEDULES:
        raise ValueError(f"schedule={name!r} is not a known noise schedule; choose one of: {', '.join(_SCHEDULES)}")
    return _SCHEDULES[name]()
