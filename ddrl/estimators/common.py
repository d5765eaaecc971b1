"""Pieces every likelihood estimator shares: seeded noise, batched noised forward passes, log-probs.

Randomness. An estimator derives all of its noise from the integer `seed` it is called with,
through a CPU `torch.Generator` (`generator_from_seed`); draws happen on the CPU and are then moved
to the batch's device. So the old, reference and current passes of one inner iteration, called
with the same seed on the same rows, see exactly the same masks whatever device the model is on,
and the global RNG is never touched. The draws depend on the seed *and on the rows' shapes*: the
same seed on a different micro-batch split gives different masks, so callers must compute old, ref
and current log-probs with the same split (the trainer does).

Per-group masks. By default every micro-batch draws from the step's seed alone, as the released
trainers do (d1, SPG, ESPO, dLLM-RL): with train.micro_batch_size = G every group of a step gets
the same masks, so the mask noise does not average out over the groups. An estimator with
`mask_per_group: true` draws each group's masks from its own seed, (seed, the group's index among
the step's global groups) (`per_group_draws`): groups get different masks, and a group's masks do not
depend on the micro-batch split or the number of processes.

Batching. Estimators that need several noised copies of the batch stack them along the batch axis
([C, B, L] -> [C*B, L]) and run ONE forward call (`rows_per_call` splits it when memory is short;
the number of passes an estimator reports counts copies, not calls). The calls' results are
concatenated, so their activations are all held until the caller's backward: rows_per_call bounds
a call's peak, not the step's; a caller that must bound the step runs backward per micro-batch.

Log-probs. `forward_logprobs` asks the model for log p(target) at the completion positions
(ddrl.logits.kept_logprobs): a DiffusionLM computes them from the final hidden states with the LM
head and the cross-entropy chunk by chunk (ddrl.ops.logprobs), so no [rows, L, V] logits exist,
in forward or backward; `scored` restricts the head work to the positions a caller reads.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import torch
from torch import Tensor

from ddrl.logits import kept_logprobs
from ddrl.contract import model_view
from ddrl.ops.logprobs import token_logprobs  # noqa: F401  (re-exported: the logits path's scoring)
from ddrl.types import RolloutBatch


def generator_from_seed(seed: int | Tensor) -> torch.Generator:
    """A fresh CPU generator seeded with `seed` (an int or a 0-d tensor such as batch.mask_seeds[k])."""
    return torch.Generator(device="cpu").manual_seed(int(seed))


def group_seed(seed: int, group: int) -> int:
    """The mask seed of one group: a 62-bit hash of (seed, group), the same on every process."""
    digest = hashlib.blake2b(repr((int(seed), "group", int(group))).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 62) - 1)


def mask_groups(batch: RolloutBatch) -> list[int]:
    """The key of each group of the batch, in row order: the trainer's step-global group indices
    (batch.groups, set by its update planner), else the batch's own group ids (one host read; a
    caller outside the trainer, whose ids are then its keys). A group's rows are consecutive."""
    if batch.groups is not None:
        return list(batch.groups)
    return torch.unique_consecutive(batch.group_ids).tolist()


def per_group_draws(draw: Callable[[RolloutBatch, int], Any], batch: RolloutBatch, seed: int) -> Any:
    """draw(sub-batch, seed) for each group with the group's own seed (group_seed), joined along the
    rows: draw returns a tensor [C, b, ...] or a tuple of them (None stays None), rows on dim 1."""
    groups = mask_groups(batch)
    size = len(batch) // max(1, len(groups))  # rows per group (micro-batches hold whole groups)
    if size * len(groups) != len(batch):
        raise ValueError(f"mask_per_group needs whole groups of equal size: {len(batch)} rows, {len(groups)} groups")
    parts = [draw(batch.index(slice(i * size, (i + 1) * size)), group_seed(seed, g)) for i, g in enumerate(groups)]
    if not isinstance(parts[0], tuple):
        return torch.cat(parts, dim=1)
    return tuple(None if ps[0] is None else torch.cat(ps, dim=1) for ps in zip(*parts))


def uniform(shape: tuple[int, ...], generator: torch.Generator, device: torch.device | str) -> Tensor:
    """U[0, 1) of `shape`, drawn on the CPU from `generator`, returned on `device`."""
    return torch.rand(shape, generator=generator).to(device)


def forward_logprobs(model, prompt_in: Tensor, prompt_mask: Tensor, completion_in: Tensor, targets: Tensor, *,
                     class_range: tuple[int, int] | None = None, rows_per_call: int | None = None,
                     scored: Tensor | None = None) -> Tensor:
    """log p_theta(targets^i | prompt_in, completion_in) at every completion position: [N, L].

    prompt_in [N, P] (possibly noised), prompt_mask [N, P] bool (True on real prompt tokens),
    completion_in [N, L] (noised completion), targets [N, L] (clean tokens to score).
    On a block model (model.block_size) a completion that ends inside a block is followed by the mask
    tokens that complete it (ddrl.processes.block "Whole blocks"): the view the block sampler decodes in.
    A model's completion suffix (`model.completion_suffix`: MMaDA's <|eoi|> after an image) follows the
    completion, attended and not scored, as the sampler feeds it (ddrl.sampling.utils.completion_logits).
    class_range=(a, b) restricts the softmax to vocabulary ids [a, b) (uniform diffusion classes);
    targets are then ids in [a, b). scored [N, L] bool: only these positions are computed (the
    others are 0 and cost no LM-head work); None = all.
    """
    N, P = prompt_in.shape
    L = completion_in.shape[1]
    ids = torch.cat([prompt_in, completion_in], dim=1)  # [N, T]
    attention = torch.cat([prompt_mask.bool(), torch.ones(N, L, dtype=torch.bool, device=ids.device)], dim=1)
    keep: int | Tensor = L  # the completion: the last L positions ...
    view = model_view(model)
    block_size = view.block_size
    if block_size:  # ... unless a block model's last block is completed by mask tokens, as the sampler feeds it
        from ddrl.processes.block import block_tail, with_block_tail  # processes import this layer's types

        tail = block_tail(prompt_mask, L, int(block_size))  # [N, E]
        if tail.shape[1]:
            ids, attention = with_block_tail(ids, attention, tail, model.mask_token_id)  # [N, T + E]
            keep = torch.arange(P, P + L, device=ids.device)
    suffix = view.completion_suffix  # fixed ids after the completion (MMaDA's <|eoi|>)
    if suffix:
        if block_size:
            raise ValueError("a completion suffix on a block model is not supported")
        tail = torch.tensor(suffix, dtype=ids.dtype, device=ids.device).expand(N, len(suffix))  # [N, S]
        ids = torch.cat([ids, tail], dim=1)  # [N, T + S]
        attention = torch.cat([attention, torch.ones_like(tail, dtype=torch.bool)], dim=1)
        keep = torch.arange(P, P + L, device=ids.device)
    step = N if not rows_per_call else max(1, int(rows_per_call))
    out = []
    for start in range(0, N, step):
        rows = slice(start, start + step)
        out.append(kept_logprobs(model, ids[rows], attention[rows], logits_to_keep=keep, targets=targets[rows],
                                 mask=None if scored is None else scored[rows], class_range=class_range))  # [n, L]
    return torch.cat(out, dim=0)


def noised_forward(model, batch: RolloutBatch, prompt_noise_mask: Tensor | None, completion_noise_mask: Tensor, *,
                   rows_per_call: int | None = None) -> Tensor:
    """Token log-probs of the clean completion under masked copies of the batch.

    completion_noise_mask: [B, L] or [C, B, L] bool, True = replaced by the mask token.
    prompt_noise_mask:     None (prompt clean), [B, P] or [C, B, P] bool.
    Returns [B, L] or [C, B, L] float32: log p_theta(x^i | noised prompt, noised completion) at
    every completion position (the caller keeps the positions it scores). The C copies go through
    the model as one batch of C*B rows.
    """
    single = completion_noise_mask.dim() == 2
    cmask = completion_noise_mask[None] if single else completion_noise_mask  # [C, B, L]
    C, B, L = cmask.shape
    P = batch.prompt_ids.shape[1]
    mask_id = model.mask_token_id
    if prompt_noise_mask is None:
        prompt_in = batch.prompt_ids[None].expand(C, B, P)
    else:
        pmask = prompt_noise_mask[None] if prompt_noise_mask.dim() == 2 else prompt_noise_mask
        prompt_in = torch.where(pmask.expand(C, B, P), mask_id, batch.prompt_ids[None])
    completion_in = torch.where(cmask, mask_id, batch.completion_ids[None])  # [C, B, L]
    lp = forward_logprobs(
        model,
        prompt_in.reshape(C * B, P),
        batch.prompt_mask.repeat(C, 1),
        completion_in.reshape(C * B, L),
        batch.completion_ids.repeat(C, 1),
        rows_per_call=rows_per_call,
    ).view(C, B, L)
    return lp[0] if single else lp


def prompt_noise(batch: RolloutBatch, p: float, generator: torch.Generator, copies: int | None = None) -> Tensor | None:
    """Mask each real prompt token independently with probability p (d1's augmentation).

    Returns [B, P] (or [copies, B, P]) bool, or None when p == 0 (nothing drawn).
    """
    if p <= 0.0:
        return None
    shape = tuple(batch.prompt_ids.shape) if copies is None else (copies, *batch.prompt_ids.shape)
    return (uniform(shape, generator, batch.prompt_ids.device) < p) & batch.prompt_mask.bool()


def random_subset_mask(counts: Tensor, eligible: Tensor, generator: torch.Generator) -> Tensor:
    """A uniformly random subset of counts[...] positions among the eligible ones, per row.

    counts [..., B] long, eligible [..., B, L] bool -> [..., B, L] bool with exactly
    min(counts, #eligible) True entries, each such subset equally likely.
    """
    keys = uniform(tuple(eligible.shape), generator, eligible.device)
    keys = keys.masked_fill(~eligible, 2.0)  # ineligible positions sort last
    rank = keys.argsort(dim=-1).argsort(dim=-1)  # [..., B, L] rank of each position in a random order
    return (rank < counts[..., None]) & eligible


def stratified_counts(lengths: Tensor, generator: torch.Generator) -> Tensor:
    """Masked-token counts n_j in {0..len_j}, marginally uniform, evenly spread over the batch.

    ESPO (Ou et al. 2025, `_get_elbo`) draws k ~ U{0..L} and uses n_j = round(k + j(L+1)/B) mod (L+1).
    We use the continuous form n_j = floor(((u + j/B) mod 1) * (len_j + 1)), u ~ U[0, 1): the same
    stratification for equal lengths, exactly uniform marginals (torch.round's half-to-even ties
    would skew them) and it also works when rows have different lengths.
    lengths [B] long -> [B] long. The lengths stay on their device (no host read): only the draw is
    made on the CPU and sent there.
    """
    B = lengths.shape[0]
    u = torch.rand((), generator=generator).double()  # float32 draw, exactly widened
    v = (u + torch.arange(B, dtype=torch.float64) / B) % 1.0  # [B] evenly spaced on the circle
    n = torch.floor(v.to(lengths.device) * (lengths.double() + 1)).long()
    return torch.minimum(n, lengths)


def masked_mean(values: Tensor, mask: Tensor, dim: int = -1) -> Tensor:
    """Mean of values over mask along dim; 0 where the mask is empty."""
    mask = mask.to(values.dtype)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def completion_lengths(batch: RolloutBatch) -> Tensor:
    """Real completion length per row (tokens up to and including the first EOS), [B] long."""
    return batch.completion_mask.long().sum(dim=1)


def positions(batch: RolloutBatch) -> Tensor:
    """Completion position indices [L] on the batch's device."""
    return torch.arange(batch.completion_ids.shape[1], device=batch.completion_ids.device)
