"""How much device memory one rank of `ddrl train` needs: an estimate from the config and the model's
shape, without loading weights (`ddrl train --dry-run CONFIG [overrides] --world-size N`), and the
start-up check that refuses a run that cannot fit.

Terms (bytes per rank; N = ranks sharing the state under FSDP, else 1; P = parameters, P_t = trainable
parameters; b = bytes per stored weight (fp32 4, a bf16 LoRA base 2); c = bytes per compute element (2
under model.mixed_precision=bf16, else b)):

  held for the whole run (on the host instead with dist.cpu_offload, FSDP2's CPUOffloadPolicy):
    weights        P b / N
    gradients      P_t 4 / N, alive from the first backward until the next share's zero_grad, so
                   through the optimizer step and the next rollout (FSDP2 reduce-scatters every
                   micro-batch: a shard, never the full gradient)
    AdamW          2 P_t 4 / N (exp_avg, exp_avg_sq in the fp32 parameter dtype)
    reference      P b / N when the method anchors a KL to a separate frozen copy (LoRA: none)
    DDP buckets    P_t 4: DDP's reducer keeps its own flat copy of the gradients
  then the largest of three phases:
    rollout        compute weights: FSDP all-gathers the whole model for generation (P c); DDP or
                   one process under bf16 autocast caches a bf16 copy of every fp32 weight that
                   requires grad for the whole autocast block (P_t 2)
                   + one no-grad forward over F rows x T tokens (one layer's transient, F T (4d + 3f) c;
                   an MoE block's instead when larger, F T m: below)
                   + the block's logits R W V (c + 12): compute dtype, then ~3 fp32 temporaries
                   (Gumbel uniforms, tempered logits, softmax); under guidance the larger of that and
                   R W V 4c (both passes' logits, 2R rows, and two temporaries of guided_logits).
                   An image model's samplers (N codes; emerge on a model.vq_path MMaDA, maskgit) ask the
                   model for the codebook's logits only (class_range: MMaDA's head computes N of its V
                   rows), R W n per call, n bytes a slot at a step's peak: the call's logits N c, under
                   guidance N (4c + 1) (the 2R rows' 2 N c, u + (w + 1)(c - u) and its masked copy, the
                   forbidden-id mask N), emerge's previous step's logits N c on top; then the draw:
                     maskgit   12 N: fp32 logits, softmax, uniforms (its draws were always over the codes)
                     emerge, rollout.rng=released   N (3c + 4): logits, softmax, its scaled copy, the fp32
                               [.., N + 1] multinomial input
                     emerge, rng=ddrl   N c + 4 V: the Gumbel uniforms still span every id (temperature > 0),
                               the noise stream keyed over [R, W, V] that a seed's tokens come from
                   n is the larger of the two (tests/unit/test_memory_model.py measures them).
                   URSA's metric_path sampler: R W N 12, three fp32 [R, W, N] tensors. Its head computes
                   the codebook's logits only (class_range: no [R, W, V] tensor) and a CTMC step holds at
                   most three: process.velocity's distances (scaled in place into the softmax input),
                   gain and path probabilities (the products and v[x_t] = 0 in place); before it z and
                   softmax(z) (8 N), z dropped before the velocity and the cdfs in place. Under guidance
                   the 2R rows' logits (2 N c + 8 N: c-dtype, then fp32) and then both halves and
                   c - u (12 N) are no more (ddrl.sampling.metric_path's Memory)
                   Dream's sampler (rollout.name=dream) steps over the whole completion, W = L: R L V n
                   with n = 2c + 24 under top-p (the logits and their masked rows' copy, then fp32
                   tempered logits, their sort's fp32 values and int64 order, its softmax and cumsum),
                   else 2c + 20 at temperature > 0 (fp32 probs, their float64 copy and its cumsum for
                   the inverse-CDF draw), max(2c + 9, c + 12) at temperature 0 (_dream_step_bytes;
                   the rehearsal measures 28 bytes with coupled_grpo's top-p, bf16: 2c + 24)
                   + the trajectory recorder, R W S_b V 4: fp32 probabilities of every step of a block
                     (methods that read token probabilities: DPS; TraceRL records commit order only;
                     an image model's samplers record over the N codes, R W S N 4)
    update         compute weights: FSDP holds ~2 gathered blocks (current + prefetch) and the root
                   (embeddings, head) in c, and one block's unsharded fp32 gradient before its
                   reduce-scatter; DDP / one process: the autocast cache P_t 2
                   + activations of one micro-batch, m rows x k copies x T tokens:
                     gradient checkpointing: every block's input (L d c) + one block recomputed (a)
                     else every block's activations L a, SwiGLU, attention by SDPA (no T x T matrix).
                       a (block_saved_bytes) is what autograd saves in ddrl's native blocks, measured for
                       every family, LoRA and full fine-tuning, autocast and FSDP2's bf16 weights
                       (tests/unit/test_block_saved_bytes.py, to the byte); r = bytes of a weight as the
                       forward reads it and of the residual stream (4 under autocast over fp32 weights,
                       c under FSDP2). Always: each RMSNorm's float32 input (4 d) and rsqrt (4 bytes a row;
                       Qwen3's x / sqrt keeps 12); SDPA's q, k and v as given (every block repeats k, v to
                       the H query heads first: q wide each, not kv) and its output, 4 q c, and its fp32
                       log-sum-exp, 4 H; the gate's output, its SiLU and the up projection's output, 3 f c.
                       Qwen3 and LLaDA2 (qk_norm) norm each query and key head too (4 (q + kv) and their
                       rows' scalars). Full fine-tuning (lora.rank = 0) adds what the weights' gradients
                       read: each norm's normalised x (r d; fp32 in Qwen3's norm, 4 d), the projections'
                       inputs (c d for q/k/v, c d for gate/up, c f for down; under autocast each linear
                       casts its own: 3 and 2 copies, one for LLaDA2's fused QKV). LoRA adds, per adapted
                       linear, its input cast to c for the adapter (c per input element), its dropout's
                       bool mask (1 per input element, dropout > 0) and the rank-wide middle (rank c); a
                       frozen base linear keeps no input. An MoE block: _moe_saved_bytes. The
                       rehearsal's tracker gives LLaDA-8B with d1's LoRA 23.6 units of T d c per block,
                       this 23 plus the middles, rsqrt and log-sum-exp (tests/unit/test_memory_model.py)
                     + the backward of one block: 5 f c per token beyond a (the rehearsal's tracker at
                     the update's peak, LLaDA-8B and URSA alike: the block's recomputed up projection and
                     7 [T, f] temporaries of SiLU's backward and the gated product's gradients, 8 f c,
                     where a counts 3); an MoE block's instead when larger: K d 4 + 4 d + 4 d c, its
                     recomputed forward at the router's weighting (WeightedSlots: the fp32 copy of the K
                     outputs and their fp32 sum) beside the block's residual stream, attention output
                     and normed input (measured on a real-width LLaDA2.0-mini MoE block: 90,048 bytes a
                     token, this 90,112; LLaDA2's dense block takes 3.4 f c, this 5:
                     tests/unit/test_memory_model.py)
                     + the final hidden states T d c and one chunk of 2**24 logits (c + 12 bytes
                     each): log p(target) is computed chunk by chunk, no [T, V] logits
                     (ddrl.ops.logprobs)
    optimizer      foreach AdamW on a GPU: one temporary of the trainable size, P_t 4 / N

R = rows per sampler call: a rank's rollout rows (prompts_per_step / ranks x group_size), or
rollout.batch_rows when that is fewer (the rollout in calls of that many rows); F = R, 2R under guidance
(rollout.cfg_scale > 0: conditional and unconditional rows in one forward); T = prompt + completion
tokens (the prompt: rollout.max_prompt_length, else 256), W = rollout.block_length, S_b = sampler
steps per block, N = an image model's codebook (config.json codebook_size; URSA's lm_head_size), m =
rows per micro-batch (train.micro_batch_size rounded down to whole groups, at least one group: the
trainer's micro-batches are whole groups; else all of a rank's rows), k = the copies of a row the
estimator declares (`copies_per_row`: copies, num_t, num_samples, num_strata, num_timesteps or
len(t_values); 2 num_mc for a coupled pair per draw, coupled_three_pass 3, a staircase row of twice
the length 2 num_t, concrete_score one sequence per probed position), batched in one forward and one
backward graph (rows_per_call splits the forward only);
with train.micro_batch_rows (an estimator's own training rows: TraceRL's trace states, UniGRPO's
(sample, copy) rows) m x k is micro_batch_rows.

Mixtures of experts (LLaDA2.0/2.1-mini: 16.3B parameters, 1.43B active). Weights, gradients, AdamW
state, the reference copy and FSDP's gathered units count every parameter (P: all experts; an FSDP unit
is a whole block, every expert in it); activations count what one token runs through. The no-grad
forward and the backward's temporaries take the larger of the dense first block's and an MoE block's:
the backward 5 f c (f = the dense block's 5120) against K d 4 + 4 d + 4 d c (above); the forward
(4 d + 3 f) c against m = 4 d c + K d (c + 4) + 4 d + 16 E a token:
routed_experts peaks where its K outputs, in (token, slot) order, are cast to fp32 for the router's
weights and summed (4 d), beside the block's residual stream and normed input, and the router's fp32
logits, scores, biased scores and group scores (measured on a real-width LLaDA2.0-mini MoE block with
MemTracker: 127,200 bytes a token, this 126,976; tests/unit/test_memory_model.py).
The saved activations take the larger of the dense and the MoE block's (_moe_saved_bytes: the experts
at the active width, the dispatch and the router as measured). K = experts per token, E = routed experts. The auxiliary balance loss (method.moe_aux_loss_coef) adds [E] per sequence and layer.
LoRA on gate/up/down_proj adapts every expert of an MoE block.

Not counted: the CUDA context and allocator fragmentation (~1-3 GB per GPU), NCCL buffers, the
tokenizer and data. The shapes of the /path/to/... placeholders of configs/paper are the published
config.json's (PLACEHOLDER_SHAPES; LLaDA-8B as bench/gpu/check.py's LLADA_8B; LLaDA2.0/2.1-mini as
yjyddq/DARE @ 83ae8a3 models/LLaDA2.0-mini/config.json).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GB = 1e9
DEFAULT_PROMPT_TOKENS = 256  # a chat-formatted math/code prompt, when rollout.max_prompt_length is unset
LOGPROB_CHUNK_ELEMENTS = 2**24  # ddrl.ops.logprobs.CHUNK_ELEMENTS: logits alive at once when scoring
NORM_ROW_SCALARS = 4  # fp32 bytes per normalised row an RMSNorm keeps: its rsqrt (LLaDA, Dream, LLaDA2)
NORM_ROW_SCALARS_FP32_WEIGHT = 12  # Qwen3's norm (1 / sqrt(mean + eps), weight in fp32): three fp32 a row
RECORDER_BYTES = 4  # a full trajectory record keeps float32 [B, W, V] per step of a block (DPS)
BACKWARD_FFN_TEMPORARIES = 5  # [tokens, f] tensors a block's backward adds to its activations (module doc)
METRIC_PATH_FP32_TENSORS = 3  # fp32 [R, W, N] tensors a metric_path sampler step holds at most (module doc)


@dataclass(frozen=True)
class ModelShape:
    """What the estimate reads of a model: a transformer of n_layers SwiGLU blocks, the last
    n_layers - dense_layers of them mixtures of experts when experts > 0 (LLaDA2: module doc, MoE)."""

    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn: int  # SwiGLU hidden width (gate and up each d x ffn, down ffn x d) of a dense block
    vocab: int
    tied: bool = False  # input embedding and LM head share one matrix
    head_dim: int | None = None  # None = d_model / n_heads
    experts: int = 0  # routed experts of an MoE block (0: every block dense)
    experts_per_token: int = 0  # k routed experts each token runs
    shared_experts: int = 0  # always-on experts, one SwiGLU of width shared_experts x expert_ffn
    expert_ffn: int = 0  # an expert's SwiGLU hidden width (moe_intermediate_size)
    dense_layers: int = 0  # leading dense blocks of an MoE model (first_k_dense_replace)
    codebook: int = 0  # image codes in the vocabulary (MMaDA's codebook_size, URSA's lm_head_size); 0 = none
    # How the family's block differs from LLaDA's in what it keeps for backward (block_saved_bytes; the
    # family's code in ddrl/models/native; shape_from_config sets them from config.json's family)
    qk_norm: bool = False  # an RMSNorm on every query and key head before RoPE (Qwen3: URSA, SDAR; LLaDA2)
    norm_weight_fp32: bool = False  # RMSNorm multiplies its weight in float32 (Qwen3's flash-attn rms_norm)
    fused_qkv: bool = False  # one query_key_value projection (LLaDA2) instead of q_proj, k_proj, v_proj

    @property
    def kv_dim(self) -> int:
        return (self.head_dim or self.d_model // self.n_heads) * self.n_kv_heads

    @property
    def q_dim(self) -> int:
        return (self.head_dim or self.d_model // self.n_heads) * self.n_heads

    @property
    def moe_layers(self) -> int:
        return self.n_layers - self.dense_layers if self.experts else 0

    def _block(self, ffn_params: int) -> int:
        d = self.d_model
        return 2 * d * self.q_dim + 2 * d * self.kv_dim + ffn_params + 2 * d

    @property
    def dense_block_params(self) -> int:
        return self._block(3 * self.d_model * self.ffn)

    @property
    def moe_block_params(self) -> int:
        """Attention, the router (experts x d) and every expert, routed and shared."""
        d, f = self.d_model, self.expert_ffn
        return self._block(self.experts * d + 3 * d * f * (self.experts + self.shared_experts))

    @property
    def block_params(self) -> int:
        """The largest block: one FSDP unit, gathered whole (all of an MoE block's experts)."""
        return self.moe_block_params if self.moe_layers else self.dense_block_params

    @property
    def root_params(self) -> int:
        """Embeddings, LM head and final norm: FSDP's root unit, gathered for the whole forward."""
        return self.vocab * self.d_model * (1 if self.tied else 2) + self.d_model

    @property
    def params(self) -> int:
        """Every parameter: what weights, gradients and AdamW state count."""
        return ((self.n_layers - self.moe_layers) * self.dense_block_params + self.moe_layers * self.moe_block_params
                + self.root_params)

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: an MoE block's router, k routed and the shared experts."""
        d, f = self.d_model, self.expert_ffn
        active_moe = self._block(self.experts * d + 3 * d * f * (self.experts_per_token + self.shared_experts))
        return ((self.n_layers - self.moe_layers) * self.dense_block_params + self.moe_layers * active_moe
                + self.root_params)

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each block linear by its module names in every family ddrl loads."""
        d, kv, f, q = self.d_model, self.kv_dim, self.ffn, self.q_dim
        return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d), "attn_out": (q, d),
                "query_key_value": (d, q + 2 * kv), "dense": (q, d),
                "gate_proj": (d, f), "ff_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d), "ff_out": (f, d)}

    def lora_params(self, rank: int, targets: list[str]) -> int:
        """A and B of every adapted block linear: rank x (in + out) each. A regex entry ("re:...") is
        counted as every linear of a block (an upper bound). In an MoE block gate/up/down_proj are
        every expert's (routed and shared), at the expert width."""
        shapes = self.linear_shapes()
        if any(t.startswith("re:") for t in targets):
            names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        else:
            names = [n for n in shapes if any(t == n or t.endswith("." + n) for t in targets)]
        dense = sum(rank * sum(shapes[n]) for n in names)
        if not self.moe_layers:
            return self.n_layers * dense
        mlp = [n for n in names if n in ("gate_proj", "up_proj", "down_proj")]
        expert = (self.experts + self.shared_experts) * rank * (self.d_model + self.expert_ffn) * len(mlp)
        moe = sum(rank * sum(shapes[n]) for n in names if n not in mlp) + expert
        return (self.n_layers - self.moe_layers) * dense + self.moe_layers * moe

    def lora_inputs(self, targets: list[str], moe: bool | None = None) -> tuple[int, int]:
        """(adapted linears, their summed input widths) one token runs through in a block (moe: an MoE
        block's; None: the widest block's): what LoRA keeps for backward per token (module doc). In an
        MoE block gate/up/down_proj are the token's K routed and the shared experts' (d, d and the
        expert width each)."""
        shapes = self.linear_shapes()
        if any(t.startswith("re:") for t in targets):
            names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        else:
            names = [n for n in shapes if any(t == n or t.endswith("." + n) for t in targets)]
        if not (bool(self.moe_layers) if moe is None else moe):
            return len(names), sum(shapes[n][0] for n in names)
        active = self.experts_per_token + self.shared_experts
        mlp = {"gate_proj": self.d_model, "up_proj": self.d_model, "down_proj": self.expert_ffn}
        widths = [active * mlp[n] if n in mlp else shapes[n][0] for n in names]
        return len(names) + (active - 1) * sum(n in mlp for n in names), sum(widths)


# What a family's block keeps beyond LLaDA's (ModelShape's block traits), by ddrl.models.families' family
# names: Qwen3's per-head q_norm/k_norm and flash-attn RMSNorm (SDAR, URSA), LLaDA2's fused QKV and
# per-head norms. LLaDA, MMaDA and Dream have LLaDA's block.
_FAMILY_BLOCKS: dict[str, dict[str, bool]] = {
    "sdar": {"qk_norm": True, "norm_weight_fp32": True},
    "ursa": {"qk_norm": True, "norm_weight_fp32": True},
    "llada2": {"qk_norm": True, "fused_qkv": True},
}

# Published config.json shapes of the models the paper recipes name with /path/to/... placeholders.
LLADA_8B = ModelShape(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn=12288, vocab=126464)
# Dream-v0-7B and DiffuCoder-7B: Qwen2.5-7B's shape
QWEN25_7B = ModelShape(d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn=18944, vocab=152064)
# URSA-1.7B: Qwen3-1.7B's blocks; its vocabulary adds the IBQ image codes (approximate: 2**17 codes)
URSA_1_7B = ModelShape(d_model=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn=6144, vocab=151936 + 131072,
                       codebook=131072, **_FAMILY_BLOCKS["ursa"])
# SEPO's DRAKES MDLM DNA CNN (ddrl.models.native.mdlm_dna): 20 dilated convolutions of kernel 9 over 128
# channels plus a time Dense each (~10 d^2 parameters), counted as blocks of that size (ffn 2d)
MDLM_DNA = ModelShape(d_model=128, n_layers=20, n_heads=1, n_kv_heads=1, ffn=256, vocab=5)
# LLaDA2.0-mini / LLaDA2.1-mini (same config.json: yjyddq/DARE @ 83ae8a3 models/LLaDA2.0-mini/config.json):
# 16.3B parameters, 1.43B active; the first block dense, 19 of 256 routed experts (8 per token) + 1 shared
LLADA2_MINI = ModelShape(d_model=2048, n_layers=20, n_heads=16, n_kv_heads=4, ffn=5120, vocab=157184, head_dim=128,
                         experts=256, experts_per_token=8, shared_experts=1, expert_ffn=512, dense_layers=1,
                         **_FAMILY_BLOCKS["llada2"])
# MMaDA-8B-Base: LLaDA-8B's blocks over 126,464 text ids + 8,192 MAGVIT-v2 codes (its config.json
# embedding_size 134,656, codebook_size 8192)
MMADA_8B = ModelShape(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn=12288, vocab=126464 + 8192,
                      codebook=8192)
PLACEHOLDER_SHAPES = {"LLaDA-8B": LLADA_8B, "MMaDA-8B": MMADA_8B, "Dream-v0-Instruct-7B": QWEN25_7B,
                      "DiffuCoder-7B": QWEN25_7B, "URSA-1.7B": URSA_1_7B, "mdlm_dna": MDLM_DNA,
                      "LLaDA2.0-mini": LLADA2_MINI, "LLaDA2.1-mini": LLADA2_MINI}


def shape_from_config(config: dict[str, Any]) -> ModelShape:
    """A config.json's sizes: LLaDA/MMaDA (d_model, n_layers, mlp_hidden_size, embedding_size), HF
    (hidden_size, num_hidden_layers, intermediate_size) and ddrl's own Denoiser (ffn_hidden)."""
    c = config.get("text_config") or config
    from ddrl.models.native.mdlm_dna import MODEL_TYPE as MDLM_DNA_TYPE

    if c.get("model_type") == MDLM_DNA_TYPE:  # SEPO's DNA CNN: each stack is five conv blocks (MDLM_DNA above)
        d = int(c["hidden_dim"])
        return ModelShape(d_model=d, n_layers=5 * int(c["num_cnn_stacks"]), n_heads=1, n_kv_heads=1, ffn=2 * d,
                          vocab=int(c["alphabet_size"]))
    pick = lambda *keys, default=None: next((c[k] for k in keys if c.get(k) is not None), default)  # noqa: E731
    d = pick("d_model", "hidden_size")
    layers = pick("n_layers", "num_hidden_layers")
    heads = pick("n_heads", "num_attention_heads")
    if d is None or layers is None or heads is None:
        raise ValueError("config.json has no transformer sizes (d_model/hidden_size, n_layers/num_hidden_layers, "
                         "n_heads/num_attention_heads)")
    ffn = pick("mlp_hidden_size", "ffn_hidden", "intermediate_size")
    if ffn is None:
        from ddrl.models.transformer import swiglu_hidden

        ffn = swiglu_hidden(d)
    tied = bool(pick("tie_word_embeddings", "weight_tying", "tie_embeddings", default=False))
    experts = int(pick("num_experts", "n_routed_experts", default=0) or 0)  # MoE (LLaDA2's llada2_moe)
    moe: dict[str, Any] = dict(experts=experts, experts_per_token=int(pick("num_experts_per_tok", default=0) or 0),
               shared_experts=int(pick("num_shared_experts", "n_shared_experts", default=0) or 0),
               expert_ffn=int(pick("moe_intermediate_size", default=0) or 0),
               dense_layers=int(pick("first_k_dense_replace", default=0) or 0)) if experts else {}
    from ddrl.models.native.ursa import QWEN3_DEFAULTS

    family = config_family(config)
    # head_dim left out of config.json: URSA's code takes Qwen3's default, every other family d_model / heads
    default_head_dim = {"ursa": QWEN3_DEFAULTS["head_dim"]}.get(family)
    return ModelShape(d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=pick("n_kv_heads", "num_key_value_heads",
                      default=heads), ffn=ffn, vocab=pick("embedding_size", "vocab_size"), tied=tied,
                      head_dim=pick("head_dim", default=default_head_dim),
                      codebook=int(pick("codebook_size", "lm_head_size", default=0) or 0), **moe,
                      **_FAMILY_BLOCKS.get(family, {}))


def config_family(config: dict[str, Any]) -> str:
    """The family of a config.json (ddrl.models.families.detect_family), or "ursa" for an URSA
    pipeline's transformer/config.json (a diffusers config: _class_name, no model_type)."""
    from ddrl.models.families import detect_family
    from ddrl.models.native.ursa import TRANSFORMER_CLASS

    return "ursa" if config.get("_class_name") == TRANSFORMER_CLASS else detect_family(config)


def model_shape(path: str) -> ModelShape:
    """The shape of model.path: its config.json, or a placeholder's published shape."""
    p = Path(path)
    for config in (p / "config.json", p / "transformer" / "config.json"):  # a model, or a diffusers pipeline (URSA)
        if config.is_file():
            return shape_from_config(json.loads(config.read_text()))
    for name, shape in PLACEHOLDER_SHAPES.items():
        if name.lower() in p.name.lower():
            return shape
    raise ValueError(f"model.path={path!r} has no config.json and is not a known placeholder "
                     f"({', '.join(PLACEHOLDER_SHAPES)}); point model.path at the model directory")


@dataclass
class MemoryEstimate:
    """Per-rank device bytes of one training step, by term (module doc); `host` is what
    dist.cpu_offload keeps in host memory instead."""

    held: dict[str, float]
    phases: dict[str, dict[str, float]]
    host: dict[str, float] = field(default_factory=dict)
    setting: str = ""

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: sum(self.phases[k].values()))

    @property
    def total(self) -> float:
        return sum(self.held.values()) + sum(self.phases[self.peak_phase].values())

    def report(self, device_bytes: float | None = None) -> str:
        lines = [f"per-rank memory estimate: {self.setting}"]
        for name, v in self.held.items():
            lines.append(f"  {name:<34}{v / GB:8.2f} GB")
        for phase, terms in self.phases.items():
            mark = "  <- peak" if phase == self.peak_phase else ""
            lines.append(f"  {phase} phase: +{sum(terms.values()) / GB:.2f} GB{mark}")
            lines.extend(f"    {name:<32}{v / GB:8.2f} GB" for name, v in terms.items())
        for name, v in self.host.items():
            lines.append(f"  host (dist.cpu_offload): {name:<16}{v / GB:8.2f} GB")
        lines.append(f"  total per rank                    {self.total / GB:8.2f} GB")
        if device_bytes:
            verdict = "fits" if self.total <= device_bytes else "does NOT fit"
            lines.append(f"  {verdict} a {device_bytes / GB:.0f} GB device")
        return "\n".join(lines)


@dataclass
class Counts:
    """Parameter counts of the model as it will train."""

    params: int
    trainable: int
    weight_bytes: int  # bytes per stored weight of the base (4 fp32, 2 bf16)
    trainable_bytes: int = 4  # the trainer refuses bf16 trainable parameters (common.build_optimizer)

    @classmethod
    def from_config(cls, cfg: Any, shape: ModelShape) -> "Counts":
        b = 2 if cfg.model.dtype == "bfloat16" else 4
        lora = cfg.model.lora
        if lora.rank > 0:
            adapters = shape.lora_params(lora.rank, list(lora.target_modules or []))
            return cls(params=shape.params + adapters, trainable=adapters, weight_bytes=b)
        return cls(params=shape.params, trainable=shape.params, weight_bytes=b)

    @classmethod
    def from_module(cls, model: Any) -> "Counts":
        params = list(model.parameters())
        frozen = [p for p in params if not p.requires_grad] or params
        return cls(params=sum(p.numel() for p in params), trainable=sum(p.numel() for p in params if p.requires_grad),
                   weight_bytes=max(p.element_size() for p in frozen))


def estimator_copies(method: Any) -> int:
    """Copies of a row one estimator call runs through the model in one forward and backward graph
    (module doc: k), as the estimator declares it (`copies_per_row`)."""
    est = method.estimator
    copies = getattr(est, "copies_per_row", None)
    if not isinstance(copies, int) or copies < 1:
        raise ValueError(f"estimator {type(est).__name__} declares no copies_per_row (a positive int: the masked "
                         f"copies of a row one call runs through the model); add it to its class, as "
                         f"ddrl/estimators/*.py do")
    return copies


def estimate_memory(cfg: Any, shape: ModelShape, world_size: int, *, counts: Counts | None = None,
                    device: str = "cuda", prompt_tokens: int | None = None) -> MemoryEstimate:
    """Per-rank device memory of `ddrl train` with this config at this world size (module doc);
    prompt_tokens: the widest prompt, when known (else rollout.max_prompt_length, else 256)."""
    from ddrl.training.distributed import DistInfo, resolve_strategy
    from ddrl.training.method import build_method

    counts = counts or Counts.from_config(cfg, shape)
    method = build_method(cfg)
    strategy = resolve_strategy(cfg.dist.strategy, DistInfo(world_size=world_size, grouped=cfg.dist.cpu_offload))
    offload = strategy == "fsdp" and cfg.dist.cpu_offload
    shards = world_size if strategy == "fsdp" else 1
    P, Pt, b = counts.params, counts.trainable, counts.weight_bytes
    bf16 = cfg.model.mixed_precision == "bf16"
    c = 2 if bf16 else b
    ref = P * b if method.needs_ref and cfg.model.lora.rank == 0 else 0
    state = {"weights": P * b / shards, "gradients (alive across the step)": Pt * 4 / shards,
             "AdamW state": 2 * Pt * 4 / shards}
    if ref:
        state["reference copy"] = ref / shards
    held = {} if offload else dict(state)
    host = dict(state) if offload else {}
    if strategy == "ddp":
        held["DDP gradient buckets"] = Pt * 4
    if prompt_tokens is None:  # 0 is a width: an unconditional model's (SEPO's DNA CNN) empty prompts
        prompt_tokens = cfg.rollout.max_prompt_length or DEFAULT_PROMPT_TOKENS
    T = prompt_tokens + cfg.rollout.gen_length
    phases = {"rollout": _rollout_terms(cfg, shape, method, world_size, strategy, counts, c, bf16, T),
              "update": _update_terms(cfg, shape, method, world_size, strategy, counts, c, bf16, T)}
    if device == "cuda" and not offload:  # offloaded, AdamW steps on the CPU
        phases["optimizer"] = {"foreach AdamW temporaries": Pt * 4 / shards}
    t = cfg.train
    setting = (f"{world_size} rank(s), strategy {strategy}{' + cpu_offload' if offload else ''}, "
               f"{P / 1e9:.2f}B params ({Pt / 1e6:.1f}M trainable), compute {'bf16' if bf16 else cfg.model.dtype}, "
               f"gradient_checkpointing={cfg.model.gradient_checkpointing}, "
               f"{t.prompts_per_step // world_size * t.group_size} rollout rows per rank, "
               f"{rollout_rows_per_call(cfg, world_size)} per sampler call")
    return MemoryEstimate(held, phases, host, setting)


def _compute_weights(strategy: str, shape: ModelShape, counts: Counts, c: int, bf16: bool, *, whole: bool) -> dict:
    if strategy == "fsdp":
        if whole:
            return {"gathered weights (generation)": counts.params * c}
        gathered = (2 * shape.block_params + shape.root_params) * c
        return {"gathered blocks + root": gathered, "one block's unsharded gradient": shape.block_params * 4}
    if bf16 and counts.weight_bytes == 4:
        return {"autocast bf16 weight cache": counts.trainable * 2}
    return {}


def rollout_rows_per_call(cfg: Any, world: int) -> int:
    """R of the module doc: a rank's rollout rows, or rollout.batch_rows when that is fewer."""
    rows = cfg.train.prompts_per_step // world * cfg.train.group_size
    return min(rows, cfg.rollout.batch_rows or rows)


def _rollout_terms(cfg: Any, shape: ModelShape, method: Any, world: int, strategy: str, counts: Counts,
                   c: int, bf16: bool, T: int) -> dict[str, float]:
    r = cfg.rollout
    R = rollout_rows_per_call(cfg, world)
    F = 2 * R if r.cfg_scale > 0 else R  # rows through the model: the unconditional ones too under guidance
    W, V = min(r.block_length or r.gen_length, r.gen_length), shape.vocab
    terms = _compute_weights(strategy, shape, counts, c, bf16, whole=True)
    terms["no-grad forward (one layer)"] = F * T * forward_transient_bytes(shape, c)
    N = shape.codebook
    # the image samplers of an image model (its completions are codes) ask for the codebook's logits only
    codes = N > 0 and r.name in ("metric_path", "maskgit", "emerge") and (
        r.name != "emerge" or bool(getattr(cfg.model, "vq_path", None)))
    if codes and r.name == "metric_path":  # codebook logits only, then the CTMC step (module doc)
        terms["block logits + fp32 temporaries"] = R * W * METRIC_PATH_FP32_TENSORS * N * 4
    elif codes:  # emerge / maskgit: codebook logits only, then the step's draw (module doc)
        terms["block logits + fp32 temporaries"] = R * W * _image_step_bytes(r, V, N, c)
    elif r.name == "dream":  # one step over the whole completion: every position's logits, then the draw
        terms["block logits + fp32 temporaries"] = R * r.gen_length * V * _dream_step_bytes(r, c)
    else:
        after = R * W * V * (c + 12)  # guided logits + fp32 temporaries
        terms["block logits + fp32 temporaries"] = max(after, R * W * V * 4 * c) if r.cfg_scale > 0 else after
    if method.needs_trajectory is True:  # COMMIT_ORDER (TraceRL) keeps [B, W] ints, no vocabulary dimension
        steps_per_block = max(1, r.steps // max(1, math.ceil(r.gen_length / W)))
        width = N if codes else shape.vocab  # an image model's samplers record softmax over the N codes per step
        terms["trajectory recorder"] = R * W * steps_per_block * width * RECORDER_BYTES
    return terms


def _dream_step_bytes(r: Any, c: int) -> int:
    """Bytes per completion slot and vocabulary id that Dream's sampler holds at a step's peak (module
    doc; ddrl.sampling.dream _denoise and filtered_probs): the step's logits and the copy of their
    masked rows (2c, both alive through the draw), then the fp32 tempered logits and, under top-p,
    their sort (fp32 values, int64 order) with its softmax and cumulative sum (4 + 12 + 8); else the
    inverse-CDF draw's fp32 probabilities, their float64 copy and its cumulative sum (4 + 16); at
    temperature 0 the larger of the fp32 logits, top-k's bool mask and the filtered copy (2c + 4 + 1 +
    4) and the entropy confidence after the masked copy is freed (c + 3 x 4: p, p + eps, its log)."""
    if r.top_p is not None and r.top_p < 1:
        return 2 * c + 24
    return 2 * c + 20 if r.temperature > 0 else max(2 * c + 9, c + 12)


def _image_step_bytes(r: Any, V: int, N: int, c: int) -> int:
    """Bytes per completion slot that the emerge and maskgit samplers of an image model hold at a step's
    peak (module doc): the model call's codebook logits, then the step's draw."""
    call = N * (4 * c + 1) if r.cfg_scale > 0 else N * c  # guided: 2R rows' logits, u + (w+1)(c - u), masked copy, mask
    if r.name == "maskgit":
        return max(call, 12 * N)  # fp32 logits, softmax, uniforms
    call += N * c  # the emerge loop holds the previous step's logits through the call
    if r.rng == "released":
        return max(call, N * (3 * c + 4))  # logits, softmax, scaled copy (c each), fp32 [.., N + 1] draw input
    return max(call, N * c + (4 * V if r.temperature > 0 else 0))  # ddrl's layout: fp32 uniforms over every id


def _update_terms(cfg: Any, shape: ModelShape, method: Any, world: int, strategy: str, counts: Counts,
                  c: int, bf16: bool, T: int) -> dict[str, float]:
    t = cfg.train
    per_rank = t.prompts_per_step // world * t.group_size
    if t.micro_batch_rows and method.has_rows:  # the estimator's own rows (trace states, masked copies) per call
        rows = t.micro_batch_rows
    else:  # samples x the copies one estimator call batches; micro-batches are whole groups (Trainer.micro_batches)
        size = t.micro_batch_size or per_rank
        rows = min(max(1, size // t.group_size) * t.group_size, per_rank) * estimator_copies(method)
    tokens = rows * T
    d, L = shape.d_model, shape.n_layers
    r = c if strategy == "fsdp" else counts.weight_bytes  # FSDP2 computes with c-byte parameters, else autocast
    block = tokens * block_saved_bytes(cfg, shape, c, r)
    terms = _compute_weights(strategy, shape, counts, c, bf16, whole=False)
    if cfg.model.gradient_checkpointing:
        terms["activations (checkpointed)"] = tokens * L * d * c + block
    else:
        terms["activations"] = L * block
    # the block being back-propagated: a dense one's SiLU backward and gated-product gradients, 7 [tokens, f]
    # tensors beside the 1 kept (recomputed) one, a counting 3; an MoE one's recomputed router weighting
    # when larger (module doc)
    terms["one block's backward temporaries"] = tokens * backward_temporary_bytes(shape, c)
    # log p(target) from the final hidden states, the LM head chunk by chunk (ddrl.ops.logprobs)
    chunk = min(LOGPROB_CHUNK_ELEMENTS, tokens * shape.vocab)
    terms["final hidden + one logits chunk"] = tokens * d * c + chunk * (c + 12)
    return terms


def forward_transient_bytes(shape: ModelShape, c: int) -> int:
    """Bytes a token holds at the peak of one layer's no-grad forward (module doc): a dense block's
    (4 d + 3 f) c, or an MoE block's when larger (routed_experts' fp32 weighting of its K outputs)."""
    d = shape.d_model
    dense = (4 * d + 3 * shape.ffn) * c if shape.dense_layers or not shape.moe_layers else 0
    if not shape.moe_layers:
        return dense
    return max(dense, 4 * d * c + shape.experts_per_token * d * (c + 4) + 4 * d + 16 * shape.experts)


def backward_temporary_bytes(shape: ModelShape, c: int) -> int:
    """Bytes a token adds, beyond the block's saved activations, at the peak of one block's backward
    (module doc): a dense block's BACKWARD_FFN_TEMPORARIES f c, or an MoE block's when larger (the router
    weighting in its recomputed forward: K d 4 + 4 d + 4 d c)."""
    d = shape.d_model
    dense = BACKWARD_FFN_TEMPORARIES * shape.ffn * c if shape.dense_layers or not shape.moe_layers else 0
    if not shape.moe_layers:
        return dense
    return max(dense, shape.experts_per_token * d * 4 + 4 * d + 4 * d * c)


def block_saved_bytes(cfg: Any, shape: ModelShape, c: int, r: int, *, moe: bool | None = None) -> int:
    """Bytes one block keeps for backward per token (module doc: activations), as autograd saves them in
    ddrl's native blocks (tests/unit/test_block_saved_bytes.py measures each family's). c: bytes of a
    compute element; r: bytes of a weight as the forward reads it, which is also the residual stream's
    (4 under autocast over fp32 weights, c under FSDP2's bf16 parameters). moe: an MoE block's (None:
    the larger of the model's dense and MoE blocks)."""
    if moe is None:
        kinds = [False, True] if shape.moe_layers and shape.dense_layers else [bool(shape.moe_layers)]
        return max(block_saved_bytes(cfg, shape, c, r, moe=kind) for kind in kinds)
    d, q, kv, H = shape.d_model, shape.q_dim, shape.kv_dim, shape.n_heads
    lora = cfg.model.lora
    full = lora.rank == 0  # the base learns: each linear keeps its input, each norm its normalised x
    casts = r != c  # autocast: each linear casts its r-byte input to c itself (one copy per linear)
    saved = 2 * _norm_saved_bytes(shape, d, 1, r, full)  # the attention's and the MLP's, over the residual
    if shape.qk_norm:  # over the projections' c-byte outputs, one row per head
        saved += _norm_saved_bytes(shape, q, H, c, full) + _norm_saved_bytes(shape, kv, shape.n_kv_heads, c, full)
    # SDPA keeps the queries, the keys and values as it gets them (every ddrl block repeats them to the H
    # query heads first: q wide each), its output (the output projection's input too) and an fp32
    # log-sum-exp per head
    saved += 4 * q * c + 4 * H
    if full:  # the norm's output read by the q, k, v projections: once, or cast by each under autocast
        saved += d * c * (1 if shape.fused_qkv or not casts else 3)
    saved += _moe_saved_bytes(shape, c, casts, full) if moe else _mlp_saved_bytes(d, shape.ffn, c, casts, full)
    if lora.rank > 0:  # each adapter's c-byte input, its dropout's bool mask, its rank-wide middle (without
        # dropout and without autocast's casts, adapters reading one tensor keep it once: an upper bound then)
        linears, width = shape.lora_inputs(list(lora.target_modules or []), moe=moe)
        saved += width * (c + (1 if lora.dropout > 0 else 0)) + linears * lora.rank * c
    return saved


def _norm_saved_bytes(shape: ModelShape, width: int, rows: int, input_bytes: int, full: bool) -> int:
    """An RMSNorm over `rows` vectors of `width` a token, its input input_bytes an element: the fp32
    input it normalises (4 width: a copy, or the input itself when fp32), fp32 scalars per row (the
    rsqrt; Qwen3's x / sqrt(...) keeps three), and when its weight learns the normalised vector the
    weight multiplies (Qwen3: fp32; LLaDA, Dream, LLaDA2: cast back to the input's dtype first)."""
    fp32_weight = shape.norm_weight_fp32
    saved = 4 * width + rows * (NORM_ROW_SCALARS_FP32_WEIGHT if fp32_weight else NORM_ROW_SCALARS)
    return saved + (width * (4 if fp32_weight else input_bytes) if full else 0)


def _mlp_saved_bytes(d: int, f: int, c: int, casts: bool, full: bool) -> int:
    """A SwiGLU: the gate's output (SiLU's input), its SiLU and the up projection's output (3 f c);
    a learning base adds the gate's and up projection's input (cast by each under autocast) and the
    down projection's, the gated product (f c)."""
    return 3 * f * c + ((2 if casts else 1) * d * c + f * c if full else 0)


def _moe_saved_bytes(shape: ModelShape, c: int, casts: bool, full: bool) -> int:
    """An MoE block's MLP (ddrl.models.native.llada2: LLaDA2SparseMoe, routed_experts) per token: the K
    routed and the shared experts' SwiGLUs at the expert width, the routed outputs once, in (token, slot)
    order (K d c: WeightedSlots), the router's fp32 sigmoid scores (4 E), the chosen
    weights, scaled, and their sum (8 K + 4), int64 expert ids, sort order and gather index (24 K).
    A learning base adds the router's fp32 input (4 d), the routed experts' gathered inputs (K d c), the
    shared expert's (d c) and every down projection's. The group-limited top-k keeps nothing: its scores
    only choose indices, and their graph is freed. Computed as under FSDP2's bf16 parameters, as every
    MoE recipe runs (under autocast the router and the weighting run in bf16: not modelled)."""
    d, K = shape.d_model, shape.experts_per_token
    f = (K + shape.shared_experts) * shape.expert_ffn  # the SwiGLU width one token runs through
    saved = 3 * f * c + K * d * c + 4 * shape.experts + 8 * K + 4 + 24 * K
    if full:
        saved += 4 * d + (K * d + d) * c * (2 if casts else 1) + f * c
    return saved


def check_fits(estimate: MemoryEstimate, device_bytes: int | None) -> None:
    """Refuse, before anything is moved to the device, a run whose estimate exceeds it. None (the
    CPU) skips the check."""
    if device_bytes is None or estimate.total <= device_bytes:
        return
    raise ValueError(f"the run needs ~{estimate.total / GB:.1f} GB per device, more than its "
                     f"{device_bytes / GB:.1f} GB:\n"
                     f"{estimate.report()}\nTo fit: shard over more GPUs (torchrun --nproc_per_node N ... "
                     f"dist.strategy=fsdp), keep the training state in host memory (dist.strategy=fsdp "
                     f"dist.cpu_offload=true), model.gradient_checkpointing=true, a smaller train.micro_batch_size, "
                     f"or LoRA (model.lora.rank=128). `ddrl train --dry-run CONFIG --world-size N` prints this plan")


def check_memory(cfg: Any, model: Any, world_size: int, device_bytes: int | None, *, reference_copy: bool,
                 strategy: str) -> None:
    """The trainer's start-up check: the full estimate when model.path has a readable shape, else
    the training state alone (distributed.check_memory_fits). None device bytes (the CPU): no check."""
    if device_bytes is None:
        return
    try:
        shape = model_shape(cfg.model.path)
    except (ValueError, OSError):
        from ddrl.training.distributed import check_memory_fits, training_state_bytes

        state, ref = training_state_bytes(model, reference_copy=reference_copy)
        check_memory_fits(state, ref, device_bytes, strategy=strategy, world_size=world_size)
        return
    check_fits(estimate_memory(cfg, shape, world_size, counts=Counts.from_module(model)), device_bytes)


def dry_run(config: str, overrides: list[str], world_size: int, device_gb: float) -> str:
    """`ddrl train --dry-run`: the per-rank estimate of a recipe at a world size, weights unread."""
    from ddrl.config import RLConfig, load_config

    cfg = load_config(config, overrides, RLConfig)
    head = f"{config}: model {cfg.model.path}"
    n = cfg.train.prompts_per_step
    if n % world_size:  # the trainer refuses it; estimated with the largest rank's share
        fits = [w for w in range(1, n + 1) if n % w == 0]
        head += (f"\nNOTE: `ddrl train` refuses this at {world_size} ranks: train.prompts_per_step={n} is not "
                 f"divisible by {world_size} (world sizes that divide it: {fits}); estimated with "
                 f"{math.ceil(n / world_size)} groups per rank")
        cfg.train.prompts_per_step = math.ceil(n / world_size) * world_size
    est = estimate_memory(cfg, model_shape(cfg.model.path or ""), world_size)
    return head + "\n" + est.report(device_gb * GB)


