"""SEPO: the concrete-score policy-gradient identity, the `concrete_score` estimator, the objective.

An exact tiny model: an explicit categorical distribution π_θ over all V^L completions (V = 3,
L <= 2), parameterised by a logits table, wrapped as a masked denoiser whose prediction at a masked
position is the exact conditional of π_θ given the visible tokens.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import ddrl.estimators.concrete_score  # noqa: F401  (registers "concrete_score")
from ddrl.estimators.concrete_score import masked_position_log_probs, score_surrogate
from ddrl.objectives import AggregationCounts
from ddrl.registry import ESTIMATORS, OBJECTIVES
from ddrl.types import RolloutBatch

V, MASK = 3, 3  # real tokens 0..2, mask id 3 (vocabulary of 4)


@dataclass
class Output:
    logits: torch.Tensor


class ExactJoint(nn.Module):
    """Masked denoiser with exact conditionals of π_θ(x) = softmax(table)[x] over all V^L completions."""

    def __init__(self, length: int, seed: int = 0, prompt_len: int = 1, shifted: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = nn.Parameter(torch.randn((V,) * length, generator=g, dtype=torch.float64))
        self.length, self.prompt_len = length, prompt_len
        self.mask_token_id, self.logits_shifted = MASK, shifted
        self.space = torch.tensor(list(itertools.product(range(V), repeat=length)))  # [N, L]

    def log_joint(self) -> torch.Tensor:  # [N] log π_θ over self.space
        return torch.log_softmax(self.table.reshape(-1), 0)

    def forward(self, input_ids, attention_mask=None):
        x = input_ids[:, self.prompt_len:]  # [B, L]
        visible = x != MASK
        consistent = ((self.space[None] == x[:, None]) | ~visible[:, None]).all(-1)  # [B, N]
        scores = torch.where(consistent, self.log_joint()[None], torch.tensor(float("-inf"), dtype=torch.float64))
        logits = torch.zeros(*input_ids.shape, V + 1, dtype=torch.float64)
        for i in range(self.length):
            onehot = self.space[:, i][None, :, None] == torch.arange(V)[None, None, :]  # [1, N, V]
            per_value = torch.where(onehot, scores[:, :, None], torch.tensor(float("-inf"), dtype=torch.float64))
            logits[:, self.prompt_len + i, :V] = torch.logsumexp(per_value, dim=1)
        logits[..., MASK] = float("-inf")
        if self.logits_shifted:
            logits = torch.cat([logits[:, 1:], logits[:, :1]], dim=1)  # position t's prediction at t-1
        return Output(logits)


def batch_of(completions, prompt_len=1, completion_mask=None):
    x = torch.tensor(completions)
    b, length = x.shape
    mask = torch.ones(b, length, dtype=torch.bool) if completion_mask is None else torch.tensor(completion_mask)
    return RolloutBatch(
        prompt_ids=torch.zeros(b, prompt_len, dtype=torch.long),
        prompt_mask=torch.ones(b, prompt_len, dtype=torch.bool),
        completion_ids=x, completion_mask=mask, group_ids=torch.zeros(b, dtype=torch.long),
        rewards=torch.zeros(b), advantages=torch.zeros(b), mask_seeds=torch.tensor([11]))


def grad_of(value, model):
    (g,) = torch.autograd.grad(value, model.table, retain_graph=True)
    return g


def index_of(model, x):
    return int((model.space == torch.tensor(x)).all(-1).nonzero())


def test_sepo_identity_over_the_whole_space():
    """∇ log π(x) = -Σ_y π(y) ∇ log s(x)_y with s(x)_y = π(y)/π(x) over all y (L = 2, V = 3)."""
    model = ExactJoint(length=2, seed=1)
    log_pi = model.log_joint()  # [9]
    for n in range(len(model.space)):
        log_scores = log_pi - log_pi[n]  # log s(x)_y for every y
        assert log_pi[n].item() == pytest.approx(-torch.logsumexp(log_scores, 0).item(), abs=1e-12)
        surrogate = score_surrogate(log_scores, log_pi.exp())
        torch.testing.assert_close(grad_of(surrogate, model), grad_of(log_pi[n], model), atol=1e-6, rtol=0)


def test_hamming_neighbourhood_alone_is_not_the_identity():
    """The identity needs the normalised weights of the set summed over; Hamming-1 of x (5 of 9) is not it."""
    model = ExactJoint(length=2, seed=2)
    log_pi = model.log_joint()
    n = index_of(model, [0, 1])
    hamming = ((model.space != model.space[n]).sum(-1) <= 1)
    weights = torch.where(hamming, log_pi.exp(), 0.0)
    surrogate = score_surrogate(log_pi - log_pi[n], weights)
    assert (grad_of(surrogate, model) - grad_of(log_pi[n], model)).abs().max() > 1e-3


def test_estimator_scores_are_exact_ratios_and_conditionals():
    model = ExactJoint(length=2, seed=3)
    log_pi = model.log_joint().detach()
    completions = [list(x) for x in itertools.product(range(V), repeat=2)]
    batch = batch_of(completions)
    positions = torch.tensor([[0, 1]] * len(completions))
    log_probs = masked_position_log_probs(model, batch, positions)  # [9, 2, V]
    for r, x in enumerate(completions):
        for k, i in enumerate((0, 1)):
            for v in range(V):
                y = list(x)
                y[i] = v
                log_s = log_probs[r, k, v] - log_probs[r, k, x[i]]
                expected = log_pi[index_of(model, y)] - log_pi[index_of(model, x)]
                assert log_s.item() == pytest.approx(expected.item(), abs=1e-10)  # s(x)_y = π(y)/π(x)


def test_estimator_surrogate_gradient_is_the_conditional_log_likelihood_gradient():
    """∇ S_i = -Σ_v π̂(y_{i,v}) ∇ log s(x)_{i,v} = ∇ log π(x^i | x^{-i}) on every probed position."""
    model = ExactJoint(length=2, seed=4)
    estimator = ESTIMATORS.get("concrete_score")(num_positions=2)
    completions = [[0, 2], [1, 1], [2, 0]]
    out = estimator(model, batch_of(completions), seed=0)
    assert out.mask.all()
    log_pi = model.log_joint()
    for r, x in enumerate(completions):
        for i in (0, 1):
            column = [index_of(model, [v, x[1]] if i == 0 else [x[0], v]) for v in range(V)]
            log_cond = log_pi[index_of(model, x)] - torch.logsumexp(log_pi[column], 0)  # log π(x^i | x^{-i})
            assert out.token_logp[r, i].item() == pytest.approx(log_cond.item(), abs=1e-10)
            torch.testing.assert_close(grad_of(out.extras["score_surrogate"][r, i], model), grad_of(log_cond, model),
                                       atol=1e-6, rtol=0)
    # seq_logp is the pseudo-log-likelihood (all positions probed here)
    torch.testing.assert_close(out.seq_logp, out.token_logp.sum(1))


def test_one_token_completion_gives_the_full_identity_through_the_estimator():
    """With L = 1 the neighbourhood of the probed position is the whole space: ∇S = ∇ log π(x) exactly."""
    model = ExactJoint(length=1, seed=5)
    out = ESTIMATORS.get("concrete_score")()(model, batch_of([[0], [1], [2]]), seed=3)
    log_pi = model.log_joint()
    for x in range(V):
        torch.testing.assert_close(grad_of(out.extras["score_surrogate"][x, 0], model), grad_of(log_pi[x], model),
                                   atol=1e-6, rtol=0)


def test_sepo_objective_is_reinforce_on_policy_for_an_exact_model():
    """sepo + concrete_score with old = sg(new) (ρ = 1): gradient = -(1/B) Σ_b A_b ∇ log π(x_b)."""
    model = ExactJoint(length=1, seed=6)
    batch = batch_of([[0], [1], [2], [1]])
    batch.advantages = torch.tensor([1.0, -0.5, 2.0, -1.5])
    new = ESTIMATORS.get("concrete_score")()(model, batch, seed=0)
    loss = OBJECTIVES.get("sepo")()(batch, new, None, None, counts=AggregationCounts.from_batch(batch)).loss
    log_pi = model.log_joint()
    reinforce = -(batch.advantages.double() * log_pi[batch.completion_ids[:, 0]]).mean()
    torch.testing.assert_close(grad_of(loss, model), grad_of(reinforce, model), atol=1e-6, rtol=0)


def test_snis_weights_are_unbiased_draws_of_the_conditional():
    model = ExactJoint(length=2, seed=7)
    batch = batch_of([[0, 1], [2, 2]])
    exact = ESTIMATORS.get("concrete_score")(num_positions=2)(model, batch, seed=1)
    few = ESTIMATORS.get("concrete_score")(num_positions=2, snis_samples=2)(model, batch, seed=1)
    many = ESTIMATORS.get("concrete_score")(num_positions=2, snis_samples=40000)(model, batch, seed=1)
    torch.testing.assert_close(few.token_logp, exact.token_logp)  # the ratio part does not depend on M
    g_exact = grad_of(exact.extras["score_surrogate"].sum(), model)
    g_many = grad_of(many.extras["score_surrogate"].sum(), model)
    torch.testing.assert_close(g_many, g_exact, atol=0.03, rtol=0)
    assert not torch.equal(grad_of(few.extras["score_surrogate"].sum(), model), g_exact)


def test_positions_are_seeded_distinct_and_inside_the_completion():
    model = ExactJoint(length=2, seed=8)
    estimator = ESTIMATORS.get("concrete_score")(num_positions=1)
    batch = batch_of([[0, 1], [1, 2], [2, 0], [0, 0]], completion_mask=[[1, 1], [1, 1], [1, 0], [1, 1]])
    a, b = estimator(model, batch, seed=5), estimator(model, batch, seed=5)
    assert torch.equal(a.mask, b.mask) and torch.equal(a.token_logp, b.token_logp)
    assert (a.mask.sum(1) == 1).all() and not (a.mask & ~batch.completion_mask).any()
    masks = {tuple(estimator(model, batch, seed=s).mask[0].tolist()) for s in range(12)}
    assert masks == {(True, False), (False, True)}  # both positions get probed across seeds
    wide = ESTIMATORS.get("concrete_score")(num_positions=5)(model, batch, seed=0)  # more than L: all tokens
    assert torch.equal(wide.mask, batch.completion_mask)


def test_on_a_transformer_with_padding():
    from tests.toy_models import ToyDiffusionLM

    model = ToyDiffusionLM(vocab_size=12, mask_token_id=11)
    g = torch.Generator().manual_seed(0)
    batch = RolloutBatch(
        prompt_ids=torch.tensor([[0, 5, 6], [7, 8, 9]]), prompt_mask=torch.tensor([[False, True, True], [True] * 3]),
        completion_ids=torch.randint(2, 11, (2, 6), generator=g),
        completion_mask=torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool),
        group_ids=torch.tensor([0, 0]), rewards=torch.tensor([1.0, 0.0]), advantages=torch.tensor([0.5, -0.5]),
        mask_seeds=torch.tensor([4]))
    out = ESTIMATORS.get("concrete_score")(num_positions=3)(model, batch, seed=4)
    assert out.mask.sum().item() == 6 and not (out.mask & ~batch.completion_mask).any()
    assert torch.isfinite(out.token_logp).all() and (out.token_logp[out.mask] < 0).all()
    old = ESTIMATORS.get("concrete_score")(num_positions=3)(model, batch, seed=4)
    loss = OBJECTIVES.get("sepo")()(batch, out, old.detach(), None, counts=AggregationCounts.from_batch(batch)).loss
    loss.backward()
    assert sum(p.grad.abs().sum() for p in model.parameters() if p.grad is not None) > 0


def test_trace_states_score_the_decoding_path_like_the_trace_estimator():
    """states='trace': each cell is scored in the state the sampler committed it from, so the log-probs are
    the trace estimator's exactly and the surrogate's gradient is that of log p(x^i | that state)."""
    from ddrl.types import Trajectory

    model = ExactJoint(length=3, seed=5)
    batch = batch_of([[0, 2, 1], [1, 1, 0], [2, 0, 2]])
    commit = torch.tensor([[0, 1, 1], [1, 0, 0], [0, 0, 1]])  # two decoding steps, several cells per step
    batch.trajectory = Trajectory(commit_step=commit, token_probs=torch.rand(3, 2, 3))
    estimator = ESTIMATORS.get("concrete_score")(num_positions=3, states="trace")
    assert estimator.needs_trajectory
    out = estimator(model, batch, seed=0)
    trace = ESTIMATORS.get("trace")()(model, batch, seed=0)
    assert out.mask.all()
    torch.testing.assert_close(out.token_logp, trace.token_logp, atol=1e-6, rtol=0, check_dtype=False)
    single = ESTIMATORS.get("concrete_score")(num_positions=3)(model, batch, seed=0)
    assert (single.token_logp - out.token_logp).abs().max() > 1e-3  # the single-cell states differ
    for r in range(3):
        for i in range(3):
            torch.testing.assert_close(grad_of(out.extras["score_surrogate"][r, i], model),
                                       grad_of(trace.token_logp[r, i], model), atol=1e-6, rtol=0, check_dtype=False)
    with pytest.raises(ValueError, match="trajectory"):
        estimator(model, batch_of([[0, 1, 2]]), seed=0)
    with pytest.raises(ValueError, match="states"):
        ESTIMATORS.get("concrete_score")(states="all")


def test_neighbour_extras_ratios_are_the_conditional_ratio_and_released_clip_is_reinforce_on_policy():
    """With exact scores every neighbour of position i gives the same ratio p_θ(x^i|x^{-i})/p_old(x^i|x^{-i});
    on-policy (old = None) the released per-neighbour form is REINFORCE, as the per-sample one is."""
    from ddrl.objectives.sepo import released_surrogates

    model = ExactJoint(length=2, seed=9)
    old_model = ExactJoint(length=2, seed=9)
    with torch.no_grad():
        old_model.table.add_(0.3 * torch.randn(old_model.table.shape, generator=torch.Generator().manual_seed(1),
                                               dtype=torch.float64))
    batch = batch_of([[0, 1], [2, 2], [1, 0]])
    estimator = ESTIMATORS.get("concrete_score")(num_positions=2, neighbour_extras=True)
    new, old = estimator(model, batch, seed=2), estimator(old_model, batch, seed=2).detach()
    assert new.extras["log_scores"].shape == (3, 2, V + 1) and new.extras["probe_valid"].all()
    _, _, ratio = released_surrogates(new.extras, old.extras, 0.2)  # [B, K, V+1]
    positions = new.extras["probe_positions"]
    expected = (new.token_logp - old.token_logp).gather(1, positions).exp()  # [B, K]
    real = ratio[..., :V]  # the mask token's weight is 0 (ratio 1 by convention)
    torch.testing.assert_close(real, expected[..., None].expand_as(real), atol=1e-9, rtol=1e-9)

    one = ExactJoint(length=1, seed=6)
    batch = batch_of([[0], [1], [2], [1]])
    batch.advantages = torch.tensor([1.0, -0.5, 2.0, -1.5])
    out = ESTIMATORS.get("concrete_score")(neighbour_extras=True)(one, batch, seed=0)
    loss = OBJECTIVES.get("sepo")(clip="released")(batch, out, None, None,
                                                   counts=AggregationCounts.from_batch(batch)).loss
    reinforce = -(batch.advantages.double() * one.log_joint()[batch.completion_ids[:, 0]]).mean()
    torch.testing.assert_close(grad_of(loss, one), grad_of(reinforce, one), atol=1e-9, rtol=0)
    with pytest.raises(ValueError, match="neighbour_extras"):
        plain = ESTIMATORS.get("concrete_score")()(one, batch, seed=0)
        OBJECTIVES.get("sepo")(clip="released")(batch, plain, None, None, counts=AggregationCounts.from_batch(batch))
    with pytest.raises(ValueError, match="clip"):
        OBJECTIVES.get("sepo")(clip="batch")
