"""The image rewards known by name: text_to_image's `task.args.reward` and `ddrl serve-reward --reward`.

Each name maps to a factory `fn(**args) -> reward` (args from reward_args / --arg KEY=VALUE); modules
load when a reward is built, so naming one never imports torch models, open_clip or hpsv3.
`build_image_reward` is the one resolver both use: a name below, or a user's own "module:function"
(ddrl.registry.import_object), which is the reward itself, or, when args are given, a factory
`function(**args)` that returns it.

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

from ddrl.registry import import_object

RewardFn = Callable[..., list[float | None]]

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


def build_image_reward(spec: str, args: dict[str, Any] | None = None, *, what: str = "image reward") -> RewardFn:
    """The reward `spec` names: a catalog name, built as factory(**args), or "module:function", the function
    itself without args and function(**args) with them (a factory). Errors name the spec and the fix;
    what: how the caller names the setting ("text_to_image reward", "--reward")."""
    args = dict(args or {})
    if not isinstance(spec, str) or (spec not in IMAGE_REWARDS and ":" not in spec):
        raise ValueError(f"{what} {spec!r} is not known; choose one of: {', '.join(IMAGE_REWARDS)}, or name your "
                         f"own function as module:function")
    if spec in IMAGE_REWARDS:
        factory: Any = image_reward_factory(spec)
    else:
        factory = import_object(spec, f"{what} {spec!r}")
        if not callable(factory):
            raise ValueError(f"{what} {spec!r} is of type {type(factory).__name__}, not a function; point it at a "
                             f"reward(completions, images=..., **columns) or a factory that returns one")
        if not args:
            return factory
    try:
        reward = factory(**args)
    except TypeError as e:
        how = "" if spec in IMAGE_REWARDS else ("; with arguments, module:function is a factory that returns the "
                                                 "reward, without them the function is the reward")
        raise ValueError(f"{what} {spec!r}: bad arguments {args}: {e}{how}; give them as reward_args in a config, "
                         f"--arg KEY=VALUE to ddrl serve-reward") from None
    if not callable(reward):
        raise ValueError(f"{what} {spec!r} called with {args} returned an object of type {type(reward).__name__}, "
                         f"not a reward function; without arguments the function itself is the reward")
    return reward
