"""The reward server on loopback: uvicorn in a thread (and `trueflow reward-serve` in a subprocess), a real HTTP
client (`RemoteReward`), batching of concurrent requests, and errors crossing the wire."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgpack
import pytest

from trueflow.http import serve_in_thread
import torch
from conftest import TRUEFLOW_EXE
from test_rewards import PROMPTS, Flaky, images

from trueflow.rewards import RewardError, RewardTimeout, WeightedSum, build_reward, score
from trueflow.rewards.remote import RemoteReward


@contextlib.contextmanager
def served(reward, **kwargs):
    """Serves `reward` on 127.0.0.1 at a free port from a thread; yields the URL."""
    from trueflow.rewards.server import create_app

    with serve_in_thread(create_app(reward, **kwargs)) as url:
        yield url


class Slow:
    """Sleeps per call, not per image: batching shows as fewer, larger calls. Records each call's batch size."""

    name = "slow"

    def __init__(self, sleep: float):
        self.sleep, self.sizes = sleep, []

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        self.sizes.append(len(prompts))
        time.sleep(self.sleep)
        return images.float().mean(dim=(1, 2, 3))


def test_remote_equals_local_and_url_specs() -> None:
    local = build_reward("redness")
    x = images(4)
    with served(local) as url:
        remote = build_reward(url)
        assert isinstance(remote, RemoteReward) and remote.name == f"redness@{url}"
        assert torch.equal(remote(x, ["a"] * 4), local(x, ["a"] * 4))  # float32 bits cross the wire unchanged
        weighted = build_reward(f"{url}:0.5,jpeg_incompressibility:0.1")
        assert isinstance(weighted, WeightedSum)
        expected = 0.5 * local(x, ["a"] * 4) + 0.1 * build_reward("jpeg_incompressibility")(x, ["a"] * 4)
        torch.testing.assert_close(weighted(x, ["a"] * 4), expected)
        bad = httpx.post(f"{url}/score", content=b"not msgpack")
        assert bad.status_code == 400 and "malformed request" in bad.json()["detail"]
    with pytest.raises(ConnectionError, match="no reward server answers"):
        RemoteReward(url, timeout=2)


def test_concurrent_requests_are_batched() -> None:
    slow = Slow(0.3)
    sizes = [2, 3, 1, 2, 4, 2]
    batches = [images(n, seed=n, size=8) for n in sizes]
    batches.append(images(2, seed=9, size=12))  # another image size: a call of its own
    with served(slow, max_batch=64, max_wait_ms=100) as url:
        remote = RemoteReward(url)
        with ThreadPoolExecutor(len(batches)) as pool:
            results = list(pool.map(lambda b: remote(b, ["p"] * len(b)), batches))
        info = httpx.get(f"{url}/info").json()
    for batch, out in zip(batches, results):  # each request got its own images' scores back, in order
        torch.testing.assert_close(out, batch.float().mean(dim=(1, 2, 3)))
    assert info["requests"] == len(batches)
    assert info["calls"] == len(slow.sizes) < len(batches) and sum(slow.sizes) == sum(sizes) + 2
    assert max(slow.sizes) > max(sizes)


def test_errors_cross_the_wire_and_name_the_prompt() -> None:
    with served(Flaky("raise")) as url:
        remote = RemoteReward(url)
        with pytest.raises(RewardError, match=rf"reward 'flaky@{url}' failed on prompt 'bad two': server answered "
                                              r"500: KeyError: 'boom'"):
            score(remote, images(5), PROMPTS)
        scores, dropped = score(remote, images(5), PROMPTS, on_error="skip")
        assert dropped == [1, 3] and torch.isfinite(scores[[0, 2, 4]]).all()
    with served(Flaky("nan")) as url:  # NaN travels as raw float32; the client's score names the prompt
        with pytest.raises(RewardError, match=r"failed on prompt 'bad two': returned nan"):
            score(RemoteReward(url), images(5), PROMPTS)


def test_one_failing_request_does_not_fail_its_batch() -> None:
    flaky = Flaky("raise", sleep=0.2)
    with served(flaky, max_wait_ms=100) as url:
        remote = RemoteReward(url)
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(remote, images(2), [p, p]) for p in ("ok a", "bad b", "ok c")]
        with pytest.raises(RewardError, match="'bad b'"):
            futures[1].result()
        assert [f.result().tolist() for f in (futures[0], futures[2])] == [[0.0, 1.0], [0.0, 1.0]]


def test_client_timeout() -> None:
    with served(Slow(1.0)) as url:
        remote = RemoteReward(url, timeout=0.2)
        with pytest.raises(RewardTimeout, match=r"failed on prompt 'a': no answer within 0.2 s"):
            score(remote, images(1), ["a"])


def test_reward_serve_cli_subprocess() -> None:
    with socket.socket() as s:  # a free port for the subprocess (a race with other processes is unlikely)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([str(TRUEFLOW_EXE), "reward-serve", "--host", "127.0.0.1", "--port", str(port),
                             "--reward", "redness:2"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "reward-serve did not answer within 60 s"
            try:
                remote = RemoteReward(url, timeout=10)
                break
            except ConnectionError:
                time.sleep(0.2)
        x = images(2)
        assert remote.name == f"redness:2@{url}"
        torch.testing.assert_close(score(remote, x, ["a", "b"])[0], 2 * build_reward("redness")(x, ["a", "b"]))
    finally:
        proc.terminate()
        proc.wait(10)


def _body(shape, prompts, images: bytes | None = None) -> bytes:
    """A /score body as a hostile client writes it: any field types, images of the size the shape names if unset."""
    if images is None:
        images = bytes(max(0, int(torch.tensor([float(s) for s in shape]).prod())))
    return msgpack.packb({"shape": shape, "images": images, "prompts": prompts})


B288 = bytes(2 * 8 * 8 * 3)  # pixels enough for two 8x8 images
BAD_REQUESTS = {  # what -> (body, words the 400 must contain)
    "a string as prompts": (_body([3, 8, 8, 3], "abc"), "prompts: Input should be a valid list"),
    "numbers as prompts": (_body([2, 8, 8, 3], [1, 2]), "prompts.0: Input should be a valid string"),
    "nulls as prompts": (_body([2, 8, 8, 3], [None, None]), "prompts.0: Input should be a valid string"),
    "a negative dimension": (_body([2, -1, 8, 3], ["a", "b"], B288), "shape.1: Input should be greater than 0"),
    "a fractional dimension": (_body([2.9, 8, 8, 3], ["a", "b"], B288), "shape.0: Input should be a valid integer"),
    "an empty image": (_body([1, 0, 8, 3], ["a"]), "shape.1: Input should be greater than 0"),
    "bytes that do not fill the shape": (_body([1, 8, 8, 3], ["a"], bytes(10)),
                                         "images: 10 bytes, the shape [1, 8, 8, 3] needs 192"),
    "a count that is not the prompts'": (_body([2, 8, 8, 3], ["a"]), "shape [2, 8, 8, 3] holds 2 images for 1 prompts"),
    "four channels": (_body([1, 8, 8, 4], ["a"]), "shape [1, 8, 8, 4]: images must have 3 channels (RGB), got 4"),
    "a missing field": (msgpack.packb({"shape": [1, 8, 8, 3], "images": bytes(192)}), "prompts: Field required"),
    "not a map": (msgpack.packb([1, 2]), "Input should be a valid dictionary"),
}


@pytest.mark.parametrize("reward", ["redness", "jpeg_compressibility"])
@pytest.mark.parametrize("what", BAD_REQUESTS)
def test_bad_requests_are_400_with_the_reason(what, reward) -> None:
    body, reason = BAD_REQUESTS[what]
    with served(build_reward(reward)) as url:
        r = httpx.post(f"{url}/score", content=body, headers={"content-type": "application/msgpack"})
        assert r.status_code == 400, (r.status_code, r.text)
        assert reason in r.json()["detail"], r.json()["detail"]
        # the server still scores a good request afterwards
        assert RemoteReward(url)(images(2, size=8), ["a", "b"]).shape == (2,)


def test_a_body_past_the_limit_is_413_unread() -> None:
    """A /score body larger than max_body_bytes is refused (413) by its Content-Length, and a chunked one (no
    declared length) once its bytes pass the limit; a body at the limit is scored."""
    good = _body([2, 8, 8, 3], ["a", "b"])
    with served(build_reward("redness"), max_body_bytes=len(good)) as url:
        post = lambda content: httpx.post(f"{url}/score", content=content,  # noqa: E731
                                          headers={"content-type": "application/msgpack"})
        assert post(good).status_code == 200
        big = _body([3, 8, 8, 3], ["a", "b", "c"])
        r = post(big)
        assert r.status_code == 413 and f"larger than the {len(good)} bytes" in r.json()["detail"], r.text
        r = post(iter([big[:100], big[100:]]))  # a generator: sent chunked, no Content-Length
        assert r.status_code == 413, r.text
        assert post(good).status_code == 200
