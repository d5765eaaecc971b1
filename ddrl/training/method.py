"""The method contract: everything the trainer needs to know about an RL method, built once.

`build_method(cfg)` turns the config's `method` section into one typed `Method`. The trainer reads
only this object; it never asks the objective or the estimator for optional attributes, so what a
method needs is stated in one place and checked at start-up:

    method = build_method(cfg)
    method.needs_old / needs_ref / needs_trajectory    which passes and records the step computes
    method.advantage                                    kind, std, clip, invalid-reward policy
    method.skip_safe                                    all-zero-advantage groups carry no gradient
    method.count_rows(b) / row_chunks(b, n)             an estimator's own training rows (TraceRL, UniGRPO)
    method.mask_seed_iteration(k)                       which inner iteration's masks iteration k uses
    method.prepare(batch)                               per-rollout inputs (DACA's token weights)
    method.loss(mb, new, old, ref, counts)              objective + the config's loss terms (ddrl.training.loss_terms)
    method.recorder(model)                              the context the loss forwards run in (a term's recording)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ContextManager

from torch import nn

from ddrl.config import RLConfig
from ddrl.objectives.base import Objective
from ddrl.registry import ESTIMATORS, OBJECTIVES
from ddrl.training.loss_terms import ElboTerm, LossTerm, RouterBalanceTerm, recorder
from ddrl.types import COMMIT_ORDER, EstimatorOutput, LossOutput, RolloutBatch

INVALID_REWARDS = ("drop", "zero")


@dataclass(frozen=True)
class AdvantageSpec:
    """How rewards become advantages (ddrl.objectives.advantages)."""

    kind: str  # mean | zscore | loo
    std: str  # zscore's std: sample | population
    eps: float  # zscore's (r - mean) / (std + eps), as the method's authors add it
    clip: float | None  # clamp to ±clip afterwards (UDM-GRPO: 5)
    invalid: str  # a None/NaN reward: "drop" (left out of its group, no loss) or "zero" (reward 0; d1, wd1)


@dataclass
class Method:
    """One RL method: its objective, estimator and the trainer-facing facts derived from both."""

    objective: Objective
    estimator: Any  # an ESTIMATORS instance: estimator(model, batch, seed) -> EstimatorOutput
    advantage: AdvantageSpec
    fresh_masks: bool = False  # a new estimator-mask seed for every pass (StableDRL)
    reuse_masks: bool = False  # every inner iteration uses iteration 0's masks (DiPOD as released)
    terms: tuple[LossTerm, ...] = ()  # added to the objective's loss (DiPOD's ELBO term, the routers' balance)

    def __post_init__(self) -> None:
        if self.fresh_masks and self.reuse_masks:
            raise ValueError("method.fresh_masks and method.reuse_masks exclude each other: fresh masks draw new "
                             "masks for every pass, reused masks keep iteration 0's; set one of them to false")

    @property
    def name(self) -> str:
        return self.objective.name

    @property
    def needs_old(self) -> bool:
        """The loss reads the behaviour policy (an old pass is computed unless it equals sg(current))."""
        return self.objective.needs_old and not self.objective.on_policy

    @property
    def needs_ref(self) -> bool:
        return self.objective.needs_ref

    @property
    def needs_trajectory(self) -> bool | str:
        """What the sampler records (its return_trajectory): False; COMMIT_ORDER when nothing reads
        token_probs (the trace estimator reads commit_step only: no [B, W, V] per step, ddrl.sampling.
        trajectory); True when DPS weights (token_weights) or the estimator read them."""
        if not (self.objective.needs_trajectory or self.estimator.needs_trajectory):
            return False
        estimator_reads_probs = self.estimator.needs_trajectory and getattr(self.estimator, "trajectory_record",
                                                                            True) is True
        return True if getattr(self.objective, "token_weights", False) or estimator_reads_probs else COMMIT_ORDER

    @property
    def skip_safe(self) -> bool:
        """Every loss term is multiplied by the row's advantage: a group whose advantages are all 0
        carries no gradient and may be left out of the update."""
        return self.objective.advantage_weighted and self.objective.kl_weight == 0.0 and not self.terms

    @property
    def masks_per_group(self) -> bool:
        """The estimator draws each group's masks from the group's own seed (its mask_per_group
        option): the planner names each micro-batch's step-global groups (batch.groups)."""
        return bool(getattr(self.estimator, "mask_per_group", False))  # an optional estimator option

    def mask_seed_iteration(self, k: int) -> int:
        """The inner iteration whose mask seed iteration k uses."""
        return 0 if self.reuse_masks else k

    def prepare(self, batch: RolloutBatch) -> None:
        self.objective.prepare(batch)

    @property
    def has_rows(self) -> bool:
        """The estimator makes training rows of its own (TraceRL's trace states, UniGRPO's masked
        copies): it counts them (`count_rows`, the row aggregations' normaliser) and cuts them
        (`row_chunks`, train.micro_batch_rows)."""
        return hasattr(self.estimator, "count_rows")

    def count_rows(self, batch: RolloutBatch) -> float | None:
        """Training rows of a batch when the estimator makes more than one per sample (TraceRL's trace
        states, UniGRPO's masked copies: `count_rows`), else None (the loss counts rows from the batch itself)."""
        count = getattr(self.estimator, "count_rows", None)  # an optional estimator capability
        return None if count is None else float(count(batch))

    def row_chunks(self, batch: RolloutBatch, rows: int) -> list[RolloutBatch]:
        """Micro-batches of at most `rows` training rows (train.micro_batch_rows): the estimator's
        rows cut sample-major (`Trace.row_chunks`: (sample, state); `RandomRatio.row_chunks`: (sample,
        copy)), each micro-batch the samples it holds with extras[estimator.row_selection] [n, S]
        naming the rows it computes."""
        if not hasattr(self.estimator, "row_chunks"):
            raise ValueError(f"estimator {getattr(self.estimator, 'name', self.estimator)!r} makes no training rows "
                             f"of its own to cut; unset train.micro_batch_rows and use train.micro_batch_size")
        out = []
        for samples, selection in self.estimator.row_chunks(batch, rows):
            mb = batch.index(samples)
            mb.extras[self.estimator.row_selection] = selection
            out.append(mb)
        return out

    def loss(self, batch: RolloutBatch, new: EstimatorOutput, old: EstimatorOutput | None,
             ref: EstimatorOutput | None, counts) -> LossOutput:
        out = self.objective(batch, new, old, ref, counts=counts)
        loss, stats = out.loss, dict(out.stats)
        for term in self.terms:
            added, stats[term.name] = term(batch, new, counts)
            loss = loss + added
        return LossOutput(loss, stats) if self.terms else out

    def recorder(self, model: nn.Module) -> ContextManager[Any]:
        """The context each micro-batch's loss forwards run in, for the terms that read them."""
        return recorder(self.terms, model)

    def describe(self) -> str:
        return " + ".join([self.objective.formula] + [f"{t.formula}, weight {t.weight:g}" for t in self.terms])


def build_method(cfg: RLConfig) -> Method:
    """The method of a config: one line (`objective=espo`) picks objective, estimator and advantages."""
    m = cfg.method
    cls = OBJECTIVES.get(m.objective)
    args = dict(m.objective_args)
    elbo_reg = m.elbo_reg
    if "elbo_reg" in {f.name for f in dataclasses.fields(cls)}:
        # DiPOD's loss is FPO's plus this regulariser, so λ is its own field and it adds the term
        # itself (the same add_elbo_regulariser); method.elbo_reg, when set, is that field.
        if elbo_reg and "elbo_reg" in args and float(args["elbo_reg"]) != elbo_reg:
            raise ValueError(f"method.elbo_reg={elbo_reg} and method.objective_args.elbo_reg={args['elbo_reg']} "
                             f"disagree; set only one of them")
        if elbo_reg:
            args["elbo_reg"] = elbo_reg
        elbo_reg = 0.0
    objective = cls(**args)
    est_name = m.estimator or objective.default_estimator
    est_args = {**objective.default_estimator_args, **m.estimator_args}
    if m.estimator and m.estimator != objective.default_estimator:
        est_args = dict(m.estimator_args)  # a different estimator does not inherit the default's args
    estimator = ESTIMATORS.get(est_name)(**est_args)
    objective.check_estimator(estimator)
    if m.invalid_reward not in INVALID_REWARDS:
        raise ValueError(f"method.invalid_reward={m.invalid_reward!r}; valid: {', '.join(INVALID_REWARDS)}")
    advantage = AdvantageSpec(
        kind=m.advantage or objective.default_advantage,
        std=m.advantage_std or objective.default_advantage_std,
        eps=objective.default_advantage_eps,
        clip=m.advantage_clip if m.advantage_clip is not None else objective.default_advantage_clip,
        invalid=m.invalid_reward,
    )
    fresh = objective.fresh_masks if m.fresh_masks is None else m.fresh_masks
    reuse = objective.reuse_masks if m.reuse_masks is None else m.reuse_masks
    terms: list[LossTerm] = [ElboTerm(elbo_reg)] if elbo_reg else []
    if m.moe_aux_loss_coef:
        terms.append(RouterBalanceTerm(float(m.moe_aux_loss_coef)))
    return Method(objective, estimator, advantage, fresh_masks=bool(fresh), reuse_masks=bool(reuse), terms=tuple(terms))
