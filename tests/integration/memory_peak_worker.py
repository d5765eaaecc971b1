"""Run by test_memory_model in a fresh process: one `ddrl train` step on the CPU, reporting the peak
resident memory it added (VmHWM after the step minus VmRSS before the trainer was built, so the
libraries' own memory is not counted) and the memory model's estimate, as JSON on stdout."""

from __future__ import annotations

import json
import sys


def status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def main(config: str, overrides: list[str]) -> None:
    import torch  # noqa: F401  (imported before the baseline: its libraries are not the step's memory)

    from ddrl.config import RLConfig, load_config
    from ddrl.data import tokenize_prompts
    from ddrl.training.memory import estimate_memory, model_shape
    from ddrl.training.trainer import Trainer

    cfg = load_config(config, overrides, RLConfig)
    before = status_kb("VmRSS") * 1024
    trainer = Trainer(cfg)
    trainer.train_step(1)
    prompts = [trainer.example(i)["prompt"] for i in range(cfg.train.prompts_per_step)]
    widest = max(len(ids) for ids in tokenize_prompts(trainer.model.tokenizer, prompts))
    estimate = estimate_memory(cfg, model_shape(cfg.model.path), 1, device="cpu", prompt_tokens=widest)
    peak = status_kb("VmHWM") * 1024
    print(json.dumps({"measured": peak - before, "estimate": estimate.total, "report": estimate.report()}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
