"""StableDRL's presets (JianyuanZhong/StableDRL @ 26ad014): gsm8k, math500, countdown, sudoku4x4.

Golden test: tests/unit/test_peer_presets.py.
"""

from __future__ import annotations

from typing import Any

from ddrl.rewards.peers import (d1_sudoku_reward, positive_verdict, stable_drl_countdown, stable_drl_gsm8k_correctness,
                               stable_drl_math_correctness, stable_drl_reward)
from ddrl.tasks.presets import Preset, register_preset
from ddrl.tasks.presets.common import question

_STABLE_BOXED_INSTRUCTION = r"(Please put the final answer in \\boxed{} tag, i.e. $\\boxed{answer here}$)"


def _stable_sudoku_prompt(example: dict[str, Any]) -> str:
    return (f"Solve this 4x4 Sudoku puzzle: {str(example['puzzle']).zfill(16)}. Use 0 for empty cells. Please put "
            "the reasoning in <reasoning> tags and the solution string in <answer> tags.")


def _stable_countdown_prompt(example: dict[str, Any]) -> str:
    return (f"Given numbers {list(example['numbers'])}, find an equation that equals {example['target']}. Please put "
            "the reasoning in <reasoning> tags and the final equation in <answer> tags, e.g. <answer> 1 + 1 </answer>.")


SOURCE = "JianyuanZhong/StableDRL@26ad014"
SAMPLER = {"gen_length": 256, "block_length": 32, "steps": 128, "temperature": 0.9}  # configs/*_spg_snis.yaml
boxed_prompt = lambda ex: question(ex) + _STABLE_BOXED_INSTRUCTION  # noqa: E731
register_preset(Preset(
    "stable_drl", "gsm8k", prompt=boxed_prompt, reward=stable_drl_reward(stable_drl_gsm8k_correctness),
    metric=positive_verdict(stable_drl_gsm8k_correctness, 1.0), eval_prompt=question,
    source=f"{SOURCE} dataloaders/math.py:reward_mixed + networks/llada_svpo.py:anti_short_boxed_reward",
    notes={"metric": "math_metrics.py:judge_answer_GSM8K (math-verify on the raw completion)",
           "prompt": "training appends the boxed instruction (collate_fn_mixed); math_metrics.py evaluates "
                     "on the raw question", **SAMPLER}))
register_preset(Preset(
    "stable_drl", "math500", prompt=boxed_prompt, reward=stable_drl_reward(stable_drl_math_correctness),
    metric=positive_verdict(stable_drl_math_correctness, 1.0),
    eval_prompt=lambda ex: question(ex) + _STABLE_BOXED_INSTRUCTION.replace("\\\\", "\\"),
    source=f"{SOURCE} dataloaders/math.py:reward_mixed + networks/llada_svpo.py:anti_short_boxed_reward",
    notes={"metric": "math_metrics.py:judge_answer_MATH", "answer": "the MATH solution (math-verify "
           "reads its last \\boxed{})", "train_data": "MATH train, level <= 4 (math_max_level)", **SAMPLER}))
register_preset(Preset(
    "stable_drl", "countdown", prompt=_stable_countdown_prompt, reward=stable_drl_reward(stable_drl_countdown),
    metric=positive_verdict(stable_drl_countdown, 1.0),
    source=f"{SOURCE} dataloaders/logic_puzzles.py:reward_countdown + anti_short_boxed_reward",
    notes={"metric": "reward verdict (StableDRL ships no Countdown evaluation)", **SAMPLER}))
register_preset(Preset(
    "stable_drl", "sudoku4x4", prompt=_stable_sudoku_prompt, reward=stable_drl_reward(d1_sudoku_reward),
    metric=d1_sudoku_reward,
    source=f"{SOURCE} dataloaders/logic_puzzles.py:reward_sudoku + anti_short_boxed_reward",
    notes={"metric": "correct blanks / blanks of the reward (StableDRL ships no Sudoku evaluation)", **SAMPLER}))
