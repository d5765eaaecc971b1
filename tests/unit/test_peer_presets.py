"""The peer presets (ddrl/tasks/presets/<paper>.py; their rewards: ddrl/rewards/peers.py) against the
peers' own reward, metric and prompt code.

tests/fixtures/peer_rewards/<paper>.json holds the scores and prompts that ESPO's, SPG's, StableDRL's,
GDSD's and DiffuCoder's own functions gave on fixed completions (tests/fixtures/make_peer_rewards.py,
run on their checkouts at the pinned commits). Each preset must give the same numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddrl.tasks.base import ChatPrompt
from ddrl.tasks.presets import get_preset

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "peer_rewards"
PAPERS = ("espo", "spg", "stable_drl", "gdsd")
TOL = 1e-6  # StableDRL builds float32 tensors: 0.1 comes back as 0.10000000149

# Completions on which ddrl knowingly differs from a peer's run, with the reason. Any other
# difference fails.
MATH_VERIFY_SET = ("math-verify >= 0.6 reads all the \\boxed{} of a completion as one set answer; the peers "
                   "pin 0.5.2, which reads the last one. ddrl uses the installed math-verify")
KNOWN = {("espo", "math500"): {11: MATH_VERIFY_SET}, ("stable_drl", "math500"): {11: MATH_VERIFY_SET}}
EXIT_ZERO = ("DiffuCoder runs each assert as `python3 -c code+assert` and counts exit status 0 as a pass, so "
             "a solution that calls sys.exit(0) passes every assert; ddrl's harness does not count it")


def load(paper: str) -> dict:
    return json.loads((FIXTURES / f"{paper}.json").read_text())


def known(paper: str, task: str) -> set[int]:
    """Indices allowed to differ: the math-verify ones only where it is not the peers' version."""
    import importlib.metadata as md

    if md.version("math-verify") == load(paper)["meta"]["math_verify"]:
        return set()
    return set(KNOWN.get((paper, task), {}))


def cases(key: str) -> list[tuple[str, str]]:
    return [(paper, t["task"]) for paper in PAPERS for t in load(paper)["tasks"] if key in t]


def task_record(paper: str, task: str) -> dict:
    return next(t for t in load(paper)["tasks"] if t["task"] == task)


def assert_scores(got: list, want: list, what: str, allowed: set[int] = frozenset()) -> None:
    assert len(got) == len(want), what
    bad = [(i, g, w) for i, (g, w) in enumerate(zip(got, want))
           if i not in allowed and (g is None or abs(g - w) > TOL)]
    assert not bad, f"{what}: (index, ddrl, peer) {bad}"


@pytest.mark.parametrize("paper,task", cases("reward"))
def test_reward_matches_peer(paper: str, task: str) -> None:
    rec = task_record(paper, task)
    preset = get_preset(paper, task)
    got = preset.reward(rec["completions"], **rec["columns"])
    assert_scores(got, rec["reward"], f"{paper}/{task} reward", known(paper, task))
    parts = preset.reward.score(rec["completions"], **rec["columns"]).parts if rec.get("parts") else {}
    for part, want in rec.get("parts", {}).items():  # each logged part, not only the sum
        weight = preset.reward.weights[part]  # the peer's scores are weighted (d1's parts are not)
        got_part = [None if v is None else weight * v for v in parts[part]]
        assert_scores(got_part, want, f"{paper}/{task} part {part}", known(paper, task))


@pytest.mark.parametrize("paper,task", cases("metric"))
def test_metric_matches_peer(paper: str, task: str) -> None:
    rec = task_record(paper, task)
    got = get_preset(paper, task).metric(rec["completions"], **rec["columns"])
    assert_scores(got, rec["metric"], f"{paper}/{task} metric", known(paper, task))


def _prompt_cases(split: str) -> list[tuple[str, str, int]]:
    return [(paper, task, i) for paper in PAPERS for task, rows in load(paper)["prompts"].get(split, {}).items()
            for i in range(len(rows))]


QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "A shop sells 1,250 pens a day. How many pens does it sell in 4 days?",
    "What is $\\frac{1}{2} + \\frac{1}{4}$?",
    "Find the roots of $x^2 - 5x + 6 = 0$.",
]


def _example(row: dict, task: str) -> dict:
    ex = {k: row[k] for k in ("numbers", "target", "puzzle", "solution") if k in row}
    if task in ("gsm8k", "math500"):
        # the question the peer's prompt builder was given (the fixture's fixed rows)
        ex["question"] = next(q for q in QUESTIONS if q in row["user"])
    return ex




def _as_chat(prompt) -> ChatPrompt:
    return prompt if isinstance(prompt, ChatPrompt) else ChatPrompt(user=prompt)


@pytest.mark.parametrize("paper,task,i", _prompt_cases("train"))
def test_training_prompt_matches_peer(paper: str, task: str, i: int) -> None:
    row = load(paper)["prompts"]["train"][task][i]
    got = _as_chat(get_preset(paper, task).prompt(_example(row, task)))
    assert got.user == row["user"]
    assert got.system == row["system"]
    assert got.prefill == ""


@pytest.mark.parametrize("paper,task,i", _prompt_cases("eval"))
def test_eval_prompt_matches_peer(paper: str, task: str, i: int) -> None:
    row = load(paper)["prompts"]["eval"][task][i]
    got = _as_chat(get_preset(paper, task).prompt_for_eval(_example(row, task)))
    assert (got.user, got.system, got.prefill) == (row["user"], row["system"], row["prefill"])


def test_spg_sudoku_is_three_shot_at_temperature_03() -> None:
    preset = get_preset("spg", "sudoku4x4")
    prompt = preset.prompt({"puzzle": "0310200404001043"})
    assert prompt.count("Question:\nSolve the following Sudoku puzzle:") == 3
    assert preset.notes["train_temperature"] == 0.3 and preset.notes["few_shot"] == 3


def test_metrics_without_a_peer_parser_are_the_reward_verdict() -> None:
    """ESPO/GDSD evaluate GSM8K/MATH with external harnesses, StableDRL ships no puzzle eval: their
    metric is the correctness verdict of the golden reward."""
    for paper, task, correct in (("espo", "gsm8k", 1.0), ("espo", "math500", 1.0), ("stable_drl", "countdown", 1.0)):
        rec = task_record(paper, task)
        want = [1.0 if abs(r - correct) < TOL else 0.0 for r in rec.get("parts", {}).get("correctness", rec["reward"])]
        got = get_preset(paper, task).metric(rec["completions"], **rec["columns"])
        assert_scores(got, want, f"{paper}/{task} metric", known(paper, task))
    for paper in ("gdsd",):
        for task in ("gsm8k", "math500"):
            rec = task_record(paper, task)
            want = [1.0 if c > 0 else 0.0 for c in rec["parts"]["correctness"]]
            assert get_preset(paper, task).metric(rec["completions"], **rec["columns"]) == want, (paper, task)


def test_diffucoder_reward_matches_peer() -> None:
    """DiffuCoder's code reward runs the asserts; ddrl runs them in its sandbox (test_sandbox.py
    requires one on the test machine)."""
    rec = load("diffucoder")["tasks"][0]
    preset = get_preset("diffucoder", "mbpp")
    scored = preset.reward.score(rec["completions"], **rec["columns"])
    got, parts = scored.scores, scored.parts
    exits_zero = rec["completions"].index("```python\nimport sys\ndef add(a, b):\n    sys.exit(0)\n```\n")
    assert_scores(got, rec["reward"], "diffucoder/mbpp reward", {exits_zero})
    assert_scores(parts["code_format"], rec["parts"]["code_format"], "code_format")
    assert_scores(parts["code"], rec["parts"]["code"], "code", {exits_zero})
    assert rec["parts"]["code"][exits_zero] == 1.0 and parts["code"][exits_zero] == 0.0, EXIT_ZERO
    prompt = preset.prompt({"text": "Write add.", "tests": ["assert add(1, 2) == 3"]})
    assert prompt == ChatPrompt(user="Write add.\nTest cases: assert add(1, 2) == 3", system="You are a helpful assistant.")


def test_fixtures_name_their_sources() -> None:
    for paper in (*PAPERS, "diffucoder"):
        meta = load(paper)["meta"]
        assert meta["commit"] and meta["repo"], paper
        assert get_preset(paper, load(paper)["tasks"][0]["task"]).source.split("@")[0] == meta["repo"]


def test_math_verify_rewards_run_off_the_main_thread() -> None:
    """math-verify's timeouts are signals (main thread only); a trainer scoring in a worker thread
    must get the same scores."""
    from concurrent.futures import ThreadPoolExecutor

    rec = task_record("stable_drl", "math500")
    preset = get_preset("stable_drl", "math500")
    main = preset.reward(rec["completions"], **rec["columns"])
    with ThreadPoolExecutor(1) as pool:
        worker = pool.submit(preset.reward, rec["completions"], **rec["columns"]).result()
    assert worker == main
