"""The routers' auxiliary balance loss (ddrl.models.moe_balance, method.moe_aux_loss_coef): its value
by hand, padding left out, off by default, and with a coefficient it changes the loss and reaches the
router's weight."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import ddrl
from ddrl.config import RLConfig, load_config
from ddrl.models.moe_balance import RouterBalance, moe_routers, sequence_balance_loss

ROOT = Path(__file__).resolve().parents[2]
LLADA2 = ROOT / "tests/fixtures/llada2/model-2.0"


def test_balance_loss_by_hand():
    # E = 4 experts, K = 1; row 0: tokens 0 and 1 both choose expert 0, row 1: experts 0 and 1
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [math.log(3.0), 0.0, 0.0, 0.0]],
                           [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]])  # [B=2, T=2, E=4]
    idx = torch.tensor([[[0], [0]], [[0], [1]]])  # [2, 2, 1]
    valid = torch.ones(2, 2, dtype=torch.bool)
    # row 0: f = (4, 0, 0, 0); token 1's sigmoid scores (3/4, 1/2, 1/2, 1/2) normalised -> s'_0 = 3/9 = 1/3;
    #   token 0's s'_0 = 1/4; P_0 = (1/4 + 1/3) / 2 = 7/24; L = 4 x 7/24 = 7/6
    # row 1: f = (2, 2, 0, 0), P = (1/4, 1/4, ...): L = 2/4 + 2/4 = 1
    got = sequence_balance_loss(logits, idx, valid)
    assert got.item() == pytest.approx((7 / 6 + 1) / 2, rel=1e-6)
    # uniform routing gives exactly 1 (f_i = 1, sum P_i = 1)
    uniform = sequence_balance_loss(torch.zeros(1, 4, 4), torch.arange(4).view(1, 4, 1), torch.ones(1, 4, dtype=bool))
    assert uniform.item() == pytest.approx(1.0)


def test_padding_is_left_out():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 5, 8, generator=g)
    idx = logits.topk(2, dim=-1).indices
    plain = sequence_balance_loss(logits, idx, torch.ones(1, 5, dtype=torch.bool))
    pad = torch.randn(1, 3, 8, generator=g)
    padded = sequence_balance_loss(torch.cat([pad, logits], 1), torch.cat([pad.topk(2, -1).indices, idx], 1),
                                   torch.tensor([[False] * 3 + [True] * 5]))
    assert padded.item() == pytest.approx(plain.item(), rel=1e-6)
    everything = sequence_balance_loss(torch.cat([pad, logits], 1), torch.cat([pad.topk(2, -1).indices, idx], 1),
                                       torch.ones(1, 8, dtype=torch.bool))
    assert everything.item() != pytest.approx(plain.item(), rel=1e-6)


def test_recorded_around_a_forward_and_the_router_gets_a_gradient():
    model = ddrl.load_model(LLADA2)
    routers = moe_routers(model)
    assert len(routers) == 2  # the tiny checkpoint: 3 layers, the first dense
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[0, :4] = False  # a left-padded row
    balance = RouterBalance(model)
    with balance:
        model(ids, attention_mask=mask)
    assert len(balance.terms) == len(routers)
    aux = balance.loss()
    aux.backward()
    for router in routers:  # through P, the sigmoid scores
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
        assert router.expert_bias.grad is None  # a buffer: chooses, never trained
    with torch.no_grad(), balance:  # a rollout / old pass records nothing
        model(ids, attention_mask=mask)
    assert not balance.terms
    model(ids, attention_mask=mask)  # outside `with`: nothing either
    assert not balance.terms


def test_refused_on_a_model_without_routers():
    model = ddrl.load_model(ROOT / "tests/fixtures/llada/model")
    with pytest.raises(ValueError, match="has none"):
        RouterBalance(model)


def _config(tmp_path: Path, coef: float | None) -> RLConfig:
    overrides = [f"model.path={LLADA2}", "task.name=tests.integration.text_task:make", "task.args={}",
                 "train.steps=1", "train.prompts_per_step=2", "train.group_size=2", "train.num_iterations=1",
                 "train.minibatches=1", "train.micro_batch_size=null", "train.progress=false",
                 "train.tensorboard=false", "eval.n=0", "eval.every=0", "eval.before=false",
                 f"output_dir={tmp_path / str(coef)}", "rollout.name=block", "rollout.gen_length=8", "rollout.steps=8",
                 "rollout.block_length=null", "method.estimator_args={p_mask_prompt: 0.0}", "seed=3"]
    if coef is not None:
        overrides.append(f"method.moe_aux_loss_coef={coef}")
    return load_config(ROOT / "configs/rl/grpo_mini_sudoku.yaml", overrides, RLConfig)


def test_off_by_default_and_a_coefficient_adds_it_to_the_loss(tmp_path):
    from ddrl.training.trainer import Trainer

    default = _config(tmp_path, None)
    assert default.method.moe_aux_loss_coef == 0.0
    plain = Trainer(default)
    assert not isinstance(plain.balance, RouterBalance)
    m0 = plain.train_step(1)
    assert "loss/moe_aux" not in m0
    coef = 0.5
    with_aux = Trainer(_config(tmp_path, coef))
    m1 = with_aux.train_step(1)  # same seed: the same rollout, the same masks
    assert m1["loss/moe_aux"] > 0
    # one micro-batch, one rank, mu = 1: the step's loss is the objective's + coef x the balance loss
    assert m1["loss/total"] == pytest.approx(m0["loss/total"] + coef * m1["loss/moe_aux"], abs=1e-5)
    assert m1["loss/total"] != pytest.approx(m0["loss/total"], abs=1e-5)
    with pytest.raises(ValueError, match="moe_aux_loss_coef"):
        Trainer(_config(tmp_path, -1.0))
