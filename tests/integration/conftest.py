"""Shared fixtures: a tiny pretrained 4x4 Sudoku model made by `ddrl pretrain` itself (seconds)."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

TINY_MODEL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "data.n_train=256",
              "data.n_heldout=16", "train.batch_size=32", "train.eval_every=1000", "train.progress=false"]


@pytest.fixture(scope="session")
def tiny_sudoku_model(tmp_path_factory) -> Path:
    from ddrl.training.pretrain import pretrain

    out = tmp_path_factory.mktemp("pretrain-sudoku")
    return pretrain(ROOT / "configs/pretrain/mini_sudoku_masked.yaml",
                    ["train.steps=30", f"output_dir={out}", *TINY_MODEL])


def rl_overrides(model_dir: Path, out: Path, steps: int = 2) -> list[str]:
    return [f"model.path={model_dir}", "task.name=tests.integration.dense_task:make", f"train.steps={steps}", "train.prompts_per_step=2", "train.group_size=4",
            "eval.n=4", "eval.every=0", "train.progress=false", "train.tensorboard=false", f"output_dir={out}"]
