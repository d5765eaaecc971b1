"""Objectives, advantages, KL estimators and loss aggregation.

Expected losses are written out by hand from each paper's formula on 2 groups x 2 samples x 3
tokens; the ratio values are chosen so each clip branch is exercised (see the comments per row).
"""

from __future__ import annotations

import math

import pytest
import torch

from ddrl.objectives import (
    AggregationCounts,
    compute_advantages,
    describe_methods,
    inject_ratio_noise,
    kl,
)
from ddrl.objectives.aggregation import (
    group_mean,
    group_softmax,
    length_weighted_mean,
    sequence_mean,
    sequence_token_mean,
    sequence_token_sum,
    token_mean,
)
from ddrl.registry import OBJECTIVES, RegistryError
from ddrl.types import EstimatorOutput, RolloutBatch

LN2 = math.log(2.0)
ADV = [1.0, -1.0, 0.5, -0.5]
GROUPS = [0, 0, 1, 1]
COMPLETION = [[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]]  # 9 completion tokens


def make_batch(adv=ADV, completion=COMPLETION, groups=GROUPS, rewards=None, extras=None, seed=7):
    mask = torch.tensor(completion, dtype=torch.bool)
    b, length = mask.shape
    rewards = torch.zeros(b) if rewards is None else torch.tensor(rewards, dtype=torch.float32)
    return RolloutBatch(
        prompt_ids=torch.zeros(b, 2, dtype=torch.long), prompt_mask=torch.ones(b, 2, dtype=torch.bool),
        completion_ids=torch.zeros(b, length, dtype=torch.long), completion_mask=mask,
        group_ids=torch.tensor(groups), rewards=rewards, advantages=torch.tensor(adv, dtype=torch.float32),
        mask_seeds=torch.tensor([seed]), extras=extras or {})


def est(token_logp=None, seq_logp=None, mask=None, **extras):
    t = lambda x: None if x is None else torch.as_tensor(x, dtype=torch.float32)  # noqa: E731
    token_logp, seq_logp = t(token_logp), t(seq_logp)
    if mask is None:
        mask = torch.tensor(COMPLETION, dtype=torch.bool)
    return EstimatorOutput(token_logp, seq_logp, torch.as_tensor(mask, dtype=torch.bool),
                           {k: t(v) for k, v in extras.items()})


def counts_of(batch):
    return AggregationCounts.from_batch(batch)


def objective(name, **kwargs):
    return OBJECTIVES.get(name)(**kwargs)


# --------------------------------------------------------------------------------------------
# Token-level PPO family (d1 GRPO, coupled-GRPO, UniGRPO, MaskGRPO, TraceRL, DACA)
# --------------------------------------------------------------------------------------------

# Per-token ratios ρ = π_θ/π_old; 9.0 sits on positions outside the completion mask (must be ignored).
RATIOS = [[1.2, 2.0, 0.4], [0.4, 2.0, 9.0], [1.0, 1.0, 1.0], [3.0, 9.0, 9.0]]
# ref - θ log-prob differences Δ: k3(Δ=ln2) = 1 - ln2, k3(Δ=-ln2) = ln2 - 0.5; they sum to 0.5.
REF_DELTA = [[0.0, LN2, 0.0], [0.0, 0.0, 5.0], [-LN2, 0.0, 0.0], [0.0, 0.0, 0.0]]


def token_outputs(ratios=RATIOS, delta=REF_DELTA, mask=None):
    new_lp = torch.full((4, 3), -1.0, requires_grad=True)
    log_r = torch.log(torch.tensor(ratios))
    new = EstimatorOutput(new_lp, None, torch.tensor(COMPLETION if mask is None else mask, dtype=torch.bool))
    old = EstimatorOutput(new_lp.detach() - log_r, None, new.mask)
    ref = EstimatorOutput(new_lp.detach() + torch.tensor(delta), None, new.mask)
    return new_lp, new, old, ref


def test_grpo_hand_computed():
    # ε = 0.5 -> clip to [0.5, 1.5]; loss per token = -min(ρA, clip(ρ)A)
    # row 0, A=+1: ρ 1.2 -> -1.2 ; ρ 2.0 -> -1.5 (clipped) ; ρ 0.4 -> -0.4 (unclipped: min picks 0.4)
    # row 1, A=-1: ρ 0.4 -> +0.5 (clipped) ; ρ 2.0 -> +2.0 (NOT clipped: conditional clipping)
    # row 2, A=+.5: three ρ=1 -> -0.5 each ; row 3, A=-.5: ρ 3.0 -> +1.5 (not clipped)
    # surrogate sum = -3.1 + 2.5 - 1.5 + 1.5 = -0.6 over 9 tokens; KL sum = 0.5, β = 0.04
    batch = make_batch()
    _, new, old, ref = token_outputs()
    out = objective("grpo")(batch, new, old, ref, counts=counts_of(batch))
    assert out.loss.item() == pytest.approx((-0.6 + 0.04 * 0.5) / 9, abs=1e-6)
    assert out.stats["clip_frac"].item() == pytest.approx(2 / 9)
    assert out.stats["ratio_max"].item() == pytest.approx(3.0)
    assert out.stats["kl"].item() == pytest.approx(0.5 / 9, abs=1e-6)
    assert all(not v.requires_grad and v.dim() == 0 for v in out.stats.values())
    assert OBJECTIVES.get("diffu_grpo") is OBJECTIVES.get("grpo")


def test_grpo_without_old_is_on_policy_ratio_one():
    batch = make_batch()
    new_lp, new, _, ref = token_outputs()
    out = objective("grpo", beta=0.0)(batch, new, None, None, counts=counts_of(batch))
    # ρ ≡ 1: loss = -Σ A·len / 9 = -(3 - 2 + 1.5 - 0.5)/9 ; gradient -A/9 on every completion token
    assert out.loss.item() == pytest.approx(-2.0 / 9)
    out.loss.backward()
    expected = -torch.tensor(ADV)[:, None] / 9 * torch.tensor(COMPLETION)
    torch.testing.assert_close(new_lp.grad, expected)


def test_coupled_grpo_hand_computed():
    batch = make_batch()
    _, new, old, ref = token_outputs()
    obj = objective("coupled_grpo")
    assert (obj.epsilon, obj.beta, obj.default_advantage) == (0.5, 0.01, "loo")
    assert obj.default_estimator == "coupled_three_pass"
    out = obj(batch, new, old, ref, counts=counts_of(batch))
    assert out.loss.item() == pytest.approx((-0.6 + 0.01 * 0.5) / 9, abs=1e-6)


@pytest.mark.parametrize("name", ["unigrpo", "maskgrpo"])
def test_masked_token_objectives_hand_computed(name):
    # The estimator scored only these positions; ε = 0.2 -> clip [0.8, 1.2]; per-sample mean, / 4.
    scored = [[1, 0, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1]]  # & completion -> rows score 2, 2, 2, 1 tokens
    # row 0 (A=1): ρ 1.2 -> -1.2, ρ 0.4 -> -0.4 : mean -0.8
    # row 1 (A=-1): ρ 0.4 -> +0.8 (clipped), ρ 2.0 -> +2.0 : mean 1.4
    # row 2 (A=.5): -0.5 ; row 3 (A=-.5): ρ 3 -> +1.5
    delta = [[0.0, 5.0, 0.0], [0.0, LN2, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]  # row 1 KL mean (1-ln2)/2
    batch = make_batch()
    _, new, old, ref = token_outputs(delta=delta, mask=scored)
    out = objective(name)(batch, new, old, ref, counts=counts_of(batch))
    if name == "maskgrpo":  # k3 to the reference, mean over each sample's masked tokens
        expected = (-0.8 + 1.4 - 0.5 + 1.5) / 4 + 0.01 * ((1 - LN2) / 2) / 4
    else:  # UniGRPO as dLLM-RL: k3 to the behaviour policy, summed over each row's masked tokens, / rows
        k3 = lambda r: 1 / r + math.log(r) - 1  # noqa: E731
        expected = (-0.8 + 1.4 - 0.5 + 1.5) / 4 + 0.01 * (k3(1.2) + k3(0.4) + k3(0.4) + k3(2.0) + k3(3.0)) / 4
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)


def test_tracerl_hand_computed():
    # ε = 0.2; per-sample token mean, / B.  KL k3 against OLD: Δ = old - θ = -ln ρ -> k3 = 1/ρ + ln ρ - 1,
    # summed over each sample's targets, / B.
    batch = make_batch()
    _, new, old, _ = token_outputs()
    obj = objective("tracerl")
    out = obj(batch, new, old, None, counts=counts_of(batch))
    surrogate = ((-1.2 - 1.2 - 0.4) / 3 + (0.8 + 2.0) / 2 - 0.5 + 1.5) / 4
    k3 = lambda r: 1 / r + math.log(r) - 1  # noqa: E731
    kl_sum = k3(1.2) + k3(2.0) + k3(0.4) + k3(0.4) + k3(2.0) + 3 * k3(1.0) + k3(3.0)
    assert out.loss.item() == pytest.approx(surrogate + 0.01 * kl_sum / 4, abs=1e-6)
    assert obj.needs_old and not obj.needs_ref and obj.needs_trajectory
    assert obj.default_advantage_std == "population"


def test_daca_token_weights():
    # DPS weights multiply the per-token surrogate (not the KL):
    # row 0: -1.2·2 - 1.5·1 - 0.4·0.5 = -4.1 ; row 1: 0.5·1 + 2.0·3 = 6.5 ; row 2: -1.5 ; row 3: 1.5·0.5
    weights = torch.tensor([[2.0, 1.0, 0.5], [1.0, 3.0, 1.0], [1.0, 1.0, 1.0], [0.5, 1.0, 1.0]])
    batch = make_batch(extras={"dps_weights": weights})
    _, new, old, ref = token_outputs()
    obj = objective("daca_grpo")
    out = obj(batch, new, old, ref, counts=counts_of(batch))
    assert out.loss.item() == pytest.approx((-4.1 + 6.5 - 1.5 + 0.75 + 0.04 * 0.5) / 9, abs=1e-6)
    assert obj.needs_trajectory and obj.default_estimator == "stratified"
    # without weights in the batch it is plain GRPO; and any token objective can switch the option on
    plain = obj(make_batch(), new, old, ref, counts=counts_of(batch))
    assert plain.loss.item() == pytest.approx((-0.6 + 0.04 * 0.5) / 9, abs=1e-6)
    weighted_grpo = objective("grpo", token_weights=True)
    assert weighted_grpo.needs_trajectory
    assert weighted_grpo(batch, new, old, ref, counts=counts_of(batch)).loss.item() == pytest.approx(out.loss.item())


# --------------------------------------------------------------------------------------------
# Sequence-level objectives
# --------------------------------------------------------------------------------------------

ELBO = [-2.0, -4.0, -1.0, -3.0]
EUBO = [-1.5, -3.0, -0.5, -2.0]


def test_wd1_hand_computed():
    # ℓ = Σ token log-probs over the completion: row 0 -6, row 1 -2 (the -100 is outside the mask), row 2 -3, row 3 -0.5
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -100.0], [-1.0, -1.0, -1.0], [-0.5, -7.0, -7.0]],
                      requires_grad=True)
    batch = make_batch()
    out = objective("wd1")(batch, EstimatorOutput(lp, None, torch.tensor(COMPLETION, dtype=torch.bool)), None, None,
                           counts=counts_of(batch))
    # group 0 (A = ±1): Σ (w⁻ - w⁺)ℓ = (σ(-2)-σ(2))(-6) + (σ(2)-σ(-2))(-2) = tanh(1)·(6 - 2)
    # group 1 (A = ±.5): tanh(0.5)·(3 - 0.5); averaged over the 2 groups
    expected = (4 * math.tanh(1.0) + 2.5 * math.tanh(0.5)) / 2
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("variant, ell", [
    ("mix", [-2.0, -3.5, -1.0, -2.5]),  # A>0: ELBO ; A<=0: ½EUBO + ½ELBO
    ("elbo", ELBO),
    ("eubo", [-2.0, -3.0, -1.0, -2.0]),
])
def test_spg_hand_computed(variant, ell):
    batch = make_batch()
    out = objective("spg", variant=variant)(batch, est(seq_logp=ELBO, elbo=ELBO, eubo=EUBO), None, None,
                                             counts=counts_of(batch))
    lengths = [3, 2, 3, 1]
    expected = sum(-a * e * n for a, e, n in zip(ADV, ell, lengths)) / 9
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)


def test_spg_mix_needs_eubo():
    batch = make_batch()
    with pytest.raises(ValueError, match="eubo"):
        objective("spg")(batch, est(seq_logp=ELBO), None, None, counts=counts_of(batch))
    with pytest.raises(ValueError, match="variant"):
        objective("spg", variant="upper")


def stable_drl_inputs(ratios):
    elbo = torch.tensor(ELBO, requires_grad=True)
    new = EstimatorOutput(None, elbo, torch.tensor(COMPLETION, dtype=torch.bool),
                          {"elbo": elbo, "eubo": torch.tensor(EUBO)})
    old = EstimatorOutput(None, elbo.detach() - torch.log(torch.tensor(ratios)), new.mask,
                          {"elbo": elbo.detach() - torch.log(torch.tensor(ratios))})
    return elbo, new, old


def test_stable_drl_hand_computed():
    # ρ = [2, 100, 1, 0.5], C = 5 -> min(ρ, C) = [2, 5, 1, .5]; w = [2/7, 5/7 | 2/3, 1/3]
    # ℓ^SPG (mix) = [-2, -3.5, -1, -2.5];  L = mean over 2 groups of -Σ w A ℓ
    batch = make_batch()
    elbo, new, old = stable_drl_inputs([2.0, 100.0, 1.0, 0.5])
    out = objective("stable_drl")(batch, new, old, None, counts=counts_of(batch))
    group0 = -(2 / 7) * 1 * -2 - (5 / 7) * -1 * -3.5
    group1 = -(2 / 3) * 0.5 * -1 - (1 / 3) * -0.5 * -2.5
    assert out.loss.item() == pytest.approx((group0 + group1) / 2, abs=1e-6)
    assert out.stats["weight_max"].item() == pytest.approx(5 / 7)
    assert out.stats["clip_frac"].item() == pytest.approx(0.25)
    assert out.stats["ratio_max"].item() == pytest.approx(100.0, rel=1e-5)


def test_stable_drl_weights_sum_to_one_and_are_bounded():
    g = torch.Generator().manual_seed(0)
    log_ratios = torch.randn(4, generator=g) * 4  # some far above log C
    ratios = log_ratios.exp()
    batch = make_batch()
    elbo, new, old = stable_drl_inputs(ratios.tolist())
    objective("stable_drl", variant="elbo")(batch, new, old, None, counts=counts_of(batch)).loss.backward()
    # dL/dℓ_i = -w_i A_i / n_groups  ->  recover the weights from the gradient
    weights = -elbo.grad * 2 / torch.tensor(ADV)
    capped = ratios.clamp(max=5.0)
    for rows in ([0, 1], [2, 3]):
        assert weights[rows].sum().item() == pytest.approx(1.0, abs=1e-5)
        assert weights[rows].max().item() <= 5.0 / capped[rows].sum().item() + 1e-6
        torch.testing.assert_close(weights[rows], capped[rows] / capped[rows].sum())


def test_conditional_vs_unconditional_clipping():
    """A negative-advantage outlier with ρ = 100: GRPO's gradient scales with ρ, StableDRL's does not."""

    def grpo_grad(rho):
        batch = make_batch(completion=[[1, 0, 0]] * 4)
        lp = torch.zeros(4, 3, requires_grad=True)
        ratios = torch.ones(4, 3)
        ratios[1, 0] = rho  # row 1 has A = -1
        new = EstimatorOutput(lp, None, batch.completion_mask)
        old = EstimatorOutput(lp.detach() - ratios.log(), None, batch.completion_mask)
        objective("grpo", beta=0.0)(batch, new, old, None, counts=counts_of(batch)).loss.backward()
        return lp.grad[1, 0].item()

    def stable_grad(rho):
        batch = make_batch()
        elbo, new, old = stable_drl_inputs([1.0, rho, 1.0, 1.0])
        objective("stable_drl", variant="elbo")(batch, new, old, None, counts=counts_of(batch)).loss.backward()
        return elbo.grad[1].item()

    assert grpo_grad(100.0) == pytest.approx(100.0 / 4, rel=1e-5)  # -A·ρ/#tokens, unclipped
    assert grpo_grad(200.0) == pytest.approx(2 * grpo_grad(100.0), rel=1e-5)
    assert stable_grad(100.0) == pytest.approx(stable_grad(200.0))
    assert abs(stable_grad(100.0)) <= 5.0 / (5.0 + 1.0) / 2 + 1e-6  # w ≤ C/Σ min(ρ, C), / 2 groups


def espo_like(ratios, length, ref_delta=(0.0, 1.0, 2.0, 0.0)):
    elbo = torch.tensor(ELBO, requires_grad=True)
    log_r = torch.log(torch.tensor(ratios)) * length
    new = est(seq_logp=elbo.detach(), elbo=ELBO)
    new.extras["elbo"] = elbo
    old = est(elbo=(elbo.detach() - log_r).tolist())
    ref = est(elbo=(elbo.detach() - torch.tensor(ref_delta)).tolist())
    return elbo, new, old, ref


def test_espo_hand_computed():
    # ρ = exp(ΔELBO / L), L = 3 padded positions; ε = 0.2:
    # row 0 (A=1) ρ 1.1 -> -1.1 ; row 1 (A=-1) ρ 1.5 -> +1.5 (unclipped)
    # row 2 (A=.5) ρ .7 -> -.35 ; row 3 (A=-.5) ρ 1 -> +.5
    # KL: ½(ELBO_θ-ELBO_ref)²/L with differences [0, 1, 2, 0] -> 5/6, sequence mean, β = 0.01
    batch = make_batch()
    _, new, old, ref = espo_like([1.1, 1.5, 0.7, 1.0], 3)
    out = objective("espo")(batch, new, old, ref, counts=counts_of(batch))
    assert out.loss.item() == pytest.approx(0.55 / 4 + 0.01 * (5 / 6) / 4, abs=1e-6)
    assert out.stats["clip_frac"].item() == 0.0


def test_fpo_and_dipod_hand_computed():
    # ρ = exp(ΔELBO), not length-normalised; ε = 0.5:
    # row 0 ρ 1.2 -> -1.2 ; row 1 (A=-1) ρ 2 -> +2 ; row 2 (A=.5) ρ .4 -> -.2 ; row 3 ρ 1 -> +.5   => 1.1/4
    # k1 KL: mean(ELBO_θ - ELBO_ref) = 3/4, β = 0.04 ; DiPOD adds 0.05·mean(-ELBO) = 0.05·2.5
    batch = make_batch()
    _, new, old, ref = espo_like([1.2, 2.0, 0.4, 1.0], 1)
    fpo = objective("fpo")(batch, new, old, ref, counts=counts_of(batch))
    assert fpo.loss.item() == pytest.approx(1.1 / 4 + 0.04 * 0.75, abs=1e-6)
    dipod = objective("dipod")(batch, new, old, ref, counts=counts_of(batch))
    assert dipod.loss.item() == pytest.approx(1.1 / 4 + 0.04 * 0.75 + 0.05 * 2.5, abs=1e-6)
    # method.elbo_reg adds the same term to any objective, as a loss term of the Method (one implementation)
    from ddrl.training.loss_terms import ElboTerm
    from ddrl.training.method import AdvantageSpec, Method

    adv = AdvantageSpec("mean", "sample", 1e-4, None, "drop")
    fpo_reg = Method(objective("fpo"), None, adv, terms=(ElboTerm(0.05),)).loss(batch, new, old, ref, counts_of(batch))
    assert fpo_reg.loss.item() == pytest.approx(dipod.loss.item())
    assert fpo_reg.stats["elbo_reg"].item() == pytest.approx(2.5)
    spg_reg = Method(objective("spg"), None, adv, terms=(ElboTerm(0.1),))
    spg_out = spg_reg.loss(batch, est(elbo=ELBO, eubo=EUBO), None, None, counts_of(batch))
    plain = objective("spg")(batch, est(elbo=ELBO, eubo=EUBO), None, None, counts=counts_of(batch))
    assert spg_out.loss.item() == pytest.approx(plain.loss.item() + 0.1 * 2.5, abs=1e-6)
    assert not spg_reg.skip_safe  # the regulariser acts on every row


def test_gdsd_hand_computed():
    # D_θ - D_old = [0.3, -1.0, 0, 0.6] clamped to [log .5, log 1.5]; L = 3; ψ = 2:
    # (Δ/3 - ψA)² = (0.1 - 2)², (log(.5)/3 + 2)², (0 - 1)², (log(1.5)/3 + 1)² ; KL k2 / L as in ESPO, β = 1e-3
    raw = torch.tensor([0.3, -1.0, 0.0, 0.6])
    denoise = torch.tensor(ELBO, requires_grad=True)
    new = EstimatorOutput(None, denoise, torch.tensor(COMPLETION, dtype=torch.bool), {})
    old = est(seq_logp=(denoise.detach() - raw).tolist())
    ref = est(seq_logp=(denoise.detach() - torch.tensor([0.0, 1.0, 2.0, 0.0])).tolist())
    batch = make_batch()
    out = objective("gdsd", psi=2.0, epsilon=0.5)(batch, new, old, ref, counts=counts_of(batch))
    regression = ((0.1 - 2) ** 2 + (math.log(0.5) / 3 + 2) ** 2 + 1.0 + (math.log(1.5) / 3 + 1) ** 2) / 4
    assert out.loss.item() == pytest.approx(regression + 1e-3 * (5 / 6) / 4, abs=1e-6)
    out.loss.backward()
    # rows 1 and 3 sit outside the trust region: only the KL gradient is left there
    assert denoise.grad[1].item() == pytest.approx(1e-3 * (1.0 / 3) / 4, abs=1e-7)
    assert denoise.grad[3].item() == pytest.approx(0.0, abs=1e-7)
    assert denoise.grad[0].item() == pytest.approx(2 * (0.1 - 2) / 3 / 4, abs=1e-6)
    gdsd, tlc = objective("gdsd"), objective("gdsd_tlc")
    assert (gdsd.epsilon, gdsd.psi, gdsd.beta) == (4e-4, 1.0, 1e-3)
    assert gdsd.default_estimator_args == {"weighted": False} and tlc.default_estimator_args == {"weighted": True}
    assert objective("gdsd", epsilon="4e-4").epsilon == 4e-4  # YAML 1.1 strings are accepted


def test_udm_grpo_hand_computed():
    # lp = per-image mean log-probs at 2 timesteps; ρ ≡ 1 so the PG value is -mean_b A_b = 0 here;
    # KL k3(ref, θ) over timesteps: (1 - ln2) + (ln2 - .5) = .5, / 4 rows, / 2 timesteps (the released
    # code averages them: one accumulation micro-batch each), β = .05
    lp = torch.tensor([[-1.0, -2.0], [-1.5, -1.0], [-2.0, -2.0], [-1.0, -3.0]], requires_grad=True)
    delta = torch.tensor([[0.0, LN2], [0.0, 0.0], [-LN2, 0.0], [0.0, 0.0]])
    new = EstimatorOutput(None, lp.mean(1), torch.ones(4, 3, dtype=torch.bool), {"per_timestep": lp})
    ref = est(per_timestep=(lp.detach() + delta).tolist())
    batch = make_batch()
    obj = objective("udm_grpo")
    out = obj(batch, new, None, ref, counts=counts_of(batch))
    assert out.loss.item() == pytest.approx(0.05 * 0.5 / 4 / 2, abs=1e-7)
    out.loss.backward()
    # d/dlp: (-A/4 + β·(1 - e^Δ)/4) / 2
    assert lp.grad[0, 1].item() == pytest.approx((-1 / 4 + 0.05 * (1 - 2) / 4) / 2, abs=1e-6)
    assert lp.grad[1, 0].item() == pytest.approx(1 / 4 / 2, abs=1e-6)
    assert lp.grad[2, 0].item() == pytest.approx((-0.5 / 4 + 0.05 * (1 - 0.5) / 4) / 2, abs=1e-6)
    assert obj.on_policy and not obj.needs_old and obj.needs_ref and obj.default_advantage_clip == 5.0


def test_sepo_hand_computed_per_sample_clip():
    # probed positions (estimator mask) and per-position log-ratios equal within a row -> ρ = [1.5, 1.5, .7, 1]
    # ε = 0.2: row 0 (A=1) ρ 1.5 -> -1.2 CLIPPED ; row 1 (A=-1) -> +1.5 ; row 2 (A=.5) -> -.35 ; row 3 -> +.5
    probes = torch.tensor([[1, 0, 1], [1, 1, 0], [0, 1, 1], [1, 0, 0]], dtype=torch.bool)
    per_row = torch.log(torch.tensor([1.5, 1.5, 0.7, 1.0]))[:, None].expand(4, 3)
    surrogate = torch.tensor([[0.2, 9.0, 0.4], [0.1, 0.3, 9.0], [9.0, 0.5, 0.5], [0.7, 9.0, 9.0]], requires_grad=True)
    lp = torch.full((4, 3), -1.0)
    new = EstimatorOutput(lp, None, probes, {"score_surrogate": surrogate})
    old = EstimatorOutput(lp - per_row, None, probes)
    batch = make_batch()
    out = objective("sepo")(batch, new, old, None, counts=counts_of(batch))
    assert out.loss.item() == pytest.approx((-1.2 + 1.5 - 0.35 + 0.5) / 4, abs=1e-6)
    out.loss.backward()
    # gradient -A·ρ/(K_b·B) on each probed S; zero for the clipped sample only (per-sample clip)
    expected = torch.tensor([[0.0, 0.0, 0.0], [1.5 / 8, 1.5 / 8, 0.0],
                             [0.0, -0.35 / 8, -0.35 / 8], [0.5 / 4, 0.0, 0.0]])
    torch.testing.assert_close(surrogate.grad, expected)


# --------------------------------------------------------------------------------------------
# Advantages, KL, aggregation
# --------------------------------------------------------------------------------------------

NAN = float("nan")
REWARDS = torch.tensor([1.0, 2.0, 3.0, NAN, 5.0, 5.0, 0.0, 4.0, 7.0, NAN])
GROUP_IDS = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 3, 3])


def test_advantages_mean_loo():
    mean = compute_advantages(REWARDS, GROUP_IDS, "mean")
    torch.testing.assert_close(mean, torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0, -2.0, 2.0, 0.0, 0.0]))
    loo = compute_advantages(REWARDS, GROUP_IDS, "loo")  # r - mean of the other valid members
    torch.testing.assert_close(loo, torch.tensor([-1.5, 0.0, 1.5, 0.0, 0.0, 0.0, -4.0, 4.0, 0.0, 0.0]))


def test_advantages_zscore_std_and_clip():
    eps = 1e-4
    sample = compute_advantages(REWARDS, GROUP_IDS, "zscore", eps=eps)
    s8 = math.sqrt(8.0)  # sample std of {0, 4}; group 0 {1,2,3} has sample std 1
    expected = [-1 / (1 + eps), 0, 1 / (1 + eps), 0, 0, 0, -2 / (s8 + eps), 2 / (s8 + eps), 0, 0]
    torch.testing.assert_close(sample, torch.tensor(expected))
    pop = compute_advantages(REWARDS, GROUP_IDS, "zscore", eps=eps, std="population")
    p3 = math.sqrt(2 / 3)
    expected = [-1 / (p3 + eps), 0, 1 / (p3 + eps), 0, 0, 0, -2 / (2 + eps), 2 / (2 + eps), 0, 0]
    torch.testing.assert_close(pop, torch.tensor(expected))
    clipped = compute_advantages(REWARDS, GROUP_IDS, "zscore", clip=0.5)
    assert clipped.abs().max().item() == pytest.approx(0.5)
    assert clipped[1].item() == 0.0 and clipped[6].item() == -0.5
    with pytest.raises(ValueError, match="valid"):
        compute_advantages(REWARDS, GROUP_IDS, "rank")


def test_advantages_constant_group_is_exactly_zero():
    r = torch.tensor([0.1, 0.1, 0.1, 0.3, 0.3, 0.3])
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    for kind in ("mean", "zscore", "loo"):
        assert torch.equal(compute_advantages(r, g, kind), torch.zeros(6))


def test_kl_estimators():
    logp, ref = torch.tensor(math.log(0.5)), torch.tensor(math.log(0.25))  # Δ = ref - logp = -ln 2
    assert kl(logp, ref, "k1").item() == pytest.approx(LN2)
    assert kl(logp, ref, "k2").item() == pytest.approx(0.5 * LN2 ** 2)
    assert kl(logp, ref, "k3").item() == pytest.approx(0.5 + LN2 - 1)
    assert kl(ref, logp, "k3").item() == pytest.approx(2 - LN2 - 1)
    assert kl(logp, logp, "k3").item() == 0.0
    with pytest.raises(ValueError, match="k3"):
        kl(logp, ref, "k4")


def test_aggregations_hand_computed():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    counts = AggregationCounts(tokens=10.0, sequences=4.0, groups=2.0)
    assert token_mean(values, mask, counts).item() == pytest.approx(15 / 10)
    assert sequence_token_mean(values, mask, counts).item() == pytest.approx((2 + 4.5) / 4)
    assert sequence_token_sum(values, mask, counts).item() == pytest.approx(15 / 4)
    seq = torch.tensor([1.0, 3.0])
    assert sequence_mean(seq, counts).item() == pytest.approx(1.0)
    assert length_weighted_mean(seq, torch.tensor([3, 2]), counts).item() == pytest.approx(9 / 10)
    assert group_mean(seq, counts).item() == pytest.approx(2.0)
    assert token_mean(torch.full((2, 3), float("inf")), torch.zeros(2, 3, dtype=torch.bool), counts).item() == 0.0


def test_group_softmax():
    logits = torch.tensor([0.0, LN2, 1.0, 1.0, 50.0])
    groups = torch.tensor([3, 3, 8, 8, 8])
    valid = torch.tensor([True, True, True, True, False])
    w = group_softmax(logits, groups, valid)
    torch.testing.assert_close(w, torch.tensor([1 / 3, 2 / 3, 0.5, 0.5, 0.0]))


def test_counts_add_over_processes():
    rewards = [1.0, NAN, 0.0, 1.0]
    full = make_batch(rewards=rewards)
    a, b = full.index(slice(0, 2)), full.index(slice(2, 4))
    total = AggregationCounts.from_batch(a, world_size=2) + AggregationCounts.from_batch(b, world_size=2)
    assert (total.tokens, total.sequences, total.groups, total.world_size) == (3 + 3 + 1, 3, 2, 2)
    assert total == AggregationCounts.from_batch(full, world_size=2, micro_batches=2)  # one micro-batch per process


def test_ratio_noise_hook():
    x = torch.zeros(3, 4)
    assert inject_ratio_noise(x, 0.0, 5) is x
    a, b = inject_ratio_noise(x, 2.0, 5), inject_ratio_noise(x, 2.0, 5)
    assert torch.equal(a, b) and a.std().item() > 0.5
    assert not torch.equal(a, inject_ratio_noise(x, 2.0, 6))
    # the stress mode changes ESPO's, GRPO's and StableDRL's losses, deterministically from mask_seeds[0]
    batch = make_batch()
    _, new, old, ref = espo_like([1.1, 1.5, 0.7, 1.0], 3)
    clean = objective("espo")(batch, new, old, ref, counts=counts_of(batch)).loss
    noisy = objective("espo", ratio_noise_std=3.0)(batch, new, old, ref, counts=counts_of(batch)).loss
    assert noisy.item() != pytest.approx(clean.item())
    _, tnew, told, tref = token_outputs()
    g1 = objective("grpo", ratio_noise_std=3.0)(batch, tnew, told, tref, counts=counts_of(batch)).stats["ratio_max"]
    assert g1.item() > 3.0
    _, snew, sold = stable_drl_inputs([1.0, 1.0, 1.0, 1.0])
    s = objective("stable_drl", ratio_noise_std=3.0)(batch, snew, sold, None, counts=counts_of(batch))
    assert s.stats["ratio_max"].item() != pytest.approx(1.0)


# --------------------------------------------------------------------------------------------
# Invariance: a step split into micro-batches / processes gives the full batch's gradient
# --------------------------------------------------------------------------------------------

ALL_OBJECTIVES = ["grpo", "unigrpo", "coupled_grpo", "tracerl", "maskgrpo", "daca_grpo", "wd1", "spg",
                  "stable_drl", "espo", "fpo", "dipod", "gdsd", "gdsd_tlc", "udm_grpo", "sepo"]
SPLIT_ARGS = {"gdsd": {"epsilon": 0.5}, "gdsd_tlc": {"epsilon": 0.5}}


def random_step(seed=0, groups=4, group_size=3, length=5):
    g = torch.Generator().manual_seed(seed)
    b = groups * group_size
    completion = torch.rand(b, length, generator=g) < 0.8
    completion[:, 0] = True
    rewards = torch.randint(0, 3, (b,), generator=g).float()
    rewards[4] = NAN  # an invalid row: it must carry no loss
    group_ids = torch.arange(groups).repeat_interleave(group_size)
    adv = compute_advantages(rewards, group_ids, "zscore")
    batch = RolloutBatch(
        prompt_ids=torch.zeros(b, 2, dtype=torch.long), prompt_mask=torch.ones(b, 2, dtype=torch.bool),
        completion_ids=torch.zeros(b, length, dtype=torch.long), completion_mask=completion, group_ids=group_ids,
        rewards=rewards, advantages=adv, mask_seeds=torch.tensor([3]),
        extras={"dps_weights": torch.rand(b, length, generator=g) * 2})
    theta = torch.randn(b, length, generator=g).mul(0.3).sub(1.0).requires_grad_(True)  # token log-prob parameters
    scored = completion & (torch.rand(b, length, generator=g) < 0.7)

    def outputs(tok):  # an estimator output with every field some objective reads
        seq = tok.sum(1)
        return EstimatorOutput(torch.where(scored, tok, 0.0), seq, scored,
                               {"elbo": seq, "eubo": seq * 0.9 + 0.2, "per_timestep": tok[:, :2],
                                "score_surrogate": tok * 1.3})

    noise = lambda: torch.randn(b, length, generator=g) * 0.05  # noqa: E731
    old = outputs(theta.detach() + noise()).detach()
    ref = outputs(theta.detach() + noise()).detach()
    return batch, theta, outputs, old, ref


def take(out: EstimatorOutput, rows) -> EstimatorOutput:
    pick = lambda t: None if t is None else t[rows]  # noqa: E731
    return EstimatorOutput(pick(out.token_logp), pick(out.seq_logp), out.mask[rows],
                           {k: v[rows] for k, v in out.extras.items()})


@pytest.mark.parametrize("name", ALL_OBJECTIVES)
def test_split_invariance(name):
    batch, theta, outputs, old, ref = random_step()
    obj = objective(name, **SPLIT_ARGS.get(name, {}))
    counts = AggregationCounts.from_batch(batch)
    full = obj(batch, outputs(theta), old, ref, counts=counts)
    (full_grad,) = torch.autograd.grad(full.loss, theta)
    assert full_grad.abs().sum() > 0  # the test has teeth

    # two micro-batches (or processes) holding whole groups, same global counts
    halves = [torch.arange(0, 6), torch.arange(6, 12)]
    total = 0.0
    split_grad = torch.zeros_like(theta)
    for rows in halves:
        part = obj(batch.index(rows), take(outputs(theta), rows), take(old, rows), take(ref, rows), counts=counts)
        (g,) = torch.autograd.grad(part.loss, theta)
        split_grad += g
        total += part.loss.item()
    assert total == pytest.approx(full.loss.item(), abs=1e-5)
    torch.testing.assert_close(split_grad, full_grad, atol=1e-6, rtol=1e-5)
    # the invalid row (NaN reward) gets no gradient
    assert full_grad[4].abs().sum().item() == 0.0


# --------------------------------------------------------------------------------------------
# Declarations
# --------------------------------------------------------------------------------------------


def test_needs_flags():
    assert objective("grpo").needs_ref and not objective("grpo", beta=0.0).needs_ref
    assert objective("grpo").needs_old and not objective("grpo").on_policy
    assert not objective("tracerl").needs_ref  # its KL is against the behaviour policy
    assert objective("espo").needs_ref and not objective("espo", beta=0).needs_ref
    assert objective("fpo").needs_ref and not objective("fpo", beta=0).needs_ref
    assert objective("gdsd").needs_ref and not objective("gdsd", beta=0).needs_ref
    assert objective("udm_grpo").needs_ref and not objective("udm_grpo", beta=0).needs_ref
    for name in ("wd1", "spg", "stable_drl", "sepo"):
        assert not objective(name).needs_ref
    assert not objective("wd1").needs_old and not objective("spg").needs_old
    assert objective("stable_drl").needs_old and objective("sepo").needs_old
    assert [n for n in OBJECTIVES.names() if OBJECTIVES.get(n).fresh_masks] == ["stable_drl"]
    assert [n for n in OBJECTIVES.names() if OBJECTIVES.get(n).on_policy] == ["udm_grpo"]
    trajectory = [n for n in OBJECTIVES.names() if objective(n).needs_trajectory]
    assert trajectory == ["daca_grpo", "tracerl"]


def test_registry_and_describe_methods():
    assert set(ALL_OBJECTIVES) | {"diffu_grpo"} == set(OBJECTIVES.names())
    rows = {r["name"]: r for r in describe_methods()}
    assert rows["stable_drl"]["estimator"] == "spg" and rows["stable_drl"]["advantage"] == "mean"
    assert rows["udm_grpo"]["advantage_clip"] == 5.0
    assert rows["grpo"]["fields"]["epsilon"] == 0.5 and rows["grpo"]["fields"]["beta"] == 0.04
    for row in rows.values():
        assert row["paper"] and row["formula"] and row["advantage"] in ("mean", "zscore", "loo")
    with pytest.raises(RegistryError, match="stable_drl"):
        OBJECTIVES.get("stable-drl")
    with pytest.raises(ValueError, match="aggregation"):
        objective("grpo", aggregation="mean")


def test_which_objectives_are_advantage_weighted():
    """Only these have a loss term that does not scale with A, so the trainer never skips their groups."""
    assert [n for n in ALL_OBJECTIVES if not OBJECTIVES.get(n).advantage_weighted] == ["wd1", "dipod", "gdsd", "gdsd_tlc"]


@pytest.mark.parametrize("name", [n for n in ALL_OBJECTIVES if OBJECTIVES.get(n).advantage_weighted])
def test_advantage_weighted_objectives_give_no_gradient_to_zero_advantage_groups(name):
    """The trainer skips all-zero-advantage groups for objectives that declare `advantage_weighted`:
    with beta = 0 those rows must carry no gradient at all, whatever the ratios and estimates."""
    obj = objective(name, **({"beta": 0.0} if hasattr(OBJECTIVES.get(name), "beta") else {}))
    batch, theta, outputs, old, ref = random_step(seed=5)
    batch.advantages[:3] = 0.0  # group 0: all right or all wrong
    out = obj(batch, outputs(theta), old, ref, counts=counts_of(batch))
    out.loss.backward()
    assert theta.grad[:3].abs().max().item() == 0.0
    assert theta.grad[3:].abs().max().item() > 0.0
