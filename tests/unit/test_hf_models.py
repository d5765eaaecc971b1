"""Hugging Face directories -> DiffusionLM, offline: remote code, family facts, padding, Dream's shift,
block attention, MMaDA's image codebook, DiffusionGemma, save/load round trips.

Every model here is written by the test itself: a tiny remote-code model (a modeling file with a
PretrainedConfig + PreTrainedModel pair, config.json with auto_map) and a WordLevel tokenizer.
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


def write_tiny_model(directory: Path, *, model_type: str = "llada", ignores_mask: bool = True,
                     supports_gc: bool = False, vocab_size: int = 32, seed: int = 0, tokenizer: bool = True,
                     **config: object) -> Path:
    """A remote-code model directory (config.json with auto_map + modeling_tiny.py + weights + tokenizer)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "modeling_tiny.py").write_text(
        MODELING.format(model_type=model_type, ignores_mask=ignores_mask, supports_gc=supports_gc))
    auto_map = {"AutoConfig": "modeling_tiny.TinyConfig", "AutoModel": "modeling_tiny.TinyModel"}
    cfg = {"model_type": model_type, "architectures": ["TinyModel"], "auto_map": auto_map,
           "vocab_size": vocab_size, **config}
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


def test_llada_remote_code_loads_offline_with_family_mask_rule_and_override(tmp_path):
    from ddrl.models.hf import HFDiffusionLM, HFTokenizer

    # Family rule: a LLaDA-sized vocabulary and no mask id in config.json -> LLaDA's 126336.
    big = write_tiny_model(tmp_path / "big", vocab_size=126464, hidden_size=8, num_layers=1, num_heads=1)
    model = load_model(big)
    assert isinstance(model, HFDiffusionLM) and isinstance(model.tokenizer, HFTokenizer)
    assert (model.family, model.mask_token_id, model.attention) == ("llada", 126336, "unpadded")
    assert model.process_spec == {"name": "masked", "mask_token_id": 126336}
    assert model(torch.tensor([[5, 6, 7]])).logits.shape == (1, 3, 126464)

    # The same rule on a small vocabulary is an error that names the fix; the override wins.
    small = write_tiny_model(tmp_path / "small")
    with pytest.raises(ValueError, match="mask_token_id"):
        load_model(small)
    from ddrl.models.hf import load_hf_model

    model = load_hf_model(small, mask_token_id=3)
    assert model.mask_token_id == 3 and model.tokenizer.mask_token_id == 3
    assert model.vocab_size == 32 and model.pad_token_id == 0 and model.eos_token_id == 1


def test_remote_code_needs_trust(tmp_path):
    from ddrl.models.hf import load_hf_model

    d = write_tiny_model(tmp_path / "m", mask_token_id=3)
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_hf_model(d, trust_remote_code=False)


def test_hf_tokenizer_encodes_without_specials_and_prompts_with_bos_or_chat_template(tmp_path):
    from transformers import AutoTokenizer

    from ddrl.models.hf import HFTokenizer

    write_tokenizer(tmp_path, 16)
    tok = HFTokenizer(AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True))
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.mask_token_id, tok.vocab_size) == (0, 1, 2, 3, 16)
    assert tok.encode("w0 w1") == [4, 5]
    assert tok.encode_prompt("w0 w1") == [2, 4, 5]  # no chat template: BOS + text
    assert tok.decode([4, 1, 5]) == "w0 w1"  # specials skipped
    write_tokenizer(tmp_path / "chat", 16, chat_template="{% for m in messages %}<bos> w9 {{ m['content'] }} "
                                                          "{% endfor %}{% if add_generation_prompt %}w8{% endif %}")
    chat = HFTokenizer(AutoTokenizer.from_pretrained(str(tmp_path / "chat"), local_files_only=True))
    assert chat.encode_prompt("w0 w1") == [2, 13, 4, 5, 12]


# --------------------------------------------------------------------------------------------
# Padding (ANCHORS complaint 5), Dream's shift, block attention
# --------------------------------------------------------------------------------------------


def test_llada_left_padded_batch_gives_the_unpadded_logits(tmp_path):
    from transformers import AutoModel

    d = write_tiny_model(tmp_path / "m", mask_token_id=3)
    model = load_model(d).eval()
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


def _oracle_dir(tmp_path: Path, model_type: str, shift: int) -> Path:
    return write_tiny_model(tmp_path / model_type, model_type=model_type, ignores_mask=False, mask_token_id=3,
                            oracle_scale=50.0, oracle_shift=shift, oracle_offset=4, oracle_period=5)


def test_dream_logits_are_shifted_so_samplers_and_estimators_read_the_right_position(tmp_path):
    from ddrl.config import SamplerConfig
    from ddrl.models.hf import load_hf_model
    from ddrl.registry import SAMPLERS

    import ddrl.sampling  # noqa: F401  (registers the samplers)

    d = _oracle_dir(tmp_path, "dream", shift=1)  # the backbone at position p predicts the token of p + 1
    model = load_model(d).eval()
    assert (model.family, model.logits_shifted, model.attention) == ("dream", True, "dream")
    prompt_ids, prompt_mask = padded_batch([[2, 4, 5], [2, 6]])
    cfg = SamplerConfig(steps=6, gen_length=6, block_length=6, temperature=0.0, early_exit=False)

    def oracle(p: torch.Tensor) -> torch.Tensor:
        return 4 + p % 5

    real = prompt_mask.sum(1, keepdim=True)  # the completion starts at position n_real
    expected = oracle(real + torch.arange(6))
    out = SAMPLERS.get("masked")(model, prompt_ids, prompt_mask, cfg, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out.completion_ids, expected)

    # Without the shift the same sampler reads every prediction one position off.
    unshifted = load_hf_model(d, mask_token_id=3)
    unshifted.logits_shifted = False
    wrong = SAMPLERS.get("masked")(unshifted, prompt_ids, prompt_mask, cfg, generator=torch.Generator().manual_seed(0))
    assert not torch.equal(wrong.completion_ids, expected)

    # Estimator alignment: the completion's log-probs read at the completion positions.
    from ddrl.estimators.common import forward_logprobs

    completion = expected
    masked = torch.full_like(completion, 3)
    lp = forward_logprobs(model, prompt_ids, prompt_mask, masked, completion)
    assert lp.min() > -0.1  # the oracle puts ~all mass on the right token
    lp_wrong = forward_logprobs(unshifted, prompt_ids, prompt_mask, masked, completion)
    assert lp_wrong.max() < -10


def test_dream_padding_gives_the_unpadded_logits(tmp_path):
    d = write_tiny_model(tmp_path / "dream", model_type="dream", ignores_mask=False, mask_token_id=3)
    model = load_model(d).eval()
    rows = [[2, 4, 5, 6, 7], [2, 9, 3]]
    ids, mask = padded_batch(rows)
    with torch.no_grad():
        batched = model(ids, attention_mask=mask).logits
        for i, r in enumerate(rows):
            alone = model(torch.tensor([r]), attention_mask=torch.ones(1, len(r), dtype=torch.bool)).logits[0]
            # position 0 of a shifted model repeats itself; compare from the second real token on
            torch.testing.assert_close(batched[i, mask[i]][1:], alone[1:], atol=1e-5, rtol=1e-5)


def test_sdar_block_family_attends_block_causally(tmp_path):
    d = write_tiny_model(tmp_path / "sdar", model_type="sdar", ignores_mask=False, mask_token_id=3)
    model = load_model(d).eval()
    assert (model.family, model.block_size, model.attention) == ("sdar", 4, "block")
    assert model.process_spec == {"name": "block", "mask_token_id": 3, "block_size": 4}
    ids = torch.tensor([[2, 4, 5, 6, 7, 8, 9, 10, 11, 12]])
    changed = ids.clone()
    changed[0, 9] = 13  # a token of block 2 (positions 8..11)
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[0, :8], b[0, :8])  # blocks 0 and 1 cannot see block 2
    assert (a[0, 8:] - b[0, 8:]).abs().max() > 1e-3  # block 2 sees itself
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 3), torch.ones(1, 10)], dim=1).bool()
    with torch.no_grad():
        torch.testing.assert_close(model(padded, attention_mask=mask).logits[0, 3:], a[0], atol=1e-5, rtol=1e-5)


def test_mmada_image_codebook_slice_and_restriction(tmp_path):
    import ddrl.sampling  # noqa: F401
    from ddrl.config import SamplerConfig
    from ddrl.registry import SAMPLERS

    d = write_tiny_model(tmp_path / "mmada", model_type="mmada", mask_token_id=3, llm_vocab_size=20,
                         codebook_size=8, num_new_special_tokens=2)
    model = load_model(d).eval()
    assert model.family == "mmada" and model.image_token_range == (22, 30)
    ids = torch.tensor([[2, 4, 5]])
    logits = model(ids).logits
    assert torch.equal(model.image_logits(logits), logits[..., 22:30])
    model.logits_range = model.image_token_range  # generate image tokens only, in vocabulary ids
    out = SAMPLERS.get("masked")(model, ids, None, SamplerConfig(steps=4, gen_length=4, temperature=1.0),
                                 generator=torch.Generator().manual_seed(0))
    assert ((out.completion_ids >= 22) & (out.completion_ids < 30)).all()


# --------------------------------------------------------------------------------------------
# Persistence
# --------------------------------------------------------------------------------------------


def test_hf_model_save_pretrained_round_trips_through_load_model(tmp_path):
    from ddrl.models.hf import load_hf_model

    d = write_tiny_model(tmp_path / "m")
    model = load_hf_model(d, mask_token_id=3)  # the override is saved in the "ddrl" section
    ids = torch.tensor([[2, 4, 5, 6]])
    model.save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["ddrl"]["mask_token_id"] == 3 and config["ddrl"]["attention"] == "unpadded"
    assert (tmp_path / "saved" / "modeling_tiny.py").is_file() and (tmp_path / "saved" / "tokenizer.json").is_file()
    again = load_model(tmp_path / "saved")
    assert (again.family, again.mask_token_id, again.attention) == ("llada", 3, "unpadded")
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
