"""Model directories on disk: atomic writes and the checks made before reading one.

A run that is killed while saving must never leave a directory that looks complete. So a save
writes into a temporary sibling directory (same filesystem, so the final rename is atomic) that
holds a marker file until everything is written; only then is the marker removed and the
directory renamed into place. A reader refuses any directory that still holds the marker.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterator

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INCOMPLETE_MARKER = ".ddrl-incomplete"  # present only while a directory is being written
# Weight files a Hugging Face directory may hold instead of a single model.safetensors.
HF_WEIGHT_FILES = (WEIGHTS_FILE, "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


class ModelDirectoryError(ValueError, FileNotFoundError):
    """A model directory that cannot be loaded. Both a ValueError (bad argument) and a
    FileNotFoundError, so callers catching either kind see it."""


@contextlib.contextmanager
def atomic_directory(target: str | Path) -> Iterator[Path]:
    """Yield a temporary directory to write into; on success it replaces `target` in one rename.

        with atomic_directory("runs/x/checkpoint-10") as tmp:
            model.save(tmp); (tmp / "trainer_state.json").write_text(...)

    On an exception the temporary directory is removed and `target` is left as it was.
    """
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise ValueError(f"cannot save to {str(target)!r}: it exists and is not a directory; choose another path")
    target.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    tmp = target.parent / f".{target.name}.tmp-{tag}"
    tmp.mkdir()
    (tmp / INCOMPLETE_MARKER).write_text("this directory is being written; do not load it\n")
    try:
        yield tmp
        (tmp / INCOMPLETE_MARKER).unlink()
        if target.exists():
            # Move the old directory aside rather than deleting it first, so that the window in
            # which no complete directory exists at `target` is one rename long.
            old = target.parent / f".{target.name}.old-{tag}"
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_model_dir(path: str | Path, weights: tuple[str, ...] = (WEIGHTS_FILE,)) -> Path:
    """Fail early, with the fix, on a directory that is missing, half-written or incomplete."""
    p = Path(path)
    if not p.exists():
        raise ModelDirectoryError(
            f"model directory {str(p)!r} does not exist; pass a directory written by save_pretrained "
            f"(or download a Hugging Face model to a local directory first)"
        )
    if not p.is_dir():
        raise ModelDirectoryError(
            f"model path {str(p)!r} is a file, not a model directory; pass the directory that holds config.json"
        )
    if (p / INCOMPLETE_MARKER).exists():
        raise ModelDirectoryError(
            f"model directory {str(p)!r} is half-written (it still holds {INCOMPLETE_MARKER}: a save was interrupted); "
            f"use another checkpoint"
        )
    if not (p / CONFIG_FILE).is_file():
        raise ModelDirectoryError(
            f"model directory {str(p)!r} is incomplete: it has no {CONFIG_FILE}; use another checkpoint"
        )
    if not any((p / w).is_file() for w in weights):
        raise ModelDirectoryError(
            f"model directory {str(p)!r} is incomplete: it has no weights ({' or '.join(weights)}); use another checkpoint"
        )
    return p


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelDirectoryError(
            f"{str(path)!r} is not valid JSON ({e}); the checkpoint is damaged, use another one"
        ) from None
    if not isinstance(data, dict):
        raise ModelDirectoryError(f"{str(path)!r} must hold a JSON object; the checkpoint is damaged, use another one")
    return data


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
