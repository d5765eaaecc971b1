"""`ddrl train CONFIG --rehearse`: the trainer's own step of d1's LLaDA-8B LoRA recipe at full width
(4096 wide, 126,464-token vocabulary, LoRA rank 128) on fake tensors, rank 0 of 8 under FSDP2, at 2
and 4 layers (ddrl.training.rehearse). Quicker than the recipe in two settings that change neither
shape nor memory: 8 sampler steps (one per block of 32) instead of 128, and 2 iterations of mu=12 (the
second one's backward already holds AdamW's state)."""

import contextlib
import io
import json

import pytest

from ddrl.cli import main
from ddrl.training.memory import GB, MemoryEstimate
from ddrl.training.rehearse import Rehearsal, extrapolate, rehearse, rehearse_extrapolated

CONFIG = "configs/paper/diffu_grpo_llada8b.yaml"
QUICK = ["dist.strategy=fsdp", "rollout.steps=8", "train.num_iterations=2"]
WORLD = 8

# One LLaDA-8B block counted by hand from its config (d_model 4096, mlp_hidden_size 12288):
# q, k, v, attn_out 4 x 4096^2; ff_proj, up_proj, ff_out 3 x 4096 x 12288; attn_norm, ff_norm 2 x 4096.
BLOCK = 4 * 4096**2 + 3 * 4096 * 12288 + 2 * 4096
# LoRA rank 128 on q, k, v (4096 -> 4096) and up_proj (4096 -> 12288): A is r x in, B is out x r.
LORA = 3 * (128 * 4096 + 4096 * 128) + (128 * 4096 + 12288 * 128)
# The root module's parameters: the input embedding and the untied LM head (126,464 x 4096 each), ln_f.
ROOT = 2 * 126464 * 4096 + 4096


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(2-layer report from the CLI, its printed table, 4-layer report from the library)."""
    out = tmp_path_factory.mktemp("rehearse")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["train", CONFIG, *QUICK, f"output_dir={out / 'two'}", "--rehearse", "--world-size", str(WORLD),
                     "--layers", "2"])
    assert code == 0
    two = json.loads((out / "two" / "rehearsal" / "rehearsal.json").read_text())
    four = rehearse(CONFIG, [*QUICK, f"output_dir={out / 'four'}"], WORLD, layers=4)
    return two, printed.getvalue(), four


def test_cli_prints_the_measured_table(runs):
    two, printed, _ = runs
    assert "rehearsal of configs/paper/diffu_grpo_llada8b.yaml: rank 0 of 8, 2 layers" in printed
    assert "peak (tracker)" in printed and "hand model" in printed and "tracker / hand" in printed
    assert f"host syncs in the step: {sum(two['host_reads'].values())}" in printed
    assert "rollout" in printed and "update" in printed and "fits a 141 GB H200" in printed
    assert f"{two['peak_bytes'] / GB:9.2f}" in printed


def test_the_whole_step_ran_to_the_optimizer(runs):
    two, _, four = runs
    # 2 iterations x 1 micro-batch share: two AdamW steps; the state is exp_avg + exp_avg_sq (fp32) of this
    # rank's 1/8 of the LoRA weights, plus one step counter per tensor
    assert two["optimizer_steps"] == 2 and four.optimizer_steps == 2
    for layers, state in ((2, two["optimizer_state_bytes"]), (4, four.optimizer_state_bytes)):
        assert state == pytest.approx(layers * 2 * 4 * LORA / WORLD, rel=0.01)
    assert four.rollout_s > 0 and four.update_s > 0 and four.update_flops > 0


def test_peak_grows_by_one_sharded_block_per_layer_and_extrapolates(runs):
    two, _, four = runs
    two = Rehearsal.from_json(two)
    # parameters at the peak: each layer adds its 1/8 shard (bf16 base, fp32 LoRA); the gathered blocks
    # and the embeddings do not depend on depth
    params = "parameters (shards, gathered blocks)"
    per_layer = (BLOCK * 2 + LORA * 4) / WORLD
    assert (four.peak_split[params] - two.peak_split[params]) / 2 == pytest.approx(per_layer, rel=0.02)
    # the rollout samples with every block gathered (distributed.gathered_parameters: no collective per
    # sampler step), bf16 under the mixed-precision policy: at 4 layers its peak is a sampler call's, which
    # holds the whole model gathered (each layer a whole block and its shard, the root its embedding and head)
    gathered = BLOCK * 2 + LORA * 2 + per_layer
    assert four.rollout_peak_split[params] == pytest.approx(ROOT * 2 + ROOT * 2 / WORLD + 4 * gathered, rel=0.02)
    # Not the difference of the two depths: at 2 layers the rollout's peak is the depth-free moment the root
    # is gathered, FSDP2's all-gather buffer and the copies out of it both held (2 x ROOT in bf16, counted as
    # activations: made outside any parameter's hook), above 2 layers' sampling (4.53 vs 4.45 GB), so its
    # parameter split is the shards alone. Sampling at 2 layers peaked higher (4.76 GB) only while MemTracker's
    # ModTracker kept each sampler step's embedding output (a leaf made to require grad by peft's hook, under
    # no_grad) alive through the gradient hook it hangs on a module's inputs: 7 x [12, 456, 4096] at the 8th step.
    assert two.rollout_peak_bytes >= ROOT * 2 * 2 + (ROOT * 2 + 2 * (BLOCK * 2 + LORA * 4)) / WORLD
    step = (four.peak_bytes - two.peak_bytes) / 2
    assert per_layer < step < 1 * GB  # plus the layer's kept activations, LoRA gradients and AdamW state
    full = extrapolate(two, four, 32, MemoryEstimate(held={}, phases={"update": {}}))
    # two lines, the rollout's and the step's, each four's value plus 14 increments of 2 layers
    rollout = four.rollout_peak_bytes + 14 * (four.rollout_peak_bytes - two.rollout_peak_bytes)
    whole = four.peak_bytes + 14 * (four.peak_bytes - two.peak_bytes)
    assert full.peak_bytes == pytest.approx(max(rollout, whole)) and full.rollout_peak_bytes == pytest.approx(rollout)
    # the split of the line that peaks, extrapolated by category: it adds up to the peak, none negative
    assert sum(full.peak_split.values()) == pytest.approx(full.peak_bytes) and min(full.peak_split.values()) >= 0
    assert full.measured_layers == (2, 4) and "extrapolated from 2 and 4 layers" in full.table()


def test_extrapolation_gives_a_full_depth_rehearsals_figures(tmp_path):
    """--extrapolate against the whole model: d1's LLaDA-8B LoRA recipe as it ships (DDP) at all 32 layers
    (about a minute here at one sampler step a block) and from its 4- and 6-layer rehearsals. Every block
    adds the same bytes, FLOPs and host reads, so the line through two depths lands on the full depth's
    figures; a term that grew otherwise (a per-layer buffer kept across layers, a depth-dependent peak
    moment) breaks it."""
    overrides = ["rollout.steps=8", "train.num_iterations=2"]
    full = rehearse(CONFIG, [*overrides, f"output_dir={tmp_path / 'full'}"], WORLD)
    line = rehearse_extrapolated(CONFIG, [*overrides, f"output_dir={tmp_path / 'line'}"], WORLD)
    assert full.layers == line.layers == 32 and full.measured_layers == () and line.measured_layers == (4, 6)
    for figure in ("peak_bytes", "rollout_peak_bytes", "optimizer_state_bytes", "update_flops", "rollout_s", "update_s"):
        assert getattr(line, figure) == pytest.approx(getattr(full, figure), rel=1e-9), figure
    assert line.peak_split.keys() == full.peak_split.keys()
    assert all(line.peak_split[k] == pytest.approx(v, rel=1e-9) for k, v in full.peak_split.items())
    assert line.host_reads == full.host_reads


def test_hand_model_within_a_stated_factor(runs):
    _, _, four = runs
    assert 0.67 < four.peak_bytes / four.hand_total_bytes < 1.5


def test_host_syncs_are_counted_and_do_not_depend_on_depth(runs):
    two, _, four = runs
    assert two["host_reads"] == four.host_reads
    sites = four.host_reads
    # the update's one sync per optimizer step (bool of isfinite(loss & grad norm)), once per iteration
    assert sum(n for s, n in sites.items() if "trainer.py" in s and s.endswith(" update") and "item" in s) >= 2
    # the data-dependent reads the previous rehearsal stopped at, now counted
    assert any("unique at ddrl/objectives/aggregation.py" in s for s in sites)
    assert any("boolean mask" in s and "aggregation.py" in s for s in sites)
    # one host copy per .tolist(), not one per element: decoding 12 rows x 256 tokens is one read
    assert all(n < 100 for n in sites.values())


# ------------------------------------------------------------------ the rest of the representative set
# Each at 2 layers, full width, rank 0 of 8, cut as QUICK in what changes neither a shape nor the peak:
# URSA's text-to-image (full fine-tuning, FSDP2), MMaDA's text-to-image (LoRA, DDP, MAGVIT-v2 decoder) and
# LLaDA2-mini's 256-expert MoE with full fine-tuning and CPU offload. LLaDA2's completion is cut to 64
# tokens (2 blocks of 32) for the suite's time: each expert is a module call per forward; the bench
# (bench/rehearse_all.py) runs the recipe's own 2,048.
RECIPES = {"ursa": ("configs/paper/udm_grpo_ursa.yaml", ["rollout.steps=2"]),
           "mmada": ("configs/paper/maskgrpo/t2i_mmada.yaml", ["rollout.steps=1", "train.num_iterations=1"]),
           "llada2": ("configs/paper/espo/llada2_mini.yaml",
                      ["rollout.gen_length=64", "rollout.steps=2", "train.num_iterations=1"])}
PARAMS = "parameters (shards, gathered blocks)"


@pytest.fixture(scope="module")
def rehearsed(tmp_path_factory):
    """name -> the report as rehearsal.json holds it, each recipe rehearsed once (at 2 layers)."""
    out, done = tmp_path_factory.mktemp("recipes"), {}

    def get(name, layers=2):
        if (name, layers) not in done:
            config, overrides = RECIPES[name]
            run = out / f"{name}-{layers}"
            rehearse(config, [*overrides, f"output_dir={run}"], WORLD, layers=layers, check_fit=False)
            done[name, layers] = json.loads((run / "rehearsal" / "rehearsal.json").read_text())
        return done[name, layers]

    return get


@pytest.mark.parametrize("name, embedding", [
    ("ursa", (151936 + 131072) * 2048 * 4 / WORLD),  # fp32 shards of URSA-1.7B's embedding (FSDP2)
    ("mmada", (126464 + 8192) * 4096 * 2)])  # MMaDA-8B's whole bf16 embedding (DDP)
def test_text_to_image_recipes_rehearse_to_the_optimizer(rehearsed, name, embedding):
    r = rehearsed(name)
    assert r["optimizer_steps"] >= 1 and r["optimizer_state_bytes"] > 0 and r["update_s"] > 0
    assert r["peak_split"][PARAMS] > embedding  # the model at its published width, not the fixture's
    assert 0 < r["rollout_peak_bytes"] <= r["peak_bytes"]
    # the images were decoded for the reward: its one check of the codes is a counted host sync
    assert any("decode_images" in site for site in r["host_reads"]) and sum(r["host_reads"].values()) < 200


def test_mmada_peak_grows_by_one_block_per_layer(rehearsed):
    one, two = rehearsed("mmada", 1), rehearsed("mmada", 2)
    # DDP: each layer adds a whole bf16 LLaDA block and its fp32 LoRA weights (MMaDA's blocks are LLaDA's)
    assert two["peak_split"][PARAMS] - one["peak_split"][PARAMS] == pytest.approx(BLOCK * 2 + LORA * 4, rel=0.02)
    assert two["peak_bytes"] > one["peak_bytes"] > 0 and two["host_reads"] == one["host_reads"]


def test_llada2_moe_full_fine_tuning_with_offload(rehearsed):
    r = rehearsed("llada2")
    # LLaDA2-mini at 2 layers by hand from its config.json: untied embedding and head (157,184 x 2048),
    # two attention blocks (fused qkv 2048 -> (16 + 2 x 4) x 128, dense 2048 -> 2048), the dense first
    # MLP (3 x 2048 x 5120), and the MoE layer: 256 experts and one shared (3 x 2048 x 512 each), router
    experts = 256 * 3 * 2048 * 512
    total = 2 * 157184 * 2048 + 2 * (2048 * 3072 + 2048 * 2048) + 3 * 2048 * 5120 + experts + 3 * 2048 * 512 + 256 * 2048
    # every expert trained at full size: AdamW's fp32 exp_avg and exp_avg_sq of this rank's 1/8 of all of them
    assert r["optimizer_state_bytes"] == pytest.approx(2 * 4 * total / WORLD, rel=0.01)
    # host memory, not counted: AdamW's state and the sharded gradients (FSDP2 copies each to its shard's host memory)
    assert r["settings"]["cpu_offload"] and "optimizer state" not in r["peak_split"] and "gradients" not in r["peak_split"]
    assert r["peak_bytes"] > 0 and r["optimizer_steps"] == 1
    assert any("tolist at ddrl/models/native/llada2.py" in site for site in r["host_reads"])  # routing counts


@pytest.mark.parametrize("rows", [1, 2])  # 12 calls of one row; 6 of two
def test_replayed_sampler_calls_give_the_figures_of_every_call_rehearsed(tmp_path, rows):
    """A rank's 12 rollout rows (16 prompts x 6 / 8 ranks) in calls of `rows`: the first and last calls
    rehearsed, the rest replayed, against every call rehearsed (rehearse's replay_calls)."""
    overrides = [*QUICK, "train.num_iterations=1", "rollout.gen_length=64", f"rollout.batch_rows={rows}"]
    every, replayed = (rehearse(CONFIG, [*overrides, f"output_dir={tmp_path / str(replay)}"], WORLD, layers=1,
                                check_fit=False, replay_calls=replay) for replay in (False, True))
    assert (replayed.sampler_calls, replayed.replayed_calls) == ((12, 10) if rows == 1 else (6, 4))
    assert replayed.rollout_peak_bytes == every.rollout_peak_bytes and replayed.peak_bytes == every.peak_bytes
    assert replayed.host_reads == every.host_reads and sum(every.host_reads.values()) > 0
    assert replayed.rollout_s == pytest.approx(every.rollout_s, rel=1e-9)  # each replayed call the last's time
    assert "sampler calls (rollout.batch_rows)" in replayed.table()
