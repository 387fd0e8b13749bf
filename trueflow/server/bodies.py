"""The request bodies, strictly typed: no coercion, unknown fields refused, each refusal naming the field."""

from __future__ import annotations

import json
import re
import types
import typing
from typing import Annotated, Any, TypeVar

import msgpack
from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from .. import http
from ..engine.request import RolloutRequest
from ..engine.sampling_params import SamplingParams
from .errors import RequestError

_M = TypeVar("_M", bound=BaseModel)
class Strict(BaseModel):
    """No coercion: a string is no list or number, a number no string, a bool no int, a float no int; floats
    may be sent as ints and must be finite; unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


_D = SamplingParams()


class Sampling(Strict):
    """Every `SamplingParams` field, with its default (a test keeps the two in step). The engine checks values."""

    steps: int = _D.steps
    sampler: str = _D.sampler
    noise_level: float = _D.noise_level
    cfg_scale: float = _D.cfg_scale
    cfg_scale_2: float | None = _D.cfg_scale_2
    distilled_guidance_scale: float | None = _D.distilled_guidance_scale
    negative_prompt: str | None = _D.negative_prompt  # None: the family's
    num_sde_steps: int | None = _D.num_sde_steps
    sde_window: tuple[StrictInt, StrictInt] | None = Field(default=_D.sde_window, strict=False)  # msgpack sends a list
    height: int = _D.height
    width: int = _D.width
    num_frames: int = _D.num_frames
    fps: float = _D.fps
    max_sequence_length: int = _D.max_sequence_length
    rollout_microgroup_size: int | None = _D.rollout_microgroup_size
    image: str | None = _D.image

    def params(self) -> SamplingParams:
        if self.image is not None:  # a path on the server's machine would let any client read its files
            raise RequestError("image (image-to-video's first frame) is a file on the engine's machine: the server "
                               "takes none; run image-to-video in process (`trueflow generate --image`)",
                               param="image")
        try:
            return SamplingParams(**{f: getattr(self, f) for f in Sampling.model_fields})
        except ValueError as e:
            raise RequestError(str(e), param=field_of(str(e))) from e


def field_of(message: str) -> str | None:
    """The sampling field a refusal is about: `SamplingParams` and the family's checks start their messages with it
    (`steps must be >= 1`, `height must be a positive multiple of 16`), or name it (`needs noise_level > 0`)."""
    words = [w for w in re.findall(r"[a-z_]+", message) if w in Sampling.model_fields]
    if message.startswith(tuple(words)):
        return words[0]
    # "the sde sampler needs noise_level > 0": the value at fault, not the sampler that needs it
    return next((w for w in words if w != "sampler"), words[0] if words else None)


class RolloutBody(Sampling):
    """`POST /rollout/generate`: an `interface.RolloutRequest`, sampling params flat."""

    prompts: list[str]
    n_per_prompt: int
    seed: int
    first_prompt: int = 0
    decode: bool = True
    record_snapshot: bool = False

    def request(self) -> RolloutRequest:
        try:
            return RolloutRequest(self.prompts, self.n_per_prompt, self.params(), self.seed, self.first_prompt,
                                  self.decode, self.record_snapshot)
        except ValueError as e:
            raise RequestError(str(e), param="first_prompt") from e


# The fields of OpenAI's images API (openai-python's `types/image_generate_params.py`, ImageGenerateParamsBase)
# that this server takes and ignores: they ask a hosted model for things an engine of one checkpoint has no setting
# for (quality tiers, styles, output encodings, moderation, a user id). A request naming one is answered as if it
# had not, and the answer's `x-trueflow-ignored-fields` header lists them. Any other unknown field is refused: it is
# a typo of a field this server honours, not a standard one.
OPENAI_IGNORED = ("background", "complexity", "frame_count", "frame_duration_ms", "moderation", "output_compression",
                  "output_format", "partial_images", "quality", "safety_identifier", "style", "svg", "user")
IGNORED_HEADER = "x-trueflow-ignored-fields"


class ImagesRequest(Strict):
    """`POST /v1/images/generations`: OpenAI's fields this server honours, and a few sampling extensions
    (`OPENAI_IGNORED`: the standard fields it takes and ignores)."""

    prompt: str
    n: int = 1
    size: str = f"{_D.width}x{_D.height}"  # or "auto": this default
    stream: bool = False  # true is refused: the answer is one JSON object
    response_format: str = "b64_json"
    model: str | None = None  # OpenAI clients send one; there is one model here (`/v1/models`)
    seed: int | None = None  # None: a new random seed, returned in the answer
    steps: int = _D.steps
    cfg_scale: float = _D.cfg_scale
    sampler: str = _D.sampler
    negative_prompt: str | None = _D.negative_prompt  # None: the family's


class LoraUpdate(Strict):
    scale: float
    merge_mode: str | None = None


class LoraByPath(LoraUpdate):
    path: str


class FullUpdate(Strict):
    pass


class FullByPath(FullUpdate):
    path: str


def type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        return type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " or ".join(map(type_name, args))
    if origin in (list, tuple):
        return f"{origin.__name__}[{', '.join(map(type_name, args))}]"
    return {float: "a finite float", type(None): "null"}.get(hint, getattr(hint, "__name__", str(hint)))


def validate(model: type[_M], body: Any) -> _M:
    """`body` as a `model`, or a RequestError naming the unknown, missing or mistyped fields."""
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a map of fields, got {type(body).__name__}")
    try:
        out = model.model_validate(body)
    except ValidationError as e:
        errors = e.errors()
        for kind, what in (("invalid_key", "field names must be strings, got"), ("extra_forbidden", "unknown field(s)"),
                           ("missing", "missing field(s)")):
            names = [x["loc"][0] for x in errors if x["type"] == kind and len(x["loc"]) == 1]
            if names:
                takes = f"; this endpoint takes {', '.join(sorted(model.model_fields))}" * (kind == "extra_forbidden")
                raise RequestError(f"{what} {', '.join(map(repr, sorted(names, key=str)))}{takes}",
                                   param=str(names[0])) from None
        name = str(errors[0]["loc"][0])  # a top-level field's name
        raise RequestError(f"field {name!r} must be {type_name(model.model_fields[name].annotation)}, got "
                           f"{type(body.get(name)).__name__} {body.get(name)!r:.100}", param=name) from None
    seed = getattr(out, "seed", None)
    if seed is not None and not -2**63 <= seed < 2**63:  # seeds are hashed as signed 64-bit integers
        raise RequestError(f"field 'seed' must fit a signed 64-bit integer, got {seed}", param="seed")
    return out


def decode_body(data: bytes, fmt: str) -> Any:
    try:
        return msgpack.unpackb(data) if fmt == "msgpack" else json.loads(data)
    except Exception as e:  # noqa: BLE001 - any undecodable body is the client's error
        raise RequestError(f"malformed {fmt} body ({type(e).__name__}: {str(e):.200})") from e


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) past `limit` bytes before more of it is read."""
    try:
        return await http.read_body(request, limit)
    except http.BodyTooLarge as e:
        raise RequestError(str(e), 413, code="too_large") from None
