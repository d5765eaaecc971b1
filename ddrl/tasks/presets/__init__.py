"""Paper presets: a paper's own prompt, reward and accuracy metric for one task, chosen by one line.

A recipe that reproduces a published table needs the paper's prompt (system prompt, assistant
pre-fill), its training reward (the exact functions, regexes and weights) and its evaluation
metric (its parsers and what it counts as correct), which differ from ddrl's defaults and from
paper to paper. A preset bundles the three for one (paper, task) pair:

    task = get_task("gsm8k", train_path=..., test_path=..., preset="d1")
    preset = get_preset("d1", "gsm8k")
    preset.prompt(example)                 # str or ChatPrompt, the training prompt
    preset.eval_prompt(example)            # the evaluation prompt (d1 pre-fills "<reasoning>")
    preset.reward(completions, **columns)  # list[float | None], the training reward
    preset.metric(completions, **columns)  # list[float], per-item accuracy as the paper scores it

Each paper's presets live in this package, one module a paper (d1, espo, spg, stable_drl, gdsd,
diffucoder); they register themselves when imported, on the first lookup. Their reward and metric
functions are plain functions in ddrl/rewards/ (d1.py, peers.py), which never import tasks.
Columns are the task's example columns: gsm8k/math500 "question", "answer"; countdown "numbers",
"target"; sudoku4x4 "puzzle", "solution".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ddrl.tasks.base import ChatPrompt

PromptFn = Callable[[dict[str, Any]], "str | ChatPrompt"]
ScoreFn = Callable[..., list[Any]]

_PRESETS: dict[tuple[str, str], "Preset"] = {}


@dataclass(frozen=True)
class Preset:
    paper: str  # "d1", "espo", "spg", "stable_drl", "gdsd", "diffucoder"
    task: str  # a registered task name
    prompt: PromptFn  # example -> training prompt
    reward: ScoreFn  # reward(completions, **columns) -> list[float | None]
    metric: ScoreFn  # metric(completions, **columns) -> list[float] in [0, 1], the paper's accuracy per item
    eval_prompt: PromptFn | None = None  # example -> evaluation prompt; None = `prompt`
    source: str = ""  # repo@commit file:function the preset reproduces (its golden test's source)
    notes: dict[str, Any] = field(default_factory=dict)  # anything else a recipe should know (e.g. sampler)

    def prompt_for_eval(self, example: dict[str, Any]) -> "str | ChatPrompt":
        return (self.eval_prompt or self.prompt)(example)


def register_preset(preset: Preset) -> Preset:
    key = (preset.paper, preset.task)
    if key in _PRESETS:
        raise ValueError(f"preset {preset.paper!r} for task {preset.task!r} is registered twice")
    _PRESETS[key] = preset
    return preset


def _load_all() -> None:
    # On first lookup, not at import: each paper module imports this one for `Preset` and `register_preset`.
    from ddrl.tasks.presets import d1, diffucoder, espo, gdsd, spg, stable_drl  # noqa: F401


def get_preset(paper: str, task: str) -> Preset:
    """The preset of `paper` for `task`; an unknown pair fails listing the ones that exist."""
    _load_all()
    if (paper, task) not in _PRESETS:
        have = ", ".join(f"{p}/{t}" for p, t in sorted(_PRESETS)) or "(none)"
        raise ValueError(f"no preset {paper!r} for task {task!r}; available: {have}")
    return _PRESETS[(paper, task)]


def presets() -> list[Preset]:
    _load_all()
    return [_PRESETS[k] for k in sorted(_PRESETS)]
