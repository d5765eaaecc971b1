"""No estimator materialises [rows, positions, V] logits: a tiny model with a 32k vocabulary.

A TorchDispatchMode watches every tensor that the estimator call and its backward allocate, and
records the largest whose last dimension is the vocabulary. With the log-prob chunk set to 16
positions, nothing larger than 16 positions' logits (or the head's own [d_model, V] gradient) may
appear, in forward or backward, while the rows x completion positions scored number 80 to 400.
Before the chunked head (ddrl.ops.logprobs) every estimator held [rows, L, V] (float32, with its
log-softmax kept for backward) and fails here; the concrete score held [B*K, U, V] to read B*K
vectors. The trace estimator's rows are its states, so it also shows that only each state's
targets reach the head.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ddrl.estimators  # noqa: F401  (registers the estimators)
from ddrl.models.diffusion_lm import DiffusionLM, make_process_spec
from ddrl.models.transformer import Denoiser, DenoiserConfig
from ddrl.registry import ESTIMATORS
from ddrl.types import RolloutBatch, Trajectory

V = 32_000
D = 8  # d_model: the head's [D, V] gradient is the only other vocabulary-wide tensor
CHUNK = 16  # log-prob positions per piece
B, P, L = 4, 6, 20


class VocabTensors(TorchDispatchMode):
    """The largest freshly allocated tensor (not a view) whose last dimension is the vocabulary."""

    def __init__(self):
        super().__init__()
        self.largest, self.shape = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == V and not t._is_view() \
                    and t.numel() > self.largest:
                self.largest, self.shape = t.numel(), tuple(t.shape)
        return out


def model(block_size: int | None = None, uniform: bool = False) -> DiffusionLM:
    cfg = DenoiserConfig(vocab_size=V, d_model=D, n_layers=1, n_heads=2, max_seq_len=2 * (P + L), block_size=block_size)
    spec = make_process_spec("uniform", num_classes=V - 100, offset=100) if uniform else None
    lm = DiffusionLM(Denoiser(cfg, seed=0), mask_token_id=V - 1, suppress_mask_logit=not uniform, process_spec=spec)
    lm.logprob_chunk = CHUNK
    return lm.train()


def rollout(seed: int = 0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    prompt_mask = torch.ones(B, P, dtype=torch.bool)
    prompt_mask[1, :2] = False
    completion_mask = torch.ones(B, L, dtype=torch.bool)
    completion_mask[2, 15:] = False
    commit = torch.rand(B, L, generator=g).argsort(1).argsort(1)  # each token committed at its own step
    return RolloutBatch(
        prompt_ids=torch.randint(100, V - 1, (B, P), generator=g), prompt_mask=prompt_mask,
        completion_ids=torch.randint(100, V - 1, (B, L), generator=g), completion_mask=completion_mask,
        group_ids=torch.tensor([0, 0, 1, 1]), rewards=torch.zeros(B), advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
        mask_seeds=torch.tensor([3]), trajectory=Trajectory(commit, torch.rand(L, generator=g).expand(B, L, L)))


def differentiable_sum(out) -> torch.Tensor:
    """Sum of every output of the estimator that carries a gradient (what an objective might use)."""
    parts = [out.token_logp, out.seq_logp, *out.extras.values()]
    return sum(t.float().sum() for t in parts if isinstance(t, torch.Tensor) and t.requires_grad)


CASES = {  # estimator: (constructor arguments, the model it needs)
    "mean_field": ({}, {}),
    "random_ratio": ({}, {}),
    "coupled_elbo": ({}, {}),
    "coupled_three_pass": ({}, {}),
    "spg": ({}, {}),
    "stratified": ({}, {}),
    "fpo_elbo": ({}, {}),
    "maskgrpo": ({}, {}),
    "trace": ({"shrink": 4}, {}),
    "concrete_score": ({"num_positions": 4}, {}),  # reads B*K = 16 vocabulary vectors by design
    "staircase": ({}, {"block_size": 4}),
    "udm": ({}, {"uniform": True}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_estimator_call_and_its_backward_hold_at_most_a_chunk_of_logits(name):
    args, model_kwargs = CASES[name]
    lm = model(**model_kwargs)
    estimator = ESTIMATORS.get(name)(**args)
    with VocabTensors() as seen:
        out = estimator(lm, rollout(), seed=5)
        differentiable_sum(out).backward()
    assert lm.model.lm_head.weight.grad is not None  # the head was trained through
    assert seen.largest <= max(CHUNK, D) * V, f"{name} allocated a {seen.shape} tensor"


def test_trace_states_send_only_their_targets_through_the_head():
    """shrink=4 over 20 steps: 5 states x 4 rows, each scoring ~4 of 20 positions. The head sees the
    B*L scored tokens once (forward) and once more (backward's recomputation), not 20 rows x 20."""
    lm = model()
    batch = rollout()
    seen: list[int] = []
    handle = lm.model.lm_head.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[0]))
    try:
        out = ESTIMATORS.get("trace")(shrink=4)(lm, batch, seed=0)
        out.token_logp.sum().backward()
    finally:
        handle.remove()
    scored = int(out.mask.sum())
    assert scored == int(batch.completion_mask.sum())
    assert sum(seen) == 2 * scored and max(seen) <= CHUNK
