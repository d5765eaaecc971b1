"""bench/gpu/check.py --rehearsal: a GPU's measured update step beside the rehearsal's prediction."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_check():
    spec = importlib.util.spec_from_file_location("gpu_check_rehearsal", ROOT / "bench" / "gpu" / "check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_measured_and_predicted_side_by_side_with_their_ratios():
    check = load_check()
    rehearsal = {"config": "configs/paper/diffu_grpo_llada8b.yaml", "world_size": 1, "layers": 32,
                 "peak_bytes": 40e9, "rollout_peak_bytes": 30e9, "update_s": 2.0}
    c = check.compare_with_rehearsal({"peak_gb": 44.0, "step_s": 5.0}, rehearsal)
    assert c["predicted_peak_gb"] == pytest.approx(40.0) and c["measured_peak_gb"] == 44.0
    assert c["peak_measured_over_predicted"] == pytest.approx(1.1)
    assert c["time_measured_over_predicted"] == pytest.approx(2.5)
    text = "\n".join(check.comparison_lines(c))
    assert "measured 44 GB" in text and "rehearsal 40 GB" in text and "1.1" in text and "2.5" in text
    unmeasured = check.compare_with_rehearsal({}, rehearsal)  # the lora section stopped before its numbers
    assert unmeasured["peak_measured_over_predicted"] is None and "n/a" in "\n".join(check.comparison_lines(unmeasured))


def test_the_rehearsal_is_of_the_lora_sections_own_step():
    """The overrides rehearse the step the lora section measures: its rows, lengths, LoRA and one process."""
    check = load_check()
    wl = check.GPU_WORKLOAD
    overrides = check.rehearsal_overrides(wl)
    assert f"train.prompts_per_step={wl.prompts}" in overrides and f"model.lora.rank={wl.lora_rank}" in overrides
    assert "dist.strategy=none" in overrides
    from ddrl.config import RLConfig, load_config

    cfg = load_config(ROOT / "configs/paper/diffu_grpo_llada8b.yaml", overrides, RLConfig)  # every key exists
    assert cfg.train.group_size == wl.group_size and cfg.rollout.gen_length == wl.gen_length
