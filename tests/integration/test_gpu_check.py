"""bench/gpu/check.sh runs at a tiny shape on the CPU in make test, so the GPU check cannot rot: every
section runs the code path it runs on an H200 and the report holds the fields bench/RESULTS.md reads."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

from tests.integration.conftest import ROOT

SECTIONS = ("matmul", "rollout", "lora", "full", "offload", "memory")
CORE = ("matmul", "rollout", "lora", "full")  # run in every tree; offload and memory need code that may not be merged


def merged() -> dict[str, bool]:
    """Whether this tree has what the offload and memory sections call (else they must say skipped)."""
    import inspect

    from ddrl.training.distributed import shard_model

    return {"offload": "cpu_offload" in inspect.signature(shard_model).parameters,
            "memory": importlib.util.find_spec("ddrl.training.memory") is not None}


def load_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu" / "check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_check_sh_tiny_writes_the_whole_report(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(ROOT / "bench/gpu/check.sh"), "--tiny", "--out", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["finished"] and report["tiny"] and report["device"] == "cpu"
    assert {name: report[name]["status"] for name in CORE} == {name: "ok" for name in CORE}
    for name, present in merged().items():
        assert report[name]["status"] == "ok" if present else report[name]["status"].startswith("skipped: ")
    assert report["matmul"]["flops_per_s"] > 0

    workload = report["workload"]
    rollout = report["rollout"]
    ref, dual = rollout["variants"]["none"], rollout["variants"]["dual"]
    assert ref["model_calls"] == dual["model_calls"] == workload["steps"]  # equal steps
    assert dual["forward_tokens"] < ref["forward_tokens"]  # the cache is really on
    assert ref["tokens_per_s"] > 0 and ref["speedup_vs_reference"] == 1.0
    assert rollout["rows"] == workload["prompts"] * workload["group_size"]

    lora, shape = report["lora"], report["shape"]
    assert lora["adapted_linears"] == 7 * shape["n_layers"]  # every linear layer of every block, not the head
    assert lora["adapter_dtype"] == "float32" and lora["loss_finite"]
    assert 0 < lora["mfu"] and math.isfinite(lora["mfu"]) and lora["step_s"] > 0 and lora["score_pass_mfu"] > 0
    # model FLOPs: 4 N per token (blocks) + 4 N_head per completion position, for every row once
    T = workload["prompt_length"] + workload["gen_length"]
    assert lora["tokens_per_step"] == workload["prompts"] * workload["group_size"] * T
    expected = 4 * (lora["matmul_params_blocks"] * lora["tokens_per_step"]
                    + lora["matmul_params_head"] * lora["tokens_per_step"] * workload["gen_length"] / T)
    assert math.isclose(lora["model_flops_per_step"], expected)
    d, h = shape["d_model"], shape["mlp_hidden_size"]
    per_block = 4 * d * d + 3 * d * h  # q, k, v, attn_out; ff_proj, up_proj, ff_out (the adapters not counted)
    assert lora["matmul_params_blocks"] == shape["n_layers"] * per_block
    assert lora["matmul_params_head"] == shape["vocab_size"] * d

    full = report["full"]
    small, large = (full["depths"][str(d)] for d in workload["full_depths"])
    for depth in (small, large):
        assert depth["master_dtype"] == "float32" and depth["compute_dtype"] == "bfloat16"
        assert depth["weights_moved"] and 0.5 * depth["lr"] < depth["master_update_max_abs"] < 2 * depth["lr"]
        assert depth["mfu"] > 0 and depth["loss_finite"]
        assert depth["matmul_params_blocks"] == depth["layers"] * per_block  # counted through FSDP2's DTensors
    assert large["params_b"] > small["params_b"]
    assert math.isclose(full["per_layer"]["params_b"], (large["params_b"] - small["params_b"])
                        / (large["layers"] - small["layers"]))
    assert f"{shape['n_layers']}_layers" in full["projected"]

    if merged()["offload"]:
        offload = report["offload"]
        assert offload["layers"] == workload["full_depths"][1] and offload["master_dtype"] == "float32"
        assert offload["weights_moved"] and offload["loss_finite"]
        # the trainer's clip on the host-memory gradients, every step (warm-up and timed)
        assert offload["max_grad_norm"] == workload["max_grad_norm"] and offload["grad_norms_finite"]
        assert len(offload["grad_norms"]) == 1 + workload["repeats"] and min(offload["grad_norms"]) > 0
    if merged()["memory"]:
        for name in ("lora", "offload"):
            assert report["memory"][name]["estimate_step_gb"] > 0

    md = (tmp_path / "report.md").read_text()
    for line in ("## Rollout [ok]", "## Memory model [", "| none |", "| dual |", "| LoRA r", "| full, fp32 master |", "| full, per layer |"):
        assert line in md


def test_a_failing_section_is_reported_and_the_others_still_run(tmp_path, monkeypatch):
    check = load_check()

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(check, "lora_section", broken)
    report = check.main(["--tiny", "--out", str(tmp_path), "--only", "lora", "full"])
    assert report["lora"]["status"].startswith("error: RuntimeError: CUDA out of memory")
    assert report["full"]["status"] == "ok" and report["finished"]
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["lora"]["status"] == report["lora"]["status"] and "traceback" in on_disk["lora"]
    assert "## Not measured" in (tmp_path / "report.md").read_text()


def test_sections_past_the_time_budget_are_skipped_not_lost(tmp_path):
    report = load_check().main(["--tiny", "--out", str(tmp_path), "--budget-s", "0"])
    assert {name: report[name]["status"] for name in SECTIONS} == {name: "skipped: time budget" for name in SECTIONS}
    assert json.loads((tmp_path / "report.json").read_text())["finished"]
