"""Math word problems for Hugging Face models (chat format): gsm_symbolic, gsm8k, math500.

Prompt: d1's instruction (answer in <reasoning>...</reasoning><answer>...</answer>) followed by the
question. The prompt is the user message; the model adapter applies its chat template.
Reward (d1, Zhao et al. 2025): `correctness_weight` (2.0) x math-verify correctness of the
<answer> (or \\boxed{}) against the gold answer + `format_weight` (0.5) x the soft format check.
`Task.correct` counts the correctness part only; each part is logged (`task.score(...).parts`).

- gsm_symbolic: reasoning-gym's GSM-Symbolic templates, split train/dev/test by question hash.
- gsm8k / math500: local files, `train_path` + `test_path` (JSONL/JSON/CSV/parquet; `path` alone is
  the test file, split="hash" splits it by question hash), or a `datasets` hub name (`dataset=`,
  needs `pip install datasets`); see ddrl/tasks/paper_data.py. The formats are the papers' (d1, SPG,
  ESPO, GDSD, StableDRL all read these hub sets): GSM8K {"question", "answer": "... #### 42"};
  MATH {"problem", "solution" (its last \\boxed{} is the answer), "answer" (optional, preferred)}.
  `question_field`/`answer_field` name other columns. Examples: "prompt", "question", "answer" (the
  bare gold answer; with a preset, the answer field as written, which the paper's code parses) and,
  for MATH rows, "solution". `preset="d1"` etc. swaps in a paper's prompt, reward and metric.
"""

from __future__ import annotations

from typing import Any

from ddrl.registry import TASKS
from ddrl.rewards.composite import CompositeReward, RewardResult
from ddrl.rewards.format import soft_format_reward
from ddrl.rewards.math import gold_answer, math_correctness_reward
from ddrl.tasks import ReasoningGymTask, check_format
from ddrl.tasks.paper_data import DEFAULT_DEV_FRACTION, DataSource, FileTask, PresetMixin
from ddrl.tasks.paper_data import read_records  # noqa: F401  (re-exported: code_tasks imports it from here)

D1_SYSTEM_PROMPT = (
    "Respond in the following format:\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>\n"
)


def chat_prompt(question: str) -> str:
    return f"{D1_SYSTEM_PROMPT}\n{question.strip()}"


class MathRewardMixin:
    """d1's correctness x2.0 + format x0.5, with per-part logging and correctness-only accuracy."""

    def _init_reward(self, correctness_weight: float, format_weight: float) -> None:
        self._reward = CompositeReward([("correctness", math_correctness_reward, correctness_weight),
                                        ("format", soft_format_reward, format_weight)])
        self._last_scored: tuple[tuple[Any, ...], RewardResult] | None = None

    def score(self, completions: list[str], **columns: Any) -> RewardResult:
        result = self._reward.score(completions, **columns)
        self._last_scored = ((list(completions), list(columns.get("answer") or [])), result)
        return result

    def reward(self, completions: list[str], **columns: Any) -> list[float | None]:
        return self.score(completions, **columns).scores

    def correct(self, completions: list[str], **columns: Any) -> list[bool]:
        key = (list(completions), list(columns.get("answer") or []))
        # evaluation calls reward then correct on the same completions: verify once
        result = self._last_scored[1] if self._last_scored and self._last_scored[0] == key else self.score(
            completions, **columns)
        return [s is not None and s >= 1.0 for s in result.parts["correctness"]]


@TASKS.register("gsm_symbolic")
class GSMSymbolicTask(MathRewardMixin, ReasoningGymTask):
    """reasoning-gym gsm_symbolic. Args: correctness_weight, format_weight, format ("chat" only)."""

    name = "gsm_symbolic"
    dataset_name = "gsm_symbolic"
    test_fraction = 0.1
    gen_length = 256

    def __init__(self, correctness_weight: float = 2.0, format_weight: float = 0.5, format: str = "chat"):
        super().__init__()
        self.format = check_format(self.name, format, ("chat",))
        self._init_reward(correctness_weight, format_weight)
        self.success_threshold = correctness_weight

    def _rg_config(self) -> dict[str, Any]:
        return {}

    def _example(self, item: dict[str, Any]) -> dict[str, Any]:
        question = item["question"]
        return {"prompt": chat_prompt(question), "question": question, "answer": str(item["answer"])}

    def _split_key(self, example: dict[str, Any]) -> str:
        return example["question"]


class MathFileTask(PresetMixin, MathRewardMixin, FileTask):
    """A question/answer dataset from local files or the `datasets` hub (ddrl/tasks/paper_data.py).

    Args: train_path + test_path (the normal form) | test_path or path (evaluation only: every row
    is a test row) | path + split="hash" (+ test_fraction, default 0.1) | dataset (+ dataset_config,
    train_split, test_split); dev_fraction (the share of train rows held out as dev, default 0.1);
    question_field, answer_field; correctness_weight, format_weight;
    preset (a paper's prompt, reward and metric: "d1", "espo", ...); format ("chat" only).
    """

    gen_length = 256
    default_question_field = "question"
    default_answer_field = "answer"
    fallback_answer_fields: tuple[str, ...] = ()
    default_dataset: tuple[str | None, str | None] = (None, None)  # shown in errors only

    def __init__(self, path: str | None = None, *, train_path: str | None = None, test_path: str | None = None,
                 dataset: str | None = None, dataset_config: str | None = None, train_split: str = "train",
                 test_split: str = "test", split: str | None = None, test_fraction: float | None = None,
                 dev_fraction: float = DEFAULT_DEV_FRACTION, question_field: str | None = None,
                 answer_field: str | None = None,
                 correctness_weight: float = 2.0, format_weight: float = 0.5, format: str = "chat",
                 preset: str | None = None):
        self.format = check_format(self.name, format, ("chat",))
        hub, cfg = self.default_dataset
        hint = f" (e.g. dataset={hub!r}" + (f", dataset_config={cfg!r})" if cfg else ")") if hub else ""
        self._init_source(DataSource(self.name, path=path, train_path=train_path, test_path=test_path,
                                     dataset=dataset, dataset_config=dataset_config, train_split=train_split,
                                     test_split=test_split, split=split, test_fraction=test_fraction,
                                     dev_fraction=dev_fraction, example_source=hint))
        self.question_field = question_field or self.default_question_field
        self.answer_field = answer_field or self.default_answer_field
        self._init_reward(correctness_weight, format_weight)
        self.success_threshold = correctness_weight
        self._init_preset(preset)

    def _example(self, row: dict[str, Any], where: str) -> dict[str, Any]:
        if self.question_field not in row:
            raise ValueError(f"{where}: no field {self.question_field!r} (fields: {', '.join(row)}); "
                             f"set question_field=")
        raw = next((row[f] for f in (self.answer_field, *self.fallback_answer_fields) if row.get(f) is not None), None)
        if raw is None:
            raise ValueError(f"{where}: no field {self.answer_field!r} (fields: {', '.join(row)}); set answer_field=")
        question = str(row[self.question_field])
        # A preset compares as its paper does, from the gold as the data writes it (d1 marks
        # \boxed{58500} wrong against MATH-500's "58,500"); ddrl's own reward takes the bare answer.
        answer = gold_answer(raw) if self.preset is None else str(raw)
        example = {"prompt": chat_prompt(question), "question": question, "answer": answer}
        if row.get("solution") is not None:  # MATH: a paper's reward may read the gold \boxed{} itself
            example["solution"] = str(row["solution"])
        return example

    def _split_key(self, example: dict[str, Any]) -> str:
        return example["question"]


@TASKS.register("gsm8k")
class GSM8KTask(MathFileTask):
    """GSM8K: fields question / answer ("... #### 42")."""

    name = "gsm8k"
    default_dataset = ("openai/gsm8k", "main")


@TASKS.register("math500")
class Math500Task(MathFileTask):
    """MATH-500: fields problem / answer, falling back to the \\boxed{} of solution."""

    name = "math500"
    default_question_field = "problem"
    fallback_answer_fields = ("solution",)
    default_dataset = ("HuggingFaceH4/MATH-500", None)
