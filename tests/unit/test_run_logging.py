"""Run logging: the reward curve's legend states how the evaluations sampled (split, temperature),
read from the run's config (a T=1 evaluation is not "greedy"); a resumed metrics.jsonl keeps each
step once."""

import json

import matplotlib.figure
import pytest
import yaml

from ddrl.training.logging import plot_reward_curve


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
