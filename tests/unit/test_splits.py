"""Three disjoint splits for every registered task: train, dev (for choices), test (sealed).

Checked for every task in ddrl.registry.TASKS: the splits share no problem, are deterministic in
their seed, `examples(split, ...)` dispatches to them, and cluster keys group what is dependent.
The train streams (what the shipped checkpoints were trained on) and the fixed test sets are
pinned by digests recorded before dev existed.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from ddrl.registry import TASKS
from ddrl.tasks import DEV_SHARE, get_task, held_out_split, is_dev_key, is_test_key
from ddrl.tasks.base import SPLITS
from ddrl.tasks.user import FunctionTask

# --------------------------------------------------------------------------- small instances


@functools.cache
def all_4x4_grids() -> list[str]:
    """Every solved 4x4 Sudoku, by brute force over rows (there are 288)."""
    rows = ["".join(p) for p in itertools.permutations("1234")]
    return ["".join(r) for r in itertools.product(rows, repeat=4)
            if all(len({r[i][c] for i in range(4)}) == 4 for c in range(4))
            and all(len({r[br + i][bc + j] for i in range(2) for j in range(2)}) == 4
                    for br in (0, 2) for bc in (0, 2))]


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _gsm8k(lo: int, hi: int) -> list[dict[str, Any]]:
    return [{"question": f"Ann has {i} pens and gets {i + 2} more. How many pens?",
             "answer": f"{i}+{i + 2}\n#### {2 * i + 2}"} for i in range(lo, hi)]


def _math(lo: int, hi: int) -> list[dict[str, Any]]:
    return [{"problem": f"Compute {i} + {i}.", "solution": f"\\boxed{{{2 * i}}}", "answer": str(2 * i)}
            for i in range(lo, hi)]


def _countdown(lo: int, hi: int) -> list[dict[str, Any]]:
    return [{"input": f"{i},{i + 1},{i + 2}", "output": str(3 * i + 3)} for i in range(lo, hi)]


def _sudoku_csv(path: Path, lo: int, hi: int) -> str:
    """d1's CSV format: Puzzle,Solution, '0' = blank; puzzles of the 288 grids, 8 blanks each."""
    grids, lines = all_4x4_grids(), ["Puzzle,Solution"]
    for i in range(lo, hi):
        grid, blanks = grids[i % 288], {(i * 7 + k * 5) % 16 for k in range(8)}
        lines.append("".join("0" if j in blanks else c for j, c in enumerate(grid)) + "," + grid)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _mbpp_rows() -> list[dict[str, Any]]:
    ids = [*range(1, 5), *range(11, 31), *range(511, 531), *range(601, 661)]  # prompt, test, validation, train
    return [{"task_id": i, "text": f"Write a function f{i} returning {i}.", "code": f"def f{i}():\n    return {i}",
             "test_list": [f"assert f{i}() == {i}"], "test_setup_code": ""} for i in ids]


def make_task(name: str, tmp_path: Path, **kwargs: Any):
    """A small instance of every registered task; file tasks read files written under tmp_path."""
    if name == "gsm8k":
        return get_task(name, train_path=_jsonl(tmp_path / "g_train.jsonl", _gsm8k(0, 200)),
                        test_path=_jsonl(tmp_path / "g_test.jsonl", _gsm8k(1000, 1040)), **kwargs)
    if name == "math500":
        return get_task(name, train_path=_jsonl(tmp_path / "m_train.jsonl", _math(0, 200)),
                        test_path=_jsonl(tmp_path / "m_test.jsonl", _math(500, 540)), **kwargs)
    if name == "sudoku4x4":
        return get_task(name, train_path=_sudoku_csv(tmp_path / "s_train.csv", 0, 200),
                        test_path=_sudoku_csv(tmp_path / "s_test.csv", 1000, 1040), **kwargs)
    if name == "countdown_file":
        return get_task("countdown", train_path=_jsonl(tmp_path / "c_train.jsonl", _countdown(1, 200)),
                        test_path=_jsonl(tmp_path / "c_test.jsonl", _countdown(500, 540)), **kwargs)
    if name == "mbpp":
        return get_task(name, path=_jsonl(tmp_path / "mbpp.jsonl", _mbpp_rows()), **kwargs)
    if name == "text_to_image":
        train, test = tmp_path / "t2i_train.txt", tmp_path / "t2i_test.jsonl"
        train.write_text("".join(f"a photo of {i} cats\n" for i in range(200)))
        _jsonl(test, [{"tag": "counting", "include": [{"class": "cat", "count": i}], "prompt": f"a photo of {i} cats"}
                      for i in range(150, 190)])  # overlaps train: those prompts leave train
        return get_task(name, image_grid=[4, 4], reward=lambda completions, **_: [0.0] * len(completions),
                        train_path=str(train), test_path=str(test), **kwargs)
    if name == "dna_enhancer":
        from tests.unit.test_dna_task import CountOracle, write_gosai_csv

        data = write_gosai_csv(tmp_path / "gosai.csv", n=300)
        return get_task(name, path=str(data), split="hash", test_fraction=0.2, oracle=CountOracle(), **kwargs)
    if name == "sudoku":
        return get_task(name, min_empty=30, max_empty=40, **kwargs)
    return get_task(name, **kwargs)


# how many examples each split is asked for (9x9 Sudoku and Countdown generation is slow)
SIZES = {"sudoku": 2, "countdown": 4, "mini_sudoku": 16, "gsm_symbolic": 20}
PROCEDURAL = ["mini_sudoku", "sudoku", "countdown", "gsm_symbolic"]
FILE_TASKS = ["gsm8k", "math500", "sudoku4x4", "countdown_file", "mbpp", "text_to_image", "dna_enhancer"]
SPECIAL = ["digits", "digits_image", "humaneval"]  # the same ten class prompts in every split; test-only
ALL = PROCEDURAL + FILE_TASKS + SPECIAL


def digest(rows: list[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()[:16]


def identity(task, example: dict[str, Any]) -> str:
    """What identifies a problem: the task's split key (the text for mbpp, which has none)."""
    return task._split_key(example) if hasattr(task, "_split_key") else example["text"]


def test_every_registered_task_is_covered():
    covered = {"countdown" if n == "countdown_file" else n for n in ALL}
    assert covered == set(TASKS.names()), "add the new task to tests/unit/test_splits.py (make_task, ALL)"


# --------------------------------------------------------------------------- disjointness


@pytest.mark.parametrize("name", PROCEDURAL + FILE_TASKS)
def test_train_dev_and_test_share_no_problem(name, tmp_path):
    task = make_task(name, tmp_path)
    n = SIZES.get(name, 1000)
    splits = {split: [e for seed in (0, 1) for e in task.examples(split, n, seed=seed)] for split in SPLITS}
    keys = {split: {identity(task, e) for e in examples} for split, examples in splits.items()}
    assert all(keys.values()), {s: len(k) for s, k in keys.items()}
    assert keys["train"].isdisjoint(keys["dev"]) and keys["train"].isdisjoint(keys["test"])
    assert keys["dev"].isdisjoint(keys["test"])


@pytest.mark.parametrize("name", PROCEDURAL)
def test_procedural_splits_are_hash_buckets_of_the_held_out_side(name):
    # the property behind disjointness, which holds for streams of any seed and size
    task = make_task(name, Path("."))
    n = SIZES[name]
    for split in SPLITS:
        for example in task.examples(split, n, seed=2):
            key = task._split_key(example)
            assert task.split_of(example) == held_out_split(key, task.test_fraction) == split
            assert is_test_key(key, task.test_fraction) == (split != "train")  # train/held-out: as before dev
    assert DEV_SHARE == 0.5


@pytest.mark.parametrize("name", PROCEDURAL + FILE_TASKS + ["digits", "digits_image"])
def test_splits_are_deterministic_streams(name, tmp_path):
    a, b = make_task(name, tmp_path), make_task(name, tmp_path)  # separate instances: no shared cache
    n = SIZES.get(name, 12)
    for split in ("dev", "test"):
        first = a.examples(split, n, seed=0)
        assert first == b.examples(split, n, seed=0)
        assert first != a.examples(split, n, seed=1)
        first[0]["prompt"] = "mutated"  # callers may mutate their examples
        assert a.examples(split, n, seed=0)[0]["prompt"] != "mutated"
    if name in PROCEDURAL:
        assert a.dev_examples(n // 2, seed=0) == a.dev_examples(n, seed=0)[: n // 2]  # one stream per seed
    assert a.examples("train", n, seed=3) == a.train_examples(n, seed=3)
    assert a.examples("dev", n, seed=3) == a.dev_examples(n, seed=3)
    assert a.examples("test", n, seed=3) == a.test_examples(n, seed=3)


def test_an_unknown_split_names_the_valid_ones():
    with pytest.raises(ValueError, match="train, dev, test"):
        get_task("digits").examples("validation", 4)


# --------------------------------------------------------------------------- what did not change

# sha256 of today's streams, recorded at c4b6859 (before dev existed): the shipped checkpoints and
# the demo were pretrained and trained on exactly these train streams
TRAIN_DIGESTS = {("mini_sudoku", 60, 0): "9d99476fd7ebbae6", ("mini_sudoku", 60, 1): "6c93f25e8243d703",
                 ("countdown", 30, 0): "66ba5f9a30317a24", ("gsm_symbolic", 20, 0): "ee0a918a6c6cd380",
                 ("sudoku", 3, 0): "38a02dd55ef67c63", ("digits", 30, 0): "79bfc62acdf5e498",
                 ("digits", 30, 1): "1aebd5dd507aa940"}
SOLUTION_HOLDOUT_TRAIN = "08001ec42f11c2c3"  # mini_sudoku, holdout="solution", 60, seed 0
# fixed test sets keep their test split: test_examples(15, seed=0) and all_test_examples()
TEST_DIGESTS = {"gsm8k": ("8d93dc2d8ed2e7f1", "095e9c7019105050"), "math500": ("2169232fc0a9ce96", "403b7c31702546a2"),
                "sudoku4x4": ("f506523b2dbb8d1f", "0917d62f079f1194"),
                "countdown_file": ("3397c482450d0355", "4fca046676814397"),
                "mbpp": ("d25c424d02bc19c6", "c1734d2201456d44"), "humaneval": ("69f7fb04d7d33eaa", None),
                "digits": ("996d68491947c3c9", None)}


@pytest.mark.parametrize("name,n,seed", sorted(TRAIN_DIGESTS))
def test_train_streams_are_the_ones_the_checkpoints_were_trained_on(name, n, seed):
    got = digest(make_task(name, Path(".")).train_examples(n, seed))
    assert got == TRAIN_DIGESTS[(name, n, seed)], "a train stream changed: the shipped checkpoints need re-pretraining"
    assert digest(get_task("mini_sudoku", holdout="solution").train_examples(60, 0)) == SOLUTION_HOLDOUT_TRAIN


@pytest.mark.parametrize("name", sorted(TEST_DIGESTS))
def test_fixed_test_sets_are_unchanged(name, tmp_path):
    task = make_task(name, tmp_path)
    sample, whole = TEST_DIGESTS[name]
    assert digest(task.test_examples(15, seed=0)) == sample
    if whole is not None:
        assert digest(task.all_test_examples()) == whole


# --------------------------------------------------------------------------- file tasks


@pytest.mark.parametrize("name", ["gsm8k", "math500", "sudoku4x4", "countdown_file"])
def test_file_dev_is_held_out_of_the_train_rows_never_the_test_file(name, tmp_path):
    task = make_task(name, tmp_path)
    whole_train = make_task(name, tmp_path, dev_fraction=0.0)  # every train row trains, as in the papers
    train = {identity(task, e) for e in task.train_examples(1000)}
    dev = {identity(task, e) for e in task.dev_examples(1000)}
    test = {identity(task, e) for e in task.all_test_examples()}
    assert train | dev == {identity(task, e) for e in whole_train.train_examples(1000)} and not train & dev
    assert 5 <= len(dev) <= 40  # ~10% (the default dev_fraction) of ~200 train rows
    assert all(is_dev_key(k, 0.1) for k in dev) and not dev & test
    with pytest.raises(ValueError, match="dev_fraction=0.1"):
        whole_train.dev_examples(4)


def test_a_test_only_file_has_no_dev_split(tmp_path):
    task = get_task("gsm8k", test_path=_jsonl(tmp_path / "t.jsonl", _gsm8k(0, 10)))
    with pytest.raises(ValueError, match="no dev split.*train_path="):
        task.dev_examples(4)
    with pytest.raises(ValueError, match=r"dev_fraction must be in \[0, 1\)"):
        get_task("gsm8k", test_path=str(tmp_path / "t.jsonl"), dev_fraction=1.0)


def test_one_hashed_file_gives_three_splits(tmp_path):
    path = _jsonl(tmp_path / "all.jsonl", _gsm8k(0, 300))
    task = get_task("gsm8k", path=path, split="hash")
    keys = {s: {e["question"] for e in task.examples(s, 1000)} for s in SPLITS}
    assert set().union(*keys.values()) == {r["question"] for r in _gsm8k(0, 300)}
    assert sum(map(len, keys.values())) == 300 and all(keys.values())


def test_mbpp_dev_is_its_validation_split(tmp_path):
    task = make_task("mbpp", tmp_path)
    assert {e["task_id"] for e in task.dev_examples(100)} == set(range(511, 531))
    assert {e["task_id"] for e in task.train_examples(200)} == {*range(1, 5), *range(601, 661)}
    assert {e["task_id"] for e in task.test_examples(100)} == set(range(11, 31))
    with pytest.raises(ValueError, match="validation split"):
        make_task("mbpp", tmp_path, dev_fraction=0.2)


def test_presets_prompt_dev_as_they_prompt_test(tmp_path):
    from ddrl.tasks.base import ChatPrompt
    from ddrl.tasks.presets import Preset

    task = make_task("gsm8k", tmp_path)
    task.preset = Preset("toy", "gsm8k", prompt=lambda ex: "train: " + ex["question"], reward=lambda c, **_: [0.0],
                         metric=lambda c, **_: [0.0], eval_prompt=lambda ex: ChatPrompt(ex["question"], prefill="<r>"))
    assert all(isinstance(e["prompt"], ChatPrompt) for e in task.dev_examples(5))
    assert all(e["prompt"].startswith("train: ") for e in task.train_examples(5))


# --------------------------------------------------------------------------- special cases


def test_digits_dev_and_test_are_balanced_draws_of_the_ten_classes():
    task = get_task("digits")
    dev, test = task.dev_examples(50, seed=0), task.test_examples(50, seed=0)
    assert sorted(e["label"] for e in dev) == sorted(e["label"] for e in test) == sorted(list(range(10)) * 5)
    assert [e["label"] for e in dev] != [e["label"] for e in test]  # other seeds; prompts are shared by nature


def test_humaneval_is_test_only():
    task = get_task("humaneval")
    assert len(task.test_examples(1000)) == 164
    for split in ("train", "dev"):
        with pytest.raises(ValueError, match="test-only"):
            task.examples(split, 4)


def test_function_task_dev_is_given_or_asked_for():
    reward = lambda completions, **_: [0.0] * len(completions)  # noqa: E731
    rows = [{"prompt": f"p{i}"} for i in range(60)]
    plain = FunctionTask("toy", reward, train_examples=rows, test_examples=[{"prompt": "p0"}])
    with pytest.raises(ValueError, match="no dev split.*dev_examples=.*dev_fraction="):
        plain.dev_examples(4)
    given = FunctionTask("toy", reward, train_examples=rows, dev_examples=[{"prompt": "p1"}, {"prompt": "p0"}],
                         test_examples=[{"prompt": "p0"}])
    assert [e["prompt"] for e in given.dev_examples(5)] == ["p1"]  # test stays sealed: p0 is test only
    assert {"p0", "p1"}.isdisjoint(e["prompt"] for e in given.train_examples(100))
    carved = FunctionTask("toy", reward, train_examples=rows, dev_fraction=0.2)
    dev = {e["prompt"] for e in carved.dev_examples(60)}
    assert dev and dev.isdisjoint(e["prompt"] for e in carved.train_examples(200))
    assert dev | {e["prompt"] for e in carved.train_examples(200)} == {r["prompt"] for r in rows}
    with pytest.raises(ValueError, match="not both"):
        FunctionTask("toy", reward, train_examples=rows, dev_examples=rows[:1], dev_fraction=0.1)


# --------------------------------------------------------------------------- clusters


def test_sudoku_clusters_are_solution_grids_and_others_are_independent(tmp_path):
    for name in ("mini_sudoku", "sudoku4x4"):
        task = make_task(name, tmp_path)
        ex = task.test_examples(3)[0]
        assert task.cluster_key(ex) == ex["solution"]
    for name in ("countdown", "digits", "gsm8k", "mbpp"):
        task = make_task(name, tmp_path)
        assert task.cluster_key(task.test_examples(2)[0]) is None


def test_solution_holdout_grids_per_split():
    # the counts ddrl/tasks/sudoku.py quotes: with holdout="solution" dev and test see grids train never saw
    grids = all_4x4_grids()
    assert len(grids) == 288
    task = get_task("mini_sudoku", holdout="solution")
    buckets = {s: {g for g in grids if held_out_split(g, task.test_fraction) == s} for s in SPLITS}
    assert {s: len(b) for s, b in buckets.items()} == {"train": 265, "dev": 10, "test": 13}
    for split in SPLITS:
        assert {task.cluster_key(e) for e in task.examples(split, 16)} <= buckets[split]


def test_split_and_cluster_helpers_take_duck_typed_tasks():
    from ddrl.tasks.base import cluster_keys, split_examples

    class Bare:  # a user's task without the Task base (load_task accepts it): no dev, no clusters
        name = "bare"

        def train_examples(self, n, seed=0):
            return [{"prompt": "t"}] * n

        def test_examples(self, n, seed=0):
            return [{"prompt": "x"}] * n

    assert split_examples(Bare(), "test", 2) == [{"prompt": "x"}] * 2
    with pytest.raises(ValueError, match="no dev split: implement dev_examples"):
        split_examples(Bare(), "dev", 2)
    assert cluster_keys(Bare(), Bare().test_examples(3)) is None
    sudoku = get_task("mini_sudoku")
    examples = sudoku.test_examples(6)
    keys = cluster_keys(sudoku, examples)
    assert len(keys) == 6 and len(set(keys)) == len({e["solution"] for e in examples})
