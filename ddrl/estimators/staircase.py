"""SPG's sandwiched bounds for block-diffusion models (SDAR layout), one staircase pass per draw.

This is the block-model counterpart of the `spg` estimator, the likelihood proxy of StableDRL (Zhong
et al., arXiv 2603.06743, whose Fig. 3 scores block models with the dual-stream "staircase"
attention of BD3-LM, Arriola et al. 2025) and of SPG (Wang et al., arXiv 2510.09541) on block
models. It returns the same kind of quantity as the full-attention `spg` estimator, which matches
the released SPG/StableDRL code (docs/methods.md):

    ELBO(x) = mean_n [ sum_i m_i^(n) log p(x^i | x^(n)) / #m^(n) ]                 unweighted per-token mean
    EUBO(x) = (1/beta) mean_{i: masked in some draw} log mean_n [ m_i^(n) p(x^i | x^(n))^beta / t_i^(n) ]

computed by the same function (`ddrl.estimators.spg.sandwich_bounds`). Per draw n, every completion
block b is noised at once: k_b ~ U{max(1, floor(min_t*len_b)) .. min(floor(max_t*len_b), len_b)} of
its len_b real tokens are masked, uniformly at random, and p(x^i | x^(n)) is read with block b noisy
and the blocks before it clean (the staircase input of `ddrl.processes.block.staircase_inputs`, one
forward pass of length 2T whose noisy completion alone is scored, through the chunked LM head of
ddrl.logits.kept_logprobs). t_i^(n) = k_b / len_b is the masking rate of token i's block.

Why not the block ELBO in nats (sum_b sum_i (1/t_b) log p, t_b >= 1e-3, still available as
`ddrl.processes.block.staircase_elbo`): StableDRL's importance weight exp(ELBO_θ - ELBO_old) is
taken between two independently masked estimates. The 1/t-weighted sum makes that log-ratio noise
tens of nats, so after the clip at log C and the group softmax half the group gets weight ~0. The
per-token mean is what SPG's block-random masking (one partially masked block, clean blocks before
it) computes on full-attention models; the staircase does that for every block at once, since a
block model never sees the blocks after the one it denoises.

Deviation from SPG's masking: no prompt / earlier-block masking (SPG's p_mask_prompt); earlier
blocks are the clean context of the block-causal model, as in the block sampler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ddrl.estimators.common import generator_from_seed, random_subset_mask, uniform
from ddrl.estimators.spg import sandwich_bounds
from ddrl.logits import kept_logprobs
from ddrl.contract import model_view
from ddrl.registry import ESTIMATORS
from ddrl.types import EstimatorOutput, RolloutBatch


@ESTIMATORS.register("staircase")
@dataclass
class Staircase:
    block_size: int | None = None  # diffusion block size; None = the model's block_size (SDAR-8B: 4)
    num_t: int = 2  # Monte-Carlo masked draws, one staircase pass each (SPG/StableDRL: 2)
    min_t: float = 0.0  # smallest fraction of each block masked (at least 1 token)
    max_t: float = 1.0  # largest fraction of each block masked
    beta_eubo: float = 1.5  # Renyi order beta of the EUBO (SPG: 1.5 GSM8K/MATH, 1.0 Sudoku, 2.0 Countdown)

    name: ClassVar[str] = "staircase"
    paper: ClassVar[str] = "StableDRL block extension (Zhong et al. 2026, arXiv 2603.06743); SPG; BD3-LM"
    formula: ClassVar[str] = ("ELBO = mean_n sum_masked log p(x^i | noisy block, clean blocks before)/#masked; "
                              "EUBO = 1/beta mean_i log mean_n[m p^beta/t_block]")
    passes: ClassVar[str] = "num_t (length 2T each)"
    needs_trajectory: ClassVar[bool] = False
    extras: ClassVar[tuple[str, ...]] = ("elbo", "eubo")  # what EstimatorOutput.extras holds

    @property
    def copies_per_row(self) -> int:
        """Copies of a row in one call's forward and backward graph (ddrl.training.memory's k):
        a staircase row is twice the sequence's length."""
        return 2 * self.num_t

    def __post_init__(self) -> None:
        if int(self.num_t) < 1:
            raise ValueError(f"staircase: num_t={self.num_t} must be >= 1 (masked draws per estimate)")
        if not 0.0 <= self.min_t <= self.max_t <= 1.0:
            raise ValueError(f"staircase: need 0 <= min_t <= max_t <= 1, got min_t={self.min_t}, max_t={self.max_t}")

    def resolve_block_size(self, model) -> int:
        own = model_view(model).block_size
        if self.block_size and own and self.block_size != own:
            raise ValueError(f"estimator_args.block_size={self.block_size} contradicts the block model's block_size="
                             f"{own}: the ELBO would score a layout the model never runs; leave it unset")
        block_size = self.block_size or own
        if not block_size:
            raise ValueError("the staircase estimator needs a block size: set estimator_args.block_size "
                             "or use a block-diffusion model (model.block_size)")
        return int(block_size)

    def draw_masks(self, batch: RolloutBatch, block_size: int, seed: int) -> tuple[Tensor, Tensor]:
        """Masks [num_t, B, L] bool (k_b of each block's real tokens) and each token's block
        masking rate t [num_t, B, L] (k_b / len_b; 1 outside the real tokens)."""
        from ddrl.processes.block import completion_blocks  # processes import this layer's types; keep it lazy

        g = generator_from_seed(seed)
        C, (B, L) = int(self.num_t), batch.completion_ids.shape
        device = batch.completion_ids.device
        blocks = completion_blocks(batch.prompt_mask, L, block_size)  # [B, L] SDAR layout
        n_blocks = int(blocks.max()) + 1 if blocks.numel() else 0
        real = batch.completion_mask.bool()
        in_block = (blocks[:, None, :] == torch.arange(n_blocks, device=device)[None, :, None]) & real[:, None]
        len_b = in_block.sum(-1)  # [B, nb] real tokens per block
        lo = (len_b * self.min_t).long().clamp(min=1)
        hi = torch.minimum((len_b * self.max_t).long(), len_b).clamp(min=lo)
        k = lo + (uniform((C, B, n_blocks), g, device) * (hi - lo + 1)).long().clamp(max=hi - lo)  # [C, B, nb]
        k = torch.minimum(k, len_b)  # empty blocks: 0
        masks = random_subset_mask(k, in_block[None].expand(C, -1, -1, -1), g).any(2)  # [C, B, L]
        rate = (k.float() / len_b.clamp(min=1)).gather(2, blocks[None].expand(C, -1, -1))  # [C, B, L]
        return masks, torch.where(real[None], rate, torch.ones_like(rate))

    def score(self, model, batch: RolloutBatch, masks: Tensor, rate: Tensor, block_size: int) -> EstimatorOutput:
        """ELBO, EUBO and per-token log-probs for given masks [C, B, L] and masking rates [C, B, L]."""
        real = batch.completion_mask.bool()
        lp = torch.stack([self.staircase_logprobs(model, batch, m, block_size) for m in masks])  # [C, B, L]
        return sandwich_bounds(lp, masks & real[None], rate, self.beta_eubo)

    @staticmethod
    def staircase_logprobs(model, batch: RolloutBatch, masked: Tensor, block_size: int) -> Tensor:
        """log p(x^i | block of i noised by `masked` [B, L], clean blocks before it) [B, L]: one pass
        over the staircase input [B, 2T] (the last block completed by mask tokens, as the sampler sees
        it), the LM head on the noisy completion only."""
        from ddrl.processes.block import staircase_completion, staircase_inputs

        P, L = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
        noisy = torch.where(masked, model.mask_token_id, batch.completion_ids)
        input_ids, position_ids, attn_mask = staircase_inputs(batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                                              noisy, block_size, mask_token_id=model.mask_token_id)
        return kept_logprobs(model, input_ids, attn_mask, position_ids=position_ids,
                             logits_to_keep=staircase_completion(input_ids, P, L), targets=batch.completion_ids)

    def __call__(self, model, batch: RolloutBatch, seed: int) -> EstimatorOutput:
        block_size = self.resolve_block_size(model)
        return self.score(model, batch, *self.draw_masks(batch, block_size, seed), block_size)
