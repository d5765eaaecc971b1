"""TraceRL's rollout records the commit order only: the trace estimator reads commit_step, so the
sampler keeps nothing per step that scales with the vocabulary (it kept fp32 [B, W, V] per step of a
block: 16.6 GB per rank at LLaDA-8B's scale), and the TraceRL loss is the one the full record gives."""

from __future__ import annotations

import pytest
import torch

import ddrl.sampling  # noqa: F401  (registers the samplers)
import ddrl.sampling.masked as masked
from ddrl.config import RLConfig, SamplerConfig, load_config
from ddrl.estimators.trace import Trace
from ddrl.objectives import AggregationCounts, compute_advantages
from ddrl.registry import OBJECTIVES, SAMPLERS
from ddrl.sampling.trajectory import ProbRecorder
from ddrl.training.method import build_method
from ddrl.types import COMMIT_ORDER, RolloutBatch
from tests.toy_models import ToyDiffusionLM

V = 29  # a vocabulary no other dimension of the run has: a stored [.., V] tensor shows in its shape
B, P, L, W = 4, 3, 8, 4


class KeptTensors(ProbRecorder):
    """A ProbRecorder that notes the shape of every tensor it holds when a block closes."""

    shapes: list[tuple[int, ...]] = []

    def close_block(self, start, first_step, final):
        KeptTensors.shapes += [tuple(t.shape) for t in self.buffer]
        super().close_block(start, first_step, final)
        KeptTensors.shapes += [tuple(g.shape) for _, _, g in self.blocks]


def rollout(record, monkeypatch) -> RolloutBatch:
    KeptTensors.shapes = []
    monkeypatch.setattr(masked, "ProbRecorder", KeptTensors)
    model = ToyDiffusionLM(vocab_size=V, mask_token_id=V - 1, seed=3)
    prompt_ids = torch.randint(2, V - 1, (B, P), generator=torch.Generator().manual_seed(0))
    prompt_mask = torch.ones_like(prompt_ids, dtype=torch.bool)
    cfg = SamplerConfig(steps=L // 2, gen_length=L, block_length=W, temperature=1.0, threshold=None)
    out = SAMPLERS.get("masked")(model, prompt_ids, prompt_mask, cfg, generator=torch.Generator().manual_seed(1),
                                 return_trajectory=record)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25])
    group_ids = torch.tensor([0, 0, 1, 1])
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=out.completion_ids,
                        completion_mask=torch.ones(B, L, dtype=torch.bool), group_ids=group_ids, rewards=rewards,
                        advantages=compute_advantages(rewards, group_ids, "mean"), mask_seeds=torch.tensor([0]),
                        trajectory=out.trajectory)


def tracerl_loss(batch: RolloutBatch) -> torch.Tensor:
    model = ToyDiffusionLM(vocab_size=V, mask_token_id=V - 1, seed=4)  # a policy that moved since the rollout
    estimator, objective = Trace(shrink=2), OBJECTIVES.get("tracerl")()
    old = Trace(shrink=2)(ToyDiffusionLM(vocab_size=V, mask_token_id=V - 1, seed=3), batch, 0)
    new = estimator(model, batch, 0)
    counts = AggregationCounts(tokens=float(batch.completion_mask.sum()), sequences=float(len(batch)),
                               rows=float(estimator.count_rows(batch)))
    return objective(batch, new, old, old, counts=counts).loss


def test_commit_order_record_keeps_no_vocabulary_dimension_and_gives_the_same_tracerl_loss(monkeypatch):
    full = rollout(True, monkeypatch)
    assert any(V in shape for shape in KeptTensors.shapes), "the full record keeps [B, W, V]: test is void"
    assert full.trajectory.token_probs.shape == (B, L // 2, L)

    order = rollout(COMMIT_ORDER, monkeypatch)
    assert not any(V in shape for shape in KeptTensors.shapes), KeptTensors.shapes
    assert order.trajectory.token_probs is None
    assert torch.equal(order.completion_ids, full.completion_ids)
    assert torch.equal(order.trajectory.commit_step, full.trajectory.commit_step)
    full_loss, order_loss = tracerl_loss(full), tracerl_loss(order)
    assert full_loss.abs() > 0
    torch.testing.assert_close(order_loss, full_loss, atol=1e-6, rtol=0)


def test_tracerl_asks_for_the_commit_order_and_daca_for_token_probs():
    tracerl = build_method(load_config("configs/paper/tracerl_llada8b.yaml", [], RLConfig))
    assert tracerl.needs_trajectory == COMMIT_ORDER
    daca = build_method(load_config("configs/paper/daca_grpo_llada8b.yaml", [], RLConfig))
    assert daca.needs_trajectory is True  # DPS weights read token_probs
    plain = build_method(load_config("configs/paper/diffu_grpo_llada8b.yaml", [], RLConfig))
    assert plain.needs_trajectory is False


def test_dps_weights_refuse_a_commit_order_record(monkeypatch):
    from ddrl.estimators.dps import denoising_progress_scores

    batch = rollout(COMMIT_ORDER, monkeypatch)
    with pytest.raises(ValueError, match="return_trajectory=True"):
        denoising_progress_scores(batch.trajectory, batch.completion_mask)


def test_tracerl_recipe_gathers_the_fsdp_model_about_once_per_optimizer_step():
    """Each micro-batch's forward/backward all-gathers the whole model under FSDP: at 8 ranks the
    recipe's micro_batch_rows must not turn a rollout's 2,048 rows per rank into ~1,000 gathers."""
    cfg = load_config("configs/paper/tracerl_llada8b.yaml", [], RLConfig)
    t, ranks = cfg.train, 8
    rows_per_rank = t.prompts_per_step * t.group_size * (cfg.rollout.gen_length // cfg.method.estimator_args["shrink"])
    rows_per_rank //= ranks
    gathers = rows_per_rank // t.micro_batch_rows
    assert gathers <= 2 * t.minibatches, f"{gathers} all-gathers per rank per rollout"
    assert t.micro_batch_rows * 0.33 < 40, "64 rows x ~0.33 GB (header arithmetic) must leave room on 80 GB"
