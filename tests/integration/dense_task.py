"""A user task (loaded by import path) with a dense reward, so that even a barely trained model
gets non-zero, varied rewards and every method has a gradient to follow in a 2-step test."""

from ddrl.tasks.sudoku import MiniSudokuTask


class CellAccuracySudoku(MiniSudokuTask):
    name = "cell_accuracy_sudoku"

    def reward(self, completions, **columns):
        return [sum(a == b for a, b in zip(c, s)) / len(s) for c, s in zip(completions, columns["solution"])]


def make(**kwargs):
    return CellAccuracySudoku(**kwargs)


class OnesSudoku(MiniSudokuTask):
    """A reward any working policy gradient climbs fast: the fraction of completion cells that are '1'."""

    name = "ones_sudoku"

    def reward(self, completions, **columns):
        return [c.count("1") / max(len(c), 1) for c in completions]


def make_ones(**kwargs):
    return OnesSudoku(**kwargs)


class ManyOnesSudoku(MiniSudokuTask):
    """A binary reward that splits groups: 1 when the completion holds at least `k` '1' cells."""

    name = "many_ones_sudoku"

    def __init__(self, k: int = 4, **kwargs):
        super().__init__(**kwargs)
        self.k = k

    def reward(self, completions, **columns):
        return [float(c.count("1") >= self.k) for c in completions]


def make_many_ones(**kwargs):
    return ManyOnesSudoku(**kwargs)
