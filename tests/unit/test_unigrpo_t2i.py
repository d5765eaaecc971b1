"""UniGRPO's random_ratio estimator on MMaDA text-to-image completions: <|eoi|> after the image in
every scoring pass, as the maskgrpo estimator feeds it, row chunks included.

The tiny official-layout MMaDA with a MAGVIT-v2 decoder is test_mmada_t2i's. The reference log-probs
are computed here by hand: the model on [prompt, noised image, <|eoi|>], log_softmax, gather.
"""

from __future__ import annotations

import pytest
import torch

import ddrl
from ddrl.estimators import MaskGRPOEstimator, RandomRatio
from ddrl.types import RolloutBatch
from tests.unit.test_mmada_t2i import EOI, IPAD, N_TOKENIZER, SOI, write_magvit, write_tiny_mmada

COPIES, SEED = 3, 11


@pytest.fixture(scope="module")
def t2i_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("unigrpo_t2i")
    return ddrl.load_model(write_tiny_mmada(root / "mmada"), dtype="float32", vq_path=write_magvit(root / "magvit")).eval()


def image_batch(model) -> RolloutBatch:
    """Two t2i prompts ([iPAD]-left-padded, ending with <|soi|>) and 4-code image completions."""
    from ddrl.data import encode_prompts

    ids, mask = encode_prompts(model.tokenizer, ["a red cat", "dog"])
    assert (ids[~mask] == IPAD).all() and (ids[:, -1] == SOI).all()
    codes = torch.tensor([[8, 3, 60, 17], [0, 1, 2, 63]]) + N_TOKENIZER  # image tokens: len(tokenizer) + code
    return RolloutBatch(prompt_ids=ids, prompt_mask=mask, completion_ids=codes,
                        completion_mask=torch.ones_like(codes, dtype=torch.bool), group_ids=torch.tensor([0, 0]),
                        rewards=torch.tensor([0.3, 0.6]), advantages=torch.tensor([-1.0, 1.0]),
                        mask_seeds=torch.tensor([SEED]))


def recorded_rows(model, estimator, batch: RolloutBatch):
    """(estimator output, every row the model was called on as (input ids, attention mask))."""
    calls = []

    def record(_module, args, kwargs):
        calls.append((args[0].detach().clone(), kwargs["attention_mask"].detach().clone()))

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.no_grad():
            out = estimator(model, batch, SEED)
    finally:
        handle.remove()
    assert calls, "the estimator never called the model"
    return out, torch.cat([c[0] for c in calls]), torch.cat([c[1] for c in calls])


def test_random_ratio_feeds_eoi_after_the_image_as_maskgrpo_does(t2i_model):
    assert t2i_model.completion_suffix == (EOI,)
    batch = image_batch(t2i_model)
    P, L = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    _, mask_rows, mask_attn = recorded_rows(t2i_model, MaskGRPOEstimator(mode="uniform", gamma=0.8, num_iterations=1), batch)
    _, rr_rows, rr_attn = recorded_rows(t2i_model, RandomRatio(copies=COPIES), batch)
    chunk = batch.index(torch.arange(2))
    chunk.extras["copy_rows"] = torch.tensor([[False, True, False], [True, False, True]])  # 3 of the 6 rows
    _, chunk_rows, chunk_attn = recorded_rows(t2i_model, RandomRatio(copies=COPIES), chunk)
    assert rr_rows.shape == (COPIES * 2, P + L + 1) and chunk_rows.shape == (3, P + L + 1)
    for rows, attn in ((mask_rows, mask_attn), (rr_rows, rr_attn), (chunk_rows, chunk_attn)):
        assert rows.shape[1] == mask_rows.shape[1] == P + L + 1  # one layout: [prompt, image slots, <|eoi|>]
        assert (rows[:, -1] == EOI).all() and attn[:, P:].all()  # <|eoi|> attended after every image
        slots = rows[:, P:P + L]
        assert ((slots == t2i_model.mask_token_id) | (slots >= N_TOKENIZER)).all()
        prompts = {tuple(r.tolist()) for r in rows[:, :P]}
        assert prompts <= {tuple(r.tolist()) for r in batch.prompt_ids}  # the prompt as the sampler fed it
    torch.testing.assert_close(rr_attn[:2], mask_attn)  # the same attention over prompt, image and suffix


def test_random_ratio_image_log_probs_are_those_with_eoi(t2i_model):
    batch = image_batch(t2i_model)
    P, L = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    out, rows, attn = recorded_rows(t2i_model, RandomRatio(copies=COPIES), batch)
    noised = rows[:, P:P + L].view(COPIES, 2, L)
    full = torch.cat([batch.prompt_ids.repeat(COPIES, 1), noised.reshape(-1, L),
                      torch.full((COPIES * 2, 1), EOI)], dim=1)  # built here, not by ddrl.estimators.common
    att = torch.cat([batch.prompt_mask.repeat(COPIES, 1), torch.ones(COPIES * 2, L + 1, dtype=torch.bool)], dim=1)
    with torch.no_grad():
        logits = t2i_model(full, attention_mask=att).logits[:, P:P + L].float()
        without = t2i_model(full[:, :-1], attention_mask=att[:, :-1]).logits[:, P:].float()
    clean = batch.completion_ids.repeat(COPIES, 1)
    lp = torch.log_softmax(logits, -1).gather(-1, clean[..., None])[..., 0].view(COPIES, 2, L)
    masked = noised == t2i_model.mask_token_id
    assert masked.any() and (~masked).any()
    torch.testing.assert_close(out.extras["copy_mask"], masked)
    torch.testing.assert_close(out.extras["copy_token_logp"], lp * masked, atol=1e-5, rtol=1e-5)
    lp_without = torch.log_softmax(without, -1).gather(-1, clean[..., None])[..., 0].view(COPIES, 2, L)
    assert ((lp_without - lp) * masked).abs().max() > 1e-3  # the suffix matters: dropping it would fail here
