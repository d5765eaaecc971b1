"""Evaluate a model on a task's held-out split: accuracy (pass@1), pass@k, mean reward.

    result = evaluate(model, "mini_sudoku", n=200)
    # {"task": "mini_sudoku", "n": 200, "accuracy": 0.61, "mean_reward": 0.61, "sampler": {...}, ...}
    result = evaluate(model, task, protocol="d1")   # a paper's protocol (ddrl.eval.protocols)

**Accuracy** is the mean over examples of the task's per-item metric (`task.metric(completions,
**columns) -> list[float]` in [0, 1]: 1/0 for a verdict, d1's Sudoku gives correct cells / blank
cells) on each example's first sample; a task without `metric` counts `task.correct` (1/0).
A task with `eval_breakdown(rows, examples) -> dict` (digits: per-class rate and diversity) adds
it to the result as "breakdown".
pass@k counts `task.correct`. A paper protocol scores with its preset's prompt, metric and reward
instead of the task's (`Scoring`), and evaluates once per generation length.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ddrl.config import SamplerConfig, validate_sampler
from ddrl.data import check_modality
from ddrl.contract import model_view
from ddrl.rewards.pixels import save_image_grid, to_uint8
from ddrl.sampling.checks import AUTO, resolve_sampler
from ddrl.sampling.settings import settings_class

PREVIEW_IMAGES = 16  # an image task's evaluation keeps this many examples' pictures (a 4 x 4 grid PNG)


def default_sampler(model: Any, task: Any, *, key: str = "sampler", **overrides: Any) -> SamplerConfig:
    """Greedy sampling sized to the task; the sampler is the model's own unless overrides name one it
    can run (ddrl.sampling.checks.resolve_sampler; key: how messages name the settings)."""
    name = resolve_sampler(model, overrides.pop("name", None) or AUTO, key)
    gen = getattr(task, "gen_length", 16)
    cfg = SamplerConfig(name=name, steps=gen, gen_length=gen, block_length=gen, temperature=0.0)
    if name == "block":
        bs = model_view(model).block_size or gen
        cfg.block_length = bs
    fields = {f.name for f in dataclasses.fields(SamplerConfig)}
    for k, v in overrides.items():
        if v is None:
            continue
        if k not in fields:
            raise ValueError(f"unknown sampler setting {k!r}; valid: {', '.join(sorted(fields))}")
        setattr(cfg, k, v)
    blocks = "block_length" in {f.name for f in dataclasses.fields(settings_class(name) or SamplerConfig)}
    if not blocks and overrides.get("block_length") is None:
        cfg.block_length = None  # a sampler without blocks decodes the whole completion at every step
    if overrides.get("gen_length") is not None:  # sizes that followed the task follow the override
        if overrides.get("steps") is None:
            cfg.steps = cfg.gen_length
        if overrides.get("block_length") is None and cfg.name != "block" and blocks:
            cfg.block_length = cfg.gen_length
    return cfg


def _pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


ScoreFn = Callable[..., list[Any]]


@dataclass(frozen=True)
class Scoring:
    """What an evaluation conditions on and how it scores; the task's own by default (task_scoring).

    prompt:   example -> str | ChatPrompt.
    reward:   reward(completions, **columns) -> list[float | None], on completions cut at the first stop token.
    correct:  correct(texts, **columns) -> list[bool], for pass@k (and accuracy when metric is None).
    metric:   metric(texts, **columns) -> list[float] in [0, 1], the per-item accuracy; None = correct.
    raw_text: correct/metric read every generated token decoded with its special tokens, as d1's
              evaluation does (batch_decode(..., skip_special_tokens=False)); False = the cut text.
    task:     whose modality decodes the ids (the rollout engine's task_completions); None = text. reward,
              correct and metric also take its reward inputs (images=[n, 3, H, W] for image tasks).
    """

    prompt: Callable[[dict[str, Any]], Any]
    reward: ScoreFn
    correct: ScoreFn
    metric: ScoreFn | None = None
    raw_text: bool = False
    task: Any = None


def task_scoring(task: Any) -> Scoring:
    """The task's prompt column, reward, correct and, when it defines its own, its per-item metric.

    Task.metric's default is `correct` as 1/0, the same accuracy; it is not called a second time
    (a code task's correct runs its tests)."""
    from ddrl.tasks.base import Task

    metric = getattr(task, "metric", None)
    if metric is not None and getattr(type(task), "metric", None) is Task.metric:
        metric = None
    return Scoring(prompt=lambda ex: ex["prompt"], reward=task.reward, correct=task.correct, metric=metric, task=task)


@torch.no_grad()
def evaluate(model: Any, task: Any, n: int | None = None, *, sampler: SamplerConfig | dict | None = None,
             seed: int = 0, k: int = 1, batch_size: int = 64, examples: list[dict] | None = None,
             output_jsonl: str | Path | None = None, split: str = "test",
             protocol: Any = None, shard: bool = False) -> dict[str, Any]:
    """Sample k completions for each of n (default 200) held-out examples; score them with the task.

    protocol: a paper protocol's name or Protocol (ddrl.eval.protocols.evaluate_protocol, whose result
    this returns): its sampler per generation length, its preset's prompt and metric, and its test
    set (the whole of it when n is None). sampler/split do not apply to a protocol.
    shard: split the examples over the ranks of torch.distributed's default group (every rank must
    call); each rank samples its share and every rank gets the whole, gathered result.
    """
    from ddrl.stats import score_estimate
    from ddrl.tasks import get_task
    from ddrl.tasks.base import cluster_keys, split_examples

    if isinstance(task, str):
        task = get_task(task)
    if protocol is not None:
        from ddrl.eval.protocols import evaluate_protocol

        if sampler is not None or split != "test":
            raise ValueError("a paper protocol fixes the sampler and scores the test split; pass sampler "
                             "overrides as evaluate_protocol(..., overrides={...})")
        return evaluate_protocol(model, task, protocol, n=n, seed=seed, k=k, batch_size=batch_size,
                                 examples=examples, output_jsonl=output_jsonl)
    check_modality(model, task)  # an image model on a text task (or the reverse) fails before any compute
    n = 200 if n is None else n
    if isinstance(sampler, dict):
        sampler = default_sampler(model, task, **sampler)
    sampler = sampler or default_sampler(model, task)
    validate_sampler(sampler, "sampler")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if examples is None:
        examples = split_examples(task, split, n, seed)
    if not examples:
        raise ValueError(f"task {task.name!r} returned no {split} examples; check its data path/arguments")
    check_samples_can_differ(task, examples, sampler, k)
    rows, stats = sample_and_score(model, examples, sampler, task_scoring(task), seed=split_sampler_seed(seed, split),
                                   k=k, batch_size=batch_size, shard=shard)
    clusters = cluster_keys(task, examples)
    if clusters is not None:  # what the bootstrap resamples (a Sudoku's solution grid), kept with the rows
        for row, cluster in zip(rows, clusters):
            row["cluster"] = str(cluster[1])
    result = {"task": task.name, "split": split, **summarize(rows), "k": k, "sampler": dataclasses.asdict(sampler),
              **stats}
    estimate = score_estimate(first_scores(rows), clusters=clusters)
    result["accuracy_interval"] = [estimate.lo, estimate.hi]  # 95%: Wilson, or the (cluster) bootstrap
    result["interval"] = estimate.as_dict()
    breakdown = getattr(task, "eval_breakdown", None)  # optional task hook: what accuracy alone hides
    if breakdown is not None:
        result["breakdown"] = breakdown(rows, examples)
    if k > 1:
        result.update(pass_at_k(rows, k, clusters))
    if output_jsonl is not None:
        write_rows(output_jsonl, rows)
    return result


def check_samples_can_differ(task: Any, examples: list[dict], sampler: SamplerConfig, k: int = 1) -> None:
    """Refuse, before any compute, an evaluation whose samples are one sample repeated: every example has
    the same prompt (an unconditional task: DNA, a class-free generator) and the sampler is greedy
    (temperature 0), so all n x k samples are one sequence and every statistic of them (mean reward,
    distinct samples, k-mer correlation) describes a single draw."""
    if sampler.temperature != 0 or len(examples) * k < 2:
        return
    prompts = {repr(ex.get("prompt")) for ex in examples}
    if len(prompts) == 1:
        raise ValueError(f"task {getattr(task, 'name', task)!r}: all {len(examples)} examples share one prompt "
                         f"({next(iter(prompts))}: an unconditional task) and temperature 0 (greedy) decodes it to "
                         f"one and the same sample {len(examples) * k} times; evaluate with temperature 1 "
                         f"(--temperature 1; eval.temperature=1.0 in a training config)")


def sample_and_score(model: Any, examples: list[dict], sampler: SamplerConfig, scoring: Scoring, *,
                     seed: int = 0, k: int = 1, batch_size: int = 64,
                     shard: bool = False) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """k completions per example, scored. Returns (one row per example, {"seconds", "model_calls"}).

    Row: prompt, completions (cut at the first stop token), rewards, correct, metric (when scored
    with one) and raw_completions (with raw_text).

    One sampler call per `batch_size` examples (x k rows). Example i draws from its own generator,
    seeded by (seed, i) on the model's device, so its samples do not depend on the batch it falls
    in nor on the rank that evaluates it. shard: rank r of W evaluates examples r, r + W, ...; the
    rows are gathered back into example order on every rank.
    """
    rank, world = _rank_and_world(shard)
    mine = list(range(rank, len(examples), world))
    start = time.perf_counter()
    rows, nfe = _sample_rows(model, examples, mine, sampler, scoring, seed=seed, k=k, batch_size=batch_size)
    seconds = time.perf_counter() - start
    if world > 1:
        parts: list[Any] = [None] * world
        torch.distributed.all_gather_object(parts, (mine, rows, nfe, seconds))
        ordered: list[dict[str, Any] | None] = [None] * len(examples)
        for indices, part_rows, _, _ in parts:
            for i, row in zip(indices, part_rows):
                ordered[i] = row
        rows = ordered  # type: ignore[assignment]
        nfe, seconds = sum(p[2] for p in parts), max(p[3] for p in parts)
    return rows, {"seconds": round(seconds, 3), "model_calls": nfe}


def _rank_and_world(shard: bool) -> tuple[int, int]:
    import torch.distributed as dist

    if not shard or not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


# Sampler draws depend on the split as well as the example's index. Tasks whose splits share their
# prompts (digits: the ten class symbols on every split) would otherwise draw the same samples for
# dev example i and test example i, and a dev score would be a look at the test one. The test
# split keeps the plain seed (its reported numbers stay as measured).
SPLIT_SAMPLER_SALT = {"test": 0, "dev": 1, "train": 2}


def split_sampler_seed(seed: int, split: str) -> int:
    """The sampler seed of `split`'s evaluation at `seed`."""
    return seed + SPLIT_SAMPLER_SALT[split] * 1_000_000_007


def example_seed(seed: int, index: int) -> int:
    """The seed of example `index`'s generator (the earlier per-batch seed at a batch of one)."""
    return seed * 1_000_003 + index


def _sample_rows(model: Any, examples: list[dict], indices: list[int], sampler: SamplerConfig, scoring: Scoring, *,
                 seed: int, k: int, batch_size: int) -> tuple[list[dict[str, Any]], int]:
    """Rows of examples[indices], sampled batch_size examples per sampler call; (rows, model calls).

    The training rollouts' engine (ddrl.sampling.engine): the same prompt cut (max_prompt_length), the
    same batch_rows calls, the same decoding; example i's k rows draw from their own generator."""
    from ddrl.processes.draws import RowGenerators, make_generator
    from ddrl.sampling.engine import RolloutEngine

    engine = RolloutEngine(model, sampler, sampler=resolve_sampler(model, sampler.name, "sampler"), task=scoring.task,
                           option_names=("--max-prompt-length", "--gen-length"))
    rows: list[dict[str, Any]] = []
    nfe = 0
    for lo in range(0, len(indices), batch_size):
        chunk_ids = indices[lo: lo + batch_size]
        chunk = [examples[i] for i in chunk_ids]
        prompts = [scoring.prompt(ex) for ex in chunk]
        encoded = engine.encode(prompts)
        g = RowGenerators([make_generator(example_seed(seed, i), engine.device) for i in chunk_ids],
                          rows_per_generator=k)
        out = engine.generate(encoded.ids, encoded.mask, g, rows_per_prompt=k)
        nfe += out.nfe
        done = out.completions  # texts, or decoded images
        texts, extra = done.texts, done.reward_inputs()
        scored = texts
        if scoring.raw_text:  # every generated token, special tokens included (d1's decode)
            scored = [model.tokenizer.decode(row, skip_special_tokens=False) for row in out.completion_ids.tolist()]
        columns = {c: [ex.get(c) for ex in chunk for _ in range(k)] for c in chunk[0] if c != "prompt"}
        rewards = scoring.reward(texts, **columns, **extra)
        correct = scoring.correct(scored, **columns, **extra)
        metric = scoring.metric(scored, **columns, **extra) if scoring.metric is not None else None
        for j, (prompt, index) in enumerate(zip(prompts, chunk_ids)):
            part = slice(j * k, (j + 1) * k)
            row = {"prompt": _jsonable_prompt(prompt), "completions": texts[part],
                   "rewards": [None if r is None else float(r) for r in rewards[part]],
                   "correct": [bool(c) for c in correct[part]]}
            if done.images is not None and index < PREVIEW_IMAGES:  # the first examples' first sample, as a picture
                row["image"] = to_uint8(done.images[j * k]).cpu()
            if metric is not None:
                row["metric"] = [float(m) for m in metric[part]]
            if scoring.raw_text:
                row["raw_completions"] = scored[part]
            rows.append(row)
    return rows, nfe


def first_scores(rows: list[dict[str, Any]]) -> list[float]:
    """Each example's accuracy: its first sample's per-item metric, else its correct verdict (1/0)."""
    return [float(row["metric"][0] if "metric" in row else row["correct"][0]) for row in rows]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """n, accuracy (the mean of first_scores), mean_reward over the valid rewards and their count.

    A reward of None (not applicable, a server that did not answer) or NaN is not a score: mean_reward
    is None (JSON null) when no completion got a valid one, never a 0.0 that reads as a measurement."""
    valid = [r for row in rows for r in row["rewards"] if r is not None and math.isfinite(r)]
    return {"n": len(rows), "accuracy": sum(first_scores(rows)) / len(rows),
            "mean_reward": sum(valid) / len(valid) if valid else None, "valid_rewards": len(valid)}


def pass_at_k(rows: list[dict[str, Any]], k: int, clusters: Any = None) -> dict[str, Any]:
    """pass@k and pass@1 over the k samples of each row, from `correct`, each with its 95%
    interval over examples (or their clusters: `pass@k_interval`, `pass@1_interval`)."""
    from ddrl.stats import score_estimate

    out: dict[str, Any] = {}
    for name, per_row in ((f"pass@{k}", [_pass_at_k(k, sum(row["correct"]), k) for row in rows]),
                          ("pass@1", [sum(row["correct"]) / k for row in rows])):
        estimate = score_estimate(per_row, clusters=clusters)
        out[name], out[f"{name}_interval"] = estimate.mean, [estimate.lo, estimate.hi]
    return out


def write_rows(path: str | Path, rows: list[dict[str, Any]]) -> None:
    """One JSON line per row; an image task's preview pictures go to a PNG grid beside it (same stem),
    each captioned with its prompt, and its row names its tile ("image": "step-10.png#3")."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pictures = [(i, row.pop("image")) for i, row in enumerate(rows) if "image" in row]
    if pictures:
        grid = path.with_suffix(".png")
        save_image_grid(torch.stack([img for _, img in pictures]), grid,
                        captions=[str(rows[i]["prompt"]) for i, _ in pictures])
        for tile, (i, _) in enumerate(pictures):
            rows[i]["image"] = f"{grid.name}#{tile}"
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def _jsonable_prompt(prompt: Any) -> Any:
    """A str stays; a ChatPrompt (a dataclass) becomes {"user", "system", "prefill"} for the JSONL."""
    return dataclasses.asdict(prompt) if dataclasses.is_dataclass(prompt) and not isinstance(prompt, type) else prompt
