"""Masked-diffusion samplers: LLaDA's semi-autoregressive low-confidence sampler, confidence-threshold
parallel decoding, MaskGRPO's ancestral "emerge" sampler and block-diffusion decoding.

**generate()** is LLaDA's reference `generate()` (Nie et al. 2025, "Large Language Diffusion Models";
docs/diffusion.md#low-confidence-sampler), batched. The completion starts as gen_length masks and
is decoded in blocks of block_length, left to right, with spb = steps // num_blocks model calls per
block. In a block with n masked positions, step s commits k_s = n // spb tokens, one more in the
first n % spb steps:

    logits = model([prompt, completion]).logits        # guided: un + (w+1)(cond - un) if cfg_scale=w > 0
    x0     = argmax(logits - tau * log(-log U))         # Gumbel-max: x0 ~ softmax(logits / tau); tau=0: argmax
    conf   = softmax(logits)[x0]  ("low_confidence")  or  U' ~ U(0, 1)  ("random")
    commit the k_s still-masked positions of the block with the highest conf: completion[pos] = x0[pos]

With temperature 0 and low-confidence remasking the tokens are the reference's, exactly (the test
compares with a plain per-row transcription). Where this code differs from the reference:
  (a) Gumbel-max in log space (utils.gumbel_argmax): the same draw, without exp() overflow.
  (b) Noise is drawn only for the current block, from the explicit generator, for all rows at
      every step, so a row's samples never depend on the other rows (nor on which have finished).
  (c) Only positions of the current block are committed. The reference also lets [MASK] tokens
      that a user typed inside the prompt compete for the block's commits; here a prompt is given.
  (d) Equal confidences go to the leftmost position (stable sort); the reference leaves ties to
      torch.topk. They occur at p = 1.0 in float64, e.g. on runs of trailing EOS.
  (e) generate() never early-exits; the registry samplers may (see below).

**Threshold decoding** (Fast-dLLM, Wu et al. 2025; docs/diffusion.md#threshold-decoding), when
threshold is set: at each step commit every masked position of the current block whose confidence
is >= threshold, and always the single most confident one; a block ends when it has no mask left,
so the number of model calls adapts to the model's confidence (at most block_length per block) and
`steps` is not used.
**Factor decoding** (the paper's variant, when factor f is set): with c_(1) >= c_(2) >= ... the
confidences of the block's masked positions, commit the n most confident for the largest n with
(n + 1)(1 - c_(n)) < f, at least one. Like threshold decoding, a block runs until it is full.

**KV cache** (rollout.cache; ddrl.sampling.cache has the details): "none" runs the whole sequence
every step (the reference); "prefix"/"dual" are Fast-dLLM's approximate block caches for
full-attention models; on block-causal models every setting but "none" is the exact cache of the
prompt and the finished blocks; "auto" is that exact cache where it is exact and "none" elsewhere.
The cache changes where the logits come from, nothing else: the commit rules, noise, early exit
and the trajectory record below are the same for every setting.

**"emerge"** (MaskGRPO's ancestral sampler, Ma et al. 2025; docs/diffusion.md#emerge-sampler):
with mask fraction k(tau) and T steps per block, at step s (k_t = k(s/T), k_s = k((s+1)/T)) every
masked token independently becomes a draw from softmax(logits / temperature) (argmax at
temperature 0) with probability (k_t - k_s) / k_t, else stays masked; the last step fills every
remaining mask. The number of tokens per step is random, unlike LLaDA's fixed counts. k is linear
(1 - tau) or MaskGRPO's cosine cos(pi tau / 2), picked by EMERGE_SCHEDULE_FOR_PROCESS from the
model's process schedule. Note that "cosine" here is MaskGIT's pace, not the MDLM cosine alpha(t)
of ddrl.processes.schedules: a masked denoiser does not see t, so any pace gives valid samples; it
only decides when tokens appear.

**"block"** (SDAR/TraDo block diffusion; docs/diffusion.md#block-diffusion): the masked sampler
with block_length = model.block_size for block-causal models, threshold decoding when
rollout.threshold is set, SDAR's dynamic rule with remasking="sdar_dynamic". Blocks follow SDAR's
layout (ddrl.processes.block: block = position // block_size, prompt included), the layout every
estimator and block pretraining use; a row whose prompt ends inside a block first finishes that
block, so its completion is shifted by n_prompt % block_size empty slots inside the loop
(ddrl.sampling.cache) and may span one block more. Steps per block = steps / ceil(gen_length / block_length). The sampler passes the layout's
attention mask explicitly, for every row whatever its prompt length.

**Early exit** (registry samplers, rollout.early_exit): after a block is finished, a row whose
completion so far contains a stop token (model.stop_token_ids: the EOS, or a chat checkpoint's
end of turn such as <|im_end|>) has its remaining blocks filled with EOS and takes no further part
in decoding; the loop stops when every row is done. Tokens up to a row's first stop token are the
ones it would get without early exit (same noise, see (b)). Within a block, a row whose
block has no mask left sits out the block's remaining steps (threshold decoding finishes rows at
different steps); its tokens cannot change.
**Static shapes**: a finished row or one sitting a step out stays in the batch. Every model call
of a generation is fed all B rows (2B under guidance), at shapes that depend only on the block and
step, and the KV caches live in buffers allocated once (ddrl.sampling.cache); the rows that are not
live are masked: nothing of theirs is committed and their recorded probabilities stay NaN. This is
what CUDA graphs / torch.compile need and saves the copy of the whole cache when rows finish; the
price is compute on rows whose results are thrown away (forward_tokens counts every row fed).

**Trajectory** (return_trajectory=True), recorded from the logits already computed, no extra call:
  commit_step [B, L]  global 0-based step (model call) at which each completion position was
                      committed; -1 for positions filled with EOS by early exit.
  token_probs [B, S, L]  softmax(logits)[final token], the model's (guided, temperature-1)
                      probability at step s of the token finally committed at the position:
                        * exact for every step of the block the position belongs to, up to its commit;
                        * after the commit step: the value at the commit step (Trajectory contract);
                        * steps before the position's block started: NaN (not recorded, see below);
                        * positions filled by early exit: NaN.
  The final token of a position is known only when it is committed, so exact values for earlier
  steps need that step's whole distribution. Keeping it for every position at every step would cost
  O(S * B * L * V); we keep it only for the block being decoded, as float32 [B, block_length, V] per
  step, and gather it when the block closes: peak extra memory spb * B * block_length * V * 4 bytes
  (LLaDA, 6 rows, block 32, 16 steps per block: ~1.5 GB on the GPU; the emerge sampler's block is the
  whole completion by default), freed after each block; the result is O(B * S * L).
  step_times [S] (emerge only): 1 - s/T, the diffusion time entering each step of its block.
  states: None.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

from ddrl.data import as_stop_ids, is_stop, model_stop_ids
from ddrl.registry import SAMPLERS
from ddrl.sampling.base import SampleOutput
from ddrl.sampling.cache import CACHE_MODES, block_forward
from ddrl.sampling.sdar import commit_dynamic, tempered_confidence
from ddrl.sampling.utils import RowNoise, gumbel_argmax
from ddrl.types import Trajectory

if TYPE_CHECKING:  # sampling imports only torch at run time (docs/architecture.md#dependency-direction)
    from ddrl.config import SamplerConfig

REMASKING = ("low_confidence", "random", "sdar_dynamic")

# Mask fraction k(tau) of the emerge sampler at reverse progress tau in [0, 1] (1 = all masked at tau = 0).
EMERGE_SCHEDULES: dict[str, Callable[[float], float]] = {
    "linear": lambda tau: 1.0 - tau,
    "cosine": lambda tau: math.cos(0.5 * math.pi * tau),  # MaskGRPO / MaskGIT image sampler
}
# Which emerge pace a model gets, by the name of its process schedule; anything else gets "linear".
EMERGE_SCHEDULE_FOR_PROCESS: dict[str, str] = {"linear": "linear", "cosine": "cosine"}


# --------------------------------------------------------------------------------------------
# Commit rules: how many / which masked positions of the current block a step commits
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


class _FixedCountRule:
    """LLaDA: steps_per_block steps per block, transfer_counts() commits per step, top-k by confidence."""

    uses_confidence = True

    def __init__(self, steps_per_block: int):
        self.steps_per_block = steps_per_block
        self.counts: Tensor | None = None

    def begin_block(self, masked: Tensor) -> None:
        self.counts = transfer_counts(masked.sum(dim=1), self.steps_per_block)  # [B, spb]

    def more_steps(self, step: int, masked: Tensor) -> bool:
        return step < self.steps_per_block

    def choose(self, step: int, confidence: Tensor, masked: Tensor, noise: RowNoise) -> Tensor:
        return commit_top_k(confidence, self.counts[:, step])

    def step_time(self, step: int) -> float | None:
        return None


class _ThresholdRule:
    """Fast-dLLM: commit everything at least `threshold` confident (at least one), until the block is full."""

    uses_confidence = True

    def __init__(self, threshold: float):
        self.threshold = threshold

    def begin_block(self, masked: Tensor) -> None:
        pass

    def more_steps(self, step: int, masked: Tensor) -> bool:
        return bool(masked.any())

    def choose(self, step: int, confidence: Tensor, masked: Tensor, noise: RowNoise) -> Tensor:
        return commit_above_threshold(confidence, masked, self.threshold)

    def step_time(self, step: int) -> float | None:
        return None


class _DynamicRule(_FixedCountRule):
    """SDAR's low_confidence_dynamic (ddrl.sampling.sdar): each step's count k comes from the block
    length, as in SDAR's get_num_transfer_tokens, whatever is still masked; commit the masked
    positions above threshold if there are at least k, else the k most confident. A block ends when
    it has no mask left (SDAR breaks out; it does not run LLaDA's trailing no-op steps)."""

    def __init__(self, steps_per_block: int, threshold: float, block_length: int):
        super().__init__(steps_per_block)
        self.threshold, self.block_length = threshold, block_length

    def begin_block(self, masked: Tensor) -> None:
        full = torch.full((masked.shape[0],), self.block_length, dtype=torch.long, device=masked.device)
        self.counts = transfer_counts(full, self.steps_per_block)  # [B, spb]

    def more_steps(self, step: int, masked: Tensor) -> bool:
        return step < self.steps_per_block and bool(masked.any())

    def choose(self, step: int, confidence: Tensor, masked: Tensor, noise: RowNoise) -> Tensor:
        return commit_dynamic(confidence, masked, self.threshold, self.counts[:, step])


class _FactorRule(_ThresholdRule):
    """Fast-dLLM's factor variant: commit_by_factor at each step, until the block is full."""

    def __init__(self, factor: float):
        self.factor = factor

    def choose(self, step: int, confidence: Tensor, masked: Tensor, noise: RowNoise) -> Tensor:
        return commit_by_factor(confidence, masked, self.factor)


class _EmergeRule:
    """MaskGRPO: each masked token appears with probability (k_t - k_s) / k_t; the last step fills all."""

    uses_confidence = False

    def __init__(self, steps_per_block: int, mask_fraction: Callable[[float], float]):
        self.steps_per_block = steps_per_block
        self.mask_fraction = mask_fraction

    def begin_block(self, masked: Tensor) -> None:
        pass

    def more_steps(self, step: int, masked: Tensor) -> bool:
        return step < self.steps_per_block

    def choose(self, step: int, confidence: Tensor | None, masked: Tensor, noise: RowNoise) -> Tensor:
        T = self.steps_per_block
        if step == T - 1:  # k(1) is 0 only up to rounding (cos(pi/2) = 6e-17): fill explicitly
            return masked
        k_t, k_s = self.mask_fraction(step / T), self.mask_fraction((step + 1) / T)
        return masked & (noise(masked.shape[1]) < (k_t - k_s) / k_t)

    def step_time(self, step: int) -> float | None:
        return 1.0 - step / self.steps_per_block


# --------------------------------------------------------------------------------------------
# Trajectory bookkeeping
# --------------------------------------------------------------------------------------------


class _ProbRecorder:
    """Keeps the current block's per-step distributions until its final tokens are known (see module doc)."""

    def __init__(self) -> None:
        self.buffer: list[Tensor] = []  # per step of the current block: [A, W, V] float32
        self.blocks: list[tuple[Tensor, int, int, Tensor]] = []  # (rows, start, first step, [A, n, W])
        self.times: list[float | None] = []

    def add_step(self, probs: Tensor, time: float | None, live: Tensor) -> None:
        """probs [A, W, V] of every row, live [A] bool. A row that is not live records NaN: one
        sitting the step out has its whole block committed already (its entries are replaced by
        the commit-step values later), a finished row has no entry at all (filled by early exit)."""
        probs = probs.float()
        if not bool(live.all()):
            probs = probs.masked_fill(~live[:, None, None], float("nan"))
        self.buffer.append(probs)
        self.times.append(time)

    def close_block(self, rows: Tensor, start: int, first_step: int, final: Tensor) -> None:
        if not self.buffer:
            return
        index = final[..., None]  # [A, W, 1]
        gathered = torch.stack([p.gather(-1, index).squeeze(-1) for p in self.buffer], dim=1)  # [A, n, W]
        self.blocks.append((rows, start, first_step, gathered))
        self.buffer = []

    def trajectory(self, commit_step: Tensor, num_steps: int) -> Trajectory:
        B, L = commit_step.shape
        probs = torch.full((B, num_steps, L), float("nan"), device=commit_step.device)  # [B, S, L]
        for rows, start, first, gathered in self.blocks:
            n, W = gathered.shape[1:]
            probs[rows, first:first + n, start:start + W] = gathered
        at_commit = probs.gather(1, commit_step.clamp(min=0)[:, None, :])  # [B, 1, L]
        steps = torch.arange(num_steps, device=probs.device)[None, :, None]
        after_commit = (steps > commit_step[:, None, :]) & (commit_step >= 0)[:, None, :]  # [B, S, L]
        probs = torch.where(after_commit, at_commit, probs)
        times = None
        if self.times and all(t is not None for t in self.times):
            times = torch.tensor(self.times, dtype=torch.float32)
        return Trajectory(commit_step=commit_step, token_probs=probs, states=None, step_times=times)


# --------------------------------------------------------------------------------------------
# The decoding loop shared by every sampler here
# --------------------------------------------------------------------------------------------


@dataclass
class _Decoded:
    completion: Tensor  # [B, L] long
    trajectory: Trajectory | None
    nfe: int  # model calls (a CFG call of 2B rows counts once)
    forward_tokens: int  # rows x tokens fed to the model, summed over calls (the cost the cache cuts)


@dataclass
class _Settings:
    temperature: float
    cfg_scale: float
    remasking: str
    mask_id: int
    generator: torch.Generator | None
    top_k: int = 0  # sdar_dynamic: top-k filter of the token distribution (0 = off)
    top_p: float = 1.0  # sdar_dynamic: nucleus filter (1 = off)


@torch.no_grad()
def _denoise(model, prompt_ids: Tensor, prompt_mask: Tensor | None, rule, settings: _Settings, *,
             gen_length: int, block_length: int, eos_id: int | Iterable[int] | None, record: bool,
             cache: str = "none") -> _Decoded:
    """Blocks left to right; inside a block, steps until `rule` says the block is done.

    eos_id: the stop token(s) of early exit, EOS first (the id finished rows are filled with); None = none.
    """
    stop_ids = as_stop_ids(eos_id)
    B, device = prompt_ids.shape[0], prompt_ids.device
    offsets = block_offsets(model, prompt_ids, prompt_mask)  # [B] or None (full attention / aligned prompts)
    width = gen_length + (0 if offsets is None else int(offsets.max()))  # completion slots W
    slots = None if offsets is None else completion_slots(offsets, gen_length, width)  # [B, W]
    forward = block_forward(model, prompt_ids, prompt_mask, cache=cache, block_length=block_length,
                            gen_length=width, cfg_scale=settings.cfg_scale, mask_id=settings.mask_id, slots=slots)
    completion = torch.full((B, width), settings.mask_id, dtype=torch.long, device=device)  # [B, W]
    commit_step = torch.full((B, width), -1, dtype=torch.long, device=device)  # [B, W]
    empty = torch.zeros_like(completion, dtype=torch.bool) if slots is None else ~slots  # never committed
    running = torch.ones(B, dtype=torch.bool, device=device)
    every = torch.arange(B, device=device)  # the batch never shrinks (module doc: static shapes)
    recorder = _ProbRecorder() if record else None
    nfe = 0
    for start in range(0, width, block_length):
        end = min(start + block_length, width)
        if not bool(running.any()):  # early exit: every row has its stop token
            break
        rule.begin_block(_still_masked(completion, empty, start, end, settings.mask_id))
        forward.begin_block(start, end)
        first_step, step = nfe, 0
        while rule.more_steps(step, masked := _still_masked(completion, empty, start, end, settings.mask_id)):
            # Live rows: those with a mask left in the block (threshold decoding finishes rows at
            # different steps); when none has one (LLaDA's trailing no-op steps), and at a block's
            # first step, every running row. Every row is fed to the model all the same; the others'
            # results are discarded: they have no mask in the window (finished rows are EOS-filled),
            # so nothing of theirs is committed, and their recorded probabilities stay NaN.
            live = masked.any(dim=1) & running  # [B]
            if step == 0 or not live.any():
                live = running
            noise = RowNoise(settings.generator, B, every, device)
            logits = forward.block_logits(step, completion)  # [B, W, V]
            window, committed = _step(logits, completion[:, start:end], masked & live[:, None], rule, step,
                                      settings, noise, live, recorder)
            completion[:, start:end] = window
            commit_step[:, start:end] = torch.where(committed, nfe, commit_step[:, start:end])
            nfe, step = nfe + 1, step + 1
        if recorder is not None:
            recorder.close_block(every, start, first_step, completion[:, start:end])
        if stop_ids:
            done = (is_stop(completion[:, :end], stop_ids) & ~empty[:, :end]).any(dim=1)  # [B]
            completion[done, end:] = stop_ids[0]
            running = ~done
    trajectory = recorder.trajectory(commit_step, nfe) if recorder is not None else None
    if offsets is not None:  # back to each row's own gen_length tokens
        take = offsets[:, None] + torch.arange(gen_length, device=device)[None, :]  # [B, L]
        completion = completion.gather(1, take)
        if trajectory is not None:
            trajectory = Trajectory(commit_step=trajectory.commit_step.gather(1, take),
                                    token_probs=trajectory.token_probs.gather(
                                        2, take[:, None, :].expand(-1, trajectory.token_probs.shape[1], -1)),
                                    states=None, step_times=trajectory.step_times)
    return _Decoded(completion, trajectory, nfe, forward.forward_tokens)


def _still_masked(completion: Tensor, empty: Tensor, start: int, end: int, mask_id: int) -> Tensor:
    """[B, W] bool: the window's slots that are still masked (empty slots never are)."""
    return (completion[:, start:end] == mask_id) & ~empty[:, start:end]


def block_offsets(model, prompt_ids: Tensor, prompt_mask: Tensor | None) -> Tensor | None:
    """[B] empty slots before each row's completion on a block-causal model: n_prompt % block_size
    (ddrl.sampling.cache module doc); None when the model has full attention or every offset is 0."""
    block_size = getattr(model, "block_size", None)
    if not block_size:
        return None
    B, P = prompt_ids.shape
    n_prompt = (prompt_mask.long().sum(dim=1) if prompt_mask is not None
                else torch.full((B,), P, dtype=torch.long, device=prompt_ids.device))
    offsets = n_prompt % int(block_size)
    return offsets if bool(offsets.any()) else None


def completion_slots(offsets: Tensor, gen_length: int, width: int) -> Tensor:
    """[B, width] bool: slot j of row i holds completion token j - offsets[i] (True) or is empty."""
    j = torch.arange(width, device=offsets.device)[None, :]
    return (j >= offsets[:, None]) & (j < offsets[:, None] + gen_length)


def _step(logits: Tensor, window: Tensor, masked: Tensor, rule, step: int, settings: _Settings, noise: RowNoise,
          live: Tensor, recorder: _ProbRecorder | None) -> tuple[Tensor, Tensor]:
    """The block's logits [B, W, V], tokens [B, W] and still-masked slots [B, W] (none in a row that
    is not live, live: [B] bool) -> (new tokens [B, W], committed this step [B, W])."""
    s = settings
    if not 0 <= s.mask_id < logits.shape[-1]:
        raise ValueError(f"mask_id={s.mask_id} is outside the model's vocabulary [0, {logits.shape[-1]}); "
                         f"pass the model's mask token id (model.mask_token_id)")
    uniforms = noise(*logits.shape[1:]) if s.temperature > 0 else None  # [B, W, V]
    if s.remasking == "sdar_dynamic":  # SDAR's candidate and confidence: the filtered, tempered softmax
        x0, sdar_confidence = tempered_confidence(logits, s.temperature, s.top_k, s.top_p, uniforms=uniforms)
    else:
        x0 = gumbel_argmax(logits, s.temperature, uniforms)  # [B, W]
    # Confidences in float64 as in the reference: float32 ties and rounding would reorder commits.
    want_probs = recorder is not None or (rule.uses_confidence and s.remasking == "low_confidence")
    probs = torch.softmax(logits.double(), dim=-1) if want_probs else None  # [B, W, V]
    confidence = None
    if rule.uses_confidence:
        if s.remasking == "sdar_dynamic":
            confidence = sdar_confidence
        elif s.remasking == "low_confidence":
            confidence = probs.gather(-1, x0[..., None]).squeeze(-1)
        else:
            confidence = noise(masked.shape[1])
        confidence = confidence.masked_fill(~masked, float("-inf"))  # committed positions never move
    committed = rule.choose(step, confidence, masked, noise) & masked
    if recorder is not None:
        recorder.add_step(probs, rule.step_time(step), live)
    return torch.where(committed, x0, window), committed


# --------------------------------------------------------------------------------------------
# Input checks (before any model call)
# --------------------------------------------------------------------------------------------


def _model_attr(model, name: str):
    value = getattr(model, name, None)
    if value is None:
        value = getattr(getattr(model, "config", None), name, None)
    return value


def _check_inputs(model, prompt_ids: Tensor, attention_mask: Tensor | None, *, gen_length: int, block_length: int,
                  temperature: float, cfg_scale: float, remasking: str, mask_id: int) -> None:
    integer = isinstance(prompt_ids, Tensor) and prompt_ids.dtype in (torch.int64, torch.int32)
    if not integer or prompt_ids.dim() != 2:
        raise ValueError(f"prompt_ids must be a [B, P] integer tensor of token ids, got "
                         f"{getattr(prompt_ids, 'dtype', type(prompt_ids))} {list(getattr(prompt_ids, 'shape', []))}")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(prompt_ids.shape):
        raise ValueError(f"attention_mask must have prompt_ids' shape {list(prompt_ids.shape)} (1 = real token, "
                         f"0 = left padding), got {list(attention_mask.shape)}")
    for name, value in (("gen_length", gen_length), ("block_length", block_length)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    # A block model's blocks follow positions (ddrl.processes.block), so its completion need not be
    # whole blocks: SDAR decodes up to a block boundary of prompt + completion.
    if gen_length % block_length and not getattr(model, "block_size", None):
        raise ValueError(f"gen_length={gen_length} is not divisible by block_length={block_length}; "
                         f"pick a block_length that divides gen_length")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if cfg_scale < 0:
        raise ValueError(f"cfg_scale must be >= 0 (0 = no guidance), got {cfg_scale}")
    if remasking not in REMASKING:
        raise ValueError(f"remasking={remasking!r} is not valid; choose one of: {', '.join(REMASKING)}")
    vocab_size = _model_attr(model, "vocab_size")
    if not isinstance(mask_id, int) or mask_id < 0 or (vocab_size is not None and mask_id >= vocab_size):
        raise ValueError(f"mask_id={mask_id!r} is outside the model's vocabulary [0, {vocab_size or 'V'}); "
                         f"pass the model's mask token id (model.mask_token_id)")
    max_len = _model_attr(model, "max_seq_len")
    if max_len is not None and prompt_ids.shape[1] + gen_length > max_len:
        raise ValueError(f"prompt length {prompt_ids.shape[1]} + gen_length={gen_length} exceeds the model's "
                         f"max_seq_len={max_len}; shorten the prompt or lower gen_length")
    if getattr(model, "logits_shifted", False) and prompt_ids.shape[1] == 0:
        raise ValueError("a model with shifted logits (Dream) needs at least one prompt token; pass a non-empty prompt")


def _check_steps(steps: int, gen_length: int, block_length: int) -> int:
    """-> steps per block (a completion of a block model that is not whole blocks counts its last one)."""
    num_blocks = -(-gen_length // block_length)
    if not isinstance(steps, int) or steps <= 0:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if steps % num_blocks:
        raise ValueError(f"steps={steps} is not divisible by the number of blocks (gen_length/block_length = "
                         f"{num_blocks}); use a multiple of {num_blocks}")
    return steps // num_blocks


def _check_generator(generator: torch.Generator | None, needs_noise: bool, why: str) -> None:
    if needs_noise and generator is None:
        raise ValueError(f"generator is required when {why} (ddrl never uses the global RNG); "
                         f"pass generator=torch.Generator(device).manual_seed(seed)")


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def generate(model, prompt_ids: Tensor, attention_mask: Tensor | None = None, *, steps: int, gen_length: int,
             block_length: int, temperature: float = 0.0, cfg_scale: float = 0.0, remasking: str = "low_confidence",
             mask_id: int, threshold: float | None = None, generator: torch.Generator | None = None,
             return_trajectory: bool = False, factor: float | None = None, cache: str = "none",
             top_k: int | None = None, top_p: float | None = None) -> Tensor | tuple[Tensor, Trajectory]:
    """LLaDA's semi-autoregressive sampler (module doc), batched.

    prompt_ids      [B, P] long, left-padded; attention_mask [B, P] (1 = real token) or None (none is
                    passed to the model). The model receives [B, P + gen_length] with ones on the completion.
    steps           steps // ceil(gen_length / block_length) model calls per block (the total on a
                    full-attention model; on a block model whose prompt ends inside a block the
                    completion spans one block more, each with as many calls); ignored when threshold
                    or factor is set (each block then runs until it is full, at most block_length calls).
    threshold       None: LLaDA's fixed counts. In [0, 1]: Fast-dLLM threshold decoding.
    generator       required when temperature > 0 or remasking == "random".
    factor          Fast-dLLM's factor-based parallel decoding (module doc), > 0; excludes threshold.
    cache           "none" (LLaDA's reference) | "prefix" | "dual" | "auto" (ddrl.sampling.cache).
    remasking       "low_confidence" | "random" | "sdar_dynamic" (SDAR's rule, with threshold =
                    its confidence_threshold and top_k / top_p filtering the token distribution).
    Returns the full sequence [B, P + gen_length] (prompt + completion), and the Trajectory when
    return_trajectory=True. Never early-exits. With the defaults (threshold, factor None, cache
    "none") these are the reference's tokens.
    """
    _check_inputs(model, prompt_ids, attention_mask, gen_length=gen_length, block_length=block_length,
                  temperature=temperature, cfg_scale=cfg_scale, remasking=remasking, mask_id=mask_id)
    rule = _commit_rule(steps, gen_length, block_length, threshold, factor, "", remasking)
    _check_cache(cache, "cache")
    _check_generator(generator, temperature > 0 or remasking == "random", "temperature > 0 or remasking='random'")
    mask = None if attention_mask is None else attention_mask.bool()
    out = _denoise(model, prompt_ids, mask, rule,
                   _Settings(float(temperature), float(cfg_scale), remasking, mask_id, generator, top_k or 0,
                             1.0 if top_p is None else float(top_p)),
                   gen_length=gen_length, block_length=block_length, eos_id=None, record=return_trajectory,
                   cache=cache)
    sequence = torch.cat([prompt_ids, out.completion.to(prompt_ids.dtype)], dim=1)  # [B, P + L]
    return (sequence, out.trajectory) if return_trajectory else sequence


def _model_mask_id(model) -> int:
    mask_id = getattr(model, "mask_token_id", None)
    if mask_id is None:
        raise ValueError("model.mask_token_id is None; masked-diffusion samplers need the model's mask token "
                         "(set mask_token_id in the model config)")
    return int(mask_id)


def _check_cache(cache: str, key: str) -> None:
    if cache not in CACHE_MODES:
        raise ValueError(f"{key}={cache!r} is not valid; choose one of: {', '.join(CACHE_MODES)}")


def _commit_rule(steps: int, gen_length: int, block_length: int, threshold: float | None, factor: float | None,
                 prefix: str, remasking: str = "low_confidence"):
    """LLaDA's fixed counts, threshold / factor decoding, or SDAR's dynamic rule (module doc)."""
    if remasking == "sdar_dynamic":
        if threshold is None or factor is not None or not 0.0 <= threshold <= 1.0:
            raise ValueError(f"{prefix}remasking='sdar_dynamic' needs {prefix}threshold in [0, 1] (SDAR's "
                             f"confidence_threshold, e.g. 0.9) and no {prefix}factor, got threshold={threshold}, "
                             f"factor={factor}")
        return _DynamicRule(_check_steps(steps, gen_length, block_length), float(threshold), block_length)
    if threshold is not None and factor is not None:
        raise ValueError(f"{prefix}threshold={threshold} and {prefix}factor={factor} are two parallel-decoding "
                         f"rules; set only one of them")
    if threshold is not None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"{prefix}threshold must be in [0, 1] (0.9 is typical) or None for fixed counts, "
                             f"got {threshold}")
        return _ThresholdRule(float(threshold))
    if factor is not None:
        if not factor > 0:
            raise ValueError(f"{prefix}factor must be > 0 (Fast-dLLM's f, e.g. 1.0) or None, got {factor}")
        return _FactorRule(float(factor))
    return _FixedCountRule(_check_steps(steps, gen_length, block_length))


def _sample_semi_ar(model, prompt_ids: Tensor, prompt_mask: Tensor | None, cfg: SamplerConfig, block_length: int,
                    generator: torch.Generator | None, return_trajectory: bool) -> SampleOutput:
    """The masked and block samplers: generate() with the config's fields, plus early exit."""
    mask_id = _model_mask_id(model)
    _check_inputs(model, prompt_ids, prompt_mask, gen_length=cfg.gen_length, block_length=block_length,
                  temperature=cfg.temperature, cfg_scale=cfg.cfg_scale, remasking=cfg.remasking, mask_id=mask_id)
    # `factor` is read if the config has it (SamplerConfig has no such field yet; a SimpleNamespace or a
    # subclass can carry it), so that the rule is selectable from a config without a second code path.
    rule = _commit_rule(cfg.steps, cfg.gen_length, block_length, cfg.threshold, getattr(cfg, "factor", None),
                        "rollout.", cfg.remasking)
    _check_cache(cfg.cache, "rollout.cache")
    _check_generator(generator, cfg.temperature > 0 or cfg.remasking == "random",
                     "rollout.temperature > 0 or rollout.remasking=random")
    eos_id = model_stop_ids(model) if cfg.early_exit else None
    out = _denoise(model, prompt_ids, None if prompt_mask is None else prompt_mask.bool(), rule,
                   _Settings(cfg.temperature, cfg.cfg_scale, cfg.remasking, mask_id, generator,
                             getattr(cfg, "top_k", None) or 0, getattr(cfg, "top_p", None) or 1.0),
                   gen_length=cfg.gen_length, block_length=block_length, eos_id=eos_id, record=return_trajectory,
                   cache=cfg.cache)
    return SampleOutput(completion_ids=out.completion, trajectory=out.trajectory, nfe=out.nfe,
                        forward_tokens=out.forward_tokens)


@SAMPLERS.register("masked")
def sample_masked(model, prompt_ids: Tensor, prompt_mask: Tensor | None, cfg: SamplerConfig, *,
                  generator: torch.Generator | None, return_trajectory: bool = False) -> SampleOutput:
    """LLaDA semi-AR sampling (threshold decoding when cfg.threshold is set), completion only [B, L].

    block_length None = gen_length (one block); mask id = model.mask_token_id; early exit on
    model.stop_token_ids when cfg.early_exit.
    """
    block_length = cfg.block_length or cfg.gen_length
    return _sample_semi_ar(model, prompt_ids, prompt_mask, cfg, block_length, generator, return_trajectory)


@SAMPLERS.register("block")
def sample_block(model, prompt_ids: Tensor, prompt_mask: Tensor | None, cfg: SamplerConfig, *,
                 generator: torch.Generator | None, return_trajectory: bool = False) -> SampleOutput:
    """Block diffusion (SDAR style): the masked sampler with block_length = model.block_size."""
    block_size = getattr(model, "block_size", None)
    if block_size is None:
        raise ValueError("the 'block' sampler needs a block-causal model, but model.block_size is None; "
                         "build the model with model.block_size set, or use rollout.name=masked for "
                         "full-attention models")
    if cfg.block_length is not None and cfg.block_length != block_size:
        raise ValueError(f"rollout.block_length={cfg.block_length} differs from model.block_size={block_size}; "
                         f"leave rollout.block_length unset for the block sampler")
    return _sample_semi_ar(model, prompt_ids, prompt_mask, cfg, int(block_size), generator, return_trajectory)


def emerge_mask_fraction(model) -> Callable[[float], float]:
    """k(tau) for the emerge sampler: cosine when the model's process schedule is cosine, else linear."""
    schedule = getattr(getattr(model, "process", None), "schedule", None)
    name = schedule if isinstance(schedule, str) else getattr(schedule, "name", None)
    return EMERGE_SCHEDULES[EMERGE_SCHEDULE_FOR_PROCESS.get(name, "linear")]


@SAMPLERS.register("emerge")
def sample_emerge(model, prompt_ids: Tensor, prompt_mask: Tensor | None, cfg: SamplerConfig, *,
                  generator: torch.Generator | None, return_trajectory: bool = False) -> SampleOutput:
    """MaskGRPO's ancestral "emerge" sampler (module doc), completion only [B, L].

    cfg.steps model calls, split evenly over blocks of cfg.block_length (None = one block, as in
    MaskGRPO); cfg.cfg_scale w gives (1 + w) cond - w uncond; cfg.remasking is not used.
    """
    _check_cache(cfg.cache, "rollout.cache")
    if cfg.threshold is not None or getattr(cfg, "factor", None) is not None:
        raise ValueError("rollout.threshold and rollout.factor apply to the masked and block samplers; the emerge "
                         "sampler unmasks at random by its schedule, so unset them")
    mask_id = _model_mask_id(model)
    block_length = cfg.block_length or cfg.gen_length
    _check_inputs(model, prompt_ids, prompt_mask, gen_length=cfg.gen_length, block_length=block_length,
                  temperature=cfg.temperature, cfg_scale=cfg.cfg_scale, remasking="low_confidence", mask_id=mask_id)
    steps_per_block = _check_steps(cfg.steps, cfg.gen_length, block_length)
    _check_generator(generator, cfg.temperature > 0 or steps_per_block > 1,
                     "the emerge sampler draws which tokens appear (steps per block > 1) or rollout.temperature > 0")
    eos_id = model_stop_ids(model) if cfg.early_exit else None
    rule = _EmergeRule(steps_per_block, emerge_mask_fraction(model))
    out = _denoise(model, prompt_ids, None if prompt_mask is None else prompt_mask.bool(), rule,
                   _Settings(cfg.temperature, cfg.cfg_scale, "low_confidence", mask_id, generator),
                   gen_length=cfg.gen_length, block_length=block_length, eos_id=eos_id, record=return_trajectory,
                   cache=cfg.cache)
    return SampleOutput(completion_ids=out.completion, trajectory=out.trajectory, nfe=out.nfe,
                        forward_tokens=out.forward_tokens)
