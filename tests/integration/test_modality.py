"""A model and a task meet only where their modalities do (ddrl.data.check_modality), refused before any
compute in `ddrl train`, `ddrl eval`, `ddrl sample` and the Python API; an image FunctionTask said in its
constructor trains on the tiny URSA pipeline; a YAML text_to_image run names its own reward as
module:function, resolved as `ddrl serve-reward --reward` resolves it.

The found case: URSA's tiny pipeline (tests/fixtures/ursa/model) with a text FunctionTask
(tests/integration/text_task.py) and rollout.name=auto trained silently on completions [''] and images=None."""

from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ddrl
from ddrl.config import RLConfig, load_config
from ddrl.data import check_modality, model_modalities
from ddrl.models.native.ursa import URSABackbone
from ddrl.tasks.user import FunctionTask
from tests.integration import text_task
from tests.integration.conftest import ROOT

URSA = ROOT / "tests/fixtures/ursa/model"
CONFIG = ROOT / "configs/rl/udm_grpo_digits.yaml"
PROMPTS = ["a red cat", "is it", "blue tree on a hill", "sun"]
SEEN_IMAGES: list[torch.Tensor] = []  # what image_task's reward received, for the test to read


def brightness(completions, images=None, **_):
    SEEN_IMAGES.append(images)
    return images.mean(dim=(1, 2, 3)).tolist()


def image_task(**kwargs):
    """A user's image task, said in the constructor: the fixture's 4x4 latent grid (8x8 pixels)."""
    return FunctionTask("brightness", brightness, [{"prompt": p} for p in PROMPTS], [{"prompt": "green sea"}],
                        modality="image", image_grid=(4, 4), **kwargs)


def ursa_overrides(out: Path, *extra: str) -> list[str]:
    return [f"model.path={URSA}", "model.dtype=float32", "model.mixed_precision=none", "rollout.name=auto",
            "rollout.gen_length=16", "rollout.steps=4", "rollout.cfg_scale=0.0", "method.objective=udm_grpo",
            "method.estimator_args={}", "train.steps=1", "train.prompts_per_step=2", "train.group_size=2",
            "train.lr=1e-2", "eval.n=0", "eval.every=0", "eval.before=false", "train.progress=false",
            "train.tensorboard=false", "train.save_every=0", "dist.strategy=none", f"output_dir={out}", *extra]


@pytest.fixture
def no_forward(monkeypatch):
    """Any forward pass of URSA's transformer fails the test: the refusals come before any compute."""
    def forward(*args, **kwargs):
        raise AssertionError("a forward pass ran before the modality check")

    monkeypatch.setattr(URSABackbone, "forward", forward)


MISMATCH = r"modality mismatch: the ursa model generates image but task 'letter_a' scores text; score images"


def test_train_refuses_an_image_model_on_a_text_task_before_any_compute(no_forward, tmp_path):
    from ddrl.training.trainer import train

    overrides = ursa_overrides(tmp_path / "run", "task.name=tests.integration.text_task:make", "task.args={}")
    with pytest.raises(ValueError, match=MISMATCH) as refused:
        train(CONFIG, overrides)
    assert "FunctionTask(..., modality=\"image\", image_grid=(h, w))" in str(refused.value)  # the fix


def test_evaluate_refuses_an_image_model_on_a_text_task(no_forward):
    model = ddrl.load_model(URSA)
    with pytest.raises(ValueError, match=MISMATCH):
        ddrl.evaluate(model, text_task.make(), n=2)


@pytest.mark.parametrize("command", ["train", "eval"])  # `ddrl sample` of an image model writes a PNG grid
def test_the_command_line_refuses_an_image_model_for_text(command, no_forward, capsys, tmp_path):
    from ddrl.cli import main

    text = "tests.integration.text_task:make"
    argv = {"train": ["train", str(CONFIG), *ursa_overrides(tmp_path / "run", f"task.name={text}", "task.args={}")],
            "eval": ["eval", "--model", str(URSA), "--task", text, "--n", "2"]}
    code = main(argv[command])
    err = capsys.readouterr().err
    assert code == 2 and "modality mismatch: the ursa model generates image" in err and "scores text" in err, err


def test_a_text_model_refuses_an_image_task():
    model = ddrl.load_model(ROOT / "checkpoints/mini_sudoku-masked")
    assert model_modalities(model) == ("text",)
    with pytest.raises(ValueError, match=r"generates text but task 'brightness' scores image; load a model with "
                                         r"an image decoder \(URSA, or MMaDA with its VQ model: model.vq_path"):
        ddrl.evaluate(model, image_task(), n=2)


def test_an_image_grid_the_model_does_not_generate_is_refused():
    model = ddrl.load_model(URSA)
    assert model_modalities(model) == ("image",) and model.image_shape is None
    wide = FunctionTask("wide", brightness, [{"prompt": "sun"}], modality="image", image_grid=(2, 8))
    with pytest.raises(ValueError, match=r"2x8 image grid, but the ursa model lays its image codes on a square grid"):
        ddrl.evaluate(model, wide, n=1)
    check_modality(model, image_task())  # 4x4: square
    model.image_shape = (4, 4)
    with pytest.raises(ValueError, match=r"asks for a 2x8 image grid, but the ursa model generates 4x4 "
                                         r"\(model.image_shape\); set the task's image_grid to \[4, 4\]"):
        check_modality(model, wide)


def test_mmada_loaded_with_a_vq_decoder_is_an_image_model(monkeypatch, tmp_path):
    """MMaDA with vq_path samples image codes only (logits_range = image_token_range): a text task is refused.
    The decoder is a stand-in (loading MAGVIT-v2's 40M weights says nothing about the modality)."""
    from ddrl.models import mmada
    from tests.unit.test_mmada_t2i import write_tiny_mmada

    class Decoder:
        codebook_size = 64

    monkeypatch.setattr(mmada.MAGVITv2Decoder, "from_pretrained", staticmethod(lambda *a, **k: Decoder()))
    directory = write_tiny_mmada(tmp_path / "mmada")
    text = ddrl.load_model(directory, dtype="float32")
    assert model_modalities(text) == ("text",)  # its vocabulary holds image codes, but it has no decoder
    image = ddrl.load_model(directory, dtype="float32", vq_path=tmp_path)
    assert model_modalities(image) == ("image",)
    with pytest.raises(ValueError, match=r"the mmada model generates image but task 'letter_a' scores text"):
        check_modality(image, text_task.make())
    check_modality(image, FunctionTask("any", brightness, [{"prompt": "sun"}], modality="image", image_grid=(2, 8)))


def test_an_image_function_task_trains_a_step_on_ursa(tmp_path):
    """The working path: FunctionTask(..., modality="image", image_grid=(4, 4)) on the tiny URSA pipeline; the
    reward receives the decoded pixels, [n, 3, H, W] (the fixture's VQ decoder: 4x4 codes -> 8x8 pixels)."""
    from ddrl.training.trainer import train

    SEEN_IMAGES.clear()
    run = train(CONFIG, ursa_overrides(tmp_path / "run", "task.name=tests.integration.test_modality:image_task",
                                       "task.args={}"))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and math.isfinite(rows[0]["loss"])
    images = SEEN_IMAGES[0]
    assert images.shape == (4, 3, 8, 8) and images.dtype == torch.float32
    assert 0 < rows[0]["reward/mean"] < 1 and rows[0]["reward/invalid_frac"] == 0.0


REDNESS = """
    SEEN = []

    def redness(completions, images=None, caption=None, **_):
        SEEN.append((images.shape, list(caption)))
        return (images[:, 0] - images[:, 1:].mean(dim=1)).mean(dim=(1, 2)).add(1).tolist()

    def scaled(scale):
        return lambda completions, images=None, **_: (images.mean(dim=(1, 2, 3)) * scale).tolist()
"""


@pytest.fixture
def my_rewards(tmp_path, monkeypatch):
    """A user's reward module, importable as my_rewards_t2i (written in tmp_path, put on sys.path)."""
    (tmp_path / "my_rewards_t2i.py").write_text(textwrap.dedent(REDNESS))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("my_rewards_t2i", None)


def t2i_overrides(tmp_path: Path, reward: str) -> list[str]:
    train_file, test_file = tmp_path / "train.txt", tmp_path / "test.txt"
    train_file.write_text("\n".join(PROMPTS) + "\n")
    test_file.write_text("green sea\n")
    return ursa_overrides(tmp_path / "run", "task.name=text_to_image",
                          f"task.args={{image_grid: [4, 4], train_path: {train_file}, test_path: {test_file}, "
                          f"dev_fraction: 0.0, reward: {reward}}}")


def test_yaml_text_to_image_trains_with_a_module_function_reward(my_rewards, tmp_path):
    from ddrl.training.trainer import train

    run = train(CONFIG, t2i_overrides(tmp_path, "my_rewards_t2i:redness"))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and math.isfinite(rows[0]["loss"]) and rows[0]["reward/invalid_frac"] == 0
    shape, captions = sys.modules["my_rewards_t2i"].SEEN[0]
    assert tuple(shape) == (4, 3, 8, 8) and set(captions) <= set(PROMPTS)


def test_a_reward_list_part_names_a_module_function_or_a_factory(my_rewards, tmp_path):
    """Each part resolves as one reward does: a function as it is, with args a factory (serve-reward's --arg)."""
    from ddrl.training.trainer import train

    reward = json.dumps([{"name": "my_rewards_t2i:redness", "weight": 1.0},
                         {"name": "my_rewards_t2i:scaled", "weight": 0.5, "args": {"scale": 2.0}, "label": "bright"}])
    run = train(CONFIG, t2i_overrides(tmp_path, reward))
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert math.isfinite(row["loss"]) and any(k.startswith("reward/redness") for k in row), sorted(row)
    assert any(k.startswith("reward/bright") for k in row)
