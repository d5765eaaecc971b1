"""FPO and DiPOD against their authors' trainer: DiPOD-release's DiffuGRPOTrainer with fpo=True.

The fixture (tests/fixtures/methods/make_dipod.py) ran their rollout scoring on two prompt groups
(completion mask before the first EOS, behaviour and reference ELBOs, the ELBO masks their
`_get_sequence_elbo` drew, advantages) and then their compute_loss for mu = 3 inner iterations,
all reusing that one mask set, each with a different current model, with dipod_beta = 0.05 (DiPOD)
and 0 (FPO). Each group was one compute_loss call (one device micro-batch).

ddrl's fpo_elbo estimator (exclude_eos=True, the FPO/DiPOD default; their masks injected) and the
fpo / dipod objectives must reproduce the ELBOs, each iteration's loss (the mean over the two
groups) and gradients to 1e-6, and the objectives must declare the mask reuse.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from ddrl.data import completion_mask
from ddrl.estimators import FPOElbo
from ddrl.objectives import AggregationCounts, compute_advantages
from ddrl.registry import OBJECTIVES
from ddrl.types import EstimatorOutput, RolloutBatch
from tests.fixtures.methods.method_common import load

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "methods"
TOL = {"atol": 1e-6, "rtol": 1e-6}


TENSORS, META = load("dipod")
S = META["settings"]
MU, GROUPS = S["num_iterations"], S["groups"]
METHODS = {"dipod": {"elbo_reg": S["dipod_beta"]}, "fpo": {}}


class TinyLM(torch.nn.Module):
    """The fixture's model: logits[b, t] = pos[t] + tok[ids[b, t]] (float64)."""

    mask_token_id, eos_token_id = S["mask_id"], S["eos_id"]

    def __init__(self, which: str):
        super().__init__()
        self.pos = torch.nn.Parameter(TENSORS[f"{which}_pos"].clone())
        self.tok = torch.nn.Parameter(TENSORS[f"{which}_tok"].clone())

    def forward(self, ids, attention_mask=None):
        return types.SimpleNamespace(logits=self.pos[None, : ids.shape[1]] + self.tok[ids])


def t(name: str) -> torch.Tensor:
    """A recorded tensor of both groups along the batch (dim 1 for the [N, G, L] masks)."""
    parts = [TENSORS[f"g{g}.{name}"] for g in range(GROUPS)]
    return torch.cat(parts, dim=1 if name in ("masks", "mask_rates") else 0)


def make_batch() -> RolloutBatch:
    ids, rewards = t("completion_ids"), t("rewards")
    group_ids = torch.arange(GROUPS).repeat_interleave(S["group_size"])
    prompt = t("prompt_ids")
    return RolloutBatch(prompt_ids=prompt, prompt_mask=torch.ones_like(prompt, dtype=torch.bool),
                        completion_ids=ids, completion_mask=completion_mask(ids, S["eos_id"]), group_ids=group_ids,
                        rewards=rewards, advantages=compute_advantages(rewards, group_ids, "mean"),
                        mask_seeds=torch.tensor([0]))


def estimator() -> FPOElbo:
    return FPOElbo(num_samples=S["elbo_num_samples"], **OBJECTIVES.get("fpo").default_estimator_args)


def objective(method: str):
    return OBJECTIVES.get(method)(epsilon=S["epsilon"], beta=S["beta"], **METHODS[method])


def expected(method: str, what: str, k: int) -> torch.Tensor:
    """The released value of the whole batch: the mean over the two groups' compute_loss calls."""
    return torch.stack([TENSORS[f"g{g}.{method}.{what}{k}"] for g in range(GROUPS)]).mean(0)


def test_released_defaults():
    for method in ("fpo", "dipod"):
        cls = OBJECTIVES.get(method)
        assert cls.reuse_masks and cls.default_estimator == "fpo_elbo" and cls.default_advantage == "mean"
        assert cls.default_estimator_args == {"exclude_eos": True}


def test_completion_mask_and_advantages_match():
    batch = make_batch()
    assert torch.equal(estimator().eligible(batch, TinyLM("old")), t("completion_mask"))
    torch.testing.assert_close(batch.advantages.double(), t("advantages"), **TOL)


def test_ddrl_draw_has_their_mask_structure():
    """k_n = floor(u_n Lc) positions among the tokens before the first EOS."""
    batch, model = make_batch(), TinyLM("old")
    est = estimator()
    masks = est.draw_masks(batch, seed=3, model=model)
    assert not (masks & ~t("completion_mask")[None]).any()
    assert (masks.sum(-1) < t("completion_mask").sum(-1)[None]).all()  # u < 1: never all of Lc
    lengths = t("completion_mask").sum(-1).double()  # [B] Lc
    assert torch.equal(t("masks").sum(-1).double(), torch.floor(t("mask_rates") * lengths))  # theirs, same rule


def test_behaviour_and_reference_elbos_match():
    batch, est = make_batch(), estimator()
    with torch.no_grad():
        old = est.score(TinyLM("old"), batch, t("masks"))
        ref = est.score(TinyLM("ref"), batch, t("masks"))
    torch.testing.assert_close(old.seq_logp.double(), t("old_elbos"), **TOL)
    torch.testing.assert_close(ref.seq_logp.double(), t("ref_elbos"), **TOL)


@pytest.mark.parametrize("method", ["dipod", "fpo"])
@pytest.mark.parametrize("k", range(MU))
def test_each_inner_iteration_with_the_reused_masks(method, k):
    batch, est = make_batch(), estimator()
    masks = t("masks")  # the one mask set of the rollout, for every k
    with torch.no_grad():
        old = est.score(TinyLM("old"), batch, masks)
        ref = est.score(TinyLM("ref"), batch, masks)
    model = TinyLM(f"cur{k}")
    new = est.score(model, batch, masks)
    out = objective(method)(batch, new, old, ref, counts=AggregationCounts.from_batch(batch))
    g_pos, g_tok = torch.autograd.grad(out.loss, [model.pos, model.tok])
    torch.testing.assert_close(new.seq_logp.double(), t(f"{method}.elbos{k}"), **TOL)
    torch.testing.assert_close(out.loss.double(), expected(method, "loss", k), **TOL)
    torch.testing.assert_close(g_pos, expected(method, "grad_pos", k), **TOL)
    torch.testing.assert_close(g_tok, expected(method, "grad_tok", k), **TOL)


@pytest.mark.parametrize("method", ["dipod", "fpo"])
@pytest.mark.parametrize("k", range(MU))
def test_objective_on_their_elbos(method, k):
    """The objective alone, fed their float64 ELBOs: loss and gradient w.r.t. the current ELBOs."""
    batch = make_batch()
    elbo = t(f"{method}.elbos{k}").clone().requires_grad_(True)
    mask = batch.completion_mask
    new = EstimatorOutput(None, elbo, mask, {"elbo": elbo})
    old = EstimatorOutput(None, t("old_elbos"), mask, {"elbo": t("old_elbos")})
    ref = EstimatorOutput(None, t("ref_elbos"), mask, {"elbo": t("ref_elbos")})
    out = objective(method)(batch, new, old, ref, counts=AggregationCounts.from_batch(batch))
    (grad,) = torch.autograd.grad(out.loss, elbo)
    torch.testing.assert_close(out.loss.double(), expected(method, "loss", k), **TOL)
    # each group's loss is a mean over its 3 rows; the batch loss is the mean of the two groups
    torch.testing.assert_close(grad.double(), t(f"{method}.grad_elbos{k}") / GROUPS, **TOL)


def test_redrawn_masks_would_differ():
    """Reuse matters: a fresh draw at iteration 1 gives another ratio than the released one."""
    batch, est, model = make_batch(), estimator(), TinyLM("cur1")
    fresh = est.draw_masks(batch, seed=11, model=model)
    with torch.no_grad():
        new = est.score(model, batch, fresh)
    assert not torch.allclose(new.seq_logp.double(), t("dipod.elbos1"), atol=1e-3)
