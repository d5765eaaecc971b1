"""Run logging: metrics.jsonl (one JSON object per step), TensorBoard, optional wandb, a reward curve,
and train.log (what the run prints, warnings included, with a plain line per logged step instead of
the progress bar's frames)."""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any, TextIO

import torch


def _plain(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        v = v.detach().float().item() if v.numel() == 1 else v.detach().float().mean().item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


# Metric names are grouped by prefix, as TRL and cleanrl group theirs (loss/, clip_ratio/, reward/,
# completions/): docs/metrics.md. Objectives and loss terms name their statistics locally (stats["kl"]);
# this table is where a local name becomes the logged one, and one it does not list is objective/<name>.
STAT_NAMES: dict[str, str] = {
    "kl": "loss/kl",
    "elbo_reg": "loss/elbo_reg",
    "moe_aux_loss": "loss/moe_aux",
    "clip_frac": "clip_ratio/region_mean",  # TRL's name for the share of clipped ratios
    "ratio_mean": "ratio/mean",
    "ratio_max": "ratio/max",
    "log_ratio_mean": "ratio/log_mean",
    "train_rows": "update/rows",
}
# Names logged before the prefixes (ddrl 0.1), old -> new: metrics.jsonl keeps writing the old ones too
# for one release, so scripts and dashboards that read them keep working; TensorBoard and wandb get
# only the new names. Remove the aliases in ddrl 0.3.
RENAMED: dict[str, str] = {
    "loss": "loss/total",
    "completion/length": "completions/mean_length",
    "nonfinite_steps": "update/nonfinite_steps",
    **STAT_NAMES,
}


def stat_name(local: str) -> str:
    """The logged name of an objective's or loss term's statistic."""
    return STAT_NAMES.get(local, f"objective/{local}")


def _old_names(row: dict[str, Any]) -> dict[str, Any]:
    """The 0.1 aliases of a row's renamed metrics (RENAMED; objective/<name> was <name>)."""
    aliases = {old: row[new] for old, new in RENAMED.items() if new in row}
    aliases.update({k.removeprefix("objective/"): v for k, v in row.items() if k.startswith("objective/")})
    return aliases


def keep_rows_through(path: Path, step: int) -> None:
    """Drop the rows of a step-keyed JSONL log (metrics.jsonl, samples.jsonl) after `step`: a resumed
    run logs those steps again. step 0: a fresh start, the file goes."""
    path = Path(path)
    if not path.exists():
        return
    if step <= 0:
        path.unlink()
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if (row_step := _step_of(line)) is not None and row_step <= step]
    if len(kept) != len(lines):
        path.write_text("".join(kept))


def _step_of(line: str) -> int | None:
    """A row's step; None for a line cut short by a kill mid-write (dropped with the rows after it)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


class MetricsLogger:
    """metrics.jsonl and its mirrors. start_step: the step the run resumes from (0: a fresh start);
    rows after it, left by the interrupted run, are dropped, so every step is logged once."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = True, wandb: bool = False,
                 config: dict[str, Any] | None = None, enabled: bool = True, start_step: int = 0):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.path = self.run_dir / "metrics.jsonl"
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        for log_file in (self.path, self.run_dir / "samples.jsonl"):
            keep_rows_through(log_file, start_step)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # purge_step: TensorBoard hides the events the interrupted run wrote after start_step
                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None)
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
            f.write(json.dumps({**row, **_old_names(row)}) + "\n")
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
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    # a 0.1 run's rows name their metrics the old way: readers ask for the new names
    return [{**{new: row[old] for old, new in RENAMED.items() if old in row and new not in row}, **row} for row in rows]


def eval_settings(split: str, temperature: float) -> str:
    """How the evaluations sampled, for a legend: "dev split, greedy" or "dev split, T=1"."""
    return f"{split} split, {'greedy' if temperature == 0 else f'T={temperature:g}'}"


def _run_eval_settings(run_dir: Path) -> str | None:
    """eval_settings from the run's config.yaml, when there is one."""
    import yaml

    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return None
    e = (yaml.safe_load(path.read_text()) or {}).get("eval") or {}
    return eval_settings(e.get("split", "dev"), float(e.get("temperature", 0.0)))


def plot_reward_curve(metrics_path: Path, out_png: Path, title: str = "reward", eval_label: str | None = None) -> Path | None:
    """reward/mean per step (and eval/accuracy where measured) as a PNG. eval_label: how the evaluations
    sampled (eval_settings; by default read from the run's config.yaml)."""
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
        label = eval_label or _run_eval_settings(Path(metrics_path).parent)
        ax.plot(*zip(*ev), "o-", label=f"eval/accuracy ({label})" if label else "eval/accuracy")
    ax.set_xlabel("RL step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return Path(out_png)


# --------------------------------------------------------------------------------------------
# train.log
# --------------------------------------------------------------------------------------------


class _Tee:
    """A text stream that writes to `stream` and hands each write to `sink` (progress-bar frames,
    which redraw a line with \r, go to the stream only)."""

    def __init__(self, stream: TextIO, sink: Any):
        self._stream, self._sink = stream, sink

    def write(self, text: str) -> int:
        if "\r" not in text:
            self._sink(text)
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:  # flush, isatty, fileno, encoding ...
        return getattr(self._stream, name)


class _SinkHandler(logging.Handler):
    def __init__(self, sink: Any):
        super().__init__()
        self.sink = sink
        self.setFormatter(logging.Formatter("ddrl: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.sink(self.format(record) + "\n")


class RunLog:
    """The run's log file: while started, what is written to stdout and stderr and ddrl's log records
    also go to it (enabled: the main rank). Until `attach` names the file they are held in memory, so
    a start that fails writes nothing and leaves no file; `line` writes to the file only (the plain
    line of a logged step, while the console shows the progress bar)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._buffer: list[str] = []
        self._file: TextIO | None = None
        self._path: Path | None = None
        self._saved: tuple[Any, Any] | None = None
        self._handler: _SinkHandler | None = None

    def _write(self, text: str) -> None:
        if self._file is not None:
            self._file.write(text)
            self._file.flush()
        else:
            self._buffer.append(text)

    def start(self) -> None:
        if not self.enabled or self._saved is not None:
            return
        if self._path is not None:
            self._file = self._path.open("a")
        self._saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(sys.stdout, self._write), _Tee(sys.stderr, self._write)
        ddrl_log = logging.getLogger("ddrl")
        if ddrl_log.hasHandlers():  # otherwise Python's last-resort handler writes to sys.stderr: teed already
            self._handler = _SinkHandler(self._write)
            ddrl_log.addHandler(self._handler)

    def attach(self, path: Path) -> None:
        """From now on to `path` (appended to), the lines held so far first."""
        if not self.enabled:
            return
        self._path = Path(path)
        if self._saved is not None:
            self._file = self._path.open("a")
            self._file.write("".join(self._buffer))
            self._file.flush()
        self._buffer = []

    def line(self, text: str) -> None:
        if self.enabled and self._saved is not None:
            self._write(text + "\n")

    @property
    def console(self) -> TextIO:
        """The terminal's stderr, without the log: for the progress bar."""
        return self._saved[1] if self._saved is not None else sys.stderr

    def stop(self) -> None:
        if self._saved is None:
            return
        sys.stdout, sys.stderr = self._saved
        self._saved = None
        if self._handler is not None:
            logging.getLogger("ddrl").removeHandler(self._handler)
            self._handler = None
        if self._file is not None:
            self._file.close()
            self._file = None
        self._buffer = []

    def __enter__(self) -> "RunLog":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def step_line(step: int, steps: int, row: dict[str, Any]) -> str:
    """One plain line of a logged step for train.log: the progress bar's numbers and a few more."""
    keys = ("reward/mean", "reward/invalid_frac", "loss/total", "grad_norm", "eval/accuracy", "time/step")
    parts = [f"{k} {row[k]:.4g}" for k in keys if isinstance(row.get(k), (int, float))]
    return f"step {step}/{steps}: " + ", ".join(parts)
