"""LLaDA2.1's token-editing block decoding (the generate() of LLaDA2.1-mini's modeling_llada2_moe.py,
yjyddq/DARE @ 83ae8a3 models/LLaDA2.1-mini), batched: the "llada2_edit" sampler.

LLaDA2.0's generate() is SDAR's dynamic-threshold block decoding (ddrl's "block" sampler with
remasking="sdar_dynamic", threshold=0.95; steps per block = min(32, gen_length): its
`steps = min(steps, gen_length // minimal_topk)`, tests/unit/test_native_llada2.py). LLaDA2.1 adds
editing. Blocks follow the block layout (ddrl.processes.block; the first decoded block may hold the
prompt's tail; the canvas is ceil((P + L) / B) * B, as theirs), and each block is decoded by

    loop:
        masked = the block's mask slots; if none is left, post += 1; stop when post > max_post_steps
        x0, p  = argmax (temperature 0) or a draw of the tempered softmax, and its probability
        commit the masked slots with p > threshold if there are >= num_to_transfer of them,
               else the num_to_transfer most confident masked slots          (commit_dynamic)
        edit   every decoded, non-prompt slot of the block with p > editing_threshold and x0 != its token
        stop when the block had no mask at the start of the step and nothing was edited

so already decoded tokens of the current block are rewritten when the model now prefers another one
confidently; finished blocks never change, so the prompt and finished blocks are cached exactly
(one prefix pass per block, then the block alone against the cache).

Rows are decoded together: row i's canvas is placed so that every row's j-th decoded block occupies
the same columns (left padding of K - first_block_i * B slots, never attended); a row whose block is
finished (or that has fewer blocks) stays in the batch and commits nothing.

Deviations from theirs: (a) LLaDA2.1's generate() builds its block mask without .log(), a 0/1 float
mask that their attention adds to the scores, so nothing is masked there; here the block layout is
applied (2.0's mask, what the model is trained with; tests/fixtures/llada2/golden.json records both
and where they differ); (b) batched rows, left padding shifts nothing; (c) temperature > 0 draws by
Gumbel-max from ddrl's keyed noise (ddrl.sampling.utils.StepNoise), not torch.multinomial; (d) ties
go to the leftmost slot; (e) eos_early_stop is not implemented (their default is off; the trainer's
stop tokens cut the completion afterwards).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from ddrl.contract import model_view
from ddrl.sampling.base import SampleOutput, model_mask_id
from ddrl.sampling.cache import CACHE_MODES
from ddrl.sampling.checks import check_generator_given, check_prompts
from ddrl.sampling.sdar import commit_dynamic, tempered_confidence
from ddrl.sampling.settings import (OFF, SamplerSettings, check_block_length, check_choice, check_threshold, no_cache,
                                    one_block, register_sampler)
from ddrl.sampling.utils import StepNoise

# LLaDA2.1's generate() defaults
THRESHOLD, EDITING_THRESHOLD, MAX_POST_STEPS, NUM_TO_TRANSFER = 0.95, 0.9, 16, 1


@dataclass
class Llada2EditSettings(SamplerSettings):
    """What rollout.name=llada2_edit reads: blocks, the commit threshold, whether to cache (anything but
    none), and, where the section has them (no YAML keys), LLaDA2.1's editing_threshold and max_post_steps.
    steps is not used: each block runs until it is full and stable."""

    why_not: ClassVar[str] = ("LLaDA2.1's token editing commits above its thresholds block by block, without "
                              "guidance or another commit rule")

    block_length: int | None = field(default=None, metadata={OFF: one_block})  # None = the model's block size
    threshold: float | None = None  # the commit threshold; None = LLaDA2.1's 0.95
    cache: str = field(default="auto", metadata={OFF: no_cache})
    editing_threshold: float = EDITING_THRESHOLD
    max_post_steps: int = MAX_POST_STEPS

    def check(self, p: str, name: str, block_size: int | None) -> None:
        super().check(p, name, block_size)
        check_block_length(p, self.block_length)
        check_threshold(p, self.threshold)
        check_choice(p, "cache", self.cache, CACHE_MODES)


@torch.no_grad()
def edit_generate(model: Any, prompt_ids: Tensor, attention_mask: Tensor | None = None, *, gen_length: int,
                  block_length: int | None = None, threshold: float = THRESHOLD,
                  editing_threshold: float = EDITING_THRESHOLD, max_post_steps: int = MAX_POST_STEPS,
                  num_to_transfer: int = NUM_TO_TRANSFER, temperature: float = 0.0, mask_id: int | None = None,
                  generator: Any = None, cache: bool = True) -> tuple[Tensor, int]:
    """prompt_ids [B, P] left-padded, attention_mask [B, P] (1 = real) or None -> (completion [B, L], model calls).

    block_length defaults to model.block_size; cache=False runs the whole window every step."""
    check_prompts(prompt_ids, attention_mask)
    check_generator_given(generator, temperature > 0, "temperature > 0")
    mask_id = model_mask_id(model) if mask_id is None else int(mask_id)
    bs = int(block_length or model.block_size)
    device, (B, P), L = prompt_ids.device, prompt_ids.shape, gen_length
    real = torch.ones_like(prompt_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    n_prompt = real.long().sum(dim=1)  # [B]
    first = n_prompt // bs  # each row's first decoded block
    n_blocks = (n_prompt + L + bs - 1) // bs - first  # [B]
    K, J = int(first.max()) * bs, int(n_blocks.max())  # host reads: the layout
    width = K + J * bs
    pos = torch.arange(width, device=device)[None, :] - (K - first * bs)[:, None]  # [B, width] real position
    is_prompt = (pos >= 0) & (pos < n_prompt[:, None])
    valid = (pos >= 0) & (pos < ((first + n_blocks) * bs)[:, None])  # the row's canvas: real keys
    src = (P - n_prompt)[:, None] + pos.clamp(min=0)  # the prompt column of each prompt slot
    ids = torch.where(is_prompt, prompt_ids.gather(1, src.clamp(max=P - 1)), torch.full_like(pos, mask_id))
    pad = model_view(model).pad_token_id
    ids = torch.where(valid, ids, torch.full_like(ids, mask_id if pad is None else int(pad)))
    noise = StepNoise(generator, B, device) if temperature > 0 else None
    nfe = 0
    for j in range(J):
        s, e = K + j * bs, K + (j + 1) * bs
        done = j >= n_blocks  # [B] rows without a j-th block
        post = torch.zeros(B, dtype=torch.long, device=device)
        past = None
        if cache and s > 0:
            past = model(ids[:, :s], attention_mask=valid[:, :s], use_cache=True).past_key_values
            nfe += 1
        step = 0
        while True:
            window = ids[:, s:e]
            masked = (window == mask_id) & valid[:, s:e]  # [B, W]
            no_mask = ~masked.any(dim=1)
            post = post + (no_mask & ~done).long()
            done = done | (post > max_post_steps)
            if bool(done.all()):
                break
            if past is not None:
                logits = model(window, attention_mask=valid[:, :e], past_key_values=past).logits  # [B, W, V]
            else:
                logits = model(ids[:, :e], attention_mask=valid[:, :e]).logits[:, s:e]
            nfe += 1
            uniforms = None
            if noise is not None:
                noise.begin_step(s, step)
                uniforms = noise(*logits.shape[1:])
            x0, p = tempered_confidence(logits.float(), temperature, uniforms=uniforms)  # [B, W]
            k = torch.full((B,), num_to_transfer, device=device)
            commit = commit_dynamic(p, masked, threshold, k)
            edit = ~masked & ~is_prompt[:, s:e] & valid[:, s:e] & (p > editing_threshold) & (x0 != window)
            change = (commit | edit) & ~done[:, None]
            ids[:, s:e] = torch.where(change, x0, window)
            done = done | (no_mask & ~(edit & ~done[:, None]).any(dim=1))
            step += 1
    take = (K - first * bs + n_prompt)[:, None] + torch.arange(L, device=device)[None, :]  # [B, L]
    return ids.gather(1, take), nfe


@register_sampler("llada2_edit", Llada2EditSettings)
def sample_llada2_edit(model, prompt_ids: Tensor, prompt_mask: Tensor | None, cfg: Any, *,
                       generator: Any = None, return_trajectory: bool = False) -> SampleOutput:
    """LLaDA2.1's token-editing block decoding (module doc), completion only [B, L].

    cfg.threshold (default 0.95) is the commit threshold; cfg.steps is not used (each block runs until
    it is full and stable, at most block_length + max_post_steps calls); editing_threshold and
    max_post_steps are LLaDA2.1's defaults (0.9, 16), or the config's when it has them."""
    if return_trajectory:
        raise ValueError("the llada2_edit sampler records no trajectory (edits rewrite committed tokens); use an "
                         "estimator that needs none, or rollout.name=block")
    s = Llada2EditSettings.read(cfg, "rollout", name="llada2_edit")
    completion, nfe = edit_generate(
        model, prompt_ids, prompt_mask, gen_length=s.gen_length, block_length=s.block_length,
        threshold=THRESHOLD if s.threshold is None else s.threshold, editing_threshold=s.editing_threshold,
        max_post_steps=s.max_post_steps, temperature=s.temperature, generator=generator, cache=s.cache != "none")
    return SampleOutput(completion_ids=completion, trajectory=None, nfe=nfe)
