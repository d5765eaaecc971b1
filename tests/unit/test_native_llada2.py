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
from ddrl.models.native.llada2 import LLaDA2Backbone, LLaDA2Router, routed_experts

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
