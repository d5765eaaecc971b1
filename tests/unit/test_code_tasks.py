"""code_reward and the humaneval / mbpp tasks: gold solutions score 1, wrong ones and exploits 0."""

from __future__ import annotations

import json
import time

import pytest

from ddrl.registry import TASKS
from ddrl.rewards import sandbox
from ddrl.rewards.code import build_solution, code_reward, extract_code, score_output
from ddrl.tasks.code_tasks import HumanEvalTask, MbppTask, load_humaneval_problems


@pytest.fixture
def require_sandbox():
    """Containment is the feature: where bwrap cannot start, these tests fail and say why."""
    assert sandbox.sandbox_available(), f"no sandbox on this machine: {sandbox.sandbox_reason()}"


needs_sandbox = pytest.mark.usefixtures("require_sandbox")

# 0: plain; 38: the prompt defines a helper the solution uses; 53: one-liner; 162: imports hashlib
SOME_IDS = ("HumanEval/0", "HumanEval/38", "HumanEval/53", "HumanEval/162")


@pytest.fixture(scope="module")
def humaneval():
    task = HumanEvalTask()
    examples = {ex["task_id"]: ex for ex in task.test_examples(164)}
    return task, [examples[i] for i in SOME_IDS]


def columns(examples):
    return {key: [ex[key] for ex in examples] for key in examples[0]}


def fenced_whole_function(ex) -> str:
    return "Here is the function:\n```python\n" + ex["code_prompt"] + ex["canonical_solution"] + "```\nDone."


MBPP_ROWS = [
    {"task_id": 2, "text": "Write a function to add two numbers.", "code": "def add(a, b):\n    return a + b",
     "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(-1, 1) == 0"],
     "test_setup_code": ""},
    {"task_id": 11, "text": "Write a function to compute the square root of the sum of squares.",
     "code": "def hyp(a, b):\n    return math.sqrt(a * a + b * b)",
     "test_list": ["assert hyp(3, 4) == 5.0", "assert hyp(5, 12) == 13.0", "assert hyp(0, 0) == 0.0"],
     "test_setup_code": "import math"},
    {"task_id": 12, "text": "Write a function to reverse a string.", "code": "def rev(s):\n    return s[::-1]",
     "test_list": ["assert rev('ab') == 'ba'", "assert rev('') == ''", "assert rev('abc') == 'cba'"],
     "test_setup_code": ""},
    {"task_id": 601, "text": "Write a function to double a number.", "code": "def double(x):\n    return 2 * x",
     "test_list": ["assert double(2) == 4", "assert double(0) == 0", "assert double(-3) == -6"],
     "test_setup_code": ""},
]  # fmt: skip


@pytest.fixture
def mbpp_file(tmp_path):
    path = tmp_path / "mbpp.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in MBPP_ROWS))
    return str(path)


# ---------------------------------------------------------------- extraction (no sandbox)


def test_extract_code_prefers_the_fenced_block_defining_the_entry_point():
    text = "Sure.\n```\nprint('usage')\n```\nand\n```python\ndef f(x):\n    return x\n```\ntrailing prose"
    assert extract_code(text, "f") == ("def f(x):\n    return x\n", True)
    assert extract_code(text) == ("print('usage')\n", True)
    assert extract_code("```python\ndef f():\n    return 1", "f") == ("def f():\n    return 1", True)  # cut off
    assert extract_code("    return 1\n") == ("    return 1\n", False)
    assert extract_code("```text\nnot code\n```") == ("```text\nnot code\n```", False)


def test_build_solution_continues_or_replaces_the_prompt():
    prompt = 'import math\n\n\ndef f(x):\n    """doc"""\n'
    body = "    return math.floor(x)\n\ndef g():\n    pass\nprint('junk')"
    assert build_solution(body, prompt, "f") == prompt + "    return math.floor(x)\n"  # stop sequences
    whole = "```python\ndef f(x):\n    return 2\n```"
    solution = build_solution(whole, prompt, "f")
    assert solution.startswith("import math") and solution.endswith("def f(x):\n    return 2\n")
    assert build_solution("def f(x):\n    return 3\n") == "def f(x):\n    return 3\n"


def test_score_output_needs_the_token():
    out = "noise\nabc 0 1\nabc 1 0\nabc 2 1\nforged 1 1\n"
    assert score_output(out, "abc", 3) == 0.0
    assert score_output(out, "abc", 3, partial_credit=True) == pytest.approx(2 / 3)
    assert score_output(out.replace("abc 1 0", "abc 1 1"), "abc", 3) == 1.0
    assert score_output(out, "other", 3, partial_credit=True) == 0.0


# ---------------------------------------------------------------- humaneval


def test_humaneval_is_registered_offline_and_test_only(humaneval):
    task, _ = humaneval
    assert TASKS.get("humaneval") is HumanEvalTask and TASKS.get("mbpp") is MbppTask
    examples = task.test_examples(1000)
    assert len(examples) == 164 and len({ex["task_id"] for ex in examples}) == 164
    assert task.test_examples(5, seed=1) == task.test_examples(5, seed=1) != task.test_examples(5, seed=2)
    ex = examples[0]
    assert ex["code_prompt"] in ex["prompt"] and "```python" in ex["prompt"]  # chat format
    assert ex["tests"].rstrip().endswith(f"check({ex['entry_point']})")
    with pytest.raises(ValueError, match="test-only"):
        task.train_examples(4)
    with pytest.raises(ValueError, match="format"):
        HumanEvalTask(format="compact")
    raw = HumanEvalTask(format="completion").test_examples(1)[0]
    assert raw["prompt"] == raw["code_prompt"]
    assert len(load_humaneval_problems()) == 164


@needs_sandbox
def test_humaneval_gold_scores_one_and_wrong_scores_zero(humaneval):
    task, examples = humaneval
    cols = columns(examples)
    continuation = [ex["canonical_solution"] for ex in examples]
    assert task.reward(continuation, **cols) == [1.0] * len(examples)
    assert task.reward([fenced_whole_function(ex) for ex in examples], **cols) == [1.0] * len(examples)
    assert all(task.correct(continuation, **cols))
    # every column straight into code_reward: the chat "prompt" column must not be taken for code
    assert code_reward(continuation, **cols) == [1.0] * len(examples)
    wrong = ["    return None\n", "```python\ndef decode_cyclic(s):\n    return s\n```", "    return 0\n", "garbage ((("]
    assert task.reward(wrong, **cols) == [0.0] * len(examples)


@needs_sandbox
def test_exploits_and_hangs_score_zero_in_bounded_time(humaneval):
    _, examples = humaneval
    ex = examples[0]
    exploits = [
        "    import sys\n    sys.exit(0)\nimport sys\nsys.exit(0)\n",  # exit 0 before the tests
        "    pass\nimport os\nos._exit(0)\n",  # exit 0 without unwinding
        "```python\nimport os\nprint('\\n' + 'f' * 32 + ' 0 1')\nos._exit(0)\n```",  # a forged success line
        "    while True:\n        pass\n",  # hangs inside the tests
        "    print('x' * 10**8)\n",  # floods the output
    ]
    n = len(exploits)
    start = time.monotonic()
    scores = code_reward(
        exploits, tests=[ex["tests"]] * n, entry_point=[ex["entry_point"]] * n, code_prompt=[ex["code_prompt"]] * n,
        timeout_s=1.5, workers=2,
    )  # fmt: skip
    assert scores == [0.0] * n
    assert time.monotonic() - start < 12


# ---------------------------------------------------------------- mbpp


def test_mbpp_loads_a_local_file_with_the_task_id_split(mbpp_file, tmp_path):
    task = MbppTask(path=mbpp_file)
    assert sorted(ex["task_id"] for ex in task.test_examples(10)) == [11, 12]
    assert {ex["task_id"] for ex in task.train_examples(6)} == {2, 601}  # cycles past the 2 rows
    ex = task.test_examples(10)[0]
    assert ex["tests"][0] in ex["prompt"] and ex["text"] in ex["prompt"]
    with pytest.raises(ValueError, match="local file"):
        MbppTask()
    test_file = tmp_path / "test.jsonl"
    test_file.write_text(json.dumps(MBPP_ROWS[0]) + "\n")
    split = MbppTask(train_path=mbpp_file, test_path=str(test_file))
    assert [e["task_id"] for e in split.test_examples(5)] == [2]
    assert 2 not in {e["task_id"] for e in split.train_examples(20)}  # never train on a test problem


def test_mbpp_the_same_file_as_train_and_test_says_the_overlap_is_the_cause(mbpp_file):
    with pytest.raises(ValueError, match=r"every train_path row is also in test_path.*separate train file.*"
                                         r"path=mbpp.jsonl alone"):
        MbppTask(train_path=mbpp_file, test_path=mbpp_file).train_examples(4)


@needs_sandbox
def test_mbpp_gold_scores_one_wrong_zero_and_partial_credit(mbpp_file):
    task = MbppTask(path=mbpp_file)
    examples = sorted(task.test_examples(10), key=lambda e: e["task_id"])  # hyp (needs setup), rev
    cols = columns(examples)
    gold = ["```python\n" + ex["canonical_solution"] + "\n```" for ex in examples]
    assert task.reward(gold, **cols) == [1.0, 1.0]
    half_right = ["def hyp(a, b):\n    return 5.0", "def rev(s):\n    return s"]  # 1 of 3, 1 of 3 ('' works)
    assert task.reward(half_right, **cols) == [0.0, 0.0]
    partial = MbppTask(path=mbpp_file, partial_credit=True)
    assert partial.reward(half_right, **cols) == [pytest.approx(1 / 3), pytest.approx(1 / 3)]


# ---------------------------------------------------------------- without a sandbox


def test_without_a_sandbox_code_scores_zero_unless_opted_in(monkeypatch, humaneval):
    _, examples = humaneval
    cols = columns(examples[:2])
    gold = [ex["canonical_solution"] for ex in examples[:2]]
    monkeypatch.setattr(sandbox, "_find_bwrap", lambda: None)
    sandbox._reset_probe()
    try:
        assert HumanEvalTask().reward(gold, **cols) == [0.0, 0.0]
        assert HumanEvalTask(allow_unsandboxed_code=True).reward(gold, **cols) == [1.0, 1.0]
    finally:
        monkeypatch.undo()
        sandbox._reset_probe()


def test_reward_never_raises_on_odd_input():
    assert code_reward([], tests=[]) == []
    assert code_reward(["x"], tests=[None]) == [0.0]
    assert HumanEvalTask().reward(["x"]) == [None]  # no tests column: not applicable


def test_mbpp_takes_diffucoders_preset(tmp_path):
    import json

    from ddrl.tasks import get_task
    from ddrl.tasks.base import ChatPrompt

    rows = [{"task_id": 600, "text": "Write sub(a, b).", "code": "", "test_list": ["assert sub(3, 2) == 1"]},
            {"task_id": 1, "text": "Write add(a, b).", "code": "", "test_list": ["assert add(1, 2) == 3"]}]
    (tmp_path / "train.jsonl").write_text(json.dumps(rows[0]) + "\n")
    (tmp_path / "test.jsonl").write_text(json.dumps(rows[1]) + "\n")
    task = get_task("mbpp", train_path=str(tmp_path / "train.jsonl"), test_path=str(tmp_path / "test.jsonl"),
                    preset="diffucoder")
    ex = task.test_examples(1)[0]
    assert isinstance(ex["prompt"], ChatPrompt) and ex["prompt"].system == "You are a helpful assistant."
    assert [e["prompt"] for e in task.all_test_examples()] == [ex["prompt"]]
    assert isinstance(task.train_examples(1)[0]["prompt"], ChatPrompt)
    good, unfenced = "```python\ndef add(a, b):\n    return a + b\n```\n", "def add(a, b):\n    return a + b\n"
    cols = {k: [ex[k]] * 2 for k in ex if k != "prompt"}
    assert task.reward([good, unfenced], **cols) == [2.5, 0.0]  # 2.0 x tests passed + 0.5 x format (DiffuCoder)
