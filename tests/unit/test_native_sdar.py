"""ddrl's native SDAR / TraDo backbone and SDAR's decoding rules against the authors' own outputs.

The oracle is tests/fixtures/sdar/ (made by tests/fixtures/make_sdar.py): Gen-Verse/dLLM-RL @ 10b4fd1c
models/sdar (TraDo's modeling code) run on a tiny checkpoint in the hub layout, under the block
layout of JetAstra/SDAR @ c2041a83 generate.py `block_diffusion_generate` (block = position //
block_size, prompt included), and that sampler's greedy tokens, per-step confidences and commits.
Their sampler takes one unpadded row (it ignores attention_mask), so the reference for a left-padded
row is its unpadded row.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ddrl.models.io import ModelDirectoryError
from ddrl.models.native.base import NATIVE_FAMILIES
from ddrl.models.native.sdar import SDARBackbone
from ddrl.sampling.sdar import commit_dynamic, tempered_confidence

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "sdar"
MODEL_DIR = FIXTURE / "model"
GOLDEN = load_file(str(FIXTURE / "golden.safetensors"))
META = json.loads((FIXTURE / "golden.json").read_text())
UNALIGNED = load_file(str(FIXTURE / "golden_unaligned.safetensors"))  # prompt + gen_length ends inside a block
UNALIGNED_META = json.loads((FIXTURE / "golden_unaligned.json").read_text())
ROWS = ("row0", "row1", "row2")
BLOCK, MASK, PAD, VOCAB = 4, 127, 101, 128
THRESHOLD = META["generate"]["confidence_threshold"]


@pytest.fixture(scope="module")
def model() -> SDARBackbone:
    return SDARBackbone.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()


def assert_logits(got: torch.Tensor, want: torch.Tensor) -> None:
    """1e-5 relative to the logits' scale (they reach ~15 on the peaked tiny model)."""
    scale = max(1.0, float(want.abs().max()))
    torch.testing.assert_close(got.float(), want.float(), atol=1e-5 * scale, rtol=1e-5)


def left_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return ids, mask


# --------------------------------------------------------------------------------------------
# The checkpoint and the logits
# --------------------------------------------------------------------------------------------


def test_config_and_registry(model):
    assert NATIVE_FAMILIES.get("sdar") is SDARBackbone
    c = model.config
    assert (c.vocab_size, c.block_size, c.mask_token_id, c.max_position_embeddings) == (VOCAB, BLOCK, MASK, 32768)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size) == (4, 2, 32, 64)
    assert model.get_output_embeddings() is model.lm_head and len(model.layers) == 2


@pytest.mark.parametrize("row", ROWS)
def test_logits_with_their_block_mask(model, row):
    ids, mask = GOLDEN[f"{row}_ids"][None], GOLDEN[f"{row}_mask"][None]  # mask [1, 1, T, T] bool
    with torch.no_grad():
        assert_logits(model(ids, attention_mask=mask).logits[0], GOLDEN[f"{row}_logits"])


@pytest.mark.parametrize("row", ROWS)
def test_default_layout_is_theirs(model, row):
    """No mask, or only a 2-D padding mask: the backbone builds block_diffusion_generate's layout."""
    ids = GOLDEN[f"{row}_ids"][None]
    with torch.no_grad():
        assert_logits(model(ids).logits[0], GOLDEN[f"{row}_logits"])
        assert_logits(model(ids, attention_mask=torch.ones_like(ids)).logits[0], GOLDEN[f"{row}_logits"])


@pytest.mark.pinned  # bf16 kernels differ by CPU: re-run under avx2 and default by test_portable_pins.py
def test_bf16_per_op_dtypes():
    """Stored bf16 weights, bf16 compute: their RMSNorm (float32 inside, weight in float32), RoPE
    (float32 angles cast to bf16) and masked SDPA, to the recorded bf16 logits.

    Their logits are those of an AVX2 CPU: under ATEN_CPU_CAPABILITY=avx2 all three rows are bit-equal.
    Other bf16 kernels round some sums the other way: AVX512, row 0 one ulp off (mean 0.0033), rows 1-2
    bit-equal; default (pre-AVX2), rows 0-1 up to 2.25 ulps off (0.141 at ulp 0.0625), mean 0.016-0.018,
    row 2 bit-equal. float32 compute (a wrong per-op dtype everywhere) is off by 0.031-0.039 on average
    and 0.16-0.23 at most. So: within 3 ulps at the row's largest logit (a sanity bound: float32's
    largest gap is 1.8-3.1 ulps), and a mean under 0.025, which is all the margin the kernels leave
    (1.4x the largest measured mean, 1.25x under float32's smallest)."""
    bf16 = SDARBackbone.from_pretrained(MODEL_DIR).eval()
    assert bf16.lm_head.weight.dtype == torch.bfloat16
    with torch.no_grad():
        for row in ROWS:
            got = bf16(GOLDEN[f"{row}_ids"][None]).logits[0]
            assert got.dtype == torch.bfloat16
            ref = GOLDEN[f"{row}_logits_bf16"].float()
            ulp = torch.exp2(torch.floor(torch.log2(ref.abs().max())) - 7)  # bf16 (8 significant bits) at the row's scale
            diff = (got.float() - ref).abs()
            assert diff.max() <= 3 * ulp, f"{row}: max |diff| {diff.max():.4f} is over 3 bf16 ulps ({ulp:.4f})"
            assert diff.mean() < 0.025, f"{row}: mean |diff| {diff.mean():.4f}"


def test_left_padded_batch_equals_unpadded_rows(model):
    ids, mask = left_pad([GOLDEN[f"{row}_ids"] for row in ROWS])
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits  # [3, T, V]
    for i, row in enumerate(ROWS):
        n = len(GOLDEN[f"{row}_ids"])
        assert_logits(logits[i, -n:], GOLDEN[f"{row}_logits"])


@pytest.mark.parametrize("row", ROWS)
def test_kv_cache_of_complete_blocks_is_exact(model, row):
    ids, want = GOLDEN[f"{row}_ids"][None], GOLDEN[f"{row}_logits"]
    cut = META["logits_rows"][row]["cache_cut"]  # the complete blocks before the last one
    assert cut % BLOCK == 0 and 0 < cut < ids.shape[1]
    with torch.no_grad():
        prefix = model(ids[:, :cut], use_cache=True)
        cached = model(ids[:, cut:], past_key_values=prefix.past_key_values, use_cache=True)
    k, v = cached.past_key_values[0]
    assert k.shape == v.shape == (1, 2, ids.shape[1], 32)  # [B, H_kv, T_past + T, Dh]
    assert_logits(prefix.logits[0], want[:cut])
    assert_logits(cached.logits[0], want[cut:])


def test_kv_cache_left_padded(model):
    """Rows cached up to different block boundaries, the prefix left-padded, 2-D mask over (cache, new)."""
    rows, cuts = [GOLDEN["row0_ids"], GOLDEN["row1_ids"]], [8, 16]
    prefix_ids, prefix_mask = left_pad([r[:c] for r, c in zip(rows, cuts)])  # row0's prefix padded by 8
    new = torch.stack([r[c:c + BLOCK] for r, c in zip(rows, cuts)])  # [2, 4]: the next block of each
    with torch.no_grad():
        past = model(prefix_ids, attention_mask=prefix_mask, use_cache=True).past_key_values
        mask = torch.cat([prefix_mask, torch.ones_like(new)], dim=1)  # [2, 16 + 4]
        logits = model(new, attention_mask=mask, past_key_values=past).logits
    for i, (row, cut) in enumerate(zip(("row0", "row1"), cuts)):
        assert_logits(logits[i], GOLDEN[f"{row}_logits"][cut:cut + BLOCK])


def test_logits_to_keep_and_hidden_states(model):
    ids, want = GOLDEN["row1_ids"][None], GOLDEN["row1_logits"]
    with torch.no_grad():
        out = model(ids, logits_to_keep=5)
        picked = model(ids, logits_to_keep=torch.tensor([0, 7, 30]))
    assert_logits(out.logits[0], want[-5:])
    assert_logits(picked.logits[0], want[[0, 7, 30]])
    assert out.hidden_states.shape == (1, ids.shape[1], 64)
    assert_logits(model.lm_head(out.hidden_states)[0], want)


def test_gradient_checkpointing_gives_the_same_gradients(model):
    ids = GOLDEN["row0_ids"][None]
    grads = []
    for enabled in (False, True):
        model.zero_grad()
        (model.gradient_checkpointing_enable if enabled else model.gradient_checkpointing_disable)()
        model.train()
        model(ids).logits.logsumexp(-1).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    model.gradient_checkpointing_disable()
    model.eval()
    model.zero_grad(set_to_none=True)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


# --------------------------------------------------------------------------------------------
# The official layout on disk
# --------------------------------------------------------------------------------------------


def test_save_reload_keeps_the_official_layout(model, tmp_path):
    model.save_pretrained(tmp_path)
    official = set(load_file(str(MODEL_DIR / "model.safetensors")))
    assert set(load_file(str(tmp_path / "model.safetensors"))) == official
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads((MODEL_DIR / "config.json").read_text())
    again = SDARBackbone.from_pretrained(tmp_path).eval()
    ids = GOLDEN["row0_ids"][None]
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


def test_tied_embeddings_round_trip(tmp_path):
    src = tmp_path / "tied"
    shutil.copytree(MODEL_DIR, src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    state = load_file(str(src / "model.safetensors"))
    del state["lm_head.weight"]
    save_file(state, str(src / "model.safetensors"))
    tied = SDARBackbone.from_pretrained(src, dtype=torch.float32)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    tied.save_pretrained(tmp_path / "out")
    assert set(load_file(str(tmp_path / "out" / "model.safetensors"))) == set(state)


@pytest.mark.parametrize("change", ["rename", "drop"])
def test_bad_weight_names_are_refused(tmp_path, change):
    bad = tmp_path / "bad"
    shutil.copytree(MODEL_DIR, bad)
    state = load_file(str(bad / "model.safetensors"))
    weight = state.pop("model.layers.0.self_attn.q_norm.weight")
    if change == "rename":
        state["model.layers.0.self_attn.query_norm.weight"] = weight
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(ModelDirectoryError, match="q_norm"):
        SDARBackbone.from_pretrained(bad)


def test_tokenizer_files_reproduce_their_prompt_ids():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR), trust_remote_code=False)
    assert (tok.mask_token, tok.mask_token_id, tok.eos_token_id, tok.pad_token_id) == ("<|MASK|>", MASK, PAD, PAD)
    for residue, key in (("1", "p1"), ("3", "p3")):
        text = tok.apply_chat_template([{"role": "user", "content": META["messages"][residue]}],
                                       add_generation_prompt=True, tokenize=False)
        assert tok(text, add_special_tokens=False)["input_ids"] == GOLDEN[f"prompt_{key}"].tolist()


# --------------------------------------------------------------------------------------------
# SDAR's decoding rules (ddrl.sampling.sdar) against the values their sampler computed
# --------------------------------------------------------------------------------------------

STEP_RUNS = ("p1_dynamic_s4", "p3_dynamic_s4", "p0_dynamic_s2")


@pytest.mark.parametrize("run", STEP_RUNS)
def test_greedy_confidence_is_theirs(run):
    tokens, probs = tempered_confidence(GOLDEN[f"steps_{run}_logits"], 0.0)
    assert torch.equal(tokens, GOLDEN[f"steps_{run}_x0"])
    torch.testing.assert_close(probs, GOLDEN[f"steps_{run}_x0_p"], atol=1e-7, rtol=1e-6)


def test_tempered_top_k_top_p_confidence_is_theirs():
    logits, tempered = GOLDEN["steps_p1_dynamic_s4_logits"], META["tempered"]
    filtered = tempered["greedy_filtered"]
    tokens, probs = tempered_confidence(logits, 0.0, filtered["top_k"], filtered["top_p"])
    assert torch.equal(tokens, GOLDEN["tempered_greedy_filtered_tokens"])
    torch.testing.assert_close(probs, GOLDEN["tempered_greedy_filtered_probs"], atol=1e-7, rtol=1e-6)
    seeded = tempered["seeded"]
    generator = torch.Generator().manual_seed(seeded["seed"])  # their torch.manual_seed(seed), made explicit
    tokens, probs = tempered_confidence(logits, seeded["temperature"], seeded["top_k"], seeded["top_p"],
                                        generator=generator)
    assert torch.equal(tokens, GOLDEN["tempered_seeded_tokens"])
    torch.testing.assert_close(probs, GOLDEN["tempered_seeded_probs"], atol=1e-7, rtol=1e-6)
    # ddrl's row noise (Gumbel-max) draws from the same filtered distribution: only kept tokens.
    u = torch.rand(*logits.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tokens, probs = tempered_confidence(logits, seeded["temperature"], seeded["top_k"], seeded["top_p"], uniforms=u)
    kept = logits.topk(seeded["top_k"], dim=-1).indices
    assert bool((tokens[..., None] == kept).any(-1).all()) and bool((probs > 0).all())


@pytest.mark.parametrize("run", STEP_RUNS)
def test_commit_dynamic_is_theirs(run):
    """Their commits at every recorded step. Where a step's k exceeds the masked count their top-k
    over -inf also rewrites decoded positions (p0_dynamic_s2, golden.json notes); there ddrl commits
    the masked ones only, and the comparison is restricted to masked positions."""
    masked, theirs = GOLDEN[f"steps_{run}_masked"], GOLDEN[f"steps_{run}_committed"]
    committed = commit_dynamic(GOLDEN[f"steps_{run}_x0_p"], masked, THRESHOLD, GOLDEN[f"steps_{run}_k"])
    overwrites = (theirs & ~masked).any(dim=1)  # [S]
    assert torch.equal(committed[~overwrites], theirs[~overwrites])
    assert torch.equal(committed[overwrites], theirs[overwrites] & masked[overwrites])
    assert int(overwrites.sum()) == sum(r["unmasked_positions_overwritten"] for r in META["generate"]["runs"]
                                        if r["run"] == run)


def test_commit_dynamic_by_hand():
    conf = torch.tensor([[0.9, 0.8, 0.1, 0.95], [0.2, 0.7, 0.3, 0.1], [0.99, 0.2, 0.1, 0.3]])
    masked = torch.tensor([[True, True, True, False], [True, True, True, True], [False, False, True, False]])
    got = commit_dynamic(conf, masked, 0.5, torch.tensor([2, 2, 3]))
    assert got.tolist() == [[True, True, False, False],  # 2 masked above 0.5 >= k: those (never the unmasked 0.95)
                            [False, True, True, False],  # 1 above < k: the top 2
                            [False, False, True, False]]  # k > masked: only the masked one
    assert not commit_dynamic(conf, masked, 0.5, torch.tensor(0)).logical_and(~masked).any()
    strict = commit_dynamic(torch.tensor([[0.5, 0.5]]), torch.tensor([[True, True]]), 0.5, torch.tensor([1]))
    assert strict.sum() == 1  # "> threshold": confidences equal to it do not count


# --------------------------------------------------------------------------------------------
# ddrl's sampler (uncached and with the exact block cache) vs block_diffusion_generate
# --------------------------------------------------------------------------------------------

# Runs in which their top-k over -inf rewrote decoded tokens are not reproducible by design (golden.json notes).
GEN_RUNS = [r for r in META["generate"]["runs"] if r["unmasked_positions_overwritten"] == 0]


def completion_blocks(prompt_length: int, gen_length: int) -> int:
    """Blocks holding completion tokens: SDAR decodes blocks (prompt_length // B) .. ((P + L - 1) // B)."""
    return -(-(prompt_length + gen_length) // BLOCK) - prompt_length // BLOCK


def ddrl_generate(model: SDARBackbone, prompt_ids, attention_mask, run: dict, cache: str = "none") -> torch.Tensor:
    from ddrl.models.diffusion_lm import DiffusionLM
    from ddrl.sampling.masked import generate

    lm = DiffusionLM(model, None, mask_token_id=MASK, vocab_size=VOCAB, block_size=BLOCK, family="sdar").eval()
    dynamic = run["remasking_strategy"] == "low_confidence_dynamic"
    steps = run["denoising_steps"] * completion_blocks(run["prompt_length"], run["gen_length"])
    out = generate(lm, prompt_ids, attention_mask, steps=steps, gen_length=run["gen_length"], block_length=BLOCK,
                   temperature=0.0, remasking="sdar_dynamic" if dynamic else "low_confidence",
                   threshold=run["confidence_threshold"] if dynamic else None, mask_id=MASK, cache=cache)
    return out[:, prompt_ids.shape[1]:]


@pytest.mark.parametrize("cache", ["none", "auto"])
@pytest.mark.parametrize("run", GEN_RUNS, ids=[r["run"] for r in GEN_RUNS])
def test_sampler_reproduces_block_diffusion_generate(model, run, cache):
    """ddrl.sampling.masked.generate == block_diffusion_generate's greedy tokens.

    Step mapping. Their loop decodes the blocks prompt_length // B .. (P + L - 1) // B (B = block
    length; the first may hold the prompt's tail) and runs, per block, at most `denoising_steps`
    denoising calls (range(denoising_steps + 1), breaking when no mask is left; the extra call only
    stores the block's KV cache). Step s of a block commits k_s = get_num_transfer_tokens(B,
    denoising_steps)[s] = B // denoising_steps (+1 for s < B % denoising_steps) tokens under
    low_confidence_static, and under low_confidence_dynamic all masked positions above the threshold
    when there are >= k_s of them, else the top k_s. So ddrl's `steps` (model calls in total, split
    evenly over the completion's blocks) is

        steps = denoising_steps * (ceil((P + L) / B) - floor(P / B))

    and ddrl's steps per block equals denoising_steps. In full blocks ddrl's LLaDA counts
    (n_masked // spb, +1 in the first n_masked % spb steps) equal k_s; in the partial first block
    they equal k_s while it is filled when denoising_steps == B (one token per step; the recorded
    runs use that, or prompts that fill whole blocks), and ddrl's trailing steps there commit
    nothing. ddrl's "sdar_dynamic" rule takes k_s from B (not from n_masked), as theirs does, and
    clips it to the masked count (commit_dynamic never commits an unmasked position; theirs would
    overwrite prompt tokens, golden.json notes). These runs end on a block boundary (P + L a
    multiple of B); test_sampler_off_the_block_boundary has those that do not.
    """
    prompt = GOLDEN[f"prompt_{run['prompt']}"][None]
    got = ddrl_generate(model, prompt, torch.ones_like(prompt), run, cache)
    assert got[0].tolist() == GOLDEN[f"gen_{run['run']}"].tolist()


@pytest.mark.parametrize("cache", ["none", "auto"])
@pytest.mark.parametrize("strategy", ["static", "dynamic"])
def test_sampler_left_padded_batch(model, strategy, cache):
    """p2 (30 tokens) and p2b (22) end 2 tokens into a block, so with the same gen_length their
    completions share block boundaries; each row must get its unpadded tokens."""
    runs = {r["run"]: r for r in GEN_RUNS}
    run = runs[f"p2_{strategy}_s4"]
    assert runs[f"p2b_{strategy}_s4"]["gen_length"] == run["gen_length"]
    ids, mask = left_pad([GOLDEN["prompt_p2"], GOLDEN["prompt_p2b"]])
    got = ddrl_generate(model, ids, mask, run, cache)
    assert got[0].tolist() == GOLDEN[f"gen_p2_{strategy}_s4"].tolist()
    assert got[1].tolist() == GOLDEN[f"gen_p2b_{strategy}_s4"].tolist()


# Off the block boundary: SDAR's canvas is ceil((P + L) / B) * B, so its last block also decodes mask
# slots past gen_length (golden_unaligned.json notes); ddrl decodes them too and returns gen_length tokens.
UNALIGNED_RUNS = [r for r in UNALIGNED_META["generate"]["runs"] if r["unmasked_positions_overwritten"] == 0]


def test_unaligned_fixture_ends_inside_blocks():
    """The fixture covers what it is for: runs whose last block reaches past gen_length, with and
    without a prompt that ends inside a block (offset 0: p0)."""
    past = {(r["prompt"], r["gen_length"]) for r in UNALIGNED_RUNS if r["decoded_past_gen_length"] > 0}
    assert ("p0", 6) in past and ("p1", 6) in past and len(past) >= 6
    for r in UNALIGNED_RUNS:
        assert r["decoded_past_gen_length"] == -(r["prompt_length"] + r["gen_length"]) % BLOCK


@pytest.mark.parametrize("cache", ["none", "auto"])
@pytest.mark.parametrize("run", UNALIGNED_RUNS, ids=[r["run"] for r in UNALIGNED_RUNS])
def test_sampler_off_the_block_boundary(model, run, cache):
    """ddrl's gen_length tokens == the first gen_length of block_diffusion_generate's, for prompts and
    lengths whose end is inside a block (step mapping: test_sampler_reproduces_block_diffusion_generate)."""
    prompt = UNALIGNED[f"prompt_{run['prompt']}"][None]
    got = ddrl_generate(model, prompt, torch.ones_like(prompt), run, cache)
    assert got.shape == (1, run["gen_length"])
    assert got[0].tolist() == UNALIGNED[f"gen_{run['run']}"][:run["gen_length"]].tolist()


@pytest.mark.parametrize("cache", ["none", "auto"])
@pytest.mark.parametrize("gen_length", sorted({r["gen_length"] for r in UNALIGNED_RUNS}))
def test_sampler_off_the_block_boundary_left_padded_batch(model, gen_length, cache):
    """The five prompts (lengths 24, 17, 30, 27, 22: every offset, rows whose last block ends at
    different slots, some on the boundary) in one left-padded batch: each row gets its unpadded
    row's SDAR tokens (padding invariance of the trailing slots)."""
    keys = ["p0", "p1", "p2", "p3", "p2b"]
    runs = {r["run"]: r for r in UNALIGNED_RUNS}
    ids, mask = left_pad([UNALIGNED[f"prompt_{k}"] for k in keys])
    for strategy in ("static", "dynamic"):
        chosen = [runs[f"{k}_L{gen_length}_{strategy}_s4"] for k in keys]
        # ddrl's steps split evenly over the batch's blocks: the widest row's (ddrl_generate takes it from one run)
        widest = max(chosen, key=lambda r: completion_blocks(r["prompt_length"], gen_length))
        got = ddrl_generate(model, ids, mask, widest, cache)
        for row, (k, r) in enumerate(zip(keys, chosen)):
            assert got[row].tolist() == UNALIGNED[f"gen_{r['run']}"][:gen_length].tolist(), k
