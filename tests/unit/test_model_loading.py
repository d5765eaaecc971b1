"""The loader for native families (LLaDA, MMaDA, Dream, SDAR/TraDo): routing, family facts, no remote
code, tokenizers without remote code, the KV cache, and each bad input failing before compute.

The family modules in ddrl.models.native are checked against their authors' code elsewhere (golden
fixtures). Here a tiny stand-in backbone, written to the contract of ddrl.models.native.base, is
registered under a test-only family name ("standin") whose facts are copied from a real family, so
the loader's behaviour per family is tested without the real architectures. Every stand-in
directory also ships modeling and tokenizer code that raises when imported: loading one proves
that no code from the directory ran.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ddrl.models import load_model
from ddrl.models.families import FAMILIES
from ddrl.models.io import ModelDirectoryError
from ddrl.models.native.base import (NATIVE_FAMILIES, BackboneOutput, attention_inputs, check_past, check_weight_names,
                                     finish_mask, read_config, read_weights, write_weights)

FAMILY = "standin"
RAISES = "raise RuntimeError('code from the checkpoint directory ran')\n"


class StandInBlock(nn.Module):
    """LLaDA's block names: q_proj, k_proj, v_proj, attn_out, ff_proj (gate), up_proj, ff_out (down)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.attn_norm, self.ff_norm = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.attn_out = nn.Linear(d, d, bias=False)
        self.ff_proj, self.up_proj = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False)
        self.ff_out = nn.Linear(2 * d, d, bias=False)

    def forward(self, x, mask, past):  # x [B, T, D]; mask [B, 1, T, T_keys] bool
        B, T, D = x.shape
        split = lambda t: t.view(B, -1, self.heads, D // self.heads).transpose(1, 2)  # noqa: E731
        h = self.attn_norm(x)
        k, v = split(self.k_proj(h)), split(self.v_proj(h))
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        a = F.scaled_dot_product_attention(split(self.q_proj(h)), k, v, attn_mask=mask)
        x = x + self.attn_out(a.transpose(1, 2).reshape(B, T, D))
        h = self.ff_norm(x)
        return x + self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h)), (k, v)


class StandIn(nn.Module):
    """A native backbone by ddrl.models.native.base's contract, with LLaDA's module tree
    (model.transformer.{wte, wpe, blocks, ln_f, ff_out}); `lm_head` is a method, as the contract
    allows. config.json's oracle_scale adds oracle_scale * onehot(4 + (position + oracle_shift) % 5)
    to the logits, so a "Dream" stand-in predicts the token of the NEXT position."""

    calls = 0  # forward calls, to see that a padded batch is one call

    def __init__(self, config: dict):
        super().__init__()
        self.config_dict = config
        V, D, L = config["vocab_size"], config["hidden_size"], config["num_layers"]
        self.model = nn.Module()
        self.model.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(V, D), wpe=nn.Embedding(64, D), ln_f=nn.LayerNorm(D), ff_out=nn.Linear(D, V, bias=False),
            blocks=nn.ModuleList(StandInBlock(D, config["num_heads"]) for _ in range(L))))

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.transformer.blocks

    def lm_head(self, hidden):
        return self.model.transformer.ff_out(hidden)

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                logits_to_keep=None):
        type(self).calls += 1
        B, T = input_ids.shape
        past_len = check_past(past_key_values, len(self.layers), B)
        explicit, valid, positions = attention_inputs(attention_mask, position_ids, B, T, past_len, input_ids.device)
        if explicit is None and valid is not None:
            explicit = valid[:, None, None, :].expand(B, 1, T, past_len + T)
        mask = finish_mask(explicit)
        t = self.model.transformer
        x = t.wte(input_ids) + t.wpe(positions)
        cache = []
        for i, block in enumerate(self.layers):
            x, kv = block(x, mask, past_key_values[i] if past_len else None)
            cache.append(kv)
        hidden = t.ln_f(x)
        logits = self.lm_head(hidden)
        c = self.config_dict
        if c.get("oracle_scale"):
            target = 4 + (positions + c.get("oracle_shift", 0)) % 5
            logits = logits + c["oracle_scale"] * F.one_hot(target, c["vocab_size"]).to(logits.dtype)
        return BackboneOutput(logits=logits, past_key_values=cache if use_cache else None, hidden_states=hidden)

    @classmethod
    def from_pretrained(cls, directory, *, device=None, dtype=None):
        directory = Path(directory)
        config = read_config(directory)
        model = cls(config)
        state = read_weights(directory)
        check_weight_names(directory, FAMILY, set(state), set(model.state_dict()))
        model.load_state_dict(state)
        return model.to(device=device, dtype=dtype)

    def save_pretrained(self, directory, state_dict=None):
        directory = Path(directory)
        (directory / "config.json").write_text(json.dumps(self.config_dict))
        write_weights(directory, self.state_dict() if state_dict is None else state_dict)


NATIVE_FAMILIES.register(FAMILY, StandIn)


@pytest.fixture
def facts_of(monkeypatch):
    """facts_of("dream"): the stand-in family gets that family's facts (its module import skipped)."""

    def use(family: str) -> None:
        monkeypatch.setitem(FAMILIES, FAMILY, dataclasses.replace(FAMILIES[family], native_module=None))

    return use


def write_llama_tokenizer(directory: Path, vocab_size: int) -> None:
    """tokenizer.json + tokenizer_config.json whose auto_map names code that raises (LLaDA / SDAR layout)."""
    from tests.unit.test_hf_models import write_tokenizer

    write_tokenizer(directory, vocab_size)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.update(auto_map={"AutoTokenizer": ["tokenization_standin.StandInTokenizer", None]},
                  tokenizer_class="StandInTokenizer")
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "tokenization_standin.py").write_text(RAISES)


DREAM_TOKENS = ["a", "b", "c", "Ġ", "ab", "Ġa", "Ġab"]  # ids 0..6, byte-level BPE
DREAM_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|beginoftext|>", "<|mask|>"]  # ids 7..11


def write_dream_tokenizer(directory: Path) -> int:
    """Dream's layout: vocab.json + merges.txt + tokenizer_config.json naming DreamTokenizer in auto_map
    (no tokenizer.json). Returns the tokenizer's length."""
    (directory / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(DREAM_TOKENS)}))
    (directory / "merges.txt").write_text("#version: 0.2\na b\nĠ a\nĠa b\n")
    added = {str(len(DREAM_TOKENS) + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True} for i, t in enumerate(DREAM_SPECIALS)}
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": added, "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]}, "tokenizer_class": "DreamTokenizer",
        "bos_token": "<|beginoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "mask_token": "<|mask|>", "unk_token": None, "model_max_length": 4096,
        "chat_template": "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>{% endif %}"}))
    (directory / "tokenization_dream.py").write_text(RAISES)
    return len(DREAM_TOKENS) + len(DREAM_SPECIALS)


def write_standin(directory: Path, *, vocab_size: int = 32, hidden: int = 16, layers: int = 2, seed: int = 0,
                  tokenizer: str | None = "llama", **config) -> Path:
    """A stand-in checkpoint directory: config.json (with an auto_map that must never be used), weights, tokenizer."""
    directory.mkdir(parents=True, exist_ok=True)
    cfg = {"model_type": FAMILY, "architectures": ["StandInModelLM"], "vocab_size": vocab_size, "hidden_size": hidden,
           "num_layers": layers, "num_heads": 2, "auto_map": {"AutoModel": "modeling_standin.StandInModelLM"}, **config}
    model = StandIn(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    model.save_pretrained(directory)
    (directory / "modeling_standin.py").write_text(RAISES)
    if tokenizer == "llama":
        write_llama_tokenizer(directory, vocab_size)
    elif tokenizer == "dream":
        write_dream_tokenizer(directory)
    return directory


def padded_batch(rows: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    from tests.unit.test_hf_models import padded_batch as pb

    return pb(rows, pad)


# --------------------------------------------------------------------------------------------
# Routing: native families never run code from the directory
# --------------------------------------------------------------------------------------------


def test_a_real_llada_directory_is_built_natively_without_remote_code(tmp_path, monkeypatch):
    """config.json as LLaDA-8B ships it (model_type llada, auto_map to modeling_llada.py): the loader
    asks NATIVE_FAMILIES for "llada" (here the stand-in) with trust_remote_code off, and LLaDA's
    mask id rule applies (126336, no mask id in config.json)."""
    from ddrl.models.hf import HFDiffusionLM, HFTokenizer

    monkeypatch.setitem(NATIVE_FAMILIES._items, "llada", StandIn)
    monkeypatch.setitem(FAMILIES, "llada", dataclasses.replace(FAMILIES["llada"], native_module=None))
    d = write_standin(tmp_path / "llada", vocab_size=126464, hidden=4, layers=1, tokenizer=None,
                      model_type="llada", architectures=["LLaDAModelLM"],
                      auto_map={"AutoConfig": "configuration_llada.LLaDAConfig",
                                "AutoModel": "modeling_llada.LLaDAModelLM"})
    (d / "modeling_llada.py").write_text(RAISES)
    (d / "configuration_llada.py").write_text(RAISES)
    write_llama_tokenizer(d, 16)
    model = load_model(d)
    assert isinstance(model, HFDiffusionLM) and isinstance(model.model, StandIn)
    assert isinstance(model.tokenizer, HFTokenizer) and model.tokenizer.mask_token_id == 126336
    assert (model.family, model.mask_token_id, model.attention, model.block_size) == ("llada", 126336, "native", None)
    assert model.process_spec == {"name": "masked", "mask_token_id": 126336}
    assert model.logits_range == (0, 16)  # the vocabulary is padded past this tokenizer: sample its ids only
    assert model(torch.tensor([[5, 6, 7]])).logits.shape == (1, 3, 126464)


def test_a_missing_native_module_is_named(tmp_path, monkeypatch):
    monkeypatch.setitem(FAMILIES, FAMILY, dataclasses.replace(FAMILIES["llada"], native_module="no_such_family"))
    d = write_standin(tmp_path / "m", mask_token_id=3)
    with pytest.raises(ModelDirectoryError, match=r"no ddrl\.models\.native\.no_such_family"):
        load_model(d)


# --------------------------------------------------------------------------------------------
# Masks, positions and the cache go straight through
# --------------------------------------------------------------------------------------------


def test_left_padded_batch_runs_in_one_call_and_gives_the_unpadded_logits(tmp_path, facts_of):
    facts_of("llada")
    model = load_model(write_standin(tmp_path / "m", mask_token_id=3)).eval()
    rows = [[2, 4, 5, 6, 7, 8], [2, 9, 3], [2, 10, 11, 3, 3]]
    ids, mask = padded_batch(rows)
    with torch.no_grad():
        StandIn.calls = 0
        batched = model(ids, attention_mask=mask).logits
        assert StandIn.calls == 1  # no unpadded fallback
        for i, r in enumerate(rows):
            torch.testing.assert_close(batched[i, mask[i]], model(torch.tensor([r])).logits[0], atol=1e-5, rtol=1e-5)


def test_the_kv_cache_reaches_the_native_backbone(tmp_path, facts_of):
    facts_of("llada")
    model = load_model(write_standin(tmp_path / "m", layers=1, mask_token_id=3)).eval()  # 1 layer: prefix cache exact
    ids, mask = padded_batch([[2, 4, 5, 6, 7, 8, 9], [2, 9, 3, 10]])
    P = 4
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        prefix = model(ids[:, :P], attention_mask=mask[:, :P], use_cache=True)
        assert prefix.past_key_values is not None and prefix.past_key_values[0][0].shape[2] == P
        rest = model(ids[:, P:], attention_mask=mask, past_key_values=prefix.past_key_values).logits
    torch.testing.assert_close(rest, full[:, P:], atol=1e-5, rtol=1e-5)


def test_gradient_checkpointing_of_a_native_backbone_checkpoints_its_layers(tmp_path, facts_of):
    facts_of("llada")
    model = load_model(write_standin(tmp_path / "m", mask_token_id=3))
    ids, mask = padded_batch([[2, 4, 5, 6], [2, 7]])

    def grads():
        model.zero_grad(set_to_none=True)
        model.train()
        model(ids, attention_mask=mask).logits.log_softmax(-1)[..., 5].sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = grads()
    model.gradient_checkpointing_enable()
    assert all("_ddrl_forward" in vars(block) for block in model.model.layers)
    for name, grad in grads().items():
        torch.testing.assert_close(grad, plain[name], atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# Dream: shifted logits, a tokenizer read without its DreamTokenizer, sampling in its vocabulary
# --------------------------------------------------------------------------------------------


def test_dream_tokenizer_loads_without_remote_code_and_sampling_stays_in_its_vocabulary(tmp_path, facts_of):
    import ddrl.sampling  # noqa: F401  (registers the samplers)
    from ddrl.config import SamplerConfig
    from ddrl.registry import SAMPLERS

    facts_of("dream")
    d = write_standin(tmp_path / "dream", vocab_size=32, tokenizer="dream", mask_token_id=11)
    model = load_model(d).eval()
    tok = model.tokenizer
    assert type(tok.tokenizer).__name__ == "Qwen2Tokenizer" and len(tok) == 12 and model.vocab_size == 32
    assert (tok.mask_token_id, tok.eos_token_id, tok.bos_token_id) == (11, 7, 10)
    assert tok.encode("ab a") == [4, 5] and tok.encode_prompt("ab") == [8, 4, 9, 8]  # Dream's chat template
    assert model.logits_shifted and model.logits_range == (0, 12)
    logits = model(torch.tensor([[8, 4, 9]])).logits
    assert (logits[..., 12:] < -1e3).all() and (logits[..., :12] > -1e3).all()
    out = SAMPLERS.get("masked")(model, torch.tensor([[8, 4, 9]]), None,
                                 SamplerConfig(steps=8, gen_length=8, temperature=1.0, early_exit=False),
                                 generator=torch.Generator().manual_seed(0))
    assert (out.completion_ids < 12).all()
    assert tok.decode([4, 5, 30, 31]) == "ab a"  # ids of the padded vocabulary have no text (no crash)

    model.save_pretrained(tmp_path / "saved")  # writes the tokenizer back; reloads with the same facts
    again = load_model(tmp_path / "saved")
    assert (again.family, again.logits_shifted, again.logits_range, len(again.tokenizer)) == (FAMILY, True, (0, 12), 12)
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(torch.tensor([[8, 4, 9]])).logits, logits)


def test_dream_logits_are_shifted_so_samplers_and_estimators_read_the_right_position(tmp_path, facts_of):
    import ddrl.sampling  # noqa: F401
    from ddrl.config import SamplerConfig
    from ddrl.estimators.common import forward_logprobs
    from ddrl.registry import SAMPLERS

    facts_of("dream")
    # The backbone at position p predicts the token of p + 1.
    d = write_standin(tmp_path / "dream", mask_token_id=3, oracle_scale=50.0, oracle_shift=1)
    model = load_model(d).eval()
    assert model.logits_shifted and model.logits_range is None  # this tokenizer covers the vocabulary
    prompt_ids, prompt_mask = padded_batch([[2, 4, 5], [2, 6]])
    cfg = SamplerConfig(steps=6, gen_length=6, block_length=6, temperature=0.0, early_exit=False)
    expected = 4 + (prompt_mask.sum(1, keepdim=True) + torch.arange(6)) % 5  # the completion starts at n_real
    out = SAMPLERS.get("masked")(model, prompt_ids, prompt_mask, cfg, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out.completion_ids, expected)
    masked = torch.full_like(expected, 3)
    assert forward_logprobs(model, prompt_ids, prompt_mask, masked, expected).min() > -0.1

    model.logits_shifted = False  # without the shift every prediction is read one position off
    wrong = SAMPLERS.get("masked")(model, prompt_ids, prompt_mask, cfg, generator=torch.Generator().manual_seed(0))
    assert not torch.equal(wrong.completion_ids, expected)
    assert forward_logprobs(model, prompt_ids, prompt_mask, masked, expected).max() < -10


# --------------------------------------------------------------------------------------------
# SDAR: the block size is the checkpoint's; MMaDA: the image codebook
# --------------------------------------------------------------------------------------------


def test_block_size_comes_from_the_checkpoint_and_a_contradicting_one_fails_before_loading(tmp_path, facts_of,
                                                                                          monkeypatch):
    facts_of("sdar")
    d = write_standin(tmp_path / "b8", mask_token_id=3, block_size=8)
    model = load_model(d)
    assert model.block_size == 8 and model.process_spec == {"name": "block", "mask_token_id": 3, "block_size": 8}
    assert load_model(d, block_size=8).process.block_size == 8
    model.block_size = 2  # one source: the spec and the process follow the model
    assert model.process_spec["block_size"] == 2 and model.process.block_size == 2
    model.save_pretrained(tmp_path / "saved")
    assert "block_size" not in json.loads((tmp_path / "saved" / "config.json").read_text())["ddrl"]["process_spec"]

    unnamed = write_standin(tmp_path / "unnamed", mask_token_id=3)  # a config.json without block_size
    assert load_model(unnamed, block_size=4).block_size == 4  # asked for: taken (and recorded by a save)

    monkeypatch.setattr(StandIn, "from_pretrained", classmethod(lambda *a, **k: pytest.fail("weights were read")))
    with pytest.raises(ValueError, match=r"model\.block_size=4 contradicts .*block size is 8.*unset model\.block_size"):
        load_model(d, block_size=4)
    with pytest.raises(ValueError, match=r"names no block_size; set model\.block_size"):
        load_model(unnamed)
    facts_of("llada")
    with pytest.raises(ValueError, match=r"model\.block_size=4, but .* is a full-attention model"):
        load_model(d, block_size=4)


def test_mmada_image_codebook_slice_and_restriction(tmp_path, facts_of):
    import ddrl.sampling  # noqa: F401
    from ddrl.config import SamplerConfig
    from ddrl.registry import SAMPLERS

    facts_of("mmada")
    # As MMaDA-8B: the tokenizer (20 tokens) is shorter than the text rows (llm_vocab_size 24); codes follow the
    # tokenizer (the authors' len(text_tokenizer) + code), not llm_vocab_size + num_new_special_tokens (= 26).
    d = write_standin(tmp_path / "mmada", vocab_size=32, mask_token_id=3, llm_vocab_size=24, codebook_size=8,
                      num_new_special_tokens=2, tokenizer=None)
    write_llama_tokenizer(d, 20)
    model = load_model(d).eval()
    assert model.image_token_range == (20, 28)
    ids = torch.tensor([[2, 4, 5]])
    logits = model(ids).logits
    assert torch.equal(model.image_logits(logits), logits[..., 20:28])
    model.logits_range = model.image_token_range  # generate image tokens only, in vocabulary ids
    out = SAMPLERS.get("masked")(model, ids, None, SamplerConfig(steps=4, gen_length=4, temperature=1.0),
                                 generator=torch.Generator().manual_seed(0))
    assert ((out.completion_ids >= 20) & (out.completion_ids < 28)).all()
    assert load_model(d, mask_token_id=3).image_token_range == (20, 28)
    write_llama_tokenizer(d, 30)  # a tokenizer too long for the codebook to fit in the vocabulary
    with pytest.raises(ValueError, match=r"end at id 38, past the model's vocab_size=32"):
        load_model(d)


# --------------------------------------------------------------------------------------------
# Bad input: each fails before compute, naming the fix
# --------------------------------------------------------------------------------------------


def test_weights_of_another_family_fail_with_the_family_check_unchanged(tmp_path, facts_of):
    from safetensors.torch import load_file, save_file

    facts_of("llada")
    d = write_standin(tmp_path / "m", mask_token_id=3)
    state = load_file(str(d / "model.safetensors"))
    state["model.layers.0.self_attn.q_proj.weight"] = state.pop("model.transformer.blocks.0.q_proj.weight")
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(ModelDirectoryError, match=r"are not a standin checkpoint's: missing "
                                                  r"\['model.transformer.blocks.0.q_proj.weight'\].*model_type"):
        load_model(d)


def test_a_missing_tokenizer_is_an_error_where_one_is_needed(tmp_path, facts_of, monkeypatch):
    facts_of("llada")
    bare = write_standin(tmp_path / "bare", tokenizer=None, mask_token_id=3)
    assert load_model(bare).tokenizer is None  # tensor-only use stays possible
    with pytest.raises(ModelDirectoryError, match=r"no tokenizer .*copy the tokenizer files"):
        load_model(bare, require_tokenizer=True)
    facts_of("sdar")  # SDAR's mask id comes from its tokenizer
    no_mask = write_standin(tmp_path / "sdar", tokenizer=None, block_size=4)
    monkeypatch.setattr(StandIn, "from_pretrained", classmethod(lambda *a, **k: pytest.fail("weights were read")))
    with pytest.raises(ModelDirectoryError, match=r"mask id must come from the tokenizer.*copy the tokenizer files"):
        load_model(no_mask)
    only_config = write_standin(tmp_path / "cfg", tokenizer=None, mask_token_id=3, block_size=4)
    (only_config / "tokenizer_config.json").write_text("{}")  # no vocabulary anywhere
    with pytest.raises(ModelDirectoryError, match=r"tokenizer\.json or vocab\.json \+ merges\.txt"):
        load_model(only_config)


def test_lora_on_llada_names_wraps_the_block_ff_out_but_not_the_lm_head(tmp_path, facts_of, caplog):
    from ddrl.config import LoraConfig
    from ddrl.models.lora import apply_lora

    facts_of("llada")
    d = write_standin(tmp_path / "m", mask_token_id=3)
    names = ["q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out"]
    with caplog.at_level(logging.INFO, logger="ddrl"):
        model = apply_lora(load_model(d), LoraConfig(rank=2, target_modules=names))
    wrapped = {n for n, _ in model.model.named_modules() if n.endswith(".lora_A.default")}
    assert len(wrapped) == 2 * 7 and not any("transformer.ff_out" in n for n in wrapped)
    assert any("LM head model.transformer.ff_out is not adapted" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="matches only the LM head 'model.transformer.ff_out'"):
        apply_lora(load_model(d), LoraConfig(rank=2, target_modules=["transformer.ff_out"]))
    asked = apply_lora(load_model(d), LoraConfig(rank=2, target_modules=["model.transformer.ff_out"]))
    assert [n for n, _ in asked.model.named_modules() if n.endswith(".lora_A.default")] == [
        "base_model.model.model.transformer.ff_out.lora_A.default"]


def test_paper_recipes_name_llada_layers_that_exist():
    from ddrl.config import RLConfig, load_config
    from ddrl.models.lora import lora_targets

    root = Path(__file__).resolve().parents[2]
    backbone = StandIn({"vocab_size": 16, "hidden_size": 4, "num_layers": 1, "num_heads": 2})
    recipes = sorted((root / "configs/paper").glob("*_llada8b.yaml"))
    assert recipes
    for path in recipes:
        lora = load_config(path, cls=RLConfig).model.lora
        if lora.rank == 0:
            continue  # full fine-tuning: no adapter
        # the layers peft matched in the papers' runs on LLaDA (their LLaMA-style list matched these four)
        wrapped = lora_targets(backbone, lora.target_modules, lora.exclude_modules)
        assert {name.rsplit(".", 1)[-1] for name in wrapped} == {"q_proj", "k_proj", "v_proj", "up_proj"}, path.name
        assert len(wrapped) == 4 and "model.transformer.ff_out" not in wrapped, path.name


# --------------------------------------------------------------------------------------------
# The families' golden checkpoints (tests/fixtures/<family>/model, the official layout)
# --------------------------------------------------------------------------------------------

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LLADA_LORA = ["q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out"]


@pytest.mark.parametrize("family", ["llada", "mmada", "dream", "sdar"])
def test_official_checkpoint_loads_natively_trains_with_lora_and_round_trips(tmp_path, family):
    from ddrl.config import LoraConfig
    from ddrl.models.lora import apply_lora

    directory = FIXTURES / family / "model"
    assert (directory / "config.json").is_file(), f"no {family} fixture; run tests/fixtures/make_{family}.py"
    model = load_model(directory, require_tokenizer=True).eval()
    assert model.family == family and model.attention == "native" and model.tokenizer is not None
    assert type(model.model).__module__.startswith("ddrl.models.native.")
    assert model.logits_shifted == (family == "dream") and (model.block_size is not None) == (family == "sdar")
    ids = torch.tensor([model.tokenizer.encode_prompt("hi")])
    with torch.no_grad():
        logits = model(ids).logits
    model.save_pretrained(tmp_path / "saved")
    with torch.no_grad():
        torch.testing.assert_close(load_model(tmp_path / "saved").eval()(ids).logits, logits)

    adapted = apply_lora(model, LoraConfig(rank=2, target_modules=LLADA_LORA + ["o_proj", "gate_proj", "down_proj"]))
    wrapped = [n for n, _ in adapted.model.named_modules() if n.endswith(".lora_A.default")]
    head = "model.transformer.ff_out" if family in ("llada", "mmada") else "lm_head"
    assert len(wrapped) == 7 * len(adapted.model.get_base_model().layers) and not any(f".{head}." in n for n in wrapped)


def test_a_tokenizer_that_needs_remote_code_names_the_option(tmp_path):
    """A non-native directory whose tokenizer_config.json auto_map points at code (Dream's layout read
    as a generic directory) fails naming model.trust_remote_code=true and the file it would run."""
    from ddrl.models.hf_tokenizer import load_tokenizer

    directory = tmp_path / "tok"
    shutil.copytree(Path(__file__).resolve().parents[1] / "fixtures" / "dream" / "model", directory)
    with pytest.raises(ModelDirectoryError, match=r"tokenization_dream\.py.*model\.trust_remote_code=true"):
        load_tokenizer(directory, native=False)
