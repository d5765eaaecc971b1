"""Paper evaluation protocols (ddrl.eval.protocols) and the per-item metric in evaluate().

Oracles: d1's published evaluation runs (tests/fixtures/d1_protocol/protocol.json, made by
tests/fixtures/make_d1_protocol.py from dllm-reasoning/d1@837888f eval/eval_baselines and dataset/):
the sampler settings each run records and the test items each run scored. The scoring path is
checked on a tiny LLaDA checkpoint (tests/fixtures/llada/model) against the sampler run by hand.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import ddrl
from ddrl.config import SamplerConfig
from ddrl.data import encode_prompts
from ddrl.eval import evaluate
from ddrl.eval.protocols import D1, Protocol, evaluate_protocol, get_protocol, paper_subsample, protocol_examples
from ddrl.registry import SAMPLERS
from ddrl.tasks.base import ChatPrompt, Task
from ddrl.tasks.presets import Preset, get_preset

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
RECORD = json.loads((FIXTURES / "d1_protocol" / "protocol.json").read_text())
LLADA = str(FIXTURES / "llada" / "model")
D1_TASKS = {"sudoku": "sudoku4x4", "countdown": "countdown"}  # d1's dataset name -> ddrl's task name


# ---------------------------------------------------------------------------- d1's settings and test sets


def test_d1_protocol_has_the_settings_of_every_published_run():
    assert {r["gen_length"] for r in RECORD["runs"]} == set(D1.gen_lengths) == {128, 256, 512}
    for run in RECORD["runs"]:
        assert D1.steps(run["gen_length"]) == run["diffusion_steps"], run["file"]
        assert D1.block_length == run["block_length"], run["file"]
    assert (D1.temperature, D1.cfg_scale, D1.remasking, D1.early_exit, D1.raw_text) == (0.0, 0.0, "low_confidence",
                                                                                         False, True)
    assert get_protocol("d1") is D1


@pytest.mark.parametrize("d1_name", sorted(D1_TASKS))
def test_d1_subsample_selects_the_published_items_in_order(d1_name):
    recorded = RECORD["subsets"][d1_name]
    size, task_name = recorded["test_size"], D1_TASKS[d1_name]
    k = D1.subsample[task_name]
    for indices in recorded["indices_by_gen_length"].values():
        assert paper_subsample(size, k, D1.subsample_seed) == indices

    class FileTask(Task):
        name = task_name

        def all_test_examples(self):
            return [{"prompt": f"item {i}", "row": i} for i in range(size)]

    examples, info = protocol_examples(FileTask(), D1)
    assert [ex["row"] for ex in examples] == recorded["indices_by_gen_length"]["256"]
    assert info == {"source": "all_test_examples", "size": size, "subsample": {"k": 256, "seed": 42}}
    first, _ = protocol_examples(FileTask(), D1, n=5)
    assert [ex["row"] for ex in first] == recorded["indices_by_gen_length"]["256"][:5]


def test_a_task_without_a_whole_test_set_needs_n():
    class Generated(Task):
        name = "generated"

        def test_examples(self, n, seed=0):
            return [{"prompt": str(i)} for i in range(n)]

    with pytest.raises(ValueError, match="whole test set.*--n"):
        protocol_examples(Generated(), D1)
    examples, info = protocol_examples(Generated(), D1, n=3)
    assert len(examples) == 3 and info["source"] == "test_examples"


def test_gsm8k_is_scored_whole():
    class FileTask(Task):
        name = "gsm8k"

        def all_test_examples(self):
            return [{"prompt": str(i), "row": i} for i in range(1319)]

    examples, info = protocol_examples(FileTask(), D1)
    assert [ex["row"] for ex in examples] == list(range(1319)) and "subsample" not in info


# ---------------------------------------------------------------------------- scoring on a tiny model

QUESTIONS = ["What is 2 + 3?", "Name a color.", "Count to three."]


def _count_metric(texts: list[str], target: list[str], **_: Any) -> list[float]:
    """A per-item metric in [0, 1] that varies on a random model: the share of characters equal to target."""
    return [sum(c == t for c in text) / max(len(text), 1) for text, t in zip(texts, target)]


def _length_reward(completions: list[str], **_: Any) -> list[float]:
    return [float(len(c)) for c in completions]


class ToyPaperTask(Task):
    """Three questions with an all_test_examples list, as a paper's test file gives them."""

    name = "toy_protocol_task"
    format = "chat"

    def all_test_examples(self):
        return [{"prompt": q, "question": q, "answer": "5", "target": "o"} for q in QUESTIONS]

    def test_examples(self, n, seed=0):
        return self.all_test_examples()[:n]

    def reward(self, completions, **columns):
        return [0.0] * len(completions)


class ToyGSM8K(ToyPaperTask):
    name = "gsm8k"  # scored by the real d1 preset for gsm8k (ddrl.rewards.d1)


def toy_gsm8k() -> ToyGSM8K:
    """Factory for `ddrl eval --task tests.unit.test_protocols:toy_gsm8k`."""
    return ToyGSM8K()


def _eval_prompt(example: dict[str, Any]) -> ChatPrompt:
    return ChatPrompt(user="Answer briefly.\n\n" + example["question"], prefill="<reasoning>")


# passed to evaluate_protocol directly: nothing is added to the global preset/protocol registries
TOY_PRESET = Preset(paper="toy_paper", task=ToyPaperTask.name, prompt=lambda ex: ex["question"],
                    eval_prompt=_eval_prompt, reward=_length_reward, metric=_count_metric)
TOY = Protocol(name="toy_paper", paper="a test protocol", gen_lengths=(32, 64), block_length=16, steps_per_token=0.5,
               main_length=64, batch_size={32: 2, 64: 3})


@pytest.fixture(scope="module")
def llada():
    return ddrl.load_model(LLADA)


def _by_hand(model, length: int) -> tuple[list[str], list[float]]:
    """The protocol's generation, written out: ChatPrompt -> the masked sampler -> raw decode -> metric."""
    prompts = [_eval_prompt({"question": q}) for q in QUESTIONS]
    ids, mask = encode_prompts(model.tokenizer, prompts)
    cfg = SamplerConfig(name="masked", gen_length=length, steps=length // 2, block_length=16, temperature=0.0,
                        early_exit=False)
    with torch.no_grad():
        out = SAMPLERS.get("masked")(model, ids, mask, cfg, generator=torch.Generator().manual_seed(0))
    raw = [model.tokenizer.decode(row, skip_special_tokens=False) for row in out.completion_ids.tolist()]
    return raw, _count_metric(raw, ["o"] * len(raw))


def test_protocol_scores_every_length_with_the_presets_prompt_and_metric(llada, tmp_path):
    out = tmp_path / "rows.jsonl"
    result = evaluate_protocol(llada, ToyPaperTask(), TOY, output_jsonl=out, preset=TOY_PRESET)
    assert result["protocol"] == "toy_paper" and result["gen_length"] == 64 and set(result["lengths"]) == {"32", "64"}
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6 and rows[0]["prompt"] == {"user": "Answer briefly.\n\nWhat is 2 + 3?", "system": None,
                                                    "prefill": "<reasoning>"}
    for length in (32, 64):
        r = result["lengths"][str(length)]
        raw, metric = _by_hand(llada, length)
        assert [row["raw_completions"][0] for row in rows if row["gen_length"] == length] == raw
        assert r["n"] == 3 and r["accuracy"] == pytest.approx(sum(metric) / 3) and r["mean_metric"] == r["accuracy"]
        assert 0.0 < r["accuracy"] < 1.0  # a fractional metric, not a 1/0 verdict
        s = r["sampler"]
        assert (s["gen_length"], s["steps"], s["block_length"], s["temperature"], s["early_exit"]) == (
            length, length // 2, 16, 0.0, False)
    # the head is the main length's, with the keys of a plain evaluate()
    head = result["lengths"]["64"]
    assert (result["task"], result["n"], result["accuracy"], result["mean_reward"]) == (
        "toy_protocol_task", 3, head["accuracy"], head["mean_reward"])
    assert result["mean_reward"] == pytest.approx(
        sum(len(row["completions"][0]) for row in rows if row["gen_length"] == 64) / 3)  # the preset's reward


def test_evaluate_takes_a_protocol(llada):
    result = evaluate(llada, ToyGSM8K(), protocol=dataclasses.replace(TOY, preset="d1"), n=2)
    assert result["protocol"] == "toy_paper" and result["lengths"]["32"]["n"] == 2 == result["n"]
    rows_prompt = get_preset("d1", "gsm8k").prompt_for_eval({"question": QUESTIONS[0], "answer": "5"})
    assert rows_prompt.prefill == "<reasoning>"
    with pytest.raises(ValueError, match="fixes the sampler"):
        evaluate(llada, ToyGSM8K(), protocol="d1", sampler={"steps": 4})


def test_cli_eval_protocol_prints_one_json_object(llada, capsys, tmp_path):
    from ddrl.cli import main

    code = main(["eval", "--model", LLADA, "--task", "tests.unit.test_protocols:toy_gsm8k", "--protocol", "d1",
                 "--gen-length", "128", "--json", "--output", str(tmp_path / "rows.jsonl")])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"task", "n", "accuracy", "mean_reward", "protocol", "lengths"} <= set(result)
    assert result["protocol"] == "d1" and list(result["lengths"]) == ["128"] and result["n"] == 3  # whole test set
    s = result["lengths"]["128"]["sampler"]
    assert (s["steps"], s["block_length"], s["temperature"], s["remasking"]) == (64, 32, 0.0, "low_confidence")
    assert result["test_set"] == {"source": "all_test_examples", "size": 3}

    assert main(["eval", "--model", LLADA, "--task", "tests.unit.test_protocols:toy_gsm8k", "--protocol", "d1",
                 "--gen-length", "100", "--json"]) == 2
    assert "reports gen_length 128, 256, 512" in capsys.readouterr().err
    assert main(["eval", "--model", LLADA, "--task", "tests.unit.test_protocols:toy_gsm8k", "--protocol", "nope"]) == 2
    assert "valid protocols: d1" in capsys.readouterr().err


# ---------------------------------------------------------------------------- accuracy = the task's metric


def test_evaluate_accuracy_is_the_tasks_per_item_metric(tmp_path):
    from ddrl.tasks import get_task

    model = ddrl.load_model("checkpoints/mini_sudoku-masked")
    base = get_task("mini_sudoku")

    class WithMetric(type(base)):
        def metric(self, completions, **columns):
            return [c.count("1") / max(len(c), 1) for c in completions]

    task = WithMetric()
    out = tmp_path / "rows.jsonl"
    result = evaluate(model, task, n=6, output_jsonl=out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    expected = sum(row["completions"][0].count("1") / max(len(row["completions"][0]), 1) for row in rows) / 6
    assert result["accuracy"] == pytest.approx(expected) and 0.0 < expected < 1.0
    plain = evaluate(model, base, n=6)  # no metric: accuracy counts correct(), as before
    assert plain["accuracy"] == sum(row["correct"][0] for row in rows) / 6


# ---------------------------------------------------------------------------- d1's published generations, replayed

SPECIAL = re.compile(r"<\|[a-z_]+\|>")


class _ReplayTokenizer:
    """Prompt i encodes to token i; token i decodes to published generation i. With skip_special_tokens
    (ddrl's default decode) the text ends at the first <|eot_id|>/<|endoftext|> and loses its special
    tokens, as the real tokenizer's decode of a completion cut at its stop token does; without it, it
    is d1's raw text (batch_decode(..., skip_special_tokens=False))."""

    pad_token_id = eos_token_id = bos_token_id = 0

    def __init__(self, texts: list[str]):
        self.texts, self.next = texts, 0

    def encode_prompt(self, prompt: Any) -> list[int]:  # sample_and_score encodes prompts in example order
        assert isinstance(prompt, ChatPrompt) and prompt.prefill == "<reasoning>"
        self.next += 1
        return [self.next - 1]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self.texts[ids[0]]
        if skip_special_tokens:
            text = SPECIAL.sub("", re.split(r"<\|eot_id\|>|<\|endoftext\|>", text)[0])
        return text


class _ReplayModel(torch.nn.Module):
    def __init__(self, texts: list[str]):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # evaluation reads the device from a parameter
        self.tokenizer = _ReplayTokenizer(texts)
        self.stop_token_ids = ()


class _Replay:
    """Stands in for the sampler registry: the completion is the prompt's token (its published generation)."""

    @staticmethod
    def get(name):
        from ddrl.sampling.base import SampleOutput

        return lambda model, ids, mask, cfg, generator=None: SampleOutput(ids[:, -1:].clone(), None, 1)


class _PaperTask(Task):
    def __init__(self, name: str):
        self.name = name


def _replay(model_texts: list[str], task: str, examples: list[dict], protocol: Protocol, tmp_path: Path, monkeypatch):
    """`ddrl eval --protocol` on fixed generations: evaluate_protocol with the sampler replaced by a replay."""
    import ddrl.sampling.engine as engine

    monkeypatch.setattr(engine, "SAMPLERS", _Replay)  # the rollout engine that evaluation samples through
    out = tmp_path / f"{task}.jsonl"
    result = evaluate_protocol(_ReplayModel(model_texts), _PaperTask(task), protocol, lengths=[protocol.gen_lengths[0]],
                               examples=examples, batch_size=2, output_jsonl=out)
    return result, [json.loads(line)["metric"][0] for line in out.read_text().splitlines()]


@pytest.mark.parametrize("task", ["sudoku4x4", "countdown", "gsm8k"])
def test_d1_protocol_gives_d1s_verdicts_on_raw_generations(task, monkeypatch, tmp_path):
    """The scoring path of `ddrl eval --protocol d1` (preset prompt -> raw decode -> preset metric ->
    accuracy) gives the verdicts of d1's own parsers (fixture "replay": completions in the form of
    LLaDA's raw decode, special tokens kept)."""
    recorded = RECORD["replay"][task]
    texts = [item["raw"] for item in recorded["items"]]
    verdicts = [item["verdict"] for item in recorded["items"]]
    examples = [{"prompt": "", **recorded["columns"]} for _ in texts]
    result, metric = _replay(texts, task, examples, D1, tmp_path, monkeypatch)
    assert metric == verdicts
    assert result["accuracy"] == pytest.approx(sum(verdicts) / len(verdicts))
    if task == "sudoku4x4":  # d1's Sudoku parser ends an answer at <|eot_id|>: text cut at the stop token differs
        _, cut = _replay(texts, task, examples, dataclasses.replace(D1, raw_text=False), tmp_path, monkeypatch)
        assert cut != verdicts
