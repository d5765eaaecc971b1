"""Built-in tasks: determinism, held-out splits, gold answers score full marks, compact encodability."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

import ddrl
from ddrl.registry import TASKS, RegistryError
from ddrl.tasks import get_task, is_test_key
from ddrl.tasks.sudoku import is_valid_solution
from ddrl.tasks.user import FunctionTask, load_task


def columns_of(examples):
    return {k: [ex[k] for ex in examples] for k in examples[0] if k != "prompt"}


def encodable(text: str, symbols: list[str]) -> bool:
    """Greedy longest match, as ddrl.models.SymbolTokenizer splits text."""
    lengths = sorted({len(s) for s in symbols}, reverse=True)
    known, i = set(symbols), 0
    while i < len(text):
        n = next((n for n in lengths if text[i:i + n] in known and len(text[i:i + n]) == n), None)
        if n is None:
            return False
        i += n
    return True


# --------------------------------------------------------------------------- registry / loading


def test_builtin_tasks_are_registered():
    for name in ("mini_sudoku", "sudoku", "countdown", "gsm_symbolic", "gsm8k", "math500", "digits"):
        assert name in TASKS


def test_unknown_task_lists_valid_names():
    with pytest.raises(RegistryError, match="mini_sudoku"):
        get_task("mini_sudokuu")


def test_get_task_is_exported_at_top_level():
    assert ddrl.get_task("mini_sudoku").name == "mini_sudoku"


def test_load_task_from_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_user_tasks.py").write_text(textwrap.dedent("""
        from ddrl.tasks.user import FunctionTask

        def make(k=1):
            return FunctionTask("mine", lambda cs, **_: [float(len(c) == k) for c in cs],
                                train_examples=[{"prompt": "a"}], test_examples=[{"prompt": "b"}])

        not_a_task = lambda: 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    task = load_task("my_user_tasks:make", k=2)
    assert task.name == "mine" and task.reward(["xy", "x"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="no attribute"):
        load_task("my_user_tasks:missing")
    with pytest.raises(ValueError, match="cannot import"):
        load_task("no_such_module_xyz:make")
    with pytest.raises(TypeError, match="lacks"):
        load_task("my_user_tasks:not_a_task")
    sys.modules.pop("my_user_tasks", None)


@pytest.mark.parametrize("name,fmt", [("gsm_symbolic", "compact"), ("digits", "chat"), ("mini_sudoku", "html")])
def test_unsupported_format_is_a_clear_error(name, fmt):
    with pytest.raises(ValueError, match="supported"):
        get_task(name, format=fmt)


# --------------------------------------------------------------------------- procedural tasks


PROCEDURAL = [("mini_sudoku", {}, 40), ("sudoku", {"min_empty": 30, "max_empty": 40}, 4), ("countdown", {}, 16),
              ("gsm_symbolic", {}, 40)]


@pytest.mark.parametrize("name,kwargs,n", PROCEDURAL)
def test_examples_are_deterministic_in_seed(name, kwargs, n):
    a, b = get_task(name, **kwargs), get_task(name, **kwargs)  # separate instances: no shared cache
    assert a.train_examples(n, seed=0) == b.train_examples(n, seed=0)
    assert a.test_examples(n // 2, seed=0) == b.test_examples(n // 2, seed=0)
    assert a.train_examples(n, seed=1) != a.train_examples(n, seed=0)
    assert a.train_examples(n // 2, seed=0) == a.train_examples(n, seed=0)[: n // 2]  # one stream per seed
    first = a.train_examples(n, seed=0)
    first[0]["prompt"] = "mutated"
    assert a.train_examples(n, seed=0)[0]["prompt"] != "mutated"


@pytest.mark.parametrize("name,kwargs,n", PROCEDURAL)
def test_test_split_is_disjoint_from_every_train_split(name, kwargs, n):
    task = get_task(name, **kwargs)
    key = task._split_key
    train = task.train_examples(n, seed=0) + task.train_examples(n, seed=1)
    test = task.test_examples(n // 2, seed=0) + task.test_examples(n // 2, seed=3)
    assert train and test
    assert {key(e) for e in train}.isdisjoint({key(e) for e in test})
    # the property behind it, which holds for train splits of any seed and size:
    assert all(is_test_key(key(e), task.test_fraction) for e in test)
    assert not any(is_test_key(key(e), task.test_fraction) for e in train)


def test_mini_sudoku_holdout_by_solution_keeps_grids_apart():
    task = get_task("mini_sudoku", holdout="solution")
    train = {e["solution"] for e in task.train_examples(300, seed=0)}
    test = {e["solution"] for e in task.test_examples(20, seed=0)}
    assert train.isdisjoint(test)


# --------------------------------------------------------------------------- sudoku


@pytest.mark.parametrize("name,size,kwargs", [("mini_sudoku", 4, {}),
                                              ("sudoku", 9, {"min_empty": 30, "max_empty": 35})])
def test_sudoku_compact_gold_is_solved_and_encodable(name, size, kwargs):
    task = get_task(name, **kwargs)
    examples = task.train_examples(3 if size == 9 else 30)
    assert task.gen_length == size * size
    assert task.symbols() == [str(d) for d in range(1, size + 1)] + ["."]
    lo, hi = task.min_empty, task.max_empty
    for ex in examples:
        assert ex["prompt"] == ex["puzzle"] and len(ex["puzzle"]) == size * size
        assert ex["puzzle"].count(".") <= hi and (size == 4 or ex["puzzle"].count(".") >= lo)
        assert is_valid_solution(ex["solution"], size)
        assert encodable(ex["prompt"], task.symbols()) and encodable(ex["solution"], task.symbols())
    pairs = task.pretrain_pairs(len(examples))
    assert [p["completion"] for p in pairs] == [e["solution"] for e in examples]
    assert task.reward([e["solution"] for e in examples], **columns_of(examples)) == [1.0] * len(examples)
    assert all(task.correct([e["solution"] for e in examples], **columns_of(examples)))


def _swap_two_blanks(puzzle: str, solution: str) -> str:
    blanks = [i for i, c in enumerate(puzzle) if c == "."]
    i, j = next((i, j) for i in blanks for j in blanks if solution[i] != solution[j])
    grid = list(solution)
    grid[i], grid[j] = grid[j], grid[i]
    return "".join(grid)


def test_sudoku_exact_and_partial_rewards():
    exact, partial = get_task("mini_sudoku"), get_task("mini_sudoku", reward="partial")
    ex = exact.train_examples(1)[0]
    puzzle, solution = ex["puzzle"], ex["solution"]
    blanks = puzzle.count(".")
    wrong = _swap_two_blanks(puzzle, solution)
    given = puzzle.index(next(c for c in puzzle if c != "."))
    contradicted = list(solution)
    contradicted[given] = str(int(solution[given]) % 4 + 1)
    contradicted = "".join(contradicted)
    cols = {"puzzle": [puzzle] * 6, "solution": [solution] * 6}
    texts = [solution, wrong, contradicted, solution[:-1], "x" * 16, " ".join(solution)]
    assert exact.reward(texts, **cols) == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert partial.reward(texts, **cols) == [1.0, (blanks - 2) / blanks, 0.0, 0.0, 0.0, 1.0]
    assert partial.correct(texts, **cols) == [True, False, False, False, False, True]


def test_sudoku_accepts_any_valid_solution_not_only_the_generators():
    task = get_task("mini_sudoku")
    other = "1234341221434321"
    assert is_valid_solution(other, 4)
    puzzle = "1..." + "." * 12  # under-constrained: many solutions
    cols = {"puzzle": [puzzle] * 2, "solution": ["1243341221344321"] * 2}  # the "generator's" solution differs
    assert task.reward([other, "2134341221434321"], **cols) == [1.0, 0.0]


def test_sudoku_chat_format():
    task = get_task("mini_sudoku", format="chat")
    ex = task.train_examples(1)[0]
    assert "<answer>" in ex["prompt"] and ex["puzzle"] not in ex["prompt"]  # the grid is shown row by row
    rows = "\n".join(" ".join(ex["solution"][r * 4:(r + 1) * 4]) for r in range(4))
    good = f"<reasoning>\nrows, columns, boxes\n</reasoning>\n<answer>\n{rows}\n</answer>"
    cols = columns_of([ex] * 3)
    assert task.reward([good, rows, "<answer>1 2</answer>"], **cols) == [1.0, 0.0, 0.0]
    with pytest.raises(NotImplementedError):
        task.pretrain_pairs(2)


# --------------------------------------------------------------------------- countdown


def test_countdown_gold_scores_one_and_fits_gen_length():
    task = get_task("countdown")
    examples = task.train_examples(60)
    gold = [p["completion"] for p in task.pretrain_pairs(60)]
    assert task.reward(gold, **columns_of(examples)) == [1.0] * 60
    assert max(map(len, gold)) <= task.gen_length <= 24
    for ex, g in zip(examples, gold):
        assert encodable(ex["prompt"], task.symbols()) and encodable(g, task.symbols())
        assert ex["prompt"].endswith(f"={ex['target']}")


def test_countdown_reward_rules():
    task = get_task("countdown")
    use_all = get_task("countdown", use_all=True)
    cols = {"numbers": [[3, 5, 7, 2]] * 13, "target": [16] * 13}
    texts = ["3+5+7+1",  # 16, but 1 is not a given number
             "(3+5)*2", "(3+5)*2=16", " (3 + 5) * 2 ", "3*5+7-2*3",  # 3 used twice
             "(7-5)*(3+5)", "16", "2**4", "__import__('os')", "3/(5+2-7)", "(3+5)*2=17", "3+5+7+2-1", "7*2+5-3"]
    expected = [0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    # "(7-5)*(3+5)" reuses 5; "3/(5+2-7)" divides by zero; "(3+5)*2=17" is scored on its left side
    assert task.reward(texts, **cols) == expected
    three = {k: v[:3] for k, v in cols.items()}
    assert use_all.reward(["(3+5)*2", "7*2+5-3", "(7+5+3)+2/2"], **three) == [0.0, 1.0, 0.0]
    exact = get_task("countdown").reward(["7/2*4+2"], numbers=[[7, 2, 4, 2]], target=[16])
    assert exact == [1.0]  # exact rational arithmetic: 7/2*4 = 14


def test_countdown_chat_reads_the_answer_tag():
    task = get_task("countdown", format="chat")
    ex = task.train_examples(1)[0]
    good = f"<reasoning>try</reasoning>\n<answer>{ex['expression']}</answer>"
    assert task.reward([good, ex["expression"]], **columns_of([ex, ex])) == [1.0, 0.0]


# --------------------------------------------------------------------------- math word problems


def test_gsm_symbolic_reward_and_correct():
    task = get_task("gsm_symbolic")
    examples = task.train_examples(3)
    cols = columns_of(examples)
    good = [f"<reasoning>\nwork\n</reasoning>\n<answer>\n{e['answer']}\n</answer>" for e in examples]
    wrong = [f"<reasoning>\nwork\n</reasoning>\n<answer>\n{e['answer']}1\n</answer>" for e in examples]
    bare = [f"The answer is {e['answer']}" for e in examples]
    assert task.reward(good, **cols) == [2.5] * 3
    assert task.score(good, **cols).parts == {"correctness": [1.0] * 3, "format": [1.0] * 3}
    assert task.reward(wrong, **cols) == [0.5] * 3
    assert task.reward(bare, **cols) == [2.0] * 3
    tripled = {k: v * 3 for k, v in cols.items()}
    assert task.correct(good + wrong + bare, **tripled) == [True] * 3 + [False] * 3 + [True] * 3


def _write_gsm8k(path, n=40, offset=0):
    rows = [{"question": f"Tom has {i} apples and buys {i + 1} more. How many?",
             "answer": f"{i}+{i + 1}\n#### {2 * i + 1:,}"} for i in range(offset, offset + n)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return rows


def test_gsm8k_from_one_file_is_split_by_question(tmp_path):
    rows = _write_gsm8k(tmp_path / "gsm8k.jsonl", n=60, offset=995)  # answers up to 2,109: thousands commas
    task = get_task("gsm8k", path=str(tmp_path / "gsm8k.jsonl"), test_fraction=0.3)
    train_q = {e["question"] for e in task.train_examples(100)}
    dev_q = {e["question"] for e in task.dev_examples(100)}  # held out of the train side
    test = task.test_examples(100)
    test_q = {e["question"] for e in test}
    assert train_q.isdisjoint(test_q) and dev_q.isdisjoint(train_q | test_q) and test_q
    assert train_q | dev_q | test_q == {r["question"] for r in rows}
    assert len(test) == len(test_q)  # test examples are distinct, at most all of them
    assert task.test_examples(5, seed=1) == get_task("gsm8k", path=str(tmp_path / "gsm8k.jsonl"),
                                                     test_fraction=0.3).test_examples(5, seed=1)
    ex = test[0]
    i = int(ex["question"].split()[2])
    assert ex["answer"] == str(2 * i + 1)  # "#### 1,991" -> "1991"
    good = f"<reasoning>\nadd\n</reasoning>\n<answer>\n{2 * i + 1:,}\n</answer>"
    assert task.reward([good], answer=[ex["answer"]]) == [2.5]
    assert task.reward(["<reasoning>\nadd\n</reasoning>\n<answer>\n-5\n</answer>"], answer=[ex["answer"]]) == [0.5]
    assert task.gen_length == 256 and task.format == "chat"


def test_gsm8k_train_and_test_files_never_share_a_question(tmp_path):
    _write_gsm8k(tmp_path / "train.jsonl", n=30, offset=0)
    _write_gsm8k(tmp_path / "test.jsonl", n=10, offset=25)  # questions 25..29 are in both files
    task = get_task("gsm8k", train_path=str(tmp_path / "train.jsonl"), test_path=str(tmp_path / "test.jsonl"))
    train_q = {e["question"] for e in task.train_examples(30)}
    dev_q = {e["question"] for e in task.dev_examples(30)}  # dev is held out of the train rows
    assert len(train_q | dev_q) == 25 and not train_q & dev_q
    assert (train_q | dev_q).isdisjoint({e["question"] for e in task.test_examples(50)})
    assert len(task.train_examples(70)) == 70  # cycles through epochs


def test_math_file_task_errors_are_actionable(tmp_path):
    with pytest.raises(ValueError, match="data source"):
        get_task("gsm8k")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"q": "x", "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match="question_field"):
        get_task("gsm8k", path=str(tmp_path / "bad.jsonl")).test_examples(1)
    with pytest.raises(ValueError, match="does not exist"):
        get_task("gsm8k", path=str(tmp_path / "missing.jsonl")).test_examples(1)


def test_math500_uses_boxed_solution_and_equivalent_forms(tmp_path):
    rows = [{"problem": f"Problem {i}: compute half.", "solution": f"It is \\boxed{{\\frac{{1}}{{2}}}} for {i}."}
            for i in range(30)]
    (tmp_path / "math.json").write_text(json.dumps(rows))
    task = get_task("math500", path=str(tmp_path / "math.json"), test_fraction=0.5)
    ex = task.test_examples(1)[0]
    assert ex["answer"] == "\\frac{1}{2}"
    texts = ["<reasoning>\nhalf\n</reasoning>\n<answer>\n0.5\n</answer>", "so \\boxed{1/2}", "<answer>0.25</answer>"]
    assert task.reward(texts, answer=[ex["answer"]] * 3) == [2.5, 2.0, 0.0]


def test_parquet_files_load_when_pyarrow_is_installed(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"question": f"q{i}", "answer": f"#### {i}"} for i in range(20)]),
                   tmp_path / "g.parquet")
    task = get_task("gsm8k", path=str(tmp_path / "g.parquet"), test_fraction=0.5)
    train_q = {e["question"] for e in task.train_examples(40)} | {e["question"] for e in task.dev_examples(40)}
    assert len(task.test_examples(20)) + len(train_q) == 20


# --------------------------------------------------------------------------- digits


def test_digits_symbols_and_gold_pairs():
    task = get_task("digits")
    symbols = task.symbols()
    assert len(symbols) == 27 and symbols[:10] == [f"<c{d}>" for d in range(10)]
    assert symbols[10:] == task.uniform_symbols and len(task.uniform_symbols) == 17  # a contiguous run
    pairs = task.pretrain_pairs(50, seed=0)
    assert pairs == task.pretrain_pairs(50, seed=0) and pairs != task.pretrain_pairs(50, seed=1)
    for p in pairs:
        assert p["prompt"] in symbols[:10] and len(p["completion"]) == task.gen_length == 64
        assert encodable(p["prompt"], symbols) and set(p["completion"]) <= set(task.uniform_symbols)


def test_digits_gold_images_follow_their_prompt_and_wrong_labels_do_not():
    task = get_task("digits")
    pairs = task.pretrain_pairs(200, seed=0)
    images = [p["completion"] for p in pairs]
    labels = [int(p["prompt"][2]) for p in pairs]
    right = task.reward(images, label=labels)
    wrong = task.reward(images, label=[(y + 1) % 10 for y in labels])
    assert sum(right) / 200 > 0.8 and sum(wrong) / 200 < 0.05
    assert sum(task.correct(images, label=labels)) / 200 > 0.9
    assert task.reward(["a" * 63, "a" * 63 + "z", "a" * 65, ""], label=[1] * 4) == [0.0] * 4
    assert task.correct(["a" * 63], label=[1]) == [False]


def test_digits_test_prompts_are_balanced_and_deterministic():
    task = get_task("digits")
    test = task.test_examples(50, seed=0)
    assert test == task.test_examples(50, seed=0) and test != task.test_examples(50, seed=1)
    assert sorted(e["label"] for e in test) == sorted(list(range(10)) * 5)
    assert all(e["prompt"] == f"<c{e['label']}>" for e in test)


def test_digits_generator_split_never_feeds_the_classifier():
    import numpy as np

    from ddrl.rewards.image import digits_splits

    splits = digits_splits()
    sizes = {k: len(v[1]) for k, v in splits.items()}
    assert sum(sizes.values()) == 1797 and abs(sizes["generator"] - 1797 / 2) <= 1
    gen = {tuple(row) for row in splits["generator"][0]}
    pretrain = {tuple(ord(c) - ord("a") for c in p["completion"]) for p in get_task("digits").pretrain_pairs(2000)}
    assert pretrain <= gen
    for part in ("generator", "classifier_fit", "classifier_heldout"):  # stratified: every class in every part
        assert set(np.unique(splits[part][1])) == set(range(10))


# --------------------------------------------------------------------------- FunctionTask


def test_function_task_holds_out_test_prompts_and_shields_the_trainer():
    def reward(completions, answer, **_):
        if "boom" in completions:
            raise RuntimeError("user bug")
        return [float(c == a) for c, a in zip(completions, answer)]

    train = [{"prompt": f"p{i}", "answer": str(i)} for i in range(10)]
    test = [{"prompt": "p3", "answer": "3"}, {"prompt": "p11", "answer": "11"}]
    task = FunctionTask("toy", reward, train_examples=train, test_examples=test, gen_length=8)
    drawn = task.train_examples(25, seed=0)
    assert len(drawn) == 25 and "p3" not in {e["prompt"] for e in drawn}
    assert drawn == task.train_examples(25, seed=0) and drawn != task.train_examples(25, seed=1)
    assert sorted(e["prompt"] for e in task.test_examples(10)) == ["p11", "p3"]
    assert task.reward(["3", "4"], answer=["3", "3"]) == [1.0, 0.0]
    assert task.reward(["boom", "3"], answer=["3", "3"]) == [None, None]  # invalid, not 0.0 (test_user_rewards.py)
    assert task.correct(["3"], answer=["3"]) == [True]
    with pytest.raises(NotImplementedError):
        task.symbols()
