"""Tasks that read the papers' data files, in the formats they ship, and the `preset=` argument.

Every file here is written by the test in the exact format of the papers' data (d1 @ 837888f,
also shipped by SPG, ESPO and GDSD; the hub sets their data_utils.py load):
- GSM8K jsonl: {"question", "answer": "... #### 42"} (openai/gsm8k);
- MATH jsonl: {"problem", "solution", "answer"} (HuggingFaceH4/MATH-500) or {"problem", "solution"};
- Countdown: d1's dataset/countdown_cd3_test.jsonl rows {"input": "30,100,93", "output": "23"}, and
  the hub set's {"nums": [...], "target": 23} (Jiayi-Pan/Countdown-Tasks-3to4);
- Sudoku: d1's dataset/4x4_test_sudoku.csv, header "Puzzle,Solution", 16-char strings, '0' = blank.
"""

from __future__ import annotations

import json
import sys

import pytest

from ddrl.tasks import get_task, presets
from ddrl.tasks.base import ChatPrompt
from ddrl.tasks.countdown import CountdownFileTask, CountdownTask
from ddrl.tasks.presets import Preset, register_preset
from ddrl.tasks.sudoku import MiniSudokuTask, Sudoku4x4Task


def columns_of(examples):
    return {k: [e[k] for e in examples] for k in examples[0] if k != "prompt"}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def gsm8k_rows(lo, hi):
    return [{"question": f"Ann has {i} pens and gets {i + 2} more. How many pens?",
             "answer": f"She has {i}+{i + 2} = {2 * i + 2} pens.\n#### {2 * i + 2}"} for i in range(lo, hi)]


# --------------------------------------------------------------------------- gsm8k / math500: splits


def test_gsm8k_train_and_test_files_are_the_splits(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", gsm8k_rows(0, 30))
    test = write_jsonl(tmp_path / "test.jsonl", gsm8k_rows(25, 45))  # 25..29 in both files
    task = get_task("gsm8k", train_path=train, test_path=test)
    test_ex = task.test_examples(1000)
    assert len(test_ex) == 20  # the whole test file, as the papers' tables report
    assert {e["question"] for e in test_ex} == {r["question"] for r in gsm8k_rows(25, 45)}
    train_q = {e["question"] for e in task.train_examples(100)}
    dev_q = {e["question"] for e in task.dev_examples(100)}  # dev: a hashed tenth of the train rows
    assert train_q | dev_q == {r["question"] for r in gsm8k_rows(0, 25)}  # overlap removed from train only
    ex = next(e for e in test_ex if e["question"].startswith("Ann has 30 "))
    assert ex["answer"] == "62" and set(ex) == {"prompt", "question", "answer"}


def test_a_single_path_is_the_test_file_not_a_hashed_tenth(tmp_path):
    path = write_jsonl(tmp_path / "gsm8k_test.jsonl", gsm8k_rows(0, 50))
    task = get_task("gsm8k", path=path)  # `ddrl eval --task-arg path=...`: every row is scored
    assert len(task.test_examples(1000)) == 50
    with pytest.raises(ValueError, match="train_path=.*split='hash'"):
        task.train_examples(4)  # training on a file named for evaluation must be asked for
    only_test = get_task("gsm8k", test_path=path)
    assert only_test.test_examples(1000) == task.test_examples(1000)
    with pytest.raises(ValueError, match="train_path"):
        only_test.train_examples(1)


@pytest.mark.parametrize("kwargs", [{"split": "hash"}, {"test_fraction": 0.1}, {"split": "hash", "test_fraction": 0.1}])
def test_hash_split_of_one_file_only_when_asked(tmp_path, kwargs):
    rows = gsm8k_rows(0, 200)
    task = get_task("gsm8k", path=write_jsonl(tmp_path / "all.jsonl", rows), **kwargs)
    test_q = {e["question"] for e in task.test_examples(1000)}
    train_q = {e["question"] for e in task.train_examples(1000)} | {e["question"] for e in task.dev_examples(1000)}
    assert test_q.isdisjoint(train_q) and test_q | train_q == {r["question"] for r in rows}
    assert 8 <= len(test_q) <= 35  # about 10% (the default test_fraction) of 200
    assert test_q == {e["question"] for e in get_task("gsm8k", path=str(tmp_path / "all.jsonl"),
                                                         split="hash").test_examples(1000)}


def test_split_arguments_that_contradict_fail_naming_the_fix(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", gsm8k_rows(0, 5))
    with pytest.raises(ValueError, match="exactly one data source.*train_path=.*test_path="):
        get_task("gsm8k")
    with pytest.raises(ValueError, match="exactly one data source"):
        get_task("gsm8k", path=path, train_path=path)
    with pytest.raises(ValueError, match="single path=FILE"):
        get_task("gsm8k", train_path=path, test_path=path, split="hash")
    with pytest.raises(ValueError, match="single path=FILE"):
        get_task("gsm8k", test_path=path, test_fraction=0.2)
    with pytest.raises(ValueError, match="test_fraction= needs split='hash'"):
        get_task("gsm8k", path=path, split="files", test_fraction=0.2)
    with pytest.raises(ValueError, match="split must be"):
        get_task("gsm8k", path=path, split="random")
    with pytest.raises(ValueError, match=r"test_fraction must be in \(0, 1\)"):
        get_task("gsm8k", path=path, split="hash", test_fraction=1.0)
    with pytest.raises(ValueError, match="no field 'question'.*question_field="):
        get_task("gsm8k", test_path=write_jsonl(tmp_path / "bad.jsonl", [{"q": "x", "answer": "1"}])).test_examples(1)


def test_missing_packages_name_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    task = get_task("gsm8k", dataset="openai/gsm8k", dataset_config="main")
    with pytest.raises(ImportError, match="pip install datasets"):
        task.test_examples(1)
    (tmp_path / "g.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match="pip install pyarrow"):
        get_task("gsm8k", test_path=str(tmp_path / "g.parquet")).test_examples(1)


def test_math500_reads_math_rows_answer_first_then_boxed_solution(tmp_path):
    h4 = [{"problem": "What is $1/2 + 1/4$?", "solution": "Sum: $\\boxed{\\frac{3}{4}}$.", "answer": "\\frac{3}{4}",
           "subject": "Prealgebra", "level": 2, "unique_id": "test/prealgebra/1.json"}]
    ankner = [{"problem": "Compute $2^3$.", "solution": "It is $2^3 = \\boxed{8}$."}]  # d1's train set: no answer
    task = get_task("math500", train_path=write_jsonl(tmp_path / "train.jsonl", ankner),
                    test_path=write_jsonl(tmp_path / "test.jsonl", h4))
    (test,), (train,) = task.test_examples(5), task.train_examples(1)
    assert (test["question"], test["answer"]) == (h4[0]["problem"], "\\frac{3}{4}")
    assert test["solution"] == h4[0]["solution"]  # kept for rewards that read the gold \boxed{} themselves
    assert (train["question"], train["answer"]) == (ankner[0]["problem"], "8")
    texts = ["<reasoning>\nadd\n</reasoning>\n<answer>\n\\frac{3}{4}\n</answer>", "<answer>0.5</answer>"]
    assert task.reward(texts, **columns_of([test, test])) == [2.5, 0.0]
    assert task.metric(texts, **columns_of([test, test])) == [1.0, 0.0]  # Task.metric: correct as 0/1


def test_math500_keeps_commas_that_are_not_thousands_separators(tmp_path):
    """Issue 23 item 2: an interval's commas survive loading; a whole number loses its separators,
    except with preset="d1", whose parser compares against MATH-500's answer as written."""
    rows = [{"problem": "Where is $\\log(2-\\log(x-2))$ defined?", "answer": "(2,12) \\cup (12,102)"},
            {"problem": "How many license plates?", "answer": "58,500"}]
    path = write_jsonl(tmp_path / "test.jsonl", rows)
    interval, plain_number, grouped = ("<answer>\\boxed{(2,12) \\cup (12,102)}</answer>", "<answer>\\boxed{58500}</answer>",
                                       "<answer>\\boxed{58,500}</answer>")
    own = get_task("math500", test_path=path)
    ex = own.all_test_examples()
    assert [e["answer"] for e in ex] == ["(2,12) \\cup (12,102)", "58500"]
    assert own.metric([interval, plain_number], **columns_of(ex)) == [1.0, 1.0]
    assert own.metric([grouped, interval], **columns_of(ex)) == [0.0, 0.0]
    d1 = get_task("math500", test_path=path, preset="d1")
    ex = d1.all_test_examples()
    assert [e["answer"] for e in ex] == ["(2,12) \\cup (12,102)", "58,500"]  # as the file writes it
    assert d1.metric([interval, plain_number], **columns_of(ex)) == [1.0, 0.0]  # d1's verdicts (math500 gen 128 #238)
    assert d1.metric([interval, grouped], **columns_of(ex)) == [1.0, 1.0]


def test_preset_reads_the_gsm8k_answer_as_written(tmp_path):
    """d1 trains GSM8K on the text after '####' as written: "1,000" is its gold, not "1000"."""
    row = {"question": "Two crates of 500?", "answer": "500 + 500 = 1000.\n#### 1,000"}
    task = get_task("gsm8k", test_path=write_jsonl(tmp_path / "test.jsonl", [row]), preset="d1")
    (ex,) = task.all_test_examples()
    assert ex["answer"] == row["answer"]
    texts = [f"<reasoning>\nadd\n</reasoning>\n<answer>\n{a}\n</answer>\n" for a in ("1,000", "1000")]
    parts = task.score(texts, **columns_of([ex, ex])).parts
    assert parts["correctness"] == [1.0, 0.0]  # d1: answer == extract_hash_answer(solution)


# --------------------------------------------------------------------------- countdown


D1_COUNTDOWN = [{"input": "49,55,53", "output": "51"}, {"input": "30,100,93", "output": "23"},
                {"input": "90,43,90", "output": "43"}]


def test_countdown_reads_d1s_jsonl_and_the_hub_rows(tmp_path):
    task = get_task("countdown", test_path=write_jsonl(tmp_path / "countdown_cd3_test.jsonl", D1_COUNTDOWN))
    assert isinstance(task, CountdownFileTask) and task.format == "chat" and task.use_all
    examples = task.test_examples(100)
    assert sorted((e["numbers"], e["target"]) for e in examples) == [
        ([30, 100, 93], 23), ([49, 55, 53], 51), ([90, 43, 90], 43)]
    assert all(set(e) == {"prompt", "numbers", "target"} for e in examples)
    hub = [{"target": 51, "nums": [49, 55, 53]}, {"target": 7, "nums": [1, 2, 4]}]
    hub_task = get_task("countdown", train_path=write_jsonl(tmp_path / "train.jsonl", hub),
                        test_path=str(tmp_path / "countdown_cd3_test.jsonl"))
    train = [(e["numbers"], e["target"]) for e in hub_task.train_examples(3)]
    assert train == [([1, 2, 4], 7)] * 3  # 49,55,53 -> 51 is a test problem: not trained on
    with pytest.raises(ValueError, match="'input'.*'output'"):
        get_task("countdown", test_path=write_jsonl(tmp_path / "bad.jsonl", [{"x": 1}])).test_examples(1)
    assert isinstance(get_task("countdown"), CountdownTask) and get_task("countdown").format == "compact"


def test_countdown_chat_accepts_a_boxed_answer(tmp_path):
    task = get_task("countdown", test_path=write_jsonl(tmp_path / "cd.jsonl", D1_COUNTDOWN[:1]))
    # LLaDA-8B-Instruct's own answer (d1 eval_baselines, countdown 256 tokens, shard 0, item 0)
    real = ("Thus, the expression \\(49 + 55 - 53\\) meets the criteria.\n</reasoning>\n\n<answer>\n"
            "\\boxed{49 + 55 - 53}\n</answer><|eot_id|><|endoftext|>")
    texts = [real, "<answer>49 + 55 - 53</answer>", "<answer>\\boxed{55 - 53 + 49 = 51}</answer>",
             "no tags, so \\boxed{(55 - 53) + 49}", "<answer>\\boxed{55 \\times 53 - 49}</answer>",
             "<answer>\\boxed{49 + 55}</answer>", "<answer>\\boxed{49 + 55 + 53 - 106}</answer>",
             "<answer>\\boxed{}</answer>", "<reasoning>49 + 55 - 53</reasoning>"]
    cols = {"numbers": [[49, 55, 53]] * len(texts), "target": [51] * len(texts)}
    assert task.reward(texts, **cols) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    times = task.reward(["<answer>\\boxed{2 \\times 3 + 1}</answer>", "<answer>$8 \\div 2 \\cdot 3$</answer>"],
                        numbers=[[2, 3, 1], [8, 2, 3]], target=[7, 12])
    assert times == [1.0, 1.0]
    generated = get_task("countdown", format="chat")  # the generator's chat format reads it too
    assert generated.reward([real], numbers=[[49, 55, 53]], target=[51]) == [1.0]


# --------------------------------------------------------------------------- sudoku4x4

SUDOKU_CSV = "Puzzle,Solution\n3102200002100320,3142243142131324\n0140432014020000,2143432114323214\n"


def test_sudoku4x4_reads_d1s_csv_strings_with_leading_zeros(tmp_path):
    (tmp_path / "4x4_test_sudoku.csv").write_text(SUDOKU_CSV)
    (tmp_path / "4x4_sudoku_unique_puzzles.csv").write_text(
        "Puzzle,Solution\n0140432014020000,2143432114323214\n1000020000300004,1342421324313124\n")
    task = get_task("sudoku4x4", train_path=str(tmp_path / "4x4_sudoku_unique_puzzles.csv"),
                    test_path=str(tmp_path / "4x4_test_sudoku.csv"))
    assert isinstance(task, Sudoku4x4Task) and task.format == "chat"
    test = sorted(task.test_examples(10), key=lambda e: e["puzzle"])
    assert [(e["puzzle"], e["solution"]) for e in test] == [("0140432014020000", "2143432114323214"),
                                                            ("3102200002100320", "3142243142131324")]
    assert [e["puzzle"] for e in task.train_examples(2)] == ["1000020000300004"] * 2  # the shared puzzle is test
    assert "0140432014020000" in test[0]["prompt"] and set(test[0]) == {"prompt", "puzzle", "solution"}
    # a tool that stored the grids as integers dropped the leading zero: a number is padded back
    ints = write_jsonl(tmp_path / "ints.jsonl", [{"Puzzle": 140432014020000, "Solution": 2143432114323214}])
    padded = get_task("sudoku4x4", test_path=ints).test_examples(1)[0]
    assert padded["puzzle"] == test[0]["puzzle"]
    for bad in ("Puzzle,Solution\n01404320140200,2143432114323214\n", "Puzzle,Answer\n0140432014020000,1\n"):
        (tmp_path / "bad.csv").write_text(bad)
        with pytest.raises(ValueError, match="16 characters|columns Puzzle and Solution"):
            get_task("sudoku4x4", test_path=str(tmp_path / "bad.csv")).test_examples(1)


@pytest.mark.parametrize("row, error", [
    ("140432014020000,2143432114323214", r"record 2 \(line 3\): Puzzle must be 16 characters.*got '140432014020000' "
                                         r"\(15 characters\).*dropped its leading '0'"),
    ("0140432014020000,214343211432321", r"record 2 \(line 3\): Solution must be 16 characters"),
    ("1140432014020000,2143432114323214", r"record 2 \(line 3\): Puzzle '1140432014020000' contradicts its Solution "
                                          r"'2143432114323214' at row 1 column 1 \(1 vs 2\)"),
    ("0000000000000000,1111111111111111", r"record 2 \(line 3\): Solution '1111111111111111' is not a solved 4x4"),
    ("0140432014020000,3142243142131324", r"record 2 \(line 3\): Puzzle '0140432014020000' contradicts"),
])
def test_sudoku4x4_rows_that_are_wrong_fail_naming_the_record(tmp_path, row, error):
    """A wrong-length grid is not padded (it would move every given) and a solution must be a solved
    grid that keeps the puzzle's givens: the error names the file, record and line."""
    (tmp_path / "t.csv").write_text(SUDOKU_CSV.splitlines()[0] + "\n" + SUDOKU_CSV.splitlines()[1] + "\n" + row + "\n")
    with pytest.raises(ValueError, match=f"t.csv {error}"):
        get_task("sudoku4x4", test_path=str(tmp_path / "t.csv")).test_examples(1)


def test_record_numbers_count_from_one_in_every_format(tmp_path):
    good = gsm8k_rows(0, 2)
    jsonl = tmp_path / "g.jsonl"  # a blank line: record 3 is on line 4
    jsonl.write_text(json.dumps(good[0]) + "\n\n" + json.dumps(good[1]) + "\n" + json.dumps({"q": "x"}) + "\n")
    (tmp_path / "g.json").write_text(json.dumps([good[0], {"q": "x"}]))
    (tmp_path / "g.csv").write_text("question,answer\nWhat is 1+1?,#### 2\n")
    (tmp_path / "syntax.jsonl").write_text(json.dumps(good[0]) + "\n{oops\n")
    (tmp_path / "list.jsonl").write_text(json.dumps(good[0]) + "\n[1, 2]\n")
    for path, where in ((jsonl, r"record 3 \(line 4\)"), (tmp_path / "g.json", "record 2")):
        with pytest.raises(ValueError, match=f"{path.name} {where}: no field 'question'"):
            get_task("gsm8k", test_path=str(path)).test_examples(1)
    with pytest.raises(ValueError, match=r"g.csv record 1 \(line 2\): no field 'problem'"):
        get_task("math500", test_path=str(tmp_path / "g.csv")).test_examples(1)
    with pytest.raises(ValueError, match="syntax.jsonl: line 2 is not valid JSON"):
        get_task("gsm8k", test_path=str(tmp_path / "syntax.jsonl")).test_examples(1)
    with pytest.raises(ValueError, match=r"list.jsonl record 2 \(line 2\): every record must be a JSON object"):
        get_task("gsm8k", test_path=str(tmp_path / "list.jsonl")).test_examples(1)


def test_the_same_file_as_train_and_test_says_the_overlap_is_the_cause(tmp_path):
    """d1 ships only test files, so a user names one file twice: every train row is a test row."""
    path = write_jsonl(tmp_path / "gsm8k_test.jsonl", gsm8k_rows(0, 20))
    task = get_task("gsm8k", train_path=path, test_path=path)
    with pytest.raises(ValueError, match=r"all 20 train rows are also test rows \(train_path and test_path name the "
                                         r"same file\).*separate train file.*dev_fraction=0.1.*split=hash") as e:
        task.train_examples(4)
    assert "larger train file" not in str(e.value)
    # a train file that is not the test file but holds only test rows: the same cause, without "same file"
    copy = write_jsonl(tmp_path / "copy.jsonl", gsm8k_rows(5, 10))
    with pytest.raises(ValueError, match=r"all 5 train rows are also test rows, and ddrl never trains"):
        get_task("gsm8k", train_path=copy, test_path=path).train_examples(4)
    # the fix it names works: one file split by hash trains on the rows that are not test
    split = get_task("gsm8k", path=path, split="hash")
    assert split.train_examples(4) and split.test_examples(100)


def test_sudoku4x4_reward_is_the_fraction_of_blanks_correct(tmp_path):
    (tmp_path / "t.csv").write_text(SUDOKU_CSV)
    task = get_task("sudoku4x4", test_path=str(tmp_path / "t.csv"))
    puzzle, solution = "3102200002100320", "3142243142131324"  # 8 blanks: cells 2,5,6,7,8,11,12,15
    wrong2 = solution[:2] + "2" + solution[3:5] + "1" + solution[6:]  # blanks 2 and 5 wrong
    texts = [f"<reasoning>x</reasoning>\n<answer>\n{solution}\n</answer>",
             f"<answer>{wrong2}</answer>",
             "<answer>\n3 1 4 2\n2 4 3 1\n4 2 1 3\n1 3 2 4\n</answer>",  # separators dropped
             f"<answer>{solution[:8]}</answer>",  # padded with '0': blanks 2,5,6,7 right, 8,11,12,15 not
             f"<answer>{puzzle}</answer>",  # the givens only: no blank filled
             solution,  # no <answer> tag
             f"<answer>{'4' * 16}</answer>"]  # givens are not checked (d1's rule): blanks 2,5,8,15 are 4
    cols = {"puzzle": [puzzle] * len(texts), "solution": [solution] * len(texts)}
    expected = [1.0, 0.75, 1.0, 0.5, 0.0, 0.0, 0.5]
    assert task.reward(texts, **cols) == expected
    assert task.metric(texts, **cols) == expected  # accuracy = correct cells / blank cells
    assert task.correct(texts, **cols) == [True, False, True, False, False, False, False]


def test_mini_sudoku_is_still_the_generator():
    task = get_task("mini_sudoku")
    assert type(task) is MiniSudokuTask and task.format == "compact" and "." in task.train_examples(1)[0]["puzzle"]


# --------------------------------------------------------------------------- preset=


@pytest.fixture
def test_presets(monkeypatch):
    """A paper 'testpaper' with presets for gsm8k, countdown and sudoku4x4, registered for this test only."""
    presets._load_all()  # register the shipped presets first, so the snapshot restored afterwards holds them
    monkeypatch.setattr(presets, "_PRESETS", dict(presets._PRESETS))
    calls = []

    def prompt(ex):
        return ChatPrompt(user=f"TRAIN {ex.get('question') or ex.get('puzzle') or ex['target']}", system="sys")

    def eval_prompt(ex):
        return ChatPrompt(user=f"EVAL {ex.get('question') or ex.get('puzzle') or ex['target']}", prefill="<reasoning>")

    def reward(completions, **columns):
        calls.append(sorted(columns))
        return [0.1 * len(c) for c in completions]

    def metric(completions, **columns):
        return [1.0 if c == "yes" else 0.25 for c in completions]

    for task in ("gsm8k", "countdown", "sudoku4x4"):
        register_preset(Preset("testpaper", task, prompt, reward, metric, eval_prompt=eval_prompt, source="test"))
    return calls


def test_preset_supplies_prompt_reward_and_metric(tmp_path, test_presets):
    train = write_jsonl(tmp_path / "train.jsonl", gsm8k_rows(0, 3))
    test = write_jsonl(tmp_path / "test.jsonl", gsm8k_rows(10, 12))
    plain = get_task("gsm8k", train_path=train, test_path=test)
    task = get_task("gsm8k", train_path=train, test_path=test, preset="testpaper")
    tr, te = task.train_examples(2), task.test_examples(2)
    assert all(e["prompt"] == ChatPrompt(user=f"TRAIN {e['question']}", system="sys") for e in tr)
    assert all(e["prompt"] == ChatPrompt(user=f"EVAL {e['question']}", prefill="<reasoning>") for e in te)
    # the same examples, except that a preset gets the answer as the file writes it (its paper parses it)
    by_question = {r["question"]: r["answer"] for r in gsm8k_rows(10, 12)}
    assert [{**{k: v for k, v in e.items() if k != "prompt"}, "answer": by_question[e["question"]]}
            for e in plain.test_examples(2)] == [{k: v for k, v in e.items() if k != "prompt"} for e in te]
    texts, cols = ["yes", "no!"], columns_of(te)
    assert task.reward(texts, **cols) == pytest.approx([0.3, 0.3]) and test_presets[-1] == ["answer", "question"]
    assert task.metric(texts, **cols) == [1.0, 0.25]
    assert task.correct(texts, **cols) == [True, False]  # success = metric 1
    assert plain.reward(texts, **cols) == [0.0, 0.0] and plain.metric(texts, **cols) == [0.0, 0.0]
    assert isinstance(plain.test_examples(1)[0]["prompt"], str)


def test_preset_on_countdown_and_sudoku(tmp_path, test_presets):
    cd = get_task("countdown", test_path=write_jsonl(tmp_path / "cd.jsonl", D1_COUNTDOWN), preset="testpaper")
    assert cd.test_examples(1)[0]["prompt"].user.startswith("EVAL ")
    assert cd.metric(["yes"], numbers=[[49, 55, 53]], target=[51]) == [1.0]
    gen = get_task("countdown", preset="testpaper")  # the generator with a paper's (chat) prompt
    assert gen.format == "chat" and gen.train_examples(1)[0]["prompt"].user.startswith("TRAIN ")
    assert gen.reward(["abcd"], numbers=[[1, 2]], target=[3]) == pytest.approx([0.4])
    with pytest.raises(ValueError, match="needs format='chat'"):
        get_task("countdown", preset="testpaper", format="compact")
    (tmp_path / "s.csv").write_text(SUDOKU_CSV)
    sd = get_task("sudoku4x4", test_path=str(tmp_path / "s.csv"), preset="testpaper")
    ex = sd.test_examples(1)[0]
    assert ex["prompt"] == ChatPrompt(user=f"EVAL {ex['puzzle']}", prefill="<reasoning>")
    assert sd.metric(["no", "yes"], **columns_of([ex, ex])) == [0.25, 1.0]
    assert sd.correct(["no", "yes"], **columns_of([ex, ex])) == [False, True]


def test_unknown_preset_fails_listing_the_available_ones(tmp_path, test_presets):
    with pytest.raises(ValueError, match="no preset 'nopaper' for task 'gsm8k'.*testpaper/gsm8k"):
        get_task("gsm8k", test_path=write_jsonl(tmp_path / "g.jsonl", gsm8k_rows(0, 2)), preset="nopaper")
    with pytest.raises(ValueError, match="no preset 'testpaper' for task 'math500'"):
        get_task("math500", test_path=str(tmp_path / "g.jsonl"), question_field="question", preset="testpaper")


def test_training_on_one_file_twice_fails_before_the_model_loads(tmp_path):
    """The train rows are read and checked before the model: the overlap error, not a model error."""
    from ddrl.config import RLConfig, load_config
    from ddrl.training.trainer import Trainer

    path = write_jsonl(tmp_path / "gsm8k_test.jsonl", gsm8k_rows(0, 10))
    cfg = load_config({"model": {"path": str(tmp_path / "no-model-here")}, "output_dir": str(tmp_path / "run"),
                       "task": {"name": "gsm8k", "args": {"train_path": path, "test_path": path}}}, cls=RLConfig)
    with pytest.raises(ValueError, match="all 10 train rows are also test rows"):
        Trainer(cfg)
