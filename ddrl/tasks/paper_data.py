"""Tasks backed by data files, in the formats the papers ship, and the `preset=` task argument.

The papers (d1, SPG, ESPO, GDSD, StableDRL) train and test on fixed files, and their tables
report accuracy on the whole test file. A file-backed task therefore reads its two splits from two
files; it never carves a test split out of one file unless asked to:

    train_path=TRAIN, test_path=TEST    the normal form (a train question also in TEST is dropped)
    test_path=TEST                      evaluation only (`ddrl eval`); training asks for train_path
    path=FILE                           the same as test_path=FILE: a user who names one file for
                                        `ddrl eval` expects every row scored, not a hashed 10%
    path=FILE, split="hash"             one file split by a hash of each example's key, a fraction
      (test_fraction=0.1)               `test_fraction` of them test (giving test_fraction alone
                                        also asks for it); stable across runs and file orders
    dataset=NAME                        a Hugging Face hub dataset (needs `pip install datasets`)

Dev. Choices (recipes, learning rates, checkpoints) are made on dev, which is held out of the TRAIN
rows, never of the test file: `dev_fraction` (default 0.1) of the train rows by a hash of their key,
independent of the test_fraction hash. The test file stays whole and sealed, for reported numbers
(`test_examples`, `all_test_examples` are what they were). dev_fraction=0 trains on every train
row, as the papers do, and leaves the task without a dev split. A task with no train rows
(test_path= or path= alone) has no dev split either.

Files: .jsonl (one JSON object a line), .json (a list of objects), .csv (a header row; cells
stay strings, so d1's Sudoku "0310..." keeps its leading zero), .parquet (needs
`pip install pyarrow`) and .txt (one prompt a line: {"prompt": line}, the text-to-image lists).
A file argument `ddrl:NAME` names a data file shipped with ddrl (ddrl.tasks.data: GenEval's prompts).

`preset="d1"` (or "espo", "spg", "stable_drl", "gdsd") makes a task use the paper's prompt, reward
and accuracy metric from `ddrl.tasks.presets.get_preset(preset, task.name)` in place of its own:
train examples get `preset.prompt(example)` as their "prompt", dev and test examples
`preset.prompt_for_eval(example)` (d1 evaluates with another system prompt than it trains with),
`reward` is the preset's reward and `metric` its per-item accuracy, `correct` = metric == 1.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from ddrl.rewards.composite import RewardResult, score_parts
from ddrl.tasks.base import Task, held_out_sample, is_test_key, split_fixed_rows, train_cycle
from ddrl.tasks.data import resolve_data_path
from ddrl.tasks.presets import Preset, get_preset

DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".txt")
DEFAULT_TEST_FRACTION = 0.1  # of a single file split by hash (split="hash")
DEFAULT_DEV_FRACTION = 0.1  # of the train rows, held out as dev


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a .jsonl / .json (a list of objects) / .csv / .parquet file, as dicts."""
    return [row for _, row in numbered_records(path)]


def numbered_records(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """(label, row) for each row of a data file. Labels count from 1, as editors do: "record 3",
    with the line where the record ends in .jsonl and .csv files ("record 3 (line 4)": a CSV's
    header is line 1, a .jsonl may have blank lines)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow "
                              f"(or convert the file to .jsonl)") from None
        return [(f"record {i}", row) for i, row in enumerate(pq.read_table(path).to_pylist(), start=1)]
    text = read_utf8(path)
    if suffix == ".csv":
        reader = csv.DictReader(io.StringIO(text, newline=""))
        return [(f"record {i} (line {reader.line_num})", dict(row)) for i, row in enumerate(reader, start=1)]
    if suffix == ".txt":  # a prompt list (PickScore's, OCR's): one prompt a line, blank lines skipped
        lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
        return [(f"record {i} (line {n})", {"prompt": line}) for i, (n, line) in enumerate(lines, start=1)]
    if suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = [(f"record {i}", row) for i, row in enumerate(json.loads(text), start=1)]
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e}); a .json data file is one list of objects") from None
    else:
        rows = []
        for line_no, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    rows.append((f"record {len(rows) + 1} (line {line_no})", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}: line {line_no} is not valid JSON ({e}); data files are "
                                     f"{', '.join(DATA_SUFFIXES)}") from None
    for label, row in rows:
        if not isinstance(row, dict):
            raise ValueError(f"{path} {label}: every record must be a JSON object, got {type(row).__name__}")
    return rows


def read_utf8(path: Path) -> str:
    """A data file's text; a file that is not UTF-8 is an error naming it and its first bad byte."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(f"data file {str(path)!r} is not UTF-8 text: byte {e.start} (line {line}) is "
                         f"0x{data[e.start]:02x} ({e.reason}); save it as UTF-8, e.g. "
                         f"`iconv -f latin1 -t utf-8 {path.name} > fixed{path.suffix}`") from None


def load_hub(dataset: str, config: str | None, split: str) -> list[dict[str, Any]]:
    """Rows of one split of a Hugging Face hub dataset (downloads it)."""
    try:
        import datasets
    except ImportError:
        raise ImportError(f"dataset={dataset!r} needs the `datasets` package: pip install datasets "
                          f"(or pass train_path=/test_path= to local .jsonl/.csv/.parquet files)") from None
    return [dict(r) for r in datasets.load_dataset(dataset, config, split=split)]


class DataSource:
    """Where a file-backed task's train and test rows come from; checked once, at construction.

    `mode` is "files" (train_path / test_path / path), "hash" (one file split by key hash) or
    "hub" (dataset=). `records(split)` returns (where, row) pairs, `where` naming the row in errors.
    `dev_fraction` is the share of the train rows held out as dev.
    """

    def __init__(self, task: str, *, path: str | None = None, train_path: str | None = None,
                 test_path: str | None = None, dataset: str | None = None, dataset_config: str | None = None,
                 train_split: str = "train", test_split: str = "test", split: str | None = None,
                 test_fraction: float | None = None, dev_fraction: float = DEFAULT_DEV_FRACTION,
                 example_source: str = ""):
        self.task = task
        if not 0.0 <= float(dev_fraction) < 1.0:
            raise ValueError(f"task {task!r}: dev_fraction must be in [0, 1) (the share of train rows held out "
                             f"as dev; 0 = no dev split), got {dev_fraction}")
        self.dev_fraction = float(dev_fraction)
        given = [path is not None, train_path is not None or test_path is not None, dataset is not None]
        if sum(given) != 1:
            raise ValueError(f"task {task!r} needs exactly one data source: train_path=TRAIN_FILE and "
                             f"test_path=TEST_FILE (test_path alone to evaluate), path=FILE with "
                             f"split='hash' to split one file, or dataset=HUB_NAME{example_source}")
        if split not in (None, "hash", "files"):
            raise ValueError(f"task {task!r}: split must be 'hash' (split one path= file by key hash) or "
                             f"'files' (path= is the test file), got {split!r}")
        hashed = split == "hash" or (split is None and test_fraction is not None)
        if hashed and path is None:
            raise ValueError(f"task {task!r}: split='hash' / test_fraction= split a single path=FILE; "
                             f"with train_path=/test_path= or dataset= the splits are already given")
        if split == "files" and test_fraction is not None:
            raise ValueError(f"task {task!r}: test_fraction= needs split='hash'")
        if hashed:
            test_fraction = DEFAULT_TEST_FRACTION if test_fraction is None else float(test_fraction)
            if not 0.0 < test_fraction < 1.0:
                raise ValueError(f"task {task!r}: test_fraction must be in (0, 1), got {test_fraction}")
        self.mode = "hub" if dataset is not None else "hash" if hashed else "files"
        self.test_fraction = test_fraction
        if self.mode == "files" and path is not None:
            test_path = path  # one file named without a split is the file to evaluate on
        path, train_path, test_path = (resolve_data_path(p) for p in (path, train_path, test_path))  # ddrl:NAME
        self.train_path, self.test_path, self.path = train_path, test_path, path
        self.dataset, self.dataset_config = dataset, dataset_config
        self.hub_splits = {"train": train_split, "test": test_split}

    def has(self, split: str) -> bool:
        """Whether rows of `split` ("train" or "test": dev is part of the train rows) exist."""
        if self.mode != "files":
            return True
        return (self.train_path if split == "train" else self.test_path) is not None

    def records(self, split: str) -> list[tuple[str, dict[str, Any]]]:
        if self.mode == "hub":
            assert self.dataset is not None  # mode "hub" means dataset= was given
            rows, where = load_hub(self.dataset, self.dataset_config, self.hub_splits[split]), str(self.dataset)
        else:
            file = self.path if self.mode == "hash" else self.train_path if split == "train" else self.test_path
            if file is None:
                raise ValueError(self._missing(split))
            return [(f"{file} {label}", row) for label, row in numbered_records(file)]
        return [(f"{where} record {i}", row) for i, row in enumerate(rows, start=1)]

    def _missing(self, split: str) -> str:
        if split == "dev":
            if self.dev_fraction == 0.0:
                return (f"task {self.task!r} has no dev split: dev_fraction=0 trains on every train row; set "
                        f"dev_fraction={DEFAULT_DEV_FRACTION} (task.args.dev_fraction) to hold part of them out "
                        f"for choices, or choose nothing and report on the test split")
            return (f"task {self.task!r} has no dev split: dev is held out of the train rows (never the test "
                    f"file) and this task has none; pass train_path=TRAIN_FILE (or split='hash' on one file)")
        if split == "train" and self.path is not None:
            return (f"task {self.task!r}: path={self.path!r} is the test file (every row is evaluated); "
                    f"to train, pass train_path=TRAIN_FILE (with test_path=TEST_FILE), or split='hash' "
                    f"(test_fraction={DEFAULT_TEST_FRACTION}) to hold out part of this one file")
        return f"task {self.task!r} has no {split} data: pass {split}_path=FILE"


class FileTask(Task):
    """A task whose examples are the rows of a DataSource.

    Subclasses implement `_example(row, where)` (a file row -> an example dict with "prompt") and
    `_split_key(example)` (what identifies a problem: train never holds a test problem's key,
    split="hash" decides each row's split by it, and dev is the dev_fraction share of the train
    rows by its hash).
    """

    source: DataSource

    def _init_source(self, source: DataSource) -> None:
        self.source = source
        self._rows: dict[str, list[dict[str, Any]]] = {}  # split -> examples, read on first use
        self._overlap = (0, 0)  # (train rows dropped as test rows, train rows read), for the error without any

    def _example(self, row: dict[str, Any], where: str) -> dict[str, Any]:
        raise NotImplementedError

    def _split_key(self, example: dict[str, Any]) -> str:
        raise NotImplementedError

    def _split_rows(self, split: str) -> list[dict[str, Any]]:
        if split not in self._rows:
            side = "test" if split == "test" else "train"  # dev is held out of the train rows
            if not self.source.has(side):
                raise ValueError(self.source._missing(split))
            # every record is turned into an example, so a malformed row fails whatever its split
            rows = [self._example(row, where) for where, row in self.source.records(side)]
            read = len(rows)
            if self.source.mode == "hash":
                tf = self.source.test_fraction
                assert tf is not None  # mode "hash" sets a test fraction (DataSource.__init__)
                rows = [ex for ex in rows if is_test_key(self._split_key(ex), tf) == (side == "test")]
            elif side == "train" and self.source.has("test"):  # files may overlap: never train on a test item
                held = {self._split_key(ex) for ex in self._split_rows("test")}
                rows = [ex for ex in rows if self._split_key(ex) not in held]
            if side == "train":
                self._overlap = (read - len(rows), read)
            if side == "test":
                self._rows["test"] = rows
            else:
                self._rows["train"], self._rows["dev"] = split_fixed_rows(rows, self._split_key,
                                                                          self.source.dev_fraction)
        return self._rows[split]

    def train_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        """n examples, cycling through seeded permutations of the train rows when n exceeds them."""
        rows = self._split_rows("train")
        if not rows and n > 0:
            raise ValueError(self._no_train_rows())
        return train_cycle(rows, n, f"{self.name}-train-{seed}")

    def _no_train_rows(self) -> str:
        """Why the train split is empty, and the fix that applies."""
        src, (dropped, read) = self.source, self._overlap
        task = f"task {self.name!r}: no train rows left"
        if read == 0:
            return f"{task}: the train data ({src.train_path or src.path or src.dataset}) has no rows"
        if dropped == read and src.mode != "hash":  # every train row is a test problem: one file given twice?
            same = (" (train_path and test_path name the same file)" if src.train_path and src.test_path
                    and Path(src.train_path).resolve() == Path(src.test_path).resolve() else "")
            return (f"{task}: all {read} train rows are also test rows{same}, and ddrl never trains on a test "
                    f"problem. Pass a separate train file as train_path (d1 ships only test files; dev_fraction="
                    f"{DEFAULT_DEV_FRACTION} then holds part of it out as dev), or split one file: path=FILE "
                    f"split=hash (test_fraction={DEFAULT_TEST_FRACTION} of its rows become test, the rest train, "
                    f"dev_fraction of those dev)")
        return (f"{task}: of {read} rows, {dropped} are test rows and dev_fraction={src.dev_fraction} holds the "
                f"other {read - dropped} out as dev. Pass a larger train file, or dev_fraction=0 to train on "
                f"every train row")

    def dev_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        """min(n, size) distinct dev examples (held out of the train rows), in a seeded order."""
        rows = self._split_rows("dev")
        if not rows and self.source.dev_fraction == 0.0:
            raise ValueError(self.source._missing("dev"))
        if not rows:
            raise ValueError(f"task {self.name!r}: none of its {len(self._split_rows('train'))} train rows fell in "
                             f"dev (dev_fraction={self.source.dev_fraction}); pass a larger dev_fraction or train file")
        return held_out_sample(rows, n, f"{self.name}-dev-{seed}")

    def all_test_examples(self) -> list[dict[str, Any]] | None:  # Task's signature (PresetMixin wraps it)
        """The whole test split in file order (the order a paper's evaluation and subsample use)."""
        return [dict(r) for r in self._split_rows("test")]

    def test_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        """min(n, size) distinct test examples, in a seeded order (n >= size: the whole test file)."""
        return held_out_sample(self._split_rows("test"), n, f"{self.name}-test-{seed}")


def check_preset_format(task: str, preset: str | None, fmt: str | None, default: str) -> str:
    """The task's format: `default` unless given; a preset (a paper's chat prompt) needs "chat"."""
    if preset is None:
        return default if fmt is None else fmt
    if fmt not in (None, "chat"):
        raise ValueError(f"task {task!r}: preset={preset!r} is a paper's chat prompt and needs format='chat', "
                         f"got format={fmt!r}")
    return "chat"


class PresetMixin:
    """The `preset=` task argument. Put it first among a task's bases: with a preset its prompt,
    reward and metric replace the task's own; without one (the default) nothing changes."""

    preset: Preset | None = None

    def _init_preset(self, preset: str | None) -> None:
        self.preset = None if preset is None else get_preset(preset, self.name)  # type: ignore[attr-defined]

    def _preset_prompts(self, examples: list[dict[str, Any]], split: str) -> list[dict[str, Any]]:
        if self.preset is None:
            return examples
        make = self.preset.prompt if split == "train" else self.preset.prompt_for_eval
        for ex in examples:
            ex["prompt"] = make({k: v for k, v in ex.items() if k != "prompt"})
        return examples

    def train_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        return self._preset_prompts(super().train_examples(n, seed), "train")  # type: ignore[misc]

    def dev_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        return self._preset_prompts(super().dev_examples(n, seed), "dev")  # type: ignore[misc]

    def test_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        return self._preset_prompts(super().test_examples(n, seed), "test")  # type: ignore[misc]

    def all_test_examples(self) -> list[dict[str, Any]] | None:
        rows = super().all_test_examples()  # type: ignore[misc]
        return None if rows is None else self._preset_prompts(rows, "test")

    def reward(self, completions: list[str], **columns: Any) -> list[float | None]:
        if self.preset is None:
            return super().reward(completions, **columns)  # type: ignore[misc]
        return list(self.preset.reward(completions, **columns))

    def metric(self, completions: list[str], **columns: Any) -> list[float]:
        if self.preset is None:
            return super().metric(completions, **columns)  # type: ignore[misc]
        return [float(m) for m in self.preset.metric(completions, **columns)]

    def correct(self, completions: list[str], **columns: Any) -> list[bool]:
        if self.preset is None:
            return super().correct(completions, **columns)  # type: ignore[misc]
        return [m >= 1.0 for m in self.metric(completions, **columns)]

    def score(self, completions: list[str], **columns: Any) -> RewardResult:
        if self.preset is None:
            return super().score(completions, **columns)  # type: ignore[misc]
        return score_parts(self.preset.reward, completions, **columns)
