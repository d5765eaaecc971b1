"""`make checkpoints`: rebuild the tiny models shipped in checkpoints/ from their committed configs.

Each model is made by `ddrl pretrain` and gets a model card (README.md) with its config, training
time and held-out score, measured here with the same evaluator as `ddrl eval`.

    python -m ddrl.training.make_checkpoints                 # all of them
    python -m ddrl.training.make_checkpoints mini_sudoku-masked
    python -m ddrl.training.make_checkpoints --reuse digits-uniform   # publish an existing run
    python -m ddrl.training.make_checkpoints --rescore       # re-measure the shipped cards' scores only

Cards report the sealed test split (never used to choose anything), with n and a 95% interval
(Wilson, or a bootstrap over Sudoku solution grids).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]

# name -> (pretrain config, evaluation: task args for the sealed test split it is scored on, n)
SHIPPED = {
    "mini_sudoku-masked": ("configs/pretrain/mini_sudoku_masked.yaml", {"min_empty": 8, "max_empty": 12}, 1000),
    "sudoku-masked": ("configs/pretrain/sudoku_masked.yaml", {"min_empty": 12, "max_empty": 16}, 256),
    "digits-uniform": ("configs/pretrain/digits_uniform.yaml", {}, 1000),  # scored with its config's sampler (T=1)
    "digits-masked": ("configs/pretrain/digits_masked.yaml", {}, 1000),
    "digits-ursa": ("configs/pretrain/digits_ursa.yaml", {}, 1000),  # an URSA pipeline folder; sampled at T=1
    "countdown-block": ("configs/pretrain/countdown_block.yaml", {}, 1000),
}
# How a card names its interval (ddrl.stats.Estimate.method); {} = the number of clusters.
INTERVAL_WORDS = {"wilson": "Wilson", "cluster_bootstrap_or_wilson": "the wider of Wilson's and a bootstrap over {} "
                  "solution grids", "cluster_bootstrap": "bootstrap over {} clusters", "bootstrap": "bootstrap"}
# Also scored with these few sampler steps (parallel decoding), where RL has room to improve it.
FEW_STEPS = {"mini_sudoku-masked": (1, 2, 4)}


def make(name: str, extra_overrides: list[str] | None = None, reuse: bool = False) -> Path:
    """Pretrain (or, with reuse, take an existing runs/pretrain/<name>/final) and publish with a card."""
    from ddrl.config import PretrainConfig, load_config, task_kwargs
    from ddrl.models import load_model
    from ddrl.models.ursa import URSADiffusionLM
    from ddrl.training.pretrain import pretrain

    config = SHIPPED[name][0]
    out_dir = ROOT / "runs" / "pretrain" / name
    overrides = [f"output_dir={out_dir}", *(extra_overrides or [])]
    cfg = load_config(ROOT / config, overrides, PretrainConfig)
    start = time.perf_counter()
    if reuse and any((out_dir / "final" / f).exists() for f in ("config.json", "model_index.json")):
        from ddrl.training.logging import read_metrics

        final = out_dir / "final"
        minutes = (read_metrics(out_dir / "metrics.jsonl") or [{}])[-1].get("time/elapsed", 0.0) / 60
    else:
        final = pretrain(cfg)
        minutes = (time.perf_counter() - start) / 60
    model = load_model(final)
    score_lines = card_scores(name, model, cfg)
    train_task_args = task_kwargs(cfg.task)
    target = ROOT / "checkpoints" / name
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(final, target)
    n_params = sum(p.numel() for p in model.parameters())
    what = (f"URSA pipeline (the official diffusers layout: a {model.process_spec['name']} denoiser over a VQ "
            f"codebook, with its VQ decoder)" if isinstance(model, URSADiffusionLM)
            else f"{model.process_spec['name']}-diffusion denoiser")
    card = [
        f"# {name}",
        "",
        f"A tiny {what} ({n_params / 1e6:.2f}M parameters) made by `ddrl pretrain {config}` (rebuild: "
        f"`make checkpoints`).",
        "",
        f"- pretraining data: task `{cfg.task.name}` with args `{json.dumps(train_task_args)}`, "
        f"{cfg.data.n_train} examples; {cfg.train.steps} steps of batch {cfg.train.batch_size}",
        f"- pretraining wall time: {minutes:.1f} min on this project's 2-core CPU machine",
        *score_lines,
        "",
        "Config:",
        "",
        "```yaml",
        yaml.safe_dump(json.loads(json.dumps(cfg, default=lambda o: o.__dict__)), sort_keys=False).strip(),
        "```",
        "",
    ]
    (target / "README.md").write_text("\n".join(card))
    print(f"{name} ({minutes:.1f} min) -> {target}")
    print("\n".join(score_lines))
    return target


def card_scores(name: str, model, cfg) -> list[str]:
    """The card's score lines: the sealed test split, with n and the 95% interval, at the config's
    sampler (greedy unless uniform) and at FEW_STEPS sampler steps."""
    from ddrl.config import task_kwargs
    from ddrl.eval import evaluate
    from ddrl.tasks import get_task

    _, eval_args, n = SHIPPED[name]
    task = get_task(cfg.task.name, **{**task_kwargs(cfg.task), **eval_args})
    sampler = {"name": cfg.sampler.name, "steps": cfg.sampler.steps, "gen_length": cfg.sampler.gen_length,
               "block_length": cfg.sampler.block_length,
               "temperature": cfg.sampler.temperature if cfg.model.process in ("uniform", "metric_path") else 0.0}

    def score(steps: int) -> str:
        r = evaluate(model, task, n=n, sampler={**sampler, "steps": steps}, seed=0, split="test")
        lo, hi = r["accuracy_interval"]
        how = INTERVAL_WORDS.get(r["interval"]["method"], r["interval"]["method"]).format(r["interval"].get("clusters"))
        return f"accuracy {r['accuracy']:.1%} [{lo:.1%}, {hi:.1%}] (95%, {how}), mean reward {r['mean_reward']:.3f}, n={r['n']}"

    described = json.dumps({**task_kwargs(cfg.task), **eval_args})
    lines = [f"- sealed test score (temperature {sampler['temperature']}, `{sampler['name']}` sampler, "
             f"{sampler['steps']} steps) on `{cfg.task.name}` with args `{described}`: {score(sampler['steps'])}"]
    lines += [f"- the same with {s} sampler step{'s' * (s > 1)} (parallel decoding): {score(s)}"
              for s in FEW_STEPS.get(name, ())]
    return lines


def rescore(name: str) -> Path:
    """Re-measure a shipped checkpoint's card scores in place (the rest of its card is kept)."""
    from ddrl.config import PretrainConfig, load_config
    from ddrl.models import load_model

    target = ROOT / "checkpoints" / name
    cfg = load_config(ROOT / SHIPPED[name][0], [], PretrainConfig)
    lines = (target / "README.md").read_text().splitlines()
    old = [i for i, line in enumerate(lines)
           if line.startswith(("- held-out score", "- sealed test score", "- the same with"))]
    if not old:
        raise ValueError(f"{target / 'README.md'}: no score lines to replace; rebuild it with `make checkpoints`")
    new = card_scores(name, load_model(target), cfg)
    lines[old[0]: old[-1] + 1] = new
    (target / "README.md").write_text("\n".join(lines) + "\n")
    print(f"{name}:\n" + "\n".join(new))
    return target


def main(argv: list[str]) -> int:
    reuse, again = "--reuse" in argv, "--rescore" in argv
    names = [a for a in argv if a not in ("--reuse", "--rescore")] or list(SHIPPED)
    for name in names:
        if name not in SHIPPED:
            print(f"unknown checkpoint {name!r}; choose from {', '.join(SHIPPED)}", file=sys.stderr)
            return 2
    for name in names:
        rescore(name) if again else make(name, reuse=reuse)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
