"""LoRA through peft on the DiffusionLM wrapper, and gradient checkpointing (built-in and Hugging Face)."""

from __future__ import annotations

import copy

import pytest
import torch

from ddrl.config import LoraConfig, ModelConfig
from ddrl.models import SymbolTokenizer, build_model, load_model
from ddrl.models.lora import apply_lora, load_adapter, merge_and_save, save_adapter
from tests.unit.test_hf_models import padded_batch, write_tiny_model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_builtin(seed: int = 0):
    tok = SymbolTokenizer(list("0123456789"))
    return build_model(ModelConfig(d_model=32, n_layers=2, n_heads=2, max_seq_len=32), tok, generator_seed=seed)


def randomise_lora_b(model, seed: int = 1) -> None:
    """peft initialises B = 0 (adapter = identity); give B values so the adapter changes the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


IDS = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10], [3, 11, 12, 13, 1, 1, 1, 1]])


def test_only_lora_parameters_are_trainable_and_bad_targets_are_named():
    model = apply_lora(tiny_builtin(), LoraConfig(rank=4, alpha=8, target_modules=ALL))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * len(ALL) * 2  # A and B, 7 projections, 2 layers
    with pytest.raises(ValueError, match="q_proj"):  # the message lists the model's linear layers
        apply_lora(tiny_builtin(), LoraConfig(rank=4, target_modules=["query"]))
    with pytest.raises(ValueError, match="already"):
        apply_lora(model, LoraConfig(rank=4))


def test_disabled_adapter_is_the_base_model_before_and_after_training():
    base = tiny_builtin()
    with torch.no_grad():
        base_logits = base(IDS).logits
    model = apply_lora(copy.deepcopy(base), LoraConfig(rank=4, alpha=8, target_modules=ALL))
    randomise_lora_b(model)
    with torch.no_grad():
        assert (model(IDS).logits - base_logits).abs().max() > 1e-2  # the adapter is active
        with model.disable_adapter():
            torch.testing.assert_close(model(IDS).logits, base_logits, atol=0, rtol=0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loss = model(IDS).logits.logsumexp(-1).mean()
    loss.backward()
    opt.step()
    with torch.no_grad():
        with model.disable_adapter():
            torch.testing.assert_close(model(IDS).logits, base_logits, atol=0, rtol=0)
        assert (model(IDS).logits - base_logits).abs().max() > 1e-2
    with pytest.raises(ValueError, match="no LoRA adapter"):
        with base.disable_adapter():
            pass


def test_merge_gives_the_adapted_logits_and_checkpoints_round_trip(tmp_path):
    model = apply_lora(tiny_builtin(), LoraConfig(rank=4, alpha=8, target_modules=ALL))
    randomise_lora_b(model)
    with torch.no_grad():
        adapted = model(IDS).logits
    merge_and_save(model, tmp_path / "merged")
    merged = load_model(tmp_path / "merged")
    assert not hasattr(merged.model, "peft_config")  # a plain model directory
    with torch.no_grad():
        torch.testing.assert_close(merged(IDS).logits, adapted, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model(IDS).logits, adapted, atol=0, rtol=0)  # the training model is untouched
    # A checkpoint of a LoRA model: base weights + adapter/, loaded back with the adapter attached.
    model.save_pretrained(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "adapter" / "adapter_config.json").is_file()
    again = load_model(tmp_path / "ckpt")
    assert hasattr(again.model, "peft_config")
    with torch.no_grad():
        torch.testing.assert_close(again(IDS).logits, adapted, atol=1e-6, rtol=1e-6)
        with again.disable_adapter():
            torch.testing.assert_close(again(IDS).logits, tiny_builtin()(IDS).logits, atol=1e-6, rtol=1e-6)
    # The adapter alone, attached to a fresh base.
    save_adapter(model, tmp_path / "adapter")
    attached = load_adapter(tiny_builtin(), tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(attached(IDS).logits, adapted, atol=1e-6, rtol=1e-6)


def test_merge_of_a_hugging_face_model(tmp_path):
    d = write_tiny_model(tmp_path / "m", mask_token_id=3)
    model = apply_lora(load_model(d), LoraConfig(rank=2, alpha=4, target_modules=["q_proj", "v_proj", "up_proj"]))
    randomise_lora_b(model)
    ids, mask = padded_batch([[2, 4, 5, 6], [2, 7]])
    with torch.no_grad():
        adapted = model(ids, attention_mask=mask).logits
    merge_and_save(model, tmp_path / "merged")
    merged = load_model(tmp_path / "merged")
    with torch.no_grad():
        torch.testing.assert_close(merged(ids, attention_mask=mask).logits, adapted, atol=1e-5, rtol=1e-5)


def _grads(model, ids, mask=None) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model.train()
    logits = model(ids, attention_mask=mask).logits
    (logits.float().log_softmax(-1)[..., 5].sum()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_grads(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("lora", [False, True])
def test_gradient_checkpointing_gives_the_same_gradients_builtin(lora):
    model = tiny_builtin()
    if lora:
        model = apply_lora(model, LoraConfig(rank=4, alpha=8, target_modules=ALL))
        randomise_lora_b(model)
    plain = _grads(model, IDS)
    model.gradient_checkpointing_enable()
    _assert_same_grads(plain, _grads(model, IDS))


@pytest.mark.parametrize("supports_gc", [True, False])
def test_gradient_checkpointing_gives_the_same_gradients_hf(tmp_path, supports_gc):
    """supports_gc=False is LLaDA's case: its remote code has no Hugging Face checkpointing, so ddrl
    checkpoints each transformer block itself; the block then runs twice per training step."""
    d = write_tiny_model(tmp_path / "m", mask_token_id=3, supports_gc=supports_gc)
    model = apply_lora(load_model(d), LoraConfig(rank=2, alpha=4, target_modules=["q_proj", "v_proj"]))
    randomise_lora_b(model)
    ids, mask = padded_batch([[2, 4, 5, 6], [2, 7]])
    block = type(model.model.get_base_model().layers[0])
    block.calls = 0
    plain = _grads(model, ids, mask)
    calls_plain = block.calls
    model.gradient_checkpointing_enable()
    block.calls = 0
    checkpointed = _grads(model, ids, mask)
    assert block.calls == 2 * calls_plain  # each block recomputed in backward
    _assert_same_grads(plain, checkpointed)
    model.gradient_checkpointing_disable()
    block.calls = 0
    _grads(model, ids, mask)
    assert block.calls == calls_plain
