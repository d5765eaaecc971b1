"""ddrl: reinforcement-learning fine-tuning of discrete diffusion models.

    import ddrl
    model = ddrl.load_model("checkpoints/mini_sudoku-masked")
    task = ddrl.get_task("mini_sudoku")
    print(ddrl.evaluate(model, task, n=100))
    run_dir = ddrl.train("configs/rl/stable_drl_mini_sudoku.yaml", overrides=["train.steps=20"])
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# Heavy layers are imported on first use so that `import ddrl` and `ddrl --help` stay fast.
_LAZY = {
    "load_model": ("ddrl.models", "load_model"),
    "generate": ("ddrl.sampling.masked", "generate"),
    "get_task": ("ddrl.tasks", "get_task"),
    "train": ("ddrl.training.trainer", "train"),
    "pretrain": ("ddrl.training.pretrain", "pretrain"),
    "evaluate": ("ddrl.eval.runner", "evaluate"),
    "load_config": ("ddrl.config", "load_config"),
    "RLConfig": ("ddrl.config", "RLConfig"),
    "PretrainConfig": ("ddrl.config", "PretrainConfig"),
    "Task": ("ddrl.tasks.base", "Task"),
}

_SUBMODULES = {"data", "config", "registry", "types", "models", "sampling", "estimators", "objectives",
               "rewards", "tasks", "training", "eval", "processes"}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"ddrl.{name}")
    raise AttributeError(f"module 'ddrl' has no attribute {name!r}")
