"""Math answer correctness with Hugging Face's math-verify.

The predicted answer is the content of the last <answer> tag (d1's format) when there is one,
else the completion itself, from which math-verify extracts a \\boxed{} or final answer. The gold
answer may be plain ("42", "\\frac{1}{2}"), a GSM8K solution ("... #### 1,000") or a MATH solution
(its last \\boxed{}). Equivalent forms score equal: 0.5 == 1/2 == \\frac{1}{2}.

Bounded time (the reward contract, docs/architecture.md#reward: rewards never hang):
- only the last MAX_CHARS characters of the candidate answer are parsed;
- expressions whose numeric comparison could run for ever (power towers such as 9^{9^{9^9}},
  huge exponents or factorials) are scored 0 before math-verify compares them;
- in the main thread math-verify's own signal-based timeouts are on as a last resort. Signals
  exist only in the main thread, so elsewhere they are off and the two guards above carry it.
"""

from __future__ import annotations

import functools
import re
import threading
from typing import Any

from ddrl.rewards.composite import per_completion
from ddrl.rewards.format import extract_answer, extract_boxed

MAX_CHARS = 2000  # longest candidate answer handed to the parser
TIMEOUT_SECONDS = 2  # math-verify's per-parse / per-comparison timeout (main thread only)
_MAX_EXPONENT = 1000
_MAX_NODES = 2000

# A number written with thousands separators, and nothing else: "1,200", "-58,500.25". Only such an
# answer loses its commas; elsewhere a comma separates things ("(2,12) \\cup (12,102)", "3, 5, 7").
_GROUPED_NUMBER = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def gold_answer(gold: Any) -> str | None:
    """The bare gold answer: text after GSM8K's '####', else a MATH solution's last \\boxed{}.

    Thousands separators are dropped only when the whole answer is one number ("1,200" -> "1200")."""
    if gold is None:
        return None
    text = str(gold)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    elif "\\boxed" in text or "\\fbox" in text:
        text = extract_boxed(text) or text
    text = text.strip().strip("$").strip()
    if _GROUPED_NUMBER.fullmatch(text):
        text = text.replace(",", "")
    return text or None


def _timeout() -> int | None:
    return TIMEOUT_SECONDS if threading.current_thread() is threading.main_thread() else None


def _parse(text: str) -> list[Any]:
    from math_verify import parse

    return parse(text, parsing_timeout=_timeout())


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> tuple[Any, ...]:
    parsed = _parse(f"${gold}$") or _parse(gold)
    return tuple(parsed)


def _is_safe(parsed: list[Any]) -> bool:
    """False for sympy objects whose evaluation may not terminate in reasonable time."""
    import sympy

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


def math_correct(completion: str, gold: Any) -> float | None:
    """1.0 if the completion's answer equals the gold answer mathematically, else 0.0; None without gold."""
    from math_verify import verify

    gold_text = gold_answer(gold)
    if gold_text is None:
        return None
    candidate = extract_answer(completion)
    if candidate is None:
        candidate = completion
    candidate = candidate[-MAX_CHARS:]
    if not candidate.strip():
        return 0.0
    gold_parsed = list(_parse_gold(gold_text))
    pred = _parse(candidate) or _parse(f"${candidate}$")
    if not gold_parsed or not pred or not (_is_safe(pred) and _is_safe(gold_parsed)):
        return 0.0
    return 1.0 if verify(gold_parsed, pred, timeout_seconds=_timeout()) else 0.0


@per_completion
def math_correctness_reward(completion: str, answer: Any = None, **_: Any) -> float | None:
    """Column `answer`: the gold answer (plain, GSM8K '#### x' or a MATH solution with \\boxed{})."""
    return math_correct(completion, answer)
