"""Block diffusion: BD3-LM (Arriola et al. 2025) / SDAR / TraDo, and the one-pass "staircase" ELBO
of StableDRL (ALGORITHMS.md §1.6).

The completion is cut into blocks of `block_size` tokens, generated left to right; inside a block
tokens are denoised by masked diffusion conditioned on the prompt and the *clean* earlier blocks.
So each block b has its own time t_b, and the NELBO is a sum of per-block MDLM NELBOs:

    -log p(x) <= sum_b E_{t_b} E_{x_t^b} [ w(t_b) sum_{i in b, masked} -log p_theta(x^i | x_t^b, x^{<b}, c) ]

with w(t) = -alpha'(t) / (1 - alpha(t)) (= 1/t, linear schedule).

Block ids (our convention, used by every function here): completion position j is in block
j // block_size; every prompt token is in block -1, i.e. the prompt is one block before the
completion that all completion blocks see, and prompt tokens see each other bidirectionally.
Padding keys are never attended. A block model's own block-causal attention must use the same
convention for training and sampling to agree.

Staircase (dual-stream) attention, one forward pass for all blocks (BD3-LM's vectorised training;
StableDRL Fig. 3). Input = [clean sequence (T tokens), noisy sequence (T tokens)], the noisy copy
with the SAME position ids. With b(.) the block id of a token, query q may attend key k if

    clean q -> clean k :  b(k) <= b(q)     block-causal clean context
    noisy q -> clean k :  b(k) <  b(q)     strictly earlier blocks, never its own clean copy
    noisy q -> noisy k :  b(k) == b(q)     its own noisy block
    clean q -> noisy k :  never

and k is not padding. Logits read on the noisy stream then equal, for every block at once, those
of the slow computation that runs [prompt, clean blocks < b, noisy block b] through the same
block-causal model (`blockwise_elbo`, kept as the reference).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ddrl.processes.base import check_eligible, check_tokens
from ddrl.processes.masked import MaskedProcess, _per_token_loss
from ddrl.processes.schedules import Schedule
from ddrl.registry import PROCESSES

PROMPT_BLOCK = -1  # block id of every prompt (and left-padding) token


@PROCESSES.register("block")
class BlockMaskedProcess(MaskedProcess):
    name = "block"

    def __init__(self, mask_token_id: int, block_size: int, schedule: str | Schedule = "linear"):
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int (tokens per diffusion block, e.g. 4), got {block_size!r}")
        super().__init__(mask_token_id, schedule)
        self.block_size = block_size

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(mask_token_id={self.mask_token_id}, block_size={self.block_size}, "
                f"schedule={self.schedule.name!r})")

    def num_blocks(self, length: int) -> int:
        """Blocks covering `length` completion tokens (the last one may be shorter)."""
        return math.ceil(length / self.block_size)

    def sample_t(self, batch_size: int, *, generator: torch.Generator, device: torch.device | str | None = None,
                 eps: float = 1e-3, stratified: bool = False, length: int | None = None) -> Tensor:
        """One time per block, t_b ~ U[eps, 1] independently: [batch_size, num_blocks(length)]."""
        if length is None or length <= 0:
            raise ValueError("BlockMaskedProcess.sample_t needs length=<completion length> (one t is drawn per block), "
                             f"got length={length!r}")
        n = self.num_blocks(length)
        t = super().sample_t(batch_size * n, generator=generator, device=device, eps=eps, stratified=stratified)
        return t.view(batch_size, n)

    def token_times(self, t: Tensor, shape: torch.Size | tuple[int, int]) -> Tensor:
        """Per-token times [B, L] from t [B], per-block t [B, num_blocks(L)] or per-token t [B, L]."""
        B, L = shape
        n = self.num_blocks(L)
        if t.dim() == 2 and tuple(t.shape) == (B, n) and n != L:
            block_of = torch.arange(L, device=t.device) // self.block_size  # [L]
            return t[:, block_of]
        if t.dim() == 2 and tuple(t.shape) not in ((B, n), (B, L)):
            raise ValueError(f"t must have shape [B]=[{B}], [B, num_blocks]=[{B}, {n}] or [B, L]=[{B}, {L}], "
                             f"got {list(t.shape)}")
        return super().token_times(t, shape)

    def pretrain_loss(self, model: Any, x0: Tensor, eligible: Tensor, attention_mask: Tensor | None = None, *,
                      generator: torch.Generator, eps: float = 1e-3,
                      num_tokens: float | Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """BD3-LM pretraining loss per eligible token, all blocks in one staircase forward pass.

        x0: [B, T]; eligible: [B, T] bool, the completion (blocks start at each row's first
        eligible position; earlier positions form the prompt block); attention_mask: [B, T] bool or
        None. The model must accept a [B, 2T, 2T] bool attention_mask and position_ids [B, 2T].
        """
        check_tokens(x0)
        eligible = check_eligible(eligible, x0)
        B, T = x0.shape
        has_any = eligible.any(dim=1)
        start = torch.where(has_any, eligible.int().argmax(dim=1), torch.full_like(has_any, T, dtype=torch.long))
        rel = torch.arange(T, device=x0.device)[None, :] - start[:, None]  # [B, T], < 0 on the prompt
        block_ids = torch.where(rel >= 0, rel.div(self.block_size, rounding_mode="floor"), PROMPT_BLOCK)
        t_blocks = self.sample_t(B, generator=generator, device=x0.device, eps=eps,
                                 length=max(T - int(start.min()), 1))  # [B, n_blocks]
        t_tok = t_blocks.gather(1, block_ids.clamp(min=0))  # [B, T]; prompt entries unused
        xt, noised = self.noise(x0, t_tok, generator=generator, eligible=eligible)
        key_valid = torch.ones_like(eligible) if attention_mask is None else attention_mask.bool()
        logits = _staircase_noisy_logits(model, x0, xt, block_ids, key_valid)  # [B, T, V]
        nelbo = self.nelbo(logits, x0, noised, t_tok)
        return _per_token_loss(nelbo, eligible, noised, num_tokens)


# --------------------------------------------------------------------------------------------
# Staircase construction (pure functions)
# --------------------------------------------------------------------------------------------


def position_ids_from_mask(key_valid: Tensor) -> Tensor:
    """[B, T] positions counting only real tokens, so left padding does not shift them."""
    return (key_valid.long().cumsum(dim=1) - 1).clamp(min=0)


def block_causal_mask(block_ids: Tensor, key_valid: Tensor) -> Tensor:
    """[B, T, T] bool (True = may attend): q sees k iff b(k) <= b(q) and k is not padding.

    The diagonal is always allowed so that a padding query has a non-empty softmax row (its output
    is never read, but a NaN there would leak into real tokens through 0 * NaN in the next layer).
    """
    bq, bk = block_ids[:, :, None], block_ids[:, None, :]
    eye = torch.eye(block_ids.shape[1], dtype=torch.bool, device=block_ids.device)
    return ((bk <= bq) & key_valid[:, None, :].bool()) | eye


def staircase_mask(block_ids: Tensor, key_valid: Tensor) -> Tensor:
    """[B, 2T, 2T] bool staircase attention for [clean | noisy] streams sharing block ids [B, T]."""
    bq, bk = block_ids[:, :, None], block_ids[:, None, :]
    valid = key_valid[:, None, :].bool()
    clean_to_clean = (bk <= bq) & valid
    noisy_to_clean = (bk < bq) & valid
    noisy_to_noisy = (bk == bq) & valid
    clean_to_noisy = torch.zeros_like(clean_to_clean)
    mask = torch.cat([torch.cat([clean_to_clean, clean_to_noisy], dim=2),
                      torch.cat([noisy_to_clean, noisy_to_noisy], dim=2)], dim=1)
    eye = torch.eye(mask.shape[1], dtype=torch.bool, device=mask.device)
    return mask | eye  # diagonal: see block_causal_mask


def completion_block_ids(prompt_mask: Tensor, length: int, block_size: int) -> Tensor:
    """[B, P + L] block ids: PROMPT_BLOCK on the prompt (padding included), j // block_size on completion j."""
    B, P = prompt_mask.shape
    completion = torch.arange(length, device=prompt_mask.device) // block_size
    return torch.cat([torch.full((B, P), PROMPT_BLOCK, dtype=torch.long, device=prompt_mask.device),
                      completion[None, :].expand(B, length)], dim=1)


def staircase_inputs(prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, noisy_completion: Tensor,
                     block_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """The dual-stream input of the one-pass block ELBO.

    prompt_ids [B, P] (left-padded), prompt_mask [B, P] bool, completion_ids and noisy_completion
    [B, L]. Returns input_ids [B, 2T] = [prompt, completion | prompt, noisy completion],
    position_ids [B, 2T] (the noisy half repeats the clean half's) and attn_mask [B, 2T, 2T] bool
    (True = may attend), T = P + L.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if tuple(prompt_mask.shape) != tuple(prompt_ids.shape):
        raise ValueError(f"prompt_mask must have the shape of prompt_ids {list(prompt_ids.shape)}, got {list(prompt_mask.shape)}")
    if tuple(noisy_completion.shape) != tuple(completion_ids.shape) or completion_ids.shape[0] != prompt_ids.shape[0]:
        raise ValueError(f"completion_ids {list(completion_ids.shape)} and noisy_completion {list(noisy_completion.shape)} "
                         f"must both be [B, L] with B = prompt_ids.shape[0] = {prompt_ids.shape[0]}")
    B, L = completion_ids.shape
    clean = torch.cat([prompt_ids, completion_ids], dim=1)  # [B, T]
    noisy = torch.cat([prompt_ids, noisy_completion], dim=1)  # [B, T]
    key_valid = torch.cat([prompt_mask.bool(), torch.ones_like(completion_ids, dtype=torch.bool)], dim=1)
    block_ids = completion_block_ids(prompt_mask, L, block_size)
    positions = position_ids_from_mask(key_valid)
    return (torch.cat([clean, noisy], dim=1), torch.cat([positions, positions], dim=1),
            staircase_mask(block_ids, key_valid))


def _staircase_noisy_logits(model: Any, clean: Tensor, noisy: Tensor, block_ids: Tensor, key_valid: Tensor) -> Tensor:
    """One forward pass over [clean | noisy] [B, 2T]; returns the noisy stream's logits [B, T, V]."""
    T = clean.shape[1]
    positions = position_ids_from_mask(key_valid)
    logits = model(torch.cat([clean, noisy], dim=1), attention_mask=staircase_mask(block_ids, key_valid),
                   position_ids=torch.cat([positions, positions], dim=1)).logits  # [B, 2T, V]
    return logits[:, T:]


# --------------------------------------------------------------------------------------------
# Block ELBO for RL: one pass (staircase) and the block-by-block reference
# --------------------------------------------------------------------------------------------


def _block_noise(process: BlockMaskedProcess, completion_ids: Tensor, completion_mask: Tensor | None,
                 generator: torch.Generator, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Draw t_b per block and mask the completion: noisy [B, L], noised [B, L] bool, per-token t [B, L]."""
    check_tokens(completion_ids, "completion_ids")
    B, L = completion_ids.shape
    t_blocks = process.sample_t(B, generator=generator, device=completion_ids.device, eps=eps, length=L)
    t_tok = process.token_times(t_blocks, (B, L))
    noisy, noised = process.noise(completion_ids, t_tok, generator=generator, eligible=completion_mask)
    return noisy, noised, t_tok


def _elbo_from_logits(process: BlockMaskedProcess, logits: Tensor, completion_ids: Tensor, noised: Tensor,
                      t_tok: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    token_logp = -process.weighted_token_nll(logits, completion_ids, noised, t_tok)  # [B, L]
    return token_logp.sum(dim=1), token_logp, noised


def _make_process(model: Any, block_size: int, mask_token_id: int | None, schedule: str) -> BlockMaskedProcess:
    mask_id = getattr(model, "mask_token_id", None) if mask_token_id is None else mask_token_id
    if mask_id is None:
        raise ValueError("no mask token id: pass mask_token_id=... or use a model with a .mask_token_id attribute")
    return BlockMaskedProcess(mask_id, block_size, schedule)


def staircase_elbo(model: Any, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, block_size: int, *,
                   generator: torch.Generator, completion_mask: Tensor | None = None, mask_token_id: int | None = None,
                   schedule: str = "linear", eps: float = 1e-3) -> tuple[Tensor, Tensor, Tensor]:
    """One-sample block-diffusion ELBO of the completions, all blocks in ONE forward pass.

    Draws t_b ~ U[eps, 1] per block, masks each eligible token (completion_mask [B, L] bool,
    default all) of block b with probability 1 - alpha(t_b), runs the staircase input [B, 2T]
    through `model(input_ids, attention_mask=[B, 2T, 2T] bool, position_ids=[B, 2T])` and reads the
    noisy stream. Returns elbo [B] = sum_b sum_{i in b, masked} w(t_b) log p_theta(x^i | ...),
    token_logp [B, L] (those weighted terms, 0 where not masked; token_logp.sum(1) == elbo) and
    noised [B, L] bool. mask_token_id defaults to model.mask_token_id.
    """
    process = _make_process(model, block_size, mask_token_id, schedule)
    noisy, noised, t_tok = _block_noise(process, completion_ids, completion_mask, generator, eps)
    input_ids, position_ids, attn_mask = staircase_inputs(prompt_ids, prompt_mask, completion_ids, noisy, block_size)
    logits = model(input_ids, attention_mask=attn_mask, position_ids=position_ids).logits  # [B, 2T, V]
    noisy_completion_logits = logits[:, input_ids.shape[1] - completion_ids.shape[1]:]  # [B, L, V]
    return _elbo_from_logits(process, noisy_completion_logits, completion_ids, noised, t_tok)


def blockwise_elbo(model: Any, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, block_size: int, *,
                   generator: torch.Generator, completion_mask: Tensor | None = None, mask_token_id: int | None = None,
                   schedule: str = "linear", eps: float = 1e-3) -> tuple[Tensor, Tensor, Tensor]:
    """The same ELBO as `staircase_elbo` (same generator -> same noise), the slow way.

    One forward pass per block b on [prompt, clean blocks < b, noisy block b] with the ordinary
    block-causal mask. The reference that the one-pass construction is tested against.
    """
    process = _make_process(model, block_size, mask_token_id, schedule)
    noisy, noised, t_tok = _block_noise(process, completion_ids, completion_mask, generator, eps)
    B, P = prompt_ids.shape
    L = completion_ids.shape[1]
    block_ids = completion_block_ids(prompt_mask, L, block_size)  # [B, T]
    key_valid = torch.cat([prompt_mask.bool(), torch.ones_like(completion_ids, dtype=torch.bool)], dim=1)
    positions = position_ids_from_mask(key_valid)
    per_block = []
    for lo in range(0, L, block_size):
        hi = min(lo + block_size, L)
        ids = torch.cat([prompt_ids, completion_ids[:, :lo], noisy[:, lo:hi]], dim=1)  # [B, P + hi]
        mask = block_causal_mask(block_ids[:, :P + hi], key_valid[:, :P + hi])
        logits = model(ids, attention_mask=mask, position_ids=positions[:, :P + hi]).logits
        per_block.append(logits[:, P + lo:])  # [B, hi - lo, V]
    return _elbo_from_logits(process, torch.cat(per_block, dim=1), completion_ids, noised, t_tok)
