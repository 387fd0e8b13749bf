"""The official `openai` Python client against a live engine server on loopback: images come back, and a refused
request raises with the server's reason, field and code (OpenAI's error object on the /v1 routes)."""

from __future__ import annotations

import base64
import io

import openai
import pytest
from PIL import Image

from trueflow.engine.engine import Engine
from trueflow.server import Limits, create_app
from trueflow.http import serve_in_thread


@pytest.fixture(scope="module")
def client(tiny_checkpoint):
    with serve_in_thread(create_app(Engine(tiny_checkpoint), Limits(max_steps=8))) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_images_through_the_openai_client(client):
    out = client.images.generate(prompt="a cat", n=2, size="48x32", response_format="b64_json",
                                 extra_body={"steps": 2, "seed": 3, "sampler": "ode"})
    assert len(out.data) == 2
    png = Image.open(io.BytesIO(base64.b64decode(out.data[0].b64_json)))
    assert png.format == "PNG" and png.size == (48, 32)


@pytest.mark.parametrize("kwargs, param, code, reason", [
    ({"size": "4096x4096", "extra_body": {"steps": 4}}, "size", "limit_exceeded",
     "16777216 pixels per frame (4096x4096); this server takes at most 4194304 (--max-pixels)"),
    ({"extra_body": {"steps": 100_000}}, "steps", "limit_exceeded", "at most 8 (--max-steps)"),
    ({"extra_body": {"steps": "4"}}, "steps", None, "field 'steps' must be int, got str '4'"),
    ({"response_format": "url"}, "response_format", None, "response_format must be 'b64_json'"),
    ({"extra_body": {"quality_boost": True}}, "quality_boost", None, "unknown field(s) 'quality_boost'"),
])
def test_a_refusal_shows_the_servers_reason(client, kwargs, param, code, reason):
    with pytest.raises(openai.BadRequestError) as e:
        client.images.generate(prompt="a cat", **kwargs)
    assert e.value.status_code == 400
    assert reason in e.value.message and reason in str(e.value)  # what a user of the SDK sees
    assert (e.value.param, e.value.code, e.value.type) == (param, code, "invalid_request_error")


def test_an_unknown_route_is_an_openai_error(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.files.list()
    assert e.value.body == {"message": "Not Found", "type": "invalid_request_error", "param": None, "code": None}
