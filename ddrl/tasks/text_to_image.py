"""Text-to-image: prompts from the peers' files, images scored by image rewards.

The completion is an image: image_grid = (h, w) codes of the model's image codebook, decoded by
the model's own decoder (ddrl.data.task_completions), so the reward receives
`images=[n, 3, H, W]` in [0, 1] beside the prompt and the row's other columns.

Files (the formats UDM-GRPO and MaskGRPO train and evaluate on; ddrl.tasks.paper_data reads them):
    .txt                 one prompt a line (PickScore's and OCR's train/test lists)
    .jsonl               GenEval's metadata: {"tag", "include": [{"class", "count", ...}], "prompt"};
                         every field but "prompt" reaches the reward as the `metadata` column,
                         the prompt's text as the `caption` column
    .json                a list of {"id", "prompt", ...} (the peers' evaluation prompts.json)
Splits as every file task (ddrl.tasks.paper_data): train_path + test_path, or path=FILE split=hash;
dev is held out of the train prompts, the test file stays sealed. GenEval's 553 evaluation prompts ship
with ddrl: test_path=ddrl:geneval/evaluation_metadata.jsonl (ddrl/tasks/data/geneval/README.md).

Rewards (task.args.reward), each a plain function of (completions, images=..., **columns):
    pickscore            PickScore_v1 from a local directory: reward_args {model: DIR}
    clip_score           CLIP score, likewise
    hpsv2                HPSv2 from a local checkpoint: reward_args {checkpoint: FILE}
    hpsv3                HPSv3 / 5 (better served: ddrl serve-reward --reward hpsv3): {checkpoint: FILE}
    unifiedreward        UnifiedReward's 1-5 score / 5 from a vLLM / sglang endpoint: {url: .../v1}
    server               a reward server (ddrl serve-reward, GenEval / OCR servers): reward_args {url: ...}
    module:function      a user's own reward(completions, images=..., **columns), imported as `ddrl
                         serve-reward --reward module:function` imports it; with reward_args, a factory
                         function(**reward_args) that returns the reward
(ddrl/rewards/catalog.py lists them; build_image_reward resolves a name.)
    [{name, weight, args}, ...]  their weighted sum, each part logged (reward/<label>, by default
                                 the name, a module:function's function); a name is any of the above
    a function           reward(completions, images=..., **columns), from Python
"""

from __future__ import annotations

from typing import Any, Callable

from ddrl.registry import TASKS
from ddrl.rewards.composite import RewardResult, score_parts
from ddrl.tasks.base import Task
from ddrl.tasks.paper_data import DEFAULT_DEV_FRACTION, DataSource, FileTask

RewardFn = Callable[..., list[float | None]]


def _build_reward(name: str, args: dict[str, Any]) -> RewardFn:
    from ddrl.rewards.catalog import build_image_reward  # the resolver `ddrl serve-reward --reward` uses

    return build_image_reward(name, args, what="text_to_image reward")


def image_reward(reward: str | list[dict[str, Any]] | RewardFn,
                 reward_args: dict[str, Any] | None = None) -> RewardFn:
    """One named reward (a catalog name or module:function), the weighted sum of a list of
    {name, weight, args} (each part logged), or a reward function as it is (the Python API)."""
    if callable(reward):
        return reward
    if isinstance(reward, str):
        return _build_reward(reward, dict(reward_args or {}))
    from ddrl.rewards.composite import CompositeReward

    parts = []
    for i, part in enumerate(reward):
        if not isinstance(part, dict) or "name" not in part:
            raise ValueError(f"text_to_image reward list entry {i} must be {{name, weight, args}}, got {part!r}")
        label = part.get("label", str(part["name"]).rpartition(":")[2])  # module:function logs as reward/function
        parts.append((label, _build_reward(part["name"], dict(part.get("args") or {})), float(part.get("weight", 1.0))))
    return CompositeReward(parts)


class TextToImageTask(FileTask):
    """Prompts -> images of image_grid codes, scored by an image reward (module docstring)."""

    name = "text_to_image"
    modality = "image"

    def __init__(self, *, image_grid: list[int] | tuple[int, int],
                 reward: str | list[dict[str, Any]] | RewardFn = "pickscore",
                 reward_args: dict[str, Any] | None = None, success_threshold: float = 1.0,
                 path: str | None = None, train_path: str | None = None, test_path: str | None = None,
                 split: str | None = None, test_fraction: float | None = None,
                 dev_fraction: float = DEFAULT_DEV_FRACTION, format: str = "compact"):
        grid = tuple(image_grid) if isinstance(image_grid, (list, tuple)) else ()
        if len(grid) != 2 or not all(isinstance(v, int) and v > 0 for v in grid):
            raise ValueError(f"task text_to_image: image_grid must be [h, w] image tokens (URSA at 512 px over a "
                             f"16x VQ: [32, 32]), got {image_grid!r}")
        self.image_grid = (int(grid[0]), int(grid[1]))
        self.gen_length = self.image_grid[0] * self.image_grid[1]
        self.success_threshold = float(success_threshold)
        self.format = format
        self._init_source(DataSource(self.name, path=path, train_path=train_path, test_path=test_path, split=split,
                                     test_fraction=test_fraction, dev_fraction=dev_fraction))
        self._reward = image_reward(reward, reward_args)  # a server that is down fails here, before any compute

    def _example(self, row: dict[str, Any], where: str) -> dict[str, Any]:
        prompt = row.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{where}: a text-to-image row needs a non-empty \"prompt\" (got keys "
                             f"{sorted(row)}); .txt files hold one prompt a line")
        metadata = {k: v for k, v in row.items() if k != "prompt"}
        # "prompt" is what the model is conditioned on (a family may lay it out); "caption" is the text
        # the image should show, the column image rewards read (rewards never see "prompt")
        return {"prompt": prompt, "caption": prompt, "metadata": metadata}

    def _split_key(self, example: dict[str, Any]) -> str:
        return example["prompt"]

    def reward(self, completions: list[str], **columns: Any) -> list[float | None]:
        return self._reward(completions, **columns)

    def score(self, completions: list[str], **columns: Any) -> RewardResult:
        return score_parts(self._reward, completions, **columns)


@TASKS.register("text_to_image")
def text_to_image_task(*, preset: str | None = None, **kwargs: Any) -> Task:
    """Text-to-image RL on prompt files (TextToImageTask); image_grid and the reward are required args.

    preset: none exists for images; `preset: null` lets a recipe based on a text recipe clear its
    preset (configs/paper/maskgrpo/t2i_mmada.yaml on ../maskgrpo_llada8b.yaml)."""
    if preset is not None:
        raise ValueError(f"task text_to_image has no presets (got preset={preset!r}); set task.args.preset=null")
    return TextToImageTask(**kwargs)
