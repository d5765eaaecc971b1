"""One-pass block-diffusion ELBO with "staircase" attention: StableDRL's proxy for block models (SDAR).

Zhong et al., "StableDRL: Stabilizing RL for Diffusion Language Models", arXiv 2603.06743 (Fig. 3);
the construction follows BD3-LM's vectorised training (Arriola et al. 2025). ALGORITHMS.md §1.6.

    input = [clean copy, noisy copy] (same position ids); noisy block b attends to clean blocks < b
    and to itself; each completion block b has its own t_b ~ U(0, 1], tokens masked with prob t_b
    ELBO(x) = sum_b sum_{i in b, masked} (1/t_b) log p_theta(x^i | noisy block b, clean blocks < b)

The work is done by ddrl.processes.block.staircase_elbo (one forward pass of length 2T); this
estimator adapts it to the estimator contract and derives its noise from the seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ddrl.estimators.common import generator_from_seed
from ddrl.registry import ESTIMATORS
from ddrl.types import EstimatorOutput, RolloutBatch


@ESTIMATORS.register("staircase")
@dataclass
class Staircase:
    block_size: int | None = None  # diffusion block size; None = the model's block_size (SDAR-8B: 4)

    name: ClassVar[str] = "staircase"
    paper: ClassVar[str] = "StableDRL block extension (Zhong et al. 2026, arXiv 2603.06743); BD3-LM"
    formula: ClassVar[str] = "ELBO = sum_b sum_{i in b masked} (1/t_b) log p(x^i | noisy block b, clean blocks < b)"
    passes: ClassVar[str] = "1 (length 2T)"
    needs_trajectory: ClassVar[bool] = False

    def __call__(self, model, batch: RolloutBatch, seed: int) -> EstimatorOutput:
        from ddrl.processes.block import staircase_elbo  # processes may import this layer's types; keep it lazy

        own = getattr(model, "block_size", None)
        if self.block_size and own and self.block_size != own:
            raise ValueError(f"estimator_args.block_size={self.block_size} contradicts the block model's block_size="
                             f"{own}: the ELBO would score a layout the model never runs; leave it unset")
        block_size = self.block_size or own
        if not block_size:
            raise ValueError("the staircase estimator needs a block size: set estimator_args.block_size "
                             "or use a block-diffusion model (model.block_size)")
        elbo, token_logp, noised = staircase_elbo(
            model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, int(block_size),
            generator=generator_from_seed(seed), completion_mask=batch.completion_mask,
        )
        mask = noised.bool() & batch.completion_mask.bool()
        return EstimatorOutput(token_logp=token_logp * mask, seq_logp=elbo, mask=mask, extras={"elbo": elbo})
