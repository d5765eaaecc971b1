"""SPG's presets (facebookresearch/SPG @ a1c7120): gsm8k, math500, countdown, sudoku4x4.

SPG's spg/data_utils.py, reward_func.py and eval/ are d1's for GSM8K, MATH and Countdown; its Sudoku
trains on a 3-shot prompt. Golden test: tests/unit/test_peer_presets.py.
"""

from __future__ import annotations

from typing import Any

from ddrl.rewards.d1 import countdown_metric_score, math500_reward, math_metric_score, sudoku_metric_score
from ddrl.rewards.peers import d1_countdown_reward, d1_sudoku_reward, five_function_reward, spg_gsm8k_metric
from ddrl.tasks.base import ChatPrompt
from ddrl.tasks.presets import Preset, d1, register_preset

D1_SUDOKU_PROMPT = d1.SUDOKU_INSTRUCTION  # SPG trains on d1's Sudoku instruction
# SPG's three worked 4x4 examples (spg/data_utils.py short_example_1..3; eval/sudoku.py has the same).
_SPG_SHOTS = (
    ("3014002020004130", "R1: 3 0 1 4\nR2: 0 0 2 0\nR3: 2 0 0 0\nR4: 4 1 3 0",
     "R1 missing 2 → R1C2=2.\nR4 missing 2 → R4C4=2.\nBox D (R3-4,C3-4) then needs {1,4}; column4 can only "
     "accept 1 → R3C4=1, R3C3=4.\nR3 now missing 3 → R3C2=3.\nColumn1 missing 1 → R2C1=1.\nColumn2 missing 4 "
     "→ R2C2=4.\nLast cell R2C4=3.", "3214142323414132"),
    ("0000100420013142", "R1: 0 0 0 0\nR2: 1 0 0 4\nR3: 2 0 0 1\nR4: 3 1 4 2",
     "Col1 missing 4 → R1C1=4.\nCol4 missing 3 → R1C4=3.\nBox A (R1-2,C1-2) missing {2,3} and R1 now needs "
     "{1,2} → R1C2=2, R2C2=3.\nR1C3=1.\nR2 now missing 2 → R2C3=2.\nCol2 missing 4 → R3C2=4, then R3C3=3.",
     "4213132424313142"),
    ("2001403002001420", "R1: 2 0 0 1\nR2: 4 0 3 0\nR3: 0 2 0 0\nR4: 1 4 2 0",
     "R1 missing {3,4}; Col2 can't be 1 so R1C2=3 → R1C3=4.\nR4 missing 3 → R4C4=3.\nCol4 missing {2,4}; R2 "
     "must take 2 → R2C4=2 → R2C2=1.\nCol1 missing 3 → R3C1=3.\nCol3 missing 1 → R3C3=1 → R3C4=4.",
     "2341413232141423"),
)


def _grid_rows(solution: str) -> str:
    return "\n".join(f"R{r + 1}: " + " ".join(solution[4 * r:4 * r + 4]) for r in range(4))


def spg_sudoku_shots(n: int = 3) -> str:
    shots = [f"Question:\nSolve the following Sudoku puzzle: {p}\nAnswer:\n<reasoning>\nInterpret puzzle as 4 rows "
             f"of 4:\n{rows}\n\nFill easy singles:\n{steps}\n\nFinal grid:\n{_grid_rows(sol)}\n</reasoning>\n"
             f"<answer>\n{sol}\n</answer>" for p, rows, steps, sol in _SPG_SHOTS[:n]]
    return "\n\n".join(shots)


def _spg_sudoku_train(example: dict[str, Any]) -> str:
    return (f"{D1_SUDOKU_PROMPT}\n\n{spg_sudoku_shots()}\n\nQuestion: Solve the following Sudoku puzzle: "
            f"{example['puzzle']}\nAnswer:\n")


def _spg_sudoku_eval(example: dict[str, Any]) -> ChatPrompt:
    question = f"Solve the following Sudoku puzzle: {example['puzzle']}\n"
    return ChatPrompt(user=f"{D1_SUDOKU_PROMPT}\n\n{spg_sudoku_shots()}\n\nQuestion: {question}\nAnswer:\n",
                      prefill="<reasoning>")


# SPG's spg/data_utils.py, reward_func.py and eval/ are d1's for GSM8K, MATH and Countdown.
SOURCE = "facebookresearch/SPG@a1c7120"
register_preset(Preset(
    "spg", "gsm8k", prompt=d1.train_prompt_gsm8k, reward=five_function_reward(dotall=False),
    metric=spg_gsm8k_metric, eval_prompt=d1.eval_prompt_gsm8k,
    source=f"{SOURCE} spg/reward_func.py (5 functions), spg/data_utils.py, eval/parse_and_get_acc.py",
    notes={"metric": "eval/parse_and_get_acc.py:parse_gsm_answers (d1's plus a fallback to the last <answer>)",
           "eubo_beta": 1.5}))
register_preset(Preset(
    "spg", "math500", prompt=d1.train_prompt_math500, reward=math500_reward(),
    metric=math_metric_score, eval_prompt=d1.eval_prompt_math500,
    source=f"{SOURCE} spg/reward_func.py:correctness_reward_func_math + boxed_and_answer_tags_format_reward",
    notes={"metric": "eval/parse_and_get_acc.py:parse_math_answers", "eubo_beta": 1.5,
           "answer": "the MATH solution (with \\boxed{})"}))
register_preset(Preset(
    "spg", "countdown", prompt=d1.train_prompt_countdown, reward=d1_countdown_reward,
    metric=countdown_metric_score, eval_prompt=d1.eval_prompt_countdown,
    source=f"{SOURCE} spg/reward_func.py:countdown_reward_func, eval/parse_and_get_acc.py",
    notes={"metric": "eval/parse_and_get_acc.py:parse_countdown_answers (reads the last \\boxed{})",
           "eubo_beta": 2.0}))
register_preset(Preset(
    "spg", "sudoku4x4", prompt=_spg_sudoku_train, reward=d1_sudoku_reward, metric=sudoku_metric_score,
    eval_prompt=_spg_sudoku_eval,
    source=f"{SOURCE} spg/data_utils.py:get_sudoku_questions_new(few_shot=3), eval/sudoku.py --few_shot 3",
    notes={"metric": "eval/parse_and_get_acc.py:parse_sudoku_answers", "few_shot": 3,
           "train_temperature": 0.3, "eval_temperature": 0.0, "eubo_beta": 1.0, "max_prompt_length": 1500,
           "data": "dataset/train_sudoku_split_new.csv / test_sudoku_split_new.csv (solution-disjoint; "
                   "dataset/generate_new_sudoku_splitting.py), not d1's 4x4 files"}))
