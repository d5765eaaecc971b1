"""Reward functions and evaluation parsers of d1's peers: ESPO, SPG, StableDRL, GDSD and DiffuCoder.

Pure functions of text and columns, as each paper's released code computes them; the presets that
bundle a paper's prompt, reward and metric per task live in ddrl/tasks/presets/<paper>.py
(repository and commit in `Preset.source`). The scores are checked
against the papers' own functions run on fixed completions (tests/fixtures/peer_rewards/, made by
tests/fixtures/make_peer_rewards.py; tests/unit/test_peer_presets.py). Presets:

    espo        gsm8k math500 countdown sudoku4x4   ML-GSAI/ESPO @ b5f2dac
    spg         gsm8k math500 countdown sudoku4x4   facebookresearch/SPG @ a1c7120
    stable_drl  gsm8k math500 countdown sudoku4x4   JianyuanZhong/StableDRL @ 26ad014
    gdsd        gsm8k math500 countdown sudoku4x4   GaryBall/GDSD @ 3fb6780
    diffucoder  mbpp                                apple/ml-diffucoder @ f735e01

What the papers' rewards are, in short (weights are the sums their trainers form):
- ESPO: GSM8K 1.0 for the "last number" of the completion equal to the gold (its own extractor:
  "The answer is X." first, then "#### X", then the last integer), with a plain
  "...put your final answer within \\boxed{}" prompt and no system prompt; MATH 1.0 when math-verify
  finds the whole completion equal to the whole gold solution; Countdown and Sudoku as d1.
- SPG: d1's rewards (five GSM8K functions, regexes without DOTALL; MATH boxed + `is_equiv`), except
  that its xmlcount subtracts the text after "\\n<answer>\\n" (d1: after "\\n</answer>\\n"). Its
  Sudoku trains on its solution-disjoint split with a 3-shot prompt at T=0.3 (`notes`).
- StableDRL: +1 / -1 from math-verify (gold parsed first) on the raw completion, plus 1.0 from its
  anti_short_boxed reward (0 for a completion under 200 non-space characters that is mostly a
  \\boxed{}), which its training loop adds to every task's reward. Countdown accepts any sub-multiset
  of the numbers (d1: all of them).
- GDSD: its own recipes train GSM8K on d1's five functions with DOTALL regexes and SPG's xmlcount,
  and MATH on "<answer> then \\boxed{} then `is_equiv`" x2.0 + a boxed-in-answer format reward x0.5
  whose "\\boxed" test is fixed (d1 tests for a backspace character, so d1 always gives 0.5 there).
- DiffuCoder: 2.0 x the fraction of test asserts that pass + 0.5 x a code-format reward (one
  ```python block ending the completion and a newline: 1.0; the same with a syntax error: 0.5);
  execution only when the format reward is 1. The tests run in ddrl's sandbox (ddrl.rewards.code).

Where a paper's code is d1's (the Countdown and Sudoku rewards of ESPO, SPG and GDSD; SPG's MATH
reward; SPG's eval parsers; the Sudoku eval parser of ESPO and GDSD), the preset uses
ddrl.rewards.d1's implementation, and the golden scores check both. What differs is here.

Metrics: where the paper ships an evaluation parser for the task (d1's parse_and_get_acc.py copies),
the metric is that parser's verdict. Where it evaluates with an external harness (ESPO: OpenCompass;
GDSD: lm-eval for GSM8K/MATH) or ships none (StableDRL Countdown/Sudoku), the metric is the
verdict of the training reward's correctness part; Preset.notes["metric"] says which.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from typing import Any, Callable

from ddrl.rewards import d1 as d1_rewards
from ddrl.rewards.composite import CompositeReward, column_value, per_completion
from ddrl.rewards.math import verify_in_worker

MATH_VERIFY_CPU_S = 10.0  # CPU seconds per comparison (the peers: 5 s wall for a parse, 5 s for verify)

# ================================================================ shared pieces
def _rows(fn: Callable[..., float | None]) -> Callable[..., list[float | None]]:
    return per_completion(fn)


def hash_gold(answer: Any) -> str:
    """The GSM8K gold as the peers compare it: the text after '####', stripped (a bare answer as is)."""
    text = str(answer)
    return text.split("####")[1].strip() if "####" in text else text.strip()


def math_solution(answer: Any) -> str:
    """The MATH gold as the peers read it: a solution with \\boxed{}. A bare answer is boxed."""
    text = str(answer)
    return text if ("\\boxed" in text or "\\fbox" in text) else "\\boxed{" + text + "}"


xml_answer = d1_rewards.xml_answer  # d1's extract_xml_answer


# ---------------------------------------------------------------- math-verify
def math_verify_equal(first: str, second: str) -> bool | None:
    """verify(parse(first), parse(second)) with math-verify's default extraction; False on error.

    The order matters to math-verify: ESPO/GDSD pass the completion first, StableDRL the gold. It
    runs in ddrl's CPU-budget worker (ddrl/rewards/cpu_budget.py) with MATH_VERIFY_CPU_S CPU seconds
    instead of the peers' wall-clock timeout, whose verdict depends on the machine's load: None
    (counted and logged) when the budget runs out, where the peers would score a timeout wrong."""
    return verify_in_worker("texts_equal", [[str(first), str(second)]], MATH_VERIFY_CPU_S)[0]


# ---------------------------------------------------------------- GDSD's MATH normalisation
def gdsd_unbox(s: str | None) -> str | None:
    """GDSD's remove_boxed: like d1's, but text that is not a box (also "x \\boxed y") comes back
    unchanged instead of raising."""
    if s is None:
        return None
    if "\\boxed " in s:
        return s[len("\\boxed "):] if s.startswith("\\boxed ") else s
    return s[len("\\boxed{"):-1] if s.startswith("\\boxed{") and s.endswith("}") else s


def _fix_fracs(s: str) -> str:
    parts = s.split("\\frac")
    if len(parts) <= 1:
        return s
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if len(part) < 2 and not part.startswith("{"):
            return s
        if part[0] == "{":
            out += part
            continue
        a, b, rest = part[0], part[1], part[2:]
        out += "{" + a + "}{" + b + "}" + rest if b != "{" else "{" + a + "}" + b + rest
    return out


def _fix_a_slash_b(s: str) -> str:
    if len(s.split("/")) != 2:
        return s
    a, b = s.split("/")
    try:
        ai, bi = int(a), int(b)
    except ValueError:
        return s
    return "\\frac{" + str(ai) + "}{" + str(bi) + "}" if s == f"{ai}/{bi}" else s


def _fix_sqrt(s: str) -> str:
    parts = s.split("\\sqrt")
    out = parts[0]
    for part in parts[1:]:
        if not part:
            out += "\\sqrt"
        elif part[0] != "{":
            out += "\\sqrt{" + part[0] + "}" + part[1:]
        else:
            out += "\\sqrt" + part
    return out


def gdsd_strip_string(s: str) -> str:
    """Hendrycks et al.'s MATH answer normalisation as GDSD rewrote it: where d1's copy raises (an
    empty \\frac or \\sqrt, several "\\text{ ", a non-integer a/b) it leaves the text as it is."""
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
                     ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")):
        s = s.replace(old, new)
    if "\\text{ " in s:
        s = s.split("\\text{ ", 1)[0]
    s = s.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    if len(s.split("=")) == 2 and len(s.split("=")[0]) <= 2:
        s = s.split("=")[1]
    s = _fix_fracs(_fix_sqrt(s).replace(" ", ""))
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_a_slash_b(s)


def gdsd_is_equiv(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return gdsd_strip_string(a) == gdsd_strip_string(b)


# ---------------------------------------------------------------- countdown
def _hits(value: Any, target: Any) -> bool:
    try:
        return bool(abs(value - target) < 1e-5)
    except Exception:  # noqa: BLE001 - a tuple result
        return False


def stable_drl_countdown_score(text: str, numbers: list[int], target: int) -> float:
    """StableDRL's compute_score_countdown: d1's, except that the numbers written may be any
    sub-multiset of the given ones (d1: all of them, once each)."""
    equation = d1_rewards.last_answer_tag(text)
    if equation is None:
        return 0.0
    if Counter(int(n) for n in re.findall(r"\d+", equation)) - Counter(int(n) for n in numbers):
        return 0.1
    try:
        value = d1_rewards.evaluate_countdown(equation)
    except Exception:  # noqa: BLE001 - their evaluate_equation returns None on any error
        return 0.1
    return 1.0 if _hits(value, target) else 0.1


def countdown_eval_boxed_first(text: str, numbers: list[int], target: int) -> float:
    """parse_countdown_answers as ESPO and GDSD ship it: d1's, except that their remove_boxed raises
    on unboxed text, so an unboxed completion is read from its first <answer> tag (d1 reads the
    whole text). Then LaTeX operators are mapped, "expr = value" is cut to expr, and every number
    must be used once."""
    boxed = d1_rewards.last_boxed(text)
    if boxed is not None and boxed.startswith("\\boxed{") and boxed.endswith("}") and "\\boxed " not in boxed:
        equation = boxed[len("\\boxed{"):-1]
    elif boxed is not None and boxed.startswith("\\boxed "):
        equation = boxed[len("\\boxed "):]
    else:
        tag = d1_rewards.first_answer_tag(text)
        equation = tag.strip() if tag is not None else text
    equation = equation.replace(r"\div", "/").replace(r"\times", "*").replace(r"\cdot", "*")
    m = re.search(r"([0-9+\-*/() ]+)=[0-9. ]+", equation)
    if m:
        equation = m.group(1).strip()
    if not d1_rewards.uses_numbers_once(equation, [int(n) for n in numbers]):
        return 0.0
    try:
        value = d1_rewards.evaluate_countdown(equation, strip=True)
    except Exception:  # noqa: BLE001 - their evaluate_equation returns inf
        return 0.0
    return 1.0 if _hits(value, target) else 0.0


# ---------------------------------------------------------------- d1's five GSM8K functions
def xml_count(text: str) -> float:
    """d1's count_xml as SPG and GDSD have it: the third term subtracts the text after "\\n<answer>\\n"."""
    count = 0.0
    if text.count("<reasoning>\n") == 1:
        count += 0.125
    if text.count("\n</reasoning>\n") == 1:
        count += 0.125
    if text.count("\n<answer>\n") == 1:
        count += 0.125
        count -= len(text.split("\n<answer>\n")[-1]) * 0.001
    if text.count("\n</answer>") == 1:
        count += 0.125
        count -= (len(text.split("\n</answer>")[-1]) - 1) * 0.001
    return count


_SOFT = r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>"
_STRICT = r"^<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\n$"


def five_function_reward(dotall: bool) -> CompositeReward:
    """xmlcount + soft 0.5 + strict 0.5 + int 0.5 + exact-answer 2.0 (d1's GSM8K reward). dotall:
    GDSD's regexes; without it (d1, SPG) the format rewards fire only on one-line reasoning."""
    flags = re.DOTALL if dotall else 0

    @_rows
    def xmlcount(completion: str, **_: Any) -> float:
        return xml_count(completion)

    @_rows
    def soft_format(completion: str, **_: Any) -> float:
        return 0.5 if re.match(_SOFT, completion, flags) else 0.0

    @_rows
    def strict_format(completion: str, **_: Any) -> float:
        return 0.5 if re.match(_STRICT, completion, flags) else 0.0

    @_rows
    def integer(completion: str, **_: Any) -> float:
        return 0.5 if xml_answer(completion).isdigit() else 0.0

    @_rows
    def correctness(completion: str, answer: Any = None, **_: Any) -> float | None:
        return None if answer is None else (2.0 if xml_answer(completion) == hash_gold(answer) else 0.0)

    return CompositeReward([("xmlcount", xmlcount, 1.0), ("soft_format", soft_format, 1.0),
                            ("strict_format", strict_format, 1.0), ("int", integer, 1.0),
                            ("correctness", correctness, 1.0)])


# ================================================================ ESPO
_ESPO_LAST_NUMBER = (re.compile(r"The answer is (\-?[0-9\.,]+)."), re.compile(r"#### (\-?[0-9\.,]+)"))


def last_number_answer(text: str) -> str:
    """ESPO's (and GDSD's) GSM8K extractor: "The answer is X." (the regex needs one character after
    X, so a final "The answer is 72" yields "7"), then "#### X", then the last integer, else ""."""
    for pattern in _ESPO_LAST_NUMBER:
        m = pattern.search(text)
        if m:
            return m.group(1).strip()
    ints = re.findall(r"(\-?[0-9]+)", text)
    return ints[-1].strip() if ints else ""


@_rows
def espo_gsm8k_reward(completion: str, answer: Any = None, **_: Any) -> float | None:
    return None if answer is None else (1.0 if last_number_answer(completion) == hash_gold(answer) else 0.0)


@_rows
def espo_math_reward(completion: str, answer: Any = None, **_: Any) -> float | None:
    """ESPO's correctness_reward_func_math: verify(parse(completion), parse(gold solution))."""
    if answer is None:
        return None
    equal = math_verify_equal(completion, math_solution(answer))
    return None if equal is None else float(equal)


# ESPO's, SPG's and GDSD's Countdown and Sudoku rewards are d1's functions, line for line.
d1_countdown_reward = d1_rewards.countdown_score
d1_sudoku_reward = d1_rewards.sudoku_score


@_rows
def countdown_eval_metric(completion: str, numbers: Any = None, target: Any = None, **_: Any) -> float:
    return countdown_eval_boxed_first(completion, list(numbers), int(target))


def positive_verdict(reward: Callable[..., list[float | None]], threshold: float) -> Callable[..., list[float]]:
    """The accuracy verdict of a reward: 1.0 where it reaches `threshold` (its correct score)."""

    def metric(completions: list[str], **columns: Any) -> list[float]:
        return [1.0 if s is not None and s >= threshold else 0.0 for s in reward(completions, **columns)]

    return metric


def part_verdict(reward: CompositeReward, part: str) -> Callable[..., list[float]]:
    """1.0 where the named part of a composite reward is positive (its correctness verdict)."""

    def metric(completions: list[str], **columns: Any) -> list[float]:
        return [1.0 if s is not None and s > 0 else 0.0 for s in reward.score(completions, **columns).parts[part]]

    return metric


# ================================================================ SPG (d1's eval parsers, plus a fallback)
_SPG_NUMBER = re.compile(r"-?\d+\.?\d*")


def _first_float(text: str, last: bool) -> float | None:
    try:
        return float(text)
    except ValueError:
        numbers = _SPG_NUMBER.findall(text)
        if numbers:
            try:
                return float(numbers[-1] if last else numbers[0])
            except ValueError:
                return None
    return None


def spg_gsm8k_parse(text: str) -> float | None:
    """SPG's parse_gsm_answers: the first usable \\boxed{} (non-greedy, so nested braces cut early),
    else the first <answer>..</answer>, else the text after the last <answer>; its number as a float."""
    for boxed in re.findall(r"\\boxed{(.*?)}", text):
        boxed = boxed.strip()
        if boxed and boxed != "..." and not re.match(r"^\.+$", boxed):
            value = _first_float(boxed, last=False)
            if value is not None:
                return value
    m = re.search(r"<answer>(.*?)</answer>", text, re.DOTALL)
    if m and m.group(1).strip():
        value = _first_float(m.group(1).strip(), last=True)
        if value is not None:
            return value
    tail = xml_answer(text)
    return _first_float(tail, last=True) if tail else None


@_rows
def spg_gsm8k_metric(completion: str, answer: Any = None, **_: Any) -> float:
    parsed = spg_gsm8k_parse(completion)
    return 1.0 if parsed is not None and parsed == float(hash_gold(answer).replace(",", "")) else 0.0


# ================================================================ StableDRL
def anti_short_boxed(text: str, min_total_chars: int = 200, non_boxed_ratio_threshold: float = 0.85) -> float:
    """StableDRL's anti_short_boxed_reward: 0 for a completion under 200 non-space characters that is
    a bare \\boxed{} or mostly one, else 1.0. Its training loop adds it to every task's reward."""
    s = text.strip()
    total = len(re.sub(r"\s+", "", s))
    pure_boxed = bool(re.fullmatch(r"[\s$]*\\boxed\{[^}]*\}[\s$]*[.?!'\"“”’]*\s*", s))
    without_boxed = re.sub(r"\s+", "", re.sub(r"\\boxed\{.*?\}", "", s, flags=re.DOTALL))
    ratio = len(without_boxed) / (total + 1e-6)
    return 0.0 if total < min_total_chars and (pure_boxed or ratio < non_boxed_ratio_threshold) else 1.0


@_rows
def stable_drl_anti_short_boxed(completion: str, **_: Any) -> float:
    return anti_short_boxed(completion)


def _stable_math(gold_of: Callable[[Any], str]) -> Callable[..., list[float | None]]:
    @_rows
    def correctness(completion: str, answer: Any = None, **_: Any) -> float | None:
        if answer is None:
            return None
        equal = math_verify_equal(gold_of(answer), completion)
        return None if equal is None else (1.0 if equal else -1.0)

    return correctness


stable_drl_gsm8k_correctness = _stable_math(lambda a: str(a).split("####")[-1].strip())
stable_drl_math_correctness = _stable_math(str)


@_rows
def stable_drl_countdown(completion: str, numbers: Any = None, target: Any = None, **_: Any) -> float | None:
    return None if numbers is None else stable_drl_countdown_score(completion, list(numbers), int(target))


def stable_drl_reward(correctness: Callable[..., list[float | None]]) -> CompositeReward:
    return CompositeReward([("correctness", correctness, 1.0), ("anti_short_boxed", stable_drl_anti_short_boxed, 1.0)])


# ================================================================ GDSD
@_rows
def gdsd_math_correctness(completion: str, answer: Any = None, **_: Any) -> float | None:
    """GDSD's correctness_reward_func_math_xml: the first <answer> tag (else the completion), its last
    \\boxed{}, GDSD's is_equiv (its normaliser never raises), 2.0."""
    if answer is None:
        return None
    gold = gdsd_unbox(d1_rewards.last_boxed(math_solution(answer)))
    try:
        text = completion.split("<answer>", 1)[1].split("</answer>", 1)[0]
    except IndexError:
        text = completion
    return 2.0 if gdsd_is_equiv(gdsd_unbox(d1_rewards.last_boxed(text)), gold) else 0.0


@_rows
def gdsd_boxed_in_answer_format(completion: str, **_: Any) -> float:
    """GDSD's boxed_and_answer_tags_format_reward_math: 0.5 x (1 for an <answer> tag pair + 1 for a
    \\boxed in it, else 0.5)."""
    reward, text = 0.0, completion
    try:
        text = completion.split("<answer>", 1)[1].split("</answer>", 1)[0]
        reward += 1.0
    except IndexError:
        pass
    reward += 1.0 if "\\boxed" in text else 0.5
    return 0.5 * reward


def gdsd_math_reward() -> CompositeReward:
    """GDSD's MATH reward: correctness x2.0 (in the part) + boxed-in-answer format x0.5 (in the part)."""
    return CompositeReward([("correctness", gdsd_math_correctness, 1.0),
                            ("format", gdsd_boxed_in_answer_format, 1.0)])


# ================================================================ DiffuCoder
_CODE_FORMAT = re.compile(r"^(?:(?!```)[\s\S])*?```python\n(?:(?!```)[\s\S])*?```\n$", re.DOTALL)
_PY_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def code_format_score(text: str) -> float:
    """DiffuCoder's code_format_reward: one ```python block that ends the completion (and a newline)
    with nothing fenced before it; 1.0 if it parses as Python, 0.5 if not, else 0."""
    if not _CODE_FORMAT.fullmatch(text):
        return 0.0
    blocks = _PY_BLOCK.findall(text)
    if not blocks:
        return 0.0
    try:
        ast.parse(blocks[0].strip())
        return 1.0
    except SyntaxError:
        return 0.5
    except Exception:  # noqa: BLE001 - e.g. null bytes: DiffuCoder's ast.parse would raise and fail the batch
        return 0.0


@_rows
def diffucoder_code_format(completion: str, **_: Any) -> float:
    return code_format_score(completion)


def diffucoder_code_reward(completions: list[str], *, tests: Any = None, setup: Any = None,
                           **kwargs: Any) -> list[float | None]:
    """DiffuCoder's code_reward: the fraction of the row's asserts that pass, for completions whose
    format reward is 1.0 (others 0). The first ```python block runs in ddrl's sandbox
    (ddrl.rewards.code.code_reward with partial_credit=True) instead of E2B."""
    from ddrl.rewards.code import code_reward

    out: list[float | None] = [0.0] * len(completions)
    todo = [i for i, c in enumerate(completions) if column_value(tests, i) is not None and code_format_score(c) == 1.0]
    if not todo:
        return [None if column_value(tests, i) is None else 0.0 for i in range(len(completions))]
    codes = [_PY_BLOCK.findall(completions[i])[0] for i in todo]
    opts = {k: kwargs[k] for k in ("timeout_s", "memory_mb", "workers", "allow_unsandboxed") if k in kwargs}
    scores = code_reward(codes, tests=[column_value(tests, i) for i in todo],
                         setup=[column_value(setup, i) for i in todo], partial_credit=True, **opts)
    for i, s in zip(todo, scores):
        out[i] = s
    return out


def diffucoder_reward() -> CompositeReward:
    """DiffuCoder's training reward (recipes/config_coupled_code.yaml): code x2.0 + code_format x0.5."""
    return CompositeReward([("code", diffucoder_code_reward, 2.0), ("code_format", diffucoder_code_format, 0.5)])
