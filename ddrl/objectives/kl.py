"""Schulman's estimators of KL(π_θ ‖ π_ref) from log-probabilities of samples of π_θ.

With Δ = log π_ref - log π_θ (per token or per sequence, any shape):
    k1 = -Δ = log π_θ - log π_ref          unbiased, can be negative     (DiPOD-FPO, on the ELBO)
    k2 = ½ Δ²                               biased, low variance          (ESPO, GDSD, on the ELBO)
    k3 = exp(Δ) - Δ - 1                     unbiased, >= 0                (d1, MaskGRPO, UDM-GRPO, TraceRL)
"""

from __future__ import annotations

import torch
from torch import Tensor


def _k1(delta: Tensor) -> Tensor:
    return -delta


def _k2(delta: Tensor) -> Tensor:
    return 0.5 * delta.square()


def _k3(delta: Tensor) -> Tensor:
    return torch.expm1(delta) - delta  # exp(Δ) - 1 - Δ, accurate for small Δ


KL_ESTIMATORS = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl(logp: Tensor, ref_logp: Tensor, kind: str = "k3") -> Tensor:
    """Elementwise KL estimate; gradients flow through both arguments (detach ref_logp yourself)."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; valid: {', '.join(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[kind](ref_logp - logp)
