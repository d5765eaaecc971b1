"""The memory model's block term (ddrl.training.memory.block_saved_bytes) against what each native
block really keeps for backward: autograd's saved tensors of one block in a training forward of the
family's tiny fixture, per token (tests/saved_activations.py), under LoRA (base frozen, ddrl's
apply_lora) and full fine-tuning, with fp32 weights under bf16 autocast (DDP, one process) and with
bf16 weights (FSDP2's MixedPrecisionPolicy). The shape comes from the fixture's config.json
(model_shape), so the family traits and head_dim that shape_from_config reads are checked too.
Equal to the byte: every term of the formula moves the total, so removing one fails a case.

Issue 33: URSA's full fine-tuning was 1.17 x the hand model because its block term was LoRA's
(no trainable-base inputs, no q/k norms, k and v counted at the key/value width)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ddrl.config import LoraConfig
from ddrl.training.memory import block_saved_bytes, model_shape
from tests.saved_activations import FAMILY_FIXTURES, block_saved_bytes_measured

# every linear of a block adapted, in each family's names (LLaDA's ff_out skips its LM head)
TARGETS = {"llada": ["q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out"],
           "llada2": ["query_key_value", "dense", "gate_proj", "up_proj", "down_proj"]}
TARGETS["mmada"] = TARGETS["llada"]
QWEN_NAMES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# weights as the forward reads them: fp32 under autocast (r = 4), bf16 under FSDP2 (r = 2); compute c = 2
COMPUTE = {"autocast": 4, "bf16": 2}
# (family, block index, compute): LLaDA2's fixture has a dense first block and MoE blocks after it. An MoE
# block is checked with bf16 weights only: every MoE recipe runs FSDP2, and under autocast its router runs
# in bf16 (not modelled) and its per-expert weight copies make the measurement vary with the routing
BLOCKS = [(family, 0, compute) for family in ("llada", "mmada", "dream", "sdar", "ursa", "llada2")
          for compute in COMPUTE] + [("llada2", 1, "bf16")]
# Blocks that build an fp32 additive [B, 1, T, T] mask and hand it to SDPA under autocast, which casts it to
# bf16 per block: 2 bytes per (query, key) pair, quadratic in T, outside the per-token formula
MASK_CAST = {"sdar", "llada2"}


def _lora(family: str, rank: int) -> LoraConfig:
    return LoraConfig(rank=rank, alpha=16, dropout=0.05, target_modules=TARGETS.get(family, QWEN_NAMES))


@pytest.mark.parametrize("lora_rank", [0, 8], ids=["full", "lora"])
@pytest.mark.parametrize("family,index,compute", BLOCKS, ids=[f"{f}-{i}-{c}" for f, i, c in BLOCKS])
def test_block_term_is_what_the_block_saves(family, index, compute, lora_rank):
    shape = model_shape(str(FAMILY_FIXTURES[family]))
    moe = bool(shape.moe_layers) and index >= shape.dense_layers
    lora = _lora(family, lora_rank)
    cfg = SimpleNamespace(model=SimpleNamespace(lora=lora))
    per_token, per_pair = block_saved_bytes_measured(family, lora=lora if lora_rank else None, compute=compute,
                                                     layer_index=index)
    assert block_saved_bytes(cfg, shape, 2, COMPUTE[compute], moe=moe) == per_token
    assert per_pair == (2 if compute == "autocast" and family in MASK_CAST else 0)


def test_the_fixture_shapes_carry_their_family_traits():
    """shape_from_config reads what decides the block term from config.json: Qwen3's per-head norms and
    fp32-weight RMSNorm (URSA, SDAR), LLaDA2's fused QKV and head norms, URSA's default head_dim 128
    (its fixture names none: 64 / 2 heads would be 32)."""
    ursa, sdar, llada2, llada = (model_shape(str(FAMILY_FIXTURES[f])) for f in ("ursa", "sdar", "llada2", "llada"))
    assert (ursa.head_dim, ursa.q_dim, ursa.kv_dim) == (128, 256, 128)
    assert ursa.qk_norm and ursa.norm_weight_fp32 and not ursa.fused_qkv
    assert sdar.qk_norm and sdar.norm_weight_fp32
    assert llada2.qk_norm and llada2.fused_qkv and not llada2.norm_weight_fp32
    assert not (llada.qk_norm or llada.norm_weight_fp32 or llada.fused_qkv)
