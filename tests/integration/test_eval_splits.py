"""The trainer's two evaluations (issue 17): eval.split (dev by default) before, every N steps and
at the end, for choosing; eval.report_split (test) once before and once after, for reporting, with
95% intervals. A task without a dev split is evaluated on test, with a notice."""

from __future__ import annotations

import json

import pytest

from ddrl.config import RLConfig, load_config
from ddrl.training.trainer import Trainer
from tests.integration.conftest import ROOT, rl_overrides

CFG = ROOT / "configs/rl/grpo_mini_sudoku.yaml"


def test_periodic_evaluations_use_dev_and_the_report_uses_the_sealed_test(tiny_sudoku_model, tmp_path):
    cfg = load_config(CFG, rl_overrides(tiny_sudoku_model, tmp_path, steps=2)
                      + ["task.name=mini_sudoku", "eval.n=8", "eval.every=1"], RLConfig)
    trainer = Trainer(cfg)
    trainer.run()
    assert [h["split"] for h in trainer.eval_history] == ["dev", "dev", "dev"]  # before, step 1, step 2
    assert trainer.report["before"]["split"] == trainer.report["after"]["split"] == "test"
    dev_prompts = {json.loads(line)["prompt"] for line in (tmp_path / "eval" / "step-0.jsonl").read_text().splitlines()}
    test_prompts = {json.loads(line)["prompt"]
                    for line in (tmp_path / "eval" / "report-step-0.jsonl").read_text().splitlines()}
    assert dev_prompts and test_prompts and not dev_prompts & test_prompts  # disjoint splits
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first, last = rows[0], rows[-1]
    assert {"eval_before/accuracy", "report_before/accuracy", "report_before/accuracy_lo"} <= set(first)
    assert last["report/accuracy_lo"] <= last["report/accuracy"] <= last["report/accuracy_hi"]
    assert "report/accuracy" not in first or first is last  # the report is scored at the end only


def test_a_task_without_dev_is_evaluated_on_test_with_a_notice(tiny_sudoku_model, tmp_path, capsys):
    # text_task's FunctionTask has train and test lists only (Trainer() encodes nothing yet)
    cfg = load_config(CFG, rl_overrides(tiny_sudoku_model, tmp_path, steps=1)
                      + ["task.name=tests.integration.text_task:make", "task.args={}"], RLConfig)
    trainer = Trainer(cfg)
    assert trainer.eval_split == "test"
    assert "no dev split" in capsys.readouterr().out


def test_a_task_breakdown_reaches_the_trainer_logs(tmp_path):
    # digits' eval_breakdown: per-class rate and diversity next to prompt following
    cfg = load_config(ROOT / "configs/rl/udm_grpo_digits.yaml",
                      ["train.steps=1", "train.prompts_per_step=2", "train.group_size=2", "eval.n=20", "eval.every=0",
                       "eval.report_split=null", "eval.steps=4", "rollout.steps=2", "train.progress=false",
                       f"output_dir={tmp_path}"], RLConfig)
    trainer = Trainer(cfg)
    trainer.run()
    assert set(trainer.eval_history[-1]["breakdown"]["per_class"]) == {str(c) for c in range(10)}
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = {k for row in rows for k in row}
    assert {"eval/min_class_rate", "eval/pairwise_hamming_mean", "eval_before/min_class_rate"} <= logged


def test_dev_and_test_draw_different_samples_for_the_same_prompts():
    # digits' splits share their prompts (the ten class symbols): a dev evaluation must not draw
    # the test evaluation's samples, or choosing on dev would be choosing on test
    import ddrl
    from ddrl.eval import evaluate
    from ddrl.eval.runner import sample_and_score, task_scoring

    model = ddrl.load_model(ROOT / "checkpoints/digits-uniform")
    task = ddrl.get_task("digits")
    examples = task.test_examples(10, seed=0)
    sampler = {"name": "uniform", "steps": 4, "gen_length": 64, "block_length": 64, "temperature": 1.0}
    dev = evaluate(model, task, examples=examples, sampler=sampler, split="dev", output_jsonl=None, seed=3)
    test = evaluate(model, task, examples=examples, sampler=sampler, split="test", seed=3)
    assert dev["mean_reward"] != test["mean_reward"]
    # the test split keeps the plain seed: its numbers are what sample_and_score(seed) draws
    from ddrl.eval.runner import default_sampler

    rows, _ = sample_and_score(model, examples, default_sampler(model, task, **sampler), task_scoring(task), seed=3)
    assert sum(r["rewards"][0] for r in rows) / len(rows) == pytest.approx(test["mean_reward"])
