"""SPG's block-random ELBO and EUBO: the sandwiched bounds of SPG, also StableDRL's proxy.

Wang et al., "SPG: Sandwiched Policy Gradient for Masked Diffusion Language Models", arXiv 2510.09541
(facebookresearch/SPG spg/spg_trainer.py `forward_process` forward_type='block_random',
`_get_per_seq_logps`); the same code is StableDRL's networks/llada_svpo.py (docs/methods.md).

Masking, per draw n = 1..num_t (mimics a semi-autoregressive generation state):
  * blocks of block_length completion positions; pick a block b uniformly among the blocks that
    hold real tokens; blocks before b stay clean, blocks after b are fully masked;
  * block b: n ~ U{max(1, floor(min_t*len_b)) .. min(floor(max_t*len_b), len_b)} of its real
    positions are masked, uniformly at random (len_b = real tokens in block b);
  * positions after the first EOS are always masked and never scored;
  * as in SPG's code (`is_mask_prompt = ~is_mask & (rand < p)`), every position the block mask leaves
    clean -- the real prompt tokens and the earlier blocks -- is also masked with prob p_mask_prompt,
    and masked completion tokens count as scored.
With m^(n) = masked & real and t_emp^(n) = #m^(n) / len:

    ELBO(x) = mean_n [ sum_i m_i^(n) log p(x^i | x^(n)) / #m^(n) ]                            (no 1/t weight)
    EUBO(x) = (1/beta) mean_{i: masked in some draw} log( mean_n [ m_i^(n) p(x^i | x^(n))^beta / t_emp^(n) ] )

Tokens no draw masked are left out of the EUBO mean (SPG's `loss_mask`): their log(0) would be
-inf. The EUBO is computed in log space (logsumexp) instead of SPG's p^beta product, which is the
same value without underflow. The objective mixes them: ELBO for A > 0, omega*EUBO +
(1-omega)*ELBO for A <= 0 (it reads extras["elbo"], extras["eubo"]; omega is the objective's field).

Deviation: SPG picks each draw's block from a random permutation of the padded blocks taken
modulo the number of real blocks (distinct blocks across draws, slightly non-uniform when the
counts do not divide); we draw each block independently and uniformly among the real blocks.
Completion lengths need not be multiples of block_length (the last block is shorter).

Checked against the released code (tests/unit/test_golden_spg.py): with SPG's own masks injected
(`score`), ELBO, EUBO and SPG's loss match facebookresearch/SPG to float32 precision.
`sandwich_bounds` turns per-draw token log-probs and masks into the ELBO/EUBO output; the block
(staircase) estimator calls the same function, so both give the same kind of quantity.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ddrl.estimators.common import (completion_lengths, generator_from_seed, masked_mean, noised_forward,
                                    per_group_draws, positions, prompt_noise, random_subset_mask, uniform)
from ddrl.registry import ESTIMATORS
from ddrl.types import EstimatorOutput, RolloutBatch


@ESTIMATORS.register("spg")
@dataclass
class SPGBounds:
    num_t: int = 2  # Monte-Carlo masked copies (SPG/StableDRL: 2)
    block_length: int = 32  # semi-AR block of the masking pattern (capped at the completion length)
    min_t: float = 0.0  # smallest fraction of block b masked (at least 1 token)
    max_t: float = 1.0  # largest fraction of block b masked
    p_mask_prompt: float = 0.15  # prob. of masking each position the block mask leaves clean (prompt, earlier blocks)
    beta_eubo: float = 1.5  # Renyi order beta of the EUBO (SPG: 1.5 GSM8K/MATH, 1.0 Sudoku, 2.0 Countdown)
    rows_per_call: int | None = None  # at most this many sequences per forward call (memory); None = one call
    mask_per_group: bool = False  # each group's masks from its own seed (ddrl.estimators.common); False = SPG's

    name: ClassVar[str] = "spg"
    paper: ClassVar[str] = "SPG (Wang et al. 2025, arXiv 2510.09541); StableDRL (Zhong et al. 2026, arXiv 2603.06743)"
    formula: ClassVar[str] = "ELBO = mean_n sum_masked log p/#masked; EUBO = 1/beta mean_i log mean_n[m p^beta/t_emp]"
    passes: ClassVar[str] = "num_t"
    needs_trajectory: ClassVar[bool] = False
    extras: ClassVar[tuple[str, ...]] = ("elbo", "eubo")  # what EstimatorOutput.extras holds

    @property
    def copies_per_row(self) -> int:
        """Copies of a row in one call's forward and backward graph (ddrl.training.memory's k)."""
        return self.num_t

    def draw_masks(self, batch: RolloutBatch, seed: int) -> tuple[Tensor | None, Tensor]:
        """Prompt masks [num_t, B, P] (or None) and completion masks [num_t, B, L] of the draws."""
        if self.mask_per_group:
            return per_group_draws(dataclasses.replace(self, mask_per_group=False).draw_masks, batch, seed)
        g = generator_from_seed(seed)
        C, (B, L) = self.num_t, batch.completion_ids.shape
        device = batch.completion_ids.device
        bl = max(1, min(self.block_length, L))
        length = completion_lengths(batch).clamp(min=1)  # [B]
        num_blocks = (length - 1) // bl + 1  # [B] blocks holding real tokens
        b = (uniform((C, B), g, device) * num_blocks).long().clamp(max=num_blocks - 1)  # [C, B]
        len_b = torch.minimum(torch.full_like(length, bl), length - b * bl)  # [C, B] real tokens in block b
        lo = (len_b * self.min_t).long().clamp(min=1)
        hi = torch.minimum((len_b * self.max_t).long(), len_b).clamp(min=lo)
        n = lo + (uniform((C, B), g, device) * (hi - lo + 1)).long().clamp(max=hi - lo)  # [C, B]
        block_of = positions(batch) // bl  # [L]
        real = batch.completion_mask.bool()[None]  # [1, B, L]
        in_b = (block_of == b[..., None]) & real
        masked = random_subset_mask(n, in_b, g) | (block_of > b[..., None]) | ~real
        earlier = (block_of < b[..., None]) & real
        pmask = prompt_noise(batch, self.p_mask_prompt, g, copies=C)
        if self.p_mask_prompt > 0:
            masked = masked | (earlier & (uniform((C, B, L), g, device) < self.p_mask_prompt))
        return pmask, masked

    def score(self, model, batch: RolloutBatch, prompt_masks: Tensor | None, masks: Tensor) -> EstimatorOutput:
        """ELBO, EUBO and per-token log-probs for given masks ([C, B, P] or None, [C, B, L])."""
        lp = noised_forward(model, batch, prompt_masks, masks, rows_per_call=self.rows_per_call)  # [C, B, L]
        real = batch.completion_mask.bool()
        m = masks & real[None]  # [C, B, L] scored
        t_emp = m.float().sum(-1, keepdim=True) / real.float().sum(-1).clamp(min=1)[None, :, None]  # [C, B, 1]
        return sandwich_bounds(lp, m, t_emp, self.beta_eubo)

    def __call__(self, model, batch: RolloutBatch, seed: int) -> EstimatorOutput:
        return self.score(model, batch, *self.draw_masks(batch, seed))


def sandwich_bounds(lp: Tensor, m: Tensor, t_mask: Tensor, beta: float) -> EstimatorOutput:
    """SPG's ELBO and EUBO from C masked draws: lp [C, B, L] log p(x^i | draw), m [C, B, L] bool
    (masked and scored), t_mask the rate each token was masked at ([C, B, 1] one per row as in SPG,
    or [C, B, L] per token for block models). extras "elbo" / "eubo" [B]; token_logp [B, L] is the
    mean over the draws that masked a token, mask [B, L] the tokens masked in at least one draw."""
    elbo = masked_mean(lp, m, dim=-1).mean(0)  # [B] per-token mean over masked tokens, then over draws
    ever = m.any(0)  # [B, L]
    eubo = _eubo(lp, m, ever, t_mask, beta)
    token_logp = masked_mean(lp, m, dim=0) * ever  # [B, L]
    return EstimatorOutput(token_logp=token_logp, seq_logp=elbo, mask=ever, extras={"elbo": elbo, "eubo": eubo})


def _eubo(lp: Tensor, m: Tensor, ever: Tensor, t_mask: Tensor, beta: float) -> Tensor:
    """(1/beta) mean_{i in ever} log mean_n [ m_i^(n) p_i^beta / t^(n) ], in log space. [B]"""
    C = lp.shape[0]
    log_terms = beta * lp - t_mask.clamp(min=1e-8).log()  # [C, B, L]
    # -inf for draws that did not mask i; tokens never masked get finite zeros (excluded below), so
    # neither the value nor the gradient of logsumexp sees an all -inf column.
    log_terms = torch.where(m, log_terms, -math.inf)
    log_terms = torch.where(ever[None], log_terms, 0.0)
    log_mean = torch.logsumexp(log_terms, dim=0) - math.log(C)  # [B, L]
    return masked_mean(log_mean, ever, dim=-1) / beta
