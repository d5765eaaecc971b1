"""Terms added to an objective's loss that are not the objective's own: DiPOD's on-policy ELBO
regulariser on any other objective (`method.elbo_reg`), and a mixture of experts' router balance
loss (`method.moe_aux_loss_coef`).

A method's loss is `objective(...) + sum_k term_k(...)`; build_method makes the terms a config asks
for, so neither the Method nor the trainer names them. Each term returns what it adds to the loss
and what it logs (a stat of its own name). A method with a term is never skip-safe: a term is not
multiplied by the advantage, so a group of zero advantages still carries its gradient.

    term.recorder(model)             a context the loss forwards run in (None: the term needs none)
    term(batch, new, counts)         -> (added to the loss, logged value), both 0-d tensors
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, ClassVar, ContextManager, Protocol

from torch import Tensor, nn

from ddrl.models.moe_balance import RouterBalance
from ddrl.objectives.aggregation import AggregationCounts
from ddrl.objectives.dipod import elbo_regulariser
from ddrl.types import EstimatorOutput, RolloutBatch


class LossTerm(Protocol):
    name: ClassVar[str]  # the stat it logs
    formula: ClassVar[str]  # appended to the objective's formula by Method.describe

    @property
    def weight(self) -> float: ...

    def recorder(self, model: nn.Module) -> ContextManager[Any] | None: ...

    def __call__(self, batch: RolloutBatch, new: EstimatorOutput,
                 counts: AggregationCounts) -> tuple[Tensor, Tensor]: ...


@dataclass(frozen=True)
class ElboTerm:
    """DiPOD's on-policy ELBO regulariser, λ·mean_i(-ELBO_θ(x_i)), on an objective other than DiPOD
    (whose loss holds the same term as its own field: ddrl.objectives.dipod)."""

    weight: float  # λ
    name: ClassVar[str] = "elbo_reg"
    formula: ClassVar[str] = "λ·mean(-ELBO)"

    def recorder(self, model: nn.Module) -> None:
        return None

    def __call__(self, batch: RolloutBatch, new: EstimatorOutput,
                 counts: AggregationCounts) -> tuple[Tensor, Tensor]:
        reg = elbo_regulariser(batch, new, counts)
        return self.weight * reg, reg.detach()


@dataclass
class RouterBalanceTerm:
    """The routers' balance loss (ddrl.models.moe_balance), recorded during the micro-batch's loss
    forwards and weighted to a mean over the step's micro-batches and ranks."""

    weight: float  # method.moe_aux_loss_coef
    name: ClassVar[str] = "moe_aux_loss"
    formula: ClassVar[str] = "c·mean(router balance)"
    balance: RouterBalance | None = field(default=None, repr=False)  # set by `recorder(model)`

    def __post_init__(self) -> None:
        if self.weight < 0:
            raise ValueError(f"method.moe_aux_loss_coef={self.weight} must be >= 0 (0 = off)")

    def recorder(self, model: nn.Module) -> RouterBalance:
        self.balance = RouterBalance(model)
        return self.balance

    def __call__(self, batch: RolloutBatch, new: EstimatorOutput,
                 counts: AggregationCounts) -> tuple[Tensor, Tensor]:
        if self.balance is None:
            raise RuntimeError("the router balance term reads the routers of the loss forwards: run them inside "
                               "`with method.recorder(model):`")
        aux = self.balance.loss()
        # counts.micro_batches: the step's real micro-batches summed over ranks, as micro_batch_token_mean divides
        return self.weight / max(counts.micro_batches, 1) * aux, aux


def recorder(terms: tuple[LossTerm, ...], model: nn.Module) -> ContextManager[Any]:
    """The context the loss forwards run in: the recording term's recorder, or a null context."""
    recorders = [r for r in (term.recorder(model) for term in terms) if r is not None]
    if len(recorders) > 1:  # one term records today (the router balance); nest them when a second comes
        raise NotImplementedError("more than one loss term records the loss forwards")
    return recorders[0] if recorders else contextlib.nullcontext()
