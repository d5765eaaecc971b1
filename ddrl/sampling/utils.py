"""Pieces every sampler shares: the per-step noise, Gumbel-max sampling, the committed token's
probability, guided logits and the one model call that returns the completion's logits.

These are pure functions of their inputs (randomness comes in as already drawn uniforms or from
StepNoise, which is seeded from the caller's explicit generator), so each sampler reads as one loop
over steps.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddrl.logits import kept_logits
from ddrl.contract import model_view
from ddrl.processes.draws import RowGenerators, chunk_seeds, row_chunks

# rollout.noise_dtype: the dtype of the masked samplers' uniforms (module doc of StepNoise).
NOISE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float64": torch.float64}

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One round of SplitMix64 (Steele et al. 2014): a bijective 64-bit mixer, so distinct keys give
    unrelated seeds."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def keyed_seed(*key: int) -> int:
    """A 64-bit seed that is a fixed function of the integer key (seed, block, step, draw)."""
    h = 0
    for part in key:
        h = _splitmix64(h ^ (part & _MASK64))
    return h


class StepNoise:
    """The noise of one sampler call: uniforms in [0, 1) for all B rows, drawn on the model's device.

    Keyed, not streamed. Each chunk of rows (one generator's rows of a RowGenerators, or the whole
    batch for a plain Generator) takes one seed from its generator when the call first needs noise
    (ddrl.processes.draws.chunk_seeds: one host read per call). The k-th draw of step s of the block
    starting at slot `start` then fills the chunk's rows from a generator on the model's device seeded
    with keyed_seed(chunk seed, start, s, k). So
      * noise is made where the model is, in `dtype` (float32 by default): no [B, W, V] float64
        tensor on the CPU and no host-to-device copy per step;
      * a chunk's numbers depend only on its own seed, its own rows and (block, step, draw), not on
        the other chunks in the batch nor on how many steps a block took for them (threshold decoding
        runs a block until its slowest row is full; early exit ends the call when every row is done):
        a batched call over several groups gives each group what a call on that group alone gives
        (same padded prompts), which the trainer's one-call-per-rank rollout relies on.
    The stream differs from a CPU draw of the same seed (the device's own generator makes it), so a
    rollout on CUDA is not the CPU rollout of the same seed; it is a fixed function of the seed on
    either. Reseeding a generator is host-only work (no device sync); a captured CUDA graph could not
    reseed, and would need graph-safe generator states instead (the sampler captures no graphs today).

    float32 uniforms are multiples of 2^-24 (on CUDA too, near 1), so the Gumbel noise -log(-log U)
    is capped at about 16.6: a token whose tempered probability is below ~e^-16.6 = 6e-8 is (almost)
    never drawn, and the probability mass lost is of the order of the total mass of such tokens
    (under 1% even if all 126k of LLaDA's ids sat there). float64 uniforms move the cap to ~1e-16:
    rollout.noise_dtype=float64, at twice the memory of the [B, W, V] draw.
    """

    def __init__(self, generator: torch.Generator | RowGenerators, batch_size: int, device: torch.device,
                 dtype: torch.dtype = torch.float32):
        row_chunks(generator, batch_size)  # a RowGenerators that does not cover the batch fails here, before any call
        self.generator, self.batch_size = generator, batch_size
        self.device, self.dtype = torch.device(device), dtype
        self.chunks: list[tuple[int, int, int]] | None = None  # (lo, hi, seed), drawn at the first use
        self.device_generator = torch.Generator(device=self.device)
        self.key = (0, 0)
        self.draws = 0

    def begin_step(self, start: int, step: int) -> None:
        """Key the next draws by the block (its first slot) and the step inside it."""
        self.key, self.draws = (start, step), 0

    def __call__(self, *tail: int) -> Tensor:
        """[B, *tail] uniforms in [0, 1), self.dtype, on self.device: the next draw of this step."""
        if self.chunks is None:
            self.chunks = chunk_seeds(self.generator, self.batch_size)
        out = torch.empty((self.batch_size, *tail), dtype=self.dtype, device=self.device)
        for lo, hi, seed in self.chunks:
            self.device_generator.manual_seed(keyed_seed(seed, *self.key, self.draws))
            out[lo:hi].uniform_(generator=self.device_generator)
        self.draws += 1
        return out


def gumbel_argmax(logits: Tensor, temperature: float, uniforms: Tensor | None, *, consume: bool = False,
                  offset: int | None = None) -> Tensor:
    """A draw from softmax(logits / temperature) by the Gumbel-max trick; argmax when temperature is 0.

    logits [..., V], uniforms [..., V] in [0, 1) (ignored at temperature 0) -> [...] long. Computed
    in the uniforms' dtype; consume=True overwrites `uniforms` in place instead of allocating the
    scores (the samplers' per-step draw, [B, W, V], is used once).

    offset: the logits are those of ids [offset, offset + C) of wider uniforms [..., V'] (an image
    model's codebook inside the V' ids the draw was keyed over: the emerge sampler keeps the noise of
    every id so that a seed gives the tokens it gave with full-vocabulary logits). The noise is then
    made over all V' exactly as without offset (the codebook's noise is then the same numbers bit for
    bit; transforming the slice alone could round its unvectorised tail differently) and read at the C
    ids; the result indexes the logits, [0, C).

    LLaDA's reference computes argmax(exp(logits) / (-log U)^temperature) in float64. Its log,
    argmax(logits - temperature * log(-log U)), picks the same token from the same U without
    overflowing exp() for logits above ~709 (or underflowing all of them to 0 below ~-745).
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    C = logits.shape[-1]
    lo, hi = (0, C) if offset is None else (offset, offset + C)
    if uniforms is None or uniforms.shape[:-1] != logits.shape[:-1] or not (
            uniforms.shape[-1] == C if offset is None else 0 <= lo and hi <= uniforms.shape[-1]):
        raise ValueError(f"uniforms must have the logits' shape {list(logits.shape)} when temperature > 0"
                         + ("" if offset is None else f", or cover ids [{lo}, {hi}) of the last dim"))
    scores = uniforms if consume else uniforms.clone()
    scores.log_().neg_().log_().mul_(-temperature)  # -temperature * log(-log U): tempered Gumbel noise
    scores = scores if offset is None else scores[..., lo:hi]  # [..., C]
    same = torch.promote_types(logits.dtype, scores.dtype) == scores.dtype
    return scores.add_(logits if same else logits.to(scores.dtype)).argmax(dim=-1)


def chosen_probability(logits: Tensor, tokens: Tensor) -> Tensor:
    """softmax(logits)[tokens] in float64: logits [..., V], tokens [...] long -> [...] float64.

    The reference ranks commits by float64 probabilities (float32 rounds p = 1 - 1e-9 to 1.0 and ties
    positions it orders). Here the exponentials are float32 and only their sum and the chosen entry
    are float64, so no [..., V] float64 copy of the logits is made; the result is within ~1e-7
    (relative) of the float64 softmax and keeps the reference's order except at such near-ties.
    """
    z = logits if logits.dtype == torch.float64 else logits.float()  # [..., V]
    top = z.amax(dim=-1, keepdim=True)  # [..., 1]
    total = (z - top).exp_().sum(dim=-1, dtype=torch.float64)  # [...]
    chosen = z.gather(-1, tokens[..., None]).squeeze(-1).double()  # [...]
    return (chosen - top.squeeze(-1).double()).exp() / total


def guided_logits(cond: Tensor, uncond: Tensor, cfg_scale: float) -> Tensor:
    """Classifier-free guidance with weight w: uncond + (w + 1)(cond - uncond).

    This is LLaDA's form (docs/diffusion.md#classifier-free-guidance); MaskGIT/MMaDA's
    (1 + w) cond - w uncond is the same expression expanded, so one function serves both samplers.
    Computed in the logits' dtype, as the reference does.
    A token that either pass forbids (logit -inf, e.g. the mask token of a SUBS denoiser) stays
    forbidden; the bare formula would make it NaN (-inf - -inf) and argmax would pick it.
    """
    guided = uncond + (cfg_scale + 1.0) * (cond - uncond)
    return guided.masked_fill(torch.isneginf(cond) | torch.isneginf(uncond), float("-inf"))


def completion_suffix(model, completion: Tensor) -> Tensor:
    """[A, S] long: the model's fixed ids after every completion (`model.completion_suffix`, e.g. MMaDA's
    <|eoi|> after an image, ddrl.models.mmada); [A, 0] for models without one."""
    ids = model_view(model).completion_suffix
    return torch.tensor(ids, dtype=torch.long, device=completion.device).expand(completion.shape[0], len(ids))


def unconditional_prompt(model, prompt_ids: Tensor, real: Tensor, mask_id: int) -> tuple[Tensor, Tensor]:
    """The guidance pass's prompt and its real tokens, [A, P] each: the model's own unconditional prompt
    (`model.cfg_unconditional_prompt`: MMaDA's empty caption in its layout) left-padded to P, else ddrl's
    form, every real prompt token replaced by mask_id (`real` is then returned as it is)."""
    ids = model_view(model).cfg_unconditional_prompt
    if ids is None:
        return prompt_ids.masked_fill(real, mask_id), real
    A, P = prompt_ids.shape
    if len(ids) > P:
        raise ValueError(f"the unconditional prompt has {len(ids)} tokens, more than the {P} of the prompts")
    row = torch.tensor([mask_id] * (P - len(ids)) + list(ids), dtype=prompt_ids.dtype, device=prompt_ids.device)
    valid = torch.arange(P, device=prompt_ids.device) >= P - len(ids)
    return row.expand(A, P), valid.expand(A, P)


def codebook_range(model) -> tuple[int, int] | None:
    """The vocabulary ids [lo, hi) of an image model's codes, when its completions are image codes (its
    logits_range is its image_token_range: a text-to-image MMaDA, URSA), else None. The image samplers
    ask such a model for those logits only (completion_logits' class_range: 8,192 of MMaDA-8B's 134,656
    ids); every other id's logit is suppressed there, so its probability is 0 and it is never drawn."""
    view = model_view(model)
    codes, image = view.logits_range, view.image_token_range
    if codes is None or image is None or tuple(codes) != tuple(image):
        return None
    return int(codes[0]), int(codes[1])


def completion_logits(model, prompt_ids: Tensor, prompt_mask: Tensor | None, completion: Tensor, *,
                      cfg_scale: float, mask_id: int, window: tuple[int, int] | None = None,
                      class_range: tuple[int, int] | None = None) -> Tensor:
    """One model call on [prompt, completion]; returns the logits of the completion positions [A, L, V].

    prompt_ids [A, P] (left-padded), prompt_mask [A, P] bool (True on real tokens) or None (no mask
    is passed to the model, like the reference), completion [A, L]. window=(lo, hi): only the
    completion positions [lo, hi) are computed and returned ([A, hi - lo, V], a sampler's block).
    With cfg_scale > 0 the conditional and unconditional inputs go through the model as one batch
    of 2A rows; the unconditional input has every real prompt token replaced by mask_id (padding is
    left as it is, the attention mask hides it), or is the model's own unconditional prompt
    (unconditional_prompt). A model's completion suffix follows the completion in every row.
    class_range=(a, b): the logits of vocabulary ids [a, b) only, [A, L, b - a] (kept_logits' class_range:
    a DiffusionLM's head computes those alone), guided as the full ones are.
    The logits must be aligned (position i predicts the clean token at i): DiffusionLM realigns a
    Dream backbone's shifted logits itself (ddrl.models.diffusion_lm), so the last L positions are
    read here whatever `logits_shifted` says; reading them one position earlier again would shift twice.
    """
    P, L = prompt_ids.shape[1], completion.shape[1]
    suffix = completion_suffix(model, completion)  # [A, S]: fixed ids after the completion (MMaDA's <|eoi|>)
    x = torch.cat([prompt_ids, completion, suffix], dim=1)  # [A, T]
    attn = None
    if prompt_mask is not None:
        attn = torch.cat([prompt_mask, torch.ones_like(completion, dtype=torch.bool),
                          torch.ones_like(suffix, dtype=torch.bool)], dim=1)  # [A, T]
    if cfg_scale > 0:
        real = prompt_mask if prompt_mask is not None else torch.ones_like(prompt_ids, dtype=torch.bool)
        uncond_prompt, uncond_real = unconditional_prompt(model, prompt_ids, real, mask_id)
        uncond = torch.cat([uncond_prompt, completion, suffix], dim=1)
        x = torch.cat([x, uncond], dim=0)  # [2A, T]
        if attn is not None or uncond_real is not real:  # [2A, T]
            rest = torch.ones(completion.shape[0], L + suffix.shape[1], dtype=torch.bool, device=x.device)
            attn = torch.cat([torch.cat([real, rest], dim=1), torch.cat([uncond_real, rest], dim=1)], dim=0)
    if window is None:  # [A or 2A, L, V]: the LM head on the completion only
        keep = torch.arange(P, P + L, device=x.device) if suffix.shape[1] else L
        logits = kept_logits(model, x, attn, logits_to_keep=keep, class_range=class_range)
    else:  # [A or 2A, hi - lo, V]: only completion positions [lo, hi) (a sampler's block)
        lo, hi = window
        logits = kept_logits(model, x, attn, logits_to_keep=torch.arange(P + lo, P + hi, device=x.device),
                             class_range=class_range)
    if cfg_scale > 0:
        cond, uncond_logits = logits.chunk(2, dim=0)
        logits = guided_logits(cond, uncond_logits, cfg_scale)
    return logits  # [A, L, V]
