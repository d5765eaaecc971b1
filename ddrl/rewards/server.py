"""Reward servers: a reward function in another process or on another machine, over HTTP.

Reward models with their own stacks (GenEval's mmdet, PaddleOCR, a VLM judge) conflict with the
training environment, so every peer runs them as servers. ddrl speaks one explicit protocol, JSON
with PNG images, never pickle (a pickle from the network runs arbitrary code on load):

    GET  /health  -> {"ok": true, "protocol": 1, "reward": "<name>"}
    POST /score   <- {"protocol": 1, "completions": [str, ...], "columns": {name: [value, ...]},
                      "images": [base64 PNG, ...] | null}
                  -> {"rewards": [float | null, ...]}          (400/500: {"error": "<why>"})

`serve_reward(fn)` wraps any reward function `fn(completions, images=..., **columns)` (`ddrl
serve-reward` on the command line); `RewardServerClient(url)` is a reward function that calls one.
The client is bounded: every request has a timeout, failed requests are retried a fixed number of
times with a fixed backoff, and a batch that still fails scores None for every completion (logged
and counted in `client.failures`), so a server that is down or slow never hangs a run and loses
nothing of it: the step goes on with no reward for those completions (method.invalid_reward says
what None means). A server that is unreachable when the client is made is an error at once.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import torch
from torch import Tensor

log = logging.getLogger(__name__)

PROTOCOL = 1
MAX_BODY = 512 * 2**20  # a request body above this is refused (a batch of 64 512-px PNGs is ~40 MB)


class RewardServerError(RuntimeError):
    """The reward server cannot be used: unreachable, or it speaks another protocol."""


# --------------------------------------------------------------------------------------------
# Images <-> PNG
# --------------------------------------------------------------------------------------------


def images_to_png(images: Tensor) -> list[str]:
    """[n, 3, H, W] in [0, 1] -> n base64 PNG strings (lossless, 8 bits per channel)."""
    from ddrl.rewards.pixels import to_pil

    return [pil_to_png(picture) for picture in to_pil(images)]


def pil_to_png(picture: Any) -> str:
    """A PIL image -> a base64 PNG string."""
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def png_to_images(encoded: list[str]) -> Tensor:
    """n base64 PNG strings of one size -> [n, 3, H, W] float32 in [0, 1]."""
    import numpy as np
    from PIL import Image

    arrays = [np.asarray(Image.open(io.BytesIO(base64.b64decode(s))).convert("RGB")) for s in encoded]
    if len({a.shape for a in arrays}) > 1:
        raise ValueError(f"images of one request must share a size, got {sorted({a.shape for a in arrays})}")
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255.0


def _jsonable(value: Any) -> Any:
    """A column value as JSON: numbers, strings, lists and dicts as they are; anything else as str."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)


# --------------------------------------------------------------------------------------------
# The client: a reward function
# --------------------------------------------------------------------------------------------


class RewardServerClient:
    """reward(completions, images=None, **columns) -> list[float | None], scored by a server.

    url:      the server's address, e.g. http://127.0.0.1:18085
    timeout:  seconds one request may take (connect + score + answer)
    retries:  further tries of a failed request (connection error, timeout, 5xx), `backoff` s apart
    batch_size: completions per request
    check:    ask /health now, so that a server that is down is an error before any compute
    """

    def __init__(self, url: str, *, timeout: float = 120.0, retries: int = 2, backoff: float = 1.0,
                 batch_size: int = 64, check: bool = True):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"reward server url must start with http:// or https://, got {url!r}")
        if timeout <= 0 or retries < 0 or backoff < 0 or batch_size < 1:
            raise ValueError("RewardServerClient needs timeout > 0, retries >= 0, backoff >= 0, batch_size >= 1")
        self.url, self.timeout, self.retries, self.backoff = url.rstrip("/"), timeout, retries, backoff
        self.batch_size = batch_size
        self.failures = 0  # batches scored None because the server did not answer
        self.name = url
        if check:
            self.name = self.health()["reward"]

    def health(self) -> dict[str, Any]:
        """The server's /health answer; RewardServerError when it is down or speaks another protocol."""
        try:
            answer = get_json(f"{self.url}/health", timeout=min(self.timeout, 10.0))
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise RewardServerError(f"reward server at {self.url} is not reachable ({e}); start it with "
                                    f"`ddrl serve-reward --reward MODULE:FUNCTION --port PORT` and check the url") from None
        if answer.get("protocol") != PROTOCOL:
            raise RewardServerError(f"reward server at {self.url} speaks protocol {answer.get('protocol')!r}, "
                                    f"this client {PROTOCOL}")
        return answer

    def __call__(self, completions: list[str], *, images: Tensor | None = None, **columns: Any) -> list[float | None]:
        from ddrl.rewards.composite import column_value

        out: list[float | None] = []
        for lo in range(0, len(completions), self.batch_size):
            rows = range(lo, min(lo + self.batch_size, len(completions)))
            request = {"protocol": PROTOCOL, "completions": [completions[i] for i in rows],
                       "columns": {k: [_jsonable(column_value(v, i)) for i in rows] for k, v in columns.items()},
                       "images": None if images is None else images_to_png(images[lo:rows.stop])}
            out.extend(self._score(request, len(rows)))
        return out

    def _score(self, request: dict[str, Any], n: int) -> list[float | None]:
        try:
            rewards = post_json(f"{self.url}/score", request, timeout=self.timeout, retries=self.retries,
                                backoff=self.backoff)["rewards"]
            if len(rewards) != n:
                raise RequestFailed(f"the server returned {len(rewards)} rewards for {n} completions")
            return [finite_or_none(r) for r in rewards]
        except (RequestFailed, KeyError, TypeError, ValueError) as e:
            self.failures += 1
            log.warning("reward server %s gave no rewards for %d completions (%s); they score None (%d failed "
                        "batches so far)", self.url, n, e, self.failures)
            return [None] * n


# --------------------------------------------------------------------------------------------
# Bounded JSON requests (this client, and clients of other JSON services: rewards/unified_reward.py)
# --------------------------------------------------------------------------------------------


class RequestFailed(RuntimeError):
    """A request that still failed after its retries (the message says why)."""


def finite_or_none(value: Any) -> float | None:
    """A reward value as a float, or None when it is missing or not finite."""
    return None if value is None or not math.isfinite(float(value)) else float(value)


def post_json(url: str, payload: dict[str, Any], *, timeout: float, retries: int, backoff: float,
              headers: dict[str, str] | None = None) -> Any:
    """POST `payload` as JSON and return the decoded JSON answer; each try is bounded by `timeout` s,
    a failed try (connection error, timeout, 5xx, an answer that is not JSON) is retried `retries` times
    `backoff` s apart; a 4xx is not retried (the request itself is wrong). RequestFailed when every try failed."""
    body = json.dumps(payload).encode()
    error = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff)
        try:
            post = urllib.request.Request(url, data=body, method="POST",
                                          headers={"Content-Type": "application/json", **(headers or {})})
            with urllib.request.urlopen(post, timeout=timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            error = f"HTTP {e.code}: {e.read()[:300].decode(errors='replace')}"
            if e.code < 500:
                break
        except (urllib.error.URLError, OSError, ValueError) as e:
            error = str(e) or type(e).__name__
    raise RequestFailed(error)


def get_json(url: str, *, timeout: float, headers: dict[str, str] | None = None) -> Any:
    """GET `url` once and decode its JSON answer (a health check: no retries); raises on any failure."""
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


# --------------------------------------------------------------------------------------------
# The server: any reward function behind HTTP
# --------------------------------------------------------------------------------------------


class RewardServer(ThreadingHTTPServer):
    """An HTTP server around one reward function (serve_reward); .url is its address."""

    daemon_threads = True

    def __init__(self, reward: Callable[..., list[float | None]], host: str, port: int, name: str):
        self.reward, self.name = reward, name
        self.lock = threading.Lock()  # one scoring at a time: reward models are rarely thread-safe
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = host.decode() if isinstance(host, bytes) else host  # typeshed allows bytes; AF_INET gives str
        return f"http://{host}:{port}"

    def score(self, request: dict[str, Any]) -> list[float | None]:
        completions, columns = request.get("completions"), request.get("columns") or {}
        if not isinstance(completions, list) or not isinstance(columns, dict):
            raise ValueError("a request needs completions: [str] and columns: {name: [value]}")
        kwargs = dict(columns)
        if request.get("images") is not None:
            kwargs["images"] = png_to_images(request["images"])
        with self.lock:
            rewards = list(self.reward(completions, **kwargs))
        if len(rewards) != len(completions):
            raise RuntimeError(f"the reward returned {len(rewards)} values for {len(completions)} completions")
        return [finite_or_none(r) for r in rewards]


class _Handler(BaseHTTPRequestHandler):
    server: RewardServer

    def _answer(self, code: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.rstrip("/") == "/health":
            self._answer(200, {"ok": True, "protocol": PROTOCOL, "reward": self.server.name})
        else:
            self._answer(404, {"error": f"no {self.path}: GET /health, POST /score"})

    def do_POST(self) -> None:  # noqa: N802
        if self.path.rstrip("/") != "/score":
            return self._answer(404, {"error": f"no {self.path}: POST /score"})
        size = int(self.headers.get("Content-Length") or 0)
        if not 0 < size <= MAX_BODY:
            return self._answer(400, {"error": f"a request body must be 1..{MAX_BODY} bytes, got {size}"})
        try:
            request = json.loads(self.rfile.read(size))
            if request.get("protocol") != PROTOCOL:
                return self._answer(400, {"error": f"protocol {request.get('protocol')!r}; this server speaks "
                                                   f"{PROTOCOL}"})
            rewards = self.server.score(request)
        except (ValueError, TypeError, KeyError) as e:
            return self._answer(400, {"error": str(e)})
        except Exception as e:  # noqa: BLE001 - the reward broke: say so, keep serving
            log.exception("reward failed")
            return self._answer(500, {"error": f"{type(e).__name__}: {e}"})
        self._answer(200, {"rewards": rewards})

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: one line per error only
        log.debug(format, *args)


def serve_reward(reward: Callable[..., list[float | None]], host: str = "127.0.0.1", port: int = 0, *,
                 name: str | None = None, background: bool = False) -> RewardServer:
    """Serve `reward` on host:port (port 0: a free one; .url says which). background=True runs it in
    a daemon thread and returns at once (tests, a trainer that starts its own); else the caller runs
    .serve_forever(). Stop it with .shutdown() and .server_close()."""
    try:
        server = RewardServer(reward, host, port, str(name or getattr(reward, "__name__", type(reward).__name__)))
    except OSError as e:  # the address is taken, or not this machine's
        raise OSError(f"cannot serve the reward at {host}:{port}: {e.strerror or e}; pick a free port (--port N; "
                      f"0 = any free one) or an address of this machine (--host)") from None
    if background:
        threading.Thread(target=server.serve_forever, name="ddrl-reward-server", daemon=True).start()
    return server
