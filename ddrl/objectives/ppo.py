"""The PPO-clip machinery shared by the ratio-based objectives.

`TokenPPO` is the one token-level clipped objective behind diffu-GRPO (d1), UniGRPO,
coupled-GRPO, TraceRL, MaskGRPO and DACA-GRPO; those differ only in their estimator, defaults,
aggregation and KL target, which are fields and class attributes here:

    ρ_{b,i} = exp(log π_θ(x^i_b) - log π_old(x^i_b))                       (per scored token)
    ℓ_{b,i} = -min(ρA_b, clip(ρ, 1-ε, 1+ε_high)A_b)·w_{b,i} + β·k(π_target, π_θ)_{b,i}
    L       = aggregation(ℓ) over scored completion tokens of valid rows

w is 1, or the per-token Denoising Progress Score weights (DACA, `token_weights=True`); the KL
target is the reference model (d1 ...) or the behaviour policy (TraceRL, UniGRPO).

Training rows. In dLLM-RL (TraceRL, UniGRPO) the unit of the loss is not the sample but a
*training row*: one trace state of a sample (`trace` estimator, extras["trace_step"]) or one
masked copy of it (`random_ratio`, extras["copy_token_logp"] / ["copy_mask"]). The aggregations
`row_token_mean` / `row_token_mean_local` average ℓ over each row's scored tokens, sum over rows
and divide by the number of rows R; the KL of those methods is summed per row and divided by the
same R (`kl_aggregation = "row_token_sum"`). `row_token_mean` divides by the step's global R
(split-invariant, see `row_count`); `row_token_mean_local` by this micro-batch's own rows, which
is what dLLM-RL's forward_process computes for one of its micro-batches.

`sequence_ppo_loss` is the sequence-level counterpart used by ESPO and DiPOD-FPO.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ddrl.estimators.dps import DPS_KINDS, denoising_progress_scores
from ddrl.objectives.aggregation import TOKEN_REDUCTIONS, AggregationCounts, masked, sequence_mean
from ddrl.objectives.base import (
    Objective,
    clipped_surrogate,
    inject_ratio_noise,
    masked_stat,
    noise_seed,
    old_or_detached,
    require_ref,
    token_logps,
    token_loss_mask,
)
from ddrl.objectives.kl import KL_ESTIMATORS, kl
from ddrl.types import EstimatorOutput, LossOutput, RolloutBatch


@dataclass
class TokenPPO(Objective):
    """Token-level PPO-clip with conditional clipping and an optional per-token KL penalty."""

    epsilon: float = 0.5  # clip range ε: ratios are clipped to [1-ε, 1+ε_high]
    epsilon_high: float | None = None  # upper clip range ("clip-higher"); None = epsilon
    beta: float = 0.04  # KL penalty coefficient β (0 = no KL, no reference pass)
    kl_estimator: str = "k3"  # k1 | k2 | k3 (kl.py)
    # token_mean | sequence_token_mean | sequence_token_sum (aggregation.py) | row_token_mean | row_token_mean_local
    aggregation: str = "token_mean"
    token_weights: bool = False  # multiply each token's surrogate by its Denoising Progress Score weight (DACA)
    dps_kind: str = "progress"  # with token_weights: progress | uncertainty (ddrl.estimators.dps)
    dps_floor: float = 0.1  # with token_weights: uniform share mixed into the weights, so every token trains
    ratio_noise_std: float = 0.0  # stress test: std of Gaussian noise added to log ρ ("exploding weights")

    needs_old: ClassVar[bool] = True
    kl_against: ClassVar[str] = "ref"  # "ref": KL to the reference model; "old": to the behaviour policy
    kl_aggregation: ClassVar[str | None] = None  # None = same as `aggregation`; row_token_sum with row aggregations
    estimator_needs_trajectory: ClassVar[bool] = False  # the default estimator reads batch.trajectory
    advantage_weighted: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.aggregation not in TOKEN_REDUCTIONS and self.aggregation not in ROW_AGGREGATIONS:
            valid = ", ".join([*TOKEN_REDUCTIONS, *ROW_AGGREGATIONS])
            raise ValueError(f"{self.name}: aggregation={self.aggregation!r}; valid: {valid}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"{self.name}: kl_estimator={self.kl_estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
        if self.dps_kind not in DPS_KINDS:
            raise ValueError(f"{self.name}: dps_kind={self.dps_kind!r}; valid: {', '.join(DPS_KINDS)}")
        if not 0.0 <= self.dps_floor <= 1.0:
            raise ValueError(f"{self.name}: dps_floor={self.dps_floor} must be in [0, 1]")

    def prepare(self, batch: RolloutBatch) -> None:
        """DPS weights of the whole step batch (before it is cut into micro-batches), from the rollout's
        trajectory, into batch.extras["dps_weights"] [B, L]."""
        if self.token_weights and batch.trajectory is not None:
            batch.extras["dps_weights"] = denoising_progress_scores(batch.trajectory, batch.completion_mask,
                                                                    self.dps_kind, self.dps_floor)

    @property
    def needs_ref(self) -> bool:
        return self.beta > 0 and self.kl_against == "ref"

    @property
    def needs_trajectory(self) -> bool:  # type: ignore[override]
        return self.estimator_needs_trajectory or self.token_weights  # DPS weights come from the trajectory

    def __call__(self, batch: RolloutBatch, new: EstimatorOutput, old: EstimatorOutput | None,
                 ref: EstimatorOutput | None, *, counts: AggregationCounts) -> LossOutput:
        if self.aggregation in ROW_AGGREGATIONS:
            return self._row_loss(batch, new, old, counts)
        mask = token_loss_mask(batch, new.mask)  # [B, L]
        logp = token_logps(new, "current")  # [B, L]
        old_logp = old_or_detached(old, logp, lambda o: token_logps(o, "old"))
        log_ratio = inject_ratio_noise(logp - old_logp, self.ratio_noise_std, noise_seed(batch))
        adv = batch.advantages.to(logp.dtype)[:, None]  # [B, 1]
        eps_high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        surrogate, clipped = clipped_surrogate(log_ratio, adv, self.epsilon, eps_high)  # [B, L]
        if self.token_weights:
            weights = batch.extras.get("dps_weights")
            if weights is not None:
                surrogate = surrogate * weights.to(surrogate.dtype)
        reduce = TOKEN_REDUCTIONS[self.aggregation]
        loss = reduce(surrogate, mask, counts)
        ratio = torch.exp(log_ratio.detach())
        stats = {"clip_frac": masked_stat(clipped.float(), mask), "ratio_mean": masked_stat(ratio, mask),
                 "ratio_max": masked_stat(ratio, mask, "max")}
        if self.beta > 0:
            target = old_logp if self.kl_against == "old" else token_logps(require_ref(ref, self.name), "ref").detach()
            per_token_kl = kl(logp, target, self.kl_estimator)  # [B, L]
            kl_name = self.kl_aggregation or self.aggregation
            reduce_kl = TOKEN_REDUCTIONS["sequence_token_sum" if kl_name == "row_token_sum" else kl_name]  # a sample = a row
            loss = loss + self.beta * reduce_kl(per_token_kl, mask, counts)
            stats["kl"] = masked_stat(per_token_kl, mask)
        return LossOutput(loss, stats)

    def _row_loss(self, batch: RolloutBatch, new: EstimatorOutput, old: EstimatorOutput | None,
                  counts: AggregationCounts) -> LossOutput:
        """ℓ averaged per training row, summed over rows / R; KL k(π_old, π_θ) summed per row / R."""
        if self.token_weights or (self.beta > 0 and self.kl_against != "old"):
            raise ValueError(f"{self.name}: the row aggregations support neither token_weights nor a KL to the "
                             f"reference model; use aggregation=token_mean or sequence_token_mean")
        logp, old_logp, rows = training_rows(batch, new, old)  # [U, B, L] each
        log_ratio = inject_ratio_noise(logp - old_logp, self.ratio_noise_std, noise_seed(batch))
        adv = batch.advantages.to(logp.dtype)[None, :, None]  # [1, B, 1]
        eps_high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        surrogate, clipped = clipped_surrogate(log_ratio, adv, self.epsilon, eps_high)  # [U, B, L]
        R = max(self.row_count(batch, new, rows, counts), 1.0)  # an empty step contributes 0, never NaN
        per_row = masked(surrogate, rows).sum(-1) / rows.sum(-1).clamp(min=1)  # [U, B]
        loss = per_row.sum() / R
        ratio = torch.exp(log_ratio.detach())
        stats = {"clip_frac": masked_stat(clipped.float(), rows), "ratio_mean": masked_stat(ratio, rows),
                 "ratio_max": masked_stat(ratio, rows, "max"), "train_rows": torch.tensor(float(rows.any(-1).sum()))}
        if self.beta > 0:
            per_token_kl = kl(logp, old_logp, self.kl_estimator)  # [U, B, L]
            kl_rows = masked(per_token_kl, rows).sum(-1)  # [U, B]
            if (self.kl_aggregation or "row_token_sum") != "row_token_sum":
                kl_rows = kl_rows / rows.sum(-1).clamp(min=1)
            loss = loss + self.beta * kl_rows.sum() / R
            stats["kl"] = masked_stat(per_token_kl, rows)
        return LossOutput(loss, stats)

    def row_count(self, batch: RolloutBatch, new: EstimatorOutput, rows: Tensor, counts: AggregationCounts) -> float:
        """R, the number of training rows the loss is divided by.

        row_token_mean_local: this micro-batch's rows with at least one scored token (dLLM-RL).
        row_token_mean: the optimizer step's global count, so the gradient does not depend on the
        micro-batch split: counts.rows when the trainer set it (the step's rows over all
        micro-batches and processes: `Trace.count_rows` of the step batch); otherwise, for
        masked copies, copies x counts.sequences (an empty copy counts as a row with zero loss; dLLM-RL
        skips it; one row per sample for other estimators), and for trace states this micro-batch's
        own rows, which is only the global count when the micro-batch is the whole step (checked).
        """
        local = float(rows.any(-1).sum())
        if self.aggregation == "row_token_mean_local":
            return local
        if counts.rows is not None:
            return float(counts.rows)
        if TRACE_STEP not in new.extras:  # masked copies (or one row per sample): U rows per valid sequence
            return float(rows.shape[0]) * float(counts.sequences)
        if float(batch.reward_valid.sum()) != float(counts.sequences) or "trace_states" in batch.extras:
            raise ValueError(f"{self.name}: aggregation=row_token_mean divides by the step's number of trace states, "
                             f"which a micro-batch cannot know: pass AggregationCounts(rows=Trace.count_rows("
                             f"step_batch) summed over processes) (the trainer does), or use "
                             f"aggregation=row_token_mean_local")
        return local


COPY_LOGP, COPY_MASK, TRACE_STEP = "copy_token_logp", "copy_mask", "trace_step"
ROW_AGGREGATIONS = ("row_token_mean", "row_token_mean_local")


def _logps(value: Tensor) -> Tensor:
    """float32, or float64 when the estimator gave float64 (golden tests run in float64)."""
    return value if value.dtype == torch.float64 else value.float()


def training_rows(batch: RolloutBatch, new: EstimatorOutput, old: EstimatorOutput | None) -> tuple[Tensor, Tensor, Tensor]:
    """(current, old log-probs, scored mask), each [U, B, L]: one slice per training row kind.

    Masked copies (random_ratio): U = copies, each copy its own log-probs and mask.
    Trace states (trace): U = states, slice s holds the tokens whose state is s (extras["trace_step"]).
    Any other token estimator: U = 1, each sample is one row.
    Rows with an invalid reward and positions outside the completion are never scored.
    """
    valid = token_loss_mask(batch, new.mask)[None]  # [1, B, L]
    if COPY_LOGP in new.extras:
        logp = _logps(new.extras[COPY_LOGP])  # [C, B, L]
        old_logp = logp.detach() if old is None else _logps(old.extras[COPY_LOGP]).detach()
        return logp, old_logp, new.extras[COPY_MASK].bool() & valid
    if TRACE_STEP in new.extras:
        step = new.extras[TRACE_STEP]  # [B, L] long, -1 = unscored
        S = int(step.max()) + 1 if (step >= 0).any() else 0
        rows = (step[None] == torch.arange(S, device=step.device)[:, None, None]) & valid  # [S, B, L]
        logp = _logps(token_logps(new, "current"))  # [B, L]; raises when the estimator gave no token log-probs
        old_logp = logp.detach() if old is None else _logps(token_logps(old, "old")).detach()
        return logp[None].expand(S, -1, -1), old_logp[None].expand(S, -1, -1), rows
    logp = _logps(token_logps(new, "current") if new.token_logp is None else new.token_logp)  # one row per sample
    old_logp = logp.detach() if old is None else _logps(token_logps(old, "old")).detach()
    return logp[None], old_logp[None], valid


def sequence_ppo_loss(log_ratio: Tensor, adv: Tensor, valid: Tensor, eps_low: float, eps_high: float,
                      counts: AggregationCounts) -> tuple[Tensor, dict[str, Tensor]]:
    """Σ_b -min(ρ_b A_b, clip(ρ_b) A_b) / global sequence count, over valid rows. log_ratio, adv: [B]."""
    surrogate, clipped = clipped_surrogate(log_ratio, adv.to(log_ratio.dtype), eps_low, eps_high)
    ratio = torch.exp(log_ratio.detach())
    stats = {"clip_frac": masked_stat(clipped.float(), valid), "ratio_mean": masked_stat(ratio, valid),
             "ratio_max": masked_stat(ratio, valid, "max")}
    return sequence_mean(surrogate, counts, valid), stats
