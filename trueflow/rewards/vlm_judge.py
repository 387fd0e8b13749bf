"""`vlm_judge`: a vision-language model scores each image through any OpenAI-compatible chat server.

Each image is sent as a PNG data URL with a scoring prompt naming the image's prompt
(`POST {url}/chat/completions`, temperature 0); the score is the first number of the answer, which must lie in
[0, 10]. An answer without such a number, a non-200 status or malformed JSON raises a RewardError naming the
prompt; no answer within `timeout` seconds raises a RewardTimeout. Images are sent concurrently
(`concurrency` requests at a time).

`url` is the server's OpenAI base URL (`http://127.0.0.1:8000/v1`; a URL without a path gets `/v1`). The model
path, if given, is the served model's name; otherwise the only model `GET {url}/models` lists. The environment
variable TRUEFLOW_JUDGE_API_KEY, if set, is sent as a bearer token.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import socket
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from PIL import Image

from .base import RewardError, RewardTimeout

TEMPLATE = ('Rate this image for the prompt "{prompt}": how well it matches the prompt and how good it looks, '
            "from 0 (worst) to 10 (best). Answer with the number only.")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)")
LOW, HIGH = 0.0, 10.0


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
        raise ValueError(f"the answer's number {value:g} is outside [{LOW:g}, {HIGH:g}]: {answer[:200]!r}")
    return value


class VlmJudge:
    def __init__(self, url: str | None, model_path: str | None = None, timeout: float = 60.0,
                 template: str = TEMPLATE, concurrency: int = 8, max_tokens: int = 16):
        if not url:
            raise ValueError("the vlm_judge reward needs the URL of an OpenAI-compatible chat server "
                             "(e.g. --reward-url http://127.0.0.1:8000/v1)")
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"vlm_judge: {url!r} is not an http(s) URL")
        self.base = url.rstrip("/") if parts.path.strip("/") else url.rstrip("/") + "/v1"
        self.timeout, self.template, self.max_tokens = timeout, template, max_tokens
        self.concurrency = concurrency
        self.headers = {"content-type": "application/json"}
        if os.environ.get("TRUEFLOW_JUDGE_API_KEY"):
            self.headers["authorization"] = f"Bearer {os.environ['TRUEFLOW_JUDGE_API_KEY']}"
        self.model = model_path or self._only_model()
        self.name = f"vlm_judge@{self.base}"

    def _request(self, path: str, body: dict[str, Any] | None = None) -> Any:
        """JSON from GET (no body) or POST `self.base + path`; HTTP errors and bad JSON raise ValueError,
        no answer in time raises TimeoutError."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as answer:
                text = answer.read()
        except urllib.error.HTTPError as e:
            raise ValueError(f"HTTP {e.code} from {self.base + path}: {e.read()[:300]!r}") from None
        except (socket.timeout, TimeoutError):
            raise TimeoutError(f"no answer from {self.base + path} within {self.timeout:g} s") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, (socket.timeout, TimeoutError)):
                raise TimeoutError(f"no answer from {self.base + path} within {self.timeout:g} s") from None
            raise ConnectionError(f"no chat server answers at {self.base}: {e.reason}") from None
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise ValueError(f"answer from {self.base + path} is not JSON: {text[:200]!r}") from None

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
