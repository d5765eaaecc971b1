"""Masked (absorbing) diffusion: MDLM (Sahoo et al. 2024) / LLaDA (Nie et al. 2025).

Forward process (docs/diffusion.md#masked-diffusion): every eligible token is independently
replaced by the mask token M with probability 1 - alpha_t,

    q(x_t^i | x_0^i) = alpha_t * delta(x_t^i = x_0^i) + (1 - alpha_t) * delta(x_t^i = M).

Continuous-time NELBO (MDLM eq. 10), per sequence:

    -log p(x_0) <= E_{t ~ U(0,1)} E_{x_t ~ q} [ -alpha'_t / (1 - alpha_t) * sum_{i: x_t^i = M} -log p_theta(x_0^i | x_t) ]

which is LLaDA's 1/t-weighted cross-entropy for the linear schedule alpha_t = 1 - t. The
denoiser's SUBS parameterisation (mask logit -inf, carry-over of clean tokens) is the model's
business; here only masked positions are scored, so carry-over does not change the value.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ddrl.processes.base import ScheduledProcess, check_eligible, check_logits, check_tokens
from ddrl.processes.draws import uniform_draw
from ddrl.processes.schedules import Schedule
from ddrl.registry import PROCESSES


@PROCESSES.register("masked")
class MaskedProcess(ScheduledProcess):
    name = "masked"

    def __init__(self, mask_token_id: int, schedule: str | Schedule = "linear"):
        if isinstance(mask_token_id, bool) or not isinstance(mask_token_id, int) or mask_token_id < 0:
            raise ValueError(f"mask_token_id must be a non-negative int (the [MASK] id of the vocabulary), got {mask_token_id!r}")
        super().__init__(schedule)
        self.mask_token_id = mask_token_id

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mask_token_id={self.mask_token_id}, schedule={self.schedule.name!r})"

    def noise(self, x0: Tensor, t: Tensor, *, generator: torch.Generator,
              eligible: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Mask each eligible token of x0 [B, L] with probability 1 - alpha(t).

        t: [B] (one time per row) or [B, L] (per token). Returns xt [B, L] and noised [B, L] bool
        (the positions now holding the mask token).
        """
        check_tokens(x0)
        eligible = check_eligible(eligible, x0)
        t_tok = self.token_times(t.to(x0.device), x0.shape)  # [B, L]
        u = uniform_draw(x0.shape, generator=generator, device=x0.device, dtype=t_tok.dtype)
        noised = eligible & (u < 1.0 - self.alpha(t_tok))
        xt = torch.where(noised, torch.full_like(x0, self.mask_token_id), x0)
        return xt, noised

    def elbo_weight(self, t: Tensor) -> Tensor:
        """-alpha'(t) / (1 - alpha(t)) > 0: 1/t for the linear schedule."""
        return -self.schedule.alpha_prime(t) / (1.0 - self.alpha(t))

    def _check_vocab(self, logits: Tensor, x0: Tensor) -> None:
        V = logits.shape[-1]
        if self.mask_token_id >= V:
            raise ValueError(
                f"mask_token_id={self.mask_token_id} is outside the model's vocabulary of {V} logits; "
                f"pass the model's own mask id (model.mask_token_id) or a model whose vocabulary includes it"
            )
        if x0.numel() and (int(x0.min()) < 0 or int(x0.max()) >= V):
            raise ValueError(f"x0 holds token ids outside [0, {V}) (the logits' vocabulary); check the tokenizer/model pair")

    def token_nll(self, logits: Tensor, x0: Tensor) -> Tensor:
        """-log p_theta(x0^i | x_t) at every position, [B, L] (float32 or wider)."""
        self._check_vocab(logits, x0)
        # logsumexp - gather rather than log_softmax: no second [B, L, V] tensor (V ~ 126k for LLaDA).
        wide = torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype
        picked = logits.gather(-1, x0.unsqueeze(-1)).squeeze(-1).to(wide)
        return torch.logsumexp(logits.to(wide), dim=-1) - picked

    def nelbo(self, logits: Tensor, x0: Tensor, noised: Tensor, t: Tensor, xt: Tensor | None = None) -> Tensor:
        """One-sample Monte-Carlo NELBO per sequence, [B]: sum over noised positions of w(t) * CE.

        logits: [B, L, V] for x_t; x0: [B, L]; noised: [B, L] bool from `noise`; t: [B] or [B, L].
        xt is accepted for the common process signature and not needed (noised says where M is).
        """
        return self.weighted_token_nll(logits, x0, noised, t).sum(dim=1)

    def weighted_token_nll(self, logits: Tensor, x0: Tensor, noised: Tensor, t: Tensor) -> Tensor:
        """The NELBO's per-token terms [B, L]: w(t) * -log p_theta(x0^i | x_t) where noised, else 0."""
        check_logits(logits, x0, noised)
        nll = self.token_nll(logits, x0)  # [B, L]
        w = self.elbo_weight(self.token_times(t.to(nll.device), x0.shape)).to(nll.dtype)
        # where(), not a product: an un-noised position may have w = inf (t = 0) or nll = inf; the
        # weight is zeroed too so that no inf * 0 = NaN reaches the gradient.
        w = torch.where(noised, w, 0.0)
        return torch.where(noised, w * nll, torch.zeros_like(nll))

    def pretrain_loss(self, model: Any, x0: Tensor, eligible: Tensor, attention_mask: Tensor | None = None, *,
                      generator: torch.Generator, eps: float = 1e-3,
                      num_tokens: float | Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """MDLM/LLaDA pretraining loss: the NELBO per eligible token, and detached stats.

        x0: [B, T] prompt + completion; eligible: [B, T] bool, the positions to noise and score
        (the completion); attention_mask: [B, T] bool padding mask or None. num_tokens: the global
        number of eligible tokens when the batch is split over processes (default: this batch's).
        """
        check_tokens(x0)
        eligible = check_eligible(eligible, x0)
        t = self.sample_t(x0.shape[0], generator=generator, device=x0.device, eps=eps)  # [B]
        xt, noised = self.noise(x0, t, generator=generator, eligible=eligible)
        logits = model(xt, attention_mask=attention_mask).logits  # [B, T, V]
        nelbo = self.nelbo(logits, x0, noised, t, xt=xt)  # [B]
        return _per_token_loss(nelbo, eligible, noised, num_tokens)


def _per_token_loss(nelbo: Tensor, eligible: Tensor, noised: Tensor,
                    num_tokens: float | Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
    n_eligible = eligible.sum().clamp(min=1)
    denom = n_eligible if num_tokens is None else num_tokens
    loss = nelbo.sum() / denom
    stats = {
        "nelbo_per_token": (nelbo.detach().sum() / n_eligible).float(),
        "noised_frac": (noised.sum() / n_eligible).float(),
    }
    return loss, stats
