"""Forward processes: exact-enumeration checks of the NELBOs, noise statistics, bad input.

The "model" in these tests is a fixed table of random logits indexed by the whole noisy state x_t,
so on a tiny vocabulary the expected NELBO can be computed exactly: enumerate every x_t with its
probability q(x_t | x_0), integrate over t by Gauss-Legendre quadrature, and compare with the
Monte-Carlo mean of `nelbo` over many (batched) draws of the process's own noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product

import numpy as np
import pytest
import torch

from ddrl.processes import BlockMaskedProcess, MaskedProcess, UniformProcess, get_schedule
from ddrl.registry import PROCESSES

EPS = 1e-3
N_MC = 200_000


@dataclass
class Output:
    logits: torch.Tensor


class TableModel:
    """Logits [B, T, V] = table[x_t]: a fixed random function of the whole input state."""

    def __init__(self, vocab_size: int, length: int, seed: int, scale: float = 1.5):
        g = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.table = torch.randn(vocab_size**length, length, vocab_size, generator=g, dtype=torch.float64) * scale
        self.powers = vocab_size ** torch.arange(length)

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Output:
        return Output(self.table[(input_ids * self.powers).sum(-1)])


def gauss_legendre(a: float, b: float, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Nodes and weights on [a, b], float64, after t = a + (b - a) u^2 (smooths a log singularity at a)."""
    u, w = np.polynomial.legendre.leggauss(n)
    u, w = (u + 1) / 2, w / 2  # on [0, 1]
    t = a + (b - a) * u**2
    return torch.tensor(t), torch.tensor(w * (b - a) * 2 * u)


def mc_mean(values: torch.Tensor) -> tuple[float, float]:
    return values.mean().item(), values.std().item() / math.sqrt(values.numel())


def assert_matches_exact(values: torch.Tensor, exact: float) -> None:
    mean, se = mc_mean(values)
    assert se < 0.02 * abs(exact), f"test not sensitive enough: se={se:.4g}, exact={exact:.4g}"
    assert abs(mean - exact) < 4 * se, f"MC mean {mean:.5f} vs exact {exact:.5f} (se {se:.5f})"


# --------------------------------------------------------------------------------------------
# Schedules
# --------------------------------------------------------------------------------------------


def test_schedules_values_and_derivatives():
    t = torch.tensor([0.0, 0.25, 0.5, 1.0], dtype=torch.float64)
    lin, cos = get_schedule("linear"), get_schedule("cosine")
    assert torch.allclose(lin.alpha(t), 1 - t)
    assert torch.allclose(cos.alpha(t), torch.cos(math.pi * t / 2))
    h = 1e-6
    tt = torch.tensor([0.1, 0.4, 0.9], dtype=torch.float64)
    for sch in (lin, cos):
        fd = (sch.alpha(tt + h) - sch.alpha(tt - h)) / (2 * h)
        assert torch.allclose(sch.alpha_prime(tt), fd, atol=1e-8)


def test_unknown_schedule_lists_choices():
    with pytest.raises(ValueError, match="linear, cosine"):
        get_schedule("cosin")


def test_registry_names():
    assert PROCESSES.get("masked") is MaskedProcess
    assert PROCESSES.get("uniform") is UniformProcess
    assert PROCESSES.get("block") is BlockMaskedProcess


# --------------------------------------------------------------------------------------------
# Masked process
# --------------------------------------------------------------------------------------------


def test_sample_t_range_and_stratification():
    p = MaskedProcess(4)
    t = p.sample_t(1000, generator=torch.Generator().manual_seed(0))
    assert t.shape == (1000,) and t.min() >= EPS and t.max() < 1
    ts = p.sample_t(8, generator=torch.Generator().manual_seed(1), eps=0.0, stratified=True)
    assert sorted((ts * 8).floor().long().tolist()) == list(range(8))  # one draw per stratum


def test_masked_noise_rate_and_eligibility():
    p = MaskedProcess(mask_token_id=9)
    g = torch.Generator().manual_seed(0)
    x0 = torch.arange(8).repeat(20_000, 1)  # [B, 8]
    eligible = torch.zeros_like(x0, dtype=torch.bool)
    eligible[:, 3:] = True
    t = torch.full((x0.shape[0],), 0.3)
    xt, noised = p.noise(x0, t, generator=g, eligible=eligible)
    assert torch.equal(xt[:, :3], x0[:, :3]) and not noised[:, :3].any()
    assert torch.equal(noised, xt == 9)
    assert torch.equal(xt[~noised], x0[~noised])
    rate = noised[:, 3:].double().mean().item()
    assert abs(rate - 0.3) < 4 * math.sqrt(0.3 * 0.7 / noised[:, 3:].numel())


def test_masked_nelbo_hand_computed():
    p = MaskedProcess(mask_token_id=3)
    logits = torch.tensor([[[2.0, 0.0, -1.0, -1e9], [0.5, 0.5, 0.0, -1e9]]])  # [1, 2, 4]
    x0 = torch.tensor([[0, 2]])
    noised = torch.tensor([[False, True]])
    t = torch.tensor([0.5])
    ce = -torch.log_softmax(logits[0, 1], -1)[2]
    assert torch.allclose(p.nelbo(logits, x0, noised, t), 2.0 * ce[None])  # weight 1/t = 2
    cos = MaskedProcess(mask_token_id=3, schedule="cosine")
    w = (math.pi / 2) * math.sin(math.pi / 4) / (1 - math.cos(math.pi / 4))
    assert torch.allclose(cos.nelbo(logits, x0, noised, t), w * ce[None])


def _masked_exact_nelbo(process: MaskedProcess, model: TableModel, prompt: list[int], x0: list[int],
                        block_size: int | None = None) -> float:
    """E_t E_{x_t} NELBO by enumeration of the masked subsets; t ~ U[EPS, 1] per block (or per sequence)."""
    L, P = len(x0), len(prompt)
    n_blocks = 1 if block_size is None else math.ceil(L / block_size)
    block_of = [0 if block_size is None else i // block_size for i in range(L)]
    t, w = gauss_legendre(EPS, 1.0, 48)
    grids = torch.meshgrid(*[t] * n_blocks, indexing="ij")  # tensor-product quadrature over the block times
    weights = torch.stack(torch.meshgrid(*[w] * n_blocks, indexing="ij")).prod(0)
    t_tok = torch.stack([grids[b] for b in block_of], -1)  # [G..., L]
    p_mask = 1 - process.schedule.alpha(t_tok)
    elbo_w = process.elbo_weight(t_tok)
    total = torch.zeros_like(weights)
    for subset in product([False, True], repeat=L):
        m = torch.tensor(subset)
        xt = torch.tensor(prompt + [process.mask_token_id if s else v for s, v in zip(subset, x0)])
        nll = -torch.log_softmax(model(xt[None]).logits[0, P:], -1)[torch.arange(L), torch.tensor(x0)]  # [L]
        prob = torch.where(m, p_mask, 1 - p_mask).prod(-1)
        total += prob * (elbo_w * torch.where(m, nll, 0.0)).sum(-1)
    return ((total * weights).sum() / (1 - EPS) ** n_blocks).item()


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_masked_nelbo_matches_exact_expectation(schedule):
    V, L, mask = 5, 3, 4
    model = TableModel(V, L, seed=0)
    p = MaskedProcess(mask, schedule)
    x0 = [2, 0, 3]
    exact = _masked_exact_nelbo(p, model, [], x0)
    g = torch.Generator().manual_seed(1)
    x0_b = torch.tensor(x0).repeat(N_MC, 1)
    t = p.sample_t(N_MC, generator=g)
    xt, noised = p.noise(x0_b, t, generator=g)
    values = p.nelbo(model(xt).logits, x0_b, noised, t)
    assert_matches_exact(values, exact)


def test_masked_pretrain_loss_matches_exact_expectation_with_prompt():
    # T = 2 prompt + 2 completion; eligible = completion; E[loss] = exact NELBO / L.
    V, mask = 4, 3
    model = TableModel(V, 4, seed=2)
    p = MaskedProcess(mask)
    prompt, x0 = [1, 2], [0, 2]
    exact = _masked_exact_nelbo(p, model, prompt, x0)
    full = torch.tensor(prompt + x0).repeat(N_MC, 1)
    eligible = torch.tensor([False, False, True, True]).repeat(N_MC, 1)
    loss, stats = p.pretrain_loss(model, full, eligible, None, generator=torch.Generator().manual_seed(3))
    # The loss is one number; its MC error is that of the per-row NELBO mean. Recompute rows via the same seed.
    g = torch.Generator().manual_seed(3)
    t = p.sample_t(N_MC, generator=g)
    xt, noised = p.noise(full, t, generator=g, eligible=eligible)
    rows = p.nelbo(model(xt).logits, full, noised, t)
    assert torch.allclose(loss, rows.sum() / (2 * N_MC))
    assert not noised[:, :2].any()
    assert_matches_exact(rows, exact)
    assert abs(stats["noised_frac"].item() - 0.5) < 0.01  # E[1 - alpha_t] = E[t] ~ 1/2


def test_block_nelbo_matches_exact_expectation():
    # Two blocks of 2 with independent times; the model sees the whole noisy sequence (process-level
    # check of per-block times and weights; the staircase context is tested in test_staircase.py).
    V, L, mask = 4, 4, 3
    model = TableModel(V, L, seed=4)
    p = BlockMaskedProcess(mask, block_size=2)
    x0 = [1, 0, 2, 2]
    exact = _masked_exact_nelbo(p, model, [], x0, block_size=2)
    g = torch.Generator().manual_seed(5)
    x0_b = torch.tensor(x0).repeat(N_MC, 1)
    t = p.sample_t(N_MC, generator=g, length=L)
    assert t.shape == (N_MC, 2)
    xt, noised = p.noise(x0_b, t, generator=g)
    values = p.nelbo(model(xt).logits, x0_b, noised, t)
    assert_matches_exact(values, exact)
    # Per-block times really are per block: tokens of one block share t, blocks differ.
    assert torch.equal(p.token_times(t, (N_MC, L))[:, 1], t[:, 0])
    assert torch.equal(p.token_times(t, (N_MC, L))[:, 2], t[:, 1])


# --------------------------------------------------------------------------------------------
# Uniform process
# --------------------------------------------------------------------------------------------

# Classes are the ids 2, 3, 4 of a 6-token vocabulary (0, 1: prompt tokens, 5: mask).
U_N, U_OFFSET, U_V, U_L = 3, 2, 6, 2


def test_uniform_noise_marginals():
    p = UniformProcess(U_N, offset=U_OFFSET)
    g = torch.Generator().manual_seed(0)
    n = 60_000
    x0 = torch.tensor([0, 3, 4]).repeat(n, 1)  # position 0 is a prompt token
    eligible = torch.tensor([False, True, True]).repeat(n, 1)
    xt, noised = p.noise(x0, torch.full((n,), 0.6), generator=g, eligible=eligible)
    assert torch.equal(noised, eligible) and torch.equal(xt[:, 0], x0[:, 0])
    alpha = 0.4
    for y in range(U_OFFSET, U_OFFSET + U_N):
        freq = (xt[:, 1] == y).double().mean().item()
        expected = alpha * (y == 3) + (1 - alpha) / U_N
        assert abs(freq - expected) < 4 * math.sqrt(expected * (1 - expected) / n)


def _duo_bracket_nelbo(N, a, da, x0_class, xt_class, x_theta):
    """UDLM's / Duo's published closed form, float64 (docs/diffusion.md#uniform-diffusion):
    (a'/(N a)) (N/xb_i - N/xbt_i - sum_{j!=i} ...)."""
    xb = N * a * torch.nn.functional.one_hot(torch.tensor(x0_class), N).double() + (1 - a)
    xbt = N * a * x_theta + (1 - a)
    i = xt_class
    s = sum((xb[j] / xb[i]) * torch.log(xbt[i] * xb[j] / (xbt[j] * xb[i])) for j in range(N) if j != i)
    return (da / (N * a)) * (N / xb[i] - N / xbt[i] - s)


def test_uniform_nelbo_equals_duo_formula_pointwise():
    N = 4
    p = UniformProcess(N, offset=1, schedule="cosine")
    g = torch.Generator().manual_seed(0)
    for t_val in (0.05, 0.5, 0.93):
        for x0_class, xt_class in ((0, 0), (2, 1)):
            logits = torch.randn(1, 1, 6, generator=g, dtype=torch.float64) * 2
            x_theta = torch.softmax(logits[0, 0, 1:1 + N], -1)
            t = torch.tensor([t_val], dtype=torch.float64)
            ours = p.nelbo(logits, torch.tensor([[x0_class + 1]]), torch.tensor([[True]]), t,
                           xt=torch.tensor([[xt_class + 1]]))
            a, da = p.schedule.alpha(t)[0], p.schedule.alpha_prime(t)[0]
            ref = _duo_bracket_nelbo(N, a, da, x0_class, xt_class, x_theta)
            assert ref > 0 and torch.allclose(ours[0], ref, rtol=1e-9)


def test_uniform_nelbo_zero_for_perfect_model_and_positive_otherwise():
    p = UniformProcess(U_N, offset=U_OFFSET)
    g = torch.Generator().manual_seed(0)
    B = 512
    x0 = U_OFFSET + torch.randint(U_N, (B, 5), generator=g)
    t = p.sample_t(B, generator=g)
    xt, noised = p.noise(x0, t, generator=g)
    perfect = torch.full((B, 5, U_V), float("-inf"))
    perfect.scatter_(-1, x0[..., None], 0.0)
    assert torch.equal(p.nelbo(perfect, x0, noised, t, xt=xt), torch.zeros(B))
    noisy = perfect.clamp(min=-3.0)  # mostly right, not one-hot
    values = p.nelbo(noisy, x0, noised, t, xt=xt)
    assert (values > 0).all() and torch.isfinite(values).all()


def _uniform_states() -> torch.Tensor:
    """Every x_t over U_L positions, as vocabulary ids: [N^L, L]."""
    return U_OFFSET + torch.tensor(list(product(range(U_N), repeat=U_L)))


def _uniform_exact_nelbo(process: UniformProcess, model: TableModel, x0: list[int], a: float, b: float) -> float:
    """(1/(b-a)) * int_a^b E_{x_t} NELBO dt, brute force from the CTMC reverse rates.

    Forward generator: jump to each other class at rate beta/N, beta = -alpha'/alpha. Reverse rate
    x -> y given x_0: R = (beta/N) q_t(y|x_0)/q_t(x|x_0); the model's uses q_t(.|x_theta).
    Integrand per token: sum_{y != x} R_theta - R + R log(R / R_theta).
    """
    N = process.num_classes
    states = _uniform_states()  # [S, L]
    x_theta = torch.softmax(model(states).logits[..., U_OFFSET:U_OFFSET + N], -1)  # [S, L, N]
    x0_oh = torch.nn.functional.one_hot(torch.tensor(x0) - U_OFFSET, N).double()  # [L, N]
    xt_oh = torch.nn.functional.one_hot(states - U_OFFSET, N).double()  # [S, L, N]
    t, w = gauss_legendre(a, b, 400)
    alpha = process.schedule.alpha(t)[:, None, None, None]  # [G, 1, 1, 1]
    beta = -process.schedule.alpha_prime(t)[:, None, None, None] / alpha
    q = alpha * x0_oh + (1 - alpha) / N  # [G, 1, L, N]
    q_theta = alpha * x_theta + (1 - alpha) / N  # [G, S, L, N]
    q_x = (q * xt_oh).sum(-1, keepdim=True)
    q_theta_x = (q_theta * xt_oh).sum(-1, keepdim=True)
    R, R_theta = beta / N * q / q_x, beta / N * q_theta / q_theta_x
    per_y = torch.where(xt_oh.bool(), 0.0, R_theta - R + R * torch.log(R / R_theta))
    integrand = per_y.sum((-1, -2))  # [G, S]
    state_prob = (q * xt_oh).sum(-1).prod(-1)  # [G, S]
    return ((state_prob * integrand).sum(-1) * w).sum().item() / (b - a)


def test_uniform_nelbo_matches_exact_expectation():
    p = UniformProcess(U_N, offset=U_OFFSET)
    model = TableModel(U_V, U_L, seed=7)
    x0 = [4, 2]
    exact = _uniform_exact_nelbo(p, model, x0, EPS, 1.0)
    g = torch.Generator().manual_seed(8)
    x0_b = torch.tensor(x0).repeat(N_MC, 1)
    t = p.sample_t(N_MC, generator=g)
    xt, noised = p.noise(x0_b, t, generator=g)
    assert_matches_exact(p.nelbo(model(xt).logits, x0_b, noised, t, xt=xt), exact)


def test_uniform_continuous_nelbo_is_limit_of_discrete_time_elbo():
    """The T-step ancestral ELBO (KL of Duo posteriors + reconstruction) tends to the closed form.

    An independent check of the continuous-time NELBO: it must be what the discrete bound that the
    sampler actually uses converges to as T grows.
    """
    p = UniformProcess(U_N, offset=U_OFFSET)
    model = TableModel(U_V, U_L, seed=7)
    x0 = [4, 2]
    N = U_N
    states = _uniform_states()
    x_theta = torch.softmax(model(states).logits[..., U_OFFSET:U_OFFSET + N], -1)  # [S, L, N]
    x0_oh = torch.nn.functional.one_hot(torch.tensor(x0) - U_OFFSET, N).double().expand_as(x_theta)
    xt_class = states - U_OFFSET

    def discrete_elbo(T: int) -> float:
        k = torch.arange(1, T + 1, dtype=torch.float64)
        t, s = (k / T)[:, None, None], ((k - 1) / T)[:, None, None]  # [T, 1, 1]
        alpha = p.schedule.alpha(t)
        state_prob = (alpha * (xt_class == torch.tensor(x0) - U_OFFSET) + (1 - alpha) / N).prod(-1)  # [T, S]
        true_post = p.posterior(x0_oh.expand(T, -1, -1, -1), xt_class.expand(T, -1, -1), t, s)
        model_post = p.posterior(x_theta.expand(T, -1, -1, -1), xt_class.expand(T, -1, -1), t, s)
        kl = torch.where(true_post > 0, true_post * (true_post.log() - model_post.log()), 0.0).sum((-1, -2))
        recon = -(model_post[0] * x0_oh[0]).sum(-1).log().sum(-1)  # step s = 0: -log p(x_0 | x_{1/T})
        per_step = torch.cat([recon[None], kl[1:]])  # [T, S]
        return (state_prob * per_step).sum().item()  # + KL(q(x_1)||uniform) = 0 (alpha_1 = 0)

    continuous = _uniform_exact_nelbo(p, model, x0, 0.0, 1.0)
    gaps = [discrete_elbo(T) - continuous for T in (250, 1000, 4000)]
    assert all(gap > 0 for gap in gaps)  # more steps, tighter bound; continuous time is the limit
    assert 3.5 < gaps[0] / gaps[1] < 4.5 and 3.5 < gaps[1] / gaps[2] < 4.5  # gap = O(1/T)
    # Richardson extrapolation of the 1/T gap to T = infinity lands on the closed form.
    assert abs(gaps[2] - (gaps[1] - gaps[2]) / 3) < 1e-6


class ConstantModel:
    """The same logits [V] at every position, whatever the input."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Output:
        return Output(self.logits.expand(*input_ids.shape, -1).clone())


def test_uniform_pretrain_losses():
    p = UniformProcess(U_N, offset=U_OFFSET)
    x0 = torch.tensor([[0, 1, 4, 2, 3], [1, 1, 3, 3, 2]])  # two prompt tokens (not classes), three class tokens
    eligible = torch.tensor([[False, False, True, True, True]] * 2)
    logits = torch.tensor([0.3, -1.0, 2.0, 0.5, -0.5, 4.0])  # classes 2..4 renormalised among themselves
    loss, stats = p.pretrain_loss(ConstantModel(logits), x0, eligible, None,
                                  generator=torch.Generator().manual_seed(0), loss="ce")
    log_x_theta = torch.log_softmax(logits[2:5], -1)
    expected = -log_x_theta[x0[eligible] - 2].mean()
    assert torch.allclose(loss, expected) and torch.allclose(stats["ce_per_token"], expected)

    # An oracle puts all mass on the true x_0, whatever it sees: the NELBO must be exactly 0. Its class
    # logits are all -inf on the prompt tokens, which must not leak NaN into the loss or the gradient.
    oracle_logits = torch.where(torch.nn.functional.one_hot(x0, U_V).bool(), 0.0, float("-inf")).requires_grad_()

    class Oracle:
        def __call__(self, input_ids, attention_mask=None):
            return Output(oracle_logits * 1.0)

    loss, _ = p.pretrain_loss(Oracle(), x0, eligible, None, generator=torch.Generator().manual_seed(0))
    assert loss.item() == 0.0
    loss.backward()
    assert not oracle_logits.grad.isnan().any()
    with pytest.raises(ValueError, match="elbo, ce"):
        p.pretrain_loss(Oracle(), x0, eligible, None, generator=torch.Generator(), loss="mse")


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


def test_mask_id_outside_vocabulary_is_a_clear_error():
    logits = torch.zeros(2, 3, 5)
    x0 = torch.zeros(2, 3, dtype=torch.long)
    noised = torch.ones(2, 3, dtype=torch.bool)
    t = torch.full((2,), 0.5)
    for p in (MaskedProcess(mask_token_id=7), BlockMaskedProcess(mask_token_id=7, block_size=2)):
        with pytest.raises(ValueError, match="mask_token_id=7 is outside"):
            p.nelbo(logits, x0, noised, t)
    with pytest.raises(ValueError, match="mask_token_id=7 is outside"):
        MaskedProcess(7).pretrain_loss(ConstantModel(torch.zeros(5)), x0, noised, None,
                                       generator=torch.Generator().manual_seed(0))


def test_uniform_classes_outside_vocabulary_is_a_clear_error():
    p = UniformProcess(4, offset=3)  # ids 3..6, but the model has 6 logits
    x0 = torch.full((1, 2), 4)
    with pytest.raises(ValueError, match="num_classes/offset"):
        p.nelbo(torch.zeros(1, 2, 6), x0, torch.ones(1, 2, dtype=torch.bool), torch.tensor([0.5]), xt=x0)
    with pytest.raises(ValueError, match="pass xt=xt"):
        p.nelbo(torch.zeros(1, 2, 8), x0, torch.ones(1, 2, dtype=torch.bool), torch.tensor([0.5]))
    with pytest.raises(ValueError, match="outside the process classes"):
        p.noise(torch.tensor([[1, 4]]), torch.tensor([0.5]), generator=torch.Generator())


@pytest.mark.parametrize("make, match", [
    (lambda: MaskedProcess(-1), "mask_token_id"),
    (lambda: MaskedProcess(3, schedule="exp"), "linear, cosine"),
    (lambda: UniformProcess(1), "num_classes"),
    (lambda: UniformProcess(4, offset=-2), "offset"),
    (lambda: BlockMaskedProcess(3, block_size=0), "block_size"),
])
def test_bad_constructor_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_call_arguments():
    p = MaskedProcess(3)
    x0 = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="generator must be a torch.Generator"):
        p.noise(x0, torch.full((2,), 0.5), generator=None)
    with pytest.raises(ValueError, match="t must have shape"):
        p.noise(x0, torch.full((3,), 0.5), generator=torch.Generator())
    with pytest.raises(ValueError, match="eps"):
        p.sample_t(4, generator=torch.Generator(), eps=1.0)
    with pytest.raises(ValueError, match="length="):
        BlockMaskedProcess(3, 2).sample_t(4, generator=torch.Generator())
    with pytest.raises(ValueError, match="0 <= s <= t <= 1"):
        UniformProcess(3).posterior(torch.full((2, 3), 1 / 3), torch.zeros(2, dtype=torch.long), 0.2, 0.5)


def test_gradients_stay_finite_at_the_time_edges():
    # t = 0 (masked: weight inf, nothing masked) and t = 1 (uniform linear: weight inf, divergence 0).
    x0 = torch.tensor([[0, 1, 2], [2, 1, 0]])
    logits = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0)).requires_grad_()
    masked = MaskedProcess(3)
    xt, noised = masked.noise(x0, torch.tensor([0.0, 0.6]), generator=torch.Generator().manual_seed(1))
    masked.nelbo(logits.masked_fill(torch.arange(4) == 1, float("-inf")), x0, noised,
                 torch.tensor([0.0, 0.6])).sum().backward()
    assert torch.isfinite(logits.grad).all()
    uniform = UniformProcess(4)
    logits.grad = None
    t = torch.tensor([1.0, 1e-4])
    xt, noised = uniform.noise(x0, t, generator=torch.Generator().manual_seed(2))
    value = uniform.nelbo(logits, x0, noised, t, xt=xt)
    value.sum().backward()
    assert torch.isfinite(value).all() and torch.isfinite(logits.grad).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_with_a_cpu_generator_give_the_cpu_numbers():
    x0 = torch.randint(0, 4, (64, 8), generator=torch.Generator().manual_seed(0))
    logits = torch.randn(64, 8, 6, generator=torch.Generator().manual_seed(1))
    for p in (MaskedProcess(5, "cosine"), UniformProcess(4), BlockMaskedProcess(5, block_size=3)):
        kw = {"length": 8} if isinstance(p, BlockMaskedProcess) else {}
        out = []
        for device in ("cpu", "cuda"):
            g = torch.Generator().manual_seed(2)
            t = p.sample_t(64, generator=g, device=device, **kw)
            xt, noised = p.noise(x0.to(device), t, generator=g)
            out.append(p.nelbo(logits.to(device), x0.to(device), noised, t, xt=xt).cpu())
        assert torch.allclose(out[0], out[1], atol=1e-5)


def test_row_generators_give_each_chunk_its_own_stream():
    import torch

    from ddrl.processes.draws import RowGenerators, randint_draw, uniform_draw

    gens = lambda: [torch.Generator().manual_seed(s) for s in (11, 22)]  # noqa: E731
    both = uniform_draw((6, 3), generator=RowGenerators(gens(), 3))
    alone = uniform_draw((3, 3), generator=torch.Generator().manual_seed(22))
    assert torch.equal(both[3:], alone)
    ints = randint_draw(5, (6, 2), generator=RowGenerators(gens(), 3))
    assert torch.equal(ints[:3], randint_draw(5, (3, 2), generator=torch.Generator().manual_seed(11)))
    import pytest

    with pytest.raises(ValueError, match="batch as the first dimension"):
        uniform_draw((4, 3), generator=RowGenerators(gens(), 3))
