"""Every shipped config loads and validates (unknown keys, types, registry names, sampler rules)."""

from pathlib import Path

import pytest

from ddrl.config import PretrainConfig, RLConfig, load_config
from ddrl.registry import ESTIMATORS, OBJECTIVES

ROOT = Path(__file__).resolve().parents[2]
PRETRAIN = sorted((ROOT / "configs/pretrain").glob("*.yaml"))
RL = sorted((ROOT / "configs/rl").glob("*.yaml")) + sorted((ROOT / "configs/paper").glob("*.yaml"))


def test_there_are_configs():
    assert len(PRETRAIN) >= 5 and len(RL) >= 30


@pytest.mark.parametrize("path", PRETRAIN, ids=lambda p: p.name)
def test_pretrain_config_loads(path):
    cfg = load_config(path, cls=PretrainConfig)
    assert cfg.train.steps > 0


@pytest.mark.parametrize("path", RL, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_rl_config_loads_and_builds_its_method(path):
    from ddrl.training.trainer import build_method

    cfg = load_config(path, cls=RLConfig)
    method = build_method(cfg)
    assert type(method.objective) is OBJECTIVES.get(cfg.method.objective)
    assert type(method.estimator) in dict(ESTIMATORS.items()).values()


def test_every_objective_has_a_tiny_cpu_config():
    names = {load_config(p, cls=RLConfig).method.objective for p in (ROOT / "configs/rl").glob("*_mini_sudoku.yaml")}
    missing = set(OBJECTIVES.names()) - names - {"diffu_grpo", "udm_grpo"}  # diffu_grpo = grpo; udm_grpo runs on digits
    assert not missing, f"no configs/rl/<method>_mini_sudoku.yaml for {sorted(missing)}"
