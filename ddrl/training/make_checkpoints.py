"""`make checkpoints`: rebuild the tiny models shipped in checkpoints/ from their committed configs.

Each model is made by `ddrl pretrain` and gets a model card (README.md) with its config, training
time and held-out score, measured here with the same evaluator as `ddrl eval`.

    python -m ddrl.training.make_checkpoints                 # all of them
    python -m ddrl.training.make_checkpoints mini_sudoku-masked
    python -m ddrl.training.make_checkpoints --reuse digits-uniform   # publish an existing run
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]

# name -> (pretrain config, evaluation: task args for the held-out split it is scored on, n)
SHIPPED = {
    "mini_sudoku-masked": ("configs/pretrain/mini_sudoku_masked.yaml", {"min_empty": 8, "max_empty": 12}, 256),
    "sudoku-masked": ("configs/pretrain/sudoku_masked.yaml", {"min_empty": 12, "max_empty": 16}, 64),
    "digits-uniform": ("configs/pretrain/digits_uniform.yaml", {}, 200),  # scored with its config's sampler (T=1)
    "digits-masked": ("configs/pretrain/digits_masked.yaml", {}, 200),
    "countdown-block": ("configs/pretrain/countdown_block.yaml", {}, 200),
}
# Also scored with these few sampler steps (parallel decoding), where RL has room to improve it.
FEW_STEPS = {"mini_sudoku-masked": (1, 2, 4)}


def make(name: str, extra_overrides: list[str] | None = None, reuse: bool = False) -> Path:
    """Pretrain (or, with reuse, take an existing runs/pretrain/<name>/final) and publish with a card."""
    from ddrl.config import PretrainConfig, load_config, task_kwargs
    from ddrl.eval import evaluate
    from ddrl.models import load_model
    from ddrl.tasks import get_task
    from ddrl.training.pretrain import pretrain

    config, eval_args, n = SHIPPED[name]
    out_dir = ROOT / "runs" / "pretrain" / name
    overrides = [f"output_dir={out_dir}", *(extra_overrides or [])]
    cfg = load_config(ROOT / config, overrides, PretrainConfig)
    start = time.perf_counter()
    if reuse and (out_dir / "final" / "config.json").exists():
        from ddrl.training.logging import read_metrics

        final = out_dir / "final"
        minutes = (read_metrics(out_dir / "metrics.jsonl") or [{}])[-1].get("time/elapsed", 0.0) / 60
    else:
        final = pretrain(cfg)
        minutes = (time.perf_counter() - start) / 60
    model = load_model(final)
    task = get_task(cfg.task.name, **{**task_kwargs(cfg.task), **eval_args})
    train_task_args = task_kwargs(cfg.task)
    sampler = {"name": cfg.sampler.name, "steps": cfg.sampler.steps, "gen_length": cfg.sampler.gen_length,
               "block_length": cfg.sampler.block_length,
               "temperature": cfg.sampler.temperature if cfg.model.process == "uniform" else 0.0}
    result = evaluate(model, task, n=n, sampler=sampler, seed=0)
    few = {s: evaluate(model, task, n=n, sampler={**sampler, "steps": s}, seed=0)["accuracy"]
           for s in FEW_STEPS.get(name, ())}
    target = ROOT / "checkpoints" / name
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(final, target)
    n_params = sum(p.numel() for p in model.parameters())
    card = [
        f"# {name}",
        "",
        f"A tiny {model.process_spec['name']}-diffusion denoiser ({n_params / 1e6:.2f}M parameters) made by "
        f"`ddrl pretrain {config}` (rebuild: `make checkpoints`).",
        "",
        f"- pretraining data: task `{cfg.task.name}` with args `{json.dumps(train_task_args)}`, "
        f"{cfg.data.n_train} examples; {cfg.train.steps} steps of batch {cfg.train.batch_size}",
        f"- pretraining wall time: {minutes:.1f} min on this project's 2-core CPU machine",
        f"- held-out score (temperature {sampler['temperature']}, `{sampler['name']}` sampler, {sampler['steps']} steps): "
        f"accuracy {result['accuracy']:.3f}, mean reward {result['mean_reward']:.3f} on n={result['n']} "
        f"test examples of `{cfg.task.name}` with args `{json.dumps({**train_task_args, **eval_args})}`",
        *[f"- the same with {s} sampler step{'s' * (s > 1)} (parallel decoding): accuracy {acc:.3f}"
          for s, acc in few.items()],
        "",
        "Config:",
        "",
        "```yaml",
        yaml.safe_dump(json.loads(json.dumps(cfg, default=lambda o: o.__dict__)), sort_keys=False).strip(),
        "```",
        "",
    ]
    (target / "README.md").write_text("\n".join(card))
    print(f"{name}: accuracy {result['accuracy']:.3f} ({minutes:.1f} min) -> {target}")
    return target


def main(argv: list[str]) -> int:
    reuse = "--reuse" in argv
    names = [a for a in argv if a != "--reuse"] or list(SHIPPED)
    for name in names:
        if name not in SHIPPED:
            print(f"unknown checkpoint {name!r}; choose from {', '.join(SHIPPED)}", file=sys.stderr)
            return 2
        make(name, reuse=reuse)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
