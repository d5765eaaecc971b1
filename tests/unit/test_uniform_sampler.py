"""The uniform-diffusion posterior and ancestral sampler, on tiny table models.

Vocabulary: ids 0..2 are prompt tokens, 3..5 the N = 3 classes of the process, 6 the mask token.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

import pytest
import torch

from ddrl.config import SamplerConfig
from ddrl.processes import MaskedProcess, UniformProcess
from ddrl.registry import SAMPLERS
from ddrl.sampling.uniform import sample_uniform

N, OFFSET, V, MASK = 3, 3, 7, 6


@dataclass
class Output:
    logits: torch.Tensor


class FnModel:
    """model(input_ids, attention_mask).logits = fn(input_ids); records every call's inputs."""

    def __init__(self, fn, process: UniformProcess | None = None):
        self.fn = fn
        self.process = process or UniformProcess(N, offset=OFFSET)
        self.vocab_size, self.mask_token_id = V, MASK
        self.calls: list[torch.Tensor] = []

    def __call__(self, input_ids, attention_mask=None):
        self.calls.append(input_ids.clone())
        return Output(self.fn(input_ids))


def cfg(**kw) -> SamplerConfig:
    return SamplerConfig(**{"name": "uniform", "steps": 4, "gen_length": 3, "temperature": 1.0, **kw})


def prompts(B: int = 4, P: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.arange(B * P).view(B, P) % 3
    ids[0, 0] = 0
    mask = torch.ones(B, P, dtype=torch.bool)
    mask[0, 0] = False  # one left-padded row
    return ids, mask


def brute_force_posterior(x0: torch.Tensor, xt: int, alpha_t: float, alpha_s: float) -> torch.Tensor:
    """q(x_s | x_t) with x_0 ~ x0 (a prior over classes), by Bayes over explicit transition matrices."""
    eye, ones = torch.eye(N, dtype=torch.float64), torch.ones(N, N, dtype=torch.float64)
    q_s_given_0 = alpha_s * eye + (1 - alpha_s) / N * ones  # [x_0, x_s]
    a_ts = alpha_t / alpha_s
    q_t_given_s = a_ts * eye + (1 - a_ts) / N * ones  # [x_s, x_t]
    joint = x0[:, None] * q_s_given_0 * q_t_given_s[None, :, xt]  # [x_0, x_s] at the observed x_t
    return joint.sum(0) / joint.sum()


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_posterior_matches_bayes(schedule):
    p = UniformProcess(N, offset=OFFSET, schedule=schedule)
    g = torch.Generator().manual_seed(0)
    for t, s in ((0.7, 0.3), (1.0, 0.75), (0.4, 0.0), (0.5, 0.5)):
        a_t, a_s = (p.schedule.alpha(torch.tensor(x, dtype=torch.float64)).item() for x in (t, s))
        priors = [torch.eye(N, dtype=torch.float64)[1], torch.softmax(torch.randn(N, generator=g, dtype=torch.float64), 0)]
        for x0 in priors:
            for xt in range(N):
                ours = p.posterior(x0[None], torch.tensor([xt]), t, s)[0]
                assert torch.allclose(ours, brute_force_posterior(x0, xt, a_t, a_s), atol=1e-12)


def test_oracle_model_produces_the_target_exactly():
    target = torch.tensor([5, 3, 4])
    oracle = torch.full((V,), float("-inf")).repeat(3, 1)
    oracle[torch.arange(3), target] = 0.0

    def fn(ids):  # all mass on the target at the completion positions
        logits = torch.zeros(*ids.shape, V)
        logits[:, -3:] = oracle
        return logits

    prompt_ids, prompt_mask = prompts()
    for temperature, cfg_scale in ((1.0, 0.0), (0.0, 0.0), (0.7, 2.0)):
        out = sample_uniform(FnModel(fn), prompt_ids, prompt_mask, cfg(temperature=temperature, cfg_scale=cfg_scale),
                             generator=torch.Generator().manual_seed(0))
        assert torch.equal(out.completion_ids, target.expand(4, 3)) and out.nfe == 4


def table_fn(seed: int, L: int = 2):
    """Logits that are a fixed random function of the completion's classes (prompt ignored)."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(N**L, L, N, generator=g, dtype=torch.float64) * 1.5
    powers = N ** torch.arange(L)

    def fn(ids):
        classes = ids[:, -L:] - OFFSET
        logits = torch.full((*ids.shape, V), -30.0, dtype=torch.float64)  # non-class ids: never used
        logits[:, -L:, OFFSET:OFFSET + N] = table[(classes * powers).sum(-1)]
        return logits

    return fn, table, powers


def test_two_step_output_distribution_is_exact():
    # S = 2: x_1 uniform -> x_{1/2} ~ q(. | x_1, x_theta(x_1)) -> x_0 ~ x_theta(x_{1/2}) at temperature tau.
    tau, L, n = 0.7, 2, 30_000
    fn, table, powers = table_fn(seed=3, L=L)
    p = UniformProcess(N, offset=OFFSET)
    x_theta = lambda c: torch.softmax(table[(torch.tensor(c) * powers).sum()] / tau, -1)  # noqa: E731  [L, N]
    states = list(product(range(N), repeat=L))
    exact = torch.zeros(N**L, dtype=torch.float64)
    for x1 in states:
        post = [brute_force_posterior(x_theta(x1)[i], x1[i], 0.0, 0.5) for i in range(L)]
        for xh in states:
            p_half = post[0][xh[0]] * post[1][xh[1]] / N**L
            final = x_theta(xh)
            for x0 in states:
                exact[x0[0] + N * x0[1]] += p_half * final[0, x0[0]] * final[1, x0[1]]  # the code of `powers`
    model = FnModel(fn, p)
    out = sample_uniform(model, torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.bool),
                         cfg(steps=2, gen_length=L, temperature=tau), generator=torch.Generator().manual_seed(1))
    code = ((out.completion_ids - OFFSET) * powers).sum(-1)
    freq = torch.bincount(code, minlength=N**L).double() / n
    se = (exact * (1 - exact) / n).sqrt()
    assert ((freq - exact).abs() < 4.5 * se).all(), (freq, exact)
    assert len(model.calls) == 2 and out.nfe == 2


def test_deterministic_given_the_generator():
    fn, _, _ = table_fn(seed=4, L=3)
    prompt_ids, prompt_mask = prompts()
    run = lambda seed: sample_uniform(FnModel(fn), prompt_ids, prompt_mask, cfg(), return_trajectory=True,  # noqa: E731
                                      generator=torch.Generator().manual_seed(seed))
    a, b, c = run(0), run(0), run(1)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.trajectory.states, b.trajectory.states)
    assert not torch.equal(a.trajectory.states, c.trajectory.states)


def test_trajectory_contents():
    fn, _, _ = table_fn(seed=5, L=3)
    prompt_ids, prompt_mask = prompts()
    B, S, L = 4, 5, 3
    model = FnModel(fn)
    out = sample_uniform(model, prompt_ids, prompt_mask, cfg(steps=S, gen_length=L), return_trajectory=True,
                         generator=torch.Generator().manual_seed(2))
    tr = out.trajectory
    assert tr.states.shape == (B, S, L) and tr.token_probs.shape == (B, S, L) and tr.commit_step.shape == (B, L)
    assert torch.allclose(tr.step_times, torch.tensor([1.0, 0.8, 0.6, 0.4, 0.2]))
    assert ((tr.states >= OFFSET) & (tr.states < OFFSET + N)).all()
    # states[:, k] is exactly what the model saw at step k, next to the prompt.
    for k in range(S):
        assert torch.equal(model.calls[k], torch.cat([prompt_ids, tr.states[:, k]], 1))
    # commit_step: the last step whose output differs from its input (0 if never changed).
    after = torch.cat([tr.states[:, 1:], out.completion_ids[:, None]], 1)  # [B, S, L] output of each step
    changed = after != tr.states
    steps = torch.arange(S)[None, :, None].expand(B, S, L)
    assert torch.equal(tr.commit_step, torch.where(changed, steps, 0).amax(1))
    # token_probs: the model's x0-probability of the final token, recomputed from the recorded states.
    for k in range(S):
        probs = torch.softmax(fn(model.calls[k])[:, -L:, OFFSET:OFFSET + N].float(), -1)
        expected = probs.gather(-1, (out.completion_ids - OFFSET)[..., None]).squeeze(-1)
        assert torch.allclose(tr.token_probs[:, k], expected, atol=1e-6)


def test_classifier_free_guidance():
    cond = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.9, 0.0, 0.0])  # argmax class 3
    uncond = torch.tensor([0.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0])  # uncond + 2 (cond - uncond): argmax class 4

    def fn(ids):
        is_uncond = (ids[:, :2] == MASK).any(1)
        return torch.where(is_uncond[:, None, None], uncond, cond).expand(*ids.shape, V).clone()

    prompt_ids, prompt_mask = prompts()
    for w, expected in ((0.0, 3), (1.0, 4)):
        model = FnModel(fn)
        out = sample_uniform(model, prompt_ids, prompt_mask, cfg(steps=1, temperature=0.0, cfg_scale=w),
                             generator=torch.Generator().manual_seed(0))
        assert (out.completion_ids == expected).all() and out.nfe == 1 and len(model.calls) == 1
    batch = model.calls[0]  # cond rows then uncond rows, in one call
    assert batch.shape[0] == 8
    assert torch.equal(batch[4:, :2], torch.where(prompt_mask, MASK, prompt_ids))


def test_registered_and_bad_inputs():
    assert SAMPLERS.get("uniform") is sample_uniform
    prompt_ids, prompt_mask = prompts()
    model = FnModel(lambda ids: torch.zeros(*ids.shape, V))
    model.process = MaskedProcess(MASK)
    with pytest.raises(ValueError, match="UniformProcess"):
        sample_uniform(model, prompt_ids, prompt_mask, cfg(), generator=torch.Generator())
    model.process = UniformProcess(5, offset=3)  # ids 3..7, vocabulary of 7
    with pytest.raises(ValueError, match="num_classes/offset"):
        sample_uniform(model, prompt_ids, prompt_mask, cfg(), generator=torch.Generator())
    model.process = UniformProcess(N, offset=OFFSET)
    with pytest.raises(ValueError, match="generator"):
        sample_uniform(model, prompt_ids, prompt_mask, cfg(), generator=None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_prompts_with_a_cpu_generator_give_the_cpu_samples():
    fn, _, _ = table_fn(seed=6, L=3)
    prompt_ids, prompt_mask = prompts()
    outs = [sample_uniform(FnModel(lambda ids: fn(ids.cpu()).to(ids.device)), prompt_ids.to(d), prompt_mask.to(d),
                           cfg(), generator=torch.Generator().manual_seed(0)).completion_ids.cpu()
            for d in ("cpu", "cuda")]
    assert torch.equal(outs[0], outs[1])
