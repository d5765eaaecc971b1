"""Mean-field one-step log-probs: d1's diffu-GRPO proxy, also wd1's.

Zhao et al., "d1: Scaling Reasoning in Diffusion LLMs via RL", arXiv 2504.12216
(dllm-reasoning/d1 diffu_grpo_trainer.py `forward_process`, `_get_per_token_logps`).

    log pi(x^i | c) := log p_theta(x^i | c~, M...M)

Every completion token (post-EOS fill included, as in d1) is masked; each real prompt token is
masked with probability p_mask_prompt, drawn from the seed, so the mu inner iterations see
different prompt masks while old/ref/current of one iteration share theirs. One forward pass.
The proxy ignores completion context (each token is predicted from the prompt alone), so it is a
biased stand-in for log π(x^i | c), not a bound on it (docs/methods.md, diffu-GRPO).

Differences from d1's released `_get_per_token_logps` / `forward_process`, none of which matter for
d1's own batches: d1 masks left-padding positions of the prompt like real tokens and calls the model
without an attention mask (d1's micro-batch is one prompt repeated, so it has no padding); d1 draws
the prompt mask from a global `set_seed(seed)`, here from a local generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ddrl.estimators.common import generator_from_seed, noised_forward, prompt_noise
from ddrl.registry import ESTIMATORS
from ddrl.types import EstimatorOutput, RolloutBatch


@ESTIMATORS.register("mean_field")
@dataclass
class MeanField:
    p_mask_prompt: float = 0.15  # probability of masking each real prompt token (d1 train.yaml: 0.15)

    name: ClassVar[str] = "mean_field"
    paper: ClassVar[str] = "d1 (Zhao et al. 2025, arXiv 2504.12216); wd1 (Tang et al. 2025, arXiv 2507.08838)"
    formula: ClassVar[str] = "log pi(x^i) = log p(x^i | prompt with 15% masked, completion all masked)"
    passes: ClassVar[str] = "1"
    copies_per_row: ClassVar[int] = 1  # copies of a row in one call's graph (memory's k)
    needs_trajectory: ClassVar[bool] = False

    def __call__(self, model, batch: RolloutBatch, seed: int) -> EstimatorOutput:
        g = generator_from_seed(seed)
        prompt_mask = prompt_noise(batch, self.p_mask_prompt, g)
        all_masked = torch.ones_like(batch.completion_mask, dtype=torch.bool)
        lp = noised_forward(model, batch, prompt_mask, all_masked)  # [B, L]
        mask = batch.completion_mask.bool()
        token_logp = lp * mask
        return EstimatorOutput(token_logp=token_logp, seq_logp=token_logp.sum(1), mask=mask)
