"""The run directory (output_dir): a new run, a resumed one, or a refusal, decided before any compute.

    resume=false  a new run: refused when output_dir already holds one (a metrics.jsonl or a checkpoint),
                  naming the fixes, unless overwrite=true (that run's files are removed once the task
                  and the model have loaded, so a start that fails loses nothing)
    resume=true   continue from the newest complete checkpoint: an error naming the directory when there
                  is none (a misspelt output_dir must not start over from step 0)
    resume=auto   continue when there is a checkpoint, else start fresh (torchrun --max-restarts)

A start that fails (a bad task, a model that does not load) removes the directories it made while
they are still empty, so failed starts leave no empty run directories behind.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ddrl.training.checkpoint import list_checkpoints
from ddrl.training.common import check_writable

# What a run writes into its directory besides config.yaml; overwrite=true removes them.
RUN_FILES = ("metrics.jsonl", "samples.jsonl", "train.log", "reward_curve.png", "eval", "tensorboard")


def previous_run(path: Path) -> list[str]:
    """The names that show `path` already holds a run: its metrics.jsonl and checkpoint directories."""
    if not path.is_dir():
        return []
    names = sorted(p.name for p in path.glob("checkpoint-*") if p.is_dir())
    return (["metrics.jsonl"] if (path / "metrics.jsonl").is_file() else []) + names


@dataclass
class RunDirectory:
    path: Path
    resume: bool  # a checkpoint is to be loaded (resume=true, or auto with a checkpoint there)
    overwrite: bool  # a new run replaces the one in path (overwrite=true and there was one)
    created: list[Path] = field(default_factory=list)  # directories this start made, deepest last

    @classmethod
    def open(cls, output_dir: str | Path, resume: bool | str, overwrite: bool) -> "RunDirectory":
        """Check output_dir against resume / overwrite (reads only), then make it, writable."""
        path = Path(output_dir)
        found = previous_run(path)
        if resume is True and not list_checkpoints(path):
            where = ("does not exist" if not path.exists() else
                     f"holds no complete checkpoint-N ({', '.join(found) or 'it is empty'})")
            raise ValueError(f"resume=true but output_dir {str(path)!r} {where}: nothing to resume. Check the "
                             f"directory's name; resume=auto starts fresh when there is no checkpoint, "
                             f"resume=false starts a new run")
        if resume is False and found and not overwrite:
            raise ValueError(f"output_dir {str(path)!r} already holds a run ({', '.join(found[:4])}); a new run "
                             f"would overwrite it. resume=true continues it, another output_dir starts a new run "
                             f"elsewhere, overwrite=true replaces it")
        missing = [p for p in (path, *path.parents) if not p.exists()]
        check_writable(path)
        return cls(path, resume=bool(resume) and bool(list_checkpoints(path)),
                   overwrite=resume is False and bool(found), created=missing[::-1])

    def clear_previous_run(self) -> None:
        """overwrite=true: remove the previous run's checkpoints, logs and evaluations (main rank only)."""
        if not self.overwrite:
            return
        for p in [*self.path.glob("checkpoint-*"), *self.path.glob(".checkpoint-*.tmp-*"),
                  *(self.path / name for name in RUN_FILES)]:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            elif p.exists():
                p.unlink()

    def abandon(self) -> None:
        """A failed start: the directories it made go, deepest first, while they are empty."""
        for p in reversed(self.created):
            try:
                p.rmdir()
            except OSError:  # not empty (another process wrote into it), or already gone
                return
