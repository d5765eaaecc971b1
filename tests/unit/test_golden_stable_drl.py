"""StableDRL against JianyuanZhong/StableDRL's own compute_loss_spg (fixture: make_stable_drl.py).

The fixture holds the released loss (use_snis: clipped, group-self-normalised importance weights
times A times SPG's mix bound) and its gradient w.r.t. fixed logits, for one prompt group, with the
masks the released code drew for ELBO_old (`ref_elbo`, at rollout) and for the current pass (a
fresh seed). Both are injected into ddrl:
  * full attention: the `spg` estimator's `score`, as the released LLaDA code;
  * block models: the `staircase` estimator's `score`, fed by a block model whose noisy stream
    returns the same per-draw logits. It must give the released value too, since StableDRL on
    block models is meant to be the released form with the staircase layout (not a 1/t-weighted
    block ELBO, which failed this test).
"""

from __future__ import annotations

import types

import torch

from ddrl.estimators.spg import SPGBounds
from ddrl.estimators.staircase import Staircase
from ddrl.objectives.aggregation import AggregationCounts
from ddrl.objectives.stable_drl import StableDRL
from ddrl.types import EstimatorOutput, RolloutBatch
from tests.fixtures.methods.method_common import load


TENSORS, META = load("stable_drl")
S = META["settings"]
P, L, C, G, MASK, BLOCK = S["prompt_len"], S["gen_len"], S["num_t"], S["group_size"], S["mask_id"], S["block_length"]


def group_batch() -> RolloutBatch:
    t = TENSORS
    return RolloutBatch(
        prompt_ids=t["prompt_ids"], prompt_mask=t["prompt_mask"].bool(), completion_ids=t["completion_ids"],
        completion_mask=t["completion_mask"].bool(), group_ids=torch.zeros(G, dtype=torch.long),
        rewards=t["rewards"].double(), advantages=t["advantages"].double(), mask_seeds=torch.tensor([0]))


def completion_masks(noisy: torch.Tensor) -> torch.Tensor:
    return (noisy[..., P:] == MASK).transpose(0, 1)  # [B, C, T] -> [C, B, L]


class FullAttentionLogits(torch.nn.Module):
    """The recorded logits [B, C, T, V], in ddrl's copy-major row order (c * B + b)."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.mask_token_id, self.logits = MASK, logits

    def forward(self, input_ids, attention_mask=None):
        B = self.logits.shape[0]
        return types.SimpleNamespace(logits=self.logits.transpose(0, 1).reshape(C * B, *self.logits.shape[2:]))


class BlockLogits(torch.nn.Module):
    """A block model called with the staircase input [B, 2T], T = P + L + E (E mask tokens complete
    the last block, as SDAR decodes it): its noisy completion (positions T + P .. T + P + L) returns
    draw n's recorded completion logits on the n-th call."""

    def __init__(self, logits: torch.Tensor, noisy: torch.Tensor):
        super().__init__()
        self.mask_token_id, self.block_size = MASK, BLOCK
        self.logits, self.noisy, self.calls = logits, noisy, 0

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        n, self.calls = self.calls, self.calls + 1
        B, T2 = input_ids.shape
        E = max(-(int(k) + L) % BLOCK for k in TENSORS["prompt_mask"].sum(1))
        T = P + L + E
        assert attention_mask.shape == (B, T2, T2) and T2 == 2 * T  # the staircase layout
        real = TENSORS["completion_mask"].bool()
        completion = input_ids[:, T + P:T + P + L]
        assert torch.equal(completion[real], self.noisy[:, n, P:][real]), "not SPG's noisy completion"
        assert bool((input_ids[:, T + P + L:] == MASK).all())  # the last block's tail
        logits = torch.zeros(B, T2, self.logits.shape[-1], dtype=self.logits.dtype)
        logits = torch.cat([logits[:, :T + P], self.logits[:, n, P:], logits[:, T + P + L:]], dim=1)
        return types.SimpleNamespace(logits=logits)


def spg_outputs(logits: torch.Tensor, noisy: torch.Tensor, batch: RolloutBatch) -> EstimatorOutput:
    masked = (noisy == MASK).transpose(0, 1)  # [C, B, T]
    est = SPGBounds(num_t=C, block_length=BLOCK, p_mask_prompt=S["p_mask_prompt"], beta_eubo=S["eubo_beta"])
    return est.score(FullAttentionLogits(logits), batch, masked[..., :P] & batch.prompt_mask[None], masked[..., P:])


def staircase_outputs(logits: torch.Tensor, noisy: torch.Tensor, batch: RolloutBatch) -> EstimatorOutput:
    masks = completion_masks(noisy)  # [C, B, L]
    real = batch.completion_mask[None]
    # the released EUBO weights each draw by its row's masked fraction; inject that rate
    rate = ((masks & real).sum(-1, keepdim=True) / real.sum(-1, keepdim=True)).expand(C, G, L)
    return Staircase(num_t=C, beta_eubo=S["eubo_beta"]).score(BlockLogits(logits, noisy), batch, masks, rate, BLOCK)


def released_form(score) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ddrl's StableDRL with the released settings: (loss, d loss / d logits, ELBO_old)."""
    batch = group_batch()
    with torch.no_grad():
        old = score(TENSORS["old_logits"], TENSORS["old_noisy"], batch).detach()
    leaf = TENSORS["logits"].clone().requires_grad_(True)
    new = score(leaf, TENSORS["noisy"], batch)
    objective = StableDRL(clip_ratio=S["ais_clip_iw"], omega=S["mix_weight"], variant=S["logp_estimation"])
    loss = objective(batch, new, old, None, counts=AggregationCounts.from_batch(batch)).loss
    loss.backward()
    return loss.detach().double(), leaf.grad, old.extras["elbo"].double()


def test_fixture_exercises_the_clip_and_both_signs():
    # some importance weights above C (clipped), advantages of both signs
    assert TENSORS["iw_max"] > S["ais_clip_iw"] and TENSORS["iw_mean"] > 1
    assert (TENSORS["advantages"] > 0).any() and (TENSORS["advantages"] < 0).any()


def test_stable_drl_reproduces_the_released_loss_and_gradient():
    loss, grad, old_elbo = released_form(spg_outputs)
    torch.testing.assert_close(old_elbo, TENSORS["ref_elbo"], atol=1e-6, rtol=0)
    torch.testing.assert_close(loss, TENSORS["loss"], atol=1e-6, rtol=0)
    torch.testing.assert_close(grad, TENSORS["grad"], atol=1e-6, rtol=0)
    assert TENSORS["grad"].abs().max() > 1e-3


def test_stable_drl_on_block_models_reproduces_the_released_form():
    loss, grad, old_elbo = released_form(staircase_outputs)
    torch.testing.assert_close(old_elbo, TENSORS["ref_elbo"], atol=1e-6, rtol=0)
    torch.testing.assert_close(loss, TENSORS["loss"], atol=1e-6, rtol=0)
    torch.testing.assert_close(grad, TENSORS["grad"], atol=1e-6, rtol=0)
