"""Coupled (complementary-mask) ELBO: ESPO's sequence log-likelihood proxy, and GDSD's denoise log-prob.

Ou et al., "ESPO: ELBO-based Sequence-level Policy Optimization", arXiv 2512.03759 (ML-GSAI/ESPO
espo/espo_trainer.py `_get_elbo`, `_get_elbo_mc`); Tang et al., "GDSD", arXiv 2605.29398
(GaryBall/GDSD gdsd/trainers/gdsd_trainer_batchll.py `_compute_denoise_probs_from_masked_batch`:
coupling always on, no 1/t weights; gdsd_trainer_tlc.py: ESPO's weights). See docs/methods.md.

Per MC draw, with n_j stratified over the batch (n_j uniform on {0..L} marginally, `stratified_counts`)
and S_j a uniformly random set of n_j completion positions, p = n_j / (L+1):

    pass 1: mask S        terms  w1 * log p(x^i | x with S masked),    i in S,    w1 = 1/p
    pass 2: mask S^c      terms  w2 * log p(x^i | x with S^c masked),  i not in S, w2 = 1/(L/(L+1) - p)
    ELBO(x) = 1/2 * (sum of pass-1 terms + sum of pass-2 terms)      (sequence-level, not length-normalised)

Every position is predicted exactly once across the pair.

Draws. seq_logp, extras["elbo"] and token_logp are the mean over the num_mc draws: ESPO forms its
ratio from that mean (`_get_elbo_mc`). extras["per_draw"] [B, num_mc] keeps each draw's value:
GDSD clamps and regresses every draw separately (its compute_loss works on [B, num_mc]), so it
must not see only the mean. With the masks of ESPO's / GDSD's `forward_process` injected through
`score`, both values equal the released ones (tests/unit/test_golden_espo.py, test_golden_gdsd.py).

What it is unbiased for. Marginally n is uniform on {0..L} and S uniform given n, so pass 1 alone
has expectation sum_{n=1..L} (1/n) E_{|S|=n}[sum_{i in S} log p(x^i | x_{-S})], and so does pass 2
(its set S^c has size L-n, also uniform on {0..L}). That is the discrete-count masked-diffusion ELBO
of LLaDA (the 1/t-weighted NELBO with t = n/L), a lower bound on log p_theta(x | c). With
weighted=False (GDSD) the expectation is (1/(L+1)) sum_{n=1..L} E_{|S|=n}[sum_{i in S} log p].

Length. ESPO and GDSD sum over all `logits_to_keep` positions, post-EOS fill included, and count
L as the padded length: include_padding=True (default) does the same. include_padding=False scores
only the real completion (up to and including the first EOS) with L = its length per row; then
post-EOS positions are masked in both passes and never scored.

Masks. The released code draws k ~ U{0..L}, n_j = round(k + j(L+1)/B) mod (L+1) and a random
permutation per row from the global RNG after set_seed(seed); ddrl draws an equivalent stratification
from a torch.Generator (`stratified_counts`), so one seed gives other masks than theirs (the golden
tests inject their masks).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ddrl.estimators.common import (generator_from_seed, noised_forward, per_group_draws, random_subset_mask,
                                    stratified_counts)
from ddrl.registry import ESTIMATORS
from ddrl.types import EstimatorOutput, RolloutBatch


@ESTIMATORS.register("coupled_elbo")
@dataclass
class CoupledELBO:
    num_mc: int = 2  # Monte-Carlo draws; each is a complementary pair of masked copies (ESPO/GDSD: 2)
    weighted: bool = True  # ESPO's 1/p and 1/(L/(L+1)-p) ELBO weights; False = GDSD's plain denoise log-prob
    include_padding: bool = True  # score all L positions incl. post-EOS fill with L = padded length (ESPO/GDSD)
    rows_per_call: int | None = None  # at most this many sequences per forward call (memory); None = one call
    mask_per_group: bool = False  # each group's masks (and strata) from its own seed; False = ESPO's / GDSD's

    name: ClassVar[str] = "coupled_elbo"
    paper: ClassVar[str] = "ESPO (Ou et al. 2025, arXiv 2512.03759); GDSD (Tang et al. 2026, arXiv 2605.29398)"
    formula: ClassVar[str] = "ELBO = 1/2[sum_S log p(x^i|x_-S)/p + sum_Sc log p(x^i|x_-Sc)/(L/(L+1)-p)], |S| stratified"
    passes: ClassVar[str] = "2*num_mc"
    needs_trajectory: ClassVar[bool] = False

    @property
    def copies_per_row(self) -> int:
        """Copies of a row in one call's forward and backward graph (ddrl.training.memory's k):
        a complementary pair per draw."""
        return 2 * self.num_mc

    def scored_positions(self, batch: RolloutBatch) -> Tensor:
        """[B, L] bool: the positions the ELBO sums over."""
        real = batch.completion_mask.bool()
        return torch.ones_like(real) if self.include_padding else real

    def draw_masks(self, batch: RolloutBatch, seed: int) -> Tensor:
        """The first-pass masks S of the num_mc draws, [num_mc, B, L] bool."""
        if self.mask_per_group:  # the counts are then stratified within each group
            return per_group_draws(dataclasses.replace(self, mask_per_group=False).draw_masks,
                                   batch, seed)
        g = generator_from_seed(seed)
        eligible = self.scored_positions(batch)
        lengths = eligible.long().sum(1)  # [B]
        counts = torch.stack([stratified_counts(lengths, g) for _ in range(self.num_mc)])  # [C, B]
        return random_subset_mask(counts, eligible[None].expand(self.num_mc, -1, -1), g)

    def score(self, model, batch: RolloutBatch, first_mask: Tensor) -> EstimatorOutput:
        """The coupled ELBO for given first-pass masks S [C, B, L] (pass 2 masks the complement)."""
        eligible = self.scored_positions(batch)[None]  # [1, B, L]
        C = first_mask.shape[0]
        S = first_mask & eligible
        Sc = eligible & ~S
        outside = ~eligible  # post-EOS when include_padding=False: masked in both passes, never scored
        lp = noised_forward(model, batch, None, torch.cat([S | outside, Sc | outside]),
                            rows_per_call=self.rows_per_call)  # [2C, B, L]
        lp1, lp2 = lp[:C], lp[C:]
        w1, w2 = self._weights(S.long().sum(-1), eligible.long().sum(-1))  # [C, B] each
        terms = 0.5 * (torch.where(S, lp1 * w1[..., None], 0.0) + torch.where(Sc, lp2 * w2[..., None], 0.0))
        per_draw = terms.sum(-1).transpose(0, 1)  # [B, C]: each draw's ELBO (GDSD regresses each)
        token_logp = terms.mean(0)  # [B, L], sums to the mean over draws
        seq = token_logp.sum(1)  # [B]
        return EstimatorOutput(token_logp=token_logp, seq_logp=seq, mask=eligible[0],
                               extras={"elbo": seq, "per_draw": per_draw})

    def _weights(self, n: Tensor, length: Tensor) -> tuple[Tensor, Tensor]:
        """ESPO's pass weights 1/p = (L+1)/n and 1/(L/(L+1) - p) = (L+1)/(L-n); 0 for an empty pass."""
        if not self.weighted:
            return torch.ones_like(n, dtype=torch.float32), torch.ones_like(n, dtype=torch.float32)
        n, length = n.float(), length.float().expand_as(n)
        w1 = torch.where(n > 0, (length + 1) / n.clamp(min=1), 0.0)
        w2 = torch.where(n < length, (length + 1) / (length - n).clamp(min=1), 0.0)
        return w1, w2

    def __call__(self, model, batch: RolloutBatch, seed: int) -> EstimatorOutput:
        return self.score(model, batch, self.draw_masks(batch, seed))
