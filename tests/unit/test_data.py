import pytest
import torch

from ddrl.data import completion_mask, encode_completions, encode_prompts


class Tok:
    pad_token_id, eos_token_id, bos_token_id = 0, 2, 3

    def encode(self, text):
        return [10 + int(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(i - 10) for i in ids if i >= 10)


def test_prompts_are_left_padded_with_bos():
    ids, mask = encode_prompts(Tok(), ["12", "3"])
    assert ids.tolist() == [[3, 11, 12], [0, 3, 13]]
    assert mask.tolist() == [[True, True, True], [False, True, True]]


def test_prompt_too_long_is_a_clear_error():
    with pytest.raises(ValueError, match="at most 2 prompt tokens"):
        encode_prompts(Tok(), ["1234"], max_length=2)


def test_completions_eos_padded_and_fixed_length_without_eos():
    ids = encode_completions(Tok(), ["12", "1234"], gen_length=4)
    assert ids.tolist() == [[11, 12, 2, 2], [11, 12, 13, 14]]
    with pytest.raises(ValueError, match="raise sampler.gen_length"):
        encode_completions(Tok(), ["12345"], gen_length=4)


def test_completion_mask_includes_first_eos_only():
    ids = torch.tensor([[5, 2, 2, 7], [5, 6, 7, 8]])
    assert completion_mask(ids, 2).tolist() == [[True, True, False, False], [True, True, True, True]]
