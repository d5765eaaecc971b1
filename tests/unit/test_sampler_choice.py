"""rollout.name=auto picks the family's own sampler, and a sampler the model cannot run is refused with
the right name (ddrl.sampling.checks.resolve_sampler), in the words of the caller: rollout.* for
configs, --flags for `ddrl eval` / `ddrl sample`."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

import ddrl
from ddrl.config import RLConfig, SamplerConfig, load_config
from ddrl.models.families import FAMILIES
from ddrl.sampling.checks import FLAGS, check_sampler, resolve_sampler

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture(scope="module")
def sdar():
    return ddrl.load_model(FIXTURES / "sdar" / "model")


@pytest.fixture(scope="module")
def dream():
    return ddrl.load_model(FIXTURES / "dream" / "model")


@pytest.fixture(scope="module")
def llada():
    return ddrl.load_model(FIXTURES / "llada" / "model")


def test_auto_is_the_default_and_picks_the_familys_sampler(sdar, dream, llada):
    assert load_config({}, cls=RLConfig).rollout.name == "auto"
    assert resolve_sampler(sdar, "auto") == "block"  # SDAR decodes its own blocks of 4
    assert resolve_sampler(llada, "auto") == "masked"
    assert resolve_sampler(dream, "auto") == "masked"
    gemma = SimpleNamespace(family="diffusion_gemma", process_spec={"name": "uniform"}, block_size=None,
                            samplers=FAMILIES["diffusion_gemma"].samplers)  # a stand-in states its samplers
    assert resolve_sampler(gemma, "auto") == "diffusion_gemma"
    uniform = SimpleNamespace(family="ddrl", process_spec={"name": "uniform"}, block_size=None)
    assert resolve_sampler(uniform, "auto") == "uniform"
    ursa = ddrl.load_model(FIXTURES / "ursa" / "model")
    assert resolve_sampler(ursa, "auto") == "metric_path"
    with pytest.raises(ValueError, match=r"rollout.name='masked' does not fit this ursa model.*'metric_path'"):
        resolve_sampler(ursa, "masked")


def test_a_sampler_that_contradicts_the_family_is_refused_with_the_right_name(sdar, dream, llada):
    with pytest.raises(ValueError, match=r"rollout.name='masked' does not fit this sdar model.*'block'"):
        resolve_sampler(sdar, "masked")  # LLaDA's semi-AR blocks on a block-4 model
    with pytest.raises(ValueError, match=r"rollout.name='dream' does not fit this llada model.*'masked'"):
        resolve_sampler(llada, "dream")  # the coupled-GRPO recipe's sampler on a LLaDA checkpoint
    gemma = SimpleNamespace(family="diffusion_gemma", process_spec={"name": "uniform"}, block_size=None,
                            samplers=FAMILIES["diffusion_gemma"].samplers)  # a stand-in states its samplers
    with pytest.raises(ValueError, match=r"'diffusion_gemma'"):
        resolve_sampler(gemma, "masked")
    with pytest.raises(ValueError, match=r"--sampler='masked' does not fit"):
        resolve_sampler(sdar, "masked", FLAGS)
    # what the family can run stays allowed
    assert resolve_sampler(dream, "dream") == "dream" and resolve_sampler(llada, "emerge") == "emerge"


def test_eval_settings_are_named_as_flags(sdar):
    """`ddrl eval --protocol d1` on SDAR: d1's 32-token blocks contradict the model's 4; the fix is a flag."""
    from ddrl.eval.protocols import get_protocol, protocol_sampler
    from ddrl.tasks import get_task

    task = get_task("countdown")
    with pytest.raises(ValueError, match=r"--block-length=32 differs from the model's block size 4.*"
                                         r"set --block-length=4") as err:
        protocol_sampler(sdar, task, get_protocol("d1"), 128, key=FLAGS)
    assert "rollout." not in str(err.value) and "sampler." not in str(err.value)
    with pytest.raises(ValueError, match=r"--threshold must be in \(0, 1\]"):
        check_sampler(SamplerConfig(threshold=1.5), FLAGS)
    cfg = protocol_sampler(sdar, task, get_protocol("d1"), 128, overrides={"block_length": 4}, key=FLAGS)
    assert cfg.name == "block" and cfg.block_length == 4


def _sdar_trainer_config(tmp_path, *extra: str) -> RLConfig:
    from tests.integration.conftest import ROOT

    return load_config(ROOT / "configs/rl/grpo_mini_sudoku.yaml",
                       [f"model.path={FIXTURES / 'sdar' / 'model'}", "task.name=tests.integration.text_task:make",
                        "task.args={}", "rollout.gen_length=8", "rollout.steps=8", "rollout.block_length=null",
                        f"output_dir={tmp_path}", "train.progress=false", "train.tensorboard=false", "eval.n=0",
                        "eval.before=false", *extra], RLConfig)


def test_the_trainer_resolves_auto_and_refuses_a_contradiction_before_any_compute(tmp_path):
    import yaml

    from ddrl.training.trainer import Trainer

    trainer = Trainer(_sdar_trainer_config(tmp_path / "auto", "rollout.name=auto"))
    assert trainer.cfg.rollout.name == "block"
    assert yaml.safe_load((tmp_path / "auto" / "config.yaml").read_text())["rollout"]["name"] == "block"
    with pytest.raises(ValueError, match=r"rollout.name='masked' does not fit this sdar model"):
        Trainer(_sdar_trainer_config(tmp_path / "masked", "rollout.name=masked", "rollout.block_length=8"))


def test_speed_settings_name_what_departs_from_the_reference():
    """The trainer's start-up line says "fast path" only for settings that change the tokens: an auto
    cache (exact, or none) on a cacheless sampler such as URSA's metric_path is the reference."""
    from ddrl.config import SamplerConfig
    from ddrl.sampling.checks import speed_settings

    assert speed_settings(SamplerConfig(name="metric_path")) == []
    assert speed_settings(SamplerConfig(cache="none")) == []
    assert speed_settings(SamplerConfig(cache="dual", threshold=0.9)) == ["cache=dual", "threshold=0.9"]
    assert speed_settings(SamplerConfig(factor=1.0)) == ["factor=1.0"]
