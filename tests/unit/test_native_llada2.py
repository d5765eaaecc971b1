"""ddrl's native LLaDA2.0 / LLaDA2.1 backbone (block-diffusion MoE) and their samplers against the
authors' own outputs.

The oracle is tests/fixtures/llada2/ (made by tests/fixtures/make_llada2.py): the hub
modeling_llada2_moe.py of LLaDA2.0-mini and LLaDA2.1-mini (yjyddq/DARE @ 83ae8a3) run on tiny
checkpoints in the hub layout (sharded safetensors, their weight names): float32 logits under the
block mask their generate() builds, each MoE layer's router choices, and the greedy tokens of both
generate() functions. Their generate() takes one unpadded row, so the reference for a left-padded
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
from ddrl.models.native.llada2 import LLaDA2Backbone, LLaDA2Router, WeightedSlots, routed_experts

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "llada2"
GOLDEN = load_file(str(FIXTURE / "golden.safetensors"))
META = json.loads((FIXTURE / "golden.json").read_text())
VERSIONS = ("2.0", "2.1")
ROWS = ("row0", "row1", "row2")
BLOCK, MASK, EOS, VOCAB = 32, 123, 120, 128


def model_dir(version: str) -> Path:
    return FIXTURE / f"model-{version}"


@pytest.fixture(scope="module", params=VERSIONS)
def loaded(request) -> tuple[str, LLaDA2Backbone]:
    return request.param, LLaDA2Backbone.from_pretrained(model_dir(request.param), dtype=torch.float32).eval()


def key(version: str, name: str) -> str:
    return f"v{version.replace('.', '')}_{name}"


def assert_logits(got: torch.Tensor, want: torch.Tensor) -> None:
    """1e-5 relative to the logits' scale."""
    scale = max(1.0, float(want.abs().max()))
    torch.testing.assert_close(got.float(), want.float(), atol=1e-5 * scale, rtol=1e-5)


def left_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), EOS, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return ids, mask


class RouterLog:
    """Forward hooks on every mlp.gate: each call's expert ids [N, k]."""

    def __init__(self, model: LLaDA2Backbone):
        self.calls: list[torch.Tensor] = []
        self.handles = [m.register_forward_hook(lambda _m, _i, out: self.calls.append(out[0]))
                        for m in model.modules() if isinstance(m, LLaDA2Router)]

    def close(self) -> None:
        for h in self.handles:
            h.remove()


# --------------------------------------------------------------------------------------------
# The checkpoint, the logits, the router
# --------------------------------------------------------------------------------------------


def test_config_and_registry(loaded):
    _, model = loaded
    assert NATIVE_FAMILIES.get("llada2") is LLaDA2Backbone
    c = model.config
    assert (c.vocab_size, c.block_size, c.hidden_size, c.head_dim, c.rotary_dim) == (VOCAB, BLOCK, 64, 32, 16)
    assert (c.num_experts, c.num_experts_per_tok, c.n_group, c.topk_group, c.num_shared_experts) == (8, 2, 4, 2, 1)
    assert len(model.layers) == 3 and not hasattr(model.layers[0].mlp, "gate")  # the first layer is dense
    assert model.layers[1].mlp.gate.expert_bias.abs().sum() > 0  # the fixture's bias is loaded


@pytest.mark.parametrize("row", ROWS)
def test_logits_and_router_choices(loaded, row):
    """No mask: the block layout of their generate(); logits within 1e-5, router choices identical."""
    version, model = loaded
    ids = GOLDEN[key(version, f"{row}_ids")][None]
    log = RouterLog(model)
    try:
        with torch.no_grad():
            logits = model(ids).logits[0]
    finally:
        log.close()
    assert logits.dtype == torch.float32
    assert_logits(logits, GOLDEN[key(version, f"{row}_logits")])
    want = GOLDEN[key(version, f"{row}_topk_idx")]  # [MoE layers, T, k]
    got = torch.stack(log.calls)
    assert got.shape == want.shape
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    assert META["per_version"][version]["rows"][row]["group_limit_changes_choice_tokens"] > 0


def test_left_padded_batch_is_each_row_unpadded(loaded):
    version, model = loaded
    rows = [GOLDEN[key(version, f"{r}_ids")] for r in ROWS]
    ids, mask = left_pad(rows)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    for i, r in enumerate(ROWS):
        assert_logits(logits[i, ids.shape[1] - len(rows[i]):], GOLDEN[key(version, f"{r}_logits")])


def test_block_cache_gives_the_full_logits(loaded):
    """The exact block cache: the complete blocks cached, the last block fed alone."""
    version, model = loaded
    ids = GOLDEN[key(version, "row0_ids")][None]
    cut = (ids.shape[1] - 1) // BLOCK * BLOCK
    with torch.no_grad():
        past = model(ids[:, :cut], use_cache=True).past_key_values
        tail = model(ids[:, cut:], past_key_values=past).logits[0]
    assert_logits(tail, GOLDEN[key(version, "row0_logits")][cut:])


def test_router_matches_a_per_token_transcription():
    """Group-limited top-k against a plain per-token loop over groups (the released rule, written out)."""
    torch.manual_seed(0)
    model = LLaDA2Backbone.from_pretrained(model_dir("2.0"), dtype=torch.float32)
    gate = model.layers[1].mlp.gate
    h = torch.randn(40, 64)
    idx, w, logits = gate(h)
    s = torch.sigmoid(h @ gate.weight.T)
    for n in range(40):
        biased = s[n] + gate.expert_bias
        groups = biased.view(4, 2).sum(-1)  # 2 experts per group: the top-2 sum is the sum
        kept = sorted(groups.argsort(descending=True)[:2].tolist())
        allowed = torch.tensor([e // 2 in kept for e in range(8)])
        choice = biased.masked_fill(~allowed, -1e9).argsort(descending=True)[:2]
        assert sorted(idx[n].tolist()) == sorted(choice.tolist())
        expect = s[n, choice] / s[n, choice].sum() * 2.5
        torch.testing.assert_close(w[n].sort().values, expect.sort().values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weighted_slots_equal_autograd_over_the_modeling_files_ops(dtype):
    """WeightedSlots (memory: keeps the slots once, a slot at a time in backward) gives the values and the
    gradients of autograd over the modeling file's `.type(fp32).mul_(weights).sum(1).type(dtype)`; an
    fp32 model's slots are not weighted in place (they are what backward reads)."""
    torch.manual_seed(3)
    slots, weights = torch.randn(13, 3, 64).to(dtype), torch.rand(13, 3)
    a, wa = slots.clone().requires_grad_(), weights.clone().requires_grad_()
    b, wb = slots.clone().requires_grad_(), weights.clone().requires_grad_()
    want = (a.to(torch.float32) * wa[..., None]).sum(dim=1).to(dtype)
    got = WeightedSlots.apply(b, wb)
    assert got.dtype == dtype and torch.equal(got, want) and torch.equal(b, slots)
    grad = torch.randn(13, 64).to(dtype)
    want.backward(grad)
    got.backward(grad)
    assert torch.equal(b.grad, a.grad)  # one product a slot, cast: the same elements
    torch.testing.assert_close(wb.grad, wa.grad)  # a sum over d each


def test_routed_experts_equal_a_loop_over_tokens_and_train_every_expert():
    torch.manual_seed(1)
    model = LLaDA2Backbone.from_pretrained(model_dir("2.0"), dtype=torch.float32)
    moe = model.layers[1].mlp
    x = torch.randn(13, 64)
    idx = torch.tensor([[0, 3]] * 13)  # experts other than 0 and 3 get no token
    w = torch.rand(13, 2)
    got = routed_experts(moe.experts, x, idx, w)
    want = torch.stack([sum(w[n, j] * moe.experts[int(idx[n, j])](x[n]) for j in range(2)) for n in range(13)])
    torch.testing.assert_close(got, want)
    got.sum().backward()
    assert all(p.grad is not None for p in moe.experts.parameters())  # unused experts are in the graph


def test_save_round_trip_keeps_the_official_layout(tmp_path):
    model = LLaDA2Backbone.from_pretrained(model_dir("2.1"), dtype=torch.float32)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config == json.loads((model_dir("2.1") / "config.json").read_text())
    again = LLaDA2Backbone.from_pretrained(tmp_path)
    ids = GOLDEN["v21_row1_ids"][None]
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits)
    names = set(json.loads((model_dir("2.1") / "model.safetensors.index.json").read_text())["weight_map"])
    assert set(again.state_dict()) == names


def test_block_size_from_generation_config_and_conflicts(tmp_path):
    shutil.copytree(model_dir("2.0"), tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"pad_token_id": EOS, "block_length": 8}))
    assert LLaDA2Backbone.from_pretrained(tmp_path / "m").config.block_size == 8
    with pytest.raises(ValueError, match="block_size=4 contradicts"):
        LLaDA2Backbone.from_pretrained(tmp_path / "m", block_size=4)


def test_foreign_weights_fail_before_loading(tmp_path):
    shutil.copytree(model_dir("2.0"), tmp_path / "m")
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())["weight_map"]
    shard = tmp_path / "m" / index["model.word_embeddings.weight"]
    state = load_file(str(shard))
    state["model.embed_tokens.weight"] = state.pop("model.word_embeddings.weight")  # a Qwen-style name
    save_file(state, str(shard))
    with pytest.raises(ModelDirectoryError, match="not a llada2_moe checkpoint"):
        LLaDA2Backbone.from_pretrained(tmp_path / "m")


# --------------------------------------------------------------------------------------------
# ddrl.load_model and the samplers: tokens equal to both generate() functions
# --------------------------------------------------------------------------------------------


def runs(version: str) -> list[dict]:
    return META["per_version"][version]["generate"]["runs"]


def settings(version: str) -> dict:
    return META["per_version"][version]["generate"]["settings"]


@pytest.fixture(scope="module")
def lm20():
    import ddrl

    return ddrl.load_model(model_dir("2.0"), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def lm21():
    import ddrl

    return ddrl.load_model(model_dir("2.1"), dtype=torch.float32).eval()


def test_load_model_reads_the_official_directory_natively(lm20):
    """auto_map names their code; the family is native, so none of it is needed or run."""
    assert json.loads((model_dir("2.0") / "config.json").read_text())["auto_map"]
    assert lm20.family == "llada2" and lm20.block_size == BLOCK and lm20.mask_token_id == MASK
    assert isinstance(lm20.model, LLaDA2Backbone) and lm20.process_spec["name"] == "block"
    ids = GOLDEN["v20_row0_ids"][None]
    with torch.no_grad():
        assert_logits(lm20(ids).logits[0], GOLDEN["v20_row0_logits"])


def threshold_generate(lm, prompt_ids, mask, gen_length: int, cache: str) -> torch.Tensor:
    """LLaDA2.0's generate() as ddrl's block sampler: SDAR's dynamic rule (commit every masked slot
    above the threshold if there are >= k, else the top k) with k from get_num_transfer_tokens(
    block_length, steps), their steps = min(steps, gen_length) per block; ddrl's steps are per
    ceil(gen_length / block_length) blocks."""
    from ddrl.sampling.masked import generate

    spb = min(settings("2.0")["steps"], gen_length)
    out = generate(lm, prompt_ids, mask, steps=spb * -(-gen_length // BLOCK), gen_length=gen_length,
                   block_length=BLOCK, temperature=0.0, remasking="sdar_dynamic",
                   threshold=settings("2.0")["threshold"], mask_id=MASK, cache=cache)
    return out[:, prompt_ids.shape[1]:]


@pytest.mark.parametrize("cache", ["none", "auto"])
@pytest.mark.parametrize("run", runs("2.0"), ids=lambda r: f"p{r['prompt']}_L{r['gen_length']}")
def test_threshold_decoding_reproduces_llada20_generate(lm20, run, cache):
    """Their generate() returns the completion up to its first EOS (and stops decoding after the
    block holding it); ddrl's tokens up to there are theirs."""
    prompt = GOLDEN[f"v20_prompt{run['prompt']}"][None]
    want = GOLDEN[f"v20_gen_p{run['prompt']}_L{run['gen_length']}"]
    got = threshold_generate(lm20, prompt, torch.ones_like(prompt), run["gen_length"], cache)
    assert got[0, :len(want)].tolist() == want.tolist()


def test_threshold_decoding_left_padded_batch(lm20):
    L = 56
    prompts = [GOLDEN[f"v20_prompt{i}"] for i in range(4)]
    ids, mask = left_pad(prompts)
    got = threshold_generate(lm20, ids, mask, L, "auto")
    for i in range(4):
        want = GOLDEN[f"v20_gen_p{i}_L{L}"]
        assert got[i, :len(want)].tolist() == want.tolist(), i


def edit_kwargs() -> dict:
    s = settings("2.1")
    return {"threshold": s["threshold"], "editing_threshold": s["editing_threshold"],
            "max_post_steps": s["max_post_steps"], "num_to_transfer": s["num_to_transfer"]}


@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("run", runs("2.1"), ids=lambda r: f"p{r['prompt']}_L{r['gen_length']}")
def test_token_editing_reproduces_llada21_generate(lm21, run, cache):
    """Tokens up to their first EOS equal; without the cache, as many model calls as theirs."""
    from ddrl.sampling.llada2 import edit_generate

    assert run["edits_seen"] > 0  # editing fires on this model
    prompt = GOLDEN[f"v21_prompt{run['prompt']}"][None]
    want = GOLDEN[f"v21_gen_p{run['prompt']}_L{run['gen_length']}"]
    got, nfe = edit_generate(lm21, prompt, None, gen_length=run["gen_length"], cache=cache, **edit_kwargs())
    assert got[0, :len(want)].tolist() == want.tolist()
    if not cache:
        assert nfe == run["model_calls"]


def test_llada21_as_shipped_differs_and_is_recorded():
    """Their 2.1 generate() adds a 0/1 mask (nothing masked); the fixture says where that changes tokens."""
    assert all(r["as_shipped_differs"] for r in runs("2.1"))
    assert all(f"v21_genasis_p{r['prompt']}_L{r['gen_length']}" in GOLDEN for r in runs("2.1"))


def test_token_editing_left_padded_batch(lm21):
    from ddrl.sampling.llada2 import edit_generate

    L = 56
    ids, mask = left_pad([GOLDEN[f"v21_prompt{i}"] for i in range(4)])
    got, _ = edit_generate(lm21, ids, mask, gen_length=L, **edit_kwargs())
    for i in range(4):
        want = GOLDEN[f"v21_gen_p{i}_L{L}"]
        assert got[i, :len(want)].tolist() == want.tolist(), i


def test_auto_picks_each_versions_own_sampler(tmp_path, lm20):
    """The two versions' config.json files are the same: 2.1 is told by its modeling file's generate()
    (read as text, never run) or generation_config.json's editing_threshold; a save keeps it."""
    import ddrl
    from ddrl.sampling.checks import resolve_sampler

    assert resolve_sampler(lm20, "auto") == "block"
    shutil.copytree(model_dir("2.1"), tmp_path / "m")
    (tmp_path / "m" / "modeling_llada2_moe.py").write_text("def generate(self, editing_threshold=0.9): ...\n")
    edited = ddrl.load_model(tmp_path / "m", dtype=torch.float32)
    assert resolve_sampler(edited, "auto") == "llada2_edit" and resolve_sampler(edited, "block") == "block"
    edited.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved" / "modeling_llada2_moe.py").exists()
    assert resolve_sampler(ddrl.load_model(tmp_path / "saved"), "auto") == "llada2_edit"


def test_llada2_edit_registry_sampler(lm21):
    from types import SimpleNamespace

    from ddrl.registry import SAMPLERS

    run = runs("2.1")[2]
    prompt = GOLDEN[f"v21_prompt{run['prompt']}"][None]
    s = settings("2.1")
    cfg = SimpleNamespace(gen_length=run["gen_length"], block_length=None, threshold=s["threshold"],
                          editing_threshold=s["editing_threshold"], max_post_steps=s["max_post_steps"],
                          temperature=0.0, cache="auto", steps=1)
    out = SAMPLERS.get("llada2_edit")(lm21, prompt, None, cfg, generator=None)
    want = GOLDEN[f"v21_gen_p{run['prompt']}_L{run['gen_length']}"]
    assert out.completion_ids[0, :len(want)].tolist() == want.tolist()
    g = torch.Generator().manual_seed(0)
    cfg.temperature = 1.0
    drawn = SAMPLERS.get("llada2_edit")(lm21, prompt, None, cfg, generator=g).completion_ids
    assert drawn.shape == (1, run["gen_length"]) and not (drawn == MASK).any()
