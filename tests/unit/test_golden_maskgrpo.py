"""MaskGRPO against its authors' trainer: martian422/MaskGRPO's rollout scoring and compute_loss.

The fixture (tests/fixtures/methods/make_maskgrpo.py) ran MaskGRPOTrainer (version "uni", task
"t2t", AR-like remasking, mu = 3) on two prompt groups, each as its own compute_loss call (one
device micro-batch), with a tiny deterministic table model: their masks of all three iterations,
their advantages, the old and reference log-probs, and for every inner iteration k the loss and
its gradient on the current model's tables.

ddrl's maskgrpo estimator with form="released" (masks injected) and objective with
aggregation="group_weighted_token_mean" must reproduce each loss (the mean over the two groups)
and gradient to 1e-6; ddrl's own mask draw must turn their uniforms into their masks; and the
default (paper) form must differ, since it scores only iteration k's masked real tokens.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from ddrl.data import completion_mask
from ddrl.estimators import MaskGRPOEstimator
from ddrl.estimators.maskgrpo import maskgrpo_ratio
from ddrl.objectives import AggregationCounts, compute_advantages
from ddrl.registry import OBJECTIVES
from ddrl.types import RolloutBatch
from tests.fixtures.methods.method_common import load

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "methods"
TOL = {"atol": 1e-6, "rtol": 1e-6}


TENSORS, META = load("maskgrpo")
S = META["settings"]
MU, GROUPS = S["num_iterations"], S["groups"]


class TinyLM(torch.nn.Module):
    """The fixture's model: logits[b, t] = pos[t] + tok[ids[b, t]] (float64)."""

    mask_token_id = S["mask_id"]

    def __init__(self, which: str):
        super().__init__()
        self.pos = torch.nn.Parameter(TENSORS[f"{which}_pos"].clone())
        self.tok = torch.nn.Parameter(TENSORS[f"{which}_tok"].clone())

    def forward(self, ids, attention_mask=None):
        return types.SimpleNamespace(logits=self.pos[None, : ids.shape[1]] + self.tok[ids])


def t(name: str, groups=range(GROUPS)) -> torch.Tensor:
    """A recorded tensor of the given groups, concatenated along the batch (dim 1 for [MU, G, L])."""
    parts = [TENSORS[f"g{g}.{name}"] for g in groups]
    return torch.cat(parts, dim=1 if parts[0].dim() == 3 else 0)


def make_batch(groups=range(GROUPS)) -> RolloutBatch:
    groups = list(groups)
    ids = t("completion_ids", groups)
    G = S["group_size"]
    rewards = t("rewards", groups)
    group_ids = torch.arange(len(groups)).repeat_interleave(G)
    cls = OBJECTIVES.get("maskgrpo")
    adv = compute_advantages(rewards, group_ids, cls.default_advantage, eps=cls.default_advantage_eps)
    prompt = t("prompt_ids", groups)
    return RolloutBatch(prompt_ids=prompt, prompt_mask=torch.ones_like(prompt, dtype=torch.bool),
                        completion_ids=ids, completion_mask=completion_mask(ids, S["eos_id"]), group_ids=group_ids,
                        rewards=rewards, advantages=adv, mask_seeds=TENSORS["g0.mask_seeds"],
                        extras={})


def ddrl_iteration(k: int, form: str = "released", aggregation: str = "group_weighted_token_mean"):
    """ddrl's loss and gradient on the current tables for inner iteration k, with their masks."""
    batch = make_batch()
    batch.extras["inner_iteration"] = k
    est = MaskGRPOEstimator(gamma=S["min_mask_rate"], num_iterations=MU, form=form)
    masks = t("masks") if form == "released" else t("masks")[k:k + 1]
    at = k if form == "released" else 0
    with torch.no_grad():
        old = est.score(TinyLM("old"), batch, masks, at)
        ref = est.score(TinyLM("ref"), batch, masks, at)
    model = TinyLM("cur")
    new = est.score(model, batch, masks, at)
    objective = OBJECTIVES.get("maskgrpo")(epsilon=S["epsilon"], beta=S["beta"], aggregation=aggregation)
    out = objective(batch, new, old, ref, counts=AggregationCounts.from_batch(batch))
    grads = torch.autograd.grad(out.loss, [model.pos, model.tok])
    return out.loss.detach().double(), grads, old


def test_advantages_match():
    torch.testing.assert_close(make_batch().advantages.double(), t("advantages"), **TOL)


@pytest.mark.parametrize("k", range(MU))
def test_ddrl_mask_draw_turns_their_uniforms_into_their_masks(k):
    P = S["prompt_len"]
    est = MaskGRPOEstimator(gamma=S["min_mask_rate"], num_iterations=MU, form="released")
    for g in range(GROUPS):
        batch = make_batch([g])
        u = TENSORS[f"g{g}.uniforms{k}"][:, P:].float()
        mask = est.mask_from_uniforms(batch, u, maskgrpo_ratio(k, MU, S["min_mask_rate"]))
        assert torch.equal(mask, TENSORS[f"g{g}.masks"][k])


@pytest.mark.parametrize("k", range(MU))
def test_released_form_reproduces_each_iteration(k):
    loss, (g_pos, g_tok), old = ddrl_iteration(k)
    # behaviour log-probs of iteration k's forward, wherever the released loss scores them
    scored = t("masks").any(0)
    torch.testing.assert_close(old.token_logp.double()[scored], t("old_logps")[k][scored], **TOL)
    expected = torch.stack([TENSORS[f"g{g}.loss{k}"] for g in range(GROUPS)]).mean()
    torch.testing.assert_close(loss, expected, **TOL)
    for name, grad in (("pos", g_pos), ("tok", g_tok)):
        want = torch.stack([TENSORS[f"g{g}.grad_{name}{k}"] for g in range(GROUPS)]).mean(0)
        torch.testing.assert_close(grad, want, **TOL)


def test_released_masks_score_post_eos_filler():
    batch = make_batch()
    assert (t("masks").any(0) & ~batch.completion_mask).any(), "the fixture should have masked post-EOS positions"


def test_paper_form_differs_from_the_released_loss():
    k = 0
    loss, _, _ = ddrl_iteration(k, form="paper", aggregation="sequence_token_mean")
    expected = torch.stack([TENSORS[f"g{g}.loss{k}"] for g in range(GROUPS)]).mean()
    assert not torch.allclose(loss, expected, atol=1e-4)
