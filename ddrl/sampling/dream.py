"""Dream's own sampler: `diffusion_generate` (Ye et al. 2025, "Dream 7B"; hub generation_utils.py,
pinned copy ZHZisZZ/dllm @ 03270de7), for Dream, Dream-Coder and DiffuCoder, batched.

The completion starts as L masks and is decoded in `steps` model calls over the whole completion
(no blocks). With timesteps t_0 = 1 > t_1 > ... > t_S = eps (linspace(1, eps, S + 1)), step i
(t = t_i, s = t_{i+1}) sees the n masked positions of a row and the model's logits there, filtered
as their sample_tokens does: logits / temperature (if > 0), top-p, then top-k (removed logits set to
the dtype's minimum), p = softmax. x0 = argmax p at temperature 0, else a draw from p.

  "origin"        each masked position is committed with probability 1 - s/t (1 at the last step),
                  to x0 drawn there (MDLM's ancestral step).
  "maskgit_plus"  confidence c = p(x0);  "topk_margin": c = p_(1) - p_(2) (top-two margin);
  "entropy"       c = sum_v p_v log(p_v + 1e-10) (negative entropy).
                  These commit the k = floor(n (1 - s/t)) most confident masked positions (k = n at
                  the last step), or, with alg_temp > 0, k positions drawn without replacement from
                  softmax(c / alg_temp) (Gumbel-top-k: the top k of c / alg_temp + Gumbel noise).

A committed token is never revisited. A committed mask token (the reference never suppresses it)
stays masked and is decoded again later, as in the reference. `vocab_limit` restricts every choice
to ids < vocab_limit (logits above set to -inf before the filtering), for models whose vocabulary is
padded past the tokenizer's (Dream: 152064 rows, 151667 ids); the reference has no such option (its
logits hook can do it, which is how the golden test applies it to their code).

**Randomness** comes from an explicit generator (or RowGenerators, one per chunk of rows), drawn
in sequence on the generator's device, per step, for all B rows, each [B, L] float64 (one number
per position, so small), in this order and only when used: "origin" transfer uniforms; token uniforms at
temperature > 0 (one per position: inverse-CDF draw from p); alg_temp > 0 position uniforms (every
step, even when k = 0). A row's draws never depend on the other rows' tokens. The reference draws the
same distributions from the global RNG on the flattened masked positions (torch.rand,
Categorical.sample, torch.multinomial), so its stream cannot be matched; the golden fixture feeds it
these uniforms instead (tests/fixtures/make_dream.py). Every row runs every step, so with
RowGenerators a batched call gives each chunk what a call on it alone gives; the masked samplers,
whose blocks take data-dependent step counts, key their noise by step instead (utils.StepNoise).

Tokens equal the reference's for every alg (tests/unit/test_native_dream.py). Where this code differs:
  (a) k is counted per row; the reference uses the batch mean of the masked counts (the same unless
      a row committed a mask token or the prompts hold masks), and takes the top-k over the whole
      row, which could re-mask prompt or committed positions when a row has fewer than k masks.
  (b) Only completion positions are decoded; the reference also fills mask tokens inside the prompt.
  (c) Scores are computed in float32 (the reference: the logits' dtype, bfloat16 for Dream), and
      timesteps on the CPU, so a bf16 model on any device commits the same counts.
  (d) Equal confidences go to the leftmost position (commit_top_k's stable sort); the reference
      leaves ties to torch.topk. They occur only where p saturates at 1.0.
  (e) Left-padded prompts: positions are counted over real tokens (the model's 2-D mask), which is
      what the reference's tok_idx does; padding rows are never attended.

**Trajectory** (return_trajectory=True): commit_step [B, L] (the step that committed each position;
a re-decoded mask token keeps its last commit) and token_probs [B, S, L], the model's temperature-1
probability (of the vocab-limited logits) at each step of the position's final token, by
ddrl.sampling.trajectory's recorder with the whole completion as one block: it keeps every step's
[B, L, V] float32 distribution until the end, S * B * L * V * 4 bytes (only when recording).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from ddrl.contract import model_view
from ddrl.sampling.base import SampleOutput, model_mask_id
from ddrl.processes.draws import uniform_draw
from ddrl.sampling.checks import check_generator_given, check_prompts
from ddrl.sampling.commit import commit_top_k
from ddrl.sampling.settings import TokenFilters, check_choice, register_sampler
from ddrl.sampling.trajectory import ProbRecorder
from ddrl.types import COMMIT_ORDER
from ddrl.sampling.utils import completion_logits
from ddrl.types import Trajectory

ALGS = ("origin", "entropy", "maskgit_plus", "topk_margin")
ENTROPY_EPS = 1e-10  # the reference's log(p + 1e-10)


@dataclass
class DreamSettings(TokenFilters):
    """What rollout.name=dream reads: Dream's ordering and filters (top_p, top_k), and diffusion_generate's
    eps and vocab_limit (no YAML keys: a section with such attributes sets them)."""

    why_not: ClassVar[str] = ("it decodes the whole completion each step, without blocks, cache, guidance or compiled "
                              "steps")

    alg: str = "entropy"  # which masked positions to commit: origin | entropy | maskgit_plus | topk_margin
    alg_temp: float | None = None  # sample the positions to commit from softmax(confidence / alg_temp)
    eps: float = 1e-3  # the final timestep
    vocab_limit: int | None = None  # ids >= it are never chosen; None = the tokenizer's length (tokenizer_vocab_limit)

    def check(self, p: str, name: str, block_size: int | None) -> None:
        super().check(p, name, block_size)
        check_choice(p, "alg", self.alg, ALGS, "one of Dream's orderings")
        if self.alg_temp is not None and self.alg_temp < 0:
            raise ValueError(f"{p}alg_temp must be >= 0 or unset, got {self.alg_temp}")
        if self.alg == "origin" and self.alg_temp:
            raise ValueError(f"{p}alg_temp applies to the confidence orderings; alg='origin' commits at random by the "
                             f"schedule, so unset {p}alg_temp")


@dataclass
class DreamRun:
    """One dream_generate call's settings, resolved."""

    steps: int
    alg: str
    alg_temp: float | None
    temperature: float
    top_p: float | None
    top_k: int | None
    eps: float
    vocab_limit: int | None
    mask_id: int


# --------------------------------------------------------------------------------------------
# One step's pieces (pure functions of logits and uniforms)
# --------------------------------------------------------------------------------------------


def filtered_probs(logits: Tensor, temperature: float, top_p: float | None, top_k: int | None) -> Tensor:
    """[N, V] logits -> [N, V] float32 p: / temperature, top-p, top-k (as the reference's sample_tokens)."""
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    lowest = torch.finfo(logits.dtype).min
    if top_p is not None and top_p < 1:
        ranked, order = torch.sort(logits, descending=True)
        drop = torch.softmax(ranked, dim=-1).cumsum(-1) > top_p
        drop[..., 1:] = drop[..., :-1].clone()  # keep the token that crosses top_p
        drop[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter_(-1, order, drop), lowest)
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, lowest)
    return torch.softmax(logits, dim=-1)


def categorical_from_uniforms(probs: Tensor, u: Tensor) -> Tensor:
    """[N, V] probs (rows need not sum to 1), [N] uniforms in [0, 1) -> [N] long: inverse-CDF draws,
    in float64; zero-probability ids are never drawn (ddrl.processes.draws.sample_categorical, with
    the uniforms given so that they come from the sampler's generator)."""
    cdf = probs.double().cumsum(-1)  # [N, V]
    target = (u.double()[:, None] * cdf[:, -1:]).contiguous()
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


def confidence(probs: Tensor, x0: Tensor, alg: str) -> Tensor:
    """[N, V] p, [N] chosen tokens -> [N] the alg's confidence (module doc)."""
    if alg == "maskgit_plus":
        return probs.gather(-1, x0[:, None]).squeeze(-1)
    if alg == "topk_margin":
        top2 = probs.topk(2, dim=-1).values
        return top2[:, 0] - top2[:, 1]
    return (probs * torch.log(probs + ENTROPY_EPS)).sum(-1)  # entropy


def transfer_count(masked: Tensor, t: Tensor, s: Tensor, last: bool) -> Tensor:
    """[B, L] masked -> [B] positions to commit: floor(n (1 - s/t)), computed in float32 as the
    reference does (int() of a float32 product), n at the last step."""
    n = masked.sum(dim=1)
    if last:
        return n
    return (n.float() * (1 - s / t).to(n.device)).long()


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------


@dataclass
class _Decoded:
    completion: Tensor  # [B, L] long
    trajectory: Trajectory | None


@dataclass
class _Uniforms:
    """noise(n) -> the next [B, n] float64 uniforms of the generator's stream, on `device` (module doc)."""

    generator: torch.Generator
    batch_size: int
    device: torch.device

    def __call__(self, n: int) -> Tensor:
        return uniform_draw((self.batch_size, n), generator=self.generator, device=self.device, dtype=torch.float64)


@torch.no_grad()
def _denoise(model, prompt_ids: Tensor, prompt_mask: Tensor | None, cfg: DreamRun, gen_length: int,
             generator: torch.Generator | None, record: bool) -> _Decoded:
    B, L, device = prompt_ids.shape[0], gen_length, prompt_ids.device
    completion = torch.full((B, L), cfg.mask_id, dtype=torch.long, device=device)  # [B, L]
    commit_step = torch.full((B, L), -1, dtype=torch.long, device=device)
    timesteps = torch.linspace(1, cfg.eps, cfg.steps + 1)  # float32 on the CPU (deviation (c))
    noise = None if generator is None else _Uniforms(generator, B, device)  # _check: given when a step draws
    recorder = ProbRecorder(token_probs=record != COMMIT_ORDER) if record else None
    for i in range(cfg.steps):
        t, s, last = timesteps[i], timesteps[i + 1], i == cfg.steps - 1
        logits = completion_logits(model, prompt_ids, prompt_mask, completion, cfg_scale=0.0,
                                   mask_id=cfg.mask_id)  # [B, L, V], aligned
        if cfg.vocab_limit is not None:
            logits = logits.clone()
            logits[..., cfg.vocab_limit:] = float("-inf")
        masked = completion == cfg.mask_id  # [B, L]
        if recorder is not None:
            recorder.add_step(logits, None)
        if cfg.alg == "origin":
            assert noise is not None  # _check: "origin" needs a generator
            move = noise(L) < (1.0 if last else float(1 - s / t))  # [B, L]
            chosen = masked & move
            x0, _ = _decide(logits[chosen], cfg, noise, chosen)
        else:
            x0, probs = _decide(logits[masked], cfg, noise, masked)
            scores = torch.full((B, L), float("-inf"), device=device)
            scores[masked] = confidence(probs, x0, cfg.alg)
            k = transfer_count(masked, t, s, last)  # [B]
            if cfg.alg_temp:
                assert noise is not None  # _check: alg_temp > 0 needs a generator
                gumbel = -torch.log(-torch.log(noise(L)))  # [B, L] float64
                scores = scores.double() / cfg.alg_temp + gumbel  # -inf stays -inf: never drawn
            chosen = commit_top_k(scores, k) & masked
            x0 = x0[chosen[masked]]
        completion[chosen] = x0
        commit_step[chosen] = i
    trajectory = None
    if recorder is not None:
        recorder.close_block(0, 0, completion)
        trajectory = recorder.trajectory(commit_step, cfg.steps)
    return _Decoded(completion, trajectory)


def _decide(logits: Tensor, cfg: DreamRun, noise: _Uniforms | None, where: Tensor) -> tuple[Tensor, Tensor]:
    """Logits [N, V] of the positions `where` [B, L] (row-major order) -> (x0 [N], p [N, V])."""
    probs = filtered_probs(logits, cfg.temperature, cfg.top_p, cfg.top_k)
    if cfg.temperature > 0:
        assert noise is not None  # _check: temperature > 0 needs a generator
        x0 = categorical_from_uniforms(probs, noise(where.shape[1])[where])
    else:
        x0 = probs.max(dim=-1).indices
    return x0, probs


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def dream_generate(model, prompt_ids: Tensor, attention_mask: Tensor | None = None, *, steps: int, gen_length: int,
                   alg: str = "entropy", alg_temp: float | None = None, temperature: float = 0.0,
                   top_p: float | None = None, top_k: int | None = None, eps: float = 1e-3,
                   generator: torch.Generator | None = None, vocab_limit: int | None = None,
                   mask_id: int | None = None, return_trajectory: bool = False) -> Tensor | tuple[Tensor, Trajectory | None]:
    """Dream's diffusion_generate (module doc) on a DiffusionLM whose logits are aligned.

    prompt_ids      [B, P] long, left-padded; attention_mask [B, P] (1 = real token) or None.
    steps           model calls; gen_length L completion tokens (the reference's max_new_tokens).
    alg, alg_temp   ordering (ALGS) and, if > 0, the temperature of sampling positions by confidence.
    temperature     0 = greedy tokens; top_p / top_k filter as the reference does (also at temperature 0,
                    where they change the confidences but not x0).
    generator       required when the sampler draws: alg "origin", temperature > 0 or alg_temp > 0.
    vocab_limit     ids >= vocab_limit are never chosen (None: the whole vocabulary, as the reference).
    mask_id         default model.mask_token_id.
    Returns [B, P + L] (prompt + completion), and the Trajectory when return_trajectory=True.
    """
    mask_id = model_mask_id(model, "config.json mask_token_id, 151666 for Dream") if mask_id is None else int(mask_id)
    cfg = DreamRun(steps=steps, alg=alg, alg_temp=alg_temp, temperature=float(temperature), top_p=top_p,
                   top_k=top_k, eps=float(eps), vocab_limit=vocab_limit, mask_id=mask_id)
    _check(model, prompt_ids, attention_mask, cfg, gen_length, generator)
    mask = None if attention_mask is None else attention_mask.bool()
    out = _denoise(model, prompt_ids, mask, cfg, gen_length, generator, return_trajectory)
    sequence = torch.cat([prompt_ids, out.completion.to(prompt_ids.dtype)], dim=1)  # [B, P + L]
    return (sequence, out.trajectory) if return_trajectory else sequence


def needs_generator(alg: str, temperature: float, alg_temp: float | None) -> bool:
    return alg == "origin" or temperature > 0 or bool(alg_temp)


def _check(model, prompt_ids: Tensor, attention_mask: Tensor | None, cfg: DreamRun, gen_length: int,
           generator: torch.Generator | None) -> None:
    DreamSettings(steps=cfg.steps, gen_length=gen_length, temperature=cfg.temperature, alg=cfg.alg,
                  alg_temp=cfg.alg_temp, top_p=cfg.top_p, top_k=cfg.top_k).check("", "dream", None)
    check_prompts(prompt_ids, attention_mask)
    if prompt_ids.shape[1] == 0:
        raise ValueError("Dream's logits are shifted by one: the first completion token is predicted from the last "
                         "prompt token, so pass at least one prompt token")
    if not 0 < cfg.eps < 1:
        raise ValueError(f"eps (the final timestep) must be in (0, 1), got {cfg.eps}")
    view = model_view(model)
    vocab_size = view.vocab_size
    if cfg.vocab_limit is not None and not (isinstance(cfg.vocab_limit, int)
                                            and 0 < cfg.vocab_limit <= (vocab_size or cfg.vocab_limit)):
        raise ValueError(f"vocab_limit must be a number of ids in [1, vocab_size={vocab_size}] (e.g. len(tokenizer)) "
                         f"or None, got {cfg.vocab_limit!r}")
    if not 0 <= cfg.mask_id < (vocab_size or cfg.mask_id + 1):
        raise ValueError(f"mask_id={cfg.mask_id} is outside the model's vocabulary [0, {vocab_size})")
    max_len = view.max_seq_len
    if isinstance(max_len, int) and prompt_ids.shape[1] + gen_length > max_len:
        raise ValueError(f"prompt length {prompt_ids.shape[1]} + gen_length={gen_length} exceeds the model's "
                         f"max_seq_len={max_len}; shorten the prompt or lower gen_length")
    check_generator_given(generator, needs_generator(cfg.alg, cfg.temperature, cfg.alg_temp),
                          f"alg={cfg.alg!r}, temperature={cfg.temperature}, alg_temp={cfg.alg_temp}")


# --------------------------------------------------------------------------------------------
# The registry entry (rollout.name = dream)
# --------------------------------------------------------------------------------------------


def tokenizer_vocab_limit(model) -> int | None:
    """len(tokenizer) when the model's vocabulary is padded past it (Dream), else None."""
    view = model_view(model)
    tokenizer, vocab_size = view.tokenizer, view.vocab_size
    if tokenizer is None or vocab_size is None:
        return None
    n = len(tokenizer)
    return n if n < vocab_size else None


@register_sampler("dream", DreamSettings)
def sample_dream(model, prompt_ids: Tensor, prompt_mask: Tensor | None, cfg: Any, *,
                 generator: torch.Generator | None, return_trajectory: bool = False) -> SampleOutput:
    """Dream's diffusion_generate with the rollout config (completion only, [B, L]).

    Reads DreamSettings: rollout.steps, gen_length, temperature, alg, alg_temp, top_p, top_k, and, where
    the section has them, eps and vocab_limit (None = the tokenizer's length when the model's vocabulary is
    larger, so ids the tokenizer cannot decode are never sampled).
    No blocks, no KV cache, no guidance, no early exit: every row runs all steps.
    """
    s = DreamSettings.read(cfg, "rollout", name="dream")
    out = dream_generate(model, prompt_ids, prompt_mask, steps=s.steps, gen_length=s.gen_length, alg=s.alg,
                         alg_temp=s.alg_temp, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, eps=s.eps,
                         generator=generator,
                         vocab_limit=tokenizer_vocab_limit(model) if s.vocab_limit is None else s.vocab_limit,
                         return_trajectory=return_trajectory)
    sequence, trajectory = out if isinstance(out, tuple) else (out, None)
    P = prompt_ids.shape[1]
    return SampleOutput(completion_ids=sequence[:, P:], trajectory=trajectory, nfe=s.steps,
                        forward_tokens=s.steps * prompt_ids.shape[0] * (P + s.gen_length))
