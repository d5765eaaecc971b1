"""d1's presets (Zhao et al. 2025, "d1: Scaling Reasoning in Diffusion LLMs via RL", diffu-GRPO).

One `Preset` per task (gsm8k, math500, countdown, sudoku4x4), reproducing dllm-reasoning/d1 @ 837888f:

- `prompt`: d1's training prompt (diffu-grpo/data_utils.py). Its format instruction, which opens
  with a newline, is part of the single user message; nothing is pre-filled.
- `eval_prompt`: d1's evaluation prompt (eval/{gsm8k,math500,countdown,sudoku}.py): the task's
  \\boxed{} instruction, also inside the user message (d1 uses no system role), and the assistant
  turn pre-filled with "<reasoning>" after the chat template's generation prompt.
- `reward` and `metric`: d1's training reward and evaluation verdict, from ddrl/rewards/d1.py
  (what they compute, and the facts of d1's code they keep, is written there).

The golden test is tests/unit/test_d1_presets.py.
"""

from __future__ import annotations

from typing import Any, Callable

from ddrl.rewards.composite import CompositeReward
from ddrl.rewards.d1 import (SOURCE, countdown_metric_score, countdown_numbers, countdown_reward,
                             gsm8k_metric_score, gsm8k_reward, math500_reward, math_metric_score,
                             sudoku_metric_score, sudoku_reward)
from ddrl.tasks.base import ChatPrompt
from ddrl.tasks.presets import Preset, register_preset

# ---------------------------------------------------------------------------------------------
# Prompts (the texts are d1's, byte for byte: their newlines and trailing spaces are part of the
# model's input)

FORMAT_INSTRUCTION = (
    "\nRespond in the following format:\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>\n")

SUDOKU_INSTRUCTION = (
    "\nPlease solve the following 4x4 Sudoku puzzle. The puzzle is provided as a 16-character string "
    "reading left-to-right, top-to-bottom, where '0' represents empty cells.\n\n"
    "Rules:\n- Fill empty cells with digits 1-4\n- Each row must contain digits 1-4 exactly once\n"
    "- Each column must contain digits 1-4 exactly once\n- Each 2x2 box must contain digits 1-4 exactly once\n\n"
    "Important: Your solution must be a COMPLETE 16-character string with only the digits 1-4, "
    "representing your final solved grid.\n\n"
    "Respond in this exact format:\n<reasoning>\nYour step-by-step solving process\n</reasoning>\n"
    "<answer>\n[16-character solution string with no spaces or separators]\n</answer>\n")

_MATH_EXPERT = ("You are a math expert. You will be given a question to solve. Solve it step by step. "
                "Wrap the final answer in a \\boxed{}.")
_BOXED_FORMAT = ("Respond in the following format:\n<reasoning>\nYour reasoning here\n</reasoning>\n"
                 "<answer>\n\\boxed{...}\n</answer>")

EVAL_GSM8K_INSTRUCTION = f"{_MATH_EXPERT} \n{_BOXED_FORMAT}"
EVAL_MATH500_INSTRUCTION = f'{_MATH_EXPERT}\n{_BOXED_FORMAT}" \n'  # d1's text has the stray quote
EVAL_COUNTDOWN_INSTRUCTION = (
    "Using only the provided numbers, create an arithmetic expression that evaluates to exactly the "
    "provided target number. You may use the operations +, -, *, and / as needed, but each number must "
    "be used exactly once. Think step-by-step. After reasoning, provide only your final expression "
    "inside \\boxed{} tags without including an equals sign or the target number. For example: "
    "\\boxed{a + b * c}" + _BOXED_FORMAT)
EVAL_PREFILL = "<reasoning>"


def _sudoku_question(puzzle: str) -> str:
    return f"Solve the following Sudoku puzzle: {puzzle}\n"


def train_prompt_gsm8k(example: dict[str, Any]) -> str:
    return f"{FORMAT_INSTRUCTION}\n\n{example['question']}"


def train_prompt_math500(example: dict[str, Any]) -> str:
    return f"{FORMAT_INSTRUCTION}\n\n{_MATH_EXPERT} \n\n{example['question']}"


def train_prompt_countdown(example: dict[str, Any]) -> str:
    numbers, target = countdown_numbers(example["numbers"]), example["target"]
    return (f"{FORMAT_INSTRUCTION}\nUsing only the numbers {numbers}, create an arithmetic expression that "
            f"evaluates to exactly {target}. You must use all numbers from the list, and each number must be "
            f"used exactly once. You may use the operations +, -, *, and / as needed. After reasoning, provide "
            f"only your final expression inside <answer></answer> tags without including an equals sign or "
            f"the target number. For example, if the numbers are [2, 3, 4] and the target is 5, a valid answer "
            f"is: <answer>\n2*4-3\n</answer>")


def train_prompt_sudoku(example: dict[str, Any]) -> str:
    return f"{SUDOKU_INSTRUCTION}\n\n{_sudoku_question(example['puzzle'])}"


def _eval_prompt(instruction: str, question: str) -> ChatPrompt:
    return ChatPrompt(user=f"{instruction}\n\n{question}", prefill=EVAL_PREFILL)


def eval_prompt_gsm8k(example: dict[str, Any]) -> ChatPrompt:
    return _eval_prompt(EVAL_GSM8K_INSTRUCTION, example["question"])


def eval_prompt_math500(example: dict[str, Any]) -> ChatPrompt:
    return _eval_prompt(EVAL_MATH500_INSTRUCTION, example["question"])


def eval_prompt_countdown(example: dict[str, Any]) -> ChatPrompt:
    question = f"Numbers: {countdown_numbers(example['numbers'])}\nTarget: {int(example['target'])}"
    return _eval_prompt(EVAL_COUNTDOWN_INSTRUCTION, question)


def eval_prompt_sudoku(example: dict[str, Any]) -> ChatPrompt:
    return _eval_prompt(SUDOKU_INSTRUCTION, _sudoku_question(example["puzzle"]))


# ---------------------------------------------------------------------------------------------
# Presets

_EVAL_SAMPLER = {  # eval/eval.py and eval/generate.py
    "gen_lengths": [128, 256, 512], "block_length": 32, "steps": "gen_length // 2", "temperature": 0.0,
    "remasking": "low_confidence", "cfg_scale": 0.0, "few_shot": 0,
    "decode_special_tokens": True,  # metric input keeps <|eot_id|> / <|endoftext|> (skip_special_tokens=False)
}


def _register(task: str, prompt: Callable, eval_prompt: Callable, reward: CompositeReward,
              metric: Callable, files: str, **notes: Any) -> Preset:
    return register_preset(Preset(
        paper="d1", task=task, prompt=prompt, eval_prompt=eval_prompt, reward=reward, metric=metric,
        source=f"{SOURCE} {files}", notes={"eval_sampler": dict(_EVAL_SAMPLER), **notes}))


GSM8K = _register("gsm8k", train_prompt_gsm8k, eval_prompt_gsm8k, gsm8k_reward(), gsm8k_metric_score,
                  "diffu-grpo/reward_func.py:{xmlcount,soft_format,strict_format,int,correctness}_reward_func; "
                  "eval/parse_and_get_acc.py:parse_gsm_answers", test_set="GSM8K test, all 1319")
MATH500 = _register("math500", train_prompt_math500, eval_prompt_math500, math500_reward(), math_metric_score,
                    "diffu-grpo/reward_func.py:correctness_reward_func_math,boxed_and_answer_tags_format_reward; "
                    "eval/parse_and_get_acc.py:parse_math_answers", test_set="MATH-500, all 500")
COUNTDOWN = _register("countdown", train_prompt_countdown, eval_prompt_countdown, countdown_reward(),
                      countdown_metric_score, "diffu-grpo/reward_func.py:countdown_reward_func; "
                      "eval/parse_and_get_acc.py:parse_countdown_answers",
                      test_set="dataset/countdown_cd3_test.jsonl, 256 items", train_numbers=3)
SUDOKU = _register("sudoku4x4", train_prompt_sudoku, eval_prompt_sudoku, sudoku_reward(), sudoku_metric_score,
                   "diffu-grpo/reward_func.py:sudoku_reward_func; eval/parse_and_get_acc.py:parse_sudoku_answers",
                   test_set="dataset/4x4_test_sudoku.csv, 256 of 500 items",
                   accuracy="total correct cells / total blank cells")
