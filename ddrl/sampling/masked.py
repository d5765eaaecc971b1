"""Masked-diffusion samplers: LLaDA's semi-autoregressive low-confidence sampler, confidence-threshold
parallel decoding, MaskGRPO's ancestral "emerge" sampler and block-diffusion decoding: one decoding
loop (`_denoise`) behind one entry (`_run`) for generate() and the masked, block and emerge samplers.
Which positions a step commits is ddrl.sampling.commit; where the logits come from (KV caches) is
ddrl.sampling.cache; the trajectory record is ddrl.sampling.trajectory; the settings each sampler
reads are its class here (MaskedSettings, BlockSettings, EmergeSettings: ddrl.sampling.settings).

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
  (b) Noise is drawn on the model's device in float32 (rollout.noise_dtype; the reference: float64),
      only for the current block, keyed by (block, step) from each chunk of rows' own seed
      (utils.StepNoise), so a row's samples never depend on the other rows, on which have finished,
      or on how many steps their blocks took.
  (c) Only positions of the current block are committed. The reference also lets [MASK] tokens
      that a user typed inside the prompt compete for the block's commits; here a prompt is given.
  (d) Equal confidences go to the leftmost position (stable sort); the reference leaves ties to
      torch.topk. They occur at p = 1.0 in float64, e.g. on runs of trailing EOS.
  (e) generate() never early-exits; the registry samplers may (see below).
  (f) conf is float64 from float32 exponentials (utils.chosen_probability): no float64 copy of the
      [B, W, V] logits; within ~1e-7 of the reference's float64 softmax.

**Threshold / factor decoding** (Fast-dLLM, Wu et al. 2025; docs/diffusion.md#threshold-decoding):
when threshold is set, each step commits every masked position of the current block whose
confidence is >= threshold, and always the single most confident one; with factor f, the n most
confident for the largest n with (n + 1)(1 - c_(n)) < f. A block ends when it has no mask left, so
the number of model calls adapts to the model's confidence (at most block_length per block) and
`steps` is not used.

**KV cache** (rollout.cache; ddrl.sampling.cache has the details): "none" runs the whole sequence
every step (the reference); "prefix"/"dual" are Fast-dLLM's approximate block caches for
full-attention models; on block-causal models every setting but "none" is the exact cache of the
prompt and the finished blocks; "auto" is that exact cache where it is exact and "none" elsewhere.
The cache changes where the logits come from, nothing else: the commit rules, noise, early exit
and the trajectory record are the same for every setting.

**"emerge"** (MaskGRPO's ancestral sampler, Ma et al. 2025; docs/diffusion.md#emerge-sampler): every
masked token independently appears with probability (k_t - k_s) / k_t at each step of its block
(ddrl.sampling.commit), drawn from softmax(logits / temperature) (argmax at temperature 0); the last
step fills every remaining mask. rollout.rng=released (image completions only) draws the appearance
and the token together as MaskGRPO's image rollouts do, so that a seed gives their tokens
(ddrl.sampling.released; it replaces (b): one stream per chunk of rows, torch.multinomial's host
check each step). On an image model (utils.codebook_range: a text-to-image MMaDA) the emerge sampler asks
the model for the codebook's logits only ([B, W, C] through class_range, C = 8,192 of MMaDA-8B's 134,656
ids: no [B, W, V] logits and suppressed copy, twice under guidance) and returns vocabulary ids. A seed's
tokens are those of full-vocabulary logits: every other id's logit is SUPPRESSED_LOGIT there, whose
exponential is 0 in float32, so the softmax is the same; ddrl's layout still draws its Gumbel uniforms
over [B, W, V] (its noise is keyed per chunk, block and step over that shape: a [B, W, C] draw would be
another stream, other tokens) and reads them at the codebook's ids.

**"block"** (SDAR/TraDo block diffusion; docs/diffusion.md#block-diffusion): the masked sampler
with block_length = model.block_size for block-causal models, threshold decoding when
rollout.threshold is set, SDAR's dynamic rule with remasking="sdar_dynamic". Blocks follow SDAR's
layout (ddrl.processes.block: block = position // block_size, prompt included), the layout every
estimator and block pretraining use; a row whose prompt ends inside a block first finishes that
block, so its completion is shifted by n_prompt % block_size empty slots inside the loop
(ddrl.sampling.cache) and may span one block more. The model always sees whole blocks, as SDAR
decodes them (JetAstra/SDAR generate.py `block_diffusion_generate`: total_length = ceil((P + L) /
block_size) * block_size): a row whose completion ends inside a block also decodes that block's
trailing slots past gen_length, mask tokens that the commit rule fills like any other, and they
are dropped at the end (`block_canvas`); each row returns its own gen_length tokens. With these
slots the greedy tokens equal SDAR's for every prompt and gen_length, not only when prompt +
gen_length ends on a block boundary (tests/unit/test_native_sdar.py). The estimators score the
same view (ddrl.processes.block.block_tail). Steps per block = steps / ceil(gen_length /
block_length). The sampler passes the layout's attention mask explicitly, for every row.

**Early exit** (registry samplers, rollout.early_exit): after a block is finished, a row whose
completion so far contains a stop token (model.stop_token_ids: the EOS, or a chat checkpoint's end
of turn such as <|im_end|>) has its remaining blocks filled with EOS and takes no further part in
decoding; the loop stops when every row is done. Tokens up to a row's first stop token are the
ones it would get without early exit (same noise, see (b)).

**Static shapes**: a finished row, or one whose block is already full (threshold decoding finishes
rows at different steps), stays in the batch. Every model call of a generation is fed all B rows
(2B under guidance), at shapes that depend only on the block and the step, and the KV caches live
in buffers allocated once (ddrl.sampling.cache); such rows have no mask left in the window, so
nothing of theirs is committed. This is what CUDA graphs / torch.compile need and saves the copy of
the whole cache when rows finish; the price is compute on rows whose results are thrown away
(forward_tokens counts every row fed).

**Host reads** (device syncs) left in the loop: per call, whether the prompt mask is all ones (one
read; then the model is given no mask), the noise seeds (one read, from the caller's generators:
no device sync for CPU generators) and the block layout of block models (block_canvas); per
block, whether every row has stopped (early exit); per step, only under threshold, factor or
sdar_dynamic decoding, whether the block still has a mask (commit.py: the next call depends on
it). Fixed counts and emerge read nothing per step, and neither do the native LLaDA and Dream
model calls nor ddrl.logits: their input checks are queued on the device (ddrl.ops.value_checks;
tests/unit/test_host_syncs.py counts the reads).

**Trajectory** (return_trajectory=True): commit_step [B, L], token_probs [B, S, L], step_times
(emerge); the contract and its memory cost are in ddrl.sampling.trajectory.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from ddrl.data import as_stop_ids, is_stop, model_stop_ids
from ddrl.contract import model_view
from ddrl.sampling.base import SampleOutput, model_mask_id
from ddrl.sampling.cache import CACHE_MODES, block_forward
from ddrl.sampling.checks import check_generator_given, check_prompts
from ddrl.sampling.commit import REMASKING, CommitRule, EmergeRule, commit_rule
from ddrl.sampling.released import RELEASED, RNG_LAYOUTS, ReleasedEmergeRule
from ddrl.sampling.sdar import tempered_confidence
from ddrl.sampling.settings import (OFF, REFUSED, GuidedSettings, TokenFilters, check_block_length, check_choice,
                                    check_threshold, no_cache, one_block, register_sampler)
from ddrl.sampling.trajectory import ProbRecorder, take_positions
from ddrl.types import COMMIT_ORDER
from ddrl.sampling.utils import NOISE_DTYPES, StepNoise, chosen_probability, codebook_range, gumbel_argmax
from ddrl.types import Trajectory


# --------------------------------------------------------------------------------------------
# The settings each sampler here reads (ddrl.sampling.settings)
# --------------------------------------------------------------------------------------------


@dataclass
class BlockwiseSettings(GuidedSettings):
    """What the block-by-block samplers share: blocks, the KV cache, compiled steps, the noise's dtype."""

    block_length: int | None = field(default=None, metadata={OFF: one_block})  # None = gen_length (one block)
    cache: str = field(default="auto", metadata={OFF: no_cache})  # none | prefix | dual | auto (ddrl.sampling.cache)
    compile: bool = False  # the decode step's model call under torch.compile (ddrl.sampling.cache)
    noise_dtype: str = "float32"  # the Gumbel uniforms' dtype: float32 | float64 (utils.StepNoise)

    def check(self, p: str, name: str, block_size: int | None) -> None:
        super().check(p, name, block_size)
        check_block_length(p, self.block_length)
        if not isinstance(self.compile, bool):
            raise ValueError(f"{p}compile must be true or false, got {self.compile!r}")
        if self.compile and self.cache == "prefix":  # ddrl.sampling.cache "Compiled steps"
            raise ValueError(f"{p}compile needs call shapes that do not change block by block, but {p}cache='prefix' "
                             f"feeds a shorter suffix every block (a recompile per block); use {p}cache=dual or auto")
        check_choice(p, "cache", self.cache, CACHE_MODES)
        check_choice(p, "noise_dtype", self.noise_dtype, tuple(NOISE_DTYPES))

    def counts_steps(self) -> bool:
        """Whether the commit rule divides `steps` over the blocks (else each block runs until it is full)."""
        return True

    def check_blocks(self, p: str, block: int, block_size: int | None) -> None:
        """Divisibility and steps per block, for sampler blocks of `block` tokens."""
        gen_length, steps, cache = self.gen_length, self.steps, self.cache
        # A block model's blocks follow positions (ddrl.processes.block), so its completion need not be
        # whole blocks: SDAR decodes up to a block boundary of prompt + completion.
        if not block_size and gen_length % block:
            raise ValueError(f"{p}gen_length={gen_length} is not divisible by {p}block_length={block}; "
                             f"pick a block_length that divides gen_length")
        num_blocks = -(-gen_length // block)
        if self.counts_steps() and steps % num_blocks:
            raise ValueError(f"{p}steps={steps} is not divisible by the number of blocks ({p}gen_length/"
                             f"{p}block_length = {num_blocks}); use a multiple of {num_blocks}")
        if block_size and cache in ("prefix", "dual") and block % block_size:
            raise ValueError(f"{p}cache={cache!r} on a block-causal model needs sampler blocks made of whole model "
                             f"blocks, but block_length={block} is not a multiple of model.block_size={block_size}; "
                             f"use block_length={block_size} (the 'block' sampler) or {p}cache=none")


@dataclass
class MaskedSettings(BlockwiseSettings, TokenFilters):
    """LLaDA's semi-AR sampler: a commit rule by confidence (top_p / top_k: SDAR's sdar_dynamic rule)."""

    why_not: ClassVar[str] = "it commits by confidence, block by block, with ddrl's noise layout"

    remasking: str = "low_confidence"  # low_confidence | random | sdar_dynamic (ddrl.sampling.commit)
    threshold: float | None = None  # Fast-dLLM: commit every position above it (and the most confident)
    factor: float | None = None  # Fast-dLLM's factor rule: the largest n with (n+1)(1-c_(n)) < factor

    def check(self, p: str, name: str, block_size: int | None) -> None:
        super().check(p, name, block_size)
        check_choice(p, "remasking", self.remasking, REMASKING)
        threshold, factor = self.threshold, self.factor
        check_threshold(p, threshold)
        if factor is not None and not factor > 0:
            raise ValueError(f"{p}factor must be > 0 (Fast-dLLM's f, e.g. 1.0) or unset, got {factor}")
        if self.remasking == "sdar_dynamic" and (threshold is None or factor is not None):
            raise ValueError(f"{p}remasking='sdar_dynamic' needs {p}threshold (SDAR's confidence_threshold, e.g. 0.9) "
                             f"and no {p}factor, got threshold={threshold}, factor={factor}")
        if threshold is not None and factor is not None:
            raise ValueError(f"{p}threshold={threshold} and {p}factor={factor} are two parallel-decoding rules; set "
                             f"only one of them")
        self.check_blocks(p, self.block_length or self.gen_length, block_size)

    def counts_steps(self) -> bool:  # fixed counts and SDAR's dynamic rule; threshold / factor run a block until full
        return self.remasking == "sdar_dynamic" or (self.threshold is None and self.factor is None)


@dataclass
class BlockSettings(MaskedSettings):
    """Block diffusion: the masked sampler on the model's own blocks (block_length = model.block_size)."""

    why_not: ClassVar[str] = "it decodes the model's blocks by confidence, with ddrl's noise layout"

    def check_blocks(self, p: str, block: int, block_size: int | None) -> None:
        if block_size is None:
            return  # the model's block size decides; checked when the sampler runs
        if self.block_length is not None and self.block_length != block_size:
            raise ValueError(f"{p}block_length={self.block_length} differs from the model's block size {block_size} "
                             f"(the block sampler decodes the model's blocks); set {p}block_length={block_size} "
                             f"or leave it unset")
        super().check_blocks(p, block_size, block_size)


@dataclass
class EmergeSettings(BlockwiseSettings):
    """MaskGRPO's emerge sampler: tokens appear at random by the schedule; its own random-number layouts."""

    why_not: ClassVar[str] = "the emerge sampler unmasks at random by its schedule"

    # ddrl | released (MaskGRPO's t2i draws: ddrl.sampling.released)
    rng: str = field(default="ddrl", metadata={REFUSED: (
        "{p}rng={value!r} is implemented by the emerge sampler only (MaskGRPO's text-to-image rollouts); the {name} "
        "sampler draws with ddrl's layout. Set {p}rng=ddrl or {p}name=emerge")})

    def check(self, p: str, name: str, block_size: int | None) -> None:
        super().check(p, name, block_size)
        check_choice(p, "rng", self.rng, RNG_LAYOUTS, "a valid random-number layout")
        if self.rng == RELEASED:  # MaskGRPO's t2i draws: one block, torch.multinomial in the probabilities' dtype
            if self.block_length is not None and self.block_length != self.gen_length:
                raise ValueError(f"{p}rng='released' decodes the completion as one block, as MaskGRPO's "
                                 f"t2i_generate_emerge; {p}block_length={self.block_length} splits it: unset "
                                 f"{p}block_length")
            if self.noise_dtype != "float32":
                raise ValueError(f"{p}noise_dtype applies to ddrl's layout; rng='released' draws with "
                                 f"torch.multinomial in the probabilities' dtype, as the authors do: unset {p}noise_dtype")
        self.check_blocks(p, self.block_length or self.gen_length, block_size)


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
    generator: Any  # torch.Generator | RowGenerators | None
    top_k: int = 0  # sdar_dynamic: top-k filter of the token distribution (0 = off)
    top_p: float = 1.0  # sdar_dynamic: nucleus filter (1 = off)
    noise_dtype: torch.dtype = torch.float32  # the uniforms' dtype (utils.StepNoise)
    # The vocabulary ids [lo, hi) the model is asked for (the emerge sampler on an image model: its codebook,
    # utils.codebook_range); None = every id. vocab: the width the Gumbel uniforms are drawn over (module doc).
    classes: tuple[int, int] | None = None
    vocab: int | None = None


@torch.no_grad()
def _denoise(model, prompt_ids: Tensor, prompt_mask: Tensor | None, rule: CommitRule, settings: _Settings, *,
             gen_length: int, block_length: int, eos_id: int | Iterable[int] | None, record: bool,
             cache: str = "none", compile: bool = False) -> _Decoded:
    """Blocks left to right; inside a block, steps until `rule` says the block is done.

    eos_id: the stop token(s) of early exit, EOS first (the id finished rows are filled with); None = none.
    """
    stop_ids = as_stop_ids(eos_id)
    B, device = prompt_ids.shape[0], prompt_ids.device
    canvas = block_canvas(model, prompt_ids, prompt_mask, gen_length)  # None: gen_length slots, all decoded
    offsets, slots = (None, None) if canvas is None else canvas  # [B], [B, W] (the slots decoded)
    width = gen_length if slots is None else slots.shape[1]  # completion slots W
    own = None if offsets is None else completion_slots(offsets, gen_length, width)  # [B, W] the row's L tokens
    forward = block_forward(model, prompt_ids, prompt_mask, cache=cache, block_length=block_length,
                            gen_length=width, cfg_scale=settings.cfg_scale, mask_id=settings.mask_id, slots=slots,
                            compile=compile, class_range=settings.classes)
    completion = torch.full((B, width), settings.mask_id, dtype=torch.long, device=device)  # [B, W]
    commit_step = torch.full((B, width), -1, dtype=torch.long, device=device)  # [B, W]
    empty = torch.zeros_like(completion, dtype=torch.bool) if slots is None else ~slots  # never committed
    running = torch.ones(B, dtype=torch.bool, device=device)  # False once early exit filled the row
    noise = None if settings.generator is None else StepNoise(settings.generator, B, device, settings.noise_dtype)
    recorder = ProbRecorder(token_probs=record != COMMIT_ORDER,
                            offset=None if settings.classes is None else settings.classes[0]) if record else None
    nfe = 0
    for start in range(0, width, block_length):
        end = min(start + block_length, width)
        if stop_ids and not bool(running.any()):  # early exit: every row has its stop token (one read per block)
            break
        rule.begin_block(_still_masked(completion, empty, start, end, settings.mask_id))
        forward.begin_block(start, end)
        first_step, step = nfe, 0
        # Every row is fed every step (static shapes); a finished row (EOS-filled) or one whose block
        # is full has no mask in the window, so nothing of it is committed.
        while rule.more_steps(step, masked := _still_masked(completion, empty, start, end, settings.mask_id)):
            if noise is not None:
                noise.begin_step(start, step)
            logits = forward.block_logits(step, completion)  # [B, W, V] (the codebook's C: settings.classes)
            window, committed = _step(logits, completion[:, start:end], masked, rule, step, settings, noise,
                                      recorder, running if stop_ids else None)
            completion[:, start:end] = window
            commit_step[:, start:end] = torch.where(committed, nfe, commit_step[:, start:end])
            nfe, step = nfe + 1, step + 1
        if recorder is not None:
            recorder.close_block(start, first_step, completion[:, start:end])
        if stop_ids:
            stops = is_stop(completion[:, :end], stop_ids)  # [B, end]; a stop past gen_length does not count
            done = (stops if own is None else stops & own[:, :end]).any(dim=1)  # [B]
            completion[:, end:] = torch.where(done[:, None], stop_ids[0], completion[:, end:])
            running = ~done
    trajectory = recorder.trajectory(commit_step, nfe) if recorder is not None else None
    if offsets is not None:  # back to each row's own gen_length tokens
        take = offsets[:, None] + torch.arange(gen_length, device=device)[None, :]  # [B, L]
        completion = completion.gather(1, take)
        trajectory = None if trajectory is None else take_positions(trajectory, take)
    return _Decoded(completion, trajectory, nfe, forward.forward_tokens)


def _still_masked(completion: Tensor, empty: Tensor, start: int, end: int, mask_id: int) -> Tensor:
    """[B, W] bool: the window's slots that are still masked (empty slots never are)."""
    return (completion[:, start:end] == mask_id) & ~empty[:, start:end]


def block_canvas(model, prompt_ids: Tensor, prompt_mask: Tensor | None,
                 gen_length: int) -> tuple[Tensor, Tensor] | None:
    """The slots a block-causal model decodes, as SDAR's block_diffusion_generate does (module doc):
    each row's completion starts `offset = n_prompt % block_size` slots into the canvas and its last
    block is decoded whole, so row i decodes slots [offset_i, ceil((offset_i + gen_length) / block_size)
    * block_size). Returns (offsets [B], decoded [B, W] bool), W the widest row's end; None when the
    model has full attention or every row starts and ends on a block boundary (all W = gen_length
    slots decoded). One host read (the largest offset)."""
    block_size = model_view(model).block_size
    if not block_size:
        return None
    bs = int(block_size)
    B, P = prompt_ids.shape
    n_prompt = (prompt_mask.long().sum(dim=1) if prompt_mask is not None
                else torch.full((B,), P, dtype=torch.long, device=prompt_ids.device))
    offsets = n_prompt % bs  # [B]
    largest = int(offsets.max())
    if largest == 0 and gen_length % bs == 0:
        return None
    ends = (offsets + gen_length + bs - 1).div(bs, rounding_mode="floor") * bs  # [B] each row's last block end
    width = -(-(largest + gen_length) // bs) * bs
    j = torch.arange(width, device=prompt_ids.device)[None, :]
    return offsets, (j >= offsets[:, None]) & (j < ends[:, None])


def completion_slots(offsets: Tensor, gen_length: int, width: int) -> Tensor:
    """[B, width] bool: slot j of row i holds completion token j - offsets[i] (True) or is empty."""
    j = torch.arange(width, device=offsets.device)[None, :]
    return (j >= offsets[:, None]) & (j < offsets[:, None] + gen_length)


def _step(logits: Tensor, window: Tensor, masked: Tensor, rule: CommitRule, step: int, settings: _Settings,
          noise: StepNoise | None, recorder: ProbRecorder | None, running: Tensor | None) -> tuple[Tensor, Tensor]:
    """The block's logits [B, W, V], tokens [B, W] and still-masked slots [B, W] -> (new tokens [B, W],
    committed this step [B, W]). running [B] bool: rows early exit has not filled (None = all).
    With settings.classes (lo, hi) the logits are ids [lo, hi) only, [B, W, hi - lo] (the emerge
    sampler on an image model); the tokens are vocabulary ids either way."""
    s = settings
    if s.classes is None and not 0 <= s.mask_id < logits.shape[-1]:
        raise ValueError(f"mask_id={s.mask_id} is outside the model's vocabulary [0, {logits.shape[-1]}); "
                         f"pass the model's mask token id (model.mask_token_id)")
    if isinstance(rule, ReleasedEmergeRule):  # rollout.rng=released: one draw gives the token and whether it appears
        x0, committed = rule.draw(step, logits, masked, s.temperature, s.generator)
        committed = committed & masked
        if recorder is not None:
            recorder.add_step(logits, rule.step_time(step), running)
        return torch.where(committed, x0, window), committed
    # [B, W, V] uniforms on the logits' device, over every vocabulary id even when the logits are the
    # codebook's: the noise stream, and so a seed's tokens, stay those of a full-vocabulary draw (module doc)
    uniforms = (noise(logits.shape[1], s.vocab or logits.shape[-1])  # type: ignore[misc]  # check_generator_given
                if s.temperature > 0 else None)
    if s.remasking == "sdar_dynamic":  # SDAR's candidate and confidence: the filtered, tempered softmax
        x0, sdar_confidence = tempered_confidence(logits, s.temperature, s.top_k, s.top_p, uniforms=uniforms)
    elif s.classes is not None:  # the codebook's logits; the draw's index + lo is the vocabulary id
        x0 = gumbel_argmax(logits, s.temperature, uniforms, consume=True, offset=s.classes[0]) + s.classes[0]
    else:
        x0 = gumbel_argmax(logits, s.temperature, uniforms, consume=True)  # [B, W]
    confidence = None
    if rule.uses_confidence:
        if s.remasking == "sdar_dynamic":
            confidence = sdar_confidence
        elif s.remasking == "low_confidence":
            confidence = chosen_probability(logits, x0)  # [B, W] float64
        else:
            assert noise is not None  # _run: random remasking needs a generator
            confidence = noise(masked.shape[1])
        confidence = confidence.masked_fill(~masked, float("-inf"))  # committed positions never move
    committed = rule.choose(step, confidence, masked, noise) & masked  # type: ignore[arg-type]  # None only for a rule without uses_confidence
    if recorder is not None:
        recorder.add_step(logits, rule.step_time(step), running)
    return torch.where(committed, x0, window), committed


# --------------------------------------------------------------------------------------------
# The one entry: checks, rule, decoding
# --------------------------------------------------------------------------------------------


def _check_model_inputs(model, prompt_ids: Tensor, gen_length: int, mask_id: int) -> None:
    """What needs the model: the mask id in its vocabulary, its maximum length, a prompt for Dream."""
    view = model_view(model)
    vocab_size = view.stated("vocab_size")
    if not isinstance(mask_id, int) or mask_id < 0 or (vocab_size is not None and mask_id >= vocab_size):
        raise ValueError(f"mask_id={mask_id!r} is outside the model's vocabulary [0, {vocab_size or 'V'}); "
                         f"pass the model's mask token id (model.mask_token_id)")
    max_len = view.stated("max_seq_len")
    if max_len is not None and prompt_ids.shape[1] + gen_length > max_len:
        raise ValueError(f"prompt length {prompt_ids.shape[1]} + gen_length={gen_length} exceeds the model's "
                         f"max_seq_len={max_len}; shorten the prompt or lower gen_length")
    if view.logits_shifted and prompt_ids.shape[1] == 0:
        raise ValueError("a model with shifted logits (Dream) needs at least one prompt token; pass a non-empty prompt")


def _run(model, prompt_ids: Tensor, prompt_mask: Tensor | None, section: Any, kind: type[BlockwiseSettings], *,
         sampler: str, key: str, generator: Any, record: bool, mask_id: int | None = None) -> _Decoded:
    """generate() and the masked / block / emerge samplers: read the settings (the sampler's class checks
    them) and check the inputs, pick the commit rule, decode. section: a rollout section or MaskedSettings."""
    block_size = model_view(model).block_size
    if sampler == "block" and block_size is None:
        raise ValueError("the 'block' sampler needs a block-causal model, but model.block_size is None; "
                         "build the model with model.block_size set, or use rollout.name=masked for "
                         "full-attention models")
    cfg = kind.read(section, key, name=sampler, block_size=None if block_size is None else int(block_size))
    check_prompts(prompt_ids, prompt_mask)
    mask_id = model_mask_id(model) if mask_id is None else mask_id
    _check_model_inputs(model, prompt_ids, cfg.gen_length, mask_id)
    block_length = int(block_size) if sampler == "block" and block_size is not None else (cfg.block_length or cfg.gen_length)
    rule = commit_rule(cfg, sampler, cfg.gen_length, block_length, model, key)
    p = f"{key}." if key else ""
    if isinstance(rule, ReleasedEmergeRule):
        check_generator_given(generator, True, f"{p}rng='released' (every step draws from it, as the authors' "
                                               f"global RNG)")
    elif isinstance(rule, EmergeRule):
        check_generator_given(generator, cfg.temperature > 0 or rule.steps_per_block > 1,
                              f"the emerge sampler draws which tokens appear (steps per block > 1) or "
                              f"{p}temperature > 0")
    else:
        assert isinstance(cfg, MaskedSettings)  # the masked and block samplers
        check_generator_given(generator, cfg.temperature > 0 or cfg.remasking == "random",
                              f"{p}temperature > 0 or {p}remasking='random'")
    classes = codebook_range(model) if sampler == "emerge" else None  # an image model's codes only (module doc)
    settings = _Settings(float(cfg.temperature), float(cfg.cfg_scale),
                         getattr(cfg, "remasking", "low_confidence"), mask_id, generator,
                         getattr(cfg, "top_k", None) or 0, getattr(cfg, "top_p", None) or 1.0,
                         NOISE_DTYPES[cfg.noise_dtype], classes,
                         None if classes is None else int(model_view(model).stated("vocab_size")))
    mask = None if prompt_mask is None else prompt_mask.bool()
    if mask is not None and bool(mask.all()):  # one read per call: then no step passes an all-ones mask,
        mask = None  # and the model runs its unmasked attention (SDPA's fastest kernel), as the reference
    return _denoise(model, prompt_ids, mask, rule, settings, gen_length=cfg.gen_length, block_length=block_length,
                    eos_id=model_stop_ids(model) if cfg.early_exit else None, record=record, cache=cfg.cache,
                    compile=cfg.compile)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def generate(model, prompt_ids: Tensor, attention_mask: Tensor | None = None, *, steps: int, gen_length: int,
             block_length: int, temperature: float = 0.0, cfg_scale: float = 0.0, remasking: str = "low_confidence",
             mask_id: int, threshold: float | None = None, generator: torch.Generator | None = None,
             return_trajectory: bool = False, factor: float | None = None, cache: str = "none",
             top_k: int | None = None, top_p: float | None = None,
             noise_dtype: str = "float32") -> Tensor | tuple[Tensor, Trajectory | None]:
    """LLaDA's semi-autoregressive sampler (module doc), batched.

    prompt_ids      [B, P] long, left-padded; attention_mask [B, P] (1 = real token) or None (none is
                    passed to the model). The model receives [B, P + gen_length] with ones on the completion.
    steps           steps // ceil(gen_length / block_length) model calls per block (the total on a
                    full-attention model; on a block model whose prompt ends inside a block the
                    completion spans one block more, each with as many calls); ignored when threshold
                    or factor is set (each block then runs until it is full, at most block_length calls).
    threshold       None: LLaDA's fixed counts. In (0, 1]: Fast-dLLM threshold decoding.
    generator       a torch.Generator, or RowGenerators (one per chunk of rows: each chunk gets what a
                    call on it alone gets); required when temperature > 0 or remasking == "random".
    factor          Fast-dLLM's factor-based parallel decoding (module doc), > 0; excludes threshold.
    cache           "none" (LLaDA's reference) | "prefix" | "dual" | "auto" (ddrl.sampling.cache).
    remasking       "low_confidence" | "random" | "sdar_dynamic" (SDAR's rule, with threshold =
                    its confidence_threshold and top_k / top_p filtering the token distribution).
    noise_dtype     "float32" (default) | "float64": the uniforms' dtype (utils.StepNoise).
    Returns the full sequence [B, P + gen_length] (prompt + completion), and the Trajectory when
    return_trajectory=True. Never early-exits. With the defaults (threshold, factor None, cache
    "none") these are the reference's tokens.
    """
    cfg = MaskedSettings(steps=steps, gen_length=gen_length, block_length=block_length, temperature=temperature,
                         cfg_scale=cfg_scale, remasking=remasking, threshold=threshold, factor=factor, cache=cache,
                         top_k=top_k, top_p=top_p, noise_dtype=noise_dtype, early_exit=False)
    out = _run(model, prompt_ids, attention_mask, cfg, MaskedSettings, sampler="masked", key="", generator=generator,
               record=return_trajectory, mask_id=mask_id)
    sequence = torch.cat([prompt_ids, out.completion.to(prompt_ids.dtype)], dim=1)  # [B, P + L]
    return (sequence, out.trajectory) if return_trajectory else sequence


def _sample(model, prompt_ids: Tensor, prompt_mask: Tensor | None, cfg: Any, kind: type[BlockwiseSettings],
            sampler: str, generator: Any, return_trajectory: bool) -> SampleOutput:
    out = _run(model, prompt_ids, prompt_mask, cfg, kind, sampler=sampler, key="rollout", generator=generator,
               record=return_trajectory)
    return SampleOutput(completion_ids=out.completion, trajectory=out.trajectory, nfe=out.nfe,
                        forward_tokens=out.forward_tokens)


@register_sampler("masked", MaskedSettings)
def sample_masked(model, prompt_ids: Tensor, prompt_mask: Tensor | None, cfg: Any, *,
                  generator: torch.Generator | None, return_trajectory: bool = False) -> SampleOutput:
    """LLaDA semi-AR sampling (threshold / factor decoding when set), completion only [B, L].

    block_length None = gen_length (one block); mask id = model.mask_token_id; early exit on
    model.stop_token_ids when cfg.early_exit. generator: a torch.Generator or RowGenerators.
    """
    return _sample(model, prompt_ids, prompt_mask, cfg, MaskedSettings, "masked", generator, return_trajectory)


@register_sampler("block", BlockSettings)
def sample_block(model, prompt_ids: Tensor, prompt_mask: Tensor | None, cfg: Any, *,
                 generator: torch.Generator | None, return_trajectory: bool = False) -> SampleOutput:
    """Block diffusion (SDAR style): the masked sampler with block_length = model.block_size."""
    return _sample(model, prompt_ids, prompt_mask, cfg, BlockSettings, "block", generator, return_trajectory)


@register_sampler("emerge", EmergeSettings)
def sample_emerge(model, prompt_ids: Tensor, prompt_mask: Tensor | None, cfg: Any, *,
                  generator: torch.Generator | None, return_trajectory: bool = False) -> SampleOutput:
    """MaskGRPO's ancestral "emerge" sampler (module doc), completion only [B, L].

    cfg.steps model calls, split evenly over blocks of cfg.block_length (None = one block, as in
    MaskGRPO); cfg.cfg_scale w gives (1 + w) cond - w uncond. Reads EmergeSettings: no remasking, threshold
    or factor (it commits at random by its schedule).
    """
    return _sample(model, prompt_ids, prompt_mask, cfg, EmergeSettings, "emerge", generator, return_trajectory)
