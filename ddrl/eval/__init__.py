"""Evaluation: the same code path for `ddrl eval`, the trainer's periodic eval and the demo."""

from ddrl.eval.runner import default_sampler, evaluate

__all__ = ["evaluate", "default_sampler"]
