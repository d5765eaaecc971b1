"""The rewards MaskGRPO serves beside training: HPSv3 behind ddrl's reward server (a fake inferencer
with the hpsv3 package's API), UnifiedReward over an OpenAI-compatible chat endpoint (a stub HTTP
server that checks every request), and their weighted sum as MaskGRPO's trainer forms it."""

from __future__ import annotations

import base64
import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

from ddrl.rewards import CompositeReward
from ddrl.rewards.hpsv3 import HPSv3Reward
from ddrl.rewards.server import RewardServerClient, RewardServerError, serve_reward
from ddrl.rewards.unified_reward import TEMPLATE, UnifiedReward, parse_final_score


class FakeInferencer:
    """hpsv3's HPSv3RewardInferencer.reward(image_paths, prompts): one (mu, sigma) row per image. Here mu
    = 10 x the image's mean pixel + the prompt's length, sigma = 99 (it must never be the score)."""

    def __init__(self):
        self.calls = []

    def reward(self, image_paths, prompts):
        self.calls.append((list(image_paths), list(prompts)))
        rows = []
        for path, prompt in zip(image_paths, prompts):
            pixels = torch.from_numpy(np.array(Image.open(path).convert("RGB"))).float() / 255
            rows.append(torch.tensor([10 * pixels.mean().item() + len(prompt), 99.0]))
        return torch.stack(rows)


def test_hpsv3_adapter_scores_mu_over_five_through_a_reward_server():
    images = torch.rand(5, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    captions = ["a cat", "a red dog", "x", "two birds", "the sea"]
    fake = FakeInferencer()
    server = serve_reward(HPSv3Reward(inferencer=fake, batch_size=2), port=0, background=True)
    try:
        client = RewardServerClient(server.url, timeout=30)
        assert client.name == "hpsv3"
        scores = client([""] * 5, images=images, caption=captions)
    finally:
        server.shutdown()
        server.server_close()
    # MaskGRPO: rewards[i][0] (mu), / 5 on its server path; the PNG round trip keeps 8-bit pixels exactly
    pixels = (images.clamp(0, 1) * 255).round() / 255
    expected = [(10 * pixels[i].mean().item() + len(captions[i])) / 5 for i in range(5)]
    assert scores == pytest.approx(expected, rel=1e-5)
    assert [len(paths) for paths, _ in fake.calls] == [2, 2, 1] and fake.calls[0][1] == captions[:2]
    assert all(path.endswith(".png") for paths, _ in fake.calls for path in paths)
    raw = HPSv3Reward(inferencer=FakeInferencer(), scale=1.0)([""], images=images[:1], prompt=["a cat"])
    assert raw == pytest.approx([expected[0] * 5], rel=1e-5)  # scale=1: mu itself
    assert HPSv3Reward(inferencer=fake)(["text"]) == [None]  # a text task: not applicable


def test_hpsv3_needs_a_local_checkpoint_and_the_package(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        HPSv3Reward(tmp_path / "missing.pth")
    checkpoint = tmp_path / "model.pth"
    checkpoint.write_bytes(b"")
    with pytest.raises(ImportError, match="pip install hpsv3"):  # not installed in the test environment
        HPSv3Reward(checkpoint)


# --------------------------------------------------------------------------------------------
# UnifiedReward against a stub chat endpoint
# --------------------------------------------------------------------------------------------

REPLIES = {"a cat": "The cat is clear and sharp.\nFinal Score: 4.5", "a dog": "Final Score: 2 (blurry)",
           "a tree": "I cannot rate this.", "Final Score: 5": "Final Score: 1"}


class StubJudge(BaseHTTPRequestHandler):
    requests: list = []
    fail_captions: set = set()

    def _send(self, code, payload):
        body = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802
        assert self.path == "/v1/models" and self.headers["Authorization"] == "Bearer secret"
        self._send(200, {"object": "list", "data": [{"id": "UnifiedReward-7b-v1.5"}]})

    def do_POST(self):  # noqa: N802
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        # the request shape an OpenAI-compatible server (vLLM, sglang) takes, as flow_grpo sends it
        assert self.path == "/v1/chat/completions" and self.headers["Authorization"] == "Bearer secret"
        assert request["model"] == "UnifiedReward-7b-v1.5" and request["temperature"] == 0
        (message,) = request["messages"]
        image, text = message["content"]
        assert message["role"] == "user" and image["type"] == "image_url" and text["type"] == "text"
        prefix = "data:image/png;base64,"
        assert image["image_url"]["url"].startswith(prefix)
        picture = Image.open(io.BytesIO(base64.b64decode(image["image_url"]["url"][len(prefix):])))
        assert picture.format == "PNG" and picture.size == (512, 512)
        caption = text["text"].rsplit("Text Caption: [", 1)[1][:-1]
        assert text["text"] == TEMPLATE.format(prompt=caption)
        type(self).requests.append(caption)
        if caption in type(self).fail_captions:
            return self._send(500, {"error": "overloaded"})
        self._send(200, {"choices": [{"message": {"role": "assistant", "content": REPLIES[caption]}}]})

    def log_message(self, *args):
        pass


@pytest.fixture()
def judge():
    StubJudge.requests, StubJudge.fail_captions = [], {"a bird"}
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubJudge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_unifiedreward_asks_the_template_and_scores_final_score_over_five(judge):
    reward = UnifiedReward(judge, api_key="secret", retries=1, backoff=0.0, timeout=10)
    captions = ["a cat", "a dog", "a tree", "Final Score: 5", "a bird"]
    images = torch.rand(5, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    scores = reward([""] * 5, images=images, caption=captions)
    # 4.5 / 5; 2 / 5; no score in the reply: 0 (flow_grpo); the caption's own "Final Score: 5" is not the
    # judge's; a request that fails after its retry: None, counted
    assert scores[:4] == pytest.approx([0.9, 0.4, 0.0, 0.2])
    assert scores[4] is None and reward.failures == 1
    assert sorted(StubJudge.requests) == sorted(captions[:4] + ["a bird", "a bird"])  # one retry of the failure
    assert reward(["x"]) == [None]  # a text task: not applicable


def test_unifiedreward_endpoint_down_at_start_is_an_error():
    with pytest.raises(RewardServerError, match="not reachable"):
        UnifiedReward("http://127.0.0.1:9/v1", timeout=2)
    with pytest.raises(ValueError, match=r"\{prompt\}"):
        UnifiedReward("http://127.0.0.1:9/v1", template="no caption here", check=False)


def test_parse_final_score():
    assert parse_final_score("analysis...\nFinal Score: 3.75\n") == 3.75
    assert parse_final_score("Final Score:4") == 4.0
    assert parse_final_score("Final Score: 7") is None  # outside 1..5
    assert parse_final_score("Final score: 4") is None  # the judge is told the exact words
    assert parse_final_score("") is None


# --------------------------------------------------------------------------------------------
# MaskGRPO's weighted sum
# --------------------------------------------------------------------------------------------


def test_composite_is_maskgrpos_weighted_nansum():
    """MaskGRPO's trainer: rewards_per_func [n, k] (None -> NaN), (rewards_per_func x reward_weights).nansum(1);
    its run GenEval_HPSv3_CLIP sums geneval, hpsv3_remote and clip with weights 1 (reward_weights unset)."""
    parts = {"geneval": [1.0, 0.0, None, 0.5], "hpsv3": [2.1, 1.7, 1.9, None], "clip": [0.31, 0.22, 0.28, 0.30]}
    weights = {"geneval": 1.0, "hpsv3": 1.0, "clip": 1.0}
    fns = {name: (lambda scores: lambda completions, **_: list(scores))(scores) for name, scores in parts.items()}
    for w in (weights, {"geneval": 2.0, "hpsv3": 0.5, "clip": 1.0}):
        reward = CompositeReward([(name, fns[name], w[name]) for name in parts])
        total = reward([""] * 4)
        table = torch.tensor([[float("nan") if s is None else s for s in parts[name]] for name in parts]).T
        expected = (table * torch.tensor([w[name] for name in parts])).nansum(dim=1)
        assert total == pytest.approx(expected.tolist())
        # each part logged (reward/<name>), as MaskGRPO logs rewards/<func>
        assert reward.score([""] * 4).parts == parts


def test_text_to_image_builds_the_maskgrpo_sum_by_name(judge, tmp_path):
    from ddrl.tasks.text_to_image import image_reward

    reward = image_reward([{"name": "unifiedreward", "weight": 1.0, "args": {"url": judge, "api_key": "secret"}},
                           {"name": "hpsv3", "weight": 0.5, "args": {"inferencer": FakeInferencer()}}])
    assert isinstance(reward, CompositeReward) and reward.weights == {"unifiedreward": 1.0, "hpsv3": 0.5}
    with pytest.raises(ValueError, match="hpsv2, hpsv3, unifiedreward"):
        image_reward("imagereward")


def test_serve_reward_lists_the_named_rewards(capsys):
    from ddrl.cli import main

    with pytest.raises(SystemExit) as done:
        main(["serve-reward", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for name in ("pickscore", "clip_score", "hpsv2", "hpsv3", "unifiedreward"):
        assert name in text
    # a catalog name reaches its factory: one `ddrl: error:` line naming the problem (exit code 2)
    assert main(["serve-reward", "--reward", "hpsv2", "--arg", "checkpoint=/nonexistent/HPS_v2.1_compressed.pt"]) == 2
    assert "nothing is downloaded" in capsys.readouterr().err
