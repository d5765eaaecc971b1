import pytest
import torch

from ddrl.data import (completion_mask, encode_completions, encode_prompts, prompt_budget, tokenize_prompts,
                       truncate_prompts)


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


def test_prompt_too_long_is_a_clear_error_that_names_max_prompt_length():
    with pytest.raises(ValueError, match="at most 2 prompt tokens.*max_prompt_length=2 "
                                         r"\(rollout.max_prompt_length .*--max-prompt-length"):
        encode_prompts(Tok(), ["1234"], max_length=2)


def test_max_prompt_length_keeps_the_last_tokens_as_trl_does():
    """TRL/d1: prompt_ids[:, -N:] of the left-padded batch; the same as cutting each row to its last N."""
    prompts = ["12345", "12", "1234"]  # 6, 3 and 5 tokens with BOS
    full, full_mask = encode_prompts(Tok(), prompts)
    ids, mask = encode_prompts(Tok(), prompts, max_prompt_length=4, max_length=4)  # fits once cut
    assert torch.equal(ids, full[:, -4:]) and torch.equal(mask, full_mask[:, -4:])
    assert ids.tolist() == [[12, 13, 14, 15], [0, 3, 11, 12], [11, 12, 13, 14]]
    rows, cut = truncate_prompts(tokenize_prompts(Tok(), prompts), 4)
    assert cut == 2 and rows[1] == [3, 11, 12]  # a short prompt keeps its BOS
    assert truncate_prompts(tokenize_prompts(Tok(), prompts), None)[1] == 0


def test_prompt_budget_refuses_a_cut_the_model_cannot_hold():
    class Model:
        max_seq_len = 10

    class Sampler:
        gen_length, max_prompt_length = 6, 5

    with pytest.raises(ValueError, match="rollout.max_prompt_length=5 does not fit.*leaves 4.*at most 4"):
        prompt_budget(Model(), Sampler())
    Sampler.max_prompt_length = 4
    assert prompt_budget(Model(), Sampler()) == 4
    assert prompt_budget(object(), Sampler()) is None  # a model that states no limit


def test_completions_eos_padded_and_fixed_length_without_eos():
    ids = encode_completions(Tok(), ["12", "1234"], gen_length=4)
    assert ids.tolist() == [[11, 12, 2, 2], [11, 12, 13, 14]]
    with pytest.raises(ValueError, match="raise sampler.gen_length"):
        encode_completions(Tok(), ["12345"], gen_length=4)


def test_completion_mask_includes_first_eos_only():
    ids = torch.tensor([[5, 2, 2, 7], [5, 6, 7, 8]])
    assert completion_mask(ids, 2).tolist() == [[True, True, False, False], [True, True, True, True]]
