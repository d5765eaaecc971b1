"""ddrl's native LLaDA / MMaDA backbones against the authors' code (golden fixtures).

tests/fixtures/make_llada.py ran the authors' own code on a tiny checkpoint in the official
layout: ZHZisZZ/dllm @ 03270de7 (hub LLaDA modeling code), ML-GSAI/LLaDA @ b7e6c356 generate(),
NVlabs/Fast-dLLM @ 24cc59e7 generate / generate_with_prefix_cache / generate_with_dual_cache,
Gen-Verse/MMaDA @ 3cdb8709 MMadaModelLM. Every comparison here is with their recorded outputs.
The tiny LLaDA has n_kv_heads=2 < n_heads=4 (grouped-query attention); the tiny MMaDA has
n_kv_heads = n_heads and 64 image codes after its 128 text tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ddrl.models import DiffusionLM
from ddrl.models.io import ModelDirectoryError
from ddrl.models.native.base import NATIVE_FAMILIES
from ddrl.models.native.llada import LLaDABackbone, MMaDABackbone
from ddrl.sampling.masked import generate

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LLADA, MMADA = FIXTURES / "llada", FIXTURES / "mmada"


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """float32 logits: 1e-5 absolute plus 1e-5 relative (the logits are peaked, |logit| up to ~15)."""
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def golden() -> dict[str, torch.Tensor]:
    return load_file(str(LLADA / "golden.safetensors"))


@pytest.fixture(scope="module")
def meta() -> dict:
    return json.loads((LLADA / "golden.json").read_text())


@pytest.fixture(scope="module")
def model() -> LLaDABackbone:
    return LLaDABackbone.from_pretrained(LLADA / "model", dtype=torch.float32).eval()


def rows(golden: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [golden[f"row{i}"] for i in range(3)]


# --------------------------------------------------------------------------------------------
# Logits, hidden states, padding
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def test_logits_and_hidden_states_equal_the_authors_per_row(model, golden):
    for i, row in enumerate(rows(golden)):
        out = model(row[None])
        close(out.logits[0], golden[f"logits_row{i}"])
        close(out.hidden_states[0], golden[f"hidden_row{i}"])  # after ln_f, as their hidden_states[-1]


@pytest.mark.pinned  # bf16 kernels differ by CPU: re-run under avx2 and default by test_portable_pins.py
@torch.no_grad()
def test_bfloat16_logits_equal_the_authors(golden):
    """The checkpoint is bf16; loaded as stored, per-op dtypes (RMSNorm and RoPE in float32, the
    norm weight applied in bf16) must be theirs. Getting one of them wrong moves logits by 0.7-1.7
    here. The recorded bf16 logits came from their code on an AVX2 CPU: under ATEN_CPU_CAPABILITY=avx2
    all rows are bit-equal; other bf16 kernels round some sums the other way (AVX512: row 2 bit-equal,
    rows 0-1 up to 0.156, mean 0.011-0.016; default: up to 0.156, mean 0.018-0.022, 0.31-0.34 of
    float32's mean gap, while float32 compute sits 0.054-0.064 away on average). So: within 0.25 (two
    bf16 ulps at 16-32), and on average less than half as far as float32."""
    model = LLaDABackbone.from_pretrained(LLADA / "model").eval()
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    for i, row in enumerate(rows(golden)):
        ours, theirs = model(row[None]).logits[0].float(), golden[f"logits_bf16_row{i}"].float()
        torch.testing.assert_close(ours, theirs, atol=0.25, rtol=0)
        assert (ours - theirs).abs().mean() < 0.5 * (golden[f"logits_row{i}"].float() - theirs).abs().mean()


@torch.no_grad()
def test_left_padded_batch_gives_each_rows_unpadded_logits(model, golden, meta):
    """The reference for a padded row is the authors' code on the row unpadded. Their own padded
    output (dllm's copy masks the pads but keeps positions 0..T-1) is recorded too: RoPE is relative,
    so it differs from the unpadded rows only by rounding (~2e-5, golden.json)."""
    ids, mask = golden["padded_ids"], golden["padded_mask"]
    out = model(ids, attention_mask=mask).logits
    W = ids.shape[1]
    for i, row in enumerate(rows(golden)):
        close(out[i, W - row.numel():], golden[f"logits_row{i}"])
        theirs = golden["padded_logits_theirs"][i, W - row.numel():]
        torch.testing.assert_close(theirs, golden[f"logits_row{i}"], atol=1e-4, rtol=1e-4)
    assert max(meta["padded_theirs_max_abs_diff_vs_unpadded"]) > 0  # theirs is not exactly the unpadded output
    # The pads must not be attended: without the mask the padded rows change completely.
    assert (model(ids).logits[0, W - golden["row0"].numel():] - golden["logits_row0"]).abs().max() > 1.0


@torch.no_grad()
def test_logits_to_keep(model, golden):
    row = golden["row2"][None]
    close(model(row, logits_to_keep=5).logits[0], golden["logits_row2"][-5:])
    index = torch.tensor([0, 7, 11])
    close(model(row, logits_to_keep=index).logits[0], golden["logits_row2"][index])
    close(model.lm_head(model(row).hidden_states)[0], golden["logits_row2"])


# --------------------------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def test_prefix_cache_call_equals_the_full_call(model, golden):
    """Bidirectional attention: re-feeding the last k tokens against the cache of the *same* full call
    (positions [0, T - k), every layer) reproduces the full call's logits there, by induction over layers."""
    row = golden["row1"][None]
    T, k = row.shape[1], 6
    full = model(row, use_cache=True)
    assert len(full.past_key_values) == 2
    key, value = full.past_key_values[0]
    assert key.shape == (1, 2, T, 16) and value.shape == (1, 2, T, 16)  # [B, H_kv, T, Dh]
    past = [(k_[:, :, :T - k], v_[:, :, :T - k]) for k_, v_ in full.past_key_values]
    cached = model(row[:, T - k:], past_key_values=past)
    close(cached.logits[0], golden["logits_row1"][T - k:])
    # The same with a 2-D mask over (cached keys, new tokens), as the samplers pass it.
    masked = model(row[:, T - k:], attention_mask=torch.ones(1, T, dtype=torch.long), past_key_values=past)
    close(masked.logits[0], golden["logits_row1"][T - k:])


@torch.no_grad()
def test_dual_cache_order_with_explicit_positions(model, golden):
    """Fast-dLLM's dual cache as ddrl's sampler feeds it: cached keys listed (prefix, suffix), the
    block's own last, the block's positions given. Keys are stored rotated, so only the queries'
    positions come from position_ids; a wrong position would change every logit of the block."""
    row = golden["row2"][None]
    T, a, b = row.shape[1], 20, 30
    full = model(row, use_cache=True)
    past = [(torch.cat([k[:, :, :a], k[:, :, b:]], 2), torch.cat([v[:, :, :a], v[:, :, b:]], 2))
            for k, v in full.past_key_values]
    out = model(row[:, a:b], attention_mask=torch.ones(1, T, dtype=torch.bool),
                position_ids=torch.arange(a, b)[None], past_key_values=past)
    close(out.logits[0], golden["logits_row2"][a:b])
    shifted = model(row[:, a:b], position_ids=torch.arange(a, b)[None] + 3, past_key_values=past)
    assert (shifted.logits[0] - golden["logits_row2"][a:b]).abs().max() > 1e-2


@torch.no_grad()
def test_boolean_4d_mask_and_position_ids_are_used_as_given(model, golden):
    """Two rows packed into one sequence with a block-diagonal boolean mask and positions restarting
    at the second row: each part must get the authors' logits of its row alone."""
    r0, r1 = golden["row0"], golden["row1"]
    T0, T1 = r0.numel(), r1.numel()
    allowed = torch.zeros(1, 1, T0 + T1, T0 + T1, dtype=torch.bool)
    allowed[..., :T0, :T0] = True
    allowed[..., T0:, T0:] = True
    positions = torch.cat([torch.arange(T0), torch.arange(T1)])[None]
    out = model(torch.cat([r0, r1])[None], attention_mask=allowed, position_ids=positions).logits[0]
    close(out[:T0], golden["logits_row0"])
    close(out[T0:], golden["logits_row1"])
    out3 = model(torch.cat([r0, r1])[None], attention_mask=allowed[:, 0], position_ids=positions).logits[0]  # 3-D
    close(out3[T0:], golden["logits_row1"])


# --------------------------------------------------------------------------------------------
# Checkpoint directory: loading, saving, errors
# --------------------------------------------------------------------------------------------


def test_config_facts_and_registry(model):
    cfg = model.config
    assert (cfg.vocab_size, cfg.mask_token_id, cfg.max_sequence_length, cfg.n_kv_heads) == (128, 124, 4096, 2)
    assert NATIVE_FAMILIES.get("llada") is LLaDABackbone and NATIVE_FAMILIES.get("mmada") is MMaDABackbone
    assert len(model.layers) == 2 and model.layers is model.model.transformer["blocks"]
    assert model.get_output_embeddings() is model.model.transformer["ff_out"]  # untied head
    lm = DiffusionLM(model, None, mask_token_id=cfg.mask_token_id, vocab_size=cfg.vocab_size, family="llada")
    assert lm.max_seq_len == 4096


def test_tokenizer_and_chat_template_give_the_recorded_prompts(meta):
    """The fixture's tokenizer files in LLaDA's layout (tokenizer.json + tokenizer_config.json with
    LLaDA-8B-Instruct's chat template) give, under ddrl's transformers, the ids transformers 4.57.1
    gave the reference run. (config.json names auto_map modeling files, as the hub's does; loading a
    tokenizer needs none of them: trust_remote_code=False.)"""
    import transformers  # pinned in pyproject: always installed
    tok = transformers.AutoTokenizer.from_pretrained(str(LLADA / "model"), trust_remote_code=False)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (120, 121, 121)
    for message, row in zip(meta["messages"], meta["rows"]):
        text = tok.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                       tokenize=False)
        assert text.startswith("<|startoftext|><|start_header_id|>user<|end_header_id|>\n\n")
        assert tok(text, add_special_tokens=False)["input_ids"] == row


def test_save_pretrained_round_trip(model, golden, tmp_path):
    model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads((LLADA / "model/config.json").read_text())
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f, \
            safe_open(str(LLADA / "model/model.safetensors"), "pt") as g:
        assert sorted(f.keys()) == sorted(g.keys())
    again = LLaDABackbone.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(golden["row0"][None]).logits, model(golden["row0"][None]).logits,
                                   atol=0, rtol=0)


def test_bad_weight_names_name_the_family(tmp_path, monkeypatch):
    shutil.copy(LLADA / "model/config.json", tmp_path / "config.json")
    state = load_file(str(LLADA / "model/model.safetensors"))
    state["model.transformer.blocks.0.attn_proj.weight"] = state.pop("model.transformer.blocks.0.q_proj.weight")
    save_file(state, str(tmp_path / "model.safetensors"))
    import ddrl.models.native.llada as llada_module

    def no_tensor_reads(directory):  # the names come from the headers, before any tensor is read
        raise AssertionError("tensors were read before the weight names were checked")

    monkeypatch.setattr(llada_module, "read_weights", no_tensor_reads)
    with pytest.raises(ModelDirectoryError, match=r"not a llada checkpoint.*q_proj.*attn_proj"):
        LLaDABackbone.from_pretrained(tmp_path)


def test_unsupported_or_foreign_config_is_refused(tmp_path):
    config = json.loads((LLADA / "model/config.json").read_text())
    shutil.copy(LLADA / "model/model.safetensors", tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({**config, "block_type": "sequential"}))
    with pytest.raises(ModelDirectoryError, match="block_type='sequential'"):
        LLaDABackbone.from_pretrained(tmp_path)
    with pytest.raises(ModelDirectoryError, match="model_type 'mmada'"):
        LLaDABackbone.from_pretrained(MMADA / "model")


def test_gradient_checkpointing_gives_the_same_gradients(golden):
    model = LLaDABackbone.from_pretrained(LLADA / "model", dtype=torch.float32).train()
    row = golden["row0"][None]

    def grads() -> list[torch.Tensor]:
        model.zero_grad()
        model(row).logits.logsumexp(-1).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = grads()
    model.gradient_checkpointing_enable()
    for a, b in zip(plain, grads()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# MMaDA
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def test_mmada_logits_equal_the_authors():
    g = load_file(str(MMADA / "golden.safetensors"))
    model = MMaDABackbone.from_pretrained(MMADA / "model", dtype=torch.float32).eval()
    cfg = model.config
    assert (cfg.vocab_size, cfg.llm_vocab_size, cfg.codebook_size, cfg.num_new_special_tokens) == (192, 128, 64, 0)
    for i in range(2):
        close(model(g[f"row{i}"][None]).logits[0], g[f"logits_row{i}"])
    # Left-padded: each row's unpadded logits. Their mmu_generate-style pairwise attention_bias agrees up
    # to rounding; their 2-D attention_mask path is causal (MMaDA's LLaDAModel adds a causal bias), recorded.
    ids, mask = g["padded_ids"], g["padded_mask"]
    out = model(ids, attention_mask=mask).logits
    W = ids.shape[1]
    for i in range(2):
        T = g[f"row{i}"].numel()
        close(out[i, W - T:], g[f"logits_row{i}"])
        torch.testing.assert_close(g["padded_logits_attention_bias_theirs"][i, W - T:], g[f"logits_row{i}"],
                                   atol=1e-4, rtol=1e-4)
        assert (g["padded_logits_attention_mask_theirs"][i, W - T:] - g[f"logits_row{i}"]).abs().max() > 1.0


# --------------------------------------------------------------------------------------------
# Greedy samplers: ddrl.sampling.masked.generate vs LLaDA's generate() and Fast-dLLM's caches
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("setting", [0, 1])
@torch.no_grad()
def test_greedy_generate_equals_llada_and_fast_dllm(model, golden, meta, cache, setting):
    """One left-padded batch through ddrl's sampler; each row must get the tokens the authors' samplers
    gave it alone (batch of 1, unpadded): LLaDA's generate() for cache "none", Fast-dLLM's generate /
    generate_with_prefix_cache / generate_with_dual_cache for every cache mode, fixed step counts and
    threshold decoding (thresholds of golden.json)."""
    cfg = model.config
    lm = DiffusionLM(model, None, mask_token_id=cfg.mask_token_id, vocab_size=cfg.vocab_size, family="llada")
    ids, mask = golden["padded_ids"], golden["padded_mask"]
    W, params = ids.shape[1], meta["sampler_settings"][setting]
    for t, threshold in enumerate([None] + meta["thresholds"]):
        out = generate(lm, ids, mask, temperature=0.0, mask_id=cfg.mask_token_id, cache=cache, threshold=threshold,
                       **params)
        for i in range(3):
            completion = out[i, W:]
            expected = golden[f"fast_{cache}_s{setting}_t{t}_row{i}"][-params["gen_length"]:]
            assert completion.tolist() == expected.tolist(), (cache, setting, threshold, i)
            if cache == "none" and threshold is None:
                assert out[i, W - golden[f"row{i}"].numel():].tolist() == golden[f"generate_s{setting}_row{i}"].tolist()
