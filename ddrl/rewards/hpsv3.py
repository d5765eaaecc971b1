"""HPSv3 (Ma et al. 2025): a Qwen2-VL preference model, run beside training as a reward server.

The `hpsv3` package's `HPSv3RewardInferencer(config_path, checkpoint_path, device)` scores with
`.reward(image_paths, prompts)`, which returns one row per image, (mu, sigma) of the predicted
preference; the score is mu (`rewards[i][0]`, as MaskGRPO's grpo/reward_func.py `hpsv3` reads it
@ b74ba3c). MaskGRPO serves it on its own machine and divides by 5 (`hpsv3_remote`: "scale to
~[0, 2]"), which `scale` (default 5) reproduces; scale=1 gives mu itself.

    ddrl serve-reward --reward hpsv3 --arg checkpoint=/models/HPSv3/model.pth --port 18087
    task.args.reward: [{name: server, args: {url: http://127.0.0.1:18087}, label: hpsv3}, ...]

The images travel as lossless PNG (ddrl's reward-server protocol, rewards/server.py) where MaskGRPO
sends JPEGs, and are written to temporary PNG files for the inferencer, as MaskGRPO's local `hpsv3`
does. The checkpoint must be a local file: the inferencer would otherwise download one. (Its config
names the Qwen2-VL base model; point it at a local copy with config=, or keep the hub cache warm.)
Install the package in the server's environment: pip install hpsv3.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from ddrl.rewards.composite import row_texts


class HPSv3Reward:
    """reward(completions, images=[n, 3, H, W], caption=...) -> mu / scale per image, from HPSv3.

    checkpoint: the local HPSv3 weights; config: the inferencer's YAML (default: the package's own)
    inferencer: a built object with .reward(image_paths, prompts) (tests, an inferencer made elsewhere)
    """

    def __init__(self, checkpoint: str | Path | None = None, *, config: str | Path | None = None,
                 device: str | None = None, scale: float = 5.0, text_column: str = "caption",
                 batch_size: int = 16, inferencer: Any = None):
        if not scale > 0:
            raise ValueError(f"scale must be > 0 (MaskGRPO divides mu by 5), got {scale}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if inferencer is None:
            if checkpoint is None or not Path(checkpoint).is_file():
                raise FileNotFoundError(f"HPSv3 checkpoint {checkpoint} does not exist; nothing is downloaded: pass "
                                        f"checkpoint=<a local copy of the HPSv3 weights>")
            if config is not None and not Path(config).is_file():
                raise FileNotFoundError(f"HPSv3 config {config} does not exist")
            try:
                from hpsv3 import HPSv3RewardInferencer
            except ImportError as e:
                raise ImportError(f"the hpsv3 reward needs the hpsv3 package ({e}): pip install hpsv3 in the reward "
                                  f"server's environment") from None
            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            inferencer = HPSv3RewardInferencer(config_path=None if config is None else str(config),
                                               checkpoint_path=str(checkpoint), device=device)
        if not callable(getattr(inferencer, "reward", None)):
            raise TypeError(f"inferencer {inferencer!r} has no .reward(image_paths, prompts)")
        self.inferencer, self.scale, self.text_column, self.batch_size = inferencer, float(scale), text_column, batch_size
        self.__name__ = "hpsv3"

    def __call__(self, completions: list[str], *, images: torch.Tensor | None = None,
                 **columns: Any) -> list[float | None]:
        from ddrl.rewards.pixels import to_pil

        if images is None:
            return [None] * len(completions)  # a text task: not applicable
        prompts = row_texts(columns, self.text_column, len(completions), "hpsv3")
        out: list[float | None] = []
        with tempfile.TemporaryDirectory(prefix="ddrl-hpsv3-") as tmp:
            paths = []
            for i, picture in enumerate(to_pil(images)):
                paths.append(str(Path(tmp) / f"{i}.png"))
                picture.save(paths[-1])
            for lo in range(0, len(paths), self.batch_size):
                hi = min(lo + self.batch_size, len(paths))
                with torch.no_grad():
                    rows = self.inferencer.reward(paths[lo:hi], [str(p) for p in prompts[lo:hi]])
                if len(rows) != hi - lo:
                    raise RuntimeError(f"HPSv3 returned {len(rows)} rows for {hi - lo} images")
                out.extend(float(row[0]) / self.scale for row in rows)  # row = (mu, sigma): the score is mu
        return out


def hpsv3_reward(checkpoint: str | Path | None = None, **kwargs: Any) -> HPSv3Reward:
    """HPSv3 mu / scale from a local checkpoint (reward name `hpsv3`; serve it: ddrl serve-reward --reward hpsv3)."""
    return HPSv3Reward(checkpoint, **kwargs)
