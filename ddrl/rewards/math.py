"""Math answer correctness with Hugging Face's math-verify.

The predicted answer is the content of the last <answer> tag (d1's format) when there is one,
else the completion itself, from which math-verify extracts a \\boxed{} or final answer. The gold
answer may be plain ("42", "\\frac{1}{2}"), a GSM8K solution ("... #### 1,000") or a MATH solution
(its last \\boxed{}). Equivalent forms score equal: 0.5 == 1/2 == \\frac{1}{2}.

Bounded time, independent of machine load (the reward contract, docs/architecture.md#reward):
- only the last MAX_CHARS characters of the candidate answer are parsed;
- math-verify runs in a worker process with CPU_BUDGET_S seconds of CPU time per completion, not
  under its own wall-clock timeouts, which made the same completion score 1 on an idle machine and 0
  on a busy one (ddrl/rewards/cpu_budget.py). A completion over budget scores None (not
  applicable), and is counted (`cpu_budget.over_budget_count()`) and logged;
- expressions whose numeric comparison could run for ever (power towers such as 9^{9^{9^9}},
  huge exponents or factorials) score 0 before math-verify compares them
  (ddrl/rewards/math_verify_jobs.py).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from ddrl.rewards.composite import column_value
from ddrl.rewards.cpu_budget import shared_worker
from ddrl.rewards.format import extract_answer, extract_boxed

logger = logging.getLogger(__name__)

MAX_CHARS = 2000  # longest candidate answer handed to the parser
# CPU seconds of math-verify work (parses + comparison) per completion. Generous: a normal answer
# takes milliseconds, a 1,000-character polynomial about a second; CPU time, unlike wall time, does
# not grow with the machine's load (it grows a little with cache contention, hence the margin).
CPU_BUDGET_S = 5.0

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


def verify_in_worker(function: str, pairs: list[list[str]], budget_s: float | None = None) -> list[bool | None]:
    """`function(*pair)` of ddrl.rewards.math_verify_jobs for each pair, in the CPU-budget worker
    with `budget_s` (default CPU_BUDGET_S) CPU seconds each: its verdict, None when it ran out of
    budget, False when it raised (math-verify could not compare the two: the completion is wrong,
    as math-verify itself scores its errors)."""
    if not pairs:
        return []
    budget_s = CPU_BUDGET_S if budget_s is None else budget_s
    outcomes = shared_worker().map(f"ddrl.rewards.math_verify_jobs:{function}", pairs, budget_s)
    return [None if o.status == "over_budget" else (o.status == "ok" and bool(o.value)) for o in outcomes]


def math_correct_batch(completions: list[str], golds: list[Any]) -> list[float | None]:
    """math_correct of each (completion, gold), sent to the worker in one batch."""
    scores: list[float | None] = [None] * len(completions)
    pairs, rows = [], []
    for i, (completion, gold) in enumerate(zip(completions, golds)):
        gold_text = gold_answer(gold)
        if gold_text is None:
            continue
        candidate = extract_answer(completion)
        candidate = (completion if candidate is None else candidate)[-MAX_CHARS:]
        if not candidate.strip():
            scores[i] = 0.0
            continue
        pairs.append([candidate, gold_text])
        rows.append(i)
    for i, equal in zip(rows, verify_in_worker("answer_equals_gold", pairs)):
        scores[i] = None if equal is None else float(equal)
    return scores


def math_correct(completion: str, gold: Any) -> float | None:
    """1.0 if the completion's answer equals the gold answer mathematically, else 0.0; None without
    gold or when the comparison ran out of CPU budget."""
    return math_correct_batch([completion], [gold])[0]


def math_correctness_reward(completions: list[str], answer: Any = None, **_: Any) -> list[float | None]:
    """Column `answer`: the gold answer (plain, GSM8K '#### x' or a MATH solution with \\boxed{})."""
    golds = [column_value(answer, i) for i in range(len(completions))]
    try:
        return math_correct_batch([str(c) for c in completions], golds)
    except Exception:  # noqa: BLE001 - a reward never raises (docs/architecture.md#reward)
        logger.exception("math correctness reward failed for the whole batch; scoring it 0")
        return [None if g is None else 0.0 for g in golds]
