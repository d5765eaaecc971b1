"""Commit rules of the masked-diffusion samplers: how many, and which, still-masked positions of the
current block a step commits (docs/diffusion.md#low-confidence-sampler and #threshold-decoding).

  fixed counts   LLaDA (Nie et al. 2025): steps_per_block steps per block; step s commits
                 k_s = n // spb tokens, one more in the first n % spb steps (n = masked in the block),
                 the k_s most confident.
  threshold      Fast-dLLM (Wu et al. 2025): every masked position with confidence >= threshold, and
                 always the most confident one, until the block is full.
  factor         Fast-dLLM's variant: the n most confident for the largest n with (n + 1)(1 - c_(n)) < f.
  sdar_dynamic   SDAR's low_confidence_dynamic (ddrl.sampling.sdar.commit_dynamic): the step's count k
                 from the block length; those above threshold if at least k, else the k most confident.
  emerge         MaskGRPO's ancestral sampler (Ma et al. 2025; docs/diffusion.md#emerge-sampler): each
                 masked token appears with probability (k_t - k_s) / k_t, k the mask-fraction pace;
                 the last step fills every remaining mask. Under rollout.rng=released the same rule
                 draws as MaskGRPO's image rollouts do (ddrl.sampling.released.ReleasedEmergeRule: one
                 draw per slot gives both the token and whether it appears).

A rule has begin_block(masked), more_steps(step, masked) -> bool, choose(step, confidence, masked,
noise) -> [B, W] bool and step_time(step). `fixed_steps` says whether more_steps depends on the step
count only: fixed counts and emerge read nothing from the device in the loop; threshold, factor and
sdar_dynamic end a block when no row has a mask left, which is one host read of a [B, W] mask per
step. That read is what the adaptive step count costs: whether to call the model again depends on
what the last call committed.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import Tensor

from ddrl.contract import model_view
from ddrl.processes.base import ScheduledProcess
from ddrl.sampling.released import RELEASED, ReleasedEmergeRule, check_released_model
from ddrl.sampling.sdar import commit_dynamic

if TYPE_CHECKING:
    from ddrl.sampling.utils import StepNoise

REMASKING = ("low_confidence", "random", "sdar_dynamic")  # rollout.remasking: how confidence is read

# Mask fraction k(tau) of the emerge sampler at reverse progress tau in [0, 1] (1 = all masked at tau = 0).
EMERGE_SCHEDULES: dict[str, Callable[[float], float]] = {
    "linear": lambda tau: 1.0 - tau,
    "cosine": lambda tau: math.cos(0.5 * math.pi * tau),  # MaskGRPO / MaskGIT image sampler
}
# Which emerge pace a model gets, by the name of its process schedule; anything else gets "linear".
EMERGE_SCHEDULE_FOR_PROCESS: dict[str, str] = {"linear": "linear", "cosine": "cosine"}


# --------------------------------------------------------------------------------------------
# Pure selection functions
# --------------------------------------------------------------------------------------------


def transfer_counts(num_masked: Tensor, steps: int) -> Tensor:
    """[A] masked counts -> [A, steps] tokens to commit per step: n // steps, +1 in the first n % steps steps.

    LLaDA's schedule; with steps > n the trailing steps commit nothing (the reference still runs them).
    """
    base = (num_masked // steps)[:, None]  # [A, 1]
    extra = torch.arange(steps, device=num_masked.device)[None, :] < (num_masked % steps)[:, None]  # [A, steps]
    return base + extra.long()


def commit_top_k(confidence: Tensor, k: Tensor) -> Tensor:
    """[A, W] confidence, [A] counts -> [A, W] bool: the k[a] most confident positions of each row.

    A stable descending sort ranks the positions, so ties go to the leftmost one and one call serves
    rows with different k (torch.topk would need a loop over rows).
    """
    order = confidence.argsort(dim=-1, descending=True, stable=True)  # [A, W]
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
    return ranks < k[:, None]


def commit_by_factor(confidence: Tensor, masked: Tensor, factor: float) -> Tensor:
    """[A, W] -> [A, W] bool: the n most confident masked positions for the largest n with
    (n + 1)(1 - c_(n)) < factor, c_(n) the n-th largest confidence; at least one per row with a mask.

    (n + 1)(1 - c_(n)) grows with n, so the n that pass form a prefix of the ranking.
    """
    ranked = confidence.sort(dim=-1, descending=True).values  # [A, W], -inf (not masked) last
    n = torch.arange(1, ranked.shape[1] + 1, device=ranked.device, dtype=ranked.dtype)
    passes = (n + 1) * (1 - ranked) < factor  # [A, W]; False on -inf
    count = passes.long().cumprod(dim=-1).sum(dim=-1).clamp(min=1)  # [A]
    return commit_top_k(confidence, count) & masked


def commit_above_threshold(confidence: Tensor, masked: Tensor, threshold: float) -> Tensor:
    """[A, W] -> [A, W] bool: every masked position with confidence >= threshold, and always the most
    confident masked one (Fast-dLLM), so each row with a mask left makes progress."""
    best = torch.zeros_like(masked)
    best.scatter_(1, confidence.argmax(dim=-1, keepdim=True), True)
    return masked & ((confidence >= threshold) | best)


# --------------------------------------------------------------------------------------------
# Rules: per block, how many steps and what each step commits
# --------------------------------------------------------------------------------------------


class FixedCountRule:
    """LLaDA: steps_per_block steps per block, transfer_counts() commits per step, top-k by confidence."""

    uses_confidence = True
    fixed_steps = True

    def __init__(self, steps_per_block: int):
        self.steps_per_block = steps_per_block
        self.counts: Tensor | None = None

    def begin_block(self, masked: Tensor) -> None:
        self.counts = transfer_counts(masked.sum(dim=1), self.steps_per_block)  # [B, spb]

    def more_steps(self, step: int, masked: Tensor) -> bool:
        return step < self.steps_per_block

    def choose(self, step: int, confidence: Tensor, masked: Tensor, noise: StepNoise | None) -> Tensor:
        assert self.counts is not None  # begin_block ran
        return commit_top_k(confidence, self.counts[:, step])

    def step_time(self, step: int) -> float | None:
        return None


class ThresholdRule:
    """Fast-dLLM: commit everything at least `threshold` confident (at least one), until the block is full."""

    uses_confidence = True
    fixed_steps = False

    def __init__(self, threshold: float):
        self.threshold = threshold

    def begin_block(self, masked: Tensor) -> None:
        pass

    def more_steps(self, step: int, masked: Tensor) -> bool:
        return bool(masked.any())  # the one host read per step of adaptive decoding (module doc)

    def choose(self, step: int, confidence: Tensor, masked: Tensor, noise: StepNoise | None) -> Tensor:
        return commit_above_threshold(confidence, masked, self.threshold)

    def step_time(self, step: int) -> float | None:
        return None


class FactorRule(ThresholdRule):
    """Fast-dLLM's factor variant: commit_by_factor at each step, until the block is full."""

    def __init__(self, factor: float):
        self.factor = factor

    def choose(self, step: int, confidence: Tensor, masked: Tensor, noise: StepNoise | None) -> Tensor:
        return commit_by_factor(confidence, masked, self.factor)


class DynamicRule(FixedCountRule):
    """SDAR's low_confidence_dynamic (ddrl.sampling.sdar): each step's count k comes from the block
    length, as in SDAR's get_num_transfer_tokens, whatever is still masked; commit the masked
    positions above threshold if there are at least k, else the k most confident. A block ends when
    it has no mask left (SDAR breaks out; it does not run LLaDA's trailing no-op steps)."""

    fixed_steps = False

    def __init__(self, steps_per_block: int, threshold: float, block_length: int):
        super().__init__(steps_per_block)
        self.threshold, self.block_length = threshold, block_length

    def begin_block(self, masked: Tensor) -> None:
        full = torch.full((masked.shape[0],), self.block_length, dtype=torch.long, device=masked.device)
        self.counts = transfer_counts(full, self.steps_per_block)  # [B, spb]

    def more_steps(self, step: int, masked: Tensor) -> bool:
        return step < self.steps_per_block and bool(masked.any())

    def choose(self, step: int, confidence: Tensor, masked: Tensor, noise: StepNoise | None) -> Tensor:
        assert self.counts is not None  # begin_block ran
        return commit_dynamic(confidence, masked, self.threshold, self.counts[:, step])


class EmergeRule:
    """MaskGRPO: each masked token appears with probability (k_t - k_s) / k_t; the last step fills all."""

    uses_confidence = False
    fixed_steps = True

    def __init__(self, steps_per_block: int, mask_fraction: Callable[[float], float]):
        self.steps_per_block = steps_per_block
        self.mask_fraction = mask_fraction

    def begin_block(self, masked: Tensor) -> None:
        pass

    def more_steps(self, step: int, masked: Tensor) -> bool:
        return step < self.steps_per_block

    def choose(self, step: int, confidence: Tensor | None, masked: Tensor, noise: StepNoise | None) -> Tensor:
        T = self.steps_per_block
        if step == T - 1:  # k(1) is 0 only up to rounding (cos(pi/2) = 6e-17): fill explicitly
            return masked
        k_t, k_s = self.mask_fraction(step / T), self.mask_fraction((step + 1) / T)
        assert noise is not None  # emerge commits at random: its sampler always passes the step's noise
        return masked & (noise(masked.shape[1]) < (k_t - k_s) / k_t)

    def step_time(self, step: int) -> float | None:
        return 1.0 - step / self.steps_per_block


CommitRule = FixedCountRule | ThresholdRule | DynamicRule | EmergeRule | ReleasedEmergeRule


def steps_per_block(steps: int, gen_length: int, block_length: int) -> int:
    """Model calls per block: steps / ceil(gen_length / block_length) (a block model's completion
    need not be whole blocks; its last one counts). The settings class has checked the division."""
    return steps // -(-gen_length // block_length)


def emerge_mask_fraction(model: Any) -> Callable[[float], float]:
    """k(tau) for the emerge sampler: the model's own `emerge_schedule` when it names one (a text-to-image
    MMaDA: cosine, MaskGRPO's image pace), else cosine when its process schedule is cosine, else linear."""
    view = model_view(model)
    if view.emerge_schedule is not None:
        return EMERGE_SCHEDULES[view.emerge_schedule]
    process = view.process
    name = process.schedule.name if isinstance(process, ScheduledProcess) else ""
    return EMERGE_SCHEDULES[EMERGE_SCHEDULE_FOR_PROCESS.get(name, "linear")]


def commit_rule(cfg: Any, sampler: str, gen_length: int, block_length: int, model: Any,
                key: str = "rollout") -> CommitRule:
    """The rule of the settings that MaskedSettings / EmergeSettings accepted: emerge's pace for the emerge
    sampler (its released layout under rng=released, for a model with image completions), else SDAR's dynamic rule,
    threshold or factor decoding, or LLaDA's fixed counts. key: how errors name the settings."""
    spb = lambda: steps_per_block(cfg.steps, gen_length, block_length)  # noqa: E731  (only where steps count)
    if sampler == "emerge" and getattr(cfg, "rng", "ddrl") == RELEASED:  # MaskGRPO's t2i draws (ddrl.sampling.released)
        return ReleasedEmergeRule(spb(), check_released_model(model, key))
    if sampler == "emerge":
        return EmergeRule(spb(), emerge_mask_fraction(model))
    if cfg.remasking == "sdar_dynamic":
        return DynamicRule(spb(), float(cfg.threshold), block_length)
    if cfg.threshold is not None:
        return ThresholdRule(float(cfg.threshold))
    if getattr(cfg, "factor", None) is not None:
        return FactorRule(float(cfg.factor))
    return FixedCountRule(spb())
