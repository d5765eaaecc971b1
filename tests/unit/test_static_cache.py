"""Static shapes in the semi-autoregressive samplers (ddrl.sampling.masked / ddrl.sampling.cache).

What must hold, for every cache strategy:
  * with early exit and threshold decoding (rows finish, and rows sit steps out), every model call
    of a generation is fed the same number of rows: finished rows are masked, not removed;
  * the past handed to the model is a view of one preallocated buffer per layer: the same storage
    for every call of the generation, across steps and blocks;
  * a row's tokens, commit steps and recorded probabilities up to its first EOS are those of the
    run without early exit.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddrl.config import SamplerConfig
from ddrl.models import Denoiser, DenoiserConfig, DiffusionLM
from ddrl.sampling.masked import sample_block, sample_masked

V, MASK, PAD, EOS = 24, 23, 0, 1
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13], [14, 15, 16, 17, 18, 19]]  # left padding of 3, 1, 5, 0
SETTINGS = [(None, "none"), (None, "prefix"), (None, "dual"), (4, "none"), (4, "auto")]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Watcher(nn.Module):
    """A built-in model with +bonus on EOS (rows finish at different blocks) that records, per call,
    the rows fed and the storage of the past it was given (None when no past)."""

    def __init__(self, block_size: int | None, bonus: float = 0.5, shifted: bool = False):
        super().__init__()
        backbone = Denoiser(DenoiserConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=2, max_seq_len=96,
                                           block_size=block_size, init_std=0.02), seed=4)
        self.model = DiffusionLM(backbone, mask_token_id=MASK, pad_token_id=PAD, eos_token_id=EOS, vocab_size=V,
                                 block_size=block_size, logits_shifted=shifted, suppress_mask_logit=True).eval()
        self.bonus = bonus
        self.rows: list[int] = []
        self.storages: list[list[tuple[int, int]] | None] = []  # per call, per layer (k, v) storage pointers
        self.past_lengths: list[int] = []
        for name in ("vocab_size", "mask_token_id", "eos_token_id", "pad_token_id", "block_size", "logits_shifted"):
            setattr(self, name, getattr(self.model, name))

    def forward(self, input_ids, attention_mask=None, past_key_values=None, **kwargs):
        self.rows.append(input_ids.shape[0])
        if past_key_values is None:
            self.storages.append(None)
        else:
            self.storages.append([(k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr())
                                  for k, v in past_key_values])
            self.past_lengths.append(past_key_values[0][0].shape[2])
        out = self.model(input_ids, attention_mask=attention_mask, past_key_values=past_key_values, **kwargs)
        logits = out.logits.clone()
        logits[..., EOS] += self.bonus
        return type(out)(logits=logits, past_key_values=out.past_key_values)


def left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[False] * (P - len(p)) + [True] * len(p) for p in prompts])
    return ids, mask


def run(model: Watcher, cache: str, early_exit: bool, threshold: float | None = 0.3, cfg_scale: float = 0.5):
    ids, mask = left_pad(PROMPTS)
    cfg = SamplerConfig(steps=24, gen_length=24, block_length=4, temperature=1.0, cache=cache, early_exit=early_exit,
                        cfg_scale=cfg_scale, threshold=threshold)
    fn = sample_block if model.block_size else sample_masked
    return fn(model, ids, mask, cfg, generator=torch.Generator().manual_seed(7), return_trajectory=True)


@pytest.mark.parametrize("block_size,cache", SETTINGS)
@pytest.mark.parametrize("threshold", [None, 0.3])
def test_every_call_sees_the_whole_batch(block_size, cache, threshold):
    model = Watcher(block_size)
    out = run(model, cache, early_exit=True, threshold=threshold)
    filled = out.trajectory.commit_step == -1  # positions filled with EOS by early exit
    assert filled.any(dim=1).sum() >= 2 and not filled.all(dim=1).all()  # rows do finish, at different blocks
    assert model.rows == [2 * len(PROMPTS)] * out.nfe  # guided: cond + uncond rows, every call


@pytest.mark.parametrize("block_size,cache", [s for s in SETTINGS if s[1] != "none"])
def test_the_past_is_a_view_of_one_preallocated_buffer(block_size, cache):
    model = Watcher(block_size)
    out = run(model, cache, early_exit=True)
    pasts = [s for s in model.storages if s is not None]
    assert len(pasts) >= out.nfe // 2  # most calls read the cache
    assert all(s == pasts[0] for s in pasts)  # one storage per layer, for every step of every block
    assert len({k for k, _ in pasts[0]} | {v for _, v in pasts[0]}) == 2 * len(pasts[0])  # distinct per layer
    if cache != "dual":  # prefix / exact: the past grows block by block inside the same storage
        assert len(set(model.past_lengths)) > 1
    else:  # dual: prefix + suffix, the same length for every block
        assert len(set(model.past_lengths)) == 1


@pytest.mark.parametrize("block_size,cache", SETTINGS)
@pytest.mark.parametrize("shifted", [False, True])
def test_early_exit_keeps_each_row_up_to_its_first_eos(block_size, cache, shifted):
    fast = run(Watcher(block_size, shifted=shifted), cache, early_exit=True)
    slow = run(Watcher(block_size, shifted=shifted), cache, early_exit=False)
    assert fast.nfe <= slow.nfe
    finished = 0
    for r in range(len(PROMPTS)):
        row = fast.completion_ids[r].tolist()
        n = row.index(EOS) + 1 if EOS in row else len(row)
        finished += n < len(row)
        assert torch.equal(fast.completion_ids[r, :n], slow.completion_ids[r, :n]), f"row {r}"
        assert torch.equal(fast.trajectory.commit_step[r, :n], slow.trajectory.commit_step[r, :n]), f"row {r}"
        # Same shapes in both runs, so the same arithmetic: the recorded probabilities agree exactly.
        torch.testing.assert_close(fast.trajectory.token_probs[r, :, :n], slow.trajectory.token_probs[r, :fast.nfe, :n],
                                   atol=0, rtol=0, equal_nan=True)
    filled = fast.trajectory.commit_step == -1  # the blocks after the one holding the first EOS
    assert finished >= 2 and filled.any() and fast.completion_ids[filled].eq(EOS).all()
