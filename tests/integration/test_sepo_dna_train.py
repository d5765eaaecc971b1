"""A 2-step `ddrl train` of SEPO's own recipe (configs/paper/sepo/dna_enhancer.yaml: drakes rollouts,
concrete_score states=clean, sepo clip=released) on the tiny MDLM DNA checkpoint and a gosai-format CSV."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

import ddrl
from tests.configs.test_paper_recipes import write_dna_files

ROOT = Path(__file__).resolve().parents[2]
CKPT = ROOT / "tests/fixtures/sepo_dna/tiny_mdlm_dna.ckpt"


def test_two_step_train_on_the_tiny_checkpoint(tmp_path):
    files = write_dna_files(tmp_path)
    overrides = [f"model.path={CKPT}", "model.mixed_precision=none", "train.steps=2", "train.prompts_per_step=2",
                 "train.group_size=2", "train.num_iterations=2", "train.tensorboard=false", "train.progress=false",
                 "train.save_every=0", "eval.n=0", "eval.before=false", "eval.every=0", "dist.strategy=none",
                 f"output_dir={tmp_path / 'run'}", "rollout.gen_length=8", "rollout.steps=8",
                 f"task.args.path={files['path']}", f"task.args.oracle={files['oracle']}",
                 "task.args.oracle_kind=torchscript", "task.args.atac_oracle=null"]
    before = {k: v.clone() for k, v in ddrl.load_model(CKPT).model.state_dict().items()}
    run = Path(ddrl.train(str(ROOT / "configs/paper/sepo/dna_enhancer.yaml"), overrides=overrides))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) and "ratio_mean" in r for r in rows)
    saved = sorted(run.glob("checkpoint-*")) + sorted(run.glob("final*"))
    if saved:  # the trained weights moved
        after = ddrl.load_model(saved[-1]).model.state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before)
