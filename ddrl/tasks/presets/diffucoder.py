"""DiffuCoder's preset (apple/ml-diffucoder @ f735e01): mbpp.

Golden test: tests/unit/test_peer_presets.py.
"""

from __future__ import annotations

from typing import Any

from ddrl.rewards.peers import diffucoder_reward
from ddrl.tasks.base import ChatPrompt
from ddrl.tasks.presets import Preset, register_preset

def _diffucoder_prompt(example: dict[str, Any]) -> ChatPrompt:
    question = str(example.get("question") or example.get("text") or "")
    tests = example.get("tests") or []
    first = tests[0] if isinstance(tests, (list, tuple)) and tests else None
    if first is not None and "\n```\n" not in question:
        question += "\nTest cases: " + str(first)
    return ChatPrompt(user=question, system="You are a helpful assistant.")


def metric(completions: list[str], **columns: Any) -> list[float]:
    from ddrl.rewards.code import code_reward

    return [float(s) for s in code_reward(completions, tests=columns["tests"], setup=columns.get("setup"))]

register_preset(Preset(
    "diffucoder", "mbpp", prompt=_diffucoder_prompt, reward=diffucoder_reward(), metric=metric,
    source="apple/ml-diffucoder@f735e01 src/open_r1/rewards.py:code_reward+get_code_format_reward, "
           "recipes/config_coupled_code.yaml (weights 2.0, 0.5), src/open_r1/grpo.py:make_conversation",
    notes={"metric": "all tests pass (ddrl's code extraction); DiffuCoder reports EvalPlus HumanEval/MBPP",
           "execution": "ddrl sandbox, one module per completion (DiffuCoder: one python3 process per assert)",
           "train_data": "AceCode-hard (recipes/process_data.py), columns question + test_cases",
           "model_family": "dream"}))
