"""Answer-format rewards and answer extraction.

d1 (Zhao et al. 2025) asks LLaDA to answer as

    <reasoning>
    ...
    </reasoning>
    <answer>
    ...
    </answer>

and rewards the structure with two regexes: strict `^<reasoning>\\n.*?\\n</reasoning>\\n<answer>\\n.*?\\n</answer>\\n$`
and soft `<reasoning>.*?</reasoning>\\s*<answer>.*?</answer>` (re.match, so anchored at the start).
We compute the same predicates with plain string searches, in linear time: the regexes backtrack
quadratically on a megabyte of repeated tags. Deviation from d1: the strict check accepts the
completion with or without its final newline (decoders often strip it), and both return 1.0/0.0
(weights live in CompositeReward).
"""

from __future__ import annotations

from ddrl.rewards.composite import per_completion

REASONING_OPEN, REASONING_CLOSE = "<reasoning>", "</reasoning>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"


def extract_answer(text: str) -> str | None:
    """Content of the last <answer> tag (up to its </answer>, or to the end if unclosed), stripped.

    None when there is no <answer> tag. Like d1's `extract_xml_answer`, an unclosed final tag still
    yields its content, so a completion cut off at gen_length keeps its answer.
    """
    if not isinstance(text, str):
        return None
    start = text.rfind(ANSWER_OPEN)
    if start < 0:
        return None
    start += len(ANSWER_OPEN)
    end = text.find(ANSWER_CLOSE, start)
    return (text[start:] if end < 0 else text[start:end]).strip()


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) with balanced braces; None if there is none."""
    if not isinstance(text, str):
        return None
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        ch = text[j]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None  # unbalanced


def has_soft_format(text: str) -> bool:
    """d1's soft regex, re.match(r"<reasoning>.*?</reasoning>\\s*<answer>.*?</answer>", re.S)."""
    if not text.startswith(REASONING_OPEN):
        return False
    last_answer_close = text.rfind(ANSWER_CLOSE)
    p = text.find(REASONING_CLOSE, len(REASONING_OPEN))
    while p >= 0:
        j = p + len(REASONING_CLOSE)
        while j < len(text) and text[j].isspace():  # whitespace runs after distinct tags do not overlap
            j += 1
        if text.startswith(ANSWER_OPEN, j) and last_answer_close >= j + len(ANSWER_OPEN):
            return True
        p = text.find(REASONING_CLOSE, p + 1)
    return False


def has_strict_format(text: str) -> bool:
    """d1's strict regex (anchored at both ends), tolerating missing/extra trailing whitespace."""
    head, middle, tail = REASONING_OPEN + "\n", "\n" + REASONING_CLOSE + "\n" + ANSWER_OPEN + "\n", "\n" + ANSWER_CLOSE
    body = text.rstrip()
    if not (body.startswith(head) and body.endswith(tail)):
        return False
    # The earliest separator leaves the most room for the answer; if it does not fit, none does.
    p = body.find(middle, len(head))
    return p >= 0 and p + len(middle) <= len(body) - len(tail)


@per_completion
def soft_format_reward(completion: str, **_: object) -> float:
    """1.0 if the completion has d1's <reasoning>...</reasoning> <answer>...</answer> shape (soft)."""
    return 1.0 if has_soft_format(completion) else 0.0


@per_completion
def strict_format_reward(completion: str, **_: object) -> float:
    """1.0 if the completion matches d1's strict format (one tag per line, nothing around)."""
    return 1.0 if has_strict_format(completion) else 0.0


@per_completion
def boxed_reward(completion: str, **_: object) -> float:
    """1.0 if the completion contains a balanced \\boxed{...} answer."""
    return 1.0 if extract_boxed(completion) is not None else 0.0
