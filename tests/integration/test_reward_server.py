"""Reward servers (ddrl/rewards/server.py): JSON + PNG over HTTP on loopback, never pickle; a server
that is down is an error before any compute, one that fails or is slow scores None within bounded
time, and a run trained through one loses nothing."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest
import torch

from ddrl.rewards.server import RewardServerClient, RewardServerError, serve_reward
from tests.integration.conftest import ROOT


def brightness(completions, images=None, **columns):
    """A scorer that reads pixels and a column: mean brightness, plus 1 where the label is 1."""
    return [float(images[i].mean()) + float(columns["label"][i] == 1) for i in range(len(completions))]


@pytest.fixture
def server():
    s = serve_reward(brightness, background=True)
    yield s
    s.shutdown()
    s.server_close()


def test_a_served_reward_equals_the_reward(server):
    images = torch.rand(5, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    labels = [0, 1, 2, 1, 0]
    client = RewardServerClient(server.url, batch_size=2)  # 3 requests
    assert client.name == "brightness"
    served = client([""] * 5, images=images, label=labels)
    direct = brightness([""] * 5, images=torch.round(images * 255) / 255, label=labels)  # PNG keeps 8 bits
    assert served == pytest.approx(direct, abs=1e-6) and client.failures == 0


def test_a_server_that_is_down_is_a_clear_error_at_once():
    s = serve_reward(brightness)  # bound to a free port, then closed: nothing listens there
    url = s.url
    s.server_close()
    start = time.perf_counter()
    with pytest.raises(RewardServerError, match="not reachable.*ddrl serve-reward"):
        RewardServerClient(url)
    assert time.perf_counter() - start < 10


def test_a_failing_or_slow_server_scores_none_within_bounded_time():
    def broken(completions, **_):
        raise RuntimeError("the scorer crashed")

    def slow(completions, **_):
        time.sleep(3)
        return [1.0] * len(completions)

    for fn in (broken, slow):
        s = serve_reward(fn, background=True)
        try:
            client = RewardServerClient(s.url, timeout=0.5, retries=1, backoff=0.1)
            start = time.perf_counter()
            assert client(["a", "b"], label=[0, 1]) == [None, None]
            assert client.failures == 1 and time.perf_counter() - start < 5
        finally:
            s.shutdown()
            s.server_close()


def test_bad_requests_get_a_400_not_a_crash(server):
    import urllib.error
    import urllib.request

    body = json.dumps({"protocol": 99, "completions": []}).encode()
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(urllib.request.Request(f"{server.url}/score", data=body, method="POST"), timeout=5)
    assert err.value.code == 400 and "protocol" in json.loads(err.value.read())["error"]
    assert RewardServerClient(server.url).health()["ok"]  # still serving


def test_two_step_training_with_a_reward_served_over_http(server, monkeypatch, tmp_path):
    from ddrl.models.diffusion_lm import DiffusionLM
    from ddrl.training.trainer import train
    from tests.integration import test_image_rollouts as images

    monkeypatch.setattr(DiffusionLM, "decode_images", images.gray_decoder, raising=False)
    monkeypatch.setattr(DiffusionLM, "image_token_range", (images.FIRST_GRAY, images.FIRST_GRAY + 17), raising=False)
    client = RewardServerClient(server.url)
    monkeypatch.setattr(images.BrightDigits, "reward", lambda self, completions, **kw: client(completions, **kw))
    run = train(ROOT / "configs/rl/udm_grpo_digits.yaml", images._overrides(tmp_path))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    assert all(r["reward/mean"] > 0 for r in rows) and client.failures == 0


def test_serve_reward_command_serves_a_module_function(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "ddrl", "serve-reward", "--reward",
                             "tests.integration.test_reward_server:brightness", "--port", "0"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    try:
        line = proc.stdout.readline()  # "serving reward ... at http://127.0.0.1:PORT (...)"
        url = line.split(" at ")[1].split()[0]
        client = RewardServerClient(url)
        images = torch.zeros(2, 3, 4, 4)
        assert client(["", ""], images=images, label=[1, 0]) == [1.0, 0.0]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
