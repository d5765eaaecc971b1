"""Block diffusion: BD3-LM (Arriola et al. 2025) / SDAR / TraDo, and the one-pass "staircase" ELBO
of StableDRL (docs/diffusion.md#block-diffusion).

The completion is cut into blocks of `block_size` tokens, generated left to right; inside a block
tokens are denoised by masked diffusion conditioned on the prompt and the *clean* earlier blocks.
So each block b has its own time t_b, and the NELBO is a sum of per-block MDLM NELBOs:

    -log p(x) <= sum_b E_{t_b} E_{x_t^b} [ w(t_b) sum_{i in b, masked} -log p_theta(x^i | x_t^b, x^{<b}, c) ]

with w(t) = -alpha'(t) / (1 - alpha(t)) (= 1/t, linear schedule).

**The block layout** (one source of truth: `block_ids` here; the block sampler, every estimator,
block pretraining and the built-in and native block models all call it). It is the layout SDAR's
own `block_diffusion_generate` samples with (JetAstra/SDAR generate.py): blocks are counted from the
first real token of the sequence, prompt included, so

    block(token) = position(token) // block_size,   position = index among the row's real tokens

and a query attends a key iff block(key) <= block(query) and the key is not padding: block-causal
inside the prompt too, bidirectional inside a block. When the prompt length is not a multiple of
block_size, the completion's first block also holds the prompt's last tokens. Left padding shifts
nothing (positions count real tokens). (TraDo's RL trainer, dLLM-RL rl_sdar.py, instead aligns the
completion's blocks to the prompt end; ddrl follows the sampler the checkpoints are decoded with.)

**Whole blocks.** The model always sees whole blocks, as it was trained and as SDAR decodes
(block_diffusion_generate's canvas is ceil((P + L) / block_size) * block_size long): a completion
that ends inside a block is followed by mask tokens up to the block's end, `block_tail` of them.
The block sampler decodes those slots and drops them (ddrl.sampling.masked); every scoring pass
here and in the estimators (ddrl.estimators.common.forward_logprobs) feeds them as mask tokens,
real keys of the last block, so a token of the last block is scored in the view it was sampled in.
In a batch, rows with a shorter tail get padding after it (never attended).

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

from ddrl.contract import model_view
from ddrl.logits import kept_logits
from ddrl.processes.base import check_eligible, check_tokens
from ddrl.processes.masked import MaskedProcess, _per_token_loss
from ddrl.processes.schedules import Schedule
from ddrl.registry import PROCESSES



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
        """Per-token times [B, L] from t [B], per-block t [B, num_blocks(L)] or per-token t [B, L].

        Per-block t indexes blocks of position // block_size over these L tokens, i.e. the layout
        when they start at position 0; callers with a prompt (the RL ELBOs, pretraining) map their
        blocks themselves (completion_blocks / block_ids) and pass per-token t."""
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

        x0: [B, T]; eligible: [B, T] bool, the tokens to denoise (the completion); blocks follow the
        module's layout (position // block_size); attention_mask: [B, T] bool or None. The model must accept a [B, 2T, 2T] bool attention_mask and position_ids [B, 2T].
        """
        check_tokens(x0)
        eligible = check_eligible(eligible, x0)
        B, T = x0.shape
        key_valid = torch.ones_like(eligible) if attention_mask is None else attention_mask.bool()
        blocks = block_ids(key_valid, self.block_size)  # [B, T] (module doc: the one block layout)
        # One t per block of the row, indexed by block id; the prompt's blocks draw one too, unused.
        t_blocks = self.sample_t(B, generator=generator, device=x0.device, eps=eps, length=T)  # [B, ceil(T / bs)]
        t_tok = t_blocks.gather(1, blocks)  # [B, T]
        xt, noised = self.noise(x0, t_tok, generator=generator, eligible=eligible)
        logits = _staircase_noisy_logits(model, x0, xt, blocks, key_valid)  # [B, T, V]
        nelbo = self.nelbo(logits, x0, noised, t_tok)
        return _per_token_loss(nelbo, eligible, noised, num_tokens)


# --------------------------------------------------------------------------------------------
# Staircase construction (pure functions)
# --------------------------------------------------------------------------------------------


def position_ids_from_mask(key_valid: Tensor) -> Tensor:
    """[B, T] positions counting only real tokens, so left padding does not shift them."""
    return (key_valid.long().cumsum(dim=1) - 1).clamp(min=0)


def block_ids(key_valid: Tensor, block_size: int) -> Tensor:
    """[B, T] bool (True = real token) -> [B, T] block of every token: position // block_size (module doc)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return position_ids_from_mask(key_valid).div(block_size, rounding_mode="floor")


def completion_blocks(prompt_mask: Tensor, length: int, block_size: int) -> Tensor:
    """[B, L] index of each completion token's block, counted from the completion's first block
    (0 = the block that may also hold the prompt's last tokens)."""
    n_prompt = prompt_mask.long().sum(dim=1, keepdim=True)  # [B, 1]
    j = torch.arange(length, device=prompt_mask.device)[None, :]
    return (n_prompt + j).div(block_size, rounding_mode="floor") - n_prompt.div(block_size, rounding_mode="floor")


def block_tail(prompt_mask: Tensor, length: int, block_size: int) -> Tensor:
    """[B, E] bool: the mask slots that follow each row's `length` completion tokens to the end of
    its last block (module doc, "Whole blocks"): slot e of row i is one (True) or padding (False).
    E = the largest tail in the batch (0..block_size - 1); one host read."""
    n_prompt = prompt_mask.long().sum(dim=1)  # [B]
    tail = (-(n_prompt + length)) % block_size  # [B]
    E = int(tail.max()) if tail.numel() else 0
    return torch.arange(E, device=prompt_mask.device)[None, :] < tail[:, None]  # [B, E]


def with_block_tail(ids: Tensor, key_valid: Tensor, tail: Tensor, mask_token_id: int) -> tuple[Tensor, Tensor]:
    """[prompt, completion] ids and key_valid [B, T] -> the same followed by `tail` [B, E] (block_tail):
    mask tokens, real keys where tail is True: ([B, T + E], [B, T + E])."""
    filler = torch.full(tail.shape, mask_token_id, dtype=ids.dtype, device=ids.device)
    return torch.cat([ids, filler], dim=1), torch.cat([key_valid.bool(), tail.to(key_valid.device)], dim=1)


def block_causal_mask(blocks: Tensor, key_valid: Tensor) -> Tensor:
    """[B, T, T] bool (True = may attend): q sees k iff b(k) <= b(q) and k is not padding.

    The diagonal is always allowed so that a padding query has a non-empty softmax row (its output
    is never read, but a NaN there would leak into real tokens through 0 * NaN in the next layer).
    """
    bq, bk = blocks[:, :, None], blocks[:, None, :]
    eye = torch.eye(blocks.shape[1], dtype=torch.bool, device=blocks.device)
    return ((bk <= bq) & key_valid[:, None, :].bool()) | eye


def block_layout_mask(positions: Tensor, key_valid: Tensor, block_size: int, query_positions: Tensor) -> Tensor:
    """The layout as a model applies it to a call (cached keys, then new tokens):
    positions, key_valid [B, Tk]; query_positions [B, Tq] -> [B, 1, Tq, Tk] bool (True = attend):
    block(key) <= block(query) and the key is real, block = position // block_size."""
    q_block = query_positions.div(block_size, rounding_mode="floor")[:, None, :, None]  # [B, 1, Tq, 1]
    k_block = positions.div(block_size, rounding_mode="floor")[:, None, None, :]  # [B, 1, 1, Tk]
    return (k_block <= q_block) & key_valid.bool()[:, None, None, :]


def block_attention(key_valid: Tensor, block_size: int) -> Tensor:
    """[B, T] bool -> [B, T, T] bool: the block layout's attention over a whole sequence."""
    return block_causal_mask(block_ids(key_valid, block_size), key_valid)


def staircase_mask(blocks: Tensor, key_valid: Tensor) -> Tensor:
    """[B, 2T, 2T] bool staircase attention for [clean | noisy] streams sharing block ids [B, T]."""
    bq, bk = blocks[:, :, None], blocks[:, None, :]
    valid = key_valid[:, None, :].bool()
    clean_to_clean = (bk <= bq) & valid
    noisy_to_clean = (bk < bq) & valid
    noisy_to_noisy = (bk == bq) & valid
    clean_to_noisy = torch.zeros_like(clean_to_clean)
    mask = torch.cat([torch.cat([clean_to_clean, clean_to_noisy], dim=2),
                      torch.cat([noisy_to_clean, noisy_to_noisy], dim=2)], dim=1)
    eye = torch.eye(mask.shape[1], dtype=torch.bool, device=mask.device)
    return mask | eye  # diagonal: see block_causal_mask


def staircase_inputs(prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, noisy_completion: Tensor,
                     block_size: int, *, mask_token_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """The dual-stream input of the one-pass block ELBO.

    prompt_ids [B, P] (left-padded), prompt_mask [B, P] bool, completion_ids and noisy_completion
    [B, L]. Returns input_ids [B, 2T] = [prompt, completion, tail | prompt, noisy completion, tail],
    position_ids [B, 2T] (the noisy half repeats the clean half's) and attn_mask [B, 2T, 2T] bool
    (True = may attend), T = P + L + E: the tail is the E mask tokens that complete the last block
    (block_tail; E = 0 when every row ends on a block boundary). `staircase_completion` says where
    the noisy completion is.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if tuple(prompt_mask.shape) != tuple(prompt_ids.shape):
        raise ValueError(f"prompt_mask must have the shape of prompt_ids {list(prompt_ids.shape)}, got {list(prompt_mask.shape)}")
    if tuple(noisy_completion.shape) != tuple(completion_ids.shape) or completion_ids.shape[0] != prompt_ids.shape[0]:
        raise ValueError(f"completion_ids {list(completion_ids.shape)} and noisy_completion {list(noisy_completion.shape)} "
                         f"must both be [B, L] with B = prompt_ids.shape[0] = {prompt_ids.shape[0]}")
    B, L = completion_ids.shape
    tail = block_tail(prompt_mask, L, block_size)  # [B, E]
    key_valid = torch.cat([prompt_mask.bool(), torch.ones_like(completion_ids, dtype=torch.bool)], dim=1)
    clean, valid = with_block_tail(torch.cat([prompt_ids, completion_ids], dim=1), key_valid, tail, mask_token_id)
    noisy, _ = with_block_tail(torch.cat([prompt_ids, noisy_completion], dim=1), key_valid, tail, mask_token_id)
    positions = position_ids_from_mask(valid)  # [B, T]
    return (torch.cat([clean, noisy], dim=1), torch.cat([positions, positions], dim=1),
            staircase_mask(block_ids(valid, block_size), valid))


def staircase_completion(input_ids: Tensor, prompt_length: int, length: int) -> int | Tensor:
    """Where staircase_inputs put the noisy completion in input_ids [B, 2T], as logits_to_keep: the
    int `length` (the last L positions) without a tail, else the positions [L]."""
    T = input_ids.shape[1] // 2
    if T == prompt_length + length:
        return length
    return torch.arange(T + prompt_length, T + prompt_length + length, device=input_ids.device)


def _staircase_noisy_logits(model: Any, clean: Tensor, noisy: Tensor, blocks: Tensor, key_valid: Tensor) -> Tensor:
    """One forward pass over [clean | noisy] [B, 2T]; returns the noisy stream's logits [B, T, V]."""

    T = clean.shape[1]
    positions = position_ids_from_mask(key_valid)
    return kept_logits(model, torch.cat([clean, noisy], dim=1), staircase_mask(blocks, key_valid),
                       position_ids=torch.cat([positions, positions], dim=1), logits_to_keep=T)  # [B, T, V]


# --------------------------------------------------------------------------------------------
# Block ELBO for RL: one pass (staircase) and the block-by-block reference
# --------------------------------------------------------------------------------------------


def _block_noise(process: BlockMaskedProcess, prompt_mask: Tensor, completion_ids: Tensor,
                 completion_mask: Tensor | None, generator: torch.Generator,
                 eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Draw t_b per completion block and mask the completion: noisy [B, L], noised [B, L] bool, per-token t [B, L].

    Completion blocks follow the layout (module doc), so a row whose prompt ends inside a block has
    its first completion tokens in that block; one t is drawn per block of the widest row.
    """
    check_tokens(completion_ids, "completion_ids")
    B, L = completion_ids.shape
    blocks = completion_blocks(prompt_mask, L, process.block_size)  # [B, L]
    t_blocks = process.sample_t(B, generator=generator, device=completion_ids.device, eps=eps,
                                length=(int(blocks.max()) + 1) * process.block_size)  # [B, n_blocks]
    t_tok = t_blocks.gather(1, blocks)  # [B, L]
    noisy, noised = process.noise(completion_ids, t_tok, generator=generator, eligible=completion_mask)
    return noisy, noised, t_tok


def _elbo_from_logits(process: BlockMaskedProcess, logits: Tensor, completion_ids: Tensor, noised: Tensor,
                      t_tok: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    token_logp = -process.weighted_token_nll(logits, completion_ids, noised, t_tok)  # [B, L]
    return token_logp.sum(dim=1), token_logp, noised


def _make_process(model: Any, block_size: int, mask_token_id: int | None, schedule: str) -> BlockMaskedProcess:
    mask_id = model_view(model).mask_token_id if mask_token_id is None else mask_token_id
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
    noisy, noised, t_tok = _block_noise(process, prompt_mask, completion_ids, completion_mask, generator, eps)
    logits = staircase_logits(model, prompt_ids, prompt_mask, completion_ids, noisy, block_size,
                              mask_token_id=process.mask_token_id)  # [B, L, V]
    return _elbo_from_logits(process, logits, completion_ids, noised, t_tok)


def staircase_logits(model: Any, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                     noisy_completion: Tensor, block_size: int, *, mask_token_id: int | None = None) -> Tensor:
    """Logits [B, L, V] of every completion position given its noisy block and the clean blocks
    before it, all blocks in ONE forward pass of the staircase input [B, 2T].

    noisy_completion [B, L] is the completion with the positions to score replaced by the mask
    token (whatever drew them: `staircase_elbo`'s t_b, or an RL estimator's masks). The noisy
    completion (`staircase_completion`) alone goes through the LM head. mask_token_id (the last
    block's tail, module doc) defaults to model.mask_token_id.
    """
    mask_id = model.mask_token_id if mask_token_id is None else mask_token_id
    input_ids, position_ids, attn_mask = staircase_inputs(prompt_ids, prompt_mask, completion_ids, noisy_completion,
                                                          block_size, mask_token_id=mask_id)
    keep = staircase_completion(input_ids, prompt_ids.shape[1], completion_ids.shape[1])
    return kept_logits(model, input_ids, attn_mask, position_ids=position_ids, logits_to_keep=keep)  # [B, L, V]


def blockwise_elbo(model: Any, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, block_size: int, *,
                   generator: torch.Generator, completion_mask: Tensor | None = None, mask_token_id: int | None = None,
                   schedule: str = "linear", eps: float = 1e-3) -> tuple[Tensor, Tensor, Tensor]:
    """The same ELBO as `staircase_elbo` (same generator -> same noise), the slow way.

    One forward pass per block b on [prompt, clean blocks < b, noisy block b] with the ordinary
    block-causal mask. The reference that the one-pass construction is tested against.
    """

    process = _make_process(model, block_size, mask_token_id, schedule)
    noisy, noised, t_tok = _block_noise(process, prompt_mask, completion_ids, completion_mask, generator, eps)
    P, L = prompt_ids.shape[1], completion_ids.shape[1]
    tail = block_tail(prompt_mask, L, block_size)  # [B, E] the last block's mask slots (module doc)
    key_valid = torch.cat([prompt_mask.bool(), torch.ones_like(completion_ids, dtype=torch.bool), tail], dim=1)
    blocks = block_ids(key_valid, block_size)  # [B, T + E]
    positions = position_ids_from_mask(key_valid)
    rel = completion_blocks(prompt_mask, L + tail.shape[1], block_size)  # [B, L + E]; the tail: the last block's
    keep = L if tail.shape[1] == 0 else torch.arange(P, P + L, device=prompt_ids.device)
    per_block = []
    for b in range(int(rel[:, :L].max()) + 1):
        # [prompt, clean blocks < b, noisy block b (+ its tail)]; later tokens are hidden as padding
        # (they come after every fed token, so the positions of the fed ones do not change).
        filler = torch.full(tail.shape, process.mask_token_id, dtype=completion_ids.dtype, device=tail.device)
        ids = torch.cat([prompt_ids, torch.where(rel[:, :L] < b, completion_ids, noisy), filler], dim=1)  # [B, T + E]
        visible = key_valid & torch.cat([torch.ones_like(prompt_mask, dtype=torch.bool), rel <= b], dim=1)
        mask = block_causal_mask(blocks, visible)
        out = kept_logits(model, ids, mask, position_ids=positions, logits_to_keep=keep)  # [B, L, V]
        per_block.append(out)
    rel = rel[:, :L]  # [B, L]
    stacked = torch.stack(per_block, dim=0)  # [n_blocks, B, L, V]
    logits = stacked.gather(0, rel[None, :, :, None].expand(1, *stacked.shape[1:])).squeeze(0)  # [B, L, V]
    return _elbo_from_logits(process, logits, completion_ids, noised, t_tok)
