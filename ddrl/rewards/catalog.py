"""The image rewards known by name: text_to_image's `task.args.reward` and `ddrl serve-reward --reward`.

Each name maps to a factory `fn(**args) -> reward` (args from reward_args / --arg KEY=VALUE); modules
load when a reward is built, so naming one never imports torch models, open_clip or hpsv3.

    pickscore      PickScore_v1, local dir: {model}                    (rewards/model_based.py)
    clip_score     CLIP score, local dir: {model}                      (rewards/model_based.py)
    hpsv2          HPSv2, local checkpoint: {checkpoint[, arch]}       (rewards/hps.py; pip install 'ddrl[hps]')
    hpsv3          HPSv3 / 5, local checkpoint: {checkpoint[, config]} (rewards/hpsv3.py; pip install hpsv3)
    unifiedreward  UnifiedReward Final Score / 5: {url[, api_key, model]} (rewards/unified_reward.py)
    server         a ddrl reward server: {url}                         (rewards/server.py)
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

IMAGE_REWARDS: dict[str, tuple[str, str]] = {
    "pickscore": ("ddrl.rewards.model_based", "pickscore_reward"),
    "clip_score": ("ddrl.rewards.model_based", "clip_score_reward"),
    "hpsv2": ("ddrl.rewards.hps", "hpsv2_reward"),
    "hpsv3": ("ddrl.rewards.hpsv3", "hpsv3_reward"),
    "unifiedreward": ("ddrl.rewards.unified_reward", "unifiedreward_reward"),
    "server": ("ddrl.rewards.server", "RewardServerClient"),
}


def image_reward_factory(name: str) -> Callable[..., Any]:
    """The factory of a named image reward; ValueError naming the known ones otherwise."""
    if name not in IMAGE_REWARDS:
        raise ValueError(f"image reward {name!r} is not known; choose one of: {', '.join(IMAGE_REWARDS)}")
    module, attr = IMAGE_REWARDS[name]
    return getattr(importlib.import_module(module), attr)
