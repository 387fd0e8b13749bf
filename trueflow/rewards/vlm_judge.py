"""`vlm_judge`: a vision-language model scores each image through any OpenAI-compatible chat server.

Each image is sent as a PNG data URL with a scoring prompt naming the image's prompt
(`POST {url}/chat/completions`, temperature 0); the score is the first number of the answer, which must lie in
[0, 10]. An answer without such a number, a non-200 status or malformed JSON raises a RewardError naming the
prompt; no answer within `timeout` seconds raises a RewardTimeout. Images are sent concurrently
(`concurrency` requests at a time).

Each request is bounded: `timeout` is one deadline for the whole exchange (a server that drips its answer is cut
off at it), an answer over `max_answer_bytes` (1 MiB) is refused without being read whole, and a redirect is an
error naming its target, never followed (the key would go with it). Proxy variables are not read.

`url` is the server's OpenAI base URL (`http://127.0.0.1:8000/v1`; a URL without a path gets `/v1`). The model
path, if given, is the served model's name; otherwise the only model `GET {url}/models` lists. The environment
variable TRUEFLOW_JUDGE_API_KEY, if set, is sent as a bearer token.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import io
import json
import os
import re
import socket
import threading
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from PIL import Image

from .errors import RewardError, RewardTimeout

TEMPLATE = ('Rate this image for the prompt "{prompt}": how well it matches the prompt and how good it looks, '
            "from 0 (worst) to 10 (best). Answer with the number only.")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")  # with its exponent: 1e9 is not 1
LOW, HIGH = 0.0, 10.0
MAX_ANSWER_BYTES = 1 << 20  # a chat answer of 16 tokens, or a model list, is a few kilobytes


def data_url(image: torch.Tensor) -> str:
    buffer = io.BytesIO()
    Image.fromarray(image.numpy()).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def parse_score(answer: str) -> float:
    """The first number of `answer`; ValueError if there is none or it lies outside [LOW, HIGH]."""
    match = _NUMBER.search(answer)
    if match is None:
        raise ValueError(f"no number in the answer {answer[:200]!r}")
    value = float(match.group())
    if not LOW <= value <= HIGH:
        raise ValueError(f"the answer's number {match.group()} is outside [{LOW:g}, {HIGH:g}]: {answer[:200]!r}")
    return value


class VlmJudge:
    def __init__(self, url: str | None, model_path: str | None = None, timeout: float = 60.0,
                 template: str = TEMPLATE, concurrency: int = 8, max_tokens: int = 16,
                 max_answer_bytes: int = MAX_ANSWER_BYTES):
        if not url:
            raise ValueError("the vlm_judge reward needs the URL of an OpenAI-compatible chat server "
                             "(e.g. --reward-url http://127.0.0.1:8000/v1)")
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"vlm_judge: {url!r} is not an http(s) URL")
        self.base = url.rstrip("/") if parts.path.strip("/") else url.rstrip("/") + "/v1"
        self.timeout, self.template, self.max_tokens = timeout, template, max_tokens
        self.max_answer_bytes = max_answer_bytes
        self.concurrency = concurrency
        self.headers = {"content-type": "application/json"}
        if os.environ.get("TRUEFLOW_JUDGE_API_KEY"):
            self.headers["authorization"] = f"Bearer {os.environ['TRUEFLOW_JUDGE_API_KEY']}"
        self.model = model_path or self._only_model()
        self.name = f"vlm_judge@{self.base}"

    def _request(self, path: str, body: dict[str, Any] | None = None) -> Any:
        """JSON from GET (no body) or POST `self.base + path`, within one deadline of `timeout` seconds for the
        whole exchange (connect, headers, body: a server that drips bytes is cut off at it) and a cap of
        `max_answer_bytes`. A redirect is not followed (it would take the bearer key elsewhere); it, another
        status, an answer over the cap or bad JSON raise ValueError, the deadline TimeoutError."""
        url = self.base + path
        parts = urllib.parse.urlsplit(url)
        # http.client, not urllib: urllib follows redirects with the key and times out per read only.
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        assert parts.hostname is not None  # `self.base` has a netloc (checked in __init__)
        conn = kind(parts.hostname, parts.port, timeout=self.timeout)
        expired = threading.Event()
        sockets: list[socket.socket] = []

        def cut() -> None:  # at the deadline: whatever read or write is under way returns at once
            expired.set()
            for sock in sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

        timer = threading.Timer(self.timeout, cut)
        timer.daemon = True
        timer.start()
        answer = None
        try:
            conn.connect()
            # Kept here: a response that closes the connection takes the socket from `conn` (getresponse).
            sockets.append(conn.sock)
            if expired.is_set():
                raise TimeoutError
            target = parts.path + (f"?{parts.query}" if parts.query else "")
            data = None if body is None else json.dumps(body).encode()
            conn.request("GET" if data is None else "POST", target, body=data, headers=self.headers)
            answer = conn.getresponse()
            if 300 <= answer.status < 400:
                raise ValueError(f"{url} answered {answer.status}, a redirect to {answer.getheader('location')!r}, "
                                 f"which is not followed (the bearer key goes to {self.base} only): give the "
                                 "server's own URL")
            if answer.status != 200:
                raise ValueError(f"HTTP {answer.status} from {url}: {answer.read(300)!r}")
            text = self._read_capped(answer, url)
        except (OSError, http.client.HTTPException) as e:
            if expired.is_set() or isinstance(e, TimeoutError):
                raise TimeoutError(f"no answer from {url} within {self.timeout:g} s") from None
            if isinstance(e, OSError):  # refused, reset, closed early (http.client's RemoteDisconnected too)
                raise ConnectionError(f"no chat server answers at {self.base}: {e}") from None
            raise ValueError(f"a malformed HTTP answer from {url}: {type(e).__name__}: {e}") from None
        finally:  # the answer too: a closing one holds the socket, and with it a server still writing
            timer.cancel()
            if answer is not None:
                answer.close()
            conn.close()
        if expired.is_set():  # cut off while the body was still coming: what was read is not the answer
            raise TimeoutError(f"no answer from {url} within {self.timeout:g} s")
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise ValueError(f"answer from {url} is not JSON: {text[:200]!r}") from None

    def _read_capped(self, answer: http.client.HTTPResponse, url: str) -> bytes:
        """The body, refused unread when its declared length passes `max_answer_bytes` and as soon as it does."""
        cap = self.max_answer_bytes
        declared = answer.getheader("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > cap:
            raise ValueError(f"the answer from {url} is {int(declared):,} bytes, over the {cap:,}-byte cap: "
                             "refused unread")
        chunks, size = [], 0
        while chunk := answer.read(min(1 << 16, cap + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > cap:
                raise ValueError(f"the answer from {url} passes the {cap:,}-byte cap: refused")
        return b"".join(chunks)

    def _only_model(self) -> str:
        try:
            listed = [m["id"] for m in self._request("/models")["data"]]
        except (ValueError, TimeoutError, KeyError, TypeError) as e:
            raise ConnectionError(f"vlm_judge: cannot list the models of {self.base} ({e}); give the model's "
                                  "name as the reward's model path") from None
        if len(listed) != 1:
            raise ValueError(f"vlm_judge: {self.base} serves {listed}; give one as the reward's model path")
        return listed[0]

    def judge(self, image: torch.Tensor, prompt: str) -> float:
        """One image's score; RewardError (RewardTimeout) naming its prompt on any failure."""
        body = {"model": self.model, "temperature": 0, "max_tokens": self.max_tokens,
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": data_url(image)}},
                    {"type": "text", "text": self.template.format(prompt=prompt)}]}]}
        try:
            answer = self._request("/chat/completions", body)
            content = answer["choices"][0]["message"]["content"]
            if not isinstance(content, str):
                raise ValueError(f"the answer's content is {type(content).__name__}, not text")
            return parse_score(content)
        except TimeoutError as e:
            raise RewardTimeout(self.name, [prompt], str(e)) from None
        except (KeyError, IndexError, TypeError) as e:
            raise RewardError(self.name, [prompt], f"malformed chat answer: {type(e).__name__}: {e}") from None
        except (ValueError, ConnectionError) as e:
            raise RewardError(self.name, [prompt], str(e)) from None

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        with ThreadPoolExecutor(min(self.concurrency, max(len(prompts), 1))) as pool:
            scores = list(pool.map(self.judge, images, prompts))
        return torch.tensor(scores, dtype=torch.float32)
