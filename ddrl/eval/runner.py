"""Evaluate a model on a task's held-out split: accuracy (pass@1), pass@k, mean reward.

    result = evaluate(model, "mini_sudoku", n=200)
    # {"task": "mini_sudoku", "n": 200, "accuracy": 0.61, "mean_reward": 0.61, "sampler": {...}, ...}
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from ddrl.config import SamplerConfig, validate_sampler
from ddrl.data import decode_completions, encode_prompts, model_stop_ids
from ddrl.registry import SAMPLERS


def default_sampler(model: Any, task: Any, **overrides: Any) -> SamplerConfig:
    """Greedy sampling sized to the task; the sampler kind follows the model's process."""
    process = getattr(getattr(model, "process_spec", None), "get", lambda *_: None)("name")
    name = {"uniform": "uniform", "block": "block"}.get(process or "", "masked")
    gen = getattr(task, "gen_length", 16)
    cfg = SamplerConfig(name=name, steps=gen, gen_length=gen, block_length=gen, temperature=0.0)
    if name == "block":
        bs = getattr(model, "block_size", None) or gen
        cfg.block_length = bs
    fields = {f.name for f in dataclasses.fields(SamplerConfig)}
    for k, v in overrides.items():
        if v is None:
            continue
        if k not in fields:
            raise ValueError(f"unknown sampler setting {k!r}; valid: {', '.join(sorted(fields))}")
        setattr(cfg, k, v)
    if cfg.name == "dream" and overrides.get("block_length") is None:
        cfg.block_length = None  # Dream's sampler decodes the whole completion at every step
    if overrides.get("gen_length") is not None:  # sizes that followed the task follow the override
        if overrides.get("steps") is None:
            cfg.steps = cfg.gen_length
        if overrides.get("block_length") is None and cfg.name not in ("block", "dream"):
            cfg.block_length = cfg.gen_length
    return cfg


def _pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


@torch.no_grad()
def evaluate(model: Any, task: Any, n: int = 200, *, sampler: SamplerConfig | dict | None = None,
             seed: int = 0, k: int = 1, batch_size: int = 64, examples: list[dict] | None = None,
             output_jsonl: str | Path | None = None, split: str = "test") -> dict[str, Any]:
    """Sample k completions for each of n held-out examples; score them with the task's reward."""
    from ddrl.tasks import get_task

    if isinstance(task, str):
        task = get_task(task)
    if isinstance(sampler, dict):
        sampler = default_sampler(model, task, **sampler)
    sampler = sampler or default_sampler(model, task)
    validate_sampler(sampler, "sampler")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if examples is None:
        if split == "train":
            examples = task.train_examples(n=n, seed=seed)
        else:
            examples = task.test_examples(n=n, seed=seed)
    if not examples:
        raise ValueError(f"task {task.name!r} returned no {split} examples; check its data path/arguments")
    device = next(model.parameters()).device
    max_prompt = None
    if getattr(model, "max_seq_len", None):
        max_prompt = model.max_seq_len - sampler.gen_length
    sample_fn = SAMPLERS.get(sampler.name)
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    nfe = 0
    for lo in range(0, len(examples), batch_size):
        chunk = examples[lo: lo + batch_size]
        prompts = [ex["prompt"] for ex in chunk for _ in range(k)]
        prompt_ids, prompt_mask = encode_prompts(model.tokenizer, prompts, max_length=max_prompt, device=device)
        g = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + lo)
        out = sample_fn(model, prompt_ids, prompt_mask, sampler, generator=g)
        nfe += out.nfe
        texts = decode_completions(model.tokenizer, out.completion_ids, model_stop_ids(model))
        columns = {c: [ex.get(c) for ex in chunk for _ in range(k)] for c in chunk[0] if c != "prompt"}
        rewards = task.reward(texts, **columns)
        correct = task.correct(texts, **columns)
        for j, ex in enumerate(chunk):
            rs = rewards[j * k:(j + 1) * k]
            cs = correct[j * k:(j + 1) * k]
            rows.append({"prompt": ex["prompt"], "completions": texts[j * k:(j + 1) * k],
                         "rewards": [None if r is None else float(r) for r in rs], "correct": [bool(c) for c in cs]})
    model.train(was_training)
    elapsed = time.perf_counter() - start
    valid = [r for row in rows for r in row["rewards"] if r is not None and math.isfinite(r)]
    result: dict[str, Any] = {
        "task": task.name,
        "n": len(rows),
        "accuracy": sum(row["correct"][0] for row in rows) / len(rows),
        "mean_reward": sum(valid) / len(valid) if valid else 0.0,
        "k": k,
        "sampler": dataclasses.asdict(sampler),
        "seconds": round(elapsed, 3),
        "model_calls": nfe,
    }
    if k > 1:
        result[f"pass@{k}"] = sum(_pass_at_k(k, sum(row["correct"]), k) for row in rows) / len(rows)
        result["pass@1"] = sum(sum(row["correct"]) / k for row in rows) / len(rows)
    if output_jsonl is not None:
        path = Path(output_jsonl)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return result
