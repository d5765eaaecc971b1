"""d1's reward functions and evaluation parsers (Zhao et al. 2025, "d1: Scaling Reasoning in Diffusion
LLMs via RL", diffu-GRPO), reproducing dllm-reasoning/d1 @ 837888f. Pure functions of text and
columns: d1's prompts and the presets that bundle prompt, reward and metric per task live in
ddrl/tasks/presets/d1.py.

- `<task>_reward()`: d1's training reward (diffu-grpo/reward_func.py), a `CompositeReward` whose parts
  are d1's reward functions, with d1's weights:
    gsm8k      xmlcount x1 + soft format x0.5 + strict format x0.5 + integer answer x0.5
               + exact-string correctness x2.0
    math500    boxed + is_equiv correctness x2.0 + boxed_and_answer_tags_format x0.5
    countdown  compute_score: 1.0 correct, 0.1 an <answer> exists but is wrong or invalid, 0 none
    sudoku4x4  fraction of the puzzle's blank cells that the <answer> fills correctly
- `<task>_metric_score`: d1's evaluation verdict (eval/parse_and_get_acc.py), 1.0/0.0 per item, and for Sudoku
  the fraction of blank cells correct (d1 reports total correct cells / total blank cells; its
  test puzzles all have 8 blanks, so the mean of this per-item value is the same number).

Facts of d1's code that these functions keep, because they decide scores:
- The format regexes have no DOTALL: `.` stops at a newline, so the soft and strict format
  rewards fire only when the reasoning (and the answer) is on one line.
- The MATH format reward tests `"\\boxed" in answer` written as a plain (not raw) Python string,
  where "\\b" is a backspace: it looks for "\\x08oxed", which decoded text never holds. The part
  is in effect 0.75 with an <answer> tag and 0.25 without.
- The MATH normaliser (Hendrycks et al.'s `strip_string`) falls back to raw string equality
  whenever a step raises (e.g. "a/b" with a non-integer side, a bare trailing "\\sqrt").
- The training rewards read d1's <answer> tags; only the evaluation parsers read \\boxed{}. So
  `<answer>\\boxed{49 + 55 - 53}</answer>` scores 0.1 as a Countdown reward and counts as correct
  in the Countdown metric, as in d1.

Inputs: a completion is the generated text after the prompt (and after the pre-fill), decoded
as d1 decodes it: without special tokens for training, with them (<|eot_id|>, <|endoftext|>) for
evaluation, which its Sudoku parser reads. Columns: gsm8k "answer" (GSM8K's "... #### 42" or the
text after "####"); math500 "answer" (MATH-500's answer field, as written: d1's evaluation gold)
and optionally "solution" (the MATH solution, whose last \\boxed{} is d1's training gold; without
it the training reward uses "answer"); countdown "numbers", "target"; sudoku4x4 "puzzle",
"solution" (16-character strings, '0' a blank).

Deviations, all outside what d1's own data reaches: an arithmetic power whose result would exceed
`MAX_POWER_BITS` bits is not computed (d1 would evaluate it, possibly for hours) and scores as a
wrong equation; where d1's code would raise (an unbalanced \\boxed{ in a gold MATH solution, a
Countdown expression that evaluates to a tuple) ddrl scores the item instead (gold taken as
written, wrong respectively). The golden test is tests/unit/test_d1_presets.py.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from typing import Any, Callable

from ddrl.rewards.composite import CompositeReward, per_completion

SOURCE = "dllm-reasoning/d1@837888f"
MAX_POWER_BITS = 100_000  # a Countdown power beyond this many bits is scored without computing it


def countdown_numbers(value: Any) -> list[int]:
    """A Countdown example's "numbers" column as a list of ints."""
    return [int(x) for x in value]


# ---------------------------------------------------------------------------------------------
# Answer extraction shared by rewards and metrics

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def xml_answer(text: str) -> str:
    """d1's `extract_xml_answer`: after the last "<answer>", up to the first "</answer>", stripped
    (the whole text when there is no tag)."""
    return text.split("<answer>")[-1].split("</answer>")[0].strip()


def last_answer_tag(text: str) -> str | None:
    """Content of the last closed <answer>...</answer> (across newlines), stripped; None if none."""
    found = _ANSWER_TAG.findall(text)
    return found[-1].strip() if found else None


def first_answer_tag(text: str) -> str | None:
    """Content of the first closed <answer>...</answer>, not stripped; None if none."""
    found = _ANSWER_TAG.search(text)
    return found.group(1) if found else None


def last_boxed(text: str) -> str | None:
    """The last "\\boxed{...}" (or "\\fbox{...}") of `text` with its braces balanced, as d1 finds it.

    Quirks that decide d1's answers: any "\\boxed " (with a space) wins and runs to the next "$";
    without any box the whole text is returned; braces are counted from the box's start and the
    box ends where the count first returns to zero (None when it never does).
    """
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return text
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
    return None


def unbox(boxed: str | None) -> str | None:
    """d1's `remove_boxed` of a `last_boxed` result: the box's content; text that is not a
    "\\boxed{...}" unchanged (an "\\fbox{...}" keeps its wrapper); None where d1 raises (no box)."""
    if boxed is None:
        return None
    if "\\boxed " in boxed:
        return boxed[len("\\boxed "):] if boxed.startswith("\\boxed ") else None
    if boxed.startswith("\\boxed{") and boxed.endswith("}"):
        return boxed[len("\\boxed{"):-1]
    return boxed


def boxed_answer(text: str) -> str | None:
    """`unbox(last_boxed(text))`: the last box's content, the whole text without a box, None if unbalanced."""
    return unbox(last_boxed(text))


# ---------------------------------------------------------------------------------------------
# MATH answer normalisation (d1's copy of Hendrycks et al.'s MATH `strip_string` / `is_equiv`)

def _units_removed(s: str) -> str:
    if "\\text{ " not in s:
        return s
    pieces = s.split("\\text{ ")
    if len(pieces) != 2:
        raise ValueError("more than one '\\text{ '")  # d1 asserts; is_equiv then compares raw strings
    return pieces[0]


def _sqrt_braced(s: str) -> str:
    if "\\sqrt" not in s:
        return s
    head, *rest = s.split("\\sqrt")
    out = [head]
    for piece in rest:
        if piece[0] != "{":  # IndexError for a trailing "\\sqrt", as in d1
            piece = "{" + piece[0] + "}" + piece[1:]
        out.append("\\sqrt" + piece)
    return "".join(out)


def _fracs_braced(s: str) -> str:
    head, *rest = s.split("\\frac")
    out = [head]
    for piece in rest:
        if piece[0] != "{":  # IndexError for a trailing "\\frac", as in d1
            if len(piece) < 2:
                return s
            a, b = piece[0], piece[1]
            piece = "{" + a + "}" + ("{" + b + "}" if b != "{" else b) + piece[2:]
        out.append("\\frac" + piece)
    return "".join(out)


def _slash_as_frac(s: str) -> str:
    parts = s.split("/")
    if len(parts) != 2:
        return s
    a, b = int(parts[0]), int(parts[1])  # ValueError propagates, as in d1
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


def normalize_math_answer(s: str) -> str:
    """d1's `strip_string`; raises where d1's does (the caller then compares raw strings)."""
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "")
    s = _units_removed(s)
    s = s.replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 3" -> "3"
        s = sides[1]
    s = _sqrt_braced(s)
    s = s.replace(" ", "")
    s = _fracs_braced(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_as_frac(s)


def math_equiv(a: Any, b: Any, numeric_floats: bool = False) -> bool:
    """d1's `is_equiv`: normalised strings equal (raw strings equal if normalising raises).

    numeric_floats=True is the evaluation copy (eval/parser_helper.py), which first compares
    numerically when either side is a float.
    """
    if numeric_floats and (type(a) is float or type(b) is float):
        try:
            return abs(float(a) - float(b)) < 1e-6
        except Exception:  # noqa: BLE001 - d1's bare except
            return False
    if a is None or b is None:
        return a is None and b is None
    try:
        return normalize_math_answer(a) == normalize_math_answer(b)
    except Exception:  # noqa: BLE001 - d1 falls back on any error
        return a == b


# ---------------------------------------------------------------------------------------------
# Countdown expressions: Python's arithmetic on d1's character set, without eval

_COUNTDOWN_CHARS = re.compile(r"^[\d+\-*/().\s]+$")
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Pow: operator.pow}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _power(base: Any, exponent: Any) -> Any:
    if type(base) is int and type(exponent) is int and exponent > 0 and abs(base) > 1:
        if exponent * math.log2(abs(base)) > MAX_POWER_BITS:
            raise OverflowError("power too large to compute")  # d1 would compute it, slowly
    return operator.pow(base, exponent)


def _evaluate(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left), _evaluate(node.right)
        return _power(left, right) if isinstance(node.op, ast.Pow) else _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.Tuple):
        return tuple(_evaluate(e) for e in node.elts)
    raise TypeError(f"{type(node).__name__} is not arithmetic")  # e.g. "(1)(2)", a call, as eval fails


def evaluate_countdown(expression: str, strip: bool = False) -> Any:
    """What d1's `eval(expression)` gives on its allowed characters; raises where eval raises.

    Python's own parser reads the text (so "01" or "1 2" fail as in eval) and Python's operators
    compute it (int / float semantics, ** included); only powers past MAX_POWER_BITS are refused.
    """
    if not _COUNTDOWN_CHARS.match(expression):
        raise ValueError("invalid characters in equation")
    source = expression.strip() if strip else expression.lstrip(" \t")  # eval() drops leading blanks
    tree = ast.parse(source, mode="eval")
    return _evaluate(tree.body)


def uses_numbers_once(expression: str, numbers: list[int]) -> bool:
    """d1's `validate_equation`: the integers written in the expression are exactly `numbers`."""
    try:
        return sorted(int(n) for n in re.findall(r"\d+", expression)) == sorted(numbers)
    except Exception:  # noqa: BLE001
        return False


def _is_target(value: Any, target: Any) -> bool:
    try:
        return bool(abs(value - target) < 1e-5)
    except Exception:  # noqa: BLE001 - a tuple or Ellipsis result
        return False


# ---------------------------------------------------------------------------------------------
# Training rewards (diffu-grpo/reward_func.py). Each part returns d1's score divided by its weight.

_STRICT_FORMAT = re.compile(r"^<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\n$")
_SOFT_FORMAT = re.compile(r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>")


def _gold_gsm8k(answer: Any) -> str:
    """d1's gold: the text after GSM8K's first '####', stripped; a bare answer as given."""
    text = str(answer)
    return text.split("####")[1].strip() if "####" in text else text.strip()


@per_completion
def xmlcount_score(completion: str, **_: Any) -> float:
    """d1's `count_xml`: 0.125 per tag written once on its own line, minus 0.001 per character after
    the final tags (the same float operations, so scores are bit-identical)."""
    score = 0.0
    if completion.count("<reasoning>\n") == 1:
        score += 0.125
    if completion.count("\n</reasoning>\n") == 1:
        score += 0.125
    if completion.count("\n<answer>\n") == 1:
        score += 0.125
        score -= len(completion.split("\n</answer>\n")[-1]) * 0.001
    if completion.count("\n</answer>") == 1:
        score += 0.125
        score -= (len(completion.split("\n</answer>")[-1]) - 1) * 0.001
    return score


@per_completion
def soft_format_score(completion: str, **_: Any) -> float:
    return 1.0 if _SOFT_FORMAT.match(completion) else 0.0


@per_completion
def strict_format_score(completion: str, **_: Any) -> float:
    return 1.0 if _STRICT_FORMAT.match(completion) else 0.0


@per_completion
def integer_answer_score(completion: str, **_: Any) -> float:
    return 1.0 if xml_answer(completion).isdigit() else 0.0  # str.isdigit, as d1 (Unicode digits too)


@per_completion
def gsm8k_correctness_score(completion: str, answer: Any = None, **_: Any) -> float:
    if answer is None:
        return 0.0
    return 1.0 if xml_answer(completion) == _gold_gsm8k(answer) else 0.0


@per_completion
def math_correctness_score(completion: str, answer: Any = None, solution: Any = None, **_: Any) -> float:
    """1.0 when the completion's last \\boxed{} (the whole completion without one) is_equiv the gold's.

    d1 trains on the MATH solution and takes its last \\boxed{}: the `solution` column when the task
    has one, else `answer` (a bare answer is its own gold)."""
    raw = solution if solution is not None else answer
    if raw is None:
        return 0.0
    gold = boxed_answer(str(raw))
    predicted = boxed_answer(completion)
    return 1.0 if math_equiv(completion if predicted is None else predicted,
                             str(raw) if gold is None else gold) else 0.0


@per_completion
def boxed_in_answer_score(completion: str, **_: Any) -> float:
    """d1's `boxed_in_answer`: 1 for an <answer> tag, plus 1 if the answer holds "\\x08oxed", else 0.5."""
    pieces = completion.split("<answer>")
    tagged = len(pieces) > 1
    searched = pieces[1].split("</answer>")[0] if tagged else completion
    return (1.0 if tagged else 0.0) + (1.0 if "\x08oxed" in searched else 0.5)


@per_completion
def countdown_score(completion: str, numbers: Any = None, target: Any = None, **_: Any) -> float:
    """d1's `compute_score`: 1.0 correct, 0.1 an answer that is wrong / invalid / not all numbers once, 0 none."""
    equation = last_answer_tag(completion)
    if equation is None:
        return 0.0
    if not uses_numbers_once(equation, countdown_numbers(numbers)):
        return 0.1
    try:
        value = evaluate_countdown(equation)
    except Exception:  # noqa: BLE001 - d1's evaluate_equation returns None on any error
        return 0.1
    return 1.0 if _is_target(value, target) else 0.1


def _blank_cells_correct(grid: str, puzzle: str, solution: str) -> float:
    """Fraction of the puzzle's blanks ('0') that `grid` (padded with '0' / cut to 16) gets right."""
    grid = (grid + "0" * 16)[:16]
    blanks = [i for i in range(16) if puzzle[i] == "0"]
    if not blanks:
        return 0.0
    return sum(grid[i] == solution[i] for i in blanks) / len(blanks)


@per_completion
def sudoku_score(completion: str, puzzle: Any = None, solution: Any = None, **_: Any) -> float:
    """d1's `sudoku_reward_func`: the digits of the last <answer> against the blanks of the puzzle."""
    content = last_answer_tag(completion)
    if content is None:
        return 0.0
    digits = "".join(ch for ch in content if ch.isdigit())
    return _blank_cells_correct(digits, str(puzzle), str(solution)) if digits else 0.0


def gsm8k_reward() -> CompositeReward:
    return CompositeReward([("xmlcount", xmlcount_score, 1.0), ("soft_format", soft_format_score, 0.5),
                            ("strict_format", strict_format_score, 0.5), ("int", integer_answer_score, 0.5),
                            ("correctness", gsm8k_correctness_score, 2.0)])


def math500_reward() -> CompositeReward:
    return CompositeReward([("correctness", math_correctness_score, 2.0),
                            ("boxed_and_answer_tags_format", boxed_in_answer_score, 0.5)])


def countdown_reward() -> CompositeReward:
    return CompositeReward([("countdown", countdown_score, 1.0)])


def sudoku_reward() -> CompositeReward:
    return CompositeReward([("sudoku", sudoku_score, 1.0)])


# ---------------------------------------------------------------------------------------------
# Evaluation metrics (eval/parse_and_get_acc.py), one verdict per completion

_BOXED_LAZY = re.compile(r"\\boxed{(.*?)}")
_NUMBER = re.compile(r"-?\d+\.?\d*")
_GSM8K_GOLD = re.compile(r"####\s*\$?([\d,]+(?:\.\d+)?)")


def gsm8k_gold_number(answer: Any) -> float | None:
    """d1's evaluation gold: the number after '####' (eval/parsers.py `extract_answer_gsm8k`); a bare
    answer is read as if it followed '####' (so, as in d1, a negative answer has no gold)."""
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return float(answer)
    text = str(answer)
    found = _GSM8K_GOLD.search(text if "####" in text else "#### " + text)
    return float(found.group(1).replace(",", "")) if found else None


def _number_in(text: str, last: bool) -> float | None:
    """`text` as a float, else its first (last=False) or last number; None when neither parses."""
    try:
        return float(text)
    except ValueError:
        pass
    found = _NUMBER.findall(text)
    try:
        return float(found[-1 if last else 0]) if found else None
    except ValueError:
        return None


def gsm8k_prediction(generation: str) -> float | None:
    """d1's `parse_gsm_answers`: the first usable one-line \\boxed{} number, else the <answer>'s last number."""
    for content in _BOXED_LAZY.findall(generation):
        content = content.strip()
        if content and not re.match(r"^\.+$", content):
            value = _number_in(content, last=False)
            if value is not None:
                return value
    tagged = first_answer_tag(generation)
    if tagged and tagged.strip():
        return _number_in(tagged.strip(), last=True)
    return None


@per_completion
def gsm8k_metric_score(completion: str, answer: Any = None, **_: Any) -> float:
    predicted, gold = gsm8k_prediction(completion), gsm8k_gold_number(answer)
    return 1.0 if predicted is not None and predicted == gold else 0.0


def math_prediction(generation: str) -> str | None:
    """d1's `parse_math_answers`: the last box's content (the whole text without a box), else the first <answer>."""
    predicted = boxed_answer(generation)
    if not predicted:
        tagged = first_answer_tag(generation)
        if tagged is not None:
            predicted = tagged.strip()
    return predicted


@per_completion
def math_metric_score(completion: str, answer: Any = None, **_: Any) -> float:
    """Column `answer`: MATH-500's bare answer (d1's ground truth); a solution's last \\boxed{} is used."""
    if isinstance(answer, str) and "\\boxed" in answer:
        answer = boxed_answer(answer) or answer
    predicted = math_prediction(completion)
    return 1.0 if predicted is not None and math_equiv(predicted, answer, numeric_floats=True) else 0.0


_EQUATION_LHS = re.compile(r"([0-9+\-*/() ]+)=[0-9. ]+")


def countdown_prediction(generation: str) -> str:
    """d1's `parse_countdown_answers` extraction: the last \\boxed{} (the whole text without a box;
    the first <answer>, else the whole text, when the box is unbalanced), LaTeX operators made
    Python's, and the left side of a "... = number"."""
    equation = boxed_answer(generation)
    if equation is None:
        tagged = first_answer_tag(generation)
        equation = tagged.strip() if tagged is not None else generation
    equation = equation.replace("\\div", "/").replace("\\times", "*").replace("\\cdot", "*")
    lhs = _EQUATION_LHS.search(equation)
    return lhs.group(1).strip() if lhs else equation


@per_completion
def countdown_metric_score(completion: str, numbers: Any = None, target: Any = None, **_: Any) -> float:
    equation = countdown_prediction(completion)
    if target is None or not uses_numbers_once(equation, countdown_numbers(numbers)):
        return 0.0
    try:
        value = evaluate_countdown(equation, strip=True)
    except Exception:  # noqa: BLE001 - d1 scores an unevaluable equation as infinity
        return 0.0
    return 1.0 if _is_target(value, target) else 0.0


_SUDOKU_ANSWER_PATTERNS = [re.compile(p, re.DOTALL) for p in (
    r"<answer>.*?```\s*([\d\s]+)```",
    r"<answer>(.*?)(?:<\|eot_id\|>|<\|endoftext\|>|</answer>)",
    r"</answer>\s*(.*?)(?:<\|eot_id\|>|<\|endoftext\|>|$)",
    r".*?(\d{16})\s*</answer>",
    r"\b(\d{16})\b",
)]


def sudoku_prediction(generation: str) -> str:
    """d1's `parse_sudoku_answers` extraction: the first of its five patterns that captures
    non-blank text, whitespace removed ("" when none does)."""
    for pattern in _SUDOKU_ANSWER_PATTERNS:
        found = pattern.search(generation)
        if found and found.group(1).strip():
            return re.sub(r"\s", "", found.group(1).strip())
    return ""


@per_completion
def sudoku_metric_score(completion: str, puzzle: Any = None, solution: Any = None, **_: Any) -> float:
    grid = sudoku_prediction(completion)
    return _blank_cells_correct(grid, str(puzzle), str(solution)) if grid else 0.0
