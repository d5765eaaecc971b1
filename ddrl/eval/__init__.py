"""Evaluation: the same code path for `ddrl eval`, the trainer's periodic eval and the demo;
paper protocols (`ddrl eval --protocol d1`) score a paper's test set as its tables do."""

from ddrl.eval.protocols import PROTOCOLS, evaluate_protocol
from ddrl.eval.runner import default_sampler, evaluate

__all__ = ["PROTOCOLS", "default_sampler", "evaluate", "evaluate_protocol"]
