"""UDM-GRPO against its authors' trainer: one whole optimizer step of Yovecent/UDM-GRPO.

The fixture (tests/fixtures/methods/make_udm_grpo.py) ran their URSAGRPOPipeline (advantages,
per-timestep loss) under their Trainer.run_step with their accelerate setup: 3 trained timesteps,
each one micro-batch, gradient accumulation 3. The transformer is a table of logits, one slice per
timestep micro-batch, so the recorded step gradient is the gradient w.r.t. those logits.

ddrl's udm_grpo objective must give the same advantages (population std, clip), the same step
loss (the mean of the 3 micro-batch losses, since accelerate divides each by 3) and the same
gradient, to 1e-6. Summing the timesteps instead (ddrl before issue 14) gives 3x the gradient.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ddrl.estimators.common import token_logprobs
from ddrl.objectives import AggregationCounts, compute_advantages
from ddrl.registry import OBJECTIVES
from ddrl.types import EstimatorOutput, RolloutBatch
from tests.fixtures.methods.method_common import load

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "methods"
TOL = {"atol": 1e-6, "rtol": 1e-6}


TENSORS, META = load("udm_grpo")
S = META["settings"]


def per_image_logp(logits: torch.Tensor) -> torch.Tensor:
    """[n_t, B, T, V] -> [B, n_t]: mean log p(x_0^i | state_t) over the N image tokens, ddrl's helpers.

    URSA scores the image tokens from the positions before them (logits[:, -N-1:-1]).
    """
    n_t, B, T, V = logits.shape
    N = S["image_tokens"]
    response = TENSORS["response"]  # [B, N]
    scored = logits[:, :, T - N - 1:T - 1].reshape(n_t * B, N, V)
    lp = token_logprobs(scored, response.repeat(n_t, 1)).view(n_t, B, N)
    return lp.mean(-1).T


def ddrl_step(advantages: torch.Tensor, objective=None):
    """ddrl's loss and gradient w.r.t. the policy logits for the recorded step."""
    objective = objective or OBJECTIVES.get("udm_grpo")(beta=S["kl_beta"])
    logits = TENSORS["policy_logits"].clone().requires_grad_(True)
    B = logits.shape[1]
    per_t = per_image_logp(logits)
    ref = per_image_logp(TENSORS["ref_logits"])
    batch = RolloutBatch(
        prompt_ids=torch.zeros(B, 1, dtype=torch.long), prompt_mask=torch.ones(B, 1, dtype=torch.bool),
        completion_ids=TENSORS["response"], completion_mask=torch.ones_like(TENSORS["response"], dtype=torch.bool),
        group_ids=TENSORS["group_ids"], rewards=TENSORS["rewards"], advantages=advantages,
        mask_seeds=torch.tensor([0]))
    mask = batch.completion_mask
    new = EstimatorOutput(None, per_t.mean(1), mask, {"per_timestep": per_t})
    ref_out = EstimatorOutput(None, ref.mean(1), mask, {"per_timestep": ref})
    out = objective(batch, new, None, ref_out, counts=AggregationCounts.from_batch(batch))
    (grad,) = torch.autograd.grad(out.loss, logits)
    return out.loss.detach().double(), grad


def ddrl_advantages() -> torch.Tensor:
    cls = OBJECTIVES.get("udm_grpo")
    return compute_advantages(TENSORS["rewards"], TENSORS["group_ids"], cls.default_advantage,
                              std=cls.default_advantage_std, clip=S["advantage_clipping"])


def test_advantages_use_the_population_std_and_clip():
    adv = ddrl_advantages()
    torch.testing.assert_close(adv, TENSORS["advantages"], **TOL)
    assert (adv.abs() == S["advantage_clipping"]).any(), "the fixture should exercise the clamp"
    sample = compute_advantages(TENSORS["rewards"], TENSORS["group_ids"], "zscore", std="sample",
                                clip=S["advantage_clipping"])
    assert not torch.allclose(sample, TENSORS["advantages"], atol=1e-3)


def test_step_loss_and_gradient_match_the_released_trainer():
    loss, grad = ddrl_step(ddrl_advantages())
    # accelerate divides each timestep micro-batch's loss by the accumulation count (3)
    torch.testing.assert_close(loss, TENSORS["micro_batch_losses"].mean(), **TOL)
    torch.testing.assert_close(grad, TENSORS["grad_policy_logits"], **TOL)


def test_each_timestep_alone_is_one_released_micro_batch():
    """With one timestep column, ddrl's loss is that timestep's postprocess loss."""
    objective = OBJECTIVES.get("udm_grpo")(beta=S["kl_beta"])
    logits = TENSORS["policy_logits"]
    per_t, ref = per_image_logp(logits), per_image_logp(TENSORS["ref_logits"])
    B = logits.shape[1]
    batch = RolloutBatch(
        prompt_ids=torch.zeros(B, 1, dtype=torch.long), prompt_mask=torch.ones(B, 1, dtype=torch.bool),
        completion_ids=TENSORS["response"], completion_mask=torch.ones_like(TENSORS["response"], dtype=torch.bool),
        group_ids=TENSORS["group_ids"], rewards=TENSORS["rewards"], advantages=ddrl_advantages(),
        mask_seeds=torch.tensor([0]))
    for t in range(per_t.shape[1]):
        new = EstimatorOutput(None, per_t[:, t], batch.completion_mask, {"per_timestep": per_t[:, t:t + 1]})
        ref_out = EstimatorOutput(None, ref[:, t], batch.completion_mask, {"per_timestep": ref[:, t:t + 1]})
        out = objective(batch, new, None, ref_out, counts=AggregationCounts.from_batch(batch))
        torch.testing.assert_close(out.loss.double(), TENSORS["micro_batch_losses"][t], **TOL)

