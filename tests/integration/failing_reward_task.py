"""Sudoku tasks whose reward stops working mid-run (tests/integration/test_dead_reward.py): one that
returns None after its first calls, and one scored by a `ddrl serve-reward` process the test kills."""

from ddrl.rewards.server import RewardServerClient
from ddrl.tasks.sudoku import MiniSudokuTask


def cell_accuracy(completions, solution, **_):
    """The dense reward of tests/integration/dense_task.py, as a function a reward server serves."""
    return [sum(a == b for a, b in zip(c, s)) / len(s) for c, s in zip(completions, solution)]


class DyingRewardSudoku(MiniSudokuTask):
    """Scores its first `works_for` calls (one per training step with eval.n=0), then None for all."""

    name = "dying_reward_sudoku"

    def __init__(self, works_for: int = 2, **kwargs):
        super().__init__(**kwargs)
        self.works_for, self.calls = works_for, 0

    def reward(self, completions, **columns):
        self.calls += 1
        if self.calls > self.works_for:
            return [None] * len(completions)
        return cell_accuracy(completions, columns["solution"])


def make_dying(**kwargs):
    return DyingRewardSudoku(**kwargs)


class ServedRewardSudoku(MiniSudokuTask):
    """Scored over HTTP: a server that is down gives None (the client's bounded retries: none here)."""

    name = "served_reward_sudoku"

    def __init__(self, url: str, **kwargs):
        super().__init__(**kwargs)
        self.client = RewardServerClient(url, retries=0, timeout=10)

    def reward(self, completions, **columns):
        return self.client(completions, solution=columns["solution"])


def make_served(**kwargs):
    return ServedRewardSudoku(**kwargs)
