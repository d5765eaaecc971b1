"""ESPO's presets (ML-GSAI/ESPO @ b5f2dac): gsm8k, math500, countdown, sudoku4x4.

Rewards and metrics: ddrl/rewards/peers.py (what they compute) and ddrl/rewards/d1.py (where ESPO's
code is d1's). Golden test: tests/unit/test_peer_presets.py.
"""

from __future__ import annotations

from typing import Any

from ddrl.rewards.d1 import sudoku_metric_score
from ddrl.rewards.peers import (countdown_eval_metric, d1_countdown_reward, d1_sudoku_reward, espo_gsm8k_reward,
                               espo_math_reward, positive_verdict)
from ddrl.tasks.base import ChatPrompt
from ddrl.tasks.presets import Preset, d1, register_preset
from ddrl.tasks.presets.common import question, with_prefill

_ESPO_BOXED_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
REASONING_FORMAT = d1.FORMAT_INSTRUCTION  # "Respond in the following format: <reasoning> ..."
_COUNTDOWN_TASK = (
    "Using only the numbers {numbers}, create an arithmetic expression that evaluates to exactly {target}. "
    "You must use all numbers from the list, and each number must be used exactly once. You may use the "
    "operations +, -, *, and / as needed. After reasoning, provide only your final expression inside "
    "<answer></answer> tags without including an equals sign or the target number. For example, if the "
    "numbers are [2, 3, 4] and the target is 5, a valid answer is: <answer>\n2*4-3\n</answer>")
_SUDOKU_RULES = (
    "\nPlease solve the following 4x4 Sudoku puzzle. The puzzle is provided as a 16-character string reading "
    "left-to-right, top-to-bottom, where '0' represents empty cells.\n\n")
SUDOKU_RESPOND = (
    "Respond in this exact format:\n<reasoning>\nYour step-by-step solving process\n</reasoning>\n<answer>\n"
    "[16-character solution string with no spaces or separators]\n</answer>\n")
ESPO_SUDOKU_PROMPT = (
    _SUDOKU_RULES
    + "**Rules:**\n- Fill empty cells with digits 1-4.\n- Each row must contain digits 1-4 exactly once.\n"
    "- Each column must contain digits 1-4 exactly once.\n- Each 2x2 box must contain digits 1-4 exactly once.\n\n"
    "**Example:**\nPuzzle: 0401002010030310\nThis puzzle grid looks like this:\n0 4 | 0 1\n0 0 | 2 0\n----+----\n"
    "1 0 | 0 3\n0 3 | 1 0\n\nSolution: 2431312412434312\nThe solved grid looks like this:\n2 4 | 3 1\n3 1 | 2 4\n"
    "----+----\n1 2 | 4 3\n4 3 | 1 2\n\n**Important:** Your solution must be a COMPLETE 16-character string with "
    "only the digits 1-4, representing your final solved grid.\n\n" + SUDOKU_RESPOND)


def countdown_user(example: dict[str, Any], intro: str = REASONING_FORMAT) -> str:
    return intro + "\n" + _COUNTDOWN_TASK.format(numbers=list(example["numbers"]), target=example["target"])


def _espo_sudoku_train(example: dict[str, Any]) -> str:
    return f"{ESPO_SUDOKU_PROMPT}\n\nNow, solve the following Sudoku puzzle: {example['puzzle']}\n"


def espo_sudoku_eval(example: dict[str, Any]) -> ChatPrompt:
    """ESPO's (and GDSD's) eval/data_utils.py SudokuDataset: system prompt, the question, "<reasoning>"."""
    asked = f"Solve the following Sudoku puzzle: {example['puzzle']}\n"
    return ChatPrompt(user=f"{ESPO_SUDOKU_PROMPT}\n\n{asked}", prefill="<reasoning>")


SOURCE = "ML-GSAI/ESPO@b5f2dac"
SAMPLER = {"gen_length": 256, "block_length": 32, "temperature": 0.9}  # recipes/train.yaml + run_*_llada.sh
register_preset(Preset(
    "espo", "gsm8k", prompt=lambda ex: question(ex) + _ESPO_BOXED_SUFFIX, reward=espo_gsm8k_reward,
    metric=positive_verdict(espo_gsm8k_reward, 1.0),
    source=f"{SOURCE} espo/rewards.py:correctness_reward_func_gsm8k, espo/data_utils.py:get_gsm8k_questions",
    notes={"metric": "reward verdict; the paper evaluates GSM8K with LLaDA's OpenCompass scripts", **SAMPLER}))
register_preset(Preset(
    "espo", "math500", prompt=lambda ex: question(ex) + _ESPO_BOXED_SUFFIX, reward=espo_math_reward,
    metric=positive_verdict(espo_math_reward, 1.0),
    source=f"{SOURCE} espo/rewards.py:correctness_reward_func_math, espo/data_utils.py:get_math_questions",
    notes={"metric": "reward verdict; the paper evaluates MATH with LLaDA's OpenCompass scripts",
           "answer": "the MATH solution (with \\boxed{}); a bare answer is boxed", **SAMPLER}))
register_preset(Preset(
    "espo", "countdown", prompt=countdown_user, reward=d1_countdown_reward,
    metric=countdown_eval_metric, eval_prompt=with_prefill(countdown_user, "<reasoning>"),
    source=f"{SOURCE} espo/rewards.py:reward_func_countdown (= d1's), eval/parse_and_get_acc.py",
    notes={"metric": "eval/parse_and_get_acc.py:parse_countdown_answers", "beta": 3e-3, "epsilon": 0.0}))
register_preset(Preset(
    "espo", "sudoku4x4", prompt=_espo_sudoku_train, reward=d1_sudoku_reward, metric=sudoku_metric_score,
    eval_prompt=espo_sudoku_eval,
    source=f"{SOURCE} espo/rewards.py:reward_func_sudoku (= d1's), eval/parse_and_get_acc.py",
    notes={"metric": "eval/parse_and_get_acc.py:parse_sudoku_answers", "beta": 1e-2}))
