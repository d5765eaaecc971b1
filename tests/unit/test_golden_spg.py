"""SPG against facebookresearch/SPG's own compute_loss (fixture: tests/fixtures/methods/make_spg.py).

The fixture holds SPG's released loss and its gradient w.r.t. fixed logits, for the mix, elbo and
eubo variants, on one optimizer step of two micro-batches, with the block-random masks SPG's
`forward_process` drew. Here those masks are injected into ddrl's `spg` estimator (`score`), a
model returns the same logits, and ddrl's `spg` objective must give the released loss and
gradient. The released trainer divides each micro-batch by its own token count and then by the
accumulation count (2), which is what `aggregation="micro_batch_token_mean"` reproduces; ddrl's
default ("token_mean") divides by the step's token count.
"""

from __future__ import annotations

import types

import pytest
import torch

from ddrl.estimators.spg import SPGBounds
from ddrl.objectives.aggregation import AggregationCounts
from ddrl.objectives.spg import SPG
from ddrl.types import RolloutBatch
from tests.fixtures.methods.method_common import load


TENSORS, META = load("spg")
S = META["settings"]
P, L, C, MASK = S["prompt_len"], S["gen_len"], S["num_t"], S["mask_id"]
MICRO = [slice(a, b) for a, b in S["micro_batches"]]


class RecordedLogits(torch.nn.Module):
    """Returns recorded logits [B, C, T, V] in ddrl's copy-major row order (c * B + b), after checking
    that ddrl fed the noisy ids SPG's model call got (on real positions; SPG also masks padding)."""

    def __init__(self, logits: torch.Tensor, noisy: torch.Tensor, real: torch.Tensor):
        super().__init__()
        self.mask_token_id = MASK
        self.logits, self.noisy, self.real = logits, noisy, real  # [B, C, T, V], [B, C, T], [B, T]

    def forward(self, input_ids, attention_mask=None):
        B, T = self.real.shape
        expected = self.noisy.transpose(0, 1).reshape(C * B, T)
        real = self.real.repeat(C, 1)
        assert torch.equal(input_ids[real], expected[real]), "ddrl's noisy input differs from SPG's"
        return types.SimpleNamespace(logits=self.logits.transpose(0, 1).reshape(C * B, T, -1))


def step_batch() -> RolloutBatch:
    t = TENSORS
    return RolloutBatch(
        prompt_ids=t["prompt_ids"], prompt_mask=t["prompt_mask"].bool(), completion_ids=t["completion_ids"],
        completion_mask=t["completion_mask"].bool(), group_ids=torch.arange(8) // 4, rewards=t["rewards"],
        advantages=t["advantages"], mask_seeds=t["mask_seeds"])


def injected_masks(noisy: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SPG's noisy ids [B, C, T] -> ddrl's prompt masks [C, B, P] and completion masks [C, B, L]."""
    masked = (noisy == MASK).transpose(0, 1)  # [C, B, T]
    return masked[..., :P] & prompt_mask.bool()[None], masked[..., P:]


def ddrl_micro_batch(variant: str, k: int, aggregation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """ddrl's loss on micro-batch k with SPG's masks, and its gradient w.r.t. the logits."""
    step = step_batch()
    batch = step.index(MICRO[k])
    leaf = TENSORS["logits"][MICRO[k]].clone().requires_grad_(True)
    real = torch.cat([batch.prompt_mask, torch.ones_like(batch.completion_mask)], 1)
    model = RecordedLogits(leaf, TENSORS[f"noisy_{k}"], real)
    estimator = SPGBounds(num_t=C, block_length=S["block_length"], p_mask_prompt=S["p_mask_prompt"],
                          beta_eubo=S["eubo_beta"])
    new = estimator.score(model, batch, *injected_masks(TENSORS[f"noisy_{k}"], batch.prompt_mask))
    objective = SPG(omega=S["mix_weight"], variant=variant, aggregation=aggregation)
    counts = AggregationCounts.from_batch(step, micro_batches=len(MICRO))
    loss = objective(batch, new, None, None, counts=counts).loss
    loss.backward()
    return loss.detach().double(), leaf.grad


@pytest.mark.parametrize("variant", S["variants"])
@pytest.mark.parametrize("k", [0, 1])
def test_spg_reproduces_the_released_loss_and_gradient(variant, k):
    loss, grad = ddrl_micro_batch(variant, k, "micro_batch_token_mean")
    accumulation = S["gradient_accumulation_steps"]  # the released step divides each micro-batch loss by it
    released_loss = TENSORS[f"{variant}_loss_{k}"] / accumulation
    released_grad = TENSORS[f"{variant}_grad_{k}"] / accumulation
    torch.testing.assert_close(loss, released_loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(grad, released_grad, atol=1e-6, rtol=0)
    assert released_grad.abs().max() > 1e-3  # the gradient is not trivially zero


def test_the_variants_differ_so_each_is_checked():
    losses = [float(TENSORS[f"{v}_loss_0"]) for v in S["variants"]]
    assert min(abs(a - b) for i, a in enumerate(losses) for b in losses[i + 1:]) > 1e-3


def test_default_normalisation_is_the_step_token_count():
    """ddrl's default divides by the step's Σ len (split-invariant): each micro-batch's released loss
    scaled by its share of the step's tokens instead of 1 / accumulation."""
    real = TENSORS["completion_mask"].sum(1).double()
    for k in (0, 1):
        loss, _ = ddrl_micro_batch("mix", k, "token_mean")
        share = real[MICRO[k]].sum() / real.sum()
        torch.testing.assert_close(loss, TENSORS[f"mix_loss_{k}"] * share, atol=1e-6, rtol=0)
    assert real[MICRO[0]].sum() != real[MICRO[1]].sum()  # so the two normalisations really differ
