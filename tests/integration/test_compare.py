"""`ddrl compare` (issue 17): the same training seeds for every method, each run scored on the same
sealed report examples before and after, gains with 95% intervals, per-method mean and spread over
seeds, the seed-pooled gain, a study that resumes, and a picture of dev curves."""

from __future__ import annotations

import json
import statistics

import pytest

from ddrl.cli import main
from ddrl.compare import aggregate, read_runs
from tests.integration.conftest import ROOT

CONFIG = str(ROOT / "configs/rl/compare_mini_sudoku.yaml")


def small() -> list[str]:  # the config's own model: the shipped converged Sudoku checkpoint
    return ["train.prompts_per_step=2", "train.group_size=4", "train.num_iterations=1",
            "eval.n=8", "eval.report_n=12", "eval.every=1", "train.progress=false"]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    argv = ["compare", "--config", CONFIG, "--methods", "grpo,spg", "--steps", "2", "--seeds", "0,1",
            "--output-dir", str(out), *small()]
    assert main(argv) == 0
    return out, argv


def report_rows(run_dir, step):
    path = run_dir / "eval" / f"report-step-{step}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_method_runs_every_seed_on_the_same_report_examples(study):
    out, _ = study
    runs = read_runs(out)
    assert sorted((r["method"], r["seed"]) for r in runs) == [("grpo", 0), ("grpo", 1), ("spg", 0), ("spg", 1)]
    prompts = {tuple(row["prompt"] for row in report_rows(out / r["method"] / f"seed-{r['seed']}", 0)) for r in runs}
    assert len(prompts) == 1 and len(next(iter(prompts))) == 12  # eval.seed fixed, eval.report_n examples
    for r in runs:
        assert r["report_split"] == "test" and r["n"] == 12
        assert r["gain"]["lo"] <= r["gain"]["mean"] <= r["gain"]["hi"]
        assert [h["step"] for h in r["dev"]] == [0, 1, 2]
    for method in ("grpo", "spg"):  # the training seed reaches the run: other rollouts, other updates
        rewards = [[row.get("reward/std") for row in map(json.loads, (out / method / f"seed-{s}" / "metrics.jsonl")
                                                          .read_text().splitlines()) if "reward/std" in row]
                   for s in (0, 1)]
        assert rewards[0] and rewards[0] != rewards[1]


def test_the_table_reports_mean_spread_and_the_pooled_gain_of_the_seeds(study):
    out, _ = study
    results = {r["method"]: r for r in json.loads((out / "results.json").read_text())}
    for method, r in results.items():
        finals, pooled_before, pooled_after = [], [], []
        for seed in (0, 1):
            run = out / method / f"seed-{seed}"
            before = [float(x["correct"][0]) for x in report_rows(run, 0)]
            after = [float(x["correct"][0]) for x in report_rows(run, 2)]
            finals.append(statistics.fmean(after))
            pooled_before.append(before)
            pooled_after.append(after)
        assert r["final_mean"] == pytest.approx(statistics.fmean(finals))
        assert r["final_sd"] == pytest.approx(statistics.stdev(finals))
        # the pooled gain: each example's scores averaged over the seeds, then after - before
        per_example = [statistics.fmean(a) - statistics.fmean(b)
                       for a, b in zip(zip(*pooled_after), zip(*pooled_before))]
        assert r["pooled_gain"]["mean"] == pytest.approx(statistics.fmean(per_example))
        assert r["pooled_gain"]["lo"] <= r["pooled_gain"]["mean"] <= r["pooled_gain"]["hi"]
    table = (out / "table.md").read_text()
    assert "| grpo | 2 |" in table and "| spg | 2 |" in table and "n=12" in table
    assert (out / "curves.png").stat().st_size > 1000


def test_a_stopped_study_resumes_without_rerunning_finished_runs(study, capsys):
    out, argv = study
    before = (out / "runs.jsonl").read_text()
    assert main(argv) == 0  # every (method, seed) is already in runs.jsonl
    assert (out / "runs.jsonl").read_text() == before
    assert '"seed": ' not in capsys.readouterr().out  # no run printed its record


def test_runs_on_different_report_examples_cannot_be_pooled(study, tmp_path):
    out, _ = study
    first = read_runs(out)[0]
    moved = dict(first, seed=9, run_dir=str(tmp_path / "other"))  # the same method, another seed
    (tmp_path / "other" / "eval").mkdir(parents=True)
    for step in (0, 2):
        rows = report_rows(out / first["method"] / f"seed-{first['seed']}", step)
        rows[0]["prompt"] = "another puzzle"
        (tmp_path / "other" / "eval" / f"report-step-{step}.jsonl").write_text(
            "\n".join(json.dumps(r) for r in rows) + "\n")
    study_dir = tmp_path / "study"
    study_dir.mkdir()
    (study_dir / "runs.jsonl").write_text(json.dumps(first) + "\n" + json.dumps(moved) + "\n")
    with pytest.raises(ValueError, match="eval.seed"):
        aggregate(study_dir, plot=False)


def test_bad_seeds_are_refused_before_any_run(tmp_path):
    with pytest.raises(SystemExit, match="--seeds"):
        main(["compare", "--seeds", "0,x", "--output-dir", str(tmp_path)])
    assert not list(tmp_path.iterdir())


def test_one_method_against_another_on_the_same_examples(study):
    from ddrl.compare import method_difference

    out, _ = study
    finals = {m: [[float(x["correct"][0]) for x in report_rows(out / m / f"seed-{s}", 2)] for s in (0, 1)]
              for m in ("grpo", "spg")}
    per_example = [statistics.fmean(a) - statistics.fmean(b)
                   for a, b in zip(zip(*finals["spg"]), zip(*finals["grpo"]))]
    diff = method_difference(out, "spg", "grpo")  # spg's final minus grpo's
    assert diff["mean"] == pytest.approx(statistics.fmean(per_example))
    assert diff["lo"] <= diff["mean"] <= diff["hi"] and diff["n"] == 12
    with pytest.raises(ValueError, match="no finished run"):
        method_difference(out, "spg", "gdsd")


def test_a_preempted_run_is_not_recorded_as_finished(tmp_path, monkeypatch, capsys):
    from ddrl.compare import run_compare
    from ddrl.training.trainer import Trainer

    def preempted(self):  # SIGTERM after a checkpoint: run() returns before train.steps
        self.step = 1
        return self.run_dir

    monkeypatch.setattr(Trainer, "run", preempted)
    run_compare(CONFIG, methods=["grpo", "spg"], steps=2, output_dir=str(tmp_path), seeds=[0],
                extra_overrides=small())
    assert read_runs(tmp_path) == []  # nothing recorded: rerunning the command runs it again
    assert "grpo seed 0 stopped at step 1" in capsys.readouterr().out
