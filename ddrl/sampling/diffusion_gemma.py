"""DiffusionGemma's own sampler: transformers' `DiffusionGemmaForBlockDiffusion.generate`
(transformers 5.24.0, models/diffusion_gemma/generation_diffusion_gemma.py), for one canvas
(gen_length == canvas_length), on ddrl's HFDiffusionLM with the "canvas" feed.

The canvas x (C tokens) starts uniform over the vocabulary (or as `initial_canvas`, their
decoder_input_ids). Denoising step n = N, N-1, ..., 1 (n counts the steps *remaining*; N = steps):

  z      = decoder(x; prompt, self-conditioning s) / tau_n,   tau_n = t_min + (t_max - t_min) n / N
  x_D    ~ softmax(z)                                      (one draw per position)
  a      = argmax z                                        (the "argmax canvas": the output)
  accept the k lowest-entropy positions, k the largest with  sum_{i<=k} H_(i) - H_(k) <= entropy_bound
           (the entropy-bound sampler, Lavenant et al. 2025, arXiv:2505.24857); H from z
  x      = x_D where accepted, a fresh uniform token elsewhere (renoising)
  s      = z                                               (self-conditioning logits of the next step)
  stop a row once a has been equal for stability_threshold + 1 steps in a row and mean H <
  confidence_threshold (their StableAndConfidentStoppingCriteria); a stopped row is frozen (its
  a, x and s kept) and the loop ends when every row has stopped.

The result is a, with every token after the first EOS replaced by pad when both eos_token_id and
pad_token_id are given (their _finalize_canvas on the first canvas).

**Randomness** comes from the explicit generator, drawn exactly as `generate` draws from the global
RNG: randint [B, C] for the initial canvas (unless given), then per step multinomial over the
flattened [B * C, V] probabilities and randint [B, C] for renoising. So, on the CPU, a generator
seeded with s gives the tokens `generate` gives after torch.manual_seed(s) for the same batch
(tests/unit/test_diffusion_gemma_sampler.py). A row's draws depend on its index in the batch, not
on the other rows' tokens. With RowGenerators (one generator per chunk of rows) each chunk draws
from its own generator, so a batched call gives each chunk what a call on it alone gives (a stopped
row is frozen, so the draws a finished chunk still receives change nothing). A generator on
another device than the model draws there (the probabilities are copied to it: slower, same numbers).

**Deterministic settings**: with t_max tiny (e.g. 1e-6, t_min = 0) softmax(z) is one-hot, every
entropy is 0, every position is accepted and x_D = a, so the tokens depend only on the initial
canvas; that is how a left-padded row is checked against `generate` on the unpadded row.

Where this differs from `generate`:
  (a) One canvas only: gen_length must equal canvas_length (the outer autoregressive loop over
      canvases, its encoder KV cache and its max_length stopping are not reproduced).
  (b) The prompt is re-encoded at every step (the canvas feed has no cache); same numbers, in float32.
  (c) Left padding: positions are counted over real tokens (the canvas feed), so a padded row gives
      the unpadded row's tokens; `generate` numbers padded prompts 0..P-1 including the pads.
  (d) No streamer, no custom logits processors / stopping criteria, no torch.compile, no images.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from ddrl.contract import model_view
from ddrl.processes.draws import row_chunks
from ddrl.sampling.base import SampleOutput
from ddrl.sampling.settings import SamplerSettings, register_sampler

# transformers' DiffusionGemmaGenerationConfig._get_default_generation_params
DEFAULT_T_MIN, DEFAULT_T_MAX = 0.4, 0.8
DEFAULT_ENTROPY_BOUND = 0.1
DEFAULT_STABILITY_THRESHOLD = 1
DEFAULT_CONFIDENCE_THRESHOLD = 0.005


@dataclass
class DiffusionGemmaSettings(SamplerSettings):
    """What rollout.name=diffusion_gemma reads: the sizes (gen_length = the model's canvas_length) and, where
    the section has them (no YAML keys), transformers' generation settings. The temperature is its
    schedule's (t_max -> t_min), so rollout.temperature is not read."""

    why_not: ClassVar[str] = "it denoises one canvas by its own schedule, without blocks, cache or guidance"

    t_min: float = DEFAULT_T_MIN
    t_max: float = DEFAULT_T_MAX
    entropy_bound: float = DEFAULT_ENTROPY_BOUND
    stability_threshold: int | None = DEFAULT_STABILITY_THRESHOLD
    confidence_threshold: float | None = DEFAULT_CONFIDENCE_THRESHOLD


@dataclass
class DiffusionGemmaRun:
    """One diffusion_gemma_generate call's settings."""

    steps: int  # their max_denoising_steps
    t_min: float
    t_max: float
    entropy_bound: float
    stability_threshold: int | None  # None (or confidence_threshold None): no adaptive stopping
    confidence_threshold: float | None
    eos_token_id: int | None
    pad_token_id: int | None


# --------------------------------------------------------------------------------------------
# One step's pieces
# --------------------------------------------------------------------------------------------


def scheduled_logits(logits: Tensor, remaining: int, cfg: DiffusionGemmaRun) -> Tensor:
    """[B, C, V] / tau_n, with tau_n computed in float32 from an int32 step as their
    LinearTemperatureScheduleLogitsProcessor does (bit-equal logits)."""
    n = torch.tensor(remaining, dtype=torch.int32, device=logits.device)
    temperature = cfg.t_min + ((cfg.t_max - cfg.t_min) * (n / cfg.steps))
    return logits / temperature


def token_entropy(logits: Tensor) -> Tensor:
    """[..., V] logits -> [...] entropy, computed as torch.distributions.Categorical(logits=).entropy()."""
    log_p = logits - logits.logsumexp(dim=-1, keepdim=True)
    p = torch.softmax(log_p, dim=-1)
    return -(log_p.clamp(min=torch.finfo(log_p.dtype).min) * p).sum(-1)


def entropy_bound_accept(entropy: Tensor, bound: float) -> Tensor:
    """[B, C] entropies -> [B, C] bool: the lowest-entropy positions whose entropy sum, less the largest
    of them, stays <= bound (the always-accepted lowest one included)."""
    ranked, order = torch.sort(entropy, dim=-1, descending=False)
    keep = ranked.cumsum(-1) - ranked <= bound  # [B, C] in ranked order
    return torch.zeros_like(keep).scatter(-1, order, keep)


@dataclass
class _Stopping:
    """Their StableAndConfidentStoppingCriteria: argmax canvas unchanged over the last
    `stability` steps and mean entropy below `confidence`."""

    stability: int
    confidence: float
    history: Tensor | None = None  # [stability, B, C] long, the last argmax canvases (-1 = none yet)

    def __call__(self, argmax_canvas: Tensor, entropy: Tensor) -> Tensor:
        B = argmax_canvas.shape[0]
        if self.stability == 0:
            stable = torch.ones(B, dtype=torch.bool, device=argmax_canvas.device)
        else:
            if self.history is None:
                self.history = torch.full((self.stability, *argmax_canvas.shape), -1, dtype=argmax_canvas.dtype,
                                          device=argmax_canvas.device)
            stable = (self.history == argmax_canvas[None]).all(dim=-1).all(dim=0)
            self.history = torch.roll(self.history, shifts=-1, dims=0)
            self.history[-1] = argmax_canvas
        return stable & (entropy.mean(dim=-1) < self.confidence)


def pad_after_eos(canvas: Tensor, eos_token_id: int | None, pad_token_id: int | None) -> Tensor:
    """[B, C] -> [B, C]: tokens after a row's first EOS become pad (both ids needed, as in theirs)."""
    if eos_token_id is None or pad_token_id is None:
        return canvas
    is_eos = canvas == eos_token_id
    seen = is_eos.cumsum(-1)
    after = (seen > 0) & ~((seen == 1) & is_eos)
    return canvas.masked_fill(after, pad_token_id)


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------


@dataclass
class _Decoded:
    canvas: Tensor  # [B, C] long, the argmax canvas (post-EOS padding applied)
    nfe: int  # decoder calls (steps until every row stopped)


def _canvas_logits(model, prompt_ids: Tensor, prompt_mask: Tensor | None, canvas: Tensor,
                   self_conditioning: Tensor | None) -> Tensor:
    """[B, C, V] float32 decoder logits of the canvas, through the model's canvas feed."""
    seq = torch.cat([prompt_ids, canvas.to(prompt_ids.dtype)], dim=1)  # [B, P + C]
    mask = None if prompt_mask is None else torch.cat([prompt_mask, torch.ones_like(canvas, dtype=torch.bool)], 1)
    out = model._feed.run(model, seq, mask, self_conditioning_logits=self_conditioning)
    return out.logits[:, -canvas.shape[1]:].float()


def _per_chunk(chunks: list[tuple[int, int, torch.Generator]], draw, device: torch.device) -> Tensor:
    """draw(generator, lo, hi) for each chunk of rows (ddrl.processes.draws.row_chunks), stacked on `device`.
    One chunk (a plain generator): exactly the one call `generate` makes."""
    return torch.cat([draw(g, lo, hi).to(device) for lo, hi, g in chunks])


@torch.no_grad()
def _denoise(model, prompt_ids: Tensor, prompt_mask: Tensor | None, cfg: DiffusionGemmaRun,
             canvas: Tensor, generator: torch.Generator | None) -> _Decoded:
    B, C = canvas.shape
    V = int(model.vocab_size)
    chunks = row_chunks(generator, B)
    stopping = (None if cfg.stability_threshold is None or cfg.confidence_threshold is None
                else _Stopping(cfg.stability_threshold, cfg.confidence_threshold))
    finished = torch.zeros(B, dtype=torch.bool, device=canvas.device)
    argmax_canvas, self_conditioning, nfe = canvas, None, 0
    embedding_dtype = _embedding_dtype(model)
    for remaining in range(cfg.steps, 0, -1):
        nfe += 1
        raw = _canvas_logits(model, prompt_ids, prompt_mask, canvas, self_conditioning)  # [B, C, V]
        logits = scheduled_logits(raw, remaining, cfg)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        drawn = _per_chunk(chunks, lambda g, lo, hi: torch.multinomial(
            probs[lo:hi].reshape(-1, V).to(g.device), 1, generator=g).view(hi - lo, C), canvas.device)  # x_D  # noqa: B023 - called within this step
        new_argmax = logits.argmax(dim=-1)
        entropy = token_entropy(logits)  # [B, C]
        accept = entropy_bound_accept(entropy, cfg.entropy_bound)  # [B, C]
        noise = _per_chunk(chunks, lambda g, lo, hi: torch.randint(0, V, (hi - lo, C), generator=g, device=g.device),
                           canvas.device)  # renoising
        new_canvas = torch.where(accept, drawn, noise)
        if stopping is not None:
            if finished.any():  # a stopped row is frozen
                assert self_conditioning is not None  # a row stops after a step, which set it
                new_argmax = torch.where(finished[:, None], argmax_canvas, new_argmax)
                new_canvas = torch.where(finished[:, None], canvas, new_canvas)
                logits = torch.where(finished[:, None, None], self_conditioning, logits)
                entropy = token_entropy(logits)
            finished |= stopping(new_argmax, entropy)
        canvas, argmax_canvas = new_canvas, new_argmax
        self_conditioning = logits.to(embedding_dtype)
        if bool(finished.all()):
            break
    return _Decoded(pad_after_eos(argmax_canvas, cfg.eos_token_id, cfg.pad_token_id), nfe)


def _embedding_dtype(model) -> torch.dtype:
    """Their self-conditioning logits are cast to the decoder embedding's dtype (found by name, so that a
    LoRA-wrapped backbone works too)."""
    for name, module in model.model.named_modules():
        if name.endswith("decoder.embed_tokens"):
            return module.weight.dtype
    raise ValueError("no decoder.embed_tokens.weight in the backbone; is this a DiffusionGemma model?")


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def diffusion_gemma_generate(model, prompt_ids: Tensor, attention_mask: Tensor | None = None, *, steps: int,
                             t_min: float = DEFAULT_T_MIN, t_max: float = DEFAULT_T_MAX,
                             entropy_bound: float = DEFAULT_ENTROPY_BOUND,
                             stability_threshold: int | None = DEFAULT_STABILITY_THRESHOLD,
                             confidence_threshold: float | None = DEFAULT_CONFIDENCE_THRESHOLD,
                             eos_token_id: int | None = None, pad_token_id: int | None = None,
                             initial_canvas: Tensor | None = None,
                             generator: torch.Generator | None = None) -> tuple[Tensor, int]:
    """transformers' DiffusionGemmaForBlockDiffusion.generate for one canvas (module doc).

    model           an HFDiffusionLM with the "canvas" feed (model.canvas_length = C).
    prompt_ids      [B, P] long, left-padded; attention_mask [B, P] (1 = real token) or None.
    steps           their max_denoising_steps; t_min / t_max the temperature schedule's ends.
    entropy_bound   their EntropyBoundSamplerConfig.entropy_bound.
    stability_threshold, confidence_threshold
                    their adaptive stopping; None for either = always run `steps` steps.
    eos_token_id, pad_token_id
                    both given: tokens after the first EOS become pad (their generation config's).
    initial_canvas  [B, C] long, their decoder_input_ids; None = drawn uniformly from the generator.
    generator       the only source of randomness (module doc); always required.
    Returns (sequence [B, P + C] = prompt + canvas, decoder calls made).
    """
    cfg = DiffusionGemmaRun(steps=steps, t_min=float(t_min), t_max=float(t_max), entropy_bound=float(entropy_bound),
                            stability_threshold=stability_threshold, confidence_threshold=confidence_threshold,
                            eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    _check(model, prompt_ids, attention_mask, cfg, initial_canvas, generator)
    B, C = prompt_ids.shape[0], int(model.canvas_length)
    if initial_canvas is None:
        V = int(model.vocab_size)
        initial_canvas = _per_chunk(row_chunks(generator, B), lambda g, lo, hi: torch.randint(
            0, V, (hi - lo, C), generator=g, device=g.device), prompt_ids.device)
    mask = None if attention_mask is None else attention_mask.bool()
    out = _denoise(model, prompt_ids, mask, cfg, initial_canvas.to(prompt_ids.device), generator)
    return torch.cat([prompt_ids, out.canvas.to(prompt_ids.dtype)], dim=1), out.nfe


def _check(model, prompt_ids: Tensor, attention_mask: Tensor | None, cfg: DiffusionGemmaRun,
           initial_canvas: Tensor | None, generator: torch.Generator | None) -> None:
    view = model_view(model)
    if view.attention != "canvas" or not view.canvas_length:
        raise ValueError(f"the diffusion_gemma sampler runs DiffusionGemma through ddrl's 'canvas' feed; got a model "
                         f"with attention={view.attention!r} (load a DiffusionGemma checkpoint)")
    if view.logits_range is not None:
        raise ValueError(f"model.logits_range={model.logits_range} is set, but DiffusionGemma's generate samples the "
                         f"whole vocabulary; unset it")
    integer = isinstance(prompt_ids, Tensor) and prompt_ids.dtype in (torch.int64, torch.int32)
    if not integer or prompt_ids.dim() != 2 or prompt_ids.shape[1] == 0:
        raise ValueError(f"prompt_ids must be a non-empty [B, P] integer tensor, got "
                         f"{getattr(prompt_ids, 'dtype', type(prompt_ids))} {list(getattr(prompt_ids, 'shape', []))}")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(prompt_ids.shape):
        raise ValueError(f"attention_mask must have prompt_ids' shape {list(prompt_ids.shape)}, got "
                         f"{list(attention_mask.shape)}")
    if not isinstance(cfg.steps, int) or cfg.steps <= 0:
        raise ValueError(f"steps (their max_denoising_steps) must be a positive integer, got {cfg.steps!r}")
    if not 0 <= cfg.t_min < cfg.t_max:
        raise ValueError(f"the temperature schedule needs 0 <= t_min < t_max, got t_min={cfg.t_min}, "
                         f"t_max={cfg.t_max} (transformers' defaults: 0.4, 0.8)")
    if cfg.entropy_bound <= 0:
        raise ValueError(f"entropy_bound must be > 0, got {cfg.entropy_bound} (transformers' default: 0.1)")
    if cfg.stability_threshold is not None and (not isinstance(cfg.stability_threshold, int)
                                                or cfg.stability_threshold < 0):
        raise ValueError(f"stability_threshold must be an integer >= 0 or None, got {cfg.stability_threshold!r}")
    if cfg.confidence_threshold is not None and cfg.confidence_threshold <= 0:
        raise ValueError(f"confidence_threshold must be > 0 or None, got {cfg.confidence_threshold}")
    C = int(model.canvas_length)
    if initial_canvas is not None and tuple(initial_canvas.shape) != (prompt_ids.shape[0], C):
        raise ValueError(f"initial_canvas must be [B, canvas_length] = [{prompt_ids.shape[0]}, {C}], got "
                         f"{list(initial_canvas.shape)}")
    if generator is None:
        raise ValueError("generator is required: DiffusionGemma's sampler draws tokens and renoises at every step "
                         "(ddrl never uses the global RNG); pass generator=torch.Generator().manual_seed(seed)")


# --------------------------------------------------------------------------------------------
# The registry entry (rollout.name = diffusion_gemma)
# --------------------------------------------------------------------------------------------


@register_sampler("diffusion_gemma", DiffusionGemmaSettings)
def sample_diffusion_gemma(model, prompt_ids: Tensor, prompt_mask: Tensor | None, cfg: Any, *,
                           generator: torch.Generator | None, return_trajectory: bool = False) -> SampleOutput:
    """DiffusionGemma's generate with the rollout config (completion only, [B, C]).

    Reads DiffusionGemmaSettings: rollout.steps (their max_denoising_steps), gen_length (must equal the
    model's canvas_length) and, where the section has them, t_min (0.4), t_max (0.8), entropy_bound (0.1),
    stability_threshold (1) and confidence_threshold (0.005): transformers' defaults. rollout.temperature
    does not apply (the schedule t_max -> t_min does). EOS handling is left to ddrl (no post-EOS padding here).
    """
    if return_trajectory:
        raise ValueError("the diffusion_gemma sampler records no trajectory; use an estimator that does not need "
                         "one, or rollout.name=uniform")
    C = model_view(model).require("canvas_length", "load a DiffusionGemma checkpoint (its sampler denoises one canvas)")
    if cfg.gen_length != C:
        raise ValueError(f"rollout.gen_length={cfg.gen_length} must equal DiffusionGemma's canvas_length={C} "
                         f"(one canvas)")
    s = DiffusionGemmaSettings.read(cfg, "rollout", name="diffusion_gemma")
    sequence, nfe = diffusion_gemma_generate(
        model, prompt_ids, prompt_mask, steps=s.steps, t_min=s.t_min, t_max=s.t_max, entropy_bound=s.entropy_bound,
        stability_threshold=s.stability_threshold, confidence_threshold=s.confidence_threshold, generator=generator)
    P = prompt_ids.shape[1]
    return SampleOutput(completion_ids=sequence[:, P:], trajectory=None, nfe=nfe,
                        forward_tokens=nfe * prompt_ids.shape[0] * (P + C))
