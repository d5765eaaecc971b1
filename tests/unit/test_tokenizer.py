"""SymbolTokenizer: id layout, longest match, decoding rules, batch encoding, persistence."""

from __future__ import annotations

import json

import pytest
import torch

from ddrl.models.tokenizer import SymbolTokenizer


def digits() -> SymbolTokenizer:
    return SymbolTokenizer(list("0123456789") + ["|", "<c3>", "<c"])


def test_specials_first_then_symbols_in_order():
    tok = digits()
    assert (tok.pad_token_id, tok.mask_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2, 3)
    assert tok.convert_tokens_to_ids(["<pad>", "<mask>", "<eos>", "<bos>"]) == [0, 1, 2, 3]
    # The digits form one contiguous id range starting right after the specials (uniform diffusion needs it).
    assert tok.convert_tokens_to_ids(list("0123456789")) == list(range(4, 14))
    assert tok.vocab_size == len(tok) == 4 + 13


def test_roundtrip():
    tok = digits()
    text = "12|34|<c3>9"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.batch_decode(torch.tensor([ids, ids])) == [text, text]


def test_greedy_longest_match():
    tok = digits()
    # "<c3>" is one symbol even though "<c" is a symbol too; "<c" then "9" when "<c9>" is not one.
    assert tok.encode("<c3>") == [tok.convert_tokens_to_ids("<c3>")]
    assert tok.encode("<c9") == tok.convert_tokens_to_ids(["<c", "9"])
    assert tok.encode("1<mask>2") == [5, tok.mask_token_id, 6]


def test_unknown_character_is_named():
    with pytest.raises(ValueError, match=r"'x' at position 2"):
        digits().encode("12x4")


def test_decode_stops_at_eos_and_skips_specials():
    tok = digits()
    ids = [tok.bos_token_id] + tok.encode("12") + [tok.mask_token_id, tok.eos_token_id] + tok.encode("99")
    assert tok.decode(ids) == "12"
    assert tok.decode(ids, stop_at_eos=False) == "1299"
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>12<mask>"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([999])


def test_call_left_pads_like_hugging_face():
    tok = digits()
    enc = tok(["12", "3"], padding=True, return_tensors="pt")
    assert enc["input_ids"].tolist() == [[5, 6], [tok.pad_token_id, 7]]
    assert enc["attention_mask"].tolist() == [[1, 1], [0, 1]]
    right = tok(["12", "3"], padding=True, padding_side="right")
    assert right["input_ids"] == [[5, 6], [7, tok.pad_token_id]]
    with pytest.raises(ValueError, match="padding=True"):
        tok(["12", "3"], return_tensors="pt")


def test_save_load_roundtrip(tmp_path):
    tok = digits()
    tok.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "tokenizer.json").read_text())["type"] == "ddrl_symbol"
    loaded = SymbolTokenizer.from_pretrained(tmp_path)
    assert loaded.get_vocab() == tok.get_vocab()
    assert loaded.encode("<c3>12") == tok.encode("<c3>12")


def test_load_rejects_other_formats(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE"}}))
    with pytest.raises(ValueError, match="not a ddrl symbol tokenizer"):
        SymbolTokenizer.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        SymbolTokenizer.from_pretrained(tmp_path / "nowhere")


def test_bad_construction():
    with pytest.raises(ValueError, match="appears twice"):
        SymbolTokenizer(["a", "b", "a"])
    with pytest.raises(ValueError, match="appears twice"):
        SymbolTokenizer(["<eos>", "a"])
    with pytest.raises(ValueError, match="exactly 4"):
        SymbolTokenizer(["a"], specials=("<pad>", "<mask>"))
