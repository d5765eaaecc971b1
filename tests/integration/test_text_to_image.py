"""The text-to-image task on the peers' prompt formats (a .txt prompt list, GenEval's metadata
jsonl), trained and evaluated with a reward served over HTTP that reads the decoded image and the
row's GenEval metadata, and a weighted sum of rewards."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ddrl.models.diffusion_lm import DiffusionLM
from ddrl.rewards.server import serve_reward
from ddrl.tasks import get_task
from tests.integration import test_image_rollouts as images
from tests.integration.conftest import ROOT

CLASSES = [f"<c{d}>" for d in range(10)]  # the digits model's prompt vocabulary


def geneval_like(completions, images=None, metadata=None, caption=None, **_):
    """Partial credit: brightness, plus 1 where the metadata's count matches the prompted digit."""
    counts = [m.get("include", [{}])[0].get("count") for m in metadata]
    return [float(images[i].mean()) + float(counts[i] == int(caption[i][2])) for i in range(len(completions))]


@pytest.fixture
def files(tmp_path):
    train = tmp_path / "train_metadata.jsonl"
    train.write_text("".join(json.dumps({"tag": "counting", "include": [{"class": "digit", "count": d}],
                                         "prompt": CLASSES[d]}) + "\n" for d in range(10)))
    test = tmp_path / "test.txt"
    test.write_text("\n".join(CLASSES[:4]) + "\n")
    return train, test


@pytest.fixture
def decoder(monkeypatch):
    monkeypatch.setattr(DiffusionLM, "decode_images", images.gray_decoder, raising=False)
    monkeypatch.setattr(DiffusionLM, "image_token_range", (images.FIRST_GRAY, images.FIRST_GRAY + 17), raising=False)


def test_prompt_files_and_their_columns(files):
    train, test = files
    task = get_task("text_to_image", image_grid=[8, 8], reward=geneval_like, train_path=str(train),
                    test_path=str(test), dev_fraction=0.0)
    assert task.modality == "image" and task.image_grid == (8, 8) and task.gen_length == 64
    rows = task.train_examples(10)
    assert {r["prompt"] for r in rows} == set(CLASSES[4:])  # test prompts never train
    assert all(r["metadata"]["tag"] == "counting" for r in rows)
    assert [r["prompt"] for r in task.all_test_examples()] == CLASSES[:4] and task.all_test_examples()[0]["metadata"] == {}
    with pytest.raises(ValueError, match="image_grid must be"):
        get_task("text_to_image", image_grid=[8], reward=geneval_like, path=str(test))
    with pytest.raises(ValueError, match="reward 'hps' is not known"):
        get_task("text_to_image", image_grid=[8, 8], reward="hps", path=str(test))


def test_training_on_prompt_files_with_a_served_weighted_reward(files, decoder, tmp_path):
    from ddrl.training.trainer import train

    server = serve_reward(geneval_like, background=True)
    try:
        train_file, test_file = files
        reward = json.dumps([{"name": "server", "weight": 0.5, "args": {"url": server.url}, "label": "geneval"}])
        overrides = images._overrides(tmp_path / "run") + [
            "task.name=text_to_image", f"task.args={{image_grid: [8, 8], train_path: {train_file}, "
            f"test_path: {test_file}, dev_fraction: 0.0, reward: {reward}}}", "eval.report_n=4", "eval.n=4"]
        run = train(ROOT / "configs/rl/udm_grpo_digits.yaml", overrides)
    finally:
        server.shutdown()
        server.server_close()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    assert all(0 < r["reward/mean"] <= 1.0 for r in rows)  # 0.5 x (brightness + count match)
    assert any(key.startswith("reward/geneval") for key in rows[0]), sorted(rows[0])
    assert (run / "eval" / "step-2.png").is_file()


def test_eval_scores_the_test_prompts(files, decoder):
    import ddrl

    train, test = files
    task = get_task("text_to_image", image_grid=[8, 8], reward=geneval_like, test_path=str(test))
    model = ddrl.load_model(ROOT / "checkpoints/digits-uniform")
    result = ddrl.evaluate(model, task, n=4, sampler={"steps": 2, "temperature": 1.0})
    assert result["n"] == 4 and torch.isfinite(torch.tensor(result["mean_reward"]))


def test_ddrl_eval_json_scores_text_to_image_on_the_ursa_fixture(tmp_path):
    """The command line end to end: URSA's own sampler (auto -> metric_path), its VQ decoder, a served
    reward, a JSON result and the PNG grid beside the per-example rows."""
    import subprocess
    import sys

    prompts = tmp_path / "test.txt"
    prompts.write_text("a cat\na red dog\na tree\n")
    server = serve_reward(geneval_like_pixels, background=True)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "ddrl", "eval", "--model", ROOT / "tests/fixtures/ursa/model", "--task",
             "text_to_image", "--task-arg", "image_grid=[4,4]", "--task-arg", f"test_path={prompts}",
             "--task-arg", "reward=server", "--task-arg", f"reward_args={{url: {server.url}}}", "--n", "3",
             "--steps", "4", "--temperature", "1", "--json", "--output", tmp_path / "rows.jsonl"],
            cwd=ROOT, capture_output=True, text=True, timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["n"] == 3 and result["sampler"]["name"] == "metric_path" and 0 <= result["mean_reward"] <= 1
    assert (tmp_path / "rows.png").is_file()


def geneval_like_pixels(completions, images=None, caption=None, **_):
    assert images.shape[1:] == (3, 8, 8)  # the fixture's VQ decoder: 4 x 4 codes -> 8 x 8 pixels
    return images.mean(dim=(1, 2, 3)).tolist()
