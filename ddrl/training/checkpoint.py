"""Checkpoints in the Hugging Face layout plus trainer state, written atomically.

    run/checkpoint-20/ config.json  model.safetensors  tokenizer.json  trainer_state.pt  COMPLETE

Everything is written into a hidden temp directory first and renamed into place at the end, so a
run killed mid-write leaves either the previous checkpoint or a `.checkpoint-N.tmp-*` directory
that is never loaded. The COMPLETE marker is written last, inside the temp directory.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

_NAME = re.compile(r"^checkpoint-(\d+)$")
COMPLETE = "COMPLETE"


def save_checkpoint(run_dir: Path, step: int, model: Any, trainer_state: dict[str, Any], keep: int = 2) -> Path:
    run_dir = Path(run_dir)
    final = run_dir / f"checkpoint-{step}"
    tmp = Path(tempfile.mkdtemp(prefix=f".checkpoint-{step}.tmp-", dir=run_dir))
    try:
        model_dir = tmp / "m"
        model.save_pretrained(model_dir)  # itself atomic into model_dir
        for item in model_dir.iterdir():
            os.replace(item, tmp / item.name)
        model_dir.rmdir()
        torch.save(trainer_state, tmp / "trainer_state.pt")
        (tmp / COMPLETE).write_text(str(step))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _prune(run_dir, keep)
    return final


def _prune(run_dir: Path, keep: int) -> None:
    if keep <= 0:
        return
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = []
    for p in run_dir.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir() and (p / COMPLETE).exists():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    checkpoint = Path(checkpoint)
    if not (checkpoint / COMPLETE).exists():
        raise ValueError(
            f"checkpoint {str(checkpoint)!r} is incomplete (no {COMPLETE} marker): it was interrupted "
            f"while being written; resume from an earlier checkpoint"
        )
    return torch.load(checkpoint / "trainer_state.pt", map_location="cpu", weights_only=False)
