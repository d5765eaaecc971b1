"""GDSD's presets (GaryBall/GDSD @ 3fb6780): gsm8k, math500, countdown, sudoku4x4.

Golden test: tests/unit/test_peer_presets.py.
"""

from __future__ import annotations

from typing import Any

from ddrl.rewards.d1 import sudoku_metric_score
from ddrl.rewards.peers import (countdown_eval_metric, d1_countdown_reward, d1_sudoku_reward, five_function_reward,
                               gdsd_math_correctness, gdsd_math_reward, part_verdict, positive_verdict)
from ddrl.tasks.presets import Preset, register_preset
from ddrl.tasks.presets.common import question, with_prefill
from ddrl.tasks.presets.espo import REASONING_FORMAT, SUDOKU_RESPOND, countdown_user, espo_sudoku_eval

GDSD_SUDOKU_PROMPT = (
    "\nPlease solve the following 4x4 Sudoku puzzle. The puzzle is provided as a 16-character\nstring reading "
    "left-to-right, top-to-bottom, where '0' represents empty cells.\n\nRules:\n- Fill empty cells with digits 1-4.\n"
    "- Each row must contain digits 1-4 exactly once.\n- Each column must contain digits 1-4 exactly once.\n"
    "- Each 2x2 box must contain digits 1-4 exactly once.\n\n" + SUDOKU_RESPOND)


def _gdsd_countdown(example: dict[str, Any]) -> str:
    return (f"{REASONING_FORMAT}\nUsing only the numbers {list(example['numbers'])}, create an arithmetic expression "
            f"that evaluates to exactly {example['target']}. Use every number exactly once. Use +, -, *, and / as "
            "needed. Put only the final expression inside <answer></answer> tags.")


SOURCE = "GaryBall/GDSD@3fb6780"
gsm_reward = five_function_reward(dotall=True)
register_preset(Preset(
    "gdsd", "gsm8k", prompt=lambda ex: REASONING_FORMAT + "\n\n" + question(ex), reward=gsm_reward,
    metric=part_verdict(five_function_reward(dotall=True), "correctness"),
    source=f"{SOURCE} gdsd/rewards.py (dataset gsm8k_xml: 5 functions), scripts/run_gdsd_llada_gsm8k.sh",
    notes={"metric": "correctness part; GDSD evaluates GSM8K with lm-eval (math_eval/)",
           "dataset_name": "gsm8k_xml (its 'gsm8k' is ESPO's reward: the espo preset)",
           "lr": 3e-6, "beta": 1e-3, "psi": 10.0}))
register_preset(Preset(
    "gdsd", "math500",
    prompt=lambda ex: (f"{REASONING_FORMAT}\n\nYou are a math expert. Solve the problem step by step. "
                       f"Wrap the final answer in a \\boxed{{}}.\n\n{question(ex)}"),
    reward=gdsd_math_reward(), metric=positive_verdict(gdsd_math_correctness, 2.0),
    source=f"{SOURCE} gdsd/rewards.py (dataset math_xml), scripts/run_gdsd_llada_math.sh",
    notes={"metric": "correctness part; GDSD evaluates MATH with lm-eval (math_eval/)",
           "answer": "the MATH solution (with \\boxed{}); a bare answer is boxed",
           "lr": 1e-5, "beta": 1e-4, "psi": 10.0}))
register_preset(Preset(
    "gdsd", "countdown", prompt=_gdsd_countdown, reward=d1_countdown_reward, metric=countdown_eval_metric,
    eval_prompt=with_prefill(countdown_user, "<reasoning>"),
    source=f"{SOURCE} gdsd/rewards.py:reward_func_countdown (= d1's), eval/parse_and_get_acc.py",
    notes={"metric": "eval/parse_and_get_acc.py:parse_countdown_answers"}))
register_preset(Preset(
    "gdsd", "sudoku4x4", prompt=lambda ex: f"{GDSD_SUDOKU_PROMPT}\n\nNow solve this Sudoku puzzle: {ex['puzzle']}\n",
    reward=d1_sudoku_reward, metric=sudoku_metric_score, eval_prompt=espo_sudoku_eval,  # ESPO's eval/
    source=f"{SOURCE} gdsd/rewards.py:reward_func_sudoku (= d1's), eval/parse_and_get_acc.py",
    notes={"metric": "eval/parse_and_get_acc.py:parse_sudoku_answers"}))
