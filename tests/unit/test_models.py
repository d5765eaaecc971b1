"""The model layer: built-in denoiser properties, the DiffusionLM wrapper, saving and loading."""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import ddrl.models.transformer as transformer_module
from ddrl.config import ModelConfig
from ddrl.models import (Denoiser, DenoiserConfig, DiffusionLM, SymbolTokenizer, build_model, load_model)
from ddrl.models.diffusion_lm import SUPPRESSED_LOGIT
from ddrl.models.io import INCOMPLETE_MARKER
from ddrl.registry import PROCESSES

V = 16  # tiny vocabulary: 4 specials + 12 symbols
EXACT = dict(atol=1e-6, rtol=0.0)  # "the same logits": only float rounding of different matmul shapes allowed


def tiny(block_size: int | None = None, seed: int = 0, **kw) -> Denoiser:
    cfg = DenoiserConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=2, max_seq_len=32, block_size=block_size, **kw)
    return Denoiser(cfg, seed=seed).eval()


def tokens(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(4, V, shape, generator=torch.Generator().manual_seed(seed))


def tokenizer() -> SymbolTokenizer:
    return SymbolTokenizer(list("0123456789ab"))


# ---------------------------------------------------------------------------------- Denoiser


def test_output_shapes_and_cache_shapes():
    out = tiny()(tokens(3, 10), use_cache=True)
    assert out.logits.shape == (3, 10, V)
    assert len(out.past_key_values) == 2
    for k, v in out.past_key_values:
        assert k.shape == v.shape == (3, 2, 10, 16)  # [B, H, T, Dh]
    assert tiny()(tokens(3, 10)).past_key_values is None


def test_init_is_small_seeded_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    a, b, c = tiny(seed=0), tiny(seed=0), tiny(seed=1)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.embed_tokens.weight, c.embed_tokens.weight)
    # Measured: PyTorch's default embedding std of 1.0 stalled the tiny model; 0.02 trains.
    assert 0.015 < a.embed_tokens.weight.std().item() < 0.025


@pytest.mark.parametrize("block_size", [None, 4])
def test_left_padding_gives_the_same_logits_on_real_tokens(block_size):
    model = tiny(block_size)
    short = tokens(1, 7)
    long = tokens(1, 10, seed=2)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1)  # pad id 0 on the left
    batch = torch.cat([long, padded])
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        alone = model(short).logits
        together = model(batch, attention_mask=mask).logits
    torch.testing.assert_close(together[1, 3:], alone[0], **EXACT)
    torch.testing.assert_close(together[0], model(long).logits[0], **EXACT)
    assert together.isfinite().all()  # padding queries included


def test_all_padding_row_is_finite():
    model = tiny(4)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1] = 0
    assert model(tokens(2, 8), attention_mask=mask).logits.isfinite().all()
    # CPU attention happens to return 0 for a row with no key; some GPU kernels return NaN.
    # So the mask itself must leave every query at least one key, on every backend.
    allowed, _ = model._attention(mask, None, 2, 8, 0, torch.device("cpu"))
    assert allowed.any(-1).all()


def test_block_causal_attention():
    ids = tokens(1, 16)
    changed = ids.clone()
    changed[0, 9] = 4 if ids[0, 9] != 4 else 5  # a token in block 2 (positions 8..11) of block_size 4
    block = tiny(block_size=4)
    with torch.no_grad():
        before, after = block(ids).logits, block(changed).logits
    assert torch.equal(before[:, :8], after[:, :8])  # blocks 0-1 cannot see block 2
    assert not torch.allclose(before[:, 8:12], after[:, 8:12])
    assert not torch.allclose(before[:, 12:], after[:, 12:])
    full = tiny(block_size=None)
    with torch.no_grad():
        assert not torch.allclose(full(ids).logits[:, :8], full(changed).logits[:, :8])  # control: full attention sees it


@pytest.mark.parametrize("pads", [0, 4])
def test_block_kv_cache_matches_the_full_forward(pads):
    model = tiny(block_size=4)
    ids = tokens(2, 12)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :pads] = 0  # a block-aligned left padding keeps the blocks aligned with the chunks
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        prefix = model(ids[:, :8], attention_mask=mask[:, :8], use_cache=True)
        last = model(ids[:, 8:], attention_mask=mask, past_key_values=prefix.past_key_values, use_cache=True)
    torch.testing.assert_close(last.logits, full[:, 8:], atol=1e-5, rtol=0.0)
    assert last.past_key_values[0][0].shape[2] == 12  # past + current


def test_empty_cache_equals_plain_forward():
    model = tiny()
    ids = tokens(2, 9)
    with torch.no_grad():
        plain = model(ids).logits
        assert torch.equal(model(ids, past_key_values=None, use_cache=True).logits, plain)
        assert torch.equal(model(ids, past_key_values=[]).logits, plain)


def test_explicit_4d_mask_is_used_as_given():
    model = tiny(block_size=4)
    ids = tokens(1, 8)
    everything = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    with torch.no_grad():
        block = model(ids).logits
        given = model(ids, attention_mask=everything).logits
        full = tiny(block_size=None)(ids).logits  # same seed, same weights, no block structure
        staircase = torch.arange(8) // 4
        by_hand = model(ids, attention_mask=(staircase[None, :] <= staircase[:, None])[None]).logits  # [1, 8, 8]
    torch.testing.assert_close(given, full, **EXACT)
    torch.testing.assert_close(by_hand, block, **EXACT)


def test_gradient_checkpointing_gives_the_same_gradients(monkeypatch):
    calls = []
    real = transformer_module.checkpoint
    monkeypatch.setattr(transformer_module, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids, target = tokens(2, 10), tokens(2, 10, seed=3)

    def grads(enable: bool) -> list[torch.Tensor]:
        model = tiny().train()
        if enable:
            model.gradient_checkpointing_enable()
        loss = nn.functional.cross_entropy(model(ids).logits.flatten(0, 1), target.flatten())
        loss.backward()
        return [p.grad for p in model.parameters()]

    plain = grads(False)
    assert not calls
    checkpointed = grads(True)
    assert len(calls) == 2  # once per layer: checkpointing really ran
    for a, b in zip(plain, checkpointed):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)


def test_bad_inputs_fail_with_the_fix():
    model = tiny()
    with pytest.raises(ValueError, match=r"length 33 .* max_seq_len=32"):
        model(tokens(1, 33))
    cache = model(tokens(1, 30), use_cache=True).past_key_values
    with pytest.raises(ValueError, match=r"length 34 .* max_seq_len=32"):
        model(tokens(1, 4), past_key_values=cache)
    with pytest.raises(ValueError, match=r"vocab_size=16"):
        model(torch.tensor([[1, 2, 16]]))
    with pytest.raises(ValueError, match=r"vocab_size=16"):
        model(torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match="attention_mask"):
        model(tokens(1, 5), attention_mask=torch.ones(1, 4))
    with pytest.raises(ValueError, match="n_heads"):
        DenoiserConfig(vocab_size=V, d_model=30, n_heads=4)


# ---------------------------------------------------------------------------------- DiffusionLM


@dataclass
class _Out:
    logits: torch.Tensor


class NextTokenBackbone(nn.Module):
    """An AR-style (Dream) model: position i's logits predict token i + 1, here perfectly."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, attention_mask=None):
        following = torch.roll(input_ids, shifts=-1, dims=1)  # token i + 1 at position i
        return _Out(logits=nn.functional.one_hot(following, V).float() * 10 + self.weight)


def test_dream_shift_aligns_logits():
    ids = tokens(2, 9)
    shifted = DiffusionLM(NextTokenBackbone(), mask_token_id=1, vocab_size=V, logits_shifted=True, family="dream")
    assert torch.equal(shifted(ids).logits[:, 1:].argmax(-1), ids[:, 1:])
    unshifted = DiffusionLM(NextTokenBackbone(), mask_token_id=1, vocab_size=V, logits_shifted=False)
    assert not torch.equal(unshifted(ids).logits[:, 1:].argmax(-1), ids[:, 1:])  # the test needs the shift


def test_mask_id_must_be_in_the_vocabulary():
    with pytest.raises(ValueError, match=r"mask_token_id=16 .* vocab_size=16"):
        DiffusionLM(tiny(), mask_token_id=16)
    with pytest.raises(ValueError, match="num_classes"):
        DiffusionLM(tiny(), mask_token_id=1, process_spec={"name": "uniform", "num_classes": 12, "offset": 5})


def test_build_model_from_config_and_mask_suppression():
    tok = tokenizer()
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=2, max_seq_len=24, ffn_mult=2.0)
    model = build_model(cfg, tok, generator_seed=3)
    assert model.model.config.ffn_hidden == 64 and model.model.config.max_seq_len == 24
    assert model.process_spec == {"name": "masked", "mask_token_id": 1, "schedule": "linear"}
    assert (model.mask_token_id, model.pad_token_id, model.eos_token_id, model.vocab_size) == (1, 0, 2, V)
    logits = model(tokens(2, 6)).logits
    assert logits.isfinite().all()
    assert (logits[..., 1] == SUPPRESSED_LOGIT).all() and (logits[..., 0] != SUPPRESSED_LOGIT).all()
    same = build_model(cfg, tok, generator_seed=3)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), same.parameters()))

    block = build_model(ModelConfig(d_model=32, n_layers=2, n_heads=2, process="block", block_size=4), tok)
    assert block.block_size == 4 and block.model.config.block_size == 4
    assert block.process_spec == {"name": "block", "mask_token_id": 1, "schedule": "linear", "block_size": 4}
    with pytest.raises(ValueError, match="block_size"):
        build_model(ModelConfig(process="block"), tok)
    with pytest.raises(ValueError, match="process_spec"):
        build_model(ModelConfig(process="uniform"), tok)
    uniform = build_model(ModelConfig(d_model=32, n_layers=2, n_heads=2, process="uniform"), tok,
                          process_spec={"name": "uniform", "num_classes": 10, "offset": 4, "schedule": "linear"})
    assert not uniform.suppress_mask_logit
    bf16 = build_model(ModelConfig(d_model=32, n_layers=2, n_heads=2, dtype="bfloat16"), tok)
    assert bf16.dtype == torch.bfloat16 and bf16(tokens(1, 5)).logits.dtype == torch.bfloat16


def test_process_is_built_lazily_from_the_registry(monkeypatch):
    class Recorder:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    monkeypatch.setitem(PROCESSES._items, "recorder_for_test", Recorder)
    monkeypatch.setattr("ddrl.registry._loaded", True)  # this test needs no built-in layer to import
    spec = {"name": "recorder_for_test", "mask_token_id": 1, "schedule": "cosine"}
    model = DiffusionLM(tiny(), tokenizer(), process_spec=spec)
    assert model.process.kwargs == {"mask_token_id": 1, "schedule": "cosine"}
    assert model.process is model.process  # built once
    model.process_spec["schedule"] = "linear"
    assert model.process.kwargs["schedule"] == "linear"  # a changed spec rebuilds it


# ---------------------------------------------------------------------------------- save / load


def saved_model(block_size=None, seed=0) -> DiffusionLM:
    tok = tokenizer()
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=2, max_seq_len=32, block_size=block_size,
                      process="block" if block_size else "masked")
    return build_model(cfg, tok, generator_seed=seed).eval()


def test_save_load_roundtrip(tmp_path):
    model = saved_model(block_size=4)
    target = tmp_path / "ckpt"
    model.save_pretrained(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary directory left behind
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    config = json.loads((target / "config.json").read_text())
    assert config["model_type"] == "ddrl_denoiser" and config["ddrl"]["mask_token_id"] == 1

    loaded = load_model(target)
    ids = tokens(2, 12)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    for name in ("mask_token_id", "pad_token_id", "eos_token_id", "bos_token_id", "vocab_size", "block_size",
                 "process_spec", "logits_shifted", "family", "suppress_mask_logit"):
        assert getattr(loaded, name) == getattr(model, name), name
    assert loaded.tokenizer.get_vocab() == model.tokenizer.get_vocab()
    assert load_model(target, dtype="bfloat16").dtype == torch.bfloat16


def test_tied_embeddings_roundtrip(tmp_path):
    model = DiffusionLM(tiny(tie_embeddings=True), tokenizer())
    model.save_pretrained(tmp_path / "m")
    loaded = DiffusionLM.from_pretrained(tmp_path / "m")
    assert loaded.model.lm_head.weight is loaded.model.embed_tokens.weight
    ids = tokens(1, 6)
    assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_save_replaces_an_old_directory_atomically(tmp_path):
    target = tmp_path / "ckpt"
    saved_model(seed=0).save_pretrained(target)
    (target / "stale.txt").write_text("from the old save")
    newer = saved_model(seed=1)
    newer.save_pretrained(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert not (target / "stale.txt").exists()
    ids = tokens(1, 6)
    assert torch.equal(load_model(target)(ids).logits, newer(ids).logits)


def test_interrupted_save_keeps_the_old_directory(tmp_path, monkeypatch):
    target = tmp_path / "ckpt"
    old = saved_model(seed=0)
    old.save_pretrained(target)
    broken = saved_model(seed=1)

    def crash(directory):
        raise OSError("disk full")

    monkeypatch.setattr(broken.tokenizer, "save_pretrained", crash)
    with pytest.raises(OSError, match="disk full"):
        broken.save_pretrained(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    ids = tokens(1, 6)
    assert torch.equal(load_model(target)(ids).logits, old(ids).logits)


def test_load_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="does not exist") as missing:
        load_model(tmp_path / "nowhere")
    assert isinstance(missing.value, FileNotFoundError)

    good = tmp_path / "good"
    saved_model().save_pretrained(good)

    no_weights = tmp_path / "no_weights"
    saved_model().save_pretrained(no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="incomplete.*use another checkpoint"):
        load_model(no_weights)

    no_config = tmp_path / "no_config"
    saved_model().save_pretrained(no_config)
    (no_config / "config.json").unlink()
    with pytest.raises(ValueError, match="incomplete.*config.json"):
        load_model(no_config)

    (good / INCOMPLETE_MARKER).write_text("")
    with pytest.raises(ValueError, match="half-written.*use another checkpoint"):
        load_model(good)


def test_hugging_face_directories_go_to_the_hf_adapter(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llada"}))
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    calls = []
    fake = types.ModuleType("ddrl.models.hf")
    fake.load_hf_model = lambda path, device=None, dtype=None, **kw: calls.append((path, device, dtype)) or "hf model"
    monkeypatch.setitem(sys.modules, "ddrl.models.hf", fake)
    monkeypatch.setattr("ddrl.models.hf", fake, raising=False)
    assert load_model(tmp_path, dtype="bfloat16") == "hf model"
    assert calls == [(str(tmp_path), None, torch.bfloat16)]


def test_the_length_limit_counts_positions_not_fed_tokens():
    """The staircase ELBO feeds a clean and a noisy copy at the same positions: 2x30 tokens fit 32."""
    model = tiny()
    ids = tokens(1, 30)
    positions = torch.arange(30)[None]
    out = model(torch.cat([ids, ids], 1), position_ids=torch.cat([positions, positions], 1))
    assert out.logits.shape == (1, 60, 16)
    with pytest.raises(ValueError, match=r"length 33 .* max_seq_len=32"):
        model(tokens(1, 4), position_ids=torch.tensor([[29, 30, 31, 32]]))


def test_builtin_loader_refuses_a_foreign_model_directory(tmp_path):
    from ddrl.models.diffusion_lm import DiffusionLM
    from ddrl.models.io import ModelDirectoryError

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llada"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelDirectoryError, match="'llada' model, not a built-in.*ddrl.load_model"):
        DiffusionLM.from_pretrained(tmp_path)
