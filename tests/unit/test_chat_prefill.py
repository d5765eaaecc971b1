"""ChatPrompt encoding: system turn + user turn + generation prompt + assistant pre-fill, through real chat templates.

The oracle is transformers' own rendering of each family's chat template (the fixture tokenizers carry
LLaDA's, Dream's and SDAR's templates): apply_chat_template(..., add_generation_prompt=True) followed
by the pre-fill's tokens, and d1's construction, tokenizer(rendered + "<reasoning>") (eval/gsm8k.py
create_prompt + collate_fn, dllm-reasoning/d1@837888f).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ddrl.data import encode_prompts
from ddrl.models.hf_tokenizer import HFTokenizer, load_tokenizer
from ddrl.models.tokenizer import SymbolTokenizer
from ddrl.tasks.base import ChatPrompt

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
FAMILIES = ("llada", "dream", "sdar")
USER = "What is 2 + 3? Answer with a number."
SYSTEM = "Be brief."
PREFILL = {"llada": "<reasoning>", "dream": "Let me think", "sdar": "<reasoning>"}  # Dream's tiny vocab has no '<'


def _hf(family: str):
    return load_tokenizer(FIXTURES / family / "model", native=True)


def _template_ids(hf, messages: list[dict]) -> list[int]:
    out = hf.apply_chat_template(messages, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("system", [None, SYSTEM])
def test_chat_prompt_is_the_template_then_the_prefill(family, system):
    hf = _hf(family)
    tok = HFTokenizer(hf)
    prefill = PREFILL[family]
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": USER}]
    expected = _template_ids(hf, messages) + hf(prefill, add_special_tokens=False)["input_ids"]
    got = tok.encode_prompt(ChatPrompt(user=USER, system=system, prefill=prefill))
    assert got == expected
    assert got[-len(hf(prefill, add_special_tokens=False)["input_ids"]):] == hf(prefill, add_special_tokens=False)["input_ids"]
    if system:
        assert SYSTEM in hf.decode(got)
    # a str prompt and a ChatPrompt of one user message encode alike, as before ChatPrompt existed
    assert tok.encode_prompt(USER) == tok.encode_prompt(ChatPrompt(user=USER)) == _template_ids(
        hf, [{"role": "user", "content": USER}])


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_matches_d1s_construction(family):
    """d1: tokenizer(apply_chat_template(messages, add_generation_prompt=True, tokenize=False) + "<reasoning>")."""
    hf = _hf(family)
    rendered = hf.apply_chat_template([{"role": "user", "content": USER}], add_generation_prompt=True, tokenize=False)
    prefill = PREFILL[family]
    got = HFTokenizer(hf).encode_prompt(ChatPrompt(user=USER, prefill=prefill))
    assert got == hf(rendered + prefill)["input_ids"]


def test_encode_prompts_left_pads_chat_prompts_and_strings_together():
    import ddrl

    model = ddrl.load_model(str(FIXTURES / "llada" / "model"))
    hf = model.tokenizer.tokenizer
    prompts = [ChatPrompt(user=USER, system=SYSTEM, prefill="<reasoning>"), "hi"]
    ids, mask = encode_prompts(model.tokenizer, prompts)
    first = _template_ids(hf, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]) + \
        hf("<reasoning>", add_special_tokens=False)["input_ids"]
    second = _template_ids(hf, [{"role": "user", "content": "hi"}])
    assert ids.shape[1] == len(first) and ids[0].tolist() == first
    assert ids[1, -len(second):].tolist() == second and int(mask[1].sum()) == len(second)
    assert not mask[1, : len(first) - len(second)].any()


def test_a_template_without_a_system_role_is_a_clear_error():
    hf = _hf("dream")
    hf.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                        "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}<|im_start|>assistant\n")
    tok = HFTokenizer(hf)
    with pytest.raises(ValueError, match="system message.*user message"):
        tok.encode_prompt(ChatPrompt(user=USER, system=SYSTEM))
    assert tok.encode_prompt(ChatPrompt(user=USER, prefill="ok"))  # the rest still works

    hf.chat_template = "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"
    with pytest.raises(ValueError, match="drops the system message"):
        HFTokenizer(hf).encode_prompt(ChatPrompt(user=USER, system=SYSTEM))


def test_without_a_template_the_prefill_continues_the_text_and_a_system_message_is_an_error():
    hf = _hf("llada")
    hf.chat_template = None
    tok = HFTokenizer(hf)
    assert tok.encode_prompt(ChatPrompt(user="2 + 3 =", prefill=" 5")) == [tok.bos_token_id] + tok.encode("2 + 3 = 5")
    with pytest.raises(ValueError, match="no chat template"):
        tok.encode_prompt(ChatPrompt(user=USER, system=SYSTEM))


def test_symbol_tokenizer_refuses_system_and_prefill():
    tok = SymbolTokenizer(list("1234."))
    with pytest.raises(ValueError, match="no chat template.*system"):
        encode_prompts(tok, [ChatPrompt(user="1.3.", system="solve")])
    with pytest.raises(ValueError, match="pre-fill"):
        encode_prompts(tok, [ChatPrompt(user="1.3.", prefill="2")])
    ids, _ = encode_prompts(tok, [ChatPrompt(user="1.3.")])
    assert ids.tolist() == encode_prompts(tok, ["1.3."])[0].tolist()
    with pytest.raises(TypeError, match="str or a ddrl.tasks.base.ChatPrompt"):
        encode_prompts(tok, [42])
