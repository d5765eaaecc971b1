"""UniGRPO against dLLM-RL's own loss code (Gen-Verse/dLLM-RL @ 10b4fd1c, train/rl_llada.py).

The fixture (tests/fixtures/methods/make_unigrpo.py) ran their "random_masking" row construction
(3 masked copies per sample, masks drawn by their code and recorded), their old log-probs and their
training loop around `forward_process` on a lookup-table model trained by AdamW: 8 samples -> 24
copy rows -> 8 micro-batches (one sample's 3 copies each), optimizer steps after micro-batches 0,
2, 4, 6. ddrl gets their masks injected (RandomRatio.score) and must give their loss and gradient
w.r.t. the logits to 1e-6 in float64, scoring every copy as its own row.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ddrl.estimators.random_ratio import RandomRatio
from ddrl.objectives import AggregationCounts
from ddrl.registry import OBJECTIVES
from ddrl.types import EstimatorOutput, RolloutBatch
from tests.fixtures.methods.method_common import load

T, META = load("unigrpo")
S = META["settings"]
P, EOS, MASK, C = S["start_pos"], S["eos_id"], S["mask_id"], S["mask_times_per_sample"]


def rollout() -> RolloutBatch:
    completion = T["completion_ids"]
    B, L = completion.shape
    is_eos = completion == EOS
    first = torch.where(is_eos.any(1), is_eos.float().argmax(1), torch.full((B,), L - 1))
    return RolloutBatch(
        prompt_ids=T["prompt_ids"], prompt_mask=torch.ones_like(T["prompt_ids"], dtype=torch.bool),
        completion_ids=completion, completion_mask=torch.arange(L)[None] <= first[:, None],
        group_ids=torch.arange(B) // 4, rewards=torch.zeros(B, dtype=torch.float64),
        advantages=T["advantages"], mask_seeds=torch.tensor([0]))


def micro_batch(m: int):
    """ddrl's micro-batch for their micro-batch m (one sample) and their copy masks [C, 1, L]."""
    ids = T[f"mb{m}/ids"].long()
    samples = T["row_sample"][ids]
    assert torch.equal(samples, samples[:1].expand(C)), "a micro-batch of theirs is one sample's copies"
    mb = rollout().index(samples[:1])
    masks = T["rows/p_mask"][ids][:, None, P:].bool()  # [C, 1, L]
    noisy = torch.where(masks | ~mb.completion_mask[None], MASK, mb.completion_ids[None])  # ddrl's noised copies
    assert torch.equal(noisy[:, 0], T["rows/noisy"][ids][:, P:]), "ddrl's noised input is not theirs"
    return mb, masks


def outputs(m: int):
    mb, masks = micro_batch(m)
    ids = T[f"mb{m}/ids"].long()
    logits = T[f"mb{m}/logits"].clone().requires_grad_(True)
    labels = T["rows/labels"][ids][:, P:]
    lp = torch.log_softmax(logits, -1)[:, P:].gather(-1, labels[..., None])[..., 0][:, None]  # [C, 1, L]
    old_lp = T[f"mb{m}/old_logp"][:, None, P:]
    scored = masks & mb.completion_mask[None]
    mask = scored.any(0)

    def out(copy_lp):
        mean = (copy_lp * scored).sum(0) / scored.sum(0).clamp(min=1)
        return EstimatorOutput(mean * mask, mean.sum(1), mask, {"copy_token_logp": copy_lp * scored, "copy_mask": scored})
    return mb, logits, out(lp), out(old_lp)


@pytest.mark.parametrize("m", range(8))
def test_loss_and_gradient_match_forward_process(m):
    mb, logits, new, old = outputs(m)
    obj = OBJECTIVES.get("unigrpo")(aggregation="row_token_mean_local")
    loss = obj(mb, new, old, None, counts=AggregationCounts.from_batch(mb)).loss
    torch.testing.assert_close(loss, T[f"mb{m}/loss"], atol=1e-6, rtol=1e-6)
    loss.backward()
    torch.testing.assert_close(logits.grad, T[f"mb{m}/grad_logits"], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("m", range(8))
def test_default_global_rows_equal_theirs_when_no_copy_is_empty(m):
    """The default divides by copies x valid sequences; with no empty copy that is their row count."""
    mb, logits, new, old = outputs(m)
    obj = OBJECTIVES.get("unigrpo")()
    assert (obj.kl_against, obj.default_advantage_std, obj.aggregation) == ("old", "population", "row_token_mean")
    assert not obj.needs_ref
    loss = obj(mb, new, old, None, counts=AggregationCounts.from_batch(mb)).loss
    torch.testing.assert_close(loss, T[f"mb{m}/loss"], atol=1e-6, rtol=1e-6)
    loss.backward()
    torch.testing.assert_close(logits.grad, T[f"mb{m}/grad_logits"], atol=1e-6, rtol=1e-6)


def test_estimator_with_their_masks_gives_their_old_logprobs():
    """RandomRatio.score with their masks on their (pre-update) lookup model gives, per copy, the
    log-probs their compute_logp_old_tok_parallel stored (float32 forward)."""
    m = 0
    mb, masks = micro_batch(m)
    keys, table = T["rows/noisy"][T[f"mb{m}/ids"].long()], T[f"mb{m}/logits"]

    class Lookup(torch.nn.Module):
        mask_token_id = MASK

        def forward(self, input_ids, attention_mask=None):
            hit = (input_ids[:, None, :] == keys[None]).all(-1)
            assert bool((hit.sum(1) >= 1).all()), "ddrl fed an input their code never built"
            return SimpleNamespace(logits=table[hit.float().argmax(1)])

    out = RandomRatio(copies=C).score(Lookup(), mb, masks)
    scored = out.extras["copy_mask"]
    expected = T[f"mb{m}/old_logp"][:, None, P:] * scored
    torch.testing.assert_close(out.extras["copy_token_logp"].double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(scored, masks & mb.completion_mask[None])
