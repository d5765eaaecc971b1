"""SEPO's released estimator path on its own system, end to end against the authors' code.

tests/fixtures/make_sepo_dna.py ran ozekri/SEPO @ 4a4a40f on the tiny MDLM DNA checkpoint: G = 3 rollout
batches of B = 3 sequences (L = 8), old model = the checkpoint, new model = the checkpoint + noise; for each
batch old `_compute_pi_y` and new `_compute_loss_sepo` (t = dt, M = 2, ε = 0.2), loss = Σ_g loss_g / G,
then backward. Their SNIS draws were recorded and are injected here. ddrl computes everything else itself:
the scores at the clean input, π(z|y) over all L·5 neighbours, the SNIS weights, the released loss, and the
gradient on the model's parameters.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ddrl
import ddrl.objectives  # noqa: F401
from ddrl.estimators.concrete_score import ConcreteScore, hamming_neighbours
from ddrl.objectives import AggregationCounts
from ddrl.registry import OBJECTIVES
from ddrl.types import RolloutBatch

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "sepo_dna"
G, B, L = 3, 3, 8


def rows(t: torch.Tensor) -> torch.Tensor:
    """[G, B, ...] -> [B*G, ...]: row b*G + g is sample b of rollout batch g (group b, rank g)."""
    return t.transpose(0, 1).reshape(G * B, *t.shape[2:])


@pytest.fixture(scope="module")
def golden():
    return load_file(str(FIXTURE / "golden.safetensors"))


def models():
    old = ddrl.load_model(FIXTURE / "tiny_mdlm_dna.ckpt").eval()
    new = ddrl.load_model(FIXTURE / "tiny_mdlm_dna.ckpt")
    new.model.load_state_dict(load_file(str(FIXTURE / "new_backbone.safetensors")))
    return old, new.train()


def batch_of(golden) -> RolloutBatch:
    n = G * B
    return RolloutBatch(
        prompt_ids=torch.zeros(n, 0, dtype=torch.long), prompt_mask=torch.ones(n, 0, dtype=torch.bool),
        completion_ids=rows(golden["rollouts"]), completion_mask=torch.ones(n, L, dtype=torch.bool),
        group_ids=torch.arange(B).repeat_interleave(G), rewards=rows(golden["rewards"]),
        advantages=rows(golden["advantages"]), mask_seeds=torch.tensor([0]))


def test_hamming_neighbours_include_every_value_at_every_position():
    x = torch.tensor([[0, 1, 2]])
    y = hamming_neighbours(x, 5)  # [1, 3, 5, 3]
    assert y.shape == (1, 3, 5, 3)
    assert y[0, 1, 4].tolist() == [0, 4, 2] and y[0, 2, 0].tolist() == [0, 1, 0] and y[0, 0, 0].tolist() == [0, 1, 2]


def test_released_path_weights_loss_and_gradient_equal_the_authors(golden):
    old, new = models()
    batch = batch_of(golden)
    est = ConcreteScore(states="clean", snis_samples=2, released_steps=128)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        old_out = est.released(old, batch, gen, draws=rows(golden["snis_draws_old"]))
    new_out = est.released(new, batch, gen, draws=rows(golden["snis_draws_new"]))
    torch.testing.assert_close(old_out.extras["neighbour_weights"], rows(golden["pi_old"]), atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(new_out.extras["neighbour_weights"], rows(golden["pi_new"]), atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(new_out.extras["log_scores"].detach(), rows(golden["log_scores_new"]), atol=1e-5, rtol=0)

    objective = OBJECTIVES.get("sepo")(clip="released", epsilon=0.2)
    out = objective(batch, new_out, old_out, None, counts=AggregationCounts.from_batch(batch))
    torch.testing.assert_close(out.loss.detach(), golden["loss"], atol=1e-6, rtol=1e-5)
    out.loss.backward()
    grads = {n: p.grad for n, p in new.model.named_parameters() if p.grad is not None}
    expected = {k[len("grad."):]: v for k, v in golden.items() if k.startswith("grad.")}
    assert set(grads) == set(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_released_path_draws_its_own_snis_samples_reproducibly(golden):
    old, _ = models()
    batch = batch_of(golden)
    est = ConcreteScore(states="clean", snis_samples=2)
    a = est(old, batch, seed=5).extras["neighbour_weights"]
    b = est(old, batch, seed=5).extras["neighbour_weights"]
    assert torch.equal(a, b) and a.shape == (G * B, L, 5) and (a > 0).all()
    with pytest.raises(ValueError, match="snis_samples"):
        ConcreteScore(states="clean", snis_samples=0)


def test_released_path_under_fsdp2_runs_through_the_wrapper_and_gives_the_authors_gradient(golden, tmp_path):
    """The paper recipe shards the DNA CNN with FSDP2 (dist.strategy=fsdp). The concrete score reads the
    backbone's raw logits; read by calling the backbone itself, the root's parameters (embedding, time
    layers, norms, outside the sharded conv blocks) stayed sharded DTensors: "mixed torch.Tensor and
    DTensor" at the first pass, found by rehearsing configs/paper/sepo/dna_enhancer.yaml on 8 fake ranks."""
    import torch.distributed as dist

    from ddrl.training.distributed import shard_model

    old, new = models()
    batch = batch_of(golden)
    est = ConcreteScore(states="clean", snis_samples=2, released_steps=128)
    gen = torch.Generator().manual_seed(0)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/process-group", rank=0, world_size=1)
    try:
        shard_model(new, torch.device("cpu"))
        with torch.no_grad():
            old_out = est.released(old, batch, gen, draws=rows(golden["snis_draws_old"]))
        new_out = est.released(new, batch, gen, draws=rows(golden["snis_draws_new"]))
        objective = OBJECTIVES.get("sepo")(clip="released", epsilon=0.2)
        out = objective(batch, new_out, old_out, None, counts=AggregationCounts.from_batch(batch))
        torch.testing.assert_close(out.loss.detach(), golden["loss"], atol=1e-6, rtol=1e-5)
        out.loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in new.model.named_parameters() if p.grad is not None}
    finally:
        dist.destroy_process_group()
    expected = {k[len("grad."):]: v for k, v in golden.items() if k.startswith("grad.")}
    assert set(grads) == set(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)
