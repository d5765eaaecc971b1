"""Math word problems for Hugging Face models (chat format): gsm_symbolic, gsm8k, math500.

Prompt: d1's instruction (answer in <reasoning>...</reasoning><answer>...</answer>) followed by the
question. The prompt is the user message; the model adapter applies its chat template.
Reward (d1, Zhao et al. 2025): `correctness_weight` (2.0) x math-verify correctness of the
<answer> (or \\boxed{}) against the gold answer + `format_weight` (0.5) x the soft format check.
`Task.correct` counts the correctness part only; each part is logged (`task.reward_parts`).

- gsm_symbolic: reasoning-gym's GSM-Symbolic templates, split train/test by question hash.
- gsm8k / math500: a local JSONL/JSON/parquet file (`path`, split by question hash with
  `test_fraction`; or `train_path` + `test_path`), or a `datasets` hub name (`dataset=`, needs the
  datasets package; nothing is downloaded otherwise). Gold answers follow GSM8K ("... #### 42") or
  MATH (a solution whose last \\boxed{} is the answer); `question_field`/`answer_field` name the columns.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from ddrl.registry import TASKS
from ddrl.rewards.composite import CompositeReward
from ddrl.rewards.format import soft_format_reward
from ddrl.rewards.math import gold_answer, math_correctness_reward
from ddrl.tasks import ReasoningGymTask, Task, check_format, is_test_key

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
        self._last_scored: tuple[Any, ...] | None = None

    def reward(self, completions: list[str], **columns: Any) -> list[float | None]:
        self._last_scored = (list(completions), list(columns.get("answer") or []))
        return self._reward(completions, **columns)

    @property
    def reward_parts(self) -> dict[str, list[float | None]]:
        """Each part's scores of the last reward call (the trainer logs them as reward/<part>)."""
        return self._reward.last_parts

    def correct(self, completions: list[str], **columns: Any) -> list[bool]:
        if self._last_scored != (list(completions), list(columns.get("answer") or [])):
            self.reward(completions, **columns)  # evaluation calls reward then correct: verify once
        return [s is not None and s >= 1.0 for s in self._reward.last_parts["correctness"]]


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


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a .jsonl / .json (a list of objects) / .parquet file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            try:
                import pandas as pd
            except ImportError:
                raise ImportError(f"reading {path} needs pyarrow or pandas (pip install pyarrow)") from None
            return pd.read_parquet(path).to_dict("records")
        return pq.read_table(path).to_pylist()
    text = path.read_text(encoding="utf-8")
    if suffix == ".json" and text.lstrip().startswith("["):
        rows = json.loads(text)
    else:
        rows = []
        for i, line in enumerate(text.splitlines()):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}: line {i + 1} is not valid JSON ({e})") from None
    if not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{path}: every record must be a JSON object")
    return rows


def _load_hub(dataset: str, config: str | None, split: str) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise ImportError(f"dataset={dataset!r} needs the `datasets` package (pip install datasets); "
                          f"or pass path= to a local JSONL/parquet file") from None
    return [dict(r) for r in datasets.load_dataset(dataset, config, split=split)]


class MathFileTask(MathRewardMixin, Task):
    """A question/answer dataset from a local file or the `datasets` hub (see the module docstring).

    Args: path | train_path + test_path | dataset (+ dataset_config, train_split, test_split);
    question_field, answer_field; test_fraction (for a single `path`); correctness_weight,
    format_weight; format ("chat" only).
    """

    gen_length = 256
    default_question_field = "question"
    default_answer_field = "answer"
    fallback_answer_fields: tuple[str, ...] = ()
    default_dataset: tuple[str | None, str | None] = (None, None)  # shown in errors only

    def __init__(self, path: str | None = None, *, train_path: str | None = None, test_path: str | None = None,
                 dataset: str | None = None, dataset_config: str | None = None, train_split: str = "train",
                 test_split: str = "test", question_field: str | None = None, answer_field: str | None = None,
                 test_fraction: float = 0.1, correctness_weight: float = 2.0, format_weight: float = 0.5,
                 format: str = "chat"):
        self.format = check_format(self.name, format, ("chat",))
        sources = [path is not None, train_path is not None or test_path is not None, dataset is not None]
        if sum(sources) != 1:
            hub, cfg = self.default_dataset
            hint = f" (e.g. dataset={hub!r}" + (f", dataset_config={cfg!r})" if cfg else ")") if hub else ""
            raise ValueError(f"task {self.name!r} needs exactly one data source: path=FILE (split by question "
                             f"hash), train_path=/test_path=FILES, or dataset=HUB_NAME{hint}")
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"{self.name}: test_fraction must be in (0, 1), got {test_fraction}")
        self.path, self.train_path, self.test_path = path, train_path, test_path
        self.dataset, self.dataset_config = dataset, dataset_config
        self.splits = {"train": train_split, "test": test_split}
        self.question_field = question_field or self.default_question_field
        self.answer_field = answer_field or self.default_answer_field
        self.test_fraction = test_fraction
        self._init_reward(correctness_weight, format_weight)
        self.success_threshold = correctness_weight
        self._rows: dict[str, list[dict[str, Any]]] = {}

    # ---- data
    def _load(self, split: str) -> list[dict[str, Any]]:
        """Examples of one split, every record checked (a missing field fails whatever its split)."""
        if self.path is not None:
            examples = [self._example(r, f"{self.path} record {i}") for i, r in enumerate(read_records(self.path))]
            return [ex for ex in examples if is_test_key(ex["question"], self.test_fraction) == (split == "test")]
        if self.dataset is not None:
            records, where = _load_hub(self.dataset, self.dataset_config, self.splits[split]), self.dataset
        else:
            file = self.train_path if split == "train" else self.test_path
            if file is None:
                raise ValueError(f"task {self.name!r} has no {split} data: pass {split}_path=FILE")
            records, where = read_records(file), file
        return [self._example(r, f"{where} record {i}") for i, r in enumerate(records)]

    def _example(self, row: dict[str, Any], where: str) -> dict[str, Any]:
        if self.question_field not in row:
            raise ValueError(f"{where}: no field {self.question_field!r} (fields: {', '.join(row)}); "
                             f"set question_field=")
        raw = next((row[f] for f in (self.answer_field, *self.fallback_answer_fields) if row.get(f) is not None), None)
        if raw is None:
            raise ValueError(f"{where}: no field {self.answer_field!r} (fields: {', '.join(row)}); set answer_field=")
        question = str(row[self.question_field])
        return {"prompt": chat_prompt(question), "question": question, "answer": gold_answer(raw)}

    def _split_rows(self, split: str) -> list[dict[str, Any]]:
        if split not in self._rows:
            rows = self._load(split)
            if split == "train" and self._has_test():  # never train on a test question (files may overlap)
                test_questions = {ex["question"] for ex in self._split_rows("test")}
                rows = [ex for ex in rows if ex["question"] not in test_questions]
            self._rows[split] = rows
        return self._rows[split]

    def _has_test(self) -> bool:
        return self.path is not None or self.test_path is not None or self.dataset is not None

    def train_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        """n examples, cycling through seeded permutations of the train rows when n exceeds them."""
        rows = self._split_rows("train")
        if not rows:
            return []
        rng = random.Random(f"{self.name}-train-{seed}")
        out: list[dict[str, Any]] = []
        while len(out) < n:
            order = list(range(len(rows)))
            rng.shuffle(order)
            out.extend(dict(rows[i]) for i in order[: n - len(out)])
        return out

    def test_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        """min(n, size) distinct test examples, in a seeded order."""
        rows = self._split_rows("test")
        order = list(range(len(rows)))
        random.Random(f"{self.name}-test-{seed}").shuffle(order)
        return [dict(rows[i]) for i in order[:n]]


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
