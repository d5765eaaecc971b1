"""Run logging: metrics.jsonl (one JSON object per step), TensorBoard, optional wandb, a reward curve."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch


def _plain(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        v = v.detach().float().item() if v.numel() == 1 else v.detach().float().mean().item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MetricsLogger:
    def __init__(self, run_dir: Path, *, tensorboard: bool = True, wandb: bool = False,
                 config: dict[str, Any] | None = None, enabled: bool = True, resume: bool = False):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.path = self.run_dir / "metrics.jsonl"
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        if not resume and self.path.exists():
            self.path.unlink()
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
            except Exception:  # TensorBoard is optional; metrics.jsonl is the source of truth
                self._tb = None
        if wandb:
            try:
                import wandb as wb
            except ImportError:
                raise ValueError("train.wandb=true but wandb is not installed; pip install wandb or set train.wandb=false") from None
            self._wandb = wb.init(project="ddrl", dir=str(self.run_dir), config=config or {})

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        if not self.enabled:
            return row
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(row, step=step)
        return row

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_reward_curve(metrics_path: Path, out_png: Path, title: str = "reward") -> Path | None:
    """reward/mean per step (and eval/accuracy where measured) as a PNG."""
    rows = read_metrics(metrics_path)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    pts = [(r["step"], r["reward/mean"]) for r in rows if r.get("reward/mean") is not None]
    if pts:
        ax.plot(*zip(*pts), label="reward/mean (rollouts)", alpha=0.8)
    ev = [(0, r["eval_before/accuracy"]) for r in rows[:1] if r.get("eval_before/accuracy") is not None]
    ev += [(r["step"], r["eval/accuracy"]) for r in rows if r.get("eval/accuracy") is not None]
    if ev:
        ax.plot(*zip(*ev), "o-", label="eval/accuracy (held-out, greedy)")
    ax.set_xlabel("RL step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return Path(out_png)
