"""The d1 presets against d1's own code (dllm-reasoning/d1 @ 837888f).

Golden data from tests/fixtures/make_d1_rewards.py:
  - rewards.json: d1's reward functions (diffu-grpo/reward_func.py) on ~30 completions a task,
    each function's score; and d1's evaluation verdict (eval/parse_and_get_acc.py) on the same;
  - prompts.json: the training prompts d1's data_utils builds and the evaluation prompts
    (user message + pre-fill) its eval datasets build.
d1's published generations (LLaDA-8B-Instruct's own outputs): bench/check_d1_generations.py checks
the preset's verdict on all 6,426 of them (bench/RESULTS.md), outside the repository; a subset of
MATH-500's with d1's verdicts is committed (tests/fixtures/d1_published/, make_d1_published.py) and
checked here through the task, from the data file to the verdict.
"""

from __future__ import annotations

import json
import time
from functools import lru_cache
from pathlib import Path

import pytest

from ddrl.tasks import get_task
from ddrl.tasks.base import ChatPrompt
from ddrl.tasks.presets import get_preset, presets

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "d1_rewards"
TASKS = ("gsm8k", "math500", "countdown", "sudoku4x4")
# d1's reward functions in the order its trainer lists them (diffu_grpo_train.py), and their names here
PARTS = {"gsm8k": ["xmlcount", "soft_format", "strict_format", "int", "correctness"],
         "math500": ["correctness", "boxed_and_answer_tags_format"],
         "countdown": ["countdown"], "sudoku4x4": ["sudoku"]}


@lru_cache(maxsize=None)
def _json(name: str) -> dict:
    return json.loads((FIXTURE / name).read_text())


def _columns(task: str, rows: list[dict], answer_key: str = "answer_raw") -> dict[str, list]:
    if task in ("gsm8k", "math500"):
        return {"answer": [r[answer_key] for r in rows]}
    if task == "countdown":
        return {"numbers": [r["numbers"] for r in rows], "target": [r["target"] for r in rows]}
    return {"puzzle": [r["puzzle"] for r in rows], "solution": [r["solution"] for r in rows]}


def test_one_d1_preset_per_task():
    assert sorted(p.task for p in presets() if p.paper == "d1") == sorted(TASKS)
    for task in TASKS:
        preset = get_preset("d1", task)
        assert preset.paper == "d1" and preset.task == task and "837888f" in preset.source
        assert preset.notes["eval_sampler"]["block_length"] == 32


@pytest.mark.parametrize("task, answer_key", [(t, "answer_raw") for t in TASKS]
                         + [("gsm8k", "answer"), ("math500", "answer")])
def test_reward_matches_d1_functions(task, answer_key):
    """Each part (times its weight) equals d1's function's score exactly; the total is their sum.
    answer_raw is the column as d1's data has it (GSM8K "... #### 42", a MATH solution);
    answer is the bare gold answer a task may pass instead."""
    rows = _json("rewards.json")[task]
    preset = get_preset("d1", task)
    totals = preset.reward([r["completion"] for r in rows], **_columns(task, rows, answer_key))
    parts = preset.reward.score([r["completion"] for r in rows], **_columns(task, rows, answer_key)).parts
    weights = preset.reward.weights
    assert list(weights) == PARTS[task]
    for i, row in enumerate(rows):
        for name in PARTS[task]:
            got = parts[name][i] * weights[name]
            assert got == row["scores"][name], (name, row["completion"], got, row["scores"][name])
        assert totals[i] == sum(row["scores"][name] for name in PARTS[task]), row["completion"]


def test_math_reward_reads_the_solution_column_first():
    """d1 trains on the MATH solution: with both columns, `solution` is the gold, whatever `answer` says."""
    rows = _json("rewards.json")["math500"]
    preset = get_preset("d1", "math500")
    totals = preset.reward([r["completion"] for r in rows], answer=["not the answer"] * len(rows),
                           solution=[r["answer_raw"] for r in rows])
    assert totals == [sum(r["scores"].values()) for r in rows]


@pytest.mark.parametrize("task", TASKS)
def test_metric_matches_d1_parser_on_edge_cases(task):
    rows = _json("rewards.json")[task]
    metric = get_preset("d1", task).metric
    if task == "gsm8k":  # d1's evaluation gold is the float after '####'
        columns = {"answer": [r["answer_raw"] for r in rows]}
    elif task == "math500":  # d1's evaluation gold is MATH-500's bare answer
        columns = {"answer": [r["eval_ground_truth"] for r in rows]}
    else:
        columns = _columns(task, rows)
    got = metric([r["completion"] for r in rows], **columns)
    want = [r["eval"]["verdict"] for r in rows]
    wrong = [(r["completion"], g, w) for r, g, w in zip(rows, got, want) if g != w]
    assert not wrong, wrong


def test_math500_task_gives_d1s_verdict_on_published_generations(tmp_path):
    """LLaDA-8B-Instruct's own MATH-500 generations, read as a user runs them: the test file holds
    the published question and ground truth, `preset="d1"` scores the published generation. Among
    them math500 gen 128 item 238: gold "58,500", generation \\boxed{58500}, wrong for d1."""
    published = json.loads((FIXTURE.parent / "d1_published" / "math500.json").read_text())
    assert published["meta"]["commit"] == "837888f"
    items = published["items"]
    assert any(x["gen_length"] == 128 and x["index"] == 238 and x["ground_truth"] == "58,500"
               and x["verdict"] == 0.0 for x in items)
    for gen_length in sorted({x["gen_length"] for x in items}):
        group = [x for x in items if x["gen_length"] == gen_length]
        path = tmp_path / f"math500_{gen_length}.jsonl"
        path.write_text("".join(json.dumps({"problem": x["question"], "answer": x["ground_truth"]}) + "\n"
                                for x in group))
        task = get_task("math500", test_path=str(path), preset="d1")
        examples = task.all_test_examples()
        columns = {k: [e[k] for e in examples] for k in examples[0] if k != "prompt"}
        got = task.metric([x["generations"] for x in group], **columns)
        wrong = [(x["index"], x["ground_truth"], g, x["verdict"]) for x, g in zip(group, got) if g != x["verdict"]]
        assert not wrong, (gen_length, wrong)


def test_countdown_boxed_answer_counts_in_the_metric_not_in_the_reward():
    """d1 evaluates \\boxed{}; its training reward reads the raw <answer> (0.1 for a boxed one)."""
    preset = get_preset("d1", "countdown")
    text = ["<answer>\\boxed{49 + 55 - 53}</answer>"]
    assert preset.metric(text, numbers=[[49, 55, 53]], target=[51]) == [1.0]
    assert preset.reward(text, numbers=[[49, 55, 53]], target=[51]) == [0.1]


def test_countdown_huge_power_is_bounded():
    """Deviation from d1 (whose eval would run for hours): a power too large to compute is wrong."""
    preset = get_preset("d1", "countdown")
    start = time.monotonic()
    text = ["<answer>99**99**99</answer>", "<answer>\\boxed{99**99**99}</answer>"]
    assert preset.reward(text, numbers=[[99, 99, 99]] * 2, target=[1] * 2) == [0.1, 0.1]
    assert preset.metric(text, numbers=[[99, 99, 99]] * 2, target=[1] * 2) == [0.0, 0.0]
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("task", TASKS)
def test_training_prompt_is_d1s(task):
    rows = _json("prompts.json")["train"][task]
    assert rows
    preset = get_preset("d1", task)
    for row in rows:
        assert preset.prompt(row["example"]) == row["user"]


@pytest.mark.parametrize("task", TASKS)
def test_eval_prompt_is_d1s(task):
    """d1's boxed instruction in the user message (no system role) and "<reasoning>" pre-filled."""
    rows = _json("prompts.json")["eval"][task]
    assert rows
    preset = get_preset("d1", task)
    for row in rows:
        prompt = preset.prompt_for_eval(row["example"])
        assert isinstance(prompt, ChatPrompt)
        assert (prompt.system, prompt.user, prompt.prefill) == (None, row["user"], row["prefill"])
    assert rows[0]["prefill"] == "<reasoning>"
