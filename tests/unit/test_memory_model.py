"""The memory model (ddrl.training.memory): the terms the old 16-bytes-per-parameter check left out,
FSDP2 CPU offload as the way to fit 8B full fine-tuning on one H200, and `ddrl train --dry-run` for
every paper recipe at 1 and 8 GPUs, without reading weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddrl.config import ConfigError, RLConfig, load_config
from ddrl.training.distributed import DistInfo, check_memory_fits, resolve_strategy
from ddrl.training.memory import (GB, LLADA_8B, check_fits, dry_run, estimate_memory, model_shape,
                                  shape_from_config)

ROOT = Path(__file__).resolve().parents[2]
H200 = 141 * GB
PAPER = sorted((ROOT / "configs/paper").rglob("*.yaml"))


def test_llada_8b_shape_has_8b_parameters():
    assert 8.0e9 < LLADA_8B.params < 8.05e9
    assert model_shape("/path/to/LLaDA-8B-Instruct") is LLADA_8B
    with pytest.raises(ValueError, match="point model.path at the model directory"):
        model_shape("/path/to/Unknown-3B")


def test_full_fine_tuning_of_8b_on_one_h200_is_refused_unless_offloaded():
    cfg = load_config(ROOT / "configs/paper/stable_drl_llada8b.yaml", [], RLConfig)
    plain = estimate_memory(cfg, LLADA_8B, 1)
    # the old check counted 16 B/param and passed it (128 GB < 141 GB) ...
    check_memory_fits(16 * LLADA_8B.params, 0, H200, strategy="none", world_size=1)
    # ... the autocast bf16 cache, activations and AdamW's temporaries do not fit
    assert plain.held["weights"] + plain.held["gradients (alive across the step)"] + plain.held["AdamW state"] \
        == pytest.approx(16 * LLADA_8B.params)
    assert "autocast bf16 weight cache" in plain.phases["update"]
    assert plain.total > H200
    with pytest.raises(ValueError, match=r"(?s)needs ~.*dist\.cpu_offload=true"):
        check_fits(plain, H200)
    offload = load_config(ROOT / "configs/paper/stable_drl_llada8b.yaml",
                          ["dist.strategy=fsdp", "dist.cpu_offload=true"], RLConfig)
    est = estimate_memory(offload, LLADA_8B, 1)
    assert resolve_strategy("fsdp", DistInfo(grouped=True)) == "fsdp"  # FSDP2 in one process
    assert not est.held and est.host["AdamW state"] == pytest.approx(8 * LLADA_8B.params)  # state on the host
    assert est.total < H200
    check_fits(est, H200)


def test_fsdp_shards_the_state_and_the_recorder_is_counted_only_where_it_keeps_probabilities():
    cfg = load_config(ROOT / "configs/paper/tracerl_llada8b.yaml", [], RLConfig)
    one, eight = estimate_memory(cfg, LLADA_8B, 1), estimate_memory(cfg, LLADA_8B, 8)
    assert eight.held["AdamW state"] == pytest.approx(one.held["AdamW state"] / 8)
    assert "gathered weights (generation)" in eight.phases["rollout"]
    # TraceRL records commit order only ([B, W] ints); DPS keeps fp32 [B, W, V] per step of a block
    assert "trajectory recorder" not in eight.phases["rollout"]
    daca = load_config(ROOT / "configs/paper/daca_grpo_llada8b.yaml", [], RLConfig)  # its DPS weights read them
    r, t = daca.rollout, daca.train
    rows, width = t.prompts_per_step // 8 * t.group_size, min(r.block_length or r.gen_length, r.gen_length)
    steps_per_block = r.steps // -(-r.gen_length // width)
    assert estimate_memory(daca, LLADA_8B, 8).phases["rollout"]["trajectory recorder"] == pytest.approx(
        rows * width * steps_per_block * 126464 * 4)


def test_shapes_are_read_from_config_json():
    llada = {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "mlp_hidden_size": 128,
             "embedding_size": 128, "vocab_size": 126, "weight_tying": False}
    s = shape_from_config(llada)
    assert (s.d_model, s.n_layers, s.kv_dim, s.ffn, s.vocab) == (64, 2, 32, 128, 128)
    dream = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "vocab_size": 128, "tie_word_embeddings": True}
    assert shape_from_config(dream).tied


@pytest.mark.parametrize("config", PAPER, ids=lambda p: str(p.relative_to(ROOT / "configs/paper")))
def test_dry_run_prints_every_paper_recipe_at_1_and_8_gpus(config):
    for world in (1, 8):
        text = dry_run(str(config), [], world, 80.0)
        assert f"{world} rank(s)" in text and "total per rank" in text and "80 GB device" in text


def test_the_cli_dry_run_reads_no_weights():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "ddrl", "train", "--dry-run",
                           str(ROOT / "configs/paper/unigrpo_llada8b.yaml"), "--world-size", "8",
                           "--gpu-memory", "141"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "8 rank(s), strategy fsdp" in done.stdout and "141 GB device" in done.stdout


def test_offload_and_timeout_are_checked():
    with pytest.raises(ConfigError, match="dist.cpu_offload=true is FSDP2's CPUOffloadPolicy; set dist.strategy=fsdp"):
        load_config(None, ["dist.cpu_offload=true"], RLConfig)
    with pytest.raises(ConfigError, match="dist.timeout must be a positive"):
        load_config(None, ["dist.timeout=0"], RLConfig)


def test_dist_timeout_reaches_init_process_group(monkeypatch):
    from datetime import timedelta

    import torch

    from ddrl.training import distributed

    seen = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kw: seen.update(kw))
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda: 2)
    distributed.init_distributed(None, torch.device("cpu"), timeout_s=1800)
    assert seen["timeout"] == timedelta(seconds=1800) and seen["backend"] == "gloo"


def test_llada2_mini_counts_every_expert_in_the_state_and_the_active_ones_in_activations():
    """LLaDA2.0-mini's published config.json (yjyddq/DARE @ 83ae8a3 models/LLaDA2.0-mini/config.json):
    16B parameters, ~1.4B active; the placeholder resolves to it, the state counts all 16B and the
    activations the active width only."""
    from ddrl.training.memory import LLADA2_MINI

    assert model_shape("/path/to/LLaDA2.0-mini") is LLADA2_MINI
    assert model_shape("/path/to/LLaDA2.1-mini") is LLADA2_MINI
    # by hand: attention 2 d (H hd) + 2 d (H_kv hd) = 10,485,760; dense SwiGLU 3 d 5120; router 256 d;
    # experts 3 d 512 each, 256 routed + 1 shared; norms 2 d; root 2 V d + d
    d, attn, norms = 2048, 2 * 2048 * 2048 + 2 * 2048 * 512, 2 * 2048
    dense = attn + 3 * d * 5120 + norms
    moe = attn + 256 * d + 257 * 3 * d * 512 + norms
    active = attn + 256 * d + 9 * 3 * d * 512 + norms
    root = 2 * 157184 * d + d
    assert LLADA2_MINI.params == dense + 19 * moe + root
    assert LLADA2_MINI.active_params == dense + 19 * active + root
    assert 16.2e9 < LLADA2_MINI.params < 16.3e9 and 1.40e9 < LLADA2_MINI.active_params < 1.45e9
    from ddrl.training.memory import estimator_copies
    from ddrl.training.method import build_method

    full = load_config(ROOT / "configs/paper/stable_drl_llada8b.yaml", [
        "model.path=/path/to/LLaDA2.0-mini", "train.micro_batch_size=2", "train.group_size=2",
        "model.gradient_checkpointing=false",
        "rollout.max_prompt_length=256"],
        RLConfig)
    est = estimate_memory(full, model_shape(full.model.path), 8)
    assert est.held["AdamW state"] == pytest.approx(2 * 4 * LLADA2_MINI.params / 8)  # all experts' moments
    assert est.phases["update"]["gathered blocks + root"] == pytest.approx((2 * moe + root) * 2)  # whole MoE blocks
    # activations: the active experts' width (8 + 1) x 512, not 257 x 512, plus the dispatch; the MoE block
    # keeps more than the dense one, so every block counts as it
    tokens = 2 * estimator_copies(build_method(full)) * (full.rollout.max_prompt_length + full.rollout.gen_length)
    # per token of an MoE block under full fine-tuning with FSDP2's bf16 weights (ddrl.models.native.llada2,
    # measured on the tiny fixture by tests/unit/test_block_saved_bytes.py), q = 16 x 128, kv = 4 x 128:
    q, kv, f = 2048, 512, 9 * 512
    norms = 2 * (4 * d + 4 + 2 * d)  # two RMSNorms: fp32 input, rsqrt, the bf16 normalised x the weight learns from
    head_norms = (6 * q + 4 * 16) + (6 * kv + 4 * 4)  # the same per query and key head
    attention = 4 * q * 2 + 4 * 16 + d * 2  # SDPA's q, repeated k and v, output; fp32 log-sum-exp; the QKV input
    experts = 3 * f * 2 + f * 2  # the SwiGLUs' gate, SiLU, up outputs and the down projections' inputs
    dispatch = 8 * d * 2 + 8 * d * 2 + d * 2  # routed outputs (once, bf16: WeightedSlots); experts' inputs
    router = 4 * d + 4 * 256 + 8 * 8 + 4 + 24 * 8  # fp32 input, scores, chosen weights + sum, int64 ids/orders
    per_token = norms + head_norms + attention + experts + dispatch + router
    assert per_token == 176540
    assert est.phases["update"]["activations"] == pytest.approx(20 * tokens * per_token)


def test_moe_shape_read_from_the_tiny_llada2_checkpoint_counts_its_parameters():
    """shape_from_config on the official-format tiny LLaDA2 equals the loaded model's parameter count
    (every expert), and its active count is that minus the routed experts a token does not run."""
    import json

    from ddrl.models.native.llada2 import LLaDA2Backbone

    directory = ROOT / "tests/fixtures/llada2/model-2.0"
    shape = model_shape(str(directory))
    model = LLaDA2Backbone.from_pretrained(directory)
    norms = sum(p.numel() for n, p in model.named_parameters() if "layernorm" in n and "attention." in n)
    assert shape.params == sum(p.numel() for p in model.parameters()) - norms  # qk-norms (2 hd a layer) not modelled
    raw = json.loads((directory / "config.json").read_text())
    E, K = raw["num_experts"], raw["num_experts_per_tok"]
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert shape.params - shape.active_params == routed * (E - K) // E


def test_image_rollouts_count_rows_per_sampler_call_and_guidance_rows():
    """MaskGRPO's image recipe: 1 row per sampler call (rollout.batch_rows) with its unconditional row
    (cfg 3.5), 1,024 codes of MMaDA-8B's 8,192 (N) out of 134,656 ids (V), bf16 compute (c = 2). The
    model computes the codes' logits only; emerge's ddrl layout still draws fp32 uniforms over all V ids
    (the seeded stream). Hand-computed from the module doc, per slot: max(call, draw) with call = N (4c + 1)
    guided (N c one pass), + N c for emerge (its previous step's logits), draw = N c + 4 V (emerge, ddrl
    rng), N (3c + 4) (released rng), 12 N (maskgit). Before the codebook-only head: V (c + 12) = 14 V."""
    from ddrl.training.memory import MMADA_8B

    recipe = ROOT / "configs/paper/maskgrpo/t2i_mmada.yaml"
    cfg = load_config(recipe, [], RLConfig)
    assert model_shape(cfg.model.path) is MMADA_8B and MMADA_8B.vocab == 134656 and MMADA_8B.codebook == 8192
    V, N, W, T, c = 134656, 8192, 1024, 256 + 1024, 2
    one_layer = (4 * 4096 + 3 * 12288) * c  # bytes per token of the no-grad forward's transient
    emerge = N * c + 4 * V  # > the guided call's 9 N + 2 N
    for world, rows in ((1, 72), (8, 9)):
        rollout = estimate_memory(cfg, MMADA_8B, world).phases["rollout"]
        assert rollout["no-grad forward (one layer)"] == 2 * T * one_layer  # 1 row + its unconditional row
        assert rollout["block logits + fp32 temporaries"] == W * emerge == W * (16384 + 538624)  # 0.57 GB (was 1.93)
        whole = estimate_memory(load_config(recipe, ["rollout.batch_rows=null"], RLConfig), MMADA_8B, world)
        assert whole.phases["rollout"]["no-grad forward (one layer)"] == 2 * rows * T * one_layer
        assert whole.phases["rollout"]["block logits + fp32 temporaries"] == rows * W * emerge
    no_cfg = estimate_memory(load_config(recipe, ["rollout.cfg_scale=0", "rollout.batch_rows=3"], RLConfig),
                             MMADA_8B, 8).phases["rollout"]
    assert no_cfg["no-grad forward (one layer)"] == 3 * T * one_layer
    assert no_cfg["block logits + fp32 temporaries"] == 3 * W * emerge
    expected = {  # overrides -> bytes per slot
        ("rollout.temperature=0",): 11 * N,  # no uniforms: the guided call, 9 N + the previous step's 2 N
        ("rollout.rng=released",): 11 * N,  # the guided call (11 N) > the draw's N (3c + 4) = 10 N
        ("rollout.rng=released", "rollout.cfg_scale=0"): 10 * N,
        ("rollout.name=maskgit", "rollout.cfg_scale=0"): 12 * N,
        ("rollout.name=maskgit",): 12 * N,  # > the guided call's 9 N
        # a MMaDA loaded without vq_path completes text: the whole vocabulary, as before
        ("model.vq_path=null",): max(V * (c + 12), V * 4 * c),
    }
    for overrides, per_slot in expected.items():
        got = estimate_memory(load_config(recipe, list(overrides), RLConfig), MMADA_8B, 8).phases["rollout"]
        assert got["block logits + fp32 temporaries"] == W * per_slot, overrides
    # on one GPU, 72 rows in one call would not fit (their ~41 GB of uniforms and logits); one row a call does
    one_call = estimate_memory(load_config(recipe, ["rollout.batch_rows=null"], RLConfig), MMADA_8B, 1)
    assert estimate_memory(cfg, MMADA_8B, 1).total < 70 * GB < one_call.total


def test_codebook_size_is_read_from_config_json():
    mmada = {"d_model": 64, "n_layers": 2, "n_heads": 4, "mlp_hidden_size": 128, "embedding_size": 192,
             "vocab_size": 192, "codebook_size": 64}
    assert shape_from_config(mmada).codebook == 64
    assert shape_from_config({**mmada, "codebook_size": None}).codebook == 0


def test_metric_path_rollout_holds_three_fp32_codebook_tensors():
    """URSA's sampler (UDM-GRPO PickScore, 8 rows a call on 8 GPUs, bf16): the head computes the codebook's
    logits only and a CTMC step holds at most three fp32 [R, W, N] tensors (process.velocity's), whatever
    the vocabulary and guidance. Hand-computed: R W 12 N (was R W 28 N: the full-vocabulary logits, the
    previous step's z and six temporaries)."""
    from ddrl.training.memory import URSA_1_7B

    recipe = ROOT / "configs/paper/udm_grpo/pickscore.yaml"
    assert model_shape("/path/to/URSA-1.7B-IBQ512") is URSA_1_7B
    R, W, N = 8, 1024, 131072
    rollout = estimate_memory(load_config(recipe, [], RLConfig), URSA_1_7B, 8).phases["rollout"]
    assert rollout["block logits + fp32 temporaries"] == R * W * 12 * N
    # no full-vocabulary tensor: a 4x larger vocabulary, or guidance (2R rows), changes nothing
    wide = URSA_1_7B.__class__(**{**URSA_1_7B.__dict__, "vocab": 4 * URSA_1_7B.vocab})
    guided = load_config(recipe, ["rollout.cfg_scale=6"], RLConfig)
    for cfg, shape in ((load_config(recipe, [], RLConfig), wide), (guided, URSA_1_7B)):
        assert estimate_memory(cfg, shape, 8).phases["rollout"]["block logits + fp32 temporaries"] == R * W * 12 * N
    # the naive ablation records softmax(z) of every step over the codes: R W S N 4
    naive = estimate_memory(load_config(recipe, ["method.estimator_args.forward_process=false"], RLConfig),
                            URSA_1_7B, 8).phases["rollout"]
    assert naive["trajectory recorder"] == R * W * 10 * N * 4


class _LiveBytes:
    """Peak bytes of the tensors allocated inside the block and alive at once (a dispatch mode that
    follows every new storage until it is freed): a CPU stand-in for torch.cuda.max_memory_allocated.
    An op's output that shares an input's storage (a view: a slice or transpose of a weight) is no
    allocation."""

    def __enter__(self):
        import weakref

        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        live, state = {}, {"now": 0, "peak": 0}
        self.state = state

        def free(key):
            state["now"] -= live.pop(key)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                given = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
                for t in tree_flatten(out)[0]:
                    storage = t.untyped_storage() if hasattr(t, "untyped_storage") else None
                    if storage is None or id(storage) in live or id(storage) in given or storage.nbytes() == 0:
                        continue
                    live[id(storage)] = storage.nbytes()
                    state["now"] += storage.nbytes()
                    state["peak"] = max(state["peak"], state["now"])
                    weakref.finalize(storage, free, id(storage))
                return out

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)

    @property
    def peak(self) -> int:
        return self.state["peak"]


@pytest.mark.parametrize("cfg_scale", [0.0, 6.0], ids=["one-pass", "guided"])
@pytest.mark.parametrize("words,codes", [(3000, 256), (40, 1024)], ids=["wide-vocabulary", "wide-codebook"])
def test_metric_path_estimate_matches_what_the_sampler_allocates(tmp_path, words, codes, cfg_scale):
    """The estimate's rollout terms for a tiny bf16 URSA pipeline against the bytes the metric_path
    sampler really keeps alive at its peak (4 rows of an 8x8 image, 3 steps): the logits term, plus at
    most the forward's one-layer transient, with a vocabulary 12x the codebook (3,000 text ids, 256
    codes: before the codebook-only head, 2 V c of full-vocabulary logits were the peak) or not (40
    text ids, 1,024 codes), with guidance or not. Measured peaks, 4 x 64 x N x bytes: 12.2 / 12.3
    (wide vocabulary) and 12.1 / 12.1 (wide codebook), weight views not counted (12.7 / 12.8 and 12.4 / 12.4
    with them); before the in-place step 56 / 107 and 28.4 / 28.4."""
    import torch

    from ddrl.models.ursa import load_ursa
    from ddrl.models.ursa_init import write_gray_level_pipeline
    from ddrl.sampling.metric_path import sample_metric_path

    write_gray_level_pipeline(tmp_path, words=[f"w{i}" for i in range(words)], levels=codes, hidden_size=32,
                              num_layers=1, num_heads=2, ffn_mult=2, max_prompt_length=4, seed=0)
    model = load_ursa(tmp_path, dtype=torch.bfloat16)
    model.image_shape = (8, 8)
    cfg = load_config(ROOT / "configs/paper/udm_grpo_ursa.yaml", [
        f"model.path={tmp_path}", "rollout.gen_length=64", "rollout.steps=3", "rollout.batch_rows=null",
        "train.prompts_per_step=1", "train.group_size=4", f"rollout.cfg_scale={cfg_scale}"], RLConfig)
    shape = model_shape(str(tmp_path))
    assert (shape.vocab, shape.codebook) == (model.vocab_size, codes)
    prompt = torch.full((4, 5), 2, dtype=torch.long)
    prompt[:, -1] = model.bov_token_id
    rollout = estimate_memory(cfg, shape, 1, prompt_tokens=5).phases["rollout"]
    logits, layer = rollout["block logits + fp32 temporaries"], rollout["no-grad forward (one layer)"]
    with torch.no_grad(), _LiveBytes() as live:
        sample_metric_path(model, prompt, None, cfg.rollout, generator=torch.Generator().manual_seed(0))
    assert logits <= live.peak <= logits + layer, (live.peak, logits, layer)  # the layer's transient: at most its term


def _tiny_t2i_mmada(directory: Path, vocab: int, codes: int) -> Path:
    """The MMaDA t2i fixture's tokenizer (132 ids) with a random one-layer backbone of `vocab` ids, `codes`
    of them image codes: the shapes the memory test needs."""
    import json
    import shutil

    import torch

    from ddrl.models.native.llada import MMaDABackbone, MMaDAConfig

    fixture = ROOT / "tests/fixtures/mmada_t2i/model"
    directory.mkdir()
    for f in fixture.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, directory / f.name)
    config = json.loads((fixture / "config.json").read_text())
    config.update(embedding_size=vocab, vocab_size=vocab, new_vocab_size=vocab, codebook_size=codes, d_model=32,
                  n_heads=2, n_kv_heads=2, mlp_hidden_size=64, n_layers=1)
    (directory / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    backbone = MMaDABackbone(MMaDAConfig.from_dict(config))
    for p in backbone.parameters():
        torch.nn.init.normal_(p, std=0.3)
    backbone.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("sampler", ["emerge", "emerge_guided", "released_guided", "maskgit", "maskgit_guided"])
@pytest.mark.parametrize("words,codes", [(4000, 256), (1300, 1024)], ids=["wide-vocabulary", "wide-codebook"])
def test_image_sampler_estimate_matches_what_the_sampler_allocates(tmp_path, words, codes, sampler):
    """The estimate's rollout terms for a tiny bf16 text-to-image MMaDA against the bytes the emerge and maskgit
    samplers really keep alive at their peak (4 rows of an 8x8 image, 3 steps): the logits term, plus at most
    the forward's one-layer transient, with a vocabulary 16x the codebook (4,000 ids, 256 codes: ddrl's emerge
    layout is then its [R, W, V] uniforms) or not (1,300 ids, 1,024 codes). Measured peaks per slot, before the
    codebook-only head / after, wide vocabulary: emerge 24.1 / 16.6 KB (guided 44.1 / 16.6), released guided
    44.1 / 2.9, maskgit 18.2 / 3.1 (guided 38.1 / 3.1); wide codebook: emerge 7.9 / 7.3 (guided 14.4 / 11.3),
    released guided 14.4 / 11.3, maskgit 14.9 / 12.3 (guided 20.0 / 12.3)."""
    import torch

    import ddrl.sampling  # noqa: F401  (registers the samplers)
    from ddrl.data import encode_prompts
    from ddrl.registry import SAMPLERS
    from tests.fixtures.make_mmada_t2i_seeded import magvit_dir

    import ddrl

    path = _tiny_t2i_mmada(tmp_path / "mmada", words, codes)
    model = ddrl.load_model(path, dtype="bfloat16", vq_path=magvit_dir(tmp_path / "magvit")).eval()
    model.tokenizer.max_text_len = 4
    name, rng = ("emerge", "released") if sampler.startswith("released") else (sampler.split("_")[0], "ddrl")
    guided = 3.5 if sampler.endswith("guided") else 0.0
    cfg = load_config(ROOT / "configs/paper/maskgrpo/t2i_mmada.yaml", [
        f"model.path={path}", f"model.vq_path={tmp_path / 'magvit'}", "rollout.gen_length=64", "rollout.steps=3",
        "rollout.batch_rows=null", "train.prompts_per_step=1", "train.group_size=4", f"rollout.name={name}",
        f"rollout.rng={rng}", f"rollout.cfg_scale={guided}"], RLConfig)
    shape = model_shape(str(path))
    assert (shape.vocab, shape.codebook) == (model.vocab_size, codes)
    ids, mask = encode_prompts(model.tokenizer, ["a"] * 4)
    rollout = estimate_memory(cfg, shape, 1, prompt_tokens=ids.shape[1] + 1).phases["rollout"]  # + <|eoi|>
    logits, layer = rollout["block logits + fp32 temporaries"], rollout["no-grad forward (one layer)"]
    run = lambda: SAMPLERS.get(name)(model, ids, mask, cfg.rollout, generator=torch.Generator().manual_seed(0))  # noqa: E731
    with torch.no_grad():
        run()  # the backbone's RoPE table is built once, at its first call: not a sampler's allocation
        with _LiveBytes() as live:
            run()
    assert logits <= live.peak <= logits + layer, (live.peak, logits, layer)  # the layer's transient: at most its term


@pytest.mark.parametrize("top_p, top_k, temperature", [(0.95, 50, 1.0), (None, 50, 1.0), (None, 50, 0.0)],
                         ids=["top-p", "sampled", "greedy"])
def test_dream_step_estimate_matches_what_the_sampler_allocates(top_p, top_k, temperature):
    """Dream's sampler steps over the whole completion; the estimate's bytes per slot and id against what
    its step really keeps alive (4 rows x 64 slots x 4,000 ids, bf16 logits handed in as the model would,
    the vocabulary limited as for Dream's padded one). Measured: 28.0 (top-p), 24.0 (sampled), 14.0
    (greedy); the term was (c + 12) = 14 for every sampler before, and the rehearsal of coupled_grpo
    measured 28 (issue 33)."""
    from types import SimpleNamespace
    from unittest import mock

    import torch

    import ddrl.sampling.dream as dream
    from ddrl.training.memory import _dream_step_bytes

    B, L, V = 4, 64, 4000
    settings = dream.DreamRun(steps=3, alg="entropy", alg_temp=None, temperature=temperature, top_p=top_p,
                              top_k=top_k, eps=1e-3, vocab_limit=V - 100, mask_id=V - 1)
    logits = lambda *a, **k: torch.randn(B, L, V, dtype=torch.bfloat16)  # noqa: E731  (the model call's [B, L, V])
    with mock.patch.object(dream, "completion_logits", logits), torch.no_grad(), _LiveBytes() as live:
        dream._denoise(None, torch.zeros(B, 8, dtype=torch.long), None, settings, L,
                       torch.Generator().manual_seed(0), False)
    per_slot = _dream_step_bytes(SimpleNamespace(top_p=top_p, temperature=temperature), 2)
    assert per_slot <= live.peak / (B * L * V) <= per_slot * 1.01, (live.peak / (B * L * V), per_slot)


def test_update_counts_every_copy_an_estimator_batches_and_whole_group_micro_batches():
    """Copies in one forward and backward: udm's 3 grid states, fpo_elbo's 4 samples, stratified's 4
    strata, coupled_three_pass's 3 passes, a coupled pair per MC draw; and a micro-batch below a
    group trains the whole group (Trainer.micro_batches: MaskGRPO t2i's 3 rows of a group of 9 are 9)."""
    from ddrl.training.memory import estimator_copies
    from ddrl.training.method import build_method

    copies = {"udm_grpo_ursa.yaml": 3, "fpo_llada8b.yaml": 4, "dipod_llada8b.yaml": 4, "daca_grpo_llada8b.yaml": 4,
              "coupled_grpo_llada8b.yaml": 3, "espo_llada8b.yaml": 4, "spg_llada8b.yaml": 2,
              "diffu_grpo_llada8b.yaml": 1}
    for name, k in copies.items():
        assert estimator_copies(build_method(load_config(ROOT / "configs/paper" / name, [], RLConfig))) == k, name
    levels = load_config(ROOT / "configs/paper/udm_grpo_ursa.yaml",
                         ["method.estimator_args.states=levels", "method.estimator_args.t_values=[0.9,0.7]"], RLConfig)
    assert estimator_copies(build_method(levels)) == 2
    from ddrl.training.memory import MMADA_8B

    t2i = load_config(ROOT / "configs/paper/maskgrpo/t2i_mmada.yaml", ["model.gradient_checkpointing=false"], RLConfig)
    T, d, f = 256 + 1024, 4096, 12288
    # every block's: fp32 norm inputs and their fp32 rsqrt, bf16 the rest (SDPA's q, k, v and output, 32 heads
    # of 128 = d each, with an fp32 log-sum-exp per head; gate, SiLU, up), and its LoRA (q, k, v, up_proj at
    # rank 128, dropout 0.05): each adapter's bf16 input and bool mask (3 bytes per input element) and
    # rank-wide middle
    per_token = 32 * (2 * (4 * d + 4) + (4 * d + 3 * f) * 2 + 4 * 32 + 4 * d * 3 + 4 * 128 * 2)
    assert estimate_memory(t2i, MMADA_8B, 8).phases["update"]["activations"] == 9 * T * per_token


def test_lora_block_activations_match_the_rehearsal_tracker_of_llada_8b():
    """What one LLaDA-8B block keeps for backward per token under d1's LoRA (q, k, v, up_proj; rank 128,
    dropout 0.05) and bf16 autocast, counted from the rehearsal's MemTracker at 2 layers (issue 33; d1,
    6 rows x 456 tokens, unit U = T d 2 bytes): RMSNorms' fp32 inputs 2 + 2 U, rotated q and k 2 U, v 1 U,
    attention output 1 U, gate output, its SiLU and up output 3 + 3 + 3 U, each adapter's bf16 input and
    bool dropout mask 1.5 U x 4: 23 U (the tracker's 23.6 adds the adapters' rank-wide middles, the
    attention's fp32 log-sum-exp, 4 bytes a head, and the norms' fp32 rsqrt, 4 bytes each). The hand
    model's block term must be these bytes, under autocast over the fp32 or bf16 base alike (r = 4, 2)."""
    from ddrl.training.memory import LLADA_8B, block_saved_bytes

    cfg = load_config(ROOT / "configs/paper/diffu_grpo_llada8b.yaml", [], RLConfig)
    d = LLADA_8B.d_model
    U = d * 2
    small = 4 * 128 * 2 + 4 * 32 + 2 * 4  # adapters' middles, log-sum-exp, rsqrt
    assert block_saved_bytes(cfg, LLADA_8B, 2, 4) == block_saved_bytes(cfg, LLADA_8B, 2, 2) == 23 * U + small
    without_dropout = load_config(ROOT / "configs/paper/diffu_grpo_llada8b.yaml", ["model.lora.dropout=0"], RLConfig)
    assert block_saved_bytes(without_dropout, LLADA_8B, 2, 4) == 23 * U - 4 * d + small  # no masks


def test_estimator_copies_are_what_the_estimator_declares():
    """The memory model reads an estimator's copies_per_row, not its class name (issue 35)."""
    from types import SimpleNamespace

    from ddrl.training.memory import estimator_copies

    class FiveCopies:
        copies_per_row = 5

    class Undeclared:
        num_mc = 3  # a field the old name-guessing would have read

    assert estimator_copies(SimpleNamespace(estimator=FiveCopies())) == 5
    with pytest.raises(ValueError, match="copies_per_row"):
        estimator_copies(SimpleNamespace(estimator=Undeclared()))
    sepo = load_config(ROOT / "configs/paper/sepo_llada8b.yaml", [], RLConfig)
    from ddrl.training.method import build_method

    assert estimator_copies(build_method(sepo)) == 16  # concrete_score: one sequence per probed position
    # SEPO's released DNA path (states=clean): the clean sequence is the graph's one row; the neighbours'
    # L x V passes are no_grad, and num_positions (4 by default) is not read
    dna = load_config(ROOT / "configs/paper/sepo/dna_enhancer.yaml", [], RLConfig)
    assert estimator_copies(build_method(dna)) == 1


def _block_peak_per_token(kind: str, backward: bool = False) -> dict[str, float]:
    """Bytes a token adds to the peak of one real-width LLaDA2.0-mini block ("dense": its first; "moe": a
    routed one) in full fine-tuning with bf16 weights (FSDP2's compute), by the rehearsal's MemTracker category
    ("ACT", "TEMP", ..., "Total"): a no-grad forward, or (backward) a checkpointed forward and its
    backward, the update's. Fake tensors (the rehearsal's host-read stand-ins route the tokens evenly),
    by difference between 16,384 and 32,768 tokens: enough that the tokens' part, not the weights'
    gradients, sets the moment of the peak, as at the recipes' 163,840."""
    import json
    from contextlib import ExitStack

    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
    from torch.utils.checkpoint import checkpoint

    from ddrl.models.native.llada2 import LLaDA2Backbone, LLaDA2Config
    from ddrl.training.memory import LLADA2_MINI as S
    from ddrl.training.rehearse import DeviceGuardless, HostReads, step_memory_tracker

    raw = json.loads((ROOT / "tests/fixtures/llada2/model-2.0/config.json").read_text())
    raw.update(hidden_size=S.d_model, num_attention_heads=S.n_heads, num_key_value_heads=S.n_kv_heads,
               head_dim=S.head_dim, intermediate_size=S.ffn, num_experts=S.experts, n_group=8, topk_group=4,
               num_experts_per_tok=S.experts_per_token, moe_intermediate_size=S.expert_ffn, num_hidden_layers=2)
    config = LLaDA2Config.from_dict(raw, block_size=32, token_editing=False)
    cpu = torch.device("cpu")
    peaks = []
    with ExitStack() as stack:
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        reads = HostReads()
        for context in (reads, reads.objects(), DeviceGuardless(reads)):
            stack.enter_context(context)
        with unset_fake_temporarily(), torch.device("meta"):
            model = LLaDA2Backbone(config).to(torch.bfloat16)
        model = model.to_empty(device=cpu)
        layer = model.layers[0 if kind == "dense" else 1]
        for T in (16384, 32768):
            h = torch.empty(1, T, S.d_model, dtype=torch.bfloat16).requires_grad_(backward)
            grad = torch.empty_like(h)  # the next block's gradient, made before the tracker starts
            cos, sin = model._rotary(torch.arange(T)[None], torch.bfloat16)
            layer.zero_grad(set_to_none=True)
            tracker = step_memory_tracker(layer)  # the rehearsal's MemTracker
            with tracker:
                start = tracker.get_tracker_snapshot("current").get(cpu, {})
                if backward:
                    out = checkpoint(lambda x, c, s: layer(x, c, s, None, None)[0], h, cos, sin, use_reentrant=False)
                    out.backward(grad)
                else:
                    with torch.no_grad():
                        out = layer(h, cos, sin, None, None)[0]
                del out
            peak = tracker.get_tracker_snapshot("peak")[cpu]
            peaks.append({str(k).split(".")[-1]: v - start.get(k, 0) for k, v in peak.items()})
    return {k: (peaks[1][k] - peaks[0][k]) / 16384 for k in peaks[0]}


def test_the_no_grad_forward_term_is_the_measured_peak_of_an_moe_block():
    """The rollout's one-layer transient: an MoE block's as measured, to 1% (routed_experts' fp32
    weighting of its K outputs; its gathered inputs and expert-ordered outputs freed with the expert
    calls: before, 250,016 bytes a token, twice this), and the dense block's to 10%."""
    from ddrl.training.memory import LLADA2_MINI, forward_transient_bytes

    moe = _block_peak_per_token("moe")["Total"]
    assert forward_transient_bytes(LLADA2_MINI, 2) == pytest.approx(moe, rel=0.01)
    d, f = LLADA2_MINI.d_model, LLADA2_MINI.ffn
    assert (4 * d + 3 * f) * 2 == pytest.approx(_block_peak_per_token("dense")["Total"], rel=0.1)
    assert forward_transient_bytes(LLADA_8B, 2) == (4 * 4096 + 3 * LLADA_8B.ffn) * 2  # a dense model: its block


def test_the_update_terms_are_the_measured_peak_of_an_moe_blocks_backward():
    """The update's block at the peak of its checkpointed forward and backward (full fine-tuning, bf16
    weights): what it saves (block_saved_bytes, to the byte on the tiny fixture) plus its input, and the
    temporaries on top (backward_temporary_bytes: its recomputed forward at the router's weighting), to 1%.
    Autograd over the weighting's ops, before WeightedSlots, held 393,628 bytes a token here (the fp32
    copy saved, two fp32 [T, K, d] gradients at once), which the dense block's 5 f c undercounted by
    96 KB: espo/llada2_mini's 15.8 GB (bench/RESULTS.md, issue 33)."""
    from ddrl.training.memory import LLADA2_MINI, backward_temporary_bytes, block_saved_bytes

    cfg = load_config(ROOT / "configs/paper/espo/llada2_mini.yaml", [], RLConfig)
    held = block_saved_bytes(cfg, LLADA2_MINI, 2, 2, moe=True) + LLADA2_MINI.d_model * 2
    measured = _block_peak_per_token("moe", backward=True)["Total"]
    assert held + backward_temporary_bytes(LLADA2_MINI, 2) == pytest.approx(measured, rel=0.01)
