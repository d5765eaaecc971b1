"""Stop tokens: one source (DiffusionLM.stop_token_ids) for early exit, completion masks and decoding.

A chat checkpoint ends a turn with a token that is not config.json's EOS: the SDAR fixture's
config.json and tokenizer name <|endoftext|> (101), its generation_config.json lists
eos_token_id [<|im_end|> (103), <|endoftext|> (101)]. The loader reads that list; the samplers stop a
row at <|im_end|>; the completion mask and the decoded text used for rewards end there. Models
with a single EOS (the built-in ones, LLaDA's fixture) keep (eos,) and behave as before.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import ddrl
from ddrl.config import SamplerConfig
from ddrl.data import completion_mask, decode_completions, model_stop_ids
from ddrl.models import Denoiser, DenoiserConfig, DiffusionLM
from ddrl.models.io import ModelDirectoryError
from ddrl.models.tokenizer import SymbolTokenizer
from ddrl.sampling.masked import sample_block, sample_masked
from tests.toy_models import Output, ToyDiffusionLM

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SDAR = FIXTURES / "sdar" / "model"
ENDOFTEXT, IM_END = 101, 103  # the SDAR fixture's <|endoftext|> (EOS) and <|im_end|> (end of turn)


def _needs(directory: Path) -> None:
    # The fixtures are committed data: a missing one is a failure, never a skip.
    assert (directory / "config.json").is_file(), f"no fixture at {directory}; run tests/fixtures/make_<family>.py"


@pytest.fixture(scope="module")
def sdar():
    _needs(SDAR)
    return ddrl.load_model(SDAR, dtype=torch.float32).eval()


# --------------------------------------------------------------------------------------------
# Where the ids come from
# --------------------------------------------------------------------------------------------


def test_sdar_stop_ids_come_from_generation_config(sdar):
    assert sdar.eos_token_id == ENDOFTEXT
    assert sdar.stop_token_ids == (ENDOFTEXT, IM_END)  # the tokenizer's EOS first
    assert model_stop_ids(sdar) == (ENDOFTEXT, IM_END)
    assert sdar.tokenizer.tokenizer.convert_ids_to_tokens(IM_END) == "<|im_end|>"


def test_sdar_stop_ids_survive_save_and_reload(sdar, tmp_path):
    sdar.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())["ddrl"]
    assert saved["stop_token_ids"] == [ENDOFTEXT, IM_END]
    (tmp_path / "saved" / "generation_config.json").unlink(missing_ok=True)  # the "ddrl" section alone restores them
    assert ddrl.load_model(tmp_path / "saved").stop_token_ids == (ENDOFTEXT, IM_END)


def test_a_directory_without_generation_config_stops_at_eos_only(tmp_path):
    _needs(SDAR)
    directory = tmp_path / "sdar"
    shutil.copytree(SDAR, directory)
    (directory / "generation_config.json").unlink()
    assert ddrl.load_model(directory).stop_token_ids == (ENDOFTEXT,)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": IM_END}))  # an int, not a list
    assert ddrl.load_model(directory).stop_token_ids == (ENDOFTEXT, IM_END)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": "<|im_end|>"}))
    with pytest.raises(ModelDirectoryError, match="eos_token_id"):
        ddrl.load_model(directory)


@pytest.mark.parametrize("family", ["llada", "dream", "mmada"])
def test_single_eos_families_keep_one_stop_id(family):
    directory = FIXTURES / family / "model"
    _needs(directory)
    model = ddrl.load_model(directory)
    assert model.eos_token_id is not None and model.stop_token_ids == (model.eos_token_id,)


def _builtin(**kwargs) -> DiffusionLM:
    tokenizer = SymbolTokenizer(list("abcdefgh"))
    backbone = Denoiser(DenoiserConfig(vocab_size=len(tokenizer), d_model=16, n_layers=1, n_heads=2, max_seq_len=32),
                        seed=0)
    return DiffusionLM(backbone, tokenizer, suppress_mask_logit=True, **kwargs)


def test_builtin_model_defaults_and_round_trip(tmp_path):
    plain = _builtin()
    assert plain.stop_token_ids == (plain.eos_token_id,) == (2,)
    chat = _builtin(stop_token_ids=[7, 2, 7])  # EOS always first, duplicates dropped
    assert chat.stop_token_ids == (2, 7)
    chat.save_pretrained(tmp_path / "chat")
    assert DiffusionLM.from_pretrained(tmp_path / "chat").stop_token_ids == (2, 7)
    # A directory saved before stop_token_ids existed (no key in its "ddrl" section) gets (eos,).
    plain.save_pretrained(tmp_path / "old")
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    del config["ddrl"]["stop_token_ids"]
    (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    assert DiffusionLM.from_pretrained(tmp_path / "old").stop_token_ids == (2,)
    backbone = Denoiser(DenoiserConfig(vocab_size=8, d_model=16, n_layers=1, n_heads=2, max_seq_len=32), seed=0)
    assert DiffusionLM(backbone, mask_token_id=1).stop_token_ids == ()  # no EOS, no stop ids


# --------------------------------------------------------------------------------------------
# Completion mask and decoded text (what rewards and the estimators see)
# --------------------------------------------------------------------------------------------


def test_completion_mask_ends_at_the_first_stop_id():
    ids = torch.tensor([[5, 7, 2, 6], [5, 6, 2, 7], [5, 6, 8, 9]])
    assert completion_mask(ids, (2, 7)).tolist() == [[True, True, False, False], [True, True, True, False],
                                                     [True, True, True, True]]
    # One id, given as an int or a 1-tuple, is today's EOS mask (the stop token itself included).
    assert completion_mask(ids, 2).tolist() == completion_mask(ids, (2,)).tolist() == [
        [True, True, True, False], [True, True, True, False], [True, True, True, True]]
    assert completion_mask(ids, ()).all() and completion_mask(ids, None).all()


def test_decoded_text_ends_before_the_first_stop_id(sdar):
    tok = sdar.tokenizer
    hello, world = tok.encode("hello"), tok.encode(" world")
    row = hello + [IM_END] + world + [ENDOFTEXT] * 2
    ids = torch.tensor([row, hello + world + [ENDOFTEXT] * (len(row) - len(hello + world))])
    assert decode_completions(tok, ids, model_stop_ids(sdar)) == ["hello", "hello world"]
    assert decode_completions(tok, ids) == [tok.decode(hello + [IM_END] + world), "hello world"]  # EOS only
    mask = completion_mask(ids, model_stop_ids(sdar))
    assert mask.sum(1).tolist() == [len(hello) + 1, len(hello + world) + 1]  # up to and including the stop token


# --------------------------------------------------------------------------------------------
# Early exit
# --------------------------------------------------------------------------------------------

MASK, PAD, EOS, END_OF_TURN = 11, 0, 1, 9
PROMPTS = torch.tensor([[2, 3, 4], [5, 6, 7]])


class TurnEnder:
    """The toy model, with a bonus on END_OF_TURN in rows whose prompt holds 2 (row 0); stop ids as given.
    With this bonus and temperature 0 row 0 writes END_OF_TURN first at position 8 (block 3 of 4)."""

    def __init__(self, stop_token_ids: tuple[int, ...], bonus: float = 2.0):
        self.model = ToyDiffusionLM(vocab_size=12, mask_token_id=MASK, pad_token_id=PAD, eos_token_id=EOS,
                                    seed=0).eval()
        self.stop_token_ids, self.bonus = stop_token_ids, bonus
        for name in ("vocab_size", "mask_token_id", "eos_token_id", "pad_token_id", "process", "block_size"):
            setattr(self, name, getattr(self.model, name))

    def __call__(self, x, attention_mask=None):
        logits = self.model(x, attention_mask).logits.clone()
        logits[(x == 2).any(1), :, END_OF_TURN] += self.bonus
        return Output(logits=logits)


def _sample(prompts: torch.Tensor, stops: tuple[int, ...], early_exit: bool):
    cfg = SamplerConfig(steps=12, gen_length=12, block_length=3, temperature=0.0, early_exit=early_exit)
    return sample_masked(TurnEnder(stops), prompts, None, cfg, generator=None)


def test_early_exit_stops_a_row_at_an_extra_stop_id():
    chat = (EOS, END_OF_TURN)
    fast, slow = _sample(PROMPTS[:1], chat, True), _sample(PROMPTS[:1], chat, False)
    a, b = fast.completion_ids[0].tolist(), slow.completion_ids[0].tolist()
    first = b.index(END_OF_TURN)
    assert first == 8 and EOS not in b[:first]  # the row ends its turn inside block 3 of 4
    assert a[:9] == b[:9] and a[9:] == [EOS] * 3  # then the last block is EOS-filled, as after an EOS
    assert (fast.nfe, slow.nfe) == (9, 12)  # and never computed
    # With EOS as the only stop id (today's behaviour) the row runs on past END_OF_TURN.
    eos_only = _sample(PROMPTS[:1], (EOS,), True)
    assert eos_only.completion_ids.tolist() == slow.completion_ids.tolist() and eos_only.nfe == 12
    assert completion_mask(fast.completion_ids, chat)[0].tolist() == [True] * (first + 1) + [False] * (11 - first)


def test_early_exit_leaves_the_other_rows_alone():
    chat = (EOS, END_OF_TURN)
    fast, slow = _sample(PROMPTS, chat, True), _sample(PROMPTS, chat, False)
    mask = completion_mask(slow.completion_ids, chat)
    assert torch.equal(fast.completion_ids[mask], slow.completion_ids[mask])  # same tokens up to each first stop
    assert fast.completion_ids[0, 9:].tolist() == [EOS] * 3


def test_block_sampler_stops_sdar_at_im_end(sdar):
    """The SDAR fixture, nudged towards <|im_end|> at one position: the block sampler's early exit
    fills the blocks after the one holding it with <|endoftext|>; mask and text end there."""

    class Nudged(torch.nn.Module):
        def __init__(self, inner: DiffusionLM, at: int):
            super().__init__()
            self.inner, self.at = inner, at

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self.inner, name)

        def forward(self, input_ids, *args, **kwargs):
            out = self.inner(input_ids, *args, **kwargs)
            assert out.logits.shape[1] == input_ids.shape[1]  # every position (rollout.cache=none)
            out.logits = out.logits.clone()
            out.logits[:, self.at, IM_END] += 50.0
            return out

    ids = torch.tensor([sdar.tokenizer.encode_prompt("hi")])  # [1, P]
    P, block = ids.shape[1], sdar.block_size
    runs = {}
    for early_exit in (True, False):
        cfg = SamplerConfig(name="block", steps=3 * block, gen_length=3 * block, temperature=0.0, cache="none",
                            early_exit=early_exit)
        runs[early_exit] = sample_block(Nudged(sdar, P + 5), ids, torch.ones_like(ids, dtype=torch.bool), cfg,
                                        generator=None)
    fast, slow = runs[True], runs[False]
    a, b = fast.completion_ids[0].tolist(), slow.completion_ids[0].tolist()
    first = next(j for j, t in enumerate(b) if t in (ENDOFTEXT, IM_END))
    assert b[first] == IM_END
    block_end = ((P + first) // block + 1) * block - P  # SDAR's layout counts blocks from position 0
    assert block_end < len(a) and a[:block_end] == b[:block_end] and set(a[block_end:]) == {ENDOFTEXT}
    assert fast.nfe < slow.nfe
    assert completion_mask(fast.completion_ids, model_stop_ids(sdar))[0].sum() == first + 1
    assert decode_completions(sdar.tokenizer, fast.completion_ids, model_stop_ids(sdar)) == [
        sdar.tokenizer.decode(a[:first])]
