"""The official `openai` Python client against a live engine server on loopback: images come back, OpenAI's own
fields the server has no setting for are taken and named, a request without a seed draws one, `/v1/models` lists
the model, and a refused request raises with the server's reason, field and code (OpenAI's error object on the /v1
routes)."""

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
    ({"size": "70x64"}, "size", None, "size 70x64: width must be a positive multiple of 16"),
    ({"extra_body": {"steps": 0}}, "steps", None, "steps must be >= 1"),
    ({"extra_body": {"cfg_scale": 0.5}}, "cfg_scale", None, "cfg_scale must be >= 1"),
    ({"extra_body": {"stream": True}}, "stream", None, "stream must be false"),
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


def b64_png(item) -> bytes:
    return base64.b64decode(item.b64_json)


def test_openais_own_fields_are_taken_ignored_and_named(client):
    """quality, user and style (as the SDK sends them) change nothing: the same pixels as without them, and the
    answer's header says which fields were ignored."""
    kwargs = dict(prompt="a cat", size="32x32", extra_body={"steps": 2, "seed": 11, "sampler": "ode"})
    raw = client.images.with_raw_response.generate(quality="hd", user="someone", style="vivid", **kwargs)
    assert raw.headers["x-trueflow-ignored-fields"] == "quality, style, user"
    plain = client.images.with_raw_response.generate(**kwargs)
    assert "x-trueflow-ignored-fields" not in plain.headers
    assert b64_png(raw.parse().data[0]) == b64_png(plain.parse().data[0])


def test_every_field_of_openais_images_api_is_honoured_or_ignored():
    """The installed SDK's request fields, against this server's: a new standard field fails here, not as a 400."""
    from openai.types.image_generate_params import ImageGenerateParamsBase

    from trueflow.server.bodies import OPENAI_IGNORED, ImagesRequest

    honoured = set(ImagesRequest.model_fields)
    assert set(ImageGenerateParamsBase.__annotations__) <= honoured | set(OPENAI_IGNORED)
    assert not honoured & set(OPENAI_IGNORED)


def test_a_request_without_a_seed_draws_one_and_returns_it(client):
    kwargs = dict(prompt="a cat", size="32x32", extra_body={"steps": 2, "sampler": "sde"})
    first, second = client.images.generate(**kwargs), client.images.generate(**kwargs)
    assert isinstance(first.seed, int) and 0 <= first.seed < 2**63 and first.seed != second.seed
    assert b64_png(first.data[0]) != b64_png(second.data[0])
    again = client.images.generate(prompt="a cat", size="32x32",
                                   extra_body={"steps": 2, "sampler": "sde", "seed": first.seed})
    assert again.seed == first.seed and b64_png(again.data[0]) == b64_png(first.data[0])


def test_models_lists_the_one_model_served(client, tiny_checkpoint):
    models = client.models.list()
    assert [m.id for m in models.data] == [tiny_checkpoint.name]
    card = client.models.retrieve(tiny_checkpoint.name)
    assert (card.id, card.object, card.owned_by) == (tiny_checkpoint.name, "model", "trueflow")
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("dall-e-3")
    assert (e.value.param, e.value.code) == ("model", "model_not_found")
    # a client naming another model is served the one there is, and told so
    raw = client.images.with_raw_response.generate(prompt="a cat", model="dall-e-3", size="32x32",
                                                   extra_body={"steps": 2, "seed": 1, "sampler": "ode"})
    assert raw.headers["x-trueflow-ignored-fields"] == "model"
