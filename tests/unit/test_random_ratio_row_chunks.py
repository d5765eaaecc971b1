"""UniGRPO's masked copies cut into row chunks (train.micro_batch_rows) give the uncut loss and gradient.

One forward/backward over all copies x samples held ~92 GB at the paper recipe's 35 copies; the
trainer instead runs the estimator, the loss and backward once per chunk of (sample, copy) rows
(RandomRatio.row_chunks via Method.row_chunks). The reference is the uncut call on the whole batch,
computed here the plain way: the chunks must draw the same masks, compute each row once, and divide
by the step's row count, or the summed loss and the accumulated parameter gradients differ.
"""

from __future__ import annotations

import pytest
import torch

from ddrl.config import ConfigError, RLConfig, load_config
from ddrl.estimators import RandomRatio
from ddrl.objectives import AggregationCounts
from ddrl.registry import OBJECTIVES
from ddrl.training.method import AdvantageSpec, Method
from ddrl.types import RolloutBatch
from tests.toy_models import ToyDiffusionLM

MASK, EOS, COPIES, SEED = 11, 1, 3, 4


def batch() -> RolloutBatch:
    """Two groups of two; one completion ends early (EOS), one reward is invalid (NaN, advantage 0)."""
    g = torch.Generator().manual_seed(0)
    completion = torch.randint(2, 11, (4, 6), generator=g)
    completion[1, 3:] = EOS
    return RolloutBatch(
        prompt_ids=torch.randint(2, 11, (4, 3), generator=g), prompt_mask=torch.ones(4, 3, dtype=torch.bool),
        completion_ids=completion, completion_mask=torch.arange(6)[None] <= torch.tensor([5, 3, 5, 5])[:, None],
        group_ids=torch.tensor([0, 0, 1, 1]), rewards=torch.tensor([1.0, 0.0, float("nan"), 1.0]),
        advantages=torch.tensor([1.0, -1.0, 0.0, 0.7]), mask_seeds=torch.tensor([SEED]))


def method() -> Method:
    objective = OBJECTIVES.get("unigrpo")(aggregation="row_token_mean", beta=0.05, epsilon=0.05)
    return Method(objective, RandomRatio(copies=COPIES), AdvantageSpec("zscore", "population", 0.0, None, "drop"))


def loss_and_grads(m: Method, policy, old_policy, micro: list[RolloutBatch], counts: AggregationCounts):
    """The trainer's accumulation: per micro-batch, old pass (no grad), current pass, loss, backward."""
    policy.zero_grad(set_to_none=True)
    total = torch.zeros(())
    for mb in micro:
        with torch.no_grad():
            old = m.estimator(old_policy, mb, SEED)
        loss = m.loss(mb, m.estimator(policy, mb, SEED), old, None, counts).loss
        loss.backward()
        total = total + loss.detach()
    return total, {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("rows", [1, 2, 5, 7])
def test_row_chunks_give_the_uncut_loss_and_every_parameter_gradient(rows):
    policy = ToyDiffusionLM(vocab_size=12, mask_token_id=MASK, pad_token_id=0, eos_token_id=EOS, seed=3)
    old_policy = ToyDiffusionLM(vocab_size=12, mask_token_id=MASK, pad_token_id=0, eos_token_id=EOS, seed=5)
    m, b = method(), batch()
    counts = AggregationCounts.from_batch(b)
    counts.rows = m.count_rows(b)
    assert counts.rows == COPIES * 3  # the invalid sample makes no rows
    whole_loss, whole_grads = loss_and_grads(m, policy, old_policy, [b], counts)
    assert whole_loss.abs() > 1e-4 and len(whole_grads) == len(list(policy.parameters()))

    seen: list[int] = []  # rows of every forward call
    handle = policy.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[0]))
    try:
        chunks = m.row_chunks(b, rows)
        loss, grads = loss_and_grads(m, policy, old_policy, chunks, counts)
    finally:
        handle.remove()
    assert len(chunks) == -(-9 // rows) and max(seen) <= rows and sum(seen) == 9  # each row once, cut as asked
    torch.testing.assert_close(loss, whole_loss, rtol=1e-5, atol=1e-7)
    assert grads.keys() == whole_grads.keys()
    for name, g in whole_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-7, msg=name)


def test_chunks_are_sample_major_rows_of_valid_samples():
    chunks = RandomRatio(copies=COPIES).row_chunks(batch(), 4)
    rows = [(int(s), int(c)) for _, selection in chunks for s, c in selection.nonzero().tolist()]
    assert rows == [(s, c) for s in (0, 1, 3) for c in range(COPIES)]  # dLLM-RL's order; sample 2 is invalid
    assert [int(sel.sum()) for _, sel in chunks] == [4, 4, 1]
    assert all(torch.equal(samples, torch.arange(4)) for samples, _ in chunks)  # the whole batch: its masks


def test_a_chunk_scores_only_its_rows_with_the_uncut_masks():
    policy = ToyDiffusionLM(vocab_size=12, mask_token_id=MASK, pad_token_id=0, eos_token_id=EOS, seed=3)
    est, b = RandomRatio(copies=COPIES), batch()
    with torch.no_grad():
        whole = est(policy, b, SEED)
        for mb in method().row_chunks(b, 2):
            part = est(policy, mb, SEED)
            chosen = mb.extras["copy_rows"].T[..., None]  # [C, B, 1]
            assert torch.equal(part.extras["copy_mask"], whole.extras["copy_mask"] & chosen)
            torch.testing.assert_close(part.extras["copy_token_logp"], whole.extras["copy_token_logp"] * chosen)


def test_micro_batch_rows_with_copies_needs_a_row_loss():
    with pytest.raises(ConfigError, match=r"aggregation='token_mean'.*row_token_mean"):
        load_config(None, ["method.objective=grpo", "method.estimator=random_ratio", "train.micro_batch_rows=8"],
                    RLConfig)
    cfg = load_config(None, ["method.objective=unigrpo", "train.micro_batch_rows=8"], RLConfig)
    assert cfg.train.micro_batch_rows == 8
