"""Prompt pieces several presets share."""

from __future__ import annotations

from typing import Any, Callable

from ddrl.tasks.base import ChatPrompt


def question(example: dict[str, Any]) -> str:
    return str(example["question"])


def with_prefill(prompt_fn: Callable[[dict[str, Any]], str], prefill: str) -> Callable[[dict[str, Any]], ChatPrompt]:
    """The prompt as the user turn, the assistant turn pre-filled with `prefill`."""
    return lambda example: ChatPrompt(user=prompt_fn(example), prefill=prefill)
