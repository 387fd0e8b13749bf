"""The VLM judge against a tiny stand-in OpenAI-compatible chat server on 127.0.0.1: what it sends, how it reads
the answer, and how a bad answer, an error status or a slow server fail."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

from trueflow.rewards import RewardError, RewardTimeout, build_reward, score
from trueflow.rewards.tiny_clip import init_tiny_aesthetic
from trueflow.rewards.vlm_judge import parse_score


def red_score(pixels: np.ndarray) -> float:
    """The stand-in judge's opinion: mean red in [0, 10]."""
    return round(float(pixels[..., 0].mean()) / 25.5, 4)


class Judge(BaseHTTPRequestHandler):
    """/v1/models lists `models`; /v1/chat/completions answers from the prompt it finds in the text part."""

    models = ["tiny-judge"]
    requests: list[dict] = []
    keys: list[str | None] = []  # the authorization header of each request that was redirected
    elsewhere = ""  # the URL a redirect points to
    sent: queue.Queue = queue.Queue()  # bytes a streamed answer got out

    def log_message(self, *args) -> None:  # quiet
        pass

    def reply(self, status: int, payload: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def stream(self, payload: bytes, chunk: int, pause: float, declare: bool = True) -> None:
        """Send `payload` `chunk` bytes at a time; record in `sent` how much went out before the client hung up."""
        self.send_response(200)
        self.send_header("content-type", "application/json")
        if declare:
            self.send_header("content-length", str(len(payload)))
        else:
            self.send_header("connection", "close")
            self.close_connection = True
        self.end_headers()
        sent = 0
        try:
            while sent < len(payload):
                self.wfile.write(payload[sent:sent + chunk])
                self.wfile.flush()
                sent += chunk
                time.sleep(pause)
        except OSError:  # the client cut the answer off
            pass
        Judge.sent.put(min(sent, len(payload)))

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self.reply(200, json.dumps({"object": "list", "data": [{"id": m} for m in self.models]}).encode())
        else:
            self.reply(404, b'{"error": "not found"}')

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        Judge.requests.append(body)
        if self.path != "/v1/chat/completions":
            return self.reply(404, b'{"error": "not found"}')
        parts = body["messages"][0]["content"]
        url = next(p["image_url"]["url"] for p in parts if p["type"] == "image_url")
        text = next(p["text"] for p in parts if p["type"] == "text")
        head, _, b64 = url.partition(",")
        assert head == "data:image/png;base64"
        pixels = np.array(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))
        answer = f"Score: {red_score(pixels)}/10"
        if "mute" in text:
            answer = "I would rather not say."
        elif "loud" in text:
            answer = "42"
        elif "broken" in text:
            return self.reply(500, b'{"error": "model crashed"}')
        elif "garbled" in text:
            return self.reply(200, b"<html>")
        elif "slow" in text:
            time.sleep(1.5)
        elif "redirected" in text:  # elsewhere: another server, on another port
            Judge.keys.append(self.headers.get("authorization"))
            self.send_response(302)
            self.send_header("location", f"{Judge.elsewhere}/v1/chat/completions")
            self.send_header("content-length", "0")
            return self.end_headers()
        elif "dripping" in text:  # a valid answer, one byte every 50 ms: no single read waits long
            return self.stream(json.dumps({"choices": [{"message": {"content": "5"}}]}).encode(), 1, 0.05)
        elif "enormous" in text:  # 50 MB, declared
            return self.stream(b" " * (50 << 20), 1 << 16, 0.0)
        elif "unbounded" in text:  # 50 MB, no length declared: read until the server closes
            return self.stream(b" " * (50 << 20), 1 << 16, 0.0, declare=False)
        elif "billion" in text:
            answer = "1e9"
        self.reply(200, json.dumps({"choices": [{"index": 0, "message": {"role": "assistant",
                                                                          "content": answer}}]}).encode())


class Elsewhere(BaseHTTPRequestHandler):
    """Where a redirect points: records every request it gets, with its authorization header."""

    seen: list[tuple[str, str | None]] = []

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        Elsewhere.seen.append((self.path, self.headers.get("authorization")))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()


@contextlib.contextmanager
def serving(handler):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture()
def server():
    Judge.models, Judge.requests, Judge.keys, Judge.sent, Elsewhere.seen = ["tiny-judge"], [], [], queue.Queue(), []
    with serving(Judge) as url, serving(Elsewhere) as Judge.elsewhere:
        yield url


def batch(n: int, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, (n, 12, 16, 3), dtype=np.uint8))


def test_judge_sends_the_image_and_prompt_and_reads_the_number(server: str) -> None:
    x = batch(3)
    prompts = ["a red barn", "a cat", "a red barn"]
    reward = build_reward("vlm_judge", url=server)  # a URL without a path gets /v1
    assert reward.name == f"vlm_judge@{server}/v1"
    scores, dropped = score(reward, x, prompts)
    assert dropped == [] and scores.dtype == torch.float32
    torch.testing.assert_close(scores, torch.tensor([red_score(a) for a in x.numpy()]))
    assert len(Judge.requests) == 3
    sent = sorted(Judge.requests, key=lambda r: r["messages"][0]["content"][0]["image_url"]["url"])
    for body in sent:
        assert body["model"] == "tiny-judge" and body["temperature"] == 0
        text = body["messages"][0]["content"][1]["text"]
        assert '"a red barn"' in text or '"a cat"' in text
    # the PNG data URL carries the pixels exactly
    urls = {r["messages"][0]["content"][0]["image_url"]["url"] for r in Judge.requests}
    decoded = [np.array(Image.open(io.BytesIO(base64.b64decode(u.partition(",")[2])))) for u in urls]
    assert sorted(d.tobytes() for d in decoded) == sorted(a.tobytes() for a in x.numpy())
    # a named model, and the full base URL
    named = build_reward("vlm_judge", model_path="other-name", url=f"{server}/v1")
    named(x[:1], ["p"])
    assert Judge.requests[-1]["model"] == "other-name"


def test_a_bad_answer_fails_its_prompt_only(server: str) -> None:
    reward = build_reward("vlm_judge", url=server)
    x = batch(4)
    prompts = ["fine", "mute dog", "fine", "loud dog"]
    with pytest.raises(RewardError, match=r"failed on prompt 'mute dog': no number in the answer"):
        score(reward, x, prompts)
    scores, dropped = score(reward, x, prompts, on_error="skip")
    assert dropped == [1, 3] and torch.isfinite(scores[[0, 2]]).all()
    with pytest.raises(RewardError, match=r"'loud dog': the answer's number 42 is outside \[0, 10\]"):
        score(reward, x[3:], prompts[3:])
    with pytest.raises(RewardError, match=r"'broken': HTTP 500 .*model crashed"):
        score(reward, x[:1], ["broken"])
    with pytest.raises(RewardError, match=r"'garbled': answer .* is not JSON"):
        score(reward, x[:1], ["garbled"])


def test_a_slow_server_times_out(server: str) -> None:
    from trueflow.rewards.vlm_judge import VlmJudge

    reward = VlmJudge(server, timeout=0.3)
    start = time.monotonic()
    with pytest.raises(RewardTimeout, match=r"'slow': no answer from .* within 0.3 s"):
        score(reward, batch(1), ["slow"])
    assert time.monotonic() - start < 1.4


def test_a_redirect_is_not_followed_and_the_key_stays(server: str, monkeypatch) -> None:
    """A 302 to a server on another port is an error naming its target; that server gets nothing, the key least."""
    monkeypatch.setenv("TRUEFLOW_JUDGE_API_KEY", "sekrit")
    reward = build_reward("vlm_judge", url=server)
    with pytest.raises(RewardError, match=f"'redirected': {server}/v1/chat/completions answered 302, a redirect to "
                                          f"'{Judge.elsewhere}/v1/chat/completions', which is not followed"):
        score(reward, batch(1), ["redirected"])
    assert Judge.keys == ["Bearer sekrit"], "the judge's own server got the key"
    assert Elsewhere.seen == [], "the redirect's target got no request, so no key"


def test_a_dripping_server_is_cut_off_at_the_deadline(server: str) -> None:
    """One byte every 50 ms never keeps a read waiting 0.5 s, but the whole answer would take ~3 s: the deadline is
    the request's, not each read's."""
    from trueflow.rewards.vlm_judge import VlmJudge

    reward = VlmJudge(server, timeout=0.5)
    start = time.monotonic()
    with pytest.raises(RewardTimeout, match=r"'dripping': no answer from .* within 0.5 s"):
        score(reward, batch(1), ["dripping"])
    assert time.monotonic() - start < 1.5
    assert Judge.sent.get(timeout=5) < 60, "the server was cut off before it had sent its answer"


@pytest.mark.parametrize("prompt, error", [
    ("enormous", r"the answer from .* is 52,428,800 bytes, over the 1,048,576-byte cap: refused unread"),
    ("unbounded", r"the answer from .* passes the 1,048,576-byte cap: refused"),
])
def test_a_huge_answer_is_refused_without_reading_it_whole(server: str, prompt: str, error: str) -> None:
    reward = build_reward("vlm_judge", url=server)
    with pytest.raises(RewardError, match=f"'{prompt}': {error}"):
        score(reward, batch(1), [prompt])
    assert Judge.sent.get(timeout=10) < 50 << 20, "the client hung up before the 50 MB were sent"


def test_a_score_outside_the_range_names_it(server: str) -> None:
    """`1e9` was read as its first digit, 1.0."""
    with pytest.raises(RewardError, match=r"'billion': the answer's number 1e9 is outside \[0, 10\]"):
        score(build_reward("vlm_judge", url=server), batch(1), ["billion"])


def test_judge_setup_errors(server: str) -> None:
    with pytest.raises(ValueError, match="needs the URL of an OpenAI-compatible chat server"):
        build_reward("vlm_judge")
    with pytest.raises(ValueError, match="a URL was given but no reward of 'redness' takes one"):
        build_reward("redness", url=server)
    with pytest.raises(ValueError, match="is not an http"):
        build_reward("vlm_judge", url="ftp://127.0.0.1:1")
    Judge.models = ["a", "b"]
    with pytest.raises(ValueError, match=r"serves \['a', 'b'\]; give one as the reward's model path"):
        build_reward("vlm_judge", url=server)
    with pytest.raises(ConnectionError, match="cannot list the models"):
        build_reward("vlm_judge", url=f"{server}/nowhere")


def test_judge_in_a_weighted_sum_with_the_aesthetic_predictor(server: str, tmp_path) -> None:
    clip = init_tiny_aesthetic(tmp_path / "clip", seed=1)
    x = batch(2)
    reward = build_reward("vlm_judge:0.1,aesthetic:2", model_path=f"aesthetic={clip}", url=server)
    judged = torch.tensor([red_score(a) for a in x.numpy()])
    expected = 0.1 * judged + 2 * build_reward("aesthetic", str(clip))(x, ["p"] * 2)
    torch.testing.assert_close(reward(x, ["p", "q"]), expected)


@pytest.mark.parametrize("answer, value", [("8", 8.0), ("Score: 7.5/10", 7.5), (" 10.", 10.0), (".5", 0.5),
                                           ("0", 0.0), ("7.5e-1", 0.75), ("8e", 8.0)])
def test_parse_score(answer: str, value: float) -> None:
    assert parse_score(answer) == value


@pytest.mark.parametrize("answer", ["ten", "", "-1", "10.5", "1e9", "1E+1000"])
def test_parse_score_refuses(answer: str) -> None:
    with pytest.raises(ValueError):
        parse_score(answer)
