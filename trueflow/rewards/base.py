"""The reward interface: uint8 images + prompts -> one float32 score per image, built from a spec string.

A spec is a registered name (`redness`), a weighted sum (`pickscore:1.0,ocr:0.5`), a custom reward
(`my.module:function`, optionally weighted: `my.module:function:0.5`) or a reward server's URL
(`http://127.0.0.1:8000`, see `trueflow reward-serve`). A model path is one path for every term that takes a
model, or one per term (`pickscore=DIR,aesthetic=DIR2`); a `url` goes to the terms that take one (`vlm_judge`).
`score` is what a trainer calls: it checks the output and turns any failure into a `RewardError` naming the reward
and the prompt, or drops that prompt's group.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol, runtime_checkable

import torch

from .aesthetic import Aesthetic
from .clip_score import ClipScore
from .errors import RewardError, RewardTimeout
from .hps import HPSv2
from .imagereward import ImageReward
from .jpeg import JpegSize
from .ocr import OcrReward
from .pickscore import PickScore
from .redness import Redness
from .vlm_judge import VlmJudge

log = logging.getLogger(__name__)

ON_ERROR = ("raise", "skip")


@runtime_checkable
class Reward(Protocol):
    """images: uint8 [N, H, W, 3] on the CPU; prompts: N strings; returns float32 [N] on the CPU."""

    name: str

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor: ...


# A factory is called with whichever of `model_path`, `device` and `url` it names, and returns a Reward.
RewardFactory = Callable[..., Reward]

REWARDS: dict[str, RewardFactory] = {
    "redness": Redness,
    "jpeg_compressibility": functools.partial(JpegSize, compressible=True),
    "jpeg_incompressibility": functools.partial(JpegSize, compressible=False),
    "pickscore": PickScore,
    "pickscore_flowgrpo": functools.partial(PickScore, normalize=True),
    "ocr": OcrReward,
    "clip_score": ClipScore,
    "aesthetic": Aesthetic,
    "hpsv2": HPSv2,
    "imagereward": ImageReward,
    "vlm_judge": VlmJudge,
}
_FACTORY_ARGS = ("model_path", "device", "url")


# -- building ------------------------------------------------------------------------------------------------
class _Named:
    """Gives a plain callable the `name` the Reward protocol wants."""

    def __init__(self, fn: Callable[[torch.Tensor, list[str]], Any], name: str):
        self.fn, self.name = fn, name

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return self.fn(images, prompts)


class WeightedSum:
    """sum_i w_i * reward_i; each term's output is checked on its own so an error names the term, not the sum."""

    def __init__(self, terms: Sequence[tuple[Reward, float]]):
        self.terms = list(terms)
        self.name = ",".join(f"{r.name}:{w:g}" for r, w in self.terms)

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        total = torch.zeros(len(prompts), dtype=torch.float32)
        for reward, weight in self.terms:
            out = as_scores(reward.name, reward(images, prompts), prompts)
            bad = _nonfinite(reward.name, out, prompts)
            if bad:
                raise next(iter(bad.values()))
            total += weight * out
        return total


def _takes_factory_args(obj: Any) -> bool:
    """A class, or a callable whose parameters are all `model_path`/`device`/`url`, is a factory; else the reward."""
    if inspect.isclass(obj):
        return True
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(p.name in _FACTORY_ARGS or p.kind is p.VAR_KEYWORD for p in params)


def _call_factory(factory: Callable[..., Any], model_path: str | None, device: str,
                  url: str | None) -> tuple[Any, set[str]]:
    """Calls `factory` with the arguments it names; also says which of `model_path` and `url` it took."""
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    any_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    given = {"model_path": model_path, "device": device, "url": url}
    kwargs = {k: v for k, v in given.items() if any_kw or k in params}
    return factory(**kwargs), {"model_path", "url"} & kwargs.keys()


def _custom(target: str) -> Callable[..., Any]:
    module, _, attr = target.rpartition(":")
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"custom reward {target!r}: cannot import module {module!r}: {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"custom reward {target!r}: module {module!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"custom reward {target!r} is not callable")
    return obj


_URL = re.compile(r"^(https?://(?:\[[^\]]*\]|[^/:,\[]+)(?::\d+)?(?:/[^:,]*)?)(?::([^:,/]+))?$")


def _split_term(term: str) -> tuple[str, float]:
    """'name' | 'name:w' | 'pkg.mod:fn' | 'pkg.mod:fn:w' | 'http://host:port[/path][:w]' -> (target, weight)."""
    url = _URL.match(term)
    if url:
        target, weight = url.group(1), url.group(2)
    else:
        head, _, tail = term.rpartition(":")
        target, weight = (head, tail) if head and _is_number(tail) else (term, None)
    if weight is None:
        return target, 1.0
    if not _is_number(weight):
        raise ValueError(f"reward term {term!r}: weight {weight!r} is not a number")
    if not math.isfinite(float(weight)):  # a NaN or inf weight would make every reward of the run NaN
        raise ValueError(f"reward term {term!r}: weight {weight!r} must be a finite number")
    return target, float(weight)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _per_term_paths(model_path: str | None, targets: Sequence[str]) -> dict[str, str] | None:
    """'name=PATH,name2=PATH2' (each name a term of the spec) -> {name: PATH}; a plain path -> None."""
    if model_path is None or model_path.partition("=")[0].strip() not in targets:
        return None
    paths: dict[str, str] = {}
    for item in model_path.split(","):
        name, eq, path = (x.strip() for x in item.partition("="))
        if not eq or name not in targets or not path or name in paths:
            raise ValueError(f"model path {model_path!r}: {item!r} is not 'NAME=PATH' for a distinct term of "
                             f"the spec (terms: {', '.join(targets)})")
        paths[name] = path
    return paths


def build_reward(spec: str, model_path: str | None = None, device: str = "cpu", url: str | None = None) -> Reward:
    """A Reward from a spec (module docstring). `model_path` goes to every term that takes a model (PickScore:
    `MODEL_DIR` or `MODEL_DIR:PROCESSOR_DIR`), or per term as 'name=PATH,name2=PATH2'; `url` to every term that
    takes one (`vlm_judge`). It is an error if no term takes a path or URL that was given."""
    split = []
    for term in (t.strip() for t in spec.split(",")):
        if not term:
            raise ValueError(f"reward spec {spec!r} has an empty term")
        split.append(_split_term(term))
    per_term = _per_term_paths(model_path, [target for target, _ in split])
    terms: list[tuple[Reward, float]] = []
    took_path: set[str] = set()  # the targets given a model path
    took_url = False
    for target, weight in split:
        path = per_term.get(target) if per_term is not None else model_path
        took: set[str] = set()
        if _URL.match(target):
            from .remote import RemoteReward

            reward: Any = RemoteReward(target)
        elif target in REWARDS:
            reward, took = _call_factory(REWARDS[target], path, device, url)
        elif ":" in target:
            obj = _custom(target)
            if _takes_factory_args(obj):
                obj, took = _call_factory(obj, path, device, url)
            reward = obj if isinstance(getattr(obj, "name", None), str) else _Named(obj, target)
        else:
            raise ValueError(f"unknown reward {target!r}; registered: {', '.join(REWARDS)}; or give "
                             "'my.module:function' or a reward server URL")
        if "model_path" in took and path is not None:
            took_path.add(target)
        took_url |= "url" in took
        terms.append((reward, weight))
    unused = sorted(set(per_term or ()) - took_path)
    if unused:
        raise ValueError(f"a model path was given for {', '.join(unused)}, which takes no model")
    if model_path is not None and not took_path:
        raise ValueError(f"a model path was given but no reward of {spec!r} takes a model")
    if url is not None and not took_url:
        raise ValueError(f"a URL was given but no reward of {spec!r} takes one (vlm_judge does)")
    if len(terms) == 1 and terms[0][1] == 1.0:
        return terms[0][0]
    return WeightedSum(terms)


# -- scoring -------------------------------------------------------------------------------------------------
def as_scores(name: str, out: Any, prompts: Sequence[str]) -> torch.Tensor:
    """A reward's output as float32 [N] on the CPU (lists and arrays accepted), or a RewardError."""
    try:
        scores = torch.as_tensor(out).detach().to("cpu", torch.float32)
    except (TypeError, ValueError, RuntimeError) as e:
        raise RewardError(name, prompts, f"returned {type(out).__name__}, not scores: {e}") from e
    if scores.shape != (len(prompts),):
        raise RewardError(name, prompts, f"returned shape {tuple(scores.shape)}, expected ({len(prompts)},)")
    return scores


def _nonfinite(name: str, scores: torch.Tensor, prompts: Sequence[str]) -> dict[str, RewardError]:
    """One RewardError per prompt that got a NaN or infinite score."""
    bad: dict[str, RewardError] = {}
    for i in torch.nonzero(~torch.isfinite(scores)).flatten().tolist():
        bad.setdefault(prompts[i], RewardError(name, [prompts[i]], f"returned {scores[i].item()} for image {i}"))
    return bad


def _call(reward: Reward, images: torch.Tensor, prompts: list[str], timeout: float | None) -> torch.Tensor:
    name = getattr(reward, "name", repr(reward))
    if timeout is None:
        return as_scores(name, reward(images, prompts), prompts)
    pool = ThreadPoolExecutor(1, thread_name_prefix=f"reward-{name}")
    try:
        out = pool.submit(reward, images, prompts).result(timeout)
    except FutureTimeout:
        raise RewardTimeout(name, prompts, f"no result within {timeout:g} s") from None
    finally:
        pool.shutdown(wait=False)  # a thread cannot be killed: a hung reward keeps it, the trainer goes on
    return as_scores(name, out, prompts)


def _as_error(name: str, prompts: Sequence[str], e: Exception) -> RewardError:
    if isinstance(e, RewardError):
        return e
    err = RewardError(name, prompts, f"{type(e).__name__}: {e}")
    err.__cause__ = e
    return err


def score(reward: Reward, images: torch.Tensor, prompts: Sequence[str], on_error: str = "raise",
          timeout: float | None = None) -> tuple[torch.Tensor, list[int]]:
    """Scores a batch: (float32 [N] scores, indices dropped). All-or-nothing per prompt group (same prompt string).

    A failure is an exception, a wrong shape, a non-finite score, or no result within `timeout` seconds. When a
    batch raises, each prompt group is re-scored alone to find the failing prompts. `on_error="raise"` raises the
    first RewardError; `"skip"` drops every sample of a failing prompt, sets its scores to NaN (so a caller that
    forgets to drop them fails loudly), logs a warning and returns the dropped indices.
    """
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, not {on_error!r}")
    prompts = list(prompts)
    if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[-1] != 3 or images.shape[0] != len(prompts):
        raise ValueError(f"expected uint8 images [N, H, W, 3] for {len(prompts)} prompts, got {images.dtype} "
                         f"{tuple(images.shape)}")
    name = getattr(reward, "name", repr(reward))
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(p, []).append(i)

    failures: dict[str, RewardError] = {}
    try:
        scores = _call(reward, images, prompts, timeout)
    except RewardTimeout as e:
        scores, failures = torch.full((len(prompts),), float("nan")), {p: e for p in groups}
    except Exception as e:  # noqa: BLE001 - any failure of user code becomes a RewardError below
        scores = torch.full((len(prompts),), float("nan"))
        if len(groups) == 1:
            failures = {prompts[0]: _as_error(name, prompts, e)}
        else:
            for p, idx in groups.items():
                try:
                    scores[idx] = _call(reward, images[idx], [p] * len(idx), timeout)
                except Exception as ge:  # noqa: BLE001
                    failures[p] = _as_error(name, [p], ge)
            if not failures:  # each group passes alone: the batch itself failed (e.g. out of memory); keep these
                log.warning("reward %r failed on the whole batch (%s) but on no prompt alone", name, e)
    for p, err in _nonfinite(name, scores, prompts).items():
        failures.setdefault(p, err)  # a group that already failed keeps its own error

    if not failures:
        return scores, []
    if on_error == "raise":
        raise next(iter(failures.values()))
    dropped = sorted(i for p in failures for i in groups[p])
    scores[dropped] = float("nan")
    log.warning("reward %r: dropped %d prompt group(s) (%d samples): %s", name, len(failures), len(dropped),
                "; ".join(str(e) for e in failures.values()))
    return scores, dropped


def score_samples(reward: Reward, samples: torch.Tensor, prompts: Sequence[str], on_error: str = "raise",
                  frames: int = 1) -> tuple[torch.Tensor, list[int]]:
    """`score` for a rollout's samples: images `[N, H, W, 3]` as they are, videos `[N, F, H, W, 3]` by the image
    reward on `frames` evenly spread frames (first and last included), averaged; a prompt dropped on any frame is
    dropped. What every placement's scoring calls (the trainer's, an engine process's, a Ray reward actor's)."""
    if samples.ndim == 4:
        return score(reward, samples, prompts, on_error=on_error)
    from ..video import frame_indices

    per_frame = [score(reward, samples[:, f].contiguous(), prompts, on_error=on_error)
                 for f in frame_indices(samples.shape[1], frames)]
    # A dropped group is NaN in its frames' scores, so the mean keeps it NaN (out of the statistics).
    return (torch.stack([r for r, _ in per_frame]).mean(0),
            sorted({i for _, dropped in per_frame for i in dropped}))
