"""Sudoku tasks: "mini_sudoku" (4x4) and "sudoku" (9x9) from reasoning-gym's generators, and
"sudoku4x4" from d1's 4x4 files (Sudoku4x4Task, at the end: d1's string format, reward and metric).

reasoning-gym removes cells from a random solved grid while the puzzle keeps a unique solution
(`min_empty`..`max_empty` blanks; a 4x4 puzzle may end with fewer blanks than asked when removing
more would break uniqueness). Only 288 solved 4x4 grids exist, so with `holdout="solution"` the
dev and test splits are made of grids that no train puzzle has (hash of the solution); the default
`holdout="puzzle"` only keeps the puzzles themselves apart (see ddrl/tasks/__init__.py). With
test_fraction 0.1, holdout="solution" gives train 265 grids, dev 10, test 13
(tests/unit/test_splits.py counts them). Puzzles of one grid are not independent examples, so
`cluster_key` is the solution grid: intervals bootstrap over grids (ddrl/stats.py).

Formats:
- compact (built-in tiny models): prompt = the grid row-major, one char per cell, "." for a blank,
  no separators ("1.3.2..4..." 16 or 81 chars); completion = the solved grid, 16 or 81 digits.
- chat (HF models): an instruction with the grid; the solved grid goes inside <answer>...</answer>.

Reward: "exact" = 1.0 for any valid completed grid that keeps every given (not only the
generator's solution); "partial" = fraction of blank cells equal to the solution, 0.0 if a given is
contradicted, 1.0 for a valid grid.
"""

from __future__ import annotations

from typing import Any

from ddrl.registry import TASKS
from ddrl.rewards.composite import per_completion
from ddrl.rewards.format import extract_answer
from ddrl.tasks import ReasoningGymTask, check_format
from ddrl.tasks.paper_data import DEFAULT_DEV_FRACTION, DataSource, FileTask, PresetMixin, check_preset_format

BLANK = "."
_GRID_CHARS = set("0123456789._")


def box_shape(size: int) -> tuple[int, int]:
    side = int(round(size**0.5))
    if side * side != size:
        raise ValueError(f"sudoku size must be a perfect square (4, 9), got {size}")
    return side, side


def is_valid_solution(grid: str, size: int) -> bool:
    """Every row, column and box of the row-major grid holds 1..size exactly once."""
    if len(grid) != size * size:
        return False
    digits = set("123456789"[:size])
    rows = [grid[r * size:(r + 1) * size] for r in range(size)]
    cols = ["".join(row[c] for row in rows) for c in range(size)]
    bh, bw = box_shape(size)
    boxes = ["".join(rows[r][c] for r in range(br, br + bh) for c in range(bc, bc + bw))
             for br in range(0, size, bh) for bc in range(0, size, bw)]
    return all(set(unit) == digits and len(unit) == size for unit in rows + cols + boxes)


def parse_grid(text: str, size: int, chat: bool) -> str | None:
    """The completion's grid as a row-major string of size*size chars, or None if malformed.

    compact: the completion itself (whitespace ignored) must be exactly the grid.
    chat: the grid is read from <answer>...</answer>, keeping digits and blanks and ignoring the
    separators a model may write (spaces, newlines, commas, bars).
    """
    if chat:
        content = extract_answer(text)
        if content is None:
            return None
        cells = "".join(ch for ch in content if ch in _GRID_CHARS)
    else:
        cells = "".join(text.split())
    return cells if len(cells) == size * size else None


def sudoku_score(completion: str, puzzle: str, solution: str, size: int, partial: bool, chat: bool) -> float:
    grid = parse_grid(completion, size, chat)
    if grid is None:
        return 0.0
    if any(p != BLANK and g != p for p, g in zip(puzzle, grid)):
        return 0.0  # a given is contradicted
    if is_valid_solution(grid, size):
        return 1.0
    if not partial:
        return 0.0
    blanks = [i for i, p in enumerate(puzzle) if p == BLANK]
    return sum(grid[i] == solution[i] for i in blanks) / len(blanks) if blanks else 0.0


def _grid_string(board: list[list[int]]) -> str:
    return "".join(str(v) if v else BLANK for row in board for v in row)


@TASKS.register("sudoku")
class SudokuTask(ReasoningGymTask):
    """9x9 Sudoku. Args: min_empty/max_empty (blank cells), reward ("exact"|"partial"),
    holdout ("puzzle"|"solution": what the test split keeps apart from train), format."""

    name = "sudoku"
    dataset_name = "sudoku"
    size = 9
    default_empty = (30, 50)
    max_empty_limit = 64  # reasoning-gym's bound (17 clues are needed for a unique 9x9 solution)
    test_fraction = 0.2  # 9x9 generation is slow (~40 ms): keep the test split's rejection cost low
    chat_gen_length = 512

    def __init__(self, min_empty: int | None = None, max_empty: int | None = None, reward: str = "exact",
                 holdout: str = "puzzle", format: str = "compact"):
        super().__init__()
        self.format = check_format(self.name, format, ("compact", "chat"))
        lo, hi = self.default_empty
        self.min_empty = lo if min_empty is None else int(min_empty)
        self.max_empty = max(hi, self.min_empty) if max_empty is None else int(max_empty)
        if not 0 <= self.min_empty <= self.max_empty <= self.max_empty_limit:
            raise ValueError(f"{self.name}: need 0 <= min_empty <= max_empty <= {self.max_empty_limit}, "
                             f"got min_empty={self.min_empty}, max_empty={self.max_empty}")
        if reward not in ("exact", "partial"):
            raise ValueError(f"{self.name}: reward must be 'exact' or 'partial', got {reward!r}")
        if holdout not in ("puzzle", "solution"):
            raise ValueError(f"{self.name}: holdout must be 'puzzle' or 'solution', got {holdout!r}")
        self.reward_kind = reward
        self.holdout = holdout
        self.gen_length = self.size * self.size if self.format == "compact" else self.chat_gen_length

    def _rg_config(self) -> dict[str, Any]:
        return {"min_empty": self.min_empty, "max_empty": self.max_empty}

    def _example(self, item: dict[str, Any]) -> dict[str, Any]:
        meta = item["metadata"]
        puzzle, solution = _grid_string(meta["puzzle"]), _grid_string(meta["solution"])
        return {"prompt": self._prompt(puzzle), "puzzle": puzzle, "solution": solution}

    def _split_key(self, example: dict[str, Any]) -> str:
        return example[self.holdout]

    def cluster_key(self, example: dict[str, Any]) -> str:
        return example["solution"]

    def _prompt(self, puzzle: str) -> str:
        if self.format == "compact":
            return puzzle
        n = self.size
        rows = "\n".join(" ".join(puzzle[r * n:(r + 1) * n]) for r in range(n))
        bh, bw = box_shape(n)
        return (f"Solve this {n}x{n} Sudoku puzzle. Fill every '.' so that each row, each column and each "
                f"{bh}x{bw} box contains the digits 1-{n} exactly once; do not change the given digits.\n\n"
                f"{rows}\n\nThink in <reasoning>...</reasoning>, then write the completed grid inside "
                f"<answer>...</answer>, one row per line with the digits separated by spaces.")

    def reward(self, completions: list[str], **columns: Any) -> list[float | None]:
        size, partial, chat = self.size, self.reward_kind == "partial", self.format == "chat"

        @per_completion
        def score(completion: str, puzzle: str, solution: str, **_: Any) -> float:
            return sudoku_score(completion, puzzle, solution, size, partial, chat)

        return score(completions, **columns)

    def symbols(self) -> list[str]:
        return [str(d) for d in range(1, self.size + 1)] + [BLANK]

    def pretrain_pairs(self, n: int, seed: int = 0) -> list[dict[str, str]]:
        if self.format != "compact":
            raise NotImplementedError(f"{self.name}: gold completions exist only in the compact format")
        return [{"prompt": ex["prompt"], "completion": ex["solution"]} for ex in self.train_examples(n, seed)]


@TASKS.register("mini_sudoku")
class MiniSudokuTask(SudokuTask):
    """4x4 Sudoku (reasoning-gym mini_sudoku). Same arguments as SudokuTask."""

    name = "mini_sudoku"
    dataset_name = "mini_sudoku"
    size = 4
    default_empty = (8, 12)
    max_empty_limit = 12  # more blanks cannot keep a unique 4x4 solution
    test_fraction = 0.1
    chat_gen_length = 256


# --------------------------------------------------------------------------- d1's 4x4 files

D1_BLANK = "0"  # d1's string format: 16 chars row-major, '0' = an empty cell
_D1_SIZE = 16


def d1_grid(value: Any, where: str, column: str) -> str:
    """A d1 grid string, checked: 16 characters of 0-4 ('0' = blank).

    A grid stored as a number (a JSON or parquet column typed as integers) has lost its leading
    zeros ("0310..." -> 310...): an int is padded back to 16 digits, as StableDRL does. A string
    keeps what the file says (d1's CSVs keep the zero), so a string of another length is an error:
    padding it would move every given of a mistyped puzzle."""
    text = str(value).strip()
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 10**_D1_SIZE:
        text = text.zfill(_D1_SIZE)
    if len(text) != _D1_SIZE or not set(text) <= set("01234"):
        lost_zero = ("; if a spreadsheet or pandas stored the grid as a number and dropped its leading '0', "
                     "write it back as a 16-character string"
                     if text.isdigit() and len(text) < _D1_SIZE else "")
        raise ValueError(f"{where}: {column} must be 16 characters of 0-4 ('0' = blank), got {value!r} "
                         f"({len(text)} characters){lost_zero}")
    return text


def check_d1_solution(puzzle: str, solution: str, where: str) -> None:
    """A d1 row's Solution must be a solved 4x4 grid that keeps every given of its Puzzle: a wrong
    solution would score right answers as wrong (the reward compares the blanks with it)."""
    if not is_valid_solution(solution, 4):
        raise ValueError(f"{where}: Solution {solution!r} is not a solved 4x4 Sudoku (each row, column and 2x2 "
                         f"box must hold 1, 2, 3 and 4 once); fix the row or drop it")
    wrong = [i for i, (p, s) in enumerate(zip(puzzle, solution)) if p != D1_BLANK and p != s]
    if wrong:
        cells = ", ".join(f"row {i // 4 + 1} column {i % 4 + 1} ({puzzle[i]} vs {solution[i]})" for i in wrong)
        raise ValueError(f"{where}: Puzzle {puzzle!r} contradicts its Solution {solution!r} at {cells}; "
                         f"the givens must equal the solution's cells (are the columns swapped or shifted?)")


def d1_answer_digits(completion: str) -> str | None:
    """The digits inside the last <answer> tag (separators dropped), or None without a tag."""
    content = extract_answer(completion)
    return None if content is None else "".join(ch for ch in content if ch.isdigit())


def blank_cell_accuracy(completion: str, puzzle: str, solution: str) -> float:
    """d1's Sudoku score: the fraction of the puzzle's blank cells that the answer fills correctly.

    The answer's digits, cut or padded with '0' to 16, are compared cell by cell with the solution
    on the blanks; givens are not checked (d1's reward and its accuracy both ignore them).
    """
    digits = d1_answer_digits(completion)
    blanks = [i for i, p in enumerate(puzzle) if p == D1_BLANK]
    if not digits or not blanks:
        return 0.0
    grid = (digits + D1_BLANK * _D1_SIZE)[:_D1_SIZE]
    return sum(grid[i] == solution[i] for i in blanks) / len(blanks)


class BlankCellScoring:
    """Reward = metric = blank_cell_accuracy; correct = every blank right (the metric is 1)."""

    def reward(self, completions: list[str], **columns: Any) -> list[float | None]:
        return blank_cell_reward(completions, **columns)

    def metric(self, completions: list[str], **columns: Any) -> list[float]:
        return [0.0 if s is None else float(s) for s in blank_cell_reward(completions, **columns)]

    def correct(self, completions: list[str], **columns: Any) -> list[bool]:
        return [m >= 1.0 for m in self.metric(completions, **columns)]


@per_completion
def blank_cell_reward(completion: str, puzzle: str, solution: str, **_: Any) -> float:
    return blank_cell_accuracy(completion, puzzle, solution)


@TASKS.register("sudoku4x4")
class Sudoku4x4Task(PresetMixin, BlankCellScoring, FileTask):
    """d1's 4x4 Sudoku files: CSVs with columns Puzzle, Solution (16-char strings, '0' = blank):
    dataset/4x4_sudoku_unique_puzzles.csv (train) and dataset/4x4_test_sudoku.csv (test) in d1,
    SPG, ESPO and GDSD; SPG also ships a solution-disjoint train_/test_sudoku_split_new.csv. Column
    names match case-insensitively. Examples: "prompt", "puzzle", "solution".

    Args: train_path, test_path, path, split, test_fraction, dev_fraction, dataset
    (ddrl/tasks/paper_data.py); format ("chat" only); preset. Reward and accuracy as d1: the
    fraction of blank cells filled correctly (`metric`); `correct` = all of them.
    """

    name = "sudoku4x4"
    gen_length = 256

    def __init__(self, path: str | None = None, *, train_path: str | None = None, test_path: str | None = None,
                 dataset: str | None = None, dataset_config: str | None = None, train_split: str = "train",
                 test_split: str = "test", split: str | None = None, test_fraction: float | None = None,
                 dev_fraction: float = DEFAULT_DEV_FRACTION, format: str | None = None, preset: str | None = None):
        fmt = check_preset_format(self.name, preset, format, "chat")
        self.format = check_format(self.name, fmt, ("chat",))
        self._init_source(DataSource(self.name, path=path, train_path=train_path, test_path=test_path,
                                     dataset=dataset, dataset_config=dataset_config, train_split=train_split,
                                     test_split=test_split, split=split, test_fraction=test_fraction,
                                     dev_fraction=dev_fraction))
        self._init_preset(preset)

    def _example(self, row: dict[str, Any], where: str) -> dict[str, Any]:
        lower = {str(k).strip().lower(): v for k, v in row.items()}
        if "puzzle" not in lower or "solution" not in lower:
            raise ValueError(f"{where}: a sudoku4x4 row needs columns Puzzle and Solution (d1's CSV header "
                             f"'Puzzle,Solution'); fields: {', '.join(map(str, row))}")
        puzzle = d1_grid(lower["puzzle"], where, "Puzzle")
        solution = d1_grid(lower["solution"], where, "Solution")
        check_d1_solution(puzzle, solution, where)
        return {"prompt": self._prompt(puzzle), "puzzle": puzzle, "solution": solution}

    def _split_key(self, example: dict[str, Any]) -> str:
        return example["puzzle"]

    def cluster_key(self, example: dict[str, Any]) -> str:
        """d1's puzzles come from the same 288 grids: bootstrap over solution grids."""
        return example["solution"]

    def _prompt(self, puzzle: str) -> str:
        return ("Solve this 4x4 Sudoku. The grid is a 16-character string read row by row, left to right; "
                "'0' marks an empty cell. Fill every empty cell with a digit from 1 to 4 so that each row, "
                "each column and each 2x2 box holds 1, 2, 3 and 4 exactly once; keep the given digits.\n\n"
                f"Puzzle: {puzzle}\n\nThink in <reasoning>...</reasoning>, then write the solved grid "
                "inside <answer>...</answer> as 16 digits without spaces.")
