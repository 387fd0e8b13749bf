"""The engine server bounds each request's work: every limit at its bound and one past it, strict request types,
the per-request timeout, a rollout stopped when its client leaves, the queue bound, and /health while busy and
when the worker is stuck. Refusals are checked on both generation routes and leave the worker idle."""

from __future__ import annotations

import math
import re
import threading
import time

import httpx
import msgpack
import pytest
from transformers import AutoTokenizer

from trueflow.cli import build_parser, main
from trueflow.engine.engine import Engine
from trueflow.engine.sampling_params import SamplingParams
from trueflow.server import Limits, RequestError, create_app
from trueflow.server.bodies import RolloutBody
from trueflow.http import MSGPACK, serve_in_thread

LIMITS = Limits(max_steps=3, max_pixels=32 * 48, max_frames=1, max_prompt_tokens=6, max_samples=2, max_queue=16,
                request_timeout=120)
ROLLOUT = {"prompts": ["a cat"], "n_per_prompt": 1, "seed": 0, "steps": 2, "height": 32, "width": 32,
           "sampler": "ode", "cfg_scale": 1.0, "decode": False}
IMAGES = {"prompt": "a cat", "size": "32x32", "steps": 2, "sampler": "ode", "cfg_scale": 1.0}
LONG = {**ROLLOUT, "steps": 100_000}  # minutes of work on the tiny model: only a stop ends it early


@pytest.fixture(scope="module")
def engine(tiny_checkpoint) -> Engine:
    return Engine(tiny_checkpoint)


@pytest.fixture(scope="module")
def url(engine):
    with serve_in_thread(create_app(engine, LIMITS)) as url:
        yield url


def post(url: str, route: str, body: dict, timeout: float = 120) -> httpx.Response:
    if route == "rollout":
        return httpx.post(f"{url}/rollout/generate", content=msgpack.packb(body), headers={"content-type": MSGPACK},
                          timeout=timeout)
    return httpx.post(f"{url}/v1/images/generations", json=body, timeout=timeout)


def error_of(r: httpx.Response) -> tuple[str, str | None]:
    """(message, param) of either route's error body."""
    error = r.json()["error"]
    return (error["message"], error["param"]) if isinstance(error, dict) else (error, None)


def health(url: str) -> httpx.Response:
    return httpx.get(f"{url}/health", timeout=10)


def wait_for(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def tokens(tiny_checkpoint, text: str) -> int:
    """The oracle: the checkpoint's own tokenizer, called directly."""
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint / "tokenizer")
    return len(tok(text, add_special_tokens=False)["input_ids"])


# -- each bound, and one past it ---------------------------------------------------------------------------------
@pytest.mark.parametrize("route, at, past, match, param", [
    ("rollout", {"steps": 3}, {"steps": 4}, r"4 denoising steps; .* at most 3 \(--max-steps\)", None),
    ("images", {"steps": 3}, {"steps": 4}, r"4 denoising steps; .* at most 3 \(--max-steps\)", "steps"),
    ("rollout", {"height": 32, "width": 48}, {"height": 48, "width": 48},
     r"2304 pixels .* at most 1536 \(--max-pixels\)", None),
    ("images", {"size": "48x32"}, {"size": "48x48"}, r"2304 pixels .* at most 1536 \(--max-pixels\)", "size"),
    ("rollout", {"prompts": ["a", "b"]}, {"prompts": ["a", "b", "c"]}, r"3 samples .* at most 2 \(--max-samples\)",
     None),
    ("rollout", {"n_per_prompt": 2}, {"n_per_prompt": 3}, r"3 samples .* at most 2 \(--max-samples\)", None),
    ("images", {"n": 2}, {"n": 3}, r"3 samples .* at most 2 \(--max-samples\)", "n"),
])
def test_each_bound_is_taken_and_one_past_it_refused(url, route, at, past, match, param):
    base = ROLLOUT if route == "rollout" else IMAGES
    r = post(url, route, {**base, **at})
    assert r.status_code == 200, r.text
    r = post(url, route, {**base, **past})
    assert r.status_code == 400, r.text
    message, got_param = error_of(r)
    assert re.search(match, message), message
    assert got_param == param
    assert health(url).json()["busy"] is False


@pytest.mark.parametrize("field", ["prompt", "negative_prompt"])
def test_prompt_tokens_at_the_bound_and_past_it(url, tiny_checkpoint, field):
    at, past = "a a a a a a", "a a a a a a a"
    assert (tokens(tiny_checkpoint, at), tokens(tiny_checkpoint, past)) == (6, 7)
    for route, base, name in [("rollout", ROLLOUT, "prompts"), ("images", IMAGES, "prompt")]:
        key = name if field == "prompt" else field
        wrap = (lambda t: [t]) if key == "prompts" else (lambda t: t)
        r = post(url, route, {**base, "cfg_scale": 1.5, key: wrap(at)})
        assert r.status_code == 200, r.text
        r = post(url, route, {**base, "cfg_scale": 1.5, key: wrap(past)})
        assert r.status_code == 400, r.text
        message, param = error_of(r)
        assert re.search(r"is 7 tokens; this server takes at most 6 \(--max-prompt-tokens\)", message), message
        assert param in (None, "prompt" if key == "prompts" else key)


def test_long_prompts_are_refused_before_tokenizing(url):
    chars = LIMITS.max_prompt_chars
    r = post(url, "rollout", {**ROLLOUT, "prompts": ["a" * chars]})  # within the character bound: tokens decide
    assert r.status_code == 400 and "tokens" in error_of(r)[0], r.text
    r = post(url, "rollout", {**ROLLOUT, "prompts": ["a" * (chars + 1)]})
    assert r.status_code == 400 and f"{chars + 1} characters" in error_of(r)[0], r.text
    # The audit's 10 MB prompt: refused at once, before any of it is parsed or tokenized.
    for route, body in [("rollout", {**ROLLOUT, "prompts": ["x" * 10_000_000]}),
                        ("images", {**IMAGES, "prompt": "x" * 10_000_000})]:
        start = time.monotonic()
        r = post(url, route, body)
        assert r.status_code == 413 and "larger than" in error_of(r)[0], r.text
        assert time.monotonic() - start < 5
    chunks = (b"\x00" * (1 << 20) for _ in range(10))  # chunked: no content-length to refuse it by
    r = httpx.post(f"{url}/rollout/generate", content=chunks, headers={"content-type": MSGPACK}, timeout=60)
    assert r.status_code == 413 and "larger than" in error_of(r)[0], r.text


@pytest.mark.parametrize("route, body, match", [  # the audit's requests, and a few more
    ("images", {"prompt": "x", "size": "4096x4096", "steps": 4}, "--max-pixels"),
    ("images", {"prompt": "x", "steps": 100_000}, "--max-steps"),
    ("rollout", {**ROLLOUT, "steps": 100_000}, "--max-steps"),
    ("rollout", {**ROLLOUT, "steps": 10**18}, "--max-steps"),
    ("rollout", {**ROLLOUT, "n_per_prompt": 10**18}, "--max-samples"),
    ("rollout", {**ROLLOUT, "prompts": ["x" * 10_000_000]}, "10000000 characters"),
    ("images", {"prompt": "x" * 10_000_000}, "10000000 characters"),
    ("images", {"prompt": "x", "size": "999999x999999"}, "multiple of 16"),
    ("images", {"prompt": "x", "size": "9" * 5000 + "x16"}, "WIDTHxHEIGHT"),  # no 5000-digit int(): a 500
])
def test_the_audits_requests_are_refused_at_once_under_the_default_limits(engine, route, body, match):
    with serve_in_thread(create_app(engine)) as url:
        start = time.monotonic()
        r = post(url, route, body)
        assert r.status_code == 400, r.text
        assert match in error_of(r)[0], r.text
        assert time.monotonic() - start < 5 and health(url).json()["queue_depth"] == 0


def test_frames_are_bounded():
    one, two = SamplingParams(steps=2, height=32, width=32), SamplingParams(steps=2, height=32, width=32, num_frames=2)
    Limits(max_frames=1).check(1, one, ["a"])
    with pytest.raises(RequestError, match=r"2 frames; .* at most 1 \(--max-frames\)"):
        Limits(max_frames=1).check(1, two, ["a"])
    Limits(max_frames=2).check(1, two, ["a"])


def test_limits_are_validated_and_the_flags_default_to_them(capsys):
    for bad in [{"max_steps": 0}, {"max_pixels": -1}, {"max_samples": 1.5}, {"max_queue": -1},
                {"request_timeout": math.inf}, {"request_timeout": 0}, {"max_prompt_tokens": 4096}]:
        with pytest.raises(ValueError):
            Limits(**bad)
    assert main(["serve", "--checkpoint", "nowhere", "--max-steps", "0"]) == 2  # before any model loads
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--max-steps must be an integer >= 1, got 0" in err
    serve = build_parser().parse_args(["serve", "--checkpoint", "x"])
    assert {f: getattr(serve, f) for f in vars(Limits())} == vars(Limits())
    # --max-batch is reward-serve's (images per merged reward call): serve refuses it, naming its own bound
    with pytest.raises(SystemExit) as e:
        main(["serve", "--checkpoint", "x", "--max-batch", "4"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "--max-samples" in err


# -- strict types ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("route, change, match", [
    ("rollout", {"prompts": "abc"}, r"'prompts' must be list\[str\], got str"),
    ("rollout", {"prompts": [1, 2]}, r"'prompts' must be list\[str\], got list"),
    ("rollout", {"prompts": [None, None]}, r"'prompts' must be list\[str\]"),
    ("rollout", {"n_per_prompt": "1"}, "'n_per_prompt' must be int, got str"),
    ("rollout", {"n_per_prompt": 1.0}, "'n_per_prompt' must be int, got float"),
    ("rollout", {"height": 32.5}, "'height' must be int, got float"),
    ("rollout", {"height": -32}, "positive multiple of 16"),
    ("rollout", {"width": True}, "'width' must be int, got bool"),
    ("rollout", {"seed": "0"}, "'seed' must be int, got str"),
    ("rollout", {"negative_prompt": 5}, "'negative_prompt' must be str or null, got int"),
    ("rollout", {"decode": 1}, "'decode' must be bool, got int"),
    ("rollout", {"cfg_scale": "4"}, "'cfg_scale' must be a finite float, got str"),
    ("rollout", {"cfg_scale": math.inf}, "'cfg_scale' must be a finite float"),
    ("rollout", {"steps": 1e9}, "'steps' must be int, got float"),
    ("rollout", {"sampler": "sde", "num_sde_steps": 1, "sde_window": [0, 1.5]}, "'sde_window' must be tuple"),
    ("rollout", {"sampler": "sde", "num_sde_steps": 1, "sde_window": "01"}, "'sde_window' must be tuple"),
    ("images", {"prompt": ["a cat"]}, "'prompt' must be str, got list"),
    ("images", {"prompt": 5}, "'prompt' must be str, got int"),
    ("images", {"n": "2"}, "'n' must be int, got str"),
    ("images", {"n": 1.0}, "'n' must be int, got float"),
    ("images", {"n": True}, "'n' must be int, got bool"),
    ("images", {"size": 32}, "'size' must be str, got int"),
    ("images", {"size": "-32x32"}, "WIDTHxHEIGHT"),
    ("images", {"size": "32.5x32"}, "WIDTHxHEIGHT"),
    ("images", {"seed": True}, "'seed' must be int or null, got bool"),
    ("images", {"model": 5}, "'model' must be str or null, got int"),
    ("images", {"steps": 1e9}, "'steps' must be int, got float"),
])
def test_request_fields_are_strictly_typed(url, route, change, match):
    r = post(url, route, {**(ROLLOUT if route == "rollout" else IMAGES), **change})
    assert r.status_code == 400, r.text
    assert re.search(match, error_of(r)[0]), error_of(r)[0]


def test_the_rollout_request_serves_every_sampling_field_with_its_default():
    served = {k: f.default for k, f in RolloutBody.model_fields.items()
              if k not in ("prompts", "n_per_prompt", "seed", "first_prompt", "decode", "record_snapshot")}
    assert served == vars(SamplingParams())


# -- time, disconnects, the queue, /health -------------------------------------------------------------------------
def test_a_request_past_its_timeout_is_stopped(engine):
    with serve_in_thread(create_app(engine, Limits(max_steps=LONG["steps"], request_timeout=1.5))) as url:
        start = time.monotonic()
        r = post(url, "images", {**IMAGES, "steps": LONG["steps"]})
        assert r.status_code == 504, r.text
        assert time.monotonic() - start < 10  # the timeout, plus at most one step
        assert r.json()["error"]["code"] == "timeout"
        assert "per-request timeout of 1.5 s (--request-timeout)" in r.json()["error"]["message"]
        assert health(url).json()["busy"] is False


def test_a_client_that_leaves_stops_its_rollout(engine):
    with serve_in_thread(create_app(engine, Limits(max_steps=LONG["steps"]))) as url:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
            post(url, "rollout", LONG, timeout=1.5)
        wait_for(lambda: not health(url).json()["busy"], 10, "the rollout kept running after its client left")
        r = post(url, "rollout", ROLLOUT)  # the worker is free for the next request
        assert r.status_code == 200, r.text


def test_the_queue_is_bounded_and_health_reports_the_work(engine):
    limits = Limits(max_steps=LONG["steps"], max_queue=1, request_timeout=4)
    with serve_in_thread(create_app(engine, limits)) as url:
        answers = {}
        threads = [threading.Thread(target=lambda k=k: answers.update({k: post(url, "rollout", LONG)}))
                   for k in ("running", "waiting")]
        threads[0].start()
        wait_for(lambda: health(url).json()["busy"], 10, "the first rollout did not start")
        threads[1].start()
        wait_for(lambda: health(url).json()["queue_depth"] == 2, 10, "the second rollout did not queue")
        h = health(url)
        assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["busy"] is True
        assert h.json()["running_for_s"] > 0
        r = post(url, "images", IMAGES)  # one past the queue bound
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "queue_full" and "--max-queue" in r.json()["error"]["message"]
        for t in threads:
            t.join(30)
        assert [answers[k].status_code for k in ("running", "waiting")] == [504, 504]  # both stopped in time
        assert health(url).json() | {"busy": False, "queue_depth": 0, "running_for_s": None} == health(url).json()


def test_health_is_not_ok_while_the_worker_is_stuck(engine, monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(engine, "rollout", lambda *a, **k: release.wait(30))  # an engine call that never checks
    try:
        with serve_in_thread(create_app(engine, Limits(request_timeout=0.5))) as url:
            threading.Thread(target=lambda: post(url, "images", IMAGES), daemon=True).start()
            wait_for(lambda: health(url).json()["busy"], 10, "the call did not start")
            assert health(url).json()["status"] == "ok"  # busy, within its time
            wait_for(lambda: health(url).status_code == 503, 10, "/health stayed ok while the worker was stuck")
            h = health(url).json()
            assert h["status"] == "stuck" and h["busy"] and h["running_for_s"] > 1.0
            release.set()  # before the server stops: it waits for the request
    finally:
        release.set()

