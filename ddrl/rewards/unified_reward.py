"""UnifiedReward (Wang et al. 2025): a VLM judge served by vLLM or sglang, asked for a 1-5 score.

MaskGRPO trains on it (grpo/mask_grpo_train.py's t2i reward @ b74ba3c) through a server of its own
that takes pickled JPEGs and answers scores, which its client divides by 5. That server is not
published; the public recipe of the same reward, in flow_grpo (flow_grpo/rewards.py
`unifiedreward_score_sglang` @ ac4c86e, which MaskGRPO's README points to for reward servers), asks an
OpenAI-compatible chat endpoint: one request per image, the image as a base64 PNG resized to 512 x 512,
the caption in the template below, temperature 0; the score is the number after "Final Score:" (1..5,
decimals allowed) divided by 5, and a reply without one scores 0. This reward does exactly that over
plain HTTP JSON (never pickle), with ddrl's bounded requests (rewards/server.py: a timeout per request,
a fixed number of retries, None for an image whose request still fails, counted in `.failures`); an
endpoint that does not answer when the reward is made is an error at once.

    python -m sglang.launch_server --model-path CodeGoat24/UnifiedReward-7b-v1.5 --api-key KEY --port 17140 \\
        --chat-template chatml-llava            (or vllm serve ... --served-model-name UnifiedReward-7b-v1.5)
    task.args.reward: unifiedreward, reward_args: {url: http://127.0.0.1:17140/v1, api_key: KEY}
"""

from __future__ import annotations

import logging
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ddrl.rewards.composite import row_texts
from ddrl.rewards.server import RequestFailed, RewardServerError, get_json, pil_to_png, post_json

log = logging.getLogger(__name__)

# The judge's instruction, word for word as flow_grpo sends it (the reward is defined by it: another
# wording is another reward). {prompt} is the caption.
TEMPLATE = (
    "<image>\nYou are given a text caption and a generated image based on that caption. Your task is to evaluate "
    "this image based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with "
    "the provided caption. Consider the accuracy of depicted objects, their relationships, and attributes as "
    "described in the caption.\n2. Overall Image Quality: Examine the visual quality of this image, including "
    "clarity, detail preservation, color accuracy, and overall aesthetic appeal.\nBased on the above criteria, "
    "assign a score from 1 to 5 after 'Final Score:'.\nYour task is provided as follows:\nText Caption: [{prompt}]"
)
_FINAL_SCORE = re.compile(r"Final Score:\s*([1-5](?:\.\d+)?)")


def parse_final_score(reply: str) -> float | None:
    """The first "Final Score: x" with x in 1..5 (decimals allowed) of a judge's reply; None if there is none."""
    match = _FINAL_SCORE.search(reply or "")
    return None if match is None else float(match.group(1))


class UnifiedReward:
    """reward(completions, images=[n, 3, H, W], caption=...) -> Final Score / 5 per image, from a chat endpoint.

    url:         the OpenAI-compatible base url, ending in /v1
    model:       the served model name; api_key: sent as a Bearer token when given
    resize:      the side the image is resized to before sending (512, as flow_grpo; None: as it is)
    unparsed:    the score of a reply with no "Final Score:" (0.0, as flow_grpo)
    timeout, retries, backoff: per request, as RewardServerClient; concurrency: requests in flight
    """

    def __init__(self, url: str = "http://127.0.0.1:17140/v1", *, model: str = "UnifiedReward-7b-v1.5",
                 api_key: str | None = None, template: str = TEMPLATE, max_score: float = 5.0,
                 resize: int | None = 512, unparsed: float | None = 0.0, text_column: str = "caption",
                 timeout: float = 120.0, retries: int = 2, backoff: float = 1.0, concurrency: int = 8,
                 max_tokens: int | None = None, check: bool = True):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"UnifiedReward url must start with http:// or https://, got {url!r}")
        if "{prompt}" not in template:
            raise ValueError("the UnifiedReward template must contain {prompt} (where the caption goes)")
        if not max_score > 0 or timeout <= 0 or retries < 0 or backoff < 0 or concurrency < 1:
            raise ValueError("UnifiedReward needs max_score > 0, timeout > 0, retries >= 0, backoff >= 0, concurrency >= 1")
        if resize is not None and resize < 1:
            raise ValueError(f"resize must be a positive side in pixels or None, got {resize}")
        self.url, self.model, self.template = url.rstrip("/"), model, template
        self.max_score, self.resize, self.unparsed, self.text_column = float(max_score), resize, unparsed, text_column
        self.timeout, self.retries, self.backoff, self.concurrency = timeout, retries, backoff, concurrency
        self.max_tokens = max_tokens
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.failures = 0  # images scored None because the endpoint did not answer
        self._lock = threading.Lock()  # requests run in threads
        self.__name__ = "unifiedreward"
        if check:
            self.health()

    def health(self) -> dict[str, Any]:
        """The endpoint's GET /models answer; RewardServerError when it does not answer."""
        try:
            return get_json(f"{self.url}/models", timeout=min(self.timeout, 10.0), headers=self.headers)
        except Exception as e:  # noqa: BLE001 - any failure means the same: not usable
            raise RewardServerError(f"UnifiedReward endpoint {self.url} is not reachable ({e}); start the model "
                                    f"(vLLM or sglang, OpenAI-compatible, the url ends in /v1) and check the url "
                                    f"and api_key") from None

    def request(self, picture: Any, caption: str) -> dict[str, Any]:
        """The chat request for one image (a PIL image) and its caption."""
        from PIL import Image

        if self.resize is not None:
            picture = picture.resize((self.resize, self.resize), Image.Resampling.BICUBIC)
        content = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{pil_to_png(picture)}"}},
                   {"type": "text", "text": self.template.format(prompt=caption)}]
        body: dict[str, Any] = {"model": self.model, "messages": [{"role": "user", "content": content}],
                                "temperature": 0}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        return body

    def _score_one(self, body: dict[str, Any]) -> float | None:
        try:
            answer = post_json(f"{self.url}/chat/completions", body, timeout=self.timeout, retries=self.retries,
                               backoff=self.backoff, headers=self.headers)
            reply = answer["choices"][0]["message"]["content"]
        except (RequestFailed, KeyError, IndexError, TypeError) as e:
            with self._lock:
                self.failures += 1
            log.warning("UnifiedReward endpoint %s gave no score (%s); the image scores None (%d so far)",
                        self.url, e, self.failures)
            return None
        score = parse_final_score(reply if isinstance(reply, str) else "")
        return self.unparsed if score is None else score / self.max_score

    def __call__(self, completions: list[str], *, images: torch.Tensor | None = None,
                 **columns: Any) -> list[float | None]:
        from ddrl.rewards.pixels import to_pil

        if images is None:
            return [None] * len(completions)  # a text task: not applicable
        captions = row_texts(columns, self.text_column, len(completions), "unifiedreward")
        bodies = [self.request(p, c) for p, c in zip(to_pil(images), captions)]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, max(1, len(bodies)))) as pool:
            return list(pool.map(self._score_one, bodies))


def unifiedreward_reward(url: str = "http://127.0.0.1:17140/v1", **kwargs: Any) -> UnifiedReward:
    """UnifiedReward's Final Score / 5 from an OpenAI-compatible endpoint (reward name `unifiedreward`)."""
    return UnifiedReward(url, **kwargs)
