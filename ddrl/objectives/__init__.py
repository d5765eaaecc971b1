"""Objectives (losses), advantages, KL estimators and loss aggregation.

Importing this package registers every built-in objective in ddrl.registry.OBJECTIVES:

    grpo / diffu_grpo, unigrpo, coupled_grpo, tracerl, maskgrpo, daca_grpo   token-level PPO (ppo.TokenPPO)
    wd1, spg                                                                 ratio-free sequence objectives
    stable_drl, espo, fpo, dipod, gdsd, gdsd_tlc, sepo                       sequence-level ratio objectives
    udm_grpo                                                                 on-policy, uniform diffusion

`ddrl methods` prints describe_methods().
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ddrl.objectives import (  # noqa: F401  (imported for registration)
    coupled_grpo,
    daca,
    dipod,
    espo,
    fpo,
    gdsd,
    grpo,
    maskgrpo,
    sepo,
    spg,
    stable_drl,
    tracerl,
    udm_grpo,
    unigrpo,
    wd1,
)
from ddrl.objectives.advantages import compute_advantages
from ddrl.objectives.aggregation import (
    AggregationCounts,
    group_mean,
    length_weighted_mean,
    sequence_mean,
    sequence_token_mean,
    sequence_token_sum,
    token_mean,
)
from ddrl.objectives.base import Objective, inject_ratio_noise
from ddrl.objectives.kl import kl
from ddrl.registry import OBJECTIVES

__all__ = [
    "AggregationCounts",
    "Objective",
    "compute_advantages",
    "describe_methods",
    "group_mean",
    "inject_ratio_noise",
    "kl",
    "length_weighted_mean",
    "sequence_mean",
    "sequence_token_mean",
    "sequence_token_sum",
    "token_mean",
]


def describe_methods() -> list[dict[str, Any]]:
    """One dict per registered objective: name, paper, released source, formula, estimator, advantage,
    fields (defaults)."""
    rows = []
    for name, cls in OBJECTIVES.items():
        rows.append({
            "name": name,
            "paper": cls.paper,
            "source": cls.source,
            "formula": cls.formula,
            "estimator": cls.default_estimator,
            "estimator_args": dict(cls.default_estimator_args),
            "advantage": cls.default_advantage,
            "advantage_std": cls.default_advantage_std,
            "advantage_clip": cls.default_advantage_clip,
            "fields": {f.name: f.default for f in dataclasses.fields(cls)},
        })
    return rows
