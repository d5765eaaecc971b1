"""Run logging: the reward curve's legend states how the evaluations sampled (split, temperature),
read from the run's config (a T=1 evaluation is not "greedy"); a resumed metrics.jsonl keeps each
step once."""

import json

import matplotlib.figure
import pytest
import yaml

from ddrl.training.logging import MetricsLogger, plot_reward_curve, read_metrics, stat_name


@pytest.mark.parametrize("temperature,label", [(1.0, "eval/accuracy (test split, T=1)"),
                                               (0.0, "eval/accuracy (test split, greedy)")])
def test_the_legend_states_the_eval_split_and_temperature(tmp_path, monkeypatch, temperature, label):
    rows = [{"step": 1, "reward/mean": 0.2, "eval/accuracy": 0.1}, {"step": 2, "reward/mean": 0.4, "eval/accuracy": 0.3}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"eval": {"split": "test", "temperature": temperature}}))
    legends = []
    real = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: (
        legends.append([t.get_text() for t in fig.axes[0].get_legend().get_texts()]), real(fig, *a, **k))[1])
    plot_reward_curve(tmp_path / "metrics.jsonl", tmp_path / "curve.png")
    assert legends == [["reward/mean (rollouts)", label]]


def test_a_resume_keeps_the_rows_up_to_its_step_and_drops_a_line_cut_short(tmp_path):
    from ddrl.training.logging import MetricsLogger

    rows = "".join(json.dumps({"step": s, "loss": 0.1}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "lo'
    (tmp_path / "metrics.jsonl").write_text(rows)
    MetricsLogger(tmp_path, tensorboard=False, start_step=2).log(3, {"loss": 0.2})
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_metric_names_are_grouped_and_the_old_names_stay_readable_in_metrics_jsonl(tmp_path):
    """Objective statistics get their prefixed names in one place (stat_name); metrics.jsonl carries
    the 0.1 names beside them for one release, TensorBoard only the new ones, and read_metrics reads a
    0.1 file under the new names."""
    assert [stat_name(n) for n in ("kl", "clip_frac", "ratio_mean", "train_rows", "weight_max")] == [
        "loss/kl", "clip_ratio/region_mean", "ratio/mean", "update/rows", "objective/weight_max"]
    logger = MetricsLogger(tmp_path, tensorboard=True)
    logger.log(1, {"loss/total": 0.5, "loss/kl": 0.1, "clip_ratio/region_mean": 0.25,
                   "completions/mean_length": 7.0, "objective/weight_max": 0.9, "reward/mean": 1.0})
    logger.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["loss/total"] == row["loss"] == 0.5 and row["kl"] == 0.1 and row["clip_frac"] == 0.25
    assert row["completion/length"] == 7.0 and row["weight_max"] == 0.9 and row["reward/mean"] == 1.0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # tensorboard: a dependency

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss/total", "loss/kl", "clip_ratio/region_mean"} <= tags and not tags & {"loss", "kl", "clip_frac"}
    old = tmp_path / "old" / "metrics.jsonl"
    old.parent.mkdir()
    old.write_text(json.dumps({"step": 1, "loss": 0.5, "kl": 0.1, "completion/length": 3.0}) + "\n")
    r = read_metrics(old)[0]
    assert (r["loss/total"], r["loss/kl"], r["completions/mean_length"]) == (0.5, 0.1, 3.0)
