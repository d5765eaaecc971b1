"""Reward functions: `reward(completions: list[str], **columns) -> list[float | None]`.

Columns are lists aligned with the completions (None = not applicable). Every reward here never
raises and returns in bounded time on any completion (docs/architecture.md#reward).

    math_correctness_reward   math-verify equivalence with the gold `answer` (rewards/math.py)
    soft_format_reward        d1's <reasoning>..</reasoning><answer>..</answer> shape (rewards/format.py)
    strict_format_reward      d1's strict, line-by-line format
    boxed_reward              a \\boxed{} answer is present
    digits_classifier_reward  a held-out classifier's p(`label` | image) (rewards/image.py)
    CompositeReward           weighted sum; .score() -> RewardResult(scores, parts) (rewards/composite.py)
    ModelReward, HFSequenceClassifierReward, ClipStyleImageReward   neural rewards (rewards/model_based.py)
    pickscore, clip_score, hpsv2, hpsv3, unifiedreward   text-to-image rewards by name (rewards/catalog.py)

The code sandbox and code-test rewards live in rewards/sandbox.py and rewards/code.py. Heavy
dependencies (math-verify, scikit-learn, torch) load when a reward first runs.
"""

from __future__ import annotations

import importlib
from typing import Any

from ddrl.rewards.composite import CompositeReward, RewardResult, d1_math_reward, per_completion, score_parts
from ddrl.rewards.format import (boxed_reward, extract_answer, extract_boxed, soft_format_reward,
                                 strict_format_reward)
from ddrl.rewards.math import gold_answer, math_correct, math_correctness_reward

_LAZY = {
    "digits_classifier_reward": "ddrl.rewards.image",
    "digits_classifier_accuracy": "ddrl.rewards.image",
    "prompt_following": "ddrl.rewards.image",
    "ModelReward": "ddrl.rewards.model_based",
    "HFSequenceClassifierReward": "ddrl.rewards.model_based",
    "ClipStyleImageReward": "ddrl.rewards.model_based",
    "CLIPImageReward": "ddrl.rewards.model_based",
    "pickscore_reward": "ddrl.rewards.model_based",
    "clip_score_reward": "ddrl.rewards.model_based",
    "to_pil": "ddrl.rewards.pixels",
    "save_image_grid": "ddrl.rewards.pixels",
    "HPSv2Reward": "ddrl.rewards.hps",
    "hpsv2_reward": "ddrl.rewards.hps",
    "HPSv3Reward": "ddrl.rewards.hpsv3",
    "hpsv3_reward": "ddrl.rewards.hpsv3",
    "UnifiedReward": "ddrl.rewards.unified_reward",
    "unifiedreward_reward": "ddrl.rewards.unified_reward",
    "RewardServerClient": "ddrl.rewards.server",
    "serve_reward": "ddrl.rewards.server",
}


def __getattr__(name: str) -> Any:  # numpy/torch load only when an image or model reward is used
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ddrl.rewards' has no attribute {name!r}")


__all__ = ["CompositeReward", "RewardResult", "score_parts", "d1_math_reward", "per_completion", "boxed_reward",
           "extract_answer", "extract_boxed", "soft_format_reward", "strict_format_reward", "gold_answer",
           "math_correct", "math_correctness_reward", *_LAZY]
