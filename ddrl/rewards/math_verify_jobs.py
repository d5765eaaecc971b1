"""math-verify calls that run inside the CPU-budget worker (ddrl/rewards/cpu_budget.py).

Imported only by the worker process: it loads math-verify and sympy at import and warms them up,
outside any job's budget. math-verify's own wall-clock timeouts (`parsing_timeout`,
`timeout_seconds`) are off here, because the worker's CPU budget bounds every call instead.

Expressions whose evaluation could run for ever or fill memory (power towers such as 9^{9^{9^9}},
huge exponents or factorials) score False before math-verify compares them: the budget would end
them too, but as None after seconds of work, and a C-level big-integer loop can allocate a lot first.
"""

from __future__ import annotations

import functools
from typing import Any

try:
    import math_verify.grader
    import math_verify.parser
    from math_verify import parse, verify
except ImportError as e:
    raise ImportError("math rewards need math-verify: pip install math-verify") from e
import sympy

_MAX_EXPONENT = 1000
_MAX_NODES = 2000

# math-verify warns once that "timeout is disabled"; here that is the design, not an omission
math_verify.parser.TIMEOUT_WARNING_SHOWN = True
math_verify.grader.TIMEOUT_WARNING_SHOWN = True


def _parse(text: str) -> list[Any]:
    return parse(text, parsing_timeout=None)


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> tuple[Any, ...]:
    return tuple(_parse(f"${gold}$") or _parse(gold))


def is_safe(parsed: list[Any]) -> bool:
    """False for sympy objects whose evaluation may not terminate in reasonable time."""
    for obj in parsed:
        if not isinstance(obj, sympy.Basic):
            continue
        for count, node in enumerate(sympy.preorder_traversal(obj)):
            if count > _MAX_NODES:
                return False
            if isinstance(node, sympy.Pow):
                exp = node.exp
                if exp.has(sympy.Pow) or (exp.is_Number and abs(exp) > _MAX_EXPONENT):
                    return False
            elif isinstance(node, (sympy.factorial, sympy.factorial2, sympy.gamma)):
                arg = node.args[0]
                if not arg.is_Number or abs(arg) > _MAX_EXPONENT:
                    return False
            elif isinstance(node, sympy.Integer) and abs(int(node)).bit_length() > 10_000:
                return False
    return True


def answer_equals_gold(candidate: str, gold: str) -> bool:
    """ddrl's comparison (ddrl.rewards.math): the candidate answer parsed as is, else inside $...$;
    the bare gold answer inside $...$, else as is; gold first, as math-verify expects."""
    gold_parsed = list(_parse_gold(gold))
    pred = _parse(candidate) or _parse(f"${candidate}$")
    if not gold_parsed or not pred or not (is_safe(pred) and is_safe(gold_parsed)):
        return False
    return bool(verify(gold_parsed, pred, timeout_seconds=None))


def texts_equal(first: str, second: str) -> bool:
    """The peers' verify(parse(first), parse(second)) with math-verify's default extraction."""
    a, b = _parse(first), _parse(second)
    if not (is_safe(a) and is_safe(b)):
        return False
    return bool(verify(a, b, timeout_seconds=None))


answer_equals_gold("1", "1")  # warm up (regex compilation, sympy's import-time work) before any budget
