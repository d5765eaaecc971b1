"""Paper evaluation protocols: how a paper measured its table, so that a ddrl run can be compared with it.

    result = evaluate_protocol(model, task, "d1")           # = evaluate(model, task, protocol="d1")
    result["lengths"]["256"]["accuracy"]                      # one entry per generation length
    # ddrl eval --model DIR --task gsm8k --task-arg test_path=... --protocol d1 --json

ddrl's default evaluation (ddrl.eval.runner.evaluate) decodes one block sized to the task, scores
200 examples with the task's own prompt and reward, and cuts each completion at its first stop
token. A paper's evaluation script fixes all of that differently. A `Protocol` holds what it fixes:
the generation lengths it reports (one table column each), the block and the number of denoising
steps per length, greedy decoding, how generations are decoded before parsing, and the test set
(the whole test file, or the paper's own subsample of it, in the paper's order). The prompt
(system text, assistant pre-fill), the parsers and the per-item metric are the paper's preset for
the task (ddrl.tasks.presets.get_preset(protocol.preset, task.name)).

**d1** (Zhao et al. 2025, "d1: Scaling Reasoning in Diffusion Large Language Models via
Reinforcement Learning", arXiv:2504.12216; dllm-reasoning/d1 @ 837888f, eval/eval.py,
eval/generate.py, eval/run_eval.sh, eval/gsm8k.py):
  * gen_length 128, 256, 512; block_length 32; steps = gen_length // 2 (eval.py overrides
    --diffusion_steps), i.e. 16 steps per block; LLaDA's low-confidence remasking, temperature 0,
    cfg_scale 0 (generate() as eval.py calls it), every block decoded (no early exit);
  * prompt: the d1 preset's eval prompt (d1 puts its system text into the user turn and pre-fills
    "<reasoning>" after the chat template's generation prompt);
  * parsing: the gen_length generated tokens decoded with their special tokens
    (batch_decode(out[:, -gen_length:], skip_special_tokens=False)), scored by the preset's metric
    (parse_and_get_acc.py's parsers);
  * test set: GSM8K and MATH500 whole; Countdown and Sudoku 256 items drawn with
    np.random.seed(42); np.random.choice(len, 256, replace=False), in that order (eval.py's
    num_evals, gsm8k.py's subsample). On d1's files this selects exactly the items of its published
    generations (tests/unit/test_protocols.py);
  * batch 8 (4 at 512 tokens), run_eval.sh; results here do not depend on it (below).
Where ddrl differs from d1's script:
  (a) d1 feeds left-padded batches to LLaDA without an attention mask, so a row's tokens depend on
      the padding of its batch; ddrl is padding invariant and gives each row what d1 gives it alone
      (batch size 1).
  (b) d1 runs under CUDA bf16 autocast; ddrl runs in the model's dtype.
  (c) accuracy is the mean of the per-item metric. d1 pools Sudoku cells over items (correct cells /
      blank cells, summed); that is the same number because every puzzle of its test file has 8 blanks.
  (d) equal confidences go to the leftmost position (ddrl.sampling.masked, (d)).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ddrl.config import SamplerConfig
from ddrl.data import check_modality
from ddrl.eval.runner import (Scoring, default_sampler, pass_at_k, sample_and_score, summarize,
                              write_rows)
from ddrl.contract import model_view
from ddrl.registry import Registry
from ddrl.sampling.checks import check_sampler
from ddrl.tasks.presets import Preset, get_preset


@dataclass(frozen=True)
class Protocol:
    """A paper's evaluation settings (module docstring). Sampler settings apply to every length."""

    name: str  # the registry name, e.g. "d1"
    paper: str  # citation and the script the settings come from
    gen_lengths: tuple[int, ...]  # completion lengths, one table column each
    block_length: int  # semi-autoregressive block
    steps_per_token: float  # denoising steps = int(gen_length * steps_per_token)
    temperature: float = 0.0
    cfg_scale: float = 0.0
    remasking: str = "low_confidence"
    early_exit: bool = False  # False: every block is decoded after EOS too, as the paper's generate() does
    raw_text: bool = True  # the metric reads every generated token with its special tokens (Scoring.raw_text)
    main_length: int | None = None  # the length whose numbers head the result; None = the first
    batch_size: dict[int, int] = field(default_factory=dict)  # prompts per sampler call per length (the paper's)
    subsample: dict[str, int] = field(default_factory=dict)  # task name -> items the paper draws from its test set
    subsample_seed: int = 42  # numpy seed of that draw
    preset: str | None = None  # the preset paper whose prompt and metric score this protocol; None = name

    def steps(self, gen_length: int) -> int:
        return int(gen_length * self.steps_per_token)

    @property
    def preset_paper(self) -> str:
        return self.preset or self.name


PROTOCOLS: Registry[Protocol] = Registry("protocol")


def register_protocol(protocol: Protocol) -> Protocol:
    return PROTOCOLS.register(protocol.name, protocol)


def get_protocol(protocol: str | Protocol) -> Protocol:
    """A Protocol, or one by name (an unknown name lists the registered ones)."""
    return protocol if isinstance(protocol, Protocol) else PROTOCOLS.get(protocol)


D1 = register_protocol(Protocol(
    name="d1",
    paper="d1 (Zhao et al. 2025, arXiv:2504.12216), dllm-reasoning/d1@837888f eval/eval.py + generate.py",
    gen_lengths=(128, 256, 512), block_length=32, steps_per_token=0.5,
    temperature=0.0, cfg_scale=0.0, remasking="low_confidence", early_exit=False, raw_text=True,
    main_length=256,  # d1 trains at 256 tokens (max_completion_length) and discusses that column
    batch_size={128: 8, 256: 8, 512: 4},
    subsample={"countdown": 256, "sudoku4x4": 256},
))


def paper_subsample(size: int, k: int, seed: int) -> list[int]:
    """The indices d1 evaluates: np.random.seed(seed); np.random.choice(size, k, replace=False), in order.

    numpy's legacy RandomState stream is frozen across numpy versions, so the draw is reproducible.
    k >= size keeps every item (a tiny test file), in the drawn order."""
    import numpy as np

    return [int(i) for i in np.random.RandomState(seed).choice(size, min(k, size), replace=False)]


def protocol_examples(task: Any, protocol: Protocol, n: int | None = None) -> tuple[list[dict], dict[str, Any]]:
    """The protocol's test examples of `task` (the first n of them when n is given) and a description.

    The whole test set comes from `task.all_test_examples()` (every test example, in the test file's
    order), then the paper's subsample when it draws one. A task without that method is scored on
    `task.test_examples(n)` when n is given; otherwise it is an error."""
    every = task.all_test_examples()
    if every is None:
        if n is None:
            raise ValueError(
                f"protocol {protocol.name!r} scores the paper's whole test set, but task {task.name!r} does not list "
                f"it (all_test_examples() is None: a procedural generator has no fixed test set): pass n "
                f"(--n N) to score N of its test examples, or use the paper's test file")
        return task.test_examples(n=n, seed=0), {"source": "test_examples", "n": n}
    rows = list(every)
    info: dict[str, Any] = {"source": "all_test_examples", "size": len(rows)}
    k = protocol.subsample.get(task.name)
    if k is not None:
        rows = [rows[i] for i in paper_subsample(len(rows), k, protocol.subsample_seed)]
        info["subsample"] = {"k": k, "seed": protocol.subsample_seed}
    if n is not None:
        rows = rows[:n]
    return rows, info


def protocol_scoring(task: Any, protocol: Protocol, preset: Preset | None = None) -> Scoring:
    """The paper's preset for the task (default get_preset(protocol.preset_paper, task.name)): its eval
    prompt, its reward and its metric (correct = metric >= 1)."""
    preset = preset or get_preset(protocol.preset_paper, task.name)

    def correct(texts: list[str], **columns: Any) -> list[bool]:
        return [float(m) >= 1.0 for m in preset.metric(texts, **columns)]

    def prompt(example: dict[str, Any]) -> Any:  # from the example's columns, as PresetMixin builds it
        return preset.prompt_for_eval({k: v for k, v in example.items() if k != "prompt"})

    return Scoring(prompt=prompt, reward=preset.reward, correct=correct, metric=preset.metric,
                   raw_text=protocol.raw_text)


def protocol_sampler(model: Any, task: Any, protocol: Protocol, gen_length: int,
                     overrides: dict[str, Any] | None = None, key: str = "sampler") -> SamplerConfig:
    """The protocol's sampler at one length; the sampler kind follows the model (default_sampler).
    overrides (e.g. {"cache": "prefix"}) change it and are reported in the result. Checked against
    the model (its block size) before any compute; key: how messages name the settings
    (ddrl.sampling.checks.FLAGS under `ddrl eval`)."""
    settings = dict(gen_length=gen_length, steps=protocol.steps(gen_length), block_length=protocol.block_length,
                    temperature=protocol.temperature, cfg_scale=protocol.cfg_scale, remasking=protocol.remasking,
                    early_exit=protocol.early_exit)
    settings.update({k: v for k, v in (overrides or {}).items() if v is not None})
    sampler = default_sampler(model, task, key=key, **settings)
    check_sampler(sampler, key, block_size=model_view(model).block_size)
    return sampler


def evaluate_protocol(model: Any, task: Any, protocol: str | Protocol, *, n: int | None = None, seed: int = 0,
                      k: int = 1, batch_size: int | None = None, lengths: Sequence[int] | None = None,
                      overrides: dict[str, Any] | None = None, examples: list[dict] | None = None,
                      output_jsonl: str | Path | None = None, preset: Preset | None = None,
                      key: str = "sampler") -> dict[str, Any]:
    """Evaluate `task` as `protocol`'s paper did, at each of its generation lengths.

    n: score the first n examples of the protocol's test set (default: all of it).
    lengths: a subset of the protocol's lengths. overrides: sampler settings that replace the
    protocol's (reported under "overrides"; the numbers are then not the paper's setting).
    Returns the main length's result with the keys of evaluate() (task, n, accuracy, mean_reward,
    k, sampler, seconds, model_calls), plus "protocol", "gen_length", "test_set" and "lengths":
    {"128": {n, accuracy, mean_metric, mean_reward, sampler, seconds, model_calls}, ...}, where
    accuracy = mean_metric = the mean per-item metric of the paper's preset.
    output_jsonl: one row per example and length, with its "gen_length".
    preset: the prompt/reward/metric to score with; default the protocol paper's preset for the task.
    key: how sampler messages name the settings ("sampler.threshold"; FLAGS: "--threshold").
    """
    from ddrl.tasks import get_task

    if isinstance(task, str):
        task = get_task(task)
    check_modality(model, task)  # before any compute (ddrl.data)
    protocol = get_protocol(protocol)
    chosen = tuple(lengths) if lengths else protocol.gen_lengths
    unknown = [length for length in chosen if length not in protocol.gen_lengths]
    if unknown:
        raise ValueError(f"protocol {protocol.name!r} reports gen_length {', '.join(map(str, protocol.gen_lengths))}; "
                         f"got {', '.join(map(str, unknown))}")
    scoring = protocol_scoring(task, protocol, preset)  # an unknown preset fails before any compute
    samplers = {length: protocol_sampler(model, task, protocol, length, overrides, key) for length in chosen}
    if examples is None:
        examples, test_set = protocol_examples(task, protocol, n)
    else:
        test_set = {"source": "examples", "size": len(examples)}
    if not examples:
        raise ValueError(f"task {task.name!r} has no test examples for protocol {protocol.name!r}")
    per_length: dict[str, dict[str, Any]] = {}
    all_rows: list[dict[str, Any]] = []
    for length, sampler in samplers.items():
        size = batch_size or protocol.batch_size.get(length, 64)
        rows, stats = sample_and_score(model, examples, sampler, scoring, seed=seed, k=k, batch_size=size)
        summary = summarize(rows)
        per_length[str(length)] = {"n": summary["n"], "accuracy": summary["accuracy"],
                                   "mean_metric": summary["accuracy"], "mean_reward": summary["mean_reward"],
                                   **(pass_at_k(rows, k) if k > 1 else {}),
                                   "sampler": dataclasses.asdict(sampler), **stats}
        all_rows.extend({"gen_length": length, **row} for row in rows)
    main = protocol.main_length if protocol.main_length in chosen else chosen[0]
    head = per_length[str(main)]
    result: dict[str, Any] = {"task": task.name, "n": head["n"], "accuracy": head["accuracy"],
                              "mean_reward": head["mean_reward"], "k": k, "sampler": head["sampler"],
                              "seconds": head["seconds"], "model_calls": head["model_calls"]}
    if k > 1:
        result.update(pass_at_k([r for r in all_rows if r["gen_length"] == main], k))
    result.update({"protocol": protocol.name, "paper": protocol.paper, "gen_length": main, "test_set": test_set,
                   "lengths": per_length})
    if overrides and any(v is not None for v in overrides.values()):
        result["overrides"] = {key: v for key, v in overrides.items() if v is not None}
    if output_jsonl is not None:
        write_rows(output_jsonl, all_rows)
    return result
