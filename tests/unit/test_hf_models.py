"""Checkpoint directories through transformers, offline: the remote-code path (opt-in, its errors),
family detection, the unpadded feed, the tokenizer wrapper, save/load, DiffusionGemma.

Every model here is written by the test itself: a tiny remote-code model (a modeling file with a
PretrainedConfig + PreTrainedModel pair, config.json with auto_map) and a WordLevel tokenizer. Their
model_type names no native family: native families (LLaDA, MMaDA, Dream, SDAR) never run remote
code and are tested in test_model_loading.py.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from ddrl.models import load_model

# The remote code: a few-k-parameter transformer. FAMILY flags mimic the real models' quirks:
#   IGNORES_MASK (LLaDA): attention_mask is accepted and ignored, positions are 0..T-1;
#   SUPPORTS_GC: Hugging Face gradient checkpointing (LLaDA's remote code has none);
#   config.oracle_scale / oracle_shift: adds oracle_scale * onehot(token for position p + shift) to the
#   logits, token(p) = oracle_offset + p % oracle_period, so a "Dream" model predicts the NEXT token.
MODELING = '''
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MaskedLMOutput

IGNORES_MASK = {ignores_mask}
SUPPORTS_GC = {supports_gc}


class TinyConfig(PretrainedConfig):
    model_type = "{model_type}"

    def __init__(self, vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, max_position_embeddings=64,
                 oracle_scale=0.0, oracle_shift=0, oracle_offset=4, oracle_period=5, **kwargs):
        self.vocab_size, self.hidden_size, self.num_layers = vocab_size, hidden_size, num_layers
        self.num_heads, self.max_position_embeddings = num_heads, max_position_embeddings
        self.oracle_scale, self.oracle_shift = oracle_scale, oracle_shift
        self.oracle_offset, self.oracle_period = oracle_offset, oracle_period
        super().__init__(**kwargs)


class Block(GradientCheckpointingLayer if SUPPORTS_GC else nn.Module):
    calls = 0  # forward executions (a checkpointed block runs twice per training step)

    def __init__(self, config):
        super().__init__()
        h = config.hidden_size
        self.heads = config.num_heads
        self.norm1, self.norm2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.q_proj, self.k_proj = nn.Linear(h, h, bias=False), nn.Linear(h, h, bias=False)
        self.v_proj, self.o_proj = nn.Linear(h, h, bias=False), nn.Linear(h, h, bias=False)
        self.up_proj, self.down_proj = nn.Linear(h, 2 * h, bias=False), nn.Linear(2 * h, h, bias=False)

    def forward(self, hidden, mask=None):
        type(self).calls += 1
        B, T, H = hidden.shape
        x = self.norm1(hidden)
        split = lambda t: t.view(B, T, self.heads, H // self.heads).transpose(1, 2)
        a = F.scaled_dot_product_attention(split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x)),
                                           attn_mask=mask)
        hidden = hidden + self.o_proj(a.transpose(1, 2).reshape(B, T, H))
        return hidden + self.down_proj(F.gelu(self.up_proj(self.norm2(hidden))))


class TinyModel(PreTrainedModel):
    config_class = TinyConfig
    base_model_prefix = "tiny"
    supports_gradient_checkpointing = SUPPORTS_GC
    _no_split_modules = ["Block"]

    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.3)

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        B, T = input_ids.shape
        if IGNORES_MASK:  # like LLaDA's remote code: no mask, positions 0..T-1
            attention_mask, position_ids = None, None
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        mask = attention_mask
        if mask is not None and mask.dim() == 2:
            mask = mask.bool()[:, None, None, :]
        hidden = self.embed_tokens(input_ids) + self.embed_positions(position_ids)
        for layer in self.layers:
            hidden = layer(hidden, mask)
        logits = self.lm_head(self.norm(hidden))
        c = self.config
        if c.oracle_scale:
            target = c.oracle_offset + (position_ids + c.oracle_shift) % c.oracle_period
            logits = logits + c.oracle_scale * F.one_hot(target, c.vocab_size).to(logits.dtype)
        return MaskedLMOutput(logits=logits)
'''

SPECIALS = ["<pad>", "<eos>", "<bos>", "<mask>"]  # ids 0..3


def write_tokenizer(directory: Path, vocab_size: int, chat_template: str | None = None) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + [f"w{i}" for i in range(vocab_size - len(SPECIALS))])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                  mask_token="<mask>")
    if chat_template:
        tok.chat_template = chat_template
    tok.save_pretrained(str(directory))


def write_tiny_model(directory: Path, *, model_type: str = "tiny", ignores_mask: bool = False,
                     supports_gc: bool = False, vocab_size: int = 32, seed: int = 0, tokenizer: bool = True,
                     attention: str | None = None, **config: object) -> Path:
    """A remote-code model directory (config.json with auto_map + modeling_tiny.py + weights + tokenizer).

    attention: the ddrl feed to record in config.json's "ddrl" section ("unpadded" for a model that
    ignores attention_mask, as LLaDA's hub code does); None = the family's."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "modeling_tiny.py").write_text(
        MODELING.format(model_type=model_type, ignores_mask=ignores_mask, supports_gc=supports_gc))
    auto_map = {"AutoConfig": "modeling_tiny.TinyConfig", "AutoModel": "modeling_tiny.TinyModel"}
    cfg = {"model_type": model_type, "architectures": ["TinyModel"], "auto_map": auto_map,
           "vocab_size": vocab_size, **config}
    if attention is not None:
        cfg["ddrl"] = {"attention": attention}
    (directory / "config.json").write_text(json.dumps(cfg))
    # Weights: initialise through the remote code once, so the directory is a complete HF model.
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(str(directory), trust_remote_code=True, local_files_only=True)
    torch.manual_seed(seed)  # test-only: HF initialises from the global RNG
    AutoModel.from_config(config, trust_remote_code=True).save_pretrained(str(directory))
    if tokenizer:
        write_tokenizer(directory, vocab_size)
    return directory


def padded_batch(rows: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows]).bool()
    return ids, mask


# --------------------------------------------------------------------------------------------
# Family facts
# --------------------------------------------------------------------------------------------


def test_family_detection_reads_model_type_architectures_and_auto_map():
    from ddrl.models.hf import detect_family

    llada = {"model_type": "llada", "architectures": ["LLaDAModelLM"],
             "auto_map": {"AutoModel": "modeling_llada.LLaDAModelLM"}}
    assert detect_family(llada) == "llada"
    assert detect_family({"model_type": "Dream", "architectures": ["DreamModel"]}) == "dream"
    assert detect_family({"model_type": "llada", "architectures": ["MMadaModelLM"]}) == "mmada"
    assert detect_family({"model_type": "sdar", "architectures": ["SDARForCausalLM"]}) == "sdar"
    assert detect_family({"model_type": "qwen3", "auto_map": {"AutoModel": "modeling_trado.TraDoModel"}}) == "sdar"
    assert detect_family({"model_type": "diffusion_gemma"}) == "diffusion_gemma"
    assert detect_family({"model_type": "bert"}) == "generic"
    assert detect_family({"model_type": "tiny", "architectures": ["TinyModel"]}) == "generic"


def test_remote_code_loads_offline_with_tokenizer_mask_and_override(tmp_path):
    from ddrl.models.hf import HFDiffusionLM, HFTokenizer, load_hf_model

    d = write_tiny_model(tmp_path / "m")
    model = load_model(d, trust_remote_code=True)
    assert isinstance(model, HFDiffusionLM) and isinstance(model.tokenizer, HFTokenizer)
    assert (model.family, model.mask_token_id, model.attention) == ("generic", 3, "native")  # the tokenizer's <mask>
    assert model.process_spec == {"name": "masked", "mask_token_id": 3}
    assert model.vocab_size == 32 and model.pad_token_id == 0 and model.eos_token_id == 1
    assert model(torch.tensor([[5, 6, 7]])).logits.shape == (1, 3, 32)

    model = load_hf_model(d, mask_token_id=2, trust_remote_code=True)  # the override wins
    assert model.mask_token_id == 2 and model.tokenizer.mask_token_id == 2
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 32\).*model.mask_token_id"):
        load_hf_model(d, mask_token_id=99, trust_remote_code=True)


def test_remote_code_is_off_by_default_and_the_error_names_the_files(tmp_path):
    from ddrl.config import ModelConfig
    from ddrl.models.hf import load_hf_model

    assert ModelConfig().trust_remote_code is False
    d = write_tiny_model(tmp_path / "m", mask_token_id=3)
    for load in (load_model, load_hf_model):
        with pytest.raises(ValueError, match=r"runs modeling_tiny\.py .*model\.trust_remote_code=true"):
            load(d)


# Remote code written for another transformers release, as the hub's dLLM files are (issue 13):
#   post_init: LLaDA's class never calls post_init() -> AttributeError all_tied_weights_keys;
#   rope: Dream's reads ROPE_INIT_FUNCTIONS['default'] -> KeyError;
#   import: SDAR imports transformers.modeling_attn_mask_utils -> ModuleNotFoundError.
BROKEN = {
    "post_init": ("", "", "AttributeError"),
    "rope": ("from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS\n", "ROPE_INIT_FUNCTIONS['default']",
             "KeyError"),
    "import": ("from transformers.modeling_attn_mask_utils import AttentionMaskConverter\n", "", "ModuleNotFoundError"),
}
BROKEN_MODELING = """
{imports}
import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel


class OldConfig(PretrainedConfig):
    model_type = "old_tiny"

    def __init__(self, vocab_size=16, **kwargs):
        self.vocab_size = vocab_size
        super().__init__(**kwargs)


class OldModel(PreTrainedModel):
    config_class = OldConfig

    def __init__(self, config):
        super().__init__(config)
        {init}
        self.lm_head = nn.Linear(4, config.vocab_size)  # no self.post_init()
"""


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_remote_code_that_does_not_run_on_the_pinned_transformers_names_the_incompatibility(tmp_path, kind):
    import transformers

    from ddrl.models.hf import RemoteCodeError

    imports, init, exception = BROKEN[kind]
    (tmp_path / "modeling_old.py").write_text(BROKEN_MODELING.format(imports=imports, init=init or "pass"))
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "old_tiny", "architectures": ["OldModel"], "vocab_size": 16, "mask_token_id": 3,
        "auto_map": {"AutoConfig": "modeling_old.OldConfig", "AutoModel": "modeling_old.OldModel"}}))
    from safetensors.torch import save_file

    weights = {"lm_head.weight": torch.zeros(16, 4), "lm_head.bias": torch.zeros(16)}
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(RemoteCodeError) as info:
        load_model(tmp_path, trust_remote_code=True)
    message = str(info.value)
    assert exception in message and "modeling_old.py" in message and transformers.__version__ in message
    assert "natively" in message and "LM head" not in message


def test_hf_tokenizer_encodes_without_specials_and_prompts_with_bos_or_chat_template(tmp_path):
    from transformers import AutoTokenizer

    from ddrl.models.hf import HFTokenizer

    write_tokenizer(tmp_path, 16)
    tok = HFTokenizer(AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True))
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.mask_token_id, tok.vocab_size) == (0, 1, 2, 3, 16)
    assert tok.encode("w0 w1") == [4, 5]
    assert tok.encode_prompt("w0 w1") == [2, 4, 5]  # no chat template: BOS + text
    assert tok.decode([4, 1, 5]) == "w0 w1"  # specials skipped
    assert tok.decode([4, 16, 5, 151000]) == "w0 w1"  # ids past the tokenizer (a padded vocabulary) have no text
    write_tokenizer(tmp_path / "chat", 16, chat_template="{% for m in messages %}<bos> w9 {{ m['content'] }} "
                                                          "{% endfor %}{% if add_generation_prompt %}w8{% endif %}")
    chat = HFTokenizer(AutoTokenizer.from_pretrained(str(tmp_path / "chat"), local_files_only=True))
    assert chat.encode_prompt("w0 w1") == [2, 13, 4, 5, 12]


# --------------------------------------------------------------------------------------------
# Remote code that ignores the attention mask: the "unpadded" feed
# --------------------------------------------------------------------------------------------


def test_mask_ignoring_remote_code_left_padded_batch_gives_the_unpadded_logits(tmp_path):
    from transformers import AutoModel

    d = write_tiny_model(tmp_path / "m", mask_token_id=3, ignores_mask=True, attention="unpadded")
    model = load_model(d, trust_remote_code=True).eval()
    assert model.attention == "unpadded"
    rows = [[2, 4, 5, 6, 7, 8], [2, 9, 3], [2, 10, 11, 3, 3], [2, 12, 13]]
    ids, mask = padded_batch(rows)
    with torch.no_grad():
        batched = model(ids, attention_mask=mask).logits  # [B, T, V]
        for i, r in enumerate(rows):
            alone = model(torch.tensor([r])).logits[0]
            torch.testing.assert_close(batched[i, mask[i]], alone, atol=1e-5, rtol=1e-5)
        # The raw remote code ignores the mask: without ddrl's treatment the padded rows are wrong.
        raw = AutoModel.from_pretrained(str(d), trust_remote_code=True, local_files_only=True).eval()
        raw_batched = raw(ids, attention_mask=mask).logits
        short = raw(torch.tensor([rows[1]])).logits[0]
        assert (raw_batched[1, mask[1]] - short).abs().max() > 1e-2
    with pytest.raises(ValueError, match="without a KV cache"):
        model(ids, attention_mask=mask, past_key_values=[])


def test_remote_code_model_passes_the_padding_mask_as_given(tmp_path):
    d = write_tiny_model(tmp_path / "m", mask_token_id=3)  # honours attention_mask and position_ids
    model = load_model(d, trust_remote_code=True).eval()
    rows = [[2, 4, 5, 6, 7], [2, 9, 3]]
    ids, mask = padded_batch(rows)
    positions = (mask.long().cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        batched = model(ids, attention_mask=mask, position_ids=positions).logits
        for i, r in enumerate(rows):
            alone = model(torch.tensor([r]), attention_mask=torch.ones(1, len(r), dtype=torch.bool)).logits[0]
            torch.testing.assert_close(batched[i, mask[i]], alone, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# Persistence
# --------------------------------------------------------------------------------------------


def test_hf_model_save_pretrained_round_trips_through_load_model(tmp_path):
    from ddrl.models.hf import load_hf_model

    d = write_tiny_model(tmp_path / "m", ignores_mask=True, attention="unpadded")
    model = load_hf_model(d, mask_token_id=2, trust_remote_code=True)  # the override is saved in the "ddrl" section
    ids = torch.tensor([[2, 4, 5, 6]])
    model.save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["ddrl"]["mask_token_id"] == 2 and config["ddrl"]["attention"] == "unpadded"
    assert (tmp_path / "saved" / "modeling_tiny.py").is_file() and (tmp_path / "saved" / "tokenizer.json").is_file()
    with pytest.raises(ValueError, match="trust_remote_code"):  # a saved remote-code model still needs the opt-in
        load_model(tmp_path / "saved")
    again = load_model(tmp_path / "saved", trust_remote_code=True)
    assert (again.family, again.mask_token_id, again.attention) == ("generic", 2, "unpadded")
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits)


# --------------------------------------------------------------------------------------------
# DiffusionGemma (native in transformers)
# --------------------------------------------------------------------------------------------

CANVAS = 8


def write_tiny_diffusion_gemma(directory: Path, vocab_size: int = 48) -> Path:
    """A ~0.4M-parameter DiffusionGemmaForBlockDiffusion. Known catches: vision_config=None builds a 167M
    vision tower, the mixture-of-experts sizes must be set, use_bidirectional_attention='all' crashes."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    text = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=16, num_experts=2,
                top_k_experts=1, moe_intermediate_size=16, sliding_window=8, max_position_embeddings=128,
                layer_types=["sliding_attention", "full_attention"], pad_token_id=0, eos_token_id=1, bos_token_id=2)
    vision = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    config = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=CANVAS,
                                  boi_token_id=vocab_size - 3, eoi_token_id=vocab_size - 2,
                                  image_token_id=vocab_size - 1)
    torch.manual_seed(0)  # test-only: HF initialises from the global RNG
    DiffusionGemmaForBlockDiffusion(config).save_pretrained(str(directory))
    write_tokenizer(directory, vocab_size)
    return directory


def test_tiny_diffusion_gemma_loads_samples_and_trains(tmp_path):
    import ddrl.sampling  # noqa: F401
    from ddrl.config import SamplerConfig
    from ddrl.registry import SAMPLERS

    d = write_tiny_diffusion_gemma(tmp_path / "dg")
    model = load_model(d)
    assert (model.family, model.attention, model.canvas_length) == ("diffusion_gemma", "canvas", CANVAS)
    assert model.process_spec["name"] == "uniform" and model.process_spec["num_classes"] == 48

    prompt_ids, prompt_mask = padded_batch([[2, 4, 5, 6], [2, 7]])
    model.eval()
    out = SAMPLERS.get("uniform")(model, prompt_ids, prompt_mask,
                                  SamplerConfig(name="uniform", steps=3, gen_length=CANVAS, temperature=1.0),
                                  generator=torch.Generator().manual_seed(0))
    assert out.completion_ids.shape == (2, CANVAS) and out.nfe == 3
    # Left padding: a padded row's canvas logits equal the unpadded row's.
    seq = torch.cat([prompt_ids, out.completion_ids], 1)
    mask = torch.cat([prompt_mask, torch.ones(2, CANVAS, dtype=torch.bool)], 1)
    with torch.no_grad():
        batched = model(seq, attention_mask=mask).logits[1, -CANVAS:]
        alone = model(seq[1:, 2:]).logits[0, -CANVAS:]
    torch.testing.assert_close(batched, alone, atol=1e-4, rtol=1e-4)

    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x0 = seq
    eligible = torch.zeros_like(mask)
    eligible[:, -CANVAS:] = True
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        loss, _ = model.process.pretrain_loss(model, x0, eligible, mask, generator=g)
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    moved = max((p.detach() - before[n]).abs().max().item() for n, p in model.named_parameters())
    assert moved > 0

    model.save_pretrained(tmp_path / "saved")
    again = load_model(tmp_path / "saved")
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(seq, attention_mask=mask).logits,
                                   model.eval()(seq, attention_mask=mask).logits)


def test_hf_model_gives_raw_logits_with_the_mask_class(tmp_path):
    """forward(raw=True) on a Hugging Face model (SEPO's concrete score with states=clean reads the mask
    class's logit): the remote code's own logits, every class's, through the model's forward (a wrapper's
    hooks run); it refuses the options that cut positions or classes. Before, a TypeError."""
    from transformers import AutoModel

    d = write_tiny_model(tmp_path / "m", mask_token_id=3)
    model = load_model(d, trust_remote_code=True).eval()
    ids = torch.tensor([[2, 4, 3, 6, 3]])
    with torch.no_grad():
        raw = model(ids, raw=True).logits
        backbone = AutoModel.from_pretrained(str(d), trust_remote_code=True, local_files_only=True).eval()
        torch.testing.assert_close(raw, backbone(ids).logits)
    with pytest.raises(ValueError, match="raw=True"):
        model(ids, raw=True, logits_to_keep=2)
