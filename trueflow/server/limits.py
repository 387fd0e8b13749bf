"""What one request may ask of the server, each bound a `trueflow serve` flag (docs/server.md, "Limits")."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, fields
from pathlib import Path

from ..engine.sampling_params import SamplingParams
from ..models import default_family
from .errors import RequestError

# The default family's text-encoder window: the server's default and largest prompt-token limit.
TOKENIZER_MAX_LENGTH = default_family().pipeline.max_text_tokens
PROMPT_CHARS_PER_TOKEN = 32  # a prompt longer than this many characters per allowed token is refused untokenized
WEIGHT_JSON_BYTES = 64 << 10  # a path update's JSON body
IPC_PAYLOAD_BYTES = 64 << 20  # an IPC payload: handles and manifests, never tensor data


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server, each a `trueflow serve` flag (docs/server.md, "Limits").

    The defaults fit Qwen-Image: its pipeline's largest sizes are about 1.8 megapixels (1328x1328) and its text
    window is `TOKENIZER_MAX_LENGTH` tokens (longer prompts would be cut), it makes images (one frame), and a
    request may ask for one GRPO group of samples."""

    max_steps: int = 100  # denoising steps per sample (the pipeline's default is 50)
    max_pixels: int = 2048 * 2048  # height x width of one frame
    max_frames: int = 1  # frames per sample; image families make one
    max_prompt_tokens: int = TOKENIZER_MAX_LENGTH  # tokens of each prompt and of the negative prompt
    max_samples: int = 64  # prompts x n_per_prompt of one request
    max_queue: int = 16  # engine calls a generation request may find waiting (weight updates always queue)
    request_timeout: float = 3600.0  # seconds from a generation request's arrival to its answer (`remote_rollout`'s)

    def __post_init__(self) -> None:
        for f in fields(self):
            v, least = getattr(self, f.name), 0 if f.name == "max_queue" else 1
            if f.name == "request_timeout" and not (math.isfinite(v) and v > 0):
                raise ValueError(f"--request-timeout must be a positive number of seconds, got {v}")
            if f.name != "request_timeout" and not (isinstance(v, int) and v >= least):
                raise ValueError(f"--{f.name.replace('_', '-')} must be an integer >= {least}, got {v}")
        if self.max_prompt_tokens > TOKENIZER_MAX_LENGTH:
            raise ValueError(f"--max-prompt-tokens must be at most {TOKENIZER_MAX_LENGTH} (the text encoder's window: "
                             f"the pipeline cuts longer prompts), got {self.max_prompt_tokens}")

    @property
    def max_prompt_chars(self) -> int:
        return self.max_prompt_tokens * PROMPT_CHARS_PER_TOKEN

    @property
    def generation_body_bytes(self) -> int:
        """The largest generation body that can hold a valid request: every prompt and the negative prompt at
        the character bound, at 12 bytes a character (a JSON surrogate pair), plus room for the other fields."""
        return (self.max_samples + 1) * self.max_prompt_chars * 12 + (64 << 10)

    def check(self, samples: int, params: SamplingParams, prompts: list[str]) -> None:
        """Refuse a request past a bound, naming the field and the flag (tokens are counted later, off the loop)."""
        for value, bound, what, param, flag in [
                (samples, self.max_samples, "samples (prompts x n)", "n_per_prompt", "--max-samples"),
                (params.steps, self.max_steps, "denoising steps", "steps", "--max-steps"),
                (params.height * params.width, self.max_pixels,
                 f"pixels per frame ({params.width}x{params.height})", "width", "--max-pixels"),
                (params.num_frames, self.max_frames, "frames", "num_frames", "--max-frames")]:
            if value > bound:
                raise RequestError(f"the request asks for {value} {what}; this server takes at most {bound} "
                                   f"({flag})", param=param, code="limit_exceeded")
        negative = [] if params.negative_prompt is None else [("negative_prompt", params.negative_prompt)]
        for name, text in [*(("prompts", p) for p in prompts), *negative]:
            if len(text) > self.max_prompt_chars:
                raise RequestError(f"a prompt of {len(text)} characters is too long: this server takes prompts of "
                                   f"at most {self.max_prompt_tokens} tokens (--max-prompt-tokens) and refuses any "
                                   f"longer than {self.max_prompt_chars} characters before tokenizing",
                                   param=name, code="limit_exceeded")


class TokenCounter:
    """Tokens of prompts, by a tokenizer of the server's own (the engine's is its thread's, or another process's):
    the class the checkpoint's tokenizer config names, as the family's text loader reads it."""

    def __init__(self, checkpoint: str):
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(Path(checkpoint) / "tokenizer")
        self._lock = threading.Lock()

    def check(self, limits: Limits, prompts: list[str], negative_prompt: str | None) -> None:
        texts = prompts if negative_prompt is None else [*prompts, negative_prompt]  # None: the family's default
        if not texts:  # no prompt at all: the engine refuses that itself
            return
        with self._lock:
            counts = [len(ids) for ids in self._tokenizer(texts,
                                                           add_special_tokens=False)["input_ids"]]
        for i, n in enumerate(counts):
            if n > limits.max_prompt_tokens:
                raise RequestError(f"{'the negative prompt' if i == len(prompts) else f'prompt {i}'} is {n} tokens; "
                                   f"this server takes at most {limits.max_prompt_tokens} (--max-prompt-tokens)",
                                   param="negative_prompt" if i == len(prompts) else "prompts", code="limit_exceeded")
