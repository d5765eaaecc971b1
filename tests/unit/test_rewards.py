"""String rewards: hand-checked values, d1 equivalence, and never raising / hanging on any text."""

from __future__ import annotations

import re
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddrl.rewards import (CompositeReward, RewardResult, boxed_reward, d1_math_reward, extract_answer, extract_boxed,
                          math_correctness_reward, per_completion, score_parts, soft_format_reward,
                          strict_format_reward)
from ddrl.rewards.format import has_soft_format, has_strict_format
from ddrl.rewards.image import digits_classifier_accuracy, digits_classifier_reward, prompt_following
from ddrl.rewards.math import gold_answer, math_correct
from ddrl.tasks import get_task

D1_SOFT = r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>"
D1_STRICT = r"^<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\n$"
GOOD = "<reasoning>\nadd them\n</reasoning>\n<answer>\n42\n</answer>\n"

# --------------------------------------------------------------------------- format


def test_extract_answer_and_boxed():
    assert extract_answer("<answer> 1 </answer> then <answer>\n2\n</answer> junk") == "2"
    assert extract_answer("<reasoning>x</reasoning><answer>\n7 (cut off") == "7 (cut off"
    assert extract_answer("no tags") is None
    assert extract_boxed("so \\boxed{1} or \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert extract_boxed("\\boxed{\\frac{1}{2}") is None and extract_boxed("plain") is None


def test_format_rewards_by_hand():
    texts = [GOOD, GOOD.rstrip("\n"), "<reasoning>a</reasoning> <answer>4</answer>", " " + GOOD,
             "<reasoning>\nx\n</reasoning>\n<answer>\n4\n</answer>\ntrailing words", "<answer>4</answer>", ""]
    assert soft_format_reward(texts) == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    assert strict_format_reward(texts) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert boxed_reward(["\\boxed{3}", "\\boxed{", "boxed{3}"]) == [1.0, 0.0, 0.0]


TAG_PIECES = st.sampled_from(["<reasoning>", "</reasoning>", "<answer>", "</answer>", "\n", " ", "x", "<", ">", "\t"])


@settings(max_examples=300, deadline=None)
@given(st.lists(TAG_PIECES, max_size=14).map("".join))
def test_linear_format_checks_equal_d1_regexes(text):
    assert has_soft_format(text) == bool(re.match(D1_SOFT, text, re.DOTALL))
    # strict: d1's regex, except that missing or extra trailing whitespace is tolerated
    assert has_strict_format(text) == bool(re.match(D1_STRICT, text.rstrip() + "\n", re.DOTALL))


def test_format_checks_are_linear_on_repeated_tags():
    evil = "<reasoning>" + "</reasoning>  <answer>" * 50_000  # quadratic for the backtracking regex
    start = time.perf_counter()
    assert soft_format_reward([evil, "<reasoning>\n" + "\n</reasoning>\n<answer>\n" * 50_000]) == [0.0, 0.0]
    assert strict_format_reward([evil]) == [0.0]
    assert time.perf_counter() - start < 2.0


# --------------------------------------------------------------------------- math


def test_gold_answer_conventions():
    assert gold_answer("She pays 3 * 4 = 12.\n#### 1,200") == "1200"
    assert gold_answer("so the answer is $\\boxed{\\frac{\\sqrt{2}}{2}}$.") == "\\frac{\\sqrt{2}}{2}"
    assert gold_answer("  $42$ ") == "42" and gold_answer(None) is None and gold_answer("") is None


@pytest.mark.parametrize("gold, bare", [
    ("58,500", "58500"), ("$-1,234,567.25$", "-1234567.25"), ("Total.\n#### 1,000", "1000"),
    ("(2,12) \\cup (12,102)", "(2,12) \\cup (12,102)"),  # a comma between things, not a separator
    ("3, 5, 7", "3, 5, 7"), ("-2,1", "-2,1"), ("(1,000, 2)", "(1,000, 2)"), ("1,0000", "1,0000"),
    ("So $x \\in \\boxed{(2,12) \\cup (12,102)}$.", "(2,12) \\cup (12,102)"),
])
def test_gold_answer_drops_thousands_separators_only_from_a_whole_number(gold, bare):
    assert gold_answer(gold) == bare


def test_interval_gold_with_commas_scores_the_right_interval():
    right, wrong = "<answer>\\boxed{(2,12) \\cup (12,102)}</answer>", "<answer>(2,12) \\cup (12102)</answer>"
    assert math_correct(right, "(2,12) \\cup (12,102)") == 1.0
    assert math_correct(wrong, "(2,12) \\cup (12,102)") == 0.0


@pytest.mark.parametrize("completion,gold,expected", [
    ("<answer>0.5</answer>", "1/2", 1.0),
    ("<answer>1/2</answer>", "0.5", 1.0),
    ("<answer>\\frac{1}{2}</answer>", "0.5", 1.0),
    ("we get \\boxed{\\frac12}", "#### 0.5", 1.0),
    (GOOD, "Work.\n#### 42", 1.0),
    ("<answer>1,200</answer>", "#### 1,200", 1.0),
    ("<answer>$\\dfrac{\\sqrt2}{2}$</answer>", "\\boxed{\\frac{\\sqrt{2}}{2}}", 1.0),
    ("The answer is 42.", "42", 1.0),
    ("<answer>43</answer>", "42", 0.0),
    ("<answer>42</answer> and 43 too", "43", 0.0),  # the tagged answer counts, not a later number
    ("", "42", 0.0),
    ("no number at all", "42", 0.0),
])
def test_math_correctness(completion, gold, expected):
    assert math_correct(completion, gold) == expected


def test_math_reward_columns_and_missing_gold():
    assert math_correctness_reward(["<answer>3</answer>"] * 3, answer=["3", None, "4"]) == [1.0, None, 0.0]
    assert math_correctness_reward(["<answer>3</answer>"]) == [None]  # no gold column: not applicable


def test_power_towers_are_rejected_before_math_verify_compares_them():
    start = time.perf_counter()
    scores = math_correctness_reward(["\\boxed{9^{9^{9^{9}}}}", "<answer>2**2**2**100</answer>", "10^10^10^10",
                                      "\\boxed{100000!}"], answer=["0.5"] * 4)
    assert scores == [0.0] * 4
    assert time.perf_counter() - start < 1.5  # math-verify's own timeout would take 2 s each


def test_math_reward_works_outside_the_main_thread():
    # math-verify's signal timeouts fail off the main thread (it then scores every answer wrong)
    result = {}
    worker = threading.Thread(target=lambda: result.update(
        scores=math_correctness_reward(["<answer>0.5</answer>", "<answer>2</answer>"], answer=["1/2", "1/2"])))
    worker.start()
    worker.join(30)
    assert result["scores"] == [1.0, 0.0]


# --------------------------------------------------------------------------- composite


def test_composite_reward_weighted_sum_and_parts():
    a = lambda cs, **_: [1.0 if "a" in c else 0.0 for c in cs]  # noqa: E731
    b = lambda cs, **_: [None if c == "" else 0.5 for c in cs]  # noqa: E731
    broken = lambda cs, **_: 1 / 0  # noqa: E731
    short = lambda cs, **_: [1.0]  # noqa: E731
    reward = CompositeReward([("a", a, 2.0), ("b", b, 0.5)])
    assert reward(["a", "b", ""]) == [2.25, 0.25, 0.0]
    scored = reward.score(["a", "b", ""])
    assert scored == RewardResult([2.25, 0.25, 0.0], {"a": [1.0, 0.0, 0.0], "b": [0.5, 0.5, None]})
    assert not hasattr(reward, "last_parts")  # the parts come back with the scores, not as state
    assert score_parts(a, ["a", "b"]) == RewardResult([1.0, 0.0], {})  # a plain reward function has no parts
    only_b = CompositeReward([("b", b, 1.0)])
    assert only_b([""]) == [None]
    guarded = CompositeReward([("a", a, 1.0), ("broken", broken, 1.0), ("short", short, 3.0)])
    assert guarded(["a", "a"]) == [4.0, 1.0]
    parts = guarded.score(["a", "a"]).parts
    assert parts["broken"] == [0.0, 0.0] and parts["short"] == [1.0, None]
    with pytest.raises(ValueError, match="unique"):
        CompositeReward([("a", a, 1.0), ("a", b, 1.0)])


def test_d1_preset_values():
    reward = d1_math_reward()
    texts = [GOOD, "<answer>42</answer>", "<reasoning>\nx\n</reasoning>\n<answer>\n41\n</answer>", "junk"]
    assert reward(texts, answer=["42"] * 4) == [2.5, 2.0, 0.5, 0.0]
    assert reward.score(texts, answer=["42"] * 4).parts["correctness"] == [1.0, 1.0, 0.0, 0.0]
    assert reward.weights == {"correctness": 2.0, "format": 0.5}


def test_per_completion_isolates_errors_and_broadcasts_scalars():
    @per_completion
    def score(completion, k=None, **_):
        return len(completion) / k

    assert score(["ab", "abcd", "x"], k=[2, 0, "z"]) == [1.0, 0.0, 0.0]
    assert score(["ab", "abcd"], k=2) == [1.0, 2.0]


# --------------------------------------------------------------------------- digits classifier


def test_digits_classifier_is_accurate_on_held_out_images():
    assert digits_classifier_accuracy() > 0.93


def test_digits_reward_and_prompt_following():
    pairs = get_task("digits").pretrain_pairs(100, seed=3)
    images = [p["completion"] for p in pairs]
    labels = [int(p["prompt"][2]) for p in pairs]
    scores = digits_classifier_reward(images, label=labels)
    assert all(0.0 <= s <= 1.0 for s in scores)
    assert prompt_following(images, labels) > 0.9
    assert prompt_following(images, [(y + 3) % 10 for y in labels]) < 0.1
    assert digits_classifier_reward(["q" * 64, "bad"], label=[None, 2]) == [None, 0.0]


# --------------------------------------------------------------------------- robustness on any text


def _task_reward(name, **kwargs):
    task = get_task(name, **kwargs)
    example = task.train_examples(1)[0]
    columns = {k: v for k, v in example.items() if k != "prompt"}
    return lambda completions: task.reward(completions, **{k: [v] * len(completions) for k, v in columns.items()})


@pytest.fixture(scope="module")
def string_rewards():
    return {
        "math": lambda cs: math_correctness_reward(cs, answer=["0.5"] * len(cs)),
        "math_gsm8k_gold": lambda cs: math_correctness_reward(cs, answer=["#### 1,000"] * len(cs)),
        "soft_format": soft_format_reward,
        "strict_format": strict_format_reward,
        "boxed": boxed_reward,
        "d1": lambda cs: d1_math_reward()(cs, answer=["42"] * len(cs)),
        "digits": lambda cs: digits_classifier_reward(cs, label=[3] * len(cs)),
        "mini_sudoku": _task_reward("mini_sudoku"),
        "mini_sudoku_partial_chat": _task_reward("mini_sudoku", reward="partial", format="chat"),
        "countdown": _task_reward("countdown"),
        "countdown_chat": _task_reward("countdown", format="chat", use_all=True),
        "gsm_symbolic": _task_reward("gsm_symbolic"),
    }


ADVERSARIAL = {
    "empty": "",
    "junk_1mb": ("x=1/2 \\boxed{ <answer> (((( 9^9^9 1e999 " * 30_000)[:1_000_000],
    "answer_junk_1mb": "<answer>" + "9" * 1_000_000 + "</answer>",
    "unbalanced_tags": "<reasoning><answer></reasoning></answer><answer>" * 1000,
    "surrogates": "\ud800\udfff\udc00 <answer>\ud83d</answer> \x00\uffff",
    "1e999": "<answer>1e999</answer>",
    "inf_nan": "\\boxed{\\infty} nan inf -inf",
    "deep_parens": "<answer>" + "(" * 50_000 + "1" + ")" * 50_000 + "</answer>",
    "deep_braces": "\\boxed{" + "{" * 20_000 + "1" + "}" * 20_000 + "}",
    "tower": "<answer>9^{9^{9^{9^{9}}}}</answer>",
    "latex_soup": "<answer>\\frac{\\frac{\\frac{1}{2}}{\\sqrt{\\sqrt{2^{100000}}}}}{0}</answer>",
    "countdown_huge": "99" * 100 + "*" + "99" * 100,
    "sudoku_ish": "1234" * 4 + "<answer>" + "1 2 3 4\n" * 4 + "</answer>",
}


@pytest.mark.parametrize("case", sorted(ADVERSARIAL))
def test_rewards_survive_adversarial_text(string_rewards, case):
    text = ADVERSARIAL[case]
    for name, reward in string_rewards.items():
        start = time.perf_counter()
        scores = reward([text, GOOD])
        elapsed = time.perf_counter() - start
        assert len(scores) == 2, name
        assert all(s is None or isinstance(s, float) for s in scores), (name, scores)
        assert elapsed < 5.0, (name, case, elapsed)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=300) | st.lists(TAG_PIECES | st.text(max_size=5), max_size=30).map("".join))
def test_rewards_never_raise_on_arbitrary_text(string_rewards, text):
    for name, reward in string_rewards.items():
        scores = reward([text])
        assert len(scores) == 1 and (scores[0] is None or isinstance(scores[0], float)), name


def test_math_reward_is_bounded_off_the_main_thread():
    # no signal-based timeout off the main thread: the input caps and the expression guard must hold alone
    texts = list(ADVERSARIAL.values())
    result = {}
    def run():
        result["scores"] = math_correctness_reward(texts, answer=["0.5"] * len(texts))

    worker = threading.Thread(target=run, daemon=True)
    start = time.perf_counter()
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "math reward hung in a worker thread"
    assert len(result["scores"]) == len(texts) and time.perf_counter() - start < 20
