"""Uniform discrete diffusion: UDLM (Schiff et al. 2024) / Duo (Sahoo et al. 2025).

The process acts on N classes, the token ids offset .. offset+N-1 of the model's vocabulary
(image or gray-level tokens placed after a text vocabulary, as URSA does). With x_0 one-hot over
those N classes (docs/diffusion.md#uniform-diffusion):

    q(x_t | x_0) = Cat( alpha_t x_0 + (1 - alpha_t) / N )        # t = 1: uniform prior

i.e. with probability 1 - alpha_t a token is redrawn uniformly (possibly to its own value).

Continuous-time NELBO per token. The forward process is the CTMC with rate beta_t / N to every
other class, beta_t = -alpha'_t / alpha_t. Its time reversal given x_0 jumps x_t = i -> y at rate
R(y) = (beta_t / N) * xbar_y / xbar_i with xbar = N alpha_t x_0 + (1 - alpha_t) (= N q(.|x_0)); the
model's reverse rate R_theta uses xbar_theta = N alpha_t x_theta(x_t) + (1 - alpha_t). The NELBO is
the path KL between the two reverse CTMCs (the prior term vanishes since q(x_1) is uniform):

    L = E_t E_{x_t} sum_i (-alpha'_t / (N alpha_t)) * sum_{y != i} [ r_theta_y - r_y + r_y log(r_y / r_theta_y) ]
        with r_y = xbar_y / xbar_i, r_theta_y = xbar_theta_y / xbar_theta_i.

Using sum_y xbar_y = N this is exactly UDLM's / Duo's expression (α'/(Nα))(N/x̄_i - N/x̄_θ,i - Σ ...).
We keep the sum-of-divergences form because every summand a - b + b log(b/a) is >= 0 and is exactly 0
when x_theta = x_0, so the NELBO is non-negative and 0 for a perfect one-hot model, and no large
terms cancel at small t (where N/x̄_i ~ N/t).

`ce_loss` is URSA's pretraining loss instead: plain cross-entropy of x_0 on every noised
position, no time weight (Yovecent/UDM-GRPO diffnext/pipelines/ursa/pipeline_train.py).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from ddrl.processes.base import (ForwardProcess, ScheduledProcess, check_eligible, check_logits, check_tokens,
                                 log_probs)
from ddrl.processes.draws import randint_draw, uniform_draw
from ddrl.processes.masked import _per_token_loss
from ddrl.processes.schedules import Schedule
from ddrl.registry import PROCESSES

_LOSSES = ("elbo", "ce")


@runtime_checkable
class ClassNoise(Protocol):
    """What an estimator that renoises over N classes needs of a process (ddrl.estimators.udm): the classes
    offset .. offset + num_classes - 1 and their forward noise. Every ClassProcess has it."""

    num_classes: int
    offset: int

    def noise(self, x0: Tensor, t: Tensor, *, generator: torch.Generator,
              eligible: Tensor | None = None) -> tuple[Tensor, Tensor]: ...


class ClassProcess(ForwardProcess):
    """A process over N classes, the token ids offset .. offset + N - 1: what the uniform process and
    URSA's metric path (ddrl.processes.metric_path) share: the classes, the model's distribution over
    them, URSA's cross-entropy loss and the pretraining step around a per-sequence loss."""

    def __init__(self, num_classes: int, offset: int = 0):
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"num_classes must be an int >= 2 (the number of token ids the process mixes over), got {num_classes!r}")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"offset must be a non-negative int (the vocabulary id of class 0), got {offset!r}")
        self.num_classes = num_classes
        self.offset = offset

    def class_log_probs(self, logits: Tensor, scored: Tensor | None = None) -> Tensor:
        """log x_theta [..., N]: the model's distribution renormalised over the N classes.

        scored: optional [...] bool; elsewhere the logits are replaced by zeros first, so a position
        that is not scored (a prompt token whose class logits may all be -inf) cannot put NaN into
        the values or the gradient.
        """
        hi = self.offset + self.num_classes
        if logits.shape[-1] < hi:
            raise ValueError(
                f"the logits have {logits.shape[-1]} entries but the process needs ids offset..offset+num_classes-1 "
                f"= {self.offset}..{hi - 1}; set num_classes/offset to fit the model's vocabulary"
            )
        class_logits = logits[..., self.offset:hi]
        if scored is not None:
            class_logits = class_logits.masked_fill(~scored.unsqueeze(-1), 0.0)
        return log_probs(class_logits)

    def ce_loss(self, logits: Tensor, x0: Tensor, noised: Tensor) -> Tensor:
        """URSA's loss per sequence [B]: sum over noised positions of -log x_theta(x_0), no time weight."""
        check_logits(logits, x0, noised)
        self._check_classes(x0, noised, "x0")
        c = (x0 - self.offset).clamp(0, self.num_classes - 1)
        nll = -self.class_log_probs(logits, noised).gather(-1, c.unsqueeze(-1)).squeeze(-1)  # [B, L]
        return torch.where(noised, nll, torch.zeros_like(nll)).sum(dim=1)

    def sequence_loss(self, loss: str, logits: Tensor, x0: Tensor, noised: Tensor, t: Tensor, xt: Tensor) -> Tensor:
        """One draw's loss per sequence [B]: URSA's cross-entropy (loss="ce"; UniformProcess adds "elbo")."""
        return self.ce_loss(logits, x0, noised)

    def _pretrain_loss(self, model: Any, x0: Tensor, eligible: Tensor, attention_mask: Tensor | None, *,
                       generator: torch.Generator, loss: str, eps: float,
                       num_tokens: float | Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
        """One pretraining draw: t, x_t, the model's logits and sequence_loss, per eligible token."""
        check_tokens(x0)
        eligible = check_eligible(eligible, x0)
        t = self.sample_t(x0.shape[0], generator=generator, device=x0.device, eps=eps)  # [B]
        xt, noised = self.noise(x0, t, generator=generator, eligible=eligible)
        logits = model(xt, attention_mask=attention_mask).logits  # [B, T, V]
        out, stats = _per_token_loss(self.sequence_loss(loss, logits, x0, noised, t, xt), eligible, noised, num_tokens)
        # Every eligible token is noised under this process; the informative number is how many changed.
        stats["noised_frac"] = (((xt != x0) & eligible).sum() / eligible.sum().clamp(min=1)).float()
        if loss == "ce":
            stats["ce_per_token"] = stats.pop("nelbo_per_token")
        return out, stats

    def _check_classes(self, ids: Tensor, where: Tensor, name: str) -> None:
        lo, hi = self.offset, self.offset + self.num_classes
        bad = where & ((ids < lo) | (ids >= hi))
        if bool(bad.any()):
            raise ValueError(
                f"{name} holds ids outside the process classes [{lo}, {hi}) at positions it must noise/score; "
                f"mark only class tokens as eligible, or fix num_classes/offset"
            )


@PROCESSES.register("uniform")
class UniformProcess(ClassProcess, ScheduledProcess):
    name = "uniform"

    def __init__(self, num_classes: int, offset: int = 0, schedule: str | Schedule = "linear"):
        ClassProcess.__init__(self, num_classes, offset)
        ScheduledProcess.__init__(self, schedule)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(num_classes={self.num_classes}, offset={self.offset}, "
                f"schedule={self.schedule.name!r})")

    # ---------------------------------------------------------------- forward process
    def noise(self, x0: Tensor, t: Tensor, *, generator: torch.Generator,
              eligible: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Draw x_t ~ q(x_t | x_0) at every eligible position of x0 [B, L] (full-vocabulary ids).

        t: [B] or [B, L]. Returns xt [B, L] and noised [B, L] bool = eligible: under the uniform
        process every eligible position is a draw from q (it may have kept its value), and the
        NELBO scores all of them. Non-eligible positions (the prompt) are copied unchanged.
        """
        check_tokens(x0)
        eligible = check_eligible(eligible, x0)
        self._check_classes(x0, eligible, "x0")
        t_tok = self.token_times(t.to(x0.device), x0.shape)  # [B, L]
        u = uniform_draw(x0.shape, generator=generator, device=x0.device, dtype=t_tok.dtype)
        redraw = eligible & (u < 1.0 - self.alpha(t_tok))
        fresh = self.offset + randint_draw(self.num_classes, x0.shape, generator=generator, device=x0.device)
        return torch.where(redraw, fresh, x0), eligible

    def posterior(self, x0_probs: Tensor, xt_class: Tensor, t: Tensor | float, s: Tensor | float) -> Tensor:
        """q(x_s | x_t, x_0) for s <= t, probs [..., N]: Duo's ancestral step.

        The formula is in docs/diffusion.md#uniform-diffusion.

        x0_probs: [..., N], one-hot x_0 or the model's distribution x_theta (then the result is the
        Bayes posterior with x_theta as the prior over x_0: sum_c pi_c q(x_s | x_t, c), pi_c ∝
        x_theta_c q(x_t | c), because numerator and denominator are both linear in x_0).
        xt_class: [...] long class indices in [0, N) (vocabulary id - offset).
        t, s: floats or tensors broadcastable to xt_class's shape (e.g. [B, 1] for one time per row).
        """
        N = self.num_classes
        if x0_probs.shape[-1] != N:
            raise ValueError(f"x0_probs must have a last axis of num_classes={N}, got {list(x0_probs.shape)}")
        if tuple(x0_probs.shape[:-1]) != tuple(xt_class.shape):
            raise ValueError(f"xt_class must have shape {list(x0_probs.shape[:-1])} (x0_probs without its class axis), "
                             f"got {list(xt_class.shape)}")
        x0 = x0_probs if x0_probs.is_floating_point() else x0_probs.float()
        t = torch.as_tensor(t, dtype=x0.dtype, device=x0.device)
        s = torch.as_tensor(s, dtype=x0.dtype, device=x0.device)
        if bool((s > t).any()) or bool((s < 0).any()) or bool((t > 1).any()):
            raise ValueError("posterior needs 0 <= s <= t <= 1 (s is the earlier, less noisy time)")
        a_t = self.alpha(t).unsqueeze(-1)  # [..., 1]
        a_s = self.alpha(s).unsqueeze(-1)
        a_ts = a_t / a_s  # alpha_{t|s}
        xt = torch.nn.functional.one_hot(xt_class.long(), N).to(x0.dtype)  # [..., N]
        num = (N * a_t * x0 * xt + (a_ts - a_t) * xt + (a_s - a_t) * x0
               + (1.0 - a_ts) * (1.0 - a_s) / N)
        den = N * a_t * (x0 * xt).sum(-1, keepdim=True) + 1.0 - a_t
        return (num / den).clamp_min(0.0)  # clamp: rounding of alpha_{t|s} - alpha_t >= 0

    # ---------------------------------------------------------------- losses
    def elbo_weight(self, t: Tensor) -> Tensor:
        """-alpha'(t) / (N alpha(t)) >= 0, the time weight in front of the per-token divergence."""
        return -self.schedule.alpha_prime(t) / (self.num_classes * self.alpha(t))

    def nelbo(self, logits: Tensor, x0: Tensor, noised: Tensor, t: Tensor, xt: Tensor | None = None) -> Tensor:
        """Closed-form continuous-time UDLM NELBO per sequence [B] (one t draw), summed over noised positions.

        logits: [B, L, V] full vocabulary for x_t; x0, xt: [B, L] full-vocabulary ids; noised: [B, L]
        bool; t: [B] or [B, L]. The value is >= 0 and exactly 0 when the model's x_theta is one-hot
        on x0 at every noised position.
        """
        if xt is None:
            raise ValueError("UniformProcess.nelbo needs xt (the noisy tokens the logits were computed from): pass xt=xt")
        check_logits(logits, x0, noised)
        self._check_classes(x0, noised, "x0")
        self._check_classes(xt, noised, "xt")
        N = self.num_classes
        log_x_theta = self.class_log_probs(logits, noised)  # [B, L, N]
        dtype = log_x_theta.dtype
        t_tok = self.token_times(t.to(logits.device), x0.shape).to(dtype)  # [B, L]
        a = self.alpha(t_tok).unsqueeze(-1)  # [B, L, 1]
        c = (x0 - self.offset).clamp(0, N - 1)  # class of x_0 (clamped off the noised positions)
        i = (xt - self.offset).clamp(0, N - 1).unsqueeze(-1)  # class of x_t, [B, L, 1]

        # log xbar = log(N alpha x + (1 - alpha)) for x = x_0 (one-hot) and x = x_theta, by the same
        # expression, so a one-hot x_theta = x_0 gives bitwise-equal values and a NELBO of exactly 0.
        log_x0 = torch.log(torch.nn.functional.one_hot(c, N).to(dtype))  # [B, L, N], 0 or -inf
        log_xbar = self._log_xbar(log_x0, a)
        log_xbar_theta = self._log_xbar(log_x_theta, a)
        log_r = log_xbar - log_xbar.gather(-1, i)  # log r_y
        log_r_theta = log_xbar_theta - log_xbar_theta.gather(-1, i)
        r, r_theta = log_r.exp(), log_r_theta.exp()
        # r_y log(r_y / r_theta_y), with 0 log 0 = 0 (r_y = 0 only at alpha = 1); the y = i term is 0.
        kl_term = torch.where(r > 0, r * (torch.where(r > 0, log_r, 0.0) - log_r_theta), 0.0)
        divergence = (r_theta - r + kl_term).sum(-1).clamp_min(0.0)  # [B, L]; >= 0 up to rounding
        # alpha = 0 (t = 1, linear): w = inf but divergence = 0; the limit of the product is 0. The
        # weight itself is zeroed (not only the product) so that no inf * 0 = NaN reaches the gradient.
        keep = noised & (a.squeeze(-1) > 0)
        w = torch.where(keep, self.elbo_weight(t_tok), 0.0)
        return (w * divergence).sum(dim=1)

    def _log_xbar(self, log_x: Tensor, a: Tensor) -> Tensor:
        """log(N a x + (1 - a)) from log x [..., N] and alpha a [..., 1]; exact for tiny x and at a in {0, 1}."""
        return torch.logaddexp(torch.log(self.num_classes * a) + log_x, torch.log1p(-a))

    def pretrain_loss(self, model: Any, x0: Tensor, eligible: Tensor, attention_mask: Tensor | None = None, *,
                      generator: torch.Generator, loss: str = "elbo", eps: float = 1e-3,
                      num_tokens: float | Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """Pretraining loss per eligible token: the UDLM NELBO (loss="elbo") or URSA's CE (loss="ce").

        x0: [B, T]; eligible: [B, T] bool (the completion; its ids must be classes of the process);
        attention_mask: [B, T] bool or None; num_tokens: global eligible-token count (default: this batch's).
        """
        if loss not in _LOSSES:
            raise ValueError(f"loss={loss!r} is not a uniform-diffusion loss; choose one of: {', '.join(_LOSSES)}")
        return self._pretrain_loss(model, x0, eligible, attention_mask, generator=generator, loss=loss, eps=eps,
                                   num_tokens=num_tokens)

    def sequence_loss(self, loss: str, logits: Tensor, x0: Tensor, noised: Tensor, t: Tensor, xt: Tensor) -> Tensor:
        """One draw's loss per sequence [B]: the UDLM NELBO (loss="elbo") or URSA's cross-entropy ("ce")."""
        return self.nelbo(logits, x0, noised, t, xt=xt) if loss == "elbo" else self.ce_loss(logits, x0, noised)
