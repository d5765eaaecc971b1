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
from ddrl.training.rehearse import Rehearsal, extrapolate, rehearse

CONFIG = "configs/paper/diffu_grpo_llada8b.yaml"
QUICK = ["dist.strategy=fsdp", "rollout.steps=8", "train.num_iterations=2"]
WORLD = 8

# One LLaDA-8B block counted by hand from its config (d_model 4096, mlp_hidden_size 12288):
# q, k, v, attn_out 4 x 4096^2; ff_proj, up_proj, ff_out 3 x 4096 x 12288; attn_norm, ff_norm 2 x 4096.
BLOCK = 4 * 4096**2 + 3 * 4096 * 12288 + 2 * 4096
# LoRA rank 128 on q, k, v (4096 -> 4096) and up_proj (4096 -> 12288): A is r x in, B is out x r.
LORA = 3 * (128 * 4096 + 4096 * 128) + (128 * 4096 + 12288 * 128)


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
    # sampler step), bf16 under the mixed-precision policy: each layer adds a whole block and its shard
    gathered = BLOCK * 2 + LORA * 2 + per_layer
    assert (four.rollout_peak_split[params] - two.rollout_peak_split[params]) / 2 == pytest.approx(gathered, rel=0.02)
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
