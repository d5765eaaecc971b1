"""Countdown: reach a target with + - * / over given numbers (reasoning-gym's generator, or files).

Sources: reasoning-gym's generator (the default: the built-in tiny models' CPU story), or, with
any of path / train_path / test_path / dataset, the papers' files (d1's countdown_cd3_test.jsonl,
see CountdownFileTask); `preset="d1"` etc. swaps in a paper's prompt, reward and metric.

Reward: 1.0 for an arithmetic expression that evaluates exactly to the target and uses each
given number at most once (`use_all=True`: exactly once, as in d1 and reasoning-gym), else 0.0.
The expression is parsed with Python's `ast` and evaluated by our own walker over integer
literals, binary + - * / and parentheses only, in exact rational arithmetic (no eval, no names,
no calls, no unary minus, no floats). reasoning-gym's own scorer is not used: it runs sympy's
parse_expr, which evaluates arbitrary Python.

Formats:
- compact: prompt "12,45,7,3=120" (the numbers, then the target); completion the expression,
  e.g. "(45-7)*3+12"; symbols: digits, + - * / ( ) , = and space.
- chat: instruction; the expression inside <answer>...</answer>, bare or as \\boxed{...}.
An answer may end with "=<target>"; only the left side is evaluated.
"""

from __future__ import annotations

import ast
import re
import warnings
from collections import Counter
from fractions import Fraction
from typing import Any

from ddrl.registry import TASKS
from ddrl.rewards.composite import per_completion
from ddrl.rewards.format import extract_answer, extract_boxed
from ddrl.tasks import ReasoningGymTask, check_format
from ddrl.tasks.paper_data import DEFAULT_DEV_FRACTION, DataSource, FileTask, PresetMixin, check_preset_format

MAX_EXPRESSION_CHARS = 256
_ALLOWED_CHARS = set("0123456789+-*/() \t\n")
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
        ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}


def _literals(tree: ast.AST) -> list[int]:
    """The integer literals of an expression tree; raises on any node outside the grammar."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant):
            if type(node.value) is not int:
                raise ValueError("only integer literals are allowed")
            out.append(node.value)
        elif not isinstance(node, (ast.Expression, ast.BinOp, *_OPS)):
            raise ValueError(f"{type(node).__name__} is not allowed in a countdown expression")
    return out


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant):
        assert isinstance(node.value, int)  # _literals admitted integer literals only
        return Fraction(node.value)
    assert isinstance(node, ast.BinOp)
    return _OPS[type(node.op)](_value(node.left), _value(node.right))  # ZeroDivisionError -> scored 0


def evaluate_expression(expression: str, numbers: list[int] | None = None) -> Fraction | None:
    """The exact value of an allowed expression, or None if it is not one.

    With `numbers`, the literals must be a sub-multiset of them (each number at most once);
    that check runs before evaluation, which also bounds the size of every intermediate value.
    """
    text = expression.strip()
    if not text or len(text) > MAX_EXPRESSION_CHARS or not set(text) <= _ALLOWED_CHARS:
        return None
    try:
        with warnings.catch_warnings():  # "1 (2)" warns "'int' object is not callable" while parsing
            warnings.simplefilter("ignore")
            tree = ast.parse(text, mode="eval")
        literals = _literals(tree)
        if numbers is not None and Counter(literals) - Counter(int(x) for x in numbers):
            return None
        return _value(tree.body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
        return None


_LATEX_OPS = {"\\times": "*", "\\cdot": "*", "\\div": "/", "$": ""}


def countdown_answer(completion: str, chat: bool) -> str | None:
    """The expression a completion answers, or None if it gives none.

    compact: the completion itself. chat: the content of the last <answer> tag; a \\boxed{...}
    inside it is unwrapped (LLaDA-8B-Instruct answers `<answer>\\boxed{49 + 55 - 53}</answer>`
    under d1's evaluation prompt); without an <answer> tag, the last \\boxed{...} of the completion.
    LaTeX operators (\\times, \\cdot, \\div) are read as * and /.
    """
    if not chat:
        return completion
    text = extract_answer(completion)
    if text is None or "\\boxed" in text or "\\fbox" in text:
        text = extract_boxed(completion if text is None else text)
    if text is None:
        return None
    for latex, op in _LATEX_OPS.items():
        text = text.replace(latex, op)
    return text


def countdown_score(completion: str, numbers: list[int], target: int, use_all: bool = False,
                    chat: bool = False) -> float:
    text = countdown_answer(completion, chat)
    if text is None:
        return 0.0
    left = text.split("=", 1)[0]
    value = evaluate_expression(left, numbers)
    if value is None or value != int(target):
        return 0.0
    if use_all:
        used = [int(tok) for tok in re.findall(r"\d+", left)]
        if sorted(used) != sorted(int(x) for x in numbers):
            return 0.0
    return 1.0


class CountdownRules:
    """Prompt and reward shared by the generated and the file-backed Countdown tasks."""

    name = "countdown"
    format = "compact"
    use_all = False

    def _prompt(self, numbers: list[int], target: int) -> str:
        if self.format == "compact":
            return ",".join(map(str, numbers)) + "=" + str(target)
        each = "each number exactly once" if self.use_all else "each number at most once"
        return (f"Using the numbers {numbers}, create an arithmetic expression that equals {target}. "
                f"You may use +, -, *, / and parentheses, {each}.\n"
                f"Think in <reasoning>...</reasoning>, then write only the expression inside "
                f"<answer>...</answer>, for example <answer>(1 + 2) * 3</answer>.")

    def reward(self, completions: list[str], **columns: Any) -> list[float | None]:
        use_all, chat = self.use_all, self.format == "chat"

        @per_completion
        def score(completion: str, numbers: list[int], target: int, **_: Any) -> float:
            return countdown_score(completion, numbers, target, use_all, chat)

        return score(completions, **columns)

    def _split_key(self, example: dict[str, Any]) -> str:
        return ",".join(map(str, sorted(example["numbers"]))) + "=" + str(example["target"])


class CountdownTask(PresetMixin, CountdownRules, ReasoningGymTask):
    """reasoning-gym's generator. Args: min_numbers/max_numbers (how many numbers),
    min_value/max_value (their range), min_target/max_target, use_all (every number exactly once),
    format ("compact" unless a preset is given), preset."""

    dataset_name = "countdown"
    test_fraction = 0.2  # generation runs sympy (~10 ms an item): keep the test split's rejection cost low

    def __init__(self, min_numbers: int = 3, max_numbers: int = 4, min_value: int = 1, max_value: int = 99,
                 min_target: int = 10, max_target: int = 999, use_all: bool = False, format: str | None = None,
                 preset: str | None = None):
        super().__init__()
        fmt = check_preset_format(self.name, preset, format, "compact")
        self.format = check_format(self.name, fmt, ("compact", "chat"))
        if not 2 <= min_numbers <= max_numbers:
            raise ValueError(f"countdown: need 2 <= min_numbers <= max_numbers, got {min_numbers}, {max_numbers}")
        if not 1 <= min_value <= max_value:
            raise ValueError(f"countdown: need 1 <= min_value <= max_value, got {min_value}, {max_value}")
        if not 1 <= min_target <= max_target:
            raise ValueError(f"countdown: need 1 <= min_target <= max_target, got {min_target}, {max_target}")
        self.config = {"min_numbers": int(min_numbers), "max_numbers": int(max_numbers), "min_value": int(min_value),
                       "max_value": int(max_value), "min_target": int(min_target), "max_target": int(max_target)}
        self.use_all = bool(use_all)
        if self.format == "compact":
            # longest gold: every number at full width, an operator between each pair, and at most
            # (numbers - 2) parenthesis pairs; rounded up to a multiple of 8 for block samplers
            digits = len(str(max_value))
            longest = max_numbers * digits + (max_numbers - 1) + 2 * max(max_numbers - 2, 0)
            self.gen_length = -(-longest // 8) * 8
        else:
            self.gen_length = 256
        self._init_preset(preset)

    def _rg_config(self) -> dict[str, Any]:
        return dict(self.config)

    def _example(self, item: dict[str, Any]) -> dict[str, Any]:
        meta = item["metadata"]
        numbers, target = [int(x) for x in meta["numbers"]], int(meta["target"])
        return {"prompt": self._prompt(numbers, target), "numbers": numbers, "target": target,
                "expression": "".join(str(meta["expression"]).split())}

    def symbols(self) -> list[str]:
        return list("0123456789") + list("+-*/(),=") + [" "]

    def pretrain_pairs(self, n: int, seed: int = 0) -> list[dict[str, str]]:
        if self.format != "compact":
            raise NotImplementedError("countdown: gold completions exist only in the compact format")
        return [{"prompt": ex["prompt"], "completion": ex["expression"]} for ex in self.train_examples(n, seed)]


def _numbers(value: Any) -> list[int]:
    """d1's "30,100,93", or a list [30, 100, 93]."""
    if isinstance(value, str):
        return [int(x) for x in value.replace("[", "").replace("]", "").split(",") if x.strip()]
    return [int(x) for x in value]


class CountdownFileTask(PresetMixin, CountdownRules, FileTask):
    """Countdown problems from files. Rows: d1's {"input": "30,100,93", "output": "23"}
    (dataset/countdown_cd3_test.jsonl, also shipped by SPG, ESPO and GDSD), the hub set the papers
    train on (Jiayi-Pan/Countdown-Tasks-3to4: {"nums": [...], "target": 23}), or
    {"numbers": [...], "target": 23}. Args: train_path, test_path, path, split, test_fraction,
    dev_fraction, dataset (see ddrl/tasks/paper_data.py); use_all (default True, the papers' rule: every
    number exactly once); format ("chat"); preset."""

    gen_length = 256

    def __init__(self, path: str | None = None, *, train_path: str | None = None, test_path: str | None = None,
                 dataset: str | None = None, dataset_config: str | None = None, train_split: str = "train",
                 test_split: str = "test", split: str | None = None, test_fraction: float | None = None,
                 dev_fraction: float = DEFAULT_DEV_FRACTION, use_all: bool = True, format: str | None = None,
                 preset: str | None = None):
        fmt = check_preset_format(self.name, preset, format, "chat")
        self.format = check_format(self.name, fmt, ("chat", "compact"))
        self._init_source(DataSource(self.name, path=path, train_path=train_path, test_path=test_path,
                                     dataset=dataset, dataset_config=dataset_config, train_split=train_split,
                                     test_split=test_split, split=split, test_fraction=test_fraction,
                                     dev_fraction=dev_fraction))
        self.use_all = bool(use_all)
        self._init_preset(preset)

    def _example(self, row: dict[str, Any], where: str) -> dict[str, Any]:
        nums = next((row[k] for k in ("input", "nums", "numbers") if row.get(k) is not None), None)
        target = next((row[k] for k in ("output", "target") if row.get(k) is not None), None)
        try:
            numbers, target = _numbers(nums), int(str(target).strip())
        except (TypeError, ValueError):
            raise ValueError(f"{where}: a countdown row needs numbers ('input': \"30,100,93\", 'nums' or "
                             f"'numbers': a list) and an integer target ('output' or 'target'); "
                             f"fields: {', '.join(row)}") from None
        return {"prompt": self._prompt(numbers, target), "numbers": numbers, "target": target}


_FILE_ARGS = ("path", "train_path", "test_path", "dataset")


@TASKS.register("countdown")
def countdown_task(**kwargs: Any) -> CountdownTask | CountdownFileTask:
    """Countdown from files (any of path / train_path / test_path / dataset: CountdownFileTask) or
    from reasoning-gym's generator (CountdownTask, the CPU story's built-in)."""
    if any(kwargs.get(k) is not None for k in _FILE_ARGS):
        return CountdownFileTask(**kwargs)
    return CountdownTask(**kwargs)
