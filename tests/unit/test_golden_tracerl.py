"""TraceRL against dLLM-RL's own loss code (Gen-Verse/dLLM-RL @ 10b4fd1c, train/rl_llada.py).

The fixture (tests/fixtures/methods/make_tracerl.py) ran their state construction
(`prepare_inputs_and_labels_for_text`, method "TraceRL", shrink 2), their old log-probs
(`compute_logp_old_tok_parallel`) and their training loop around `forward_process`, on a lookup-table
model trained by AdamW: 8 samples -> 19 state rows -> 7 micro-batches of 3 rows, an optimizer step
after micro-batches 0, 2, 4 and 6, so later micro-batches have ratios != 1 against the fixed old
log-probs (clipping and the k3 gradient are exercised). Here ddrl rebuilds each of their
micro-batches from the rollout with `Trace.row_chunks`, checks that its states are their rows,
and that TraceRL gives their loss and gradient (w.r.t. the logits) to 1e-6 in float64.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ddrl.estimators.trace import Trace
from ddrl.objectives import AggregationCounts, compute_advantages
from ddrl.objectives.advantages import groups_in_band
from ddrl.registry import OBJECTIVES
from ddrl.types import EstimatorOutput, RolloutBatch, Trajectory
from tests.fixtures.methods.method_common import load

T, META = load("tracerl")
S = META["settings"]
P, EOS, MASK = S["start_pos"], S["eos_id"], S["mask_id"]
BS = S["batch_size_lm"]


def rollout() -> RolloutBatch:
    completion = T["completion_ids"]
    B, L = completion.shape
    is_eos = completion == EOS
    first = torch.where(is_eos.any(1), is_eos.float().argmax(1), torch.full((B,), L - 1))
    completion_mask = torch.arange(L)[None] <= first[:, None]  # up to and including the first EOS
    return RolloutBatch(
        prompt_ids=T["prompt_ids"], prompt_mask=torch.ones_like(T["prompt_ids"], dtype=torch.bool),
        completion_ids=completion, completion_mask=completion_mask,
        group_ids=torch.arange(B) // 4, rewards=torch.zeros(B, dtype=torch.float64),
        advantages=T["advantages"], mask_seeds=torch.tensor([0]),
        trajectory=Trajectory(commit_step=T["step_map"], token_probs=torch.zeros(B, 1, L)))


def micro_batch(m: int) -> RolloutBatch:
    samples, selection = Trace(shrink=S["shrink"]).row_chunks(rollout(), BS)[m]
    mb = rollout().index(samples)
    mb.extras["trace_states"] = selection
    return mb


def their_row_of_each_state(m: int, mb: RolloutBatch):
    """ddrl's states of micro-batch m (row, masks, targets, order) and the index of their row for each."""
    rows, masks, targets, order = Trace(shrink=S["shrink"]).states(mb)
    ids = T[f"mb{m}/ids"].long()
    noisy, p_mask = T["rows/noisy"][ids], T["rows/p_mask"][ids]
    match = []
    for n in range(rows.numel()):
        state = torch.cat([mb.prompt_ids[rows[n]], torch.where(masks[n], MASK, mb.completion_ids[rows[n]])])
        hit = [j for j in range(ids.numel()) if torch.equal(noisy[j], state) and torch.equal(p_mask[j, P:], targets[n])]
        assert len(hit) >= 1, f"micro-batch {m}: ddrl state {n} is none of their rows"
        match.append(hit[0])
    assert sorted(match) == list(range(ids.numel())), f"micro-batch {m}: states and rows differ"
    return rows, targets, order, match


def outputs(m: int, mb: RolloutBatch):
    """(logits leaf [n, T, V] float64, new, old): ddrl's estimator outputs built from their logits."""
    rows, targets, order, match = their_row_of_each_state(m, mb)
    logits = T[f"mb{m}/logits"].clone().requires_grad_(True)
    labels = T["rows/labels"][T[f"mb{m}/ids"].long()][:, P:]  # [n, L]
    lp = torch.log_softmax(logits, -1)[:, P:].gather(-1, labels[..., None])[..., 0]  # [n, L]
    old_lp = T[f"mb{m}/old_logp"][:, P:]
    new_tok = torch.zeros(mb.completion_ids.shape, dtype=torch.float64)
    old_tok = torch.zeros_like(new_tok)
    for n, j in enumerate(match):
        new_tok = new_tok.index_put((rows[n:n + 1],), torch.where(targets[n], lp[j], 0.0)[None], accumulate=True)
        old_tok = old_tok.index_put((rows[n:n + 1],), torch.where(targets[n], old_lp[j], 0.0)[None], accumulate=True)
    mask = order >= 0
    new = EstimatorOutput(new_tok, new_tok.sum(1), mask, {"trace_step": order})
    old = EstimatorOutput(old_tok, old_tok.sum(1), mask, {"trace_step": order})
    return logits, new, old


def test_their_rows_are_ddrl_trace_states_in_their_micro_batches():
    chunks = Trace(shrink=S["shrink"]).row_chunks(rollout(), BS)
    assert len(chunks) == META["micro_batches"]
    assert Trace(shrink=S["shrink"]).count_rows(rollout()) == T["rows/noisy"].shape[0]
    for m, (samples, selection) in enumerate(chunks):
        theirs = T["row_sample"][T[f"mb{m}/ids"].long()]
        assert torch.equal(samples.repeat_interleave(selection.sum(1)), theirs)
        micro_batch(m) and their_row_of_each_state(m, micro_batch(m))


@pytest.mark.parametrize("m", range(7))
def test_loss_and_gradient_match_forward_process(m):
    mb = micro_batch(m)
    logits, new, old = outputs(m, mb)
    obj = OBJECTIVES.get("tracerl")(aggregation="row_token_mean_local")
    out = obj(mb, new, old, None, counts=AggregationCounts.from_batch(mb))
    torch.testing.assert_close(out.loss, T[f"mb{m}/loss"], atol=1e-6, rtol=1e-6)
    out.loss.backward()
    torch.testing.assert_close(logits.grad, T[f"mb{m}/grad_logits"], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("window", [(1, 2), (3, 4), (5, 6)])
def test_default_global_rows_sum_to_their_accumulated_step(window):
    """ddrl's default divides by the step's rows: summed over one of their accumulation windows
    (equal micro-batches) it is the mean of their micro-batch losses, with their gradient / GA."""
    assert all(w - 1 in S["optimizer_step_after_micro_batch"] for w in window[:1])
    rows = sum(T[f"mb{m}/ids"].numel() for m in window)
    total, theirs = 0.0, 0.0
    for m in window:
        mb = micro_batch(m)
        logits, new, old = outputs(m, mb)
        counts = AggregationCounts(**{**vars(AggregationCounts.from_batch(mb)), "rows": float(rows)})
        out = OBJECTIVES.get("tracerl")()(mb, new, old, None, counts=counts)
        out.loss.backward()
        share = T[f"mb{m}/ids"].numel() / rows
        torch.testing.assert_close(logits.grad, T[f"mb{m}/grad_logits"] * share, atol=1e-6, rtol=1e-6)
        total, theirs = total + out.loss.item(), theirs + T[f"mb{m}/loss"].item() * share
    assert total == pytest.approx(theirs, abs=1e-6)


def test_trace_estimator_gives_their_old_logprobs():
    """The estimator's forward (float32 log-softmax) on their lookup model gives the log-probs their
    compute_logp_old_tok_parallel stored before training."""
    noisy, keys_logits = [], []
    for m in range(META["micro_batches"]):
        noisy.append(T["rows/noisy"][T[f"mb{m}/ids"].long()])
        keys_logits.append(T[f"mb{m}/logits"])
    table = torch.cat(keys_logits)  # logits per row of theirs (rows of micro-batch 0 are pre-update: the old model)
    keys = torch.cat(noisy)
    m0 = T["mb0/ids"].numel()

    class Lookup(torch.nn.Module):
        mask_token_id = MASK

        def forward(self, input_ids, attention_mask=None):
            hit = (input_ids[:, None, :] == keys[None, :m0]).all(-1)
            assert bool((hit.sum(1) >= 1).all())
            return SimpleNamespace(logits=table[:m0][hit.float().argmax(1)])

    mb = micro_batch(0)
    out = Trace(shrink=S["shrink"])(Lookup(), mb, seed=0)
    _, new, _ = outputs(0, mb)
    torch.testing.assert_close(out.token_logp.double(), new.token_logp.detach(), atol=1e-5, rtol=1e-5)
    assert torch.equal(out.mask, new.mask) and torch.equal(out.extras["trace_step"], new.extras["trace_step"])


def test_population_zscore_matches_their_reward_script():
    info = META["reward"]
    for correct, adv, kept in zip(info["correctness"], info["advantages"], info["kept"]):
        r = torch.tensor(correct, dtype=torch.float64)
        ours = compute_advantages(r, torch.zeros(4, dtype=torch.long), "zscore", std="population", eps=0.0)
        torch.testing.assert_close(ours, torch.tensor(adv, dtype=torch.float64), atol=1e-12, rtol=0)
        accuracy = sum(correct) / len(correct)
        keep = groups_in_band(r, torch.zeros(4, dtype=torch.long), 0.2, 0.8)  # train.group_filter=[0.2, 0.8]
        assert bool(keep.all()) == kept and bool(keep.any()) == kept, accuracy
