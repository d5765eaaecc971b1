"""An auxiliary load-balancing loss for the routers of a mixture-of-experts backbone (LLaDA2), off by
default (method.moe_aux_loss_coef = 0), as RL recipes run MoE models.

The released LLaDA2 modeling file computes none: its forward returns aux_loss = None
(modeling_llada2_moe.py of LLaDA2.0/2.1-mini, yjyddq/DARE @ 83ae8a3), and its router balances without
a loss, through `expert_bias` (auxiliary-loss-free balancing, DeepSeek-V3, arXiv 2412.19437 §2.1.2),
a buffer that chooses experts and is never trained. The form here is the one DeepSeek-V3 pairs
with that router, its complementary sequence-wise balance loss (eq. 17-20; Megatron-Core's
"seq_aux_loss"), for one sequence of T real tokens, E routed experts, K per token:

    s'_{t,i} = s_{t,i} / sum_j s_{t,j}              the token's sigmoid scores, normalised
    f_i      = E / (K T) sum_t 1[i in top-K(t)]     the share of routed slots expert i took (no gradient)
    P_i      = 1/T sum_t s'_{t,i}
    L        = sum_i f_i P_i                        1 when every expert gets an equal share

averaged over sequences (rows of a forward) and the MoE layers, so the coefficient does not scale
with depth (transformers' load_balancing_loss_func averages layers the same way). Padding tokens
(False in the 2-D attention mask) are left out; with no mask or a 3-D/4-D one every token counts.
The gradient reaches the router weight through P (the scores); under LoRA the router is frozen and it
reaches only the adapters below it.

Use: `with balance:` around the forward(s) of a micro-batch's loss, then `balance.loss()`; outside it
(rollout, old and reference passes, the backward's recomputation under activation checkpointing)
nothing is recorded.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The routers of a model: modules that declare `moe_router = True` and return (expert ids [N, K],
    weights [N, K], router logits [N, E]) from hidden states [N, D]."""
    return [m for m in model.modules() if getattr(m, "moe_router", False)]


def sequence_balance_loss(logits: Tensor, idx: Tensor, valid: Tensor) -> Tensor:
    """logits [B, T, E] (router logits), idx [B, T, K] (chosen experts), valid [B, T] bool -> the
    mean over rows with a real token of sum_i f_i P_i (module doc), float32 scalar."""
    B, T, E = logits.shape
    K = idx.shape[-1]
    w = valid.float()  # [B, T]
    n = w.sum(dim=1).clamp(min=1.0)  # [B] real tokens per row
    scores = torch.sigmoid(logits.float())
    normalised = scores / scores.sum(dim=-1, keepdim=True)  # [B, T, E]
    P = (normalised * w[..., None]).sum(dim=1) / n[:, None]  # [B, E]
    with torch.no_grad():
        chosen = torch.zeros(B, T, E, device=logits.device).scatter_(2, idx, 1.0)  # [B, T, E]
        f = (chosen * w[..., None]).sum(dim=1) * E / (K * n[:, None])  # [B, E]
    rows = valid.any(dim=1)
    return (f * P).sum(dim=-1)[rows].mean() if rows.any() else logits.sum() * 0.0


class RouterBalance:
    """Records every router's choices during the forwards inside `with self:` and turns them into
    the balance loss. Built once per model; raises when the model has no router."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError(f"method.moe_aux_loss_coef > 0 balances a mixture of experts' routers, and this "
                             f"{type(model).__name__} has none (families with routers: llada2); set it to 0")
        self.terms: list[Tensor] = []
        self._valid: Tensor | None = None  # [B, T] of the current forward
        self._handles: list[Any] = []

    def __enter__(self) -> "RouterBalance":
        self.terms = []
        self._handles = [self.model.register_forward_pre_hook(self._read_mask, with_kwargs=True)]
        self._handles += [r.register_forward_hook(self._record) for r in self.routers]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles, self._valid = [], None

    def _read_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = args[0] if args else kwargs["input_ids"]  # [B, T]
        mask = args[1] if len(args) > 1 else kwargs.get("attention_mask")
        self._valid = mask.bool() if mask is not None and mask.dim() == 2 else torch.ones(ids.shape, dtype=torch.bool, device=ids.device)

    def _record(self, module: nn.Module, inputs: tuple, output: tuple[Tensor, Tensor, Tensor]) -> None:
        if not torch.is_grad_enabled() or self._valid is None:
            return
        idx, _, logits = output
        B, T = self._valid.shape
        self.terms.append(sequence_balance_loss(logits.view(B, T, -1), idx.view(B, T, -1), self._valid))

    def loss(self) -> Tensor:
        """The mean over the recorded (forward, layer) terms; raises when nothing was recorded."""
        if not self.terms:
            raise RuntimeError("no router ran with gradients inside `with RouterBalance(...)`")
        return torch.stack(self.terms).mean()
