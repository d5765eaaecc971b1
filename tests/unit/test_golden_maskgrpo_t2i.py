"""MaskGRPO's image half against its authors' trainer: t2i scoring and compute_loss on image codes.

The fixture (tests/fixtures/methods/make_maskgrpo_t2i.py) ran martian422/MaskGRPO's
MaskGRPOTrainer (version "uni", task "t2i", mean_method "grpo", min_mask_rate 0.8, epsilon 0.001,
beta 0.01, mu = 3) on two prompt groups of image completions, each its own compute_loss call: the
sequence [prompt, <|soi|>, codes, <|eoi|>], iid masks of the image slots at ratio_k, log-probs over
the code slice 126349:134541, and for every inner iteration k the loss and its gradient.

ddrl's maskgrpo estimator (mode="uniform", form="released", masks injected) on a model whose
logits_range is the image codebook and whose completion_suffix is <|eoi|>, with the objective's
aggregation="group_weighted_token_mean", must reproduce each loss and gradient. Their log-probs are
cast to float32 (`_get_per_token_logps_uni`), so the tolerance is float32's 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from ddrl.estimators import MaskGRPOEstimator
from ddrl.estimators.maskgrpo import maskgrpo_ratio
from ddrl.models.hf import HFDiffusionLM
from ddrl.objectives import AggregationCounts, compute_advantages
from ddrl.registry import OBJECTIVES
from ddrl.types import RolloutBatch
from tests.fixtures.methods.method_common import ImageTableLM, load

TOL = {"atol": 1e-5, "rtol": 1e-5}

TENSORS, META = load("maskgrpo_t2i")
S = META["settings"]
MU, GROUPS, G = S["num_iterations"], S["groups"], S["group_size"]
NAMES = ("emb", "pos", "mix", "head")


def image_model(which: str, **overrides) -> HFDiffusionLM:
    """The fixture's model behind ddrl's wrapper: image codes only (logits_range), <|eoi|> after the completion."""
    params = {n: TENSORS[f"{which}_{n}"] for n in NAMES}
    lo, hi = S["offset"], S["offset"] + S["codebook"]
    settings = {"logits_range": (lo, hi), "suffix": (S["eoi"],), **overrides}
    model = HFDiffusionLM(ImageTableLM(params, lo=lo, vocab=S["vocab"]), mask_token_id=S["mask_id"],
                          vocab_size=S["vocab"], image_token_range=(lo, hi), logits_range=settings["logits_range"])
    model.completion_suffix = settings["suffix"]
    return model


def t(name: str) -> torch.Tensor:
    """A recorded tensor of both groups, concatenated along the batch (dim 1 for [MU, G, L])."""
    parts = [TENSORS[f"g{g}.{name}"] for g in range(GROUPS)]
    return torch.cat(parts, dim=1 if parts[0].dim() == 3 else 0)


def make_batch() -> RolloutBatch:
    """ddrl's prompt ends with <|soi|> (MMaDAT2ITokenizer.encode_prompt); the completion is code ids."""
    prompt = t("prompt_ids")
    prompt = torch.cat([prompt, torch.full((len(prompt), 1), S["soi"])], dim=1)
    ids = t("completion_ids")
    rewards = t("rewards")
    group_ids = torch.arange(GROUPS).repeat_interleave(G)
    cls = OBJECTIVES.get("maskgrpo")
    adv = compute_advantages(rewards, group_ids, cls.default_advantage, eps=cls.default_advantage_eps)
    return RolloutBatch(prompt_ids=prompt, prompt_mask=torch.ones_like(prompt, dtype=torch.bool), completion_ids=ids,
                        completion_mask=torch.ones_like(ids, dtype=torch.bool), group_ids=group_ids, rewards=rewards,
                        advantages=adv, mask_seeds=TENSORS["g0.mask_seeds"], extras={})


def estimator() -> MaskGRPOEstimator:
    return MaskGRPOEstimator(gamma=S["min_mask_rate"], mode="uniform", num_iterations=MU, form="released")


def ddrl_iteration(k: int, **model_overrides):
    """ddrl's loss and gradient on the current parameters for inner iteration k, with their masks."""
    batch = make_batch()
    est, masks = estimator(), t("masks")
    with torch.no_grad():
        old = est.score(image_model("old", **model_overrides), batch, masks, k)
        ref = est.score(image_model("ref", **model_overrides), batch, masks, k)
    model = image_model("cur", **model_overrides)
    new = est.score(model, batch, masks, k)
    objective = OBJECTIVES.get("maskgrpo")(epsilon=S["epsilon"], beta=S["beta"], aggregation="group_weighted_token_mean")
    out = objective(batch, new, old, ref, counts=AggregationCounts.from_batch(batch))
    params = [getattr(model.model, n) for n in NAMES]
    return out, dict(zip(NAMES, torch.autograd.grad(out.loss, params))), old, ref


def expected_loss(k: int) -> torch.Tensor:
    return torch.stack([TENSORS[f"g{g}.loss{k}"] for g in range(GROUPS)]).mean()


def test_advantages_match():
    torch.testing.assert_close(make_batch().advantages.double(), t("advantages"), **TOL)


@pytest.mark.parametrize("k", range(MU))
def test_ddrl_mask_draw_turns_their_uniforms_into_their_image_masks(k):
    ratio = maskgrpo_ratio(k, MU, S["min_mask_rate"])
    assert ratio == pytest.approx(min(0.8 + 0.2 * (k + 1) / MU, 0.999))
    batch = make_batch()
    u = torch.cat([TENSORS[f"g{g}.uniforms{k}"] for g in range(GROUPS)]).float()
    assert torch.equal(estimator().mask_from_uniforms(batch, u, ratio), t("masks")[k])


@pytest.mark.parametrize("k", range(MU))
def test_released_form_reproduces_each_image_iteration(k):
    out, grads, old, ref = ddrl_iteration(k)
    scored = t("masks").any(0)  # every position some iteration masked
    torch.testing.assert_close(old.token_logp.double()[scored], t("old_logps")[k][scored], **TOL)
    torch.testing.assert_close(ref.token_logp.double()[scored], t("ref_logps")[k][scored], **TOL)
    torch.testing.assert_close(out.loss.detach().double(), expected_loss(k), **TOL)
    for name, grad in grads.items():
        want = torch.stack([TENSORS[f"g{g}.grad_{name}{k}"] for g in range(GROUPS)]).mean(0)
        torch.testing.assert_close(grad, want, **TOL)
    assert 0.2 < float(out.stats["clip_frac"]) < 0.8  # epsilon 0.001 clips part of the tokens, not all


def test_without_the_eoi_suffix_the_loss_differs():
    out, _, old, _ = ddrl_iteration(0, suffix=())
    scored = t("masks").any(0)
    assert not torch.allclose(old.token_logp.double()[scored], t("old_logps")[0][scored], atol=1e-3, rtol=0)
    assert not torch.allclose(out.loss.detach().double(), expected_loss(0), **TOL)


def test_softmax_over_the_whole_vocabulary_differs():
    """Their log-probs normalise over the 8,192 codes only; ddrl's logits_range does the same."""
    out, _, _, _ = ddrl_iteration(0, logits_range=None)
    assert not torch.allclose(out.loss.detach().double(), expected_loss(0), atol=1e-4, rtol=0)
