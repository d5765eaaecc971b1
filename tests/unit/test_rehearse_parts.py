"""The parts of `ddrl train --rehearse` (ddrl.training.rehearse) that run without a whole step."""

import json
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ddrl.training.memory import GB, LLADA_8B, LLADA2_MINI, shape_from_config
from ddrl.training.rehearse import FIXTURES, HostReads, family_source, sized_config


def test_llada_fixture_config_resized_to_the_published_shape():
    source, shape = family_source("/path/to/LLaDA-8B-Instruct")
    assert shape == LLADA_8B
    sized = sized_config(json.loads((source / "config.json").read_text()), shape, None)
    assert (sized["d_model"], sized["n_layers"], sized["mlp_hidden_size"], sized["embedding_size"]) == (
        4096, 32, 12288, 126464)
    assert shape_from_config(sized).params == LLADA_8B.params  # 8.0B: the hand model reads the same sizes


def test_reduced_layer_count_and_moe_fields():
    raw = json.loads((FIXTURES / "llada2/model-2.0/config.json").read_text())
    sized = sized_config(raw, LLADA2_MINI, 4)
    assert sized["num_hidden_layers"] == 4 and sized["num_experts"] == 256 and sized["moe_intermediate_size"] == 512
    assert sized["rotary_dim"] == 64  # half of a 128-wide head (partial_rotary_factor 0.5)


def test_host_reads_are_counted_by_call_site():
    reads = HostReads()
    with FakeTensorMode(), reads:
        x = torch.ones(3, 4)
        reads.counting = True
        assert bool((x > 0).any())  # stand-in True
        assert x.sum().item() == 1.0  # stand-in 1.0: fake tensors hold no values
        idx = torch.nonzero(x)
    assert idx.shape == (12, 2)  # stand-in: every element
    assert reads.total == 3
    assert all("test_rehearse_parts" not in site for site in reads.sites)  # sites name ddrl frames only


def test_a_host_scalar_of_known_value_is_read_without_a_sync():
    """DRAKES's m(t) = 1 - alpha(torch.tensor(t)) is host arithmetic on a real GPU: no device read. Under
    FakeTensorMode it is a constant; its value comes back and nothing is counted. A device value is."""
    from ddrl.processes.schedules import LogLinearSchedule

    reads = HostReads()
    with FakeTensorMode(), reads:
        reads.counting = True
        m = float(1.0 - LogLinearSchedule().alpha(torch.tensor(0.25, dtype=torch.float64)))
        device_value = torch.ones(3).sum().item()
    assert m == pytest.approx((1 - 1e-3) * 0.25, rel=1e-12)
    assert device_value == 1.0 and reads.total == 1


def test_unknown_placeholder_is_refused_with_the_known_families():
    try:
        family_source("/path/to/SomeOther-7B")
    except ValueError as e:
        assert "LLaDA-8B" in str(e) and "model.path" in str(e)
    else:
        raise AssertionError("an unknown placeholder was accepted")


def _report(**changes):
    from ddrl.training.rehearse import Rehearsal

    base = dict(config="big.yaml", world_size=8, layers=32, strategy="ddp",
                peak_split={"parameters (shards, gathered blocks)": 16 * GB, "gradients": 32 * GB,
                            "optimizer state": 64 * GB, "activations (forward outputs kept)": 40 * GB},
                peak_bytes=152 * GB, rollout_peak_bytes=20 * GB, rollout_peak_split={}, hand_total_bytes=150 * GB, hand_terms={},
                host_reads={}, rollout_s=1.0, update_s=1.0, update_flops=1.0, tokens=1,
                settings={"strategy": "ddp", "cpu_offload": False, "lora_rank": 0, "micro_batch_size": 6,
                          "gradient_checkpointing": False})
    return Rehearsal(**{**base, **changes})


def test_extrapolated_host_reads_grow_only_where_a_layer_makes_them():
    """LLaDA2-mini's MoE routing counts are read once an MoE layer a forward (4 layers: 3 MoE, 6: 5);
    the sampler's stopping rule once a forward at any depth. 20 layers: 19 MoE."""
    from ddrl.training.memory import MemoryEstimate
    from ddrl.training.rehearse import extrapolate

    forwards, rule, routing = 1040, "item at ddrl/sampling/commit.py:179 more_steps", "tolist at llada2.py routed_experts"
    fewer = _report(layers=4, host_reads={rule: forwards, routing: 3 * forwards})
    more = _report(layers=6, host_reads={rule: forwards, routing: 5 * forwards, "item at a 6-layer-only site": 1})
    full = extrapolate(fewer, more, 20, MemoryEstimate(held={"weights": GB}, phases={"update": {"activations": GB}}))
    assert full.host_reads[rule] == forwards and full.host_reads[routing] == 19 * forwards
    assert full.host_reads["item at a 6-layer-only site"] == 8  # a line through 0 at 4 layers and 1 at 6


def test_a_recipe_that_does_not_fit_is_refused_with_its_split_and_the_settings_that_shrink_it():
    from ddrl.training.rehearse import RecipeDoesNotFit, require_fit

    try:
        require_fit(_report())
    except RecipeDoesNotFit as e:
        text = str(e)
    else:
        raise AssertionError("152 GB on a 141 GB H200 was accepted")
    assert "does not fit: rank 0 peaks at 152.0 GB" in text and "optimizer state" in text  # the split
    advice = text[text.index("Settings that lower it"):].splitlines()[1:]
    # the state (112 GB) outweighs the activations (40 GB): sharding and LoRA come first
    assert advice[0].startswith("  - dist.strategy=fsdp") and "[112.0 GB of the peak]" in advice[0]
    assert any("model.lora.rank" in a for a in advice) and "gradient_checkpointing=true" in advice[-2]
    assert advice[-1].startswith("  - train.micro_batch_size=3")
    # a recipe already sharded, offloaded, with LoRA and checkpointing is told only what is left
    done = _report(settings={"strategy": "fsdp", "cpu_offload": True, "lora_rank": 128, "micro_batch_size": 1,
                             "gradient_checkpointing": True})
    try:
        require_fit(done)
    except RecipeDoesNotFit as e:
        left = str(e)[str(e).index("Settings that lower it"):].splitlines()[1:]
    assert left == ["  - --world-size 16 (1/16 of the sharded state) [112.0 GB of the peak]"]
    require_fit(_report(peak_bytes=120 * GB))  # 120 GB <= 90% of 141 GB: fits, nothing raised


def test_a_whole_tensor_read_is_one_sync_and_routing_counts_stand_in_balanced():
    reads = HostReads()
    with FakeTensorMode(), reads, reads.objects():
        reads.counting = True
        rows = torch.ones(12, 256, dtype=torch.long).tolist()  # decoding completions: one device-to-host copy
        assert len(rows) == 12 and len(rows[0]) == 256
        counts = torch.bincount(torch.ones(30, dtype=torch.long), minlength=8).tolist()  # an MoE's routing
        chosen = torch.ones(5, 3)[torch.ones(5, dtype=torch.bool)]  # x[mask]: nonzero, a sync on a GPU
    assert counts == [4, 4, 4, 4, 4, 4, 3, 3]  # 30 routed pairs over 8 experts, as even as integers allow
    assert chosen.shape == (5, 3)  # the stand-in selects every row: the largest shape the read can give
    assert reads.sites == {"tolist at outside ddrl": 2, "nonzero (a read through a boolean mask) at outside ddrl": 1}


def test_ursa_pipeline_sized_with_its_codebook_in_every_part(tmp_path):
    """The transformer's head, the VQ decoder's codebook and the metric path's codebook are one size,
    which URSA's loader checks: all three at URSA-1.7B's 2**17 codes; the embedding at full size."""
    from ddrl.training.memory import URSA_1_7B
    from ddrl.training.rehearse import sized_model_dir

    directory, shape = sized_model_dir("/path/to/URSA-1.7B-IBQ512", 2, tmp_path)
    transformer = json.loads((directory / "transformer" / "config.json").read_text())
    assert (transformer["lm_head_size"], transformer["vocab_size"], transformer["hidden_size"]) == (
        131072, 151936 + 131072, 2048)
    assert transformer["lm_vocab_size"] + transformer["lm_head_size"] <= transformer["vocab_size"]
    assert json.loads((directory / "vae" / "config.json").read_text())["num_vq_embeddings"] == 131072
    codebook = torch.load(directory / "scheduler" / "scheduler_model.pth", weights_only=True)["path.emb"]
    assert codebook.shape[0] == 131072 and shape.codebook == URSA_1_7B.codebook and shape.n_layers == 2
    # the fixture itself is untouched (the sized directory links every other file)
    assert json.loads((FIXTURES / "ursa/model/vae/config.json").read_text())["num_vq_embeddings"] == 64


def test_stand_in_task_takes_the_recipes_image_grid():
    from ddrl.config import RLConfig, load_config
    from ddrl.training.rehearse import StandInTask

    image = StandInTask.of_recipe(load_config("configs/paper/udm_grpo_ursa.yaml", [], RLConfig), "a cat")
    text = StandInTask.of_recipe(load_config("configs/paper/diffu_grpo_llada8b.yaml", [], RLConfig), "1 + 1")
    assert (image.modality, image.image_grid) == ("image", (32, 32))
    assert (text.modality, text.image_grid) == ("text", None)


def test_a_check_that_refuses_bad_data_is_answered_as_passing(tmp_path):
    """A boolean read is answered True (an early exit taken, a finite loss), except inside the named
    checks whose True means "refuse this data" (image codes outside the codebook): there False."""
    from ddrl.models.native.magvit2 import MAGVITv2Decoder
    from ddrl.training.rehearse import _weights_unread, stand_in_vq_dir

    reads = HostReads()
    with FakeTensorMode(allow_non_fake_inputs=True), reads:
        reads.counting = True
        codes = torch.zeros(2, 4, dtype=torch.long)
        from ddrl.data import decode_image_ids

        class Decoding:  # decode_image_ids's view of a model: its codebook ids and decoder
            image_token_range = (10, 20)

            def decode_images(self, codes):
                return torch.zeros(codes.shape[0], 3, 8, 8)

        assert decode_image_ids(Decoding(), codes + 10, (2, 2)).shape == (2, 3, 8, 8)  # no ValueError
        assert bool((codes > 0).any())  # elsewhere the stand-in stays True
    assert any("decode_image_ids" in site for site in reads.sites)
    # the stand-in MAGVIT-v2 directory loads as the released layout, at the decoder's real size
    vq = stand_in_vq_dir(tmp_path)
    with torch.device("meta"), _weights_unread():
        decoder = MAGVITv2Decoder.from_pretrained(vq)
    assert sum(p.numel() for p in decoder.parameters()) > 30e6  # MAGVIT-v2's decoder: ~40M parameters


def _bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("rehearse_all", "bench/rehearse_all.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bench_picks_the_recipes_own_world_size():
    bench = _bench()
    world, note = bench.recipe_world_size(Path("configs/paper/gdsd_llada8b.yaml"), 8)
    assert world == 5 and "20 prompt groups do not split over 8" in note
    assert bench.recipe_world_size(Path("configs/paper/diffu_grpo_llada8b.yaml"), 8) == (8, "")

    # the bench's overrides reach the prompt count it splits over ranks
    assert bench.recipe_world_size(Path("configs/paper/diffu_grpo_llada8b.yaml"), 8, ("train.prompts_per_step=6",)) \
        == (6, " (6 prompt groups do not split over 8: the recipe's own 6)")


def test_bench_passes_its_overrides_to_every_rehearsal(tmp_path, monkeypatch):
    """`bench/rehearse_all.py dist.strategy=fsdp dist.cpu_offload=true --quick --only ...`: each recipe is
    rehearsed with the overrides (then --quick's, computed from the overridden config), and its row
    and the section's command name them. The rehearsal itself is stood in: only the plumbing is tested."""
    from ddrl.training.rehearse import Rehearsal

    bench, asked = _bench(), []

    def rehearsed(config, overrides, world_size, check_fit, recipe_steps, one_share):
        asked.append((Path(config).name, list(overrides), world_size, recipe_steps, one_share))
        return Rehearsal(config=str(config), world_size=world_size, layers=32, strategy="fsdp", peak_bytes=30e9,
                         peak_split={}, rollout_peak_bytes=20e9, rollout_peak_split={}, hand_total_bytes=25e9,
                         hand_terms={}, host_reads={"item at x": 2}, rollout_s=1.0, update_s=2.0, update_flops=1.0,
                         tokens=1)

    monkeypatch.setattr(bench, "rehearse_extrapolated", rehearsed)
    out = tmp_path / "RESULTS.md"
    words = ["dist.strategy=fsdp", "dist.cpu_offload=true", "rollout.gen_length=128"]
    assert bench.main([*words, "--quick", "--only", "diffu_grpo_llada8b", "--out", str(out)]) == 0
    (name, overrides, world, steps, one_share), = asked
    assert name == "diffu_grpo_llada8b.yaml" and world == 8
    # the recipe's own sampler steps (TraceRL's states come from them), before --quick's; no micro_batch_rows
    assert steps == 128  # configs/paper/diffu_grpo_llada8b.yaml's rollout.steps (--quick makes them 4)
    assert one_share is False
    # the bench's words first, then --quick's: one sampler step per block of the overridden 128 tokens
    assert overrides[:3] == words and "rollout.steps=4" in overrides[3:]
    text = out.read_text()
    assert "`bench/rehearse_all.py dist.strategy=fsdp dist.cpu_offload=true rollout.gen_length=128 --quick`" in text
    assert "| configs/paper/diffu_grpo_llada8b.yaml dist.strategy=fsdp dist.cpu_offload=true rollout.gen_length=128 " \
           "| 8 | fsdp | 30.0 | 25.0 | 1.20 |" in text
    with pytest.raises(SystemExit):  # an override given after --only would be read as a recipe substring
        bench.parse_args(["--only", "d1", "dist.cpu_offload=true"])


def test_bench_hand_only_lists_the_hand_model_without_rehearsing(capsys, monkeypatch):
    """`bench/rehearse_all.py [KEY=VALUE ...] --hand-only`: the hand column at each row's world size and
    with the overrides, in seconds (no rehearsal), e.g. to recheck every ratio after a hand-model change."""
    from ddrl.config import RLConfig, load_config
    from ddrl.training.memory import estimate_memory

    bench = _bench()
    monkeypatch.setattr(bench, "rehearse_extrapolated", lambda *a, **k: pytest.fail("--hand-only rehearsed"))
    figures = {}
    for words in ([], ["dist.strategy=fsdp"]):
        assert bench.main([*words, "--quick", "--hand-only", "--only", "diffu_grpo_llada8b", "gdsd_llada8b"]) == 0
        rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| configs/")]
        assert [r.split(" | ")[1].split()[0] for r in rows] == ["8", "5"]  # gdsd's 20 groups: its own 5
        figures[tuple(words)] = float(rows[0].split(" | ")[2].rstrip(" |"))
    # LLaDA-8B LoRA under DDP and FSDP2: the hand model at the published shape, 8 ranks, --quick's overrides and
    # the recipe's 200-token prompts (rollout.max_prompt_length)
    for words, figure in figures.items():
        path = Path("configs/paper/diffu_grpo_llada8b.yaml")
        cfg = load_config(path, [*words, *bench.quick_overrides(path, tuple(words))[0]], RLConfig)
        assert figure == pytest.approx(estimate_memory(cfg, LLADA_8B, 8, prompt_tokens=200).total / GB, abs=0.06)
    assert figures[("dist.strategy=fsdp",)] < figures[()] - 5  # FSDP2 shards what DDP replicates


def test_sepo_dna_placeholder_is_built_at_drakes_size_and_rehearsed_whole(tmp_path):
    """configs/paper/sepo/dna_enhancer.yaml names a Lightning .ckpt: the rehearsal writes the CNN in ddrl's
    layout at DRAKES's size (128 channels, 4 stacks of 5 dilated convolutions), loadable by load_model, and
    refuses a layer count (its config has none to resize)."""
    import ddrl
    from ddrl.training.rehearse import sized_model_dir

    directory, shape = sized_model_dir("/path/to/mdlm_dna_pretrained.ckpt", None, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    assert (config["model_type"], config["hidden_dim"], config["num_cnn_stacks"], config["length"]) == (
        "mdlm_dna", 128, 4, 200)
    assert (shape.d_model, shape.n_layers, shape.vocab) == (128, 20, 5)
    model = ddrl.load_model(directory)
    assert model.family == "mdlm_dna" and len(model.model.convs) == 20
    with pytest.raises(ValueError, match="rehearsed whole"):
        sized_model_dir("/path/to/mdlm_dna_pretrained.ckpt", 4, tmp_path / "again")


def test_roofline_times_an_op_by_the_h200_figures_and_tracks_no_module():
    """The rehearsal's clock: one bf16 [4096 x 4096] @ [4096 x 4096] matmul takes 2 * 4096^3 flops at 989
    TFLOP/s (compute-bound), and no ModTracker hooks are hung on module calls (the total is all the
    rehearsal reads; an MoE block's 256 expert calls a layer made those hooks most of its CPU time)."""
    import torch.nn.modules.module as module_hooks

    from ddrl.training.rehearse import DEVICE, roofline

    with FakeTensorMode():
        a = torch.empty(4096, 4096, dtype=torch.bfloat16, device="cuda")
        linear = torch.nn.Linear(8, 8)
        with roofline(DEVICE) as est:
            assert not module_hooks._global_forward_pre_hooks and not module_hooks._global_forward_hooks
            _ = a @ a
            ms = est.total_runtime
            linear(torch.empty(2, 8))
    assert ms == pytest.approx(2 * 4096 ** 3 / (DEVICE.bf16_tflops * 1e12) * 1e3, rel=1e-6)


def test_roofline_charges_no_time_to_metadata_views_and_allocations():
    """`x.device`, a slice and torch.empty move no data on a GPU: torch's roofline charged each the bytes of
    its tensors at HBM speed (78% of a rehearsed LLaDA2 step's time was prim::device). A copy and an
    in-place add still move theirs: 2 and 3 x 1 GiB (read, read + write) at 4.8 TB/s."""
    from ddrl.training.rehearse import DEVICE, roofline

    with FakeTensorMode():
        x = torch.empty(2 ** 29, dtype=torch.bfloat16, device="cuda")  # 1 GiB
        with roofline(DEVICE) as est:
            _ = x.device, torch.ops.aten.slice(x, 0, 0, 2 ** 28), x.narrow(0, 8, 8), torch.empty_like(x), x.view(2, -1)
            free = est.total_runtime
            y = x.clone()
            copy = est.total_runtime - free
            y.add_(x)
            add = est.total_runtime - free - copy
    assert free == 0
    gib_ms = 2 ** 30 / (DEVICE.hbm_gbps * 1e9) * 1e3
    assert copy == pytest.approx(2 * gib_ms, rel=1e-3) and add == pytest.approx(3 * gib_ms, rel=1e-3)
