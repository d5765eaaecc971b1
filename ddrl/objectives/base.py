"""The objective contract and the few pieces every objective shares.

An objective is a dataclass whose fields are its hyper-parameters (set in a config's
`method.objective_args`) and whose class attributes say what it needs, so that the trainer
computes only that:

    loss_out = objective(batch, new, old, ref, counts=counts)

    batch   RolloutBatch of one micro-batch (whole prompt groups), advantages already computed
    new     EstimatorOutput of the current policy (with grad)
    old     EstimatorOutput of the behaviour policy (no grad), or None (then old = sg(new): ratio 1)
    ref     EstimatorOutput of the reference model (no grad), or None when not needed
    counts  AggregationCounts of the whole optimizer step (aggregation.py)

Read the needs_* flags on an instance: where beta decides (needs_ref) or an option does
(needs_trajectory with token_weights), they are properties computed from the fields.
Rows with an invalid reward (batch.reward_valid False) carry no loss at all.
Stats are detached 0-d tensors describing this micro-batch (means/maxima over its rows/tokens); the
trainer logs each as its mean over the real micro-batches of every rank, except the counts named in
COUNTED_STATS, which it sums over them (rows per optimizer step).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ddrl.objectives.aggregation import AggregationCounts
from ddrl.types import EstimatorOutput, LossOutput, RolloutBatch


# Stats that count (rows of a micro-batch): logged as their sum over an optimizer step's micro-batches
# and ranks, which does not depend on how the step is split. Every other stat is a mean.
COUNTED_STATS = frozenset({"train_rows"})


@dataclass
class Objective:
    """Base of every objective; subclasses set the class attributes and implement __call__."""

    name: ClassVar[str] = ""
    paper: ClassVar[str] = ""  # short citation: authors, arXiv id
    source: ClassVar[str] = ""  # the released repository@commit:file:function its golden test was made from
    formula: ClassVar[str] = ""  # one line, shown by `ddrl methods`
    default_estimator: ClassVar[str] = "mean_field"  # an ESTIMATORS name
    default_estimator_args: ClassVar[dict] = {}  # estimator keyword arguments this method's paper uses
    default_advantage: ClassVar[str] = "mean"  # mean | zscore | loo
    default_advantage_clip: ClassVar[float | None] = None  # clamp advantages to ±this
    default_advantage_std: ClassVar[str] = "sample"  # zscore's std: sample | population
    default_advantage_eps: ClassVar[float] = 1e-4  # zscore's (r - mean) / (std + eps)
    needs_old: ClassVar[bool] = False  # uses the behaviour policy's estimate
    needs_trajectory: ClassVar[bool] = False  # the sampler must record batch.trajectory
    fresh_masks: ClassVar[bool] = False  # a new estimator-mask seed for every pass (StableDRL)
    reuse_masks: ClassVar[bool] = False  # every inner iteration reuses iteration 0's masks (DiPOD as released)
    on_policy: ClassVar[bool] = False  # one update per rollout; old = sg(current) by construction
    # Every loss term except the KL is multiplied by the row's advantage, so a group whose advantages
    # are all 0 contributes no gradient when beta = 0 (the trainer may then skip it).
    advantage_weighted: ClassVar[bool] = False

    @property
    def kl_weight(self) -> float:
        """β of the method's KL term, 0 when it has none. Objectives with a KL declare a float field
        `beta`; this is the one place that reads it, so the trainer never guesses."""
        return float(getattr(self, "beta", 0.0))

    @property
    def needs_ref(self) -> bool:
        """Uses the reference model's estimate: exactly when the method has a KL weight beta > 0."""
        return self.kl_weight > 0

    def check_estimator(self, estimator: object) -> None:
        """Raise, before any compute, when `estimator` cannot give what this loss reads (SPG's EUBO).
        Default: every estimator will do."""

    def prepare(self, batch: RolloutBatch) -> None:
        """Per-rollout inputs the loss reads from batch.extras, computed once on the whole step batch
        before it is cut into micro-batches (DACA's token weights). Default: nothing."""

    def __post_init__(self) -> None:
        # YAML 1.1 reads 4e-4 as a string; objective_args arrive untyped, so numbers are fixed here.
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, str) and "float" in str(f.type) and "str" not in str(f.type):
                setattr(self, f.name, float(value))

    def __call__(self, batch: RolloutBatch, new: EstimatorOutput, old: EstimatorOutput | None,
                 ref: EstimatorOutput | None, *, counts: AggregationCounts) -> LossOutput:
        raise NotImplementedError


# --------------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------------


def token_loss_mask(batch: RolloutBatch, estimator_mask: Tensor) -> Tensor:
    """[B, L] bool: positions the estimator scored, inside the completion, of rows with a valid reward."""
    return estimator_mask.bool() & batch.completion_mask.bool() & batch.reward_valid[:, None]


def token_logps(out: EstimatorOutput, who: str) -> Tensor:
    if out.token_logp is None:
        raise ValueError(f"this objective needs per-token log-probs, but the {who} estimator output has "
                         f"token_logp=None; pick a token-level estimator (mean_field, random_ratio ...)")
    return promote(out.token_logp)


def promote(x: Tensor) -> Tensor:
    """bf16/fp16 -> float32 for the loss arithmetic; float32 and float64 stay as they are (a float64
    golden test then runs in float64 end to end)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def sequence_proxy(out: EstimatorOutput, prefer: str = "elbo") -> Tensor:
    """[B] sequence-level log-likelihood proxy.

    prefer="elbo": extras["elbo"] if the estimator gave it, else seq_logp (ESPO, FPO, StableDRL, SPG).
    prefer="seq":  seq_logp, else extras["elbo"] (GDSD's plain denoise log-prob).
    """
    order = (out.extras.get("elbo"), out.seq_logp) if prefer == "elbo" else (out.seq_logp, out.extras.get("elbo"))
    value = next((v for v in order if v is not None), None)
    if value is None:
        raise ValueError("this objective needs a sequence-level proxy (seq_logp or extras['elbo']); "
                         "pick a sequence estimator (coupled_elbo, spg, fpo_elbo ...)")
    return promote(value)


def old_or_detached(old: EstimatorOutput | None, new_value: Tensor, pick) -> Tensor:
    """The behaviour policy's value, or sg(new) when there is no old pass (μ = 1: ratio ≡ 1)."""
    return new_value.detach() if old is None else pick(old).detach()


def require_ref(ref: EstimatorOutput | None, name: str) -> EstimatorOutput:
    if ref is None:
        raise ValueError(f"{name}: beta > 0 needs the reference model's estimate (ref=None was passed)")
    return ref


def inject_ratio_noise(log_ratio: Tensor, std: float, seed: int | Tensor) -> Tensor:
    """Stress hook ("exploding weights", StableDRL Fig. 5): log ρ + N(0, std²), noise from `seed`.

    The noise is a constant (no gradient) drawn on the CPU from torch.Generator(seed), so every
    objective that uses the hook sees the same draws for the same batch (objectives pass
    batch.mask_seeds[0]; micro-batches of equal shape draw the same noise, so the stress mode is not
    split-invariant, which it need not be). std = 0 returns log_ratio unchanged.
    """
    if std == 0.0:
        return log_ratio
    g = torch.Generator().manual_seed(int(seed))
    noise = torch.randn(log_ratio.shape, generator=g, dtype=torch.float64) * std
    return log_ratio + noise.to(device=log_ratio.device, dtype=log_ratio.dtype)


def noise_seed(batch: RolloutBatch) -> int | Tensor:
    """The batch's first mask seed, for inject_ratio_noise: left a 0-d tensor, read only when noise is
    added (std > 0), so the default loss reads no value on the host."""
    return batch.mask_seeds.reshape(-1)[0] if batch.mask_seeds.numel() else 0


def clipped_surrogate(log_ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic surrogate, elementwise: -min(ρA, clip(ρ, 1-ε_low, 1+ε_high)·A).

    Conditional clipping: the clipped branch is taken only when ρ > 1+ε with A > 0 or ρ < 1-ε with
    A < 0; a sample with A < 0 and ρ ≫ 1 passes unclipped and its gradient scales with ρ
    (the failure StableDRL fixes). Returns (loss [...], clipped [...] bool: clipped branch active).
    """
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).detach()


def masked_stat(values: Tensor, mask: Tensor, reduce: str = "mean") -> Tensor:
    """Detached mean / max of values over mask (0 when empty), for logging. mask covers the leading
    dimensions of values. Masked sums, not boolean indexing: the selected count is never read on the
    host, so a stat costs the step no device sync."""
    with torch.no_grad():
        v = values.detach().float()
        m = mask.bool().reshape(*mask.shape, *(1,) * (v.dim() - mask.dim())).expand_as(v)
        n = m.sum()
        if reduce == "mean":
            stat = torch.where(m, v, 0.0).sum() / n.clamp(min=1)
        else:
            stat = torch.where(m, v, -math.inf).amax() if v.numel() else v.new_zeros(())
        return torch.where(n > 0, stat, 0.0)
