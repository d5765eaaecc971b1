"""Data files shipped with ddrl, named in a task's file arguments as `ddrl:<dir>/<file>`:

    task.args.test_path=ddrl:geneval/evaluation_metadata.jsonl

Only small files whose licence allows it, byte for byte as their source ships them; each folder's
README.md says where each file comes from (repository, commit, path, licence). Everything else a
paper trains on stays a path the user gives (nothing is downloaded at run time).
"""

from __future__ import annotations

from pathlib import Path

PREFIX = "ddrl:"
ROOT = Path(__file__).resolve().parent
# What counts as a shipped data file: the formats the file tasks read. Not this module, its compiled
# __pycache__ (written beside it on first import), or the provenance READMEs.
DATA_SUFFIXES = (".jsonl", ".json", ".txt", ".csv", ".parquet")


def shipped_files() -> list[str]:
    """Every shipped data file, as a task argument names it (ddrl:geneval/evaluation_metadata.jsonl)."""
    return sorted(PREFIX + p.relative_to(ROOT).as_posix() for p in ROOT.glob("*/*")
                  if p.is_file() and p.suffix in DATA_SUFFIXES and p.parent.name != "__pycache__")


def resolve_data_path(path: str | None) -> str | None:
    """A task's file argument as a real path: `ddrl:NAME` is the shipped file NAME, anything else is
    returned as it is. An unknown shipped name is an error that lists the shipped files."""
    if path is None or not str(path).startswith(PREFIX):
        return path
    name = str(path)[len(PREFIX):]
    file = ROOT / name
    if ".." in Path(name).parts or not file.is_file() or str(path) not in shipped_files():
        raise ValueError(f"{path!r} is not a data file shipped with ddrl; shipped: {', '.join(shipped_files())} "
                         f"(or give the path of your own file)")
    return str(file)
