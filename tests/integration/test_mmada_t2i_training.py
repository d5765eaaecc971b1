"""MaskGRPO's image half in miniature: a 2-step `ddrl train` of MaskGRPO on a tiny official-layout
MMaDA loaded with a MAGVIT-v2 decoder (model.vq_path), text-to-image prompts from a file, emerge
rollouts, and a CLIP-score reward on the decoded pixels (a tiny random CLIP directory)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.conftest import ROOT
from tests.tiny_clip import write_tiny_clip
from tests.unit.test_mmada_t2i import write_magvit, write_tiny_mmada


def t2i_run(tmp_path, config: str, sampler: str, extra: list[str]) -> tuple:
    """A 2-step `ddrl train` of `config` on the tiny MMaDA + MAGVIT pair with a tiny CLIP reward; returns
    (the MMaDA directory, the run directory, its metrics rows)."""
    from ddrl.training.trainer import train

    mmada, magvit = write_tiny_mmada(tmp_path / "mmada"), write_magvit(tmp_path / "magvit")
    clip = write_tiny_clip(tmp_path / "clip")
    prompts = tmp_path / "train.txt"
    prompts.write_text("a red cat\na blue dog\na green tree\na small house\n")
    reward = json.dumps([{"name": "clip_score", "weight": 1.0, "args": {"model": str(clip)}}])
    run = train(ROOT / config, [
        f"model.path={mmada}", f"model.vq_path={magvit}", "model.dtype=float32",
        "task.name=text_to_image", "task.args={}", f"task.args={{image_grid: [2, 2], path: {prompts}, split: hash, "
        f"test_fraction: 0.25, dev_fraction: 0.0, reward: {reward}}}",
        f"rollout.name={sampler}", "rollout.gen_length=4", "rollout.steps=2", "rollout.block_length=null",
        "rollout.cache=none", "rollout.temperature=1.0", "train.steps=2", "train.prompts_per_step=2",
        "train.group_size=2", "train.lr=1e-2", "train.save_every=2", "eval.n=0", "eval.before=false",
        "train.progress=false", "train.tensorboard=false", f"output_dir={tmp_path / 'run'}", *extra])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows), rows
    assert all(math.isfinite(r["reward/mean"]) for r in rows)
    before, after = load_file(str(mmada / "model.safetensors")), load_file(str(run / "checkpoint-2" / "model.safetensors"))
    assert before.keys() == after.keys()  # saved back in the official layout
    assert any(not torch.equal(before[k].float(), after[k].float()) for k in before), "no parameter moved"
    return mmada, run, rows


@pytest.mark.parametrize("released", [False, True])
def test_two_step_maskgrpo_text_to_image_on_mmada(tmp_path, released):
    """released: MaskGRPO's attended [iPAD] rows (model.t2i_attend_padding) and emerge draws (rollout.rng)."""
    _, run, _ = t2i_run(tmp_path, "configs/rl/maskgrpo_mini_sudoku.yaml", "emerge",
                        ["model.t2i_attend_padding=true", "rollout.rng=released"] if released else [])
    saved = json.loads((run / "checkpoint-2" / "config.json").read_text())["ddrl"]
    assert saved["t2i_attend_padding"] is released


def test_two_step_unigrpo_text_to_image_on_mmada(tmp_path):
    """UniGRPO (MMaDA's own RL method) on the same tiny MMaDA: MaskGIT rollouts (MMaDA's t2i sampler),
    random-ratio masked copies of the image scored with <|eoi|> after it (tests/unit/test_unigrpo_t2i.py),
    backward per chunk of 3 (sample, copy) rows; MMaDA released no image RL settings, so these are ddrl's."""
    _, _, rows = t2i_run(tmp_path, "configs/rl/unigrpo_mini_sudoku.yaml", "maskgit",
                         ["method.estimator_args.copies=2", "train.micro_batch_rows=3", "train.num_iterations=2"])
    assert all(r["optimizer_steps"] > 0 for r in rows) and rows[-1]["optimizer_steps"] == 4  # mu 2 x 2 steps

def test_ddrl_eval_json_on_a_text_to_image_mmada(tmp_path):
    """`ddrl eval --vq-path` makes the MMaDA an image model from the command line, as load_model(vq_path=)
    does: emerge with MaskGRPO's released draws (--rng) and rows (--t2i-attend-padding), a CLIP reward on
    the decoded pixels, a JSON result with the sampler that ran, and the PNG grid beside the rows."""
    import subprocess
    import sys

    mmada, magvit = write_tiny_mmada(tmp_path / "mmada"), write_magvit(tmp_path / "magvit")
    clip = write_tiny_clip(tmp_path / "clip")
    prompts = tmp_path / "test.txt"
    prompts.write_text("a red cat\na blue dog\n")
    command = [sys.executable, "-m", "ddrl", "eval", "--model", str(mmada), "--vq-path", str(magvit),
               "--t2i-attend-padding", "--task", "text_to_image", "--task-arg", "image_grid=[2,2]",
               "--task-arg", f"test_path={prompts}", "--task-arg", "reward=clip_score",
               "--task-arg", f"reward_args={{model: {clip}}}", "--n", "2", "--sampler", "emerge", "--steps", "2",
               "--temperature", "1", "--rng", "released", "--json", "--output", str(tmp_path / "rows.jsonl")]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["n"] == 2 and result["sampler"]["name"] == "emerge" and result["sampler"]["rng"] == "released"
    assert math.isfinite(result["mean_reward"])
    assert (tmp_path / "rows.png").is_file()
    # without the decoder the same MMaDA completes text, and the released draws refuse it before any compute
    proc = subprocess.run([c for c in command if c not in ("--vq-path", str(magvit), "--t2i-attend-padding")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode != 0 and "vq_path" in proc.stderr, proc.stderr[-2000:]
