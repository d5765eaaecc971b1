"""LoRA through peft on the DiffusionLM wrapper: which layers it wraps (names, paths, regexes, the LM
head, exclusions), merge and checkpoints, and gradient checkpointing (built-in and Hugging Face)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from ddrl.config import LoraConfig, ModelConfig
from ddrl.models import SymbolTokenizer, build_model, load_model
from ddrl.models.lora import apply_lora, load_adapter, merge_and_save, save_adapter
from tests.unit.test_hf_models import CANVAS, padded_batch, write_tiny_diffusion_gemma, write_tiny_model

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
    model = apply_lora(load_model(d, trust_remote_code=True),
                       LoraConfig(rank=2, alpha=4, target_modules=["q_proj", "v_proj", "up_proj"]))
    randomise_lora_b(model)
    ids, mask = padded_batch([[2, 4, 5, 6], [2, 7]])
    with torch.no_grad():
        adapted = model(ids, attention_mask=mask).logits
    merge_and_save(model, tmp_path / "merged")
    merged = load_model(tmp_path / "merged", trust_remote_code=True)
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
    model = apply_lora(load_model(d, trust_remote_code=True),
                       LoraConfig(rank=2, alpha=4, target_modules=["q_proj", "v_proj"]))
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


@pytest.mark.parametrize("kind", ["builtin", "hf", "hf_no_gc", "llada"])
def test_a_frozen_embedding_output_needs_no_grad_under_lora_and_checkpointing(kind, tmp_path):
    """peft (on wrapping) and transformers (on turning checkpointing on) hang a hook on the input
    embeddings that makes their output require grad, which only REENTRANT checkpointing needs. ddrl's
    is non-reentrant, so the hooks are dropped: a frozen embedding's output is no leaf that requires
    grad (with the hook, backward computed the first block's unused input gradient into a [B, T, D]
    .grad held as long as the graph), and every layer's adapter still gets its gradient."""
    if kind == "builtin":
        model, ids, mask = tiny_builtin(), IDS, None
        targets = ALL
    elif kind == "llada":
        model, targets = load_model("tests/fixtures/llada/model"), ["q_proj", "k_proj", "v_proj", "up_proj"]
        ids, mask = torch.tensor([[1, 5, 9, 13, 17, 21]]), None
    else:
        d = write_tiny_model(tmp_path / "m", mask_token_id=3, supports_gc=kind == "hf")
        model, targets = load_model(d, trust_remote_code=True), ["q_proj", "v_proj"]
        ids, mask = padded_batch([[2, 4, 5, 6], [2, 7]])
    model = apply_lora(model, LoraConfig(rank=2, alpha=4, target_modules=targets))
    randomise_lora_b(model)
    embedded = []
    handles = [m.register_forward_hook(lambda _m, _i, out: embedded.append(out))
               for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    # without checkpointing (peft's hook, dropped by apply_lora: the trainer turns checkpointing on after it,
    # or not at all), then with it (transformers' hook, dropped by gradient_checkpointing_enable)
    plain = _grads(model, ids, mask)
    assert embedded and not any(e.requires_grad for e in embedded)
    embedded.clear()
    model.gradient_checkpointing_enable()
    checkpointed = _grads(model, ids, mask)
    for h in handles:
        h.remove()
    assert embedded and not any(e.requires_grad for e in embedded)
    assert {n.split(".lora_")[0] for n in checkpointed if "lora_A" in n} == \
        {n.split(".lora_")[0] for n, _ in model.named_parameters() if "lora_A" in n}  # every adapter, block 0's too
    _assert_same_grads(plain, checkpointed)


# --------------------------------------------------------------------------------------------
# Which layers: names, dotted paths, regexes, exclusions, the LM head
# --------------------------------------------------------------------------------------------


def _wrapped(model) -> set[str]:
    """Full names (relative to the base model) of the layers that got a LoRA adapter."""
    prefix = "base_model.model."
    return {n[len(prefix):-len(".lora_A.default")] for n, _ in model.model.named_modules()
            if n.endswith(".lora_A.default")}


def test_targets_by_name_path_and_regex_and_unmatched_names_are_only_reported(caplog):
    cfg = dict(rank=2, alpha=4)
    by_name = apply_lora(tiny_builtin(), LoraConfig(target_modules=["q_proj"], **cfg))
    assert _wrapped(by_name) == {"layers.0.attn.q_proj", "layers.1.attn.q_proj"}
    by_path = apply_lora(tiny_builtin(), LoraConfig(target_modules=["layers.1.attn.q_proj", "1.mlp.up_proj"], **cfg))
    assert _wrapped(by_path) == {"layers.1.attn.q_proj", "layers.1.mlp.up_proj"}
    by_regex = apply_lora(tiny_builtin(), LoraConfig(target_modules=[r"re:layers\.0\..*_proj"], **cfg))
    assert _wrapped(by_regex) == {f"layers.0.{n}" for n in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj",
                                                            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    exclude = ["re:layers\\.1\\..*", "up_proj"]
    excluded = apply_lora(tiny_builtin(), LoraConfig(target_modules=ALL, exclude_modules=exclude, **cfg))
    assert _wrapped(excluded) == {f"layers.0.{n}" for n in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj",
                                                            "mlp.gate_proj", "mlp.down_proj")}
    with caplog.at_level(logging.INFO, logger="ddrl"):
        model = apply_lora(tiny_builtin(), LoraConfig(target_modules=["q_proj", "attn_out", "ff_proj"], **cfg))
    assert _wrapped(model) == {"layers.0.attn.q_proj", "layers.1.attn.q_proj"}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "attn_out, ff_proj" in warnings[0]  # reported, not fatal
    info = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
    assert "wraps 2 linear layers: layers.*.attn.q_proj (x2)" in info
    with pytest.raises(ValueError, match="not a valid regex"):
        apply_lora(tiny_builtin(), LoraConfig(target_modules=["re:(q_proj"], **cfg))


def test_lm_head_is_adapted_only_when_named_by_its_full_path(tmp_path, caplog):
    d = write_tiny_model(tmp_path / "m", mask_token_id=3)  # its LM head is `lm_head` (get_output_embeddings)
    with pytest.raises(ValueError, match=r"matches only the LM head 'lm_head'.*full path"):
        apply_lora(load_model(d, trust_remote_code=True), LoraConfig(rank=2, target_modules=["q_proj", "re:lm_.*"]))
    built = tiny_builtin()
    with caplog.at_level(logging.INFO, logger="ddrl"):
        model = apply_lora(built, LoraConfig(rank=2, target_modules=["re:.*_(proj|head)"]))
    assert "lm_head" not in _wrapped(model) and len(_wrapped(model)) == 14  # every block projection, not the head
    assert any("LM head lm_head is not adapted" in r.getMessage() for r in caplog.records)
    asked = apply_lora(tiny_builtin(), LoraConfig(rank=2, target_modules=["q_proj", "lm_head"]))
    assert "lm_head" in _wrapped(asked)  # the full path asks for it


def test_nothing_matched_is_an_error_naming_the_layers():
    with pytest.raises(ValueError, match=r"matches no linear layer.*q_proj"):
        apply_lora(tiny_builtin(), LoraConfig(rank=2, target_modules=["attn_out", "ff_out"]))
    with pytest.raises(ValueError, match="matches no linear layer"):  # everything it named is excluded
        apply_lora(tiny_builtin(), LoraConfig(rank=2, target_modules=["q_proj"], exclude_modules=["q_proj"]))


def test_lora_on_diffusion_gemma_text_layers_with_the_vision_tower_excluded(tmp_path):
    """DiffusionGemma's vision tower wraps q/k/v/o and gate/up/down in Gemma4ClippableLinear (not an
    nn.Linear): peft's name matching reaches them and fails. ddrl adapts linear layers only, and the
    tower can be excluded by regex, also from a regex that would reach its inner `.linear` layers."""
    d = write_tiny_diffusion_gemma(tmp_path / "dg")
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = apply_lora(load_model(d), LoraConfig(rank=2, alpha=4, target_modules=names,
                                                 exclude_modules=["re:.*vision_tower.*"]))
    wrapped = _wrapped(model)
    assert wrapped and not any("vision_tower" in n for n in wrapped) and "lm_head" not in wrapped
    assert any(n.startswith("model.decoder.layers.") for n in wrapped)
    assert any(n.startswith("model.encoder.language_model.layers.") for n in wrapped)
    with pytest.raises(ValueError, match="matches no linear layer"):
        apply_lora(load_model(d), LoraConfig(rank=2, target_modules=[r"re:.*\.linear"],
                                             exclude_modules=["re:.*vision_tower.*"]))

    randomise_lora_b(model)
    prompt_ids, prompt_mask = padded_batch([[2, 4, 5, 6], [2, 7]])
    seq = torch.cat([prompt_ids, torch.randint(4, 40, (2, CANVAS), generator=torch.Generator().manual_seed(0))], 1)
    mask = torch.cat([prompt_mask, torch.ones(2, CANVAS, dtype=torch.bool)], 1)
    eligible = torch.zeros_like(mask)
    eligible[:, -CANVAS:] = True
    model.train()
    loss, _ = model.process.pretrain_loss(model, seq, eligible, mask, generator=torch.Generator().manual_seed(1))
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert torch.isfinite(loss) and all(".lora_" in n for n in grads)
    assert any(g is not None and g.abs().sum() > 0 for g in grads.values())
    model.eval()
    with torch.no_grad():
        adapted = model(seq, attention_mask=mask).logits
        with model.disable_adapter():
            assert (model(seq, attention_mask=mask).logits - adapted).abs().max() > 1e-4
