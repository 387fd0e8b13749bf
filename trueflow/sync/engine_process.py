"""The rollout engine in its own process, driven by the trainer through queues.

LoRA updates cross as weight buckets (`buckets.py`): on CPU each bucket's buffer is moved to shared memory and
torch's multiprocessing pickler sends its handle; on CUDA it sends a CUDA IPC handle. Either way no tensor data is
copied through a pipe. The engine copies the update into place, and answers with the checksum of what it now holds
(read back from its layers), so the trainer knows the new weights are in place. Rollouts come back on the CPU.
"""

from __future__ import annotations

import queue
import traceback
from typing import TYPE_CHECKING

import torch
import torch.multiprocessing as mp

from ..rewards.base import RewardError
from .buckets import DEFAULT_BUCKET_BYTES, pack, unpack

if TYPE_CHECKING:
    from ..engine.interface import RolloutRequest
    from ..engine.trajectory import Rollout


class EngineProcessError(RuntimeError):
    pass


class EngineRequestRefused(EngineProcessError, ValueError):
    """The engine refused a request as invalid (a bad weight update, bad sampling params) and kept serving;
    the message is the engine's ValueError, without the traceback. Nothing was applied."""


def to_cpu(obj):
    """Tensors of a rollout (nested dataclasses, lists, dicts) moved to the CPU for the trip back."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(o) for o in obj)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            setattr(obj, name, to_cpu(getattr(obj, name)))
    return obj


def _serve(args: dict, threads: int, reward_args: tuple | None, requests, replies) -> None:
    # On CPU the engine must use the trainer's intra-op thread count (parity condition 9, docs/patch-group.md).
    torch.set_num_threads(threads)
    try:
        from ..engine.engine import Engine
        from ..engine.interface import ScoredEngine
        from ..rewards.base import build_reward

        engine = Engine(**args)
        if reward_args is not None:  # scored here: the images never leave this process unscored
            *spec, on_error, frames = reward_args
            engine = ScoredEngine(engine, build_reward(*spec), on_error, frames)
        replies.put(("ok", "ready"))
    except ValueError as e:  # a bad setting (a reward spec, a patch name): the user's to fix, one line
        replies.put(("refused", str(e)))
        return
    except Exception:  # noqa: BLE001 - reported to the trainer, which raises it
        replies.put(("failed", traceback.format_exc()))
        return
    while True:
        op, payload = requests.get()
        try:
            if op == "close":
                replies.put(("ok", None))
                return
            if op == "rollout":
                value = to_cpu(engine.rollout(*payload))
            elif op == "update_weights":
                buckets, scale, merge_mode = payload
                # Clone out of the sender's buffers: they are the trainer's, freed once it has our answer.
                value = engine.update_weights({k: v.clone() for k, v in unpack(buckets).items()}, scale, merge_mode)
                del buckets
            elif op == "checksum":
                value = engine.checksum()
            elif op == "health":
                value = engine.health()
            else:
                raise ValueError(f"unknown engine request {op!r}")
            replies.put(("ok", value))
        except RewardError as e:  # the user's reward failed: the trainer raises it as the same RewardError
            replies.put(("reward_failed", (e.reward, e.prompts, e.reason)))
        except ValueError as e:  # the request's fault: its reason is the message
            replies.put(("refused", str(e)))
        except Exception:  # noqa: BLE001 - the engine keeps serving; the trainer raises
            replies.put(("failed", traceback.format_exc()))


class EngineClient:
    """The engine interface (`engine.interface.RolloutEngine`) served by an `Engine` in another process."""

    def __init__(self, checkpoint: str, patch_group: str = "none", disabled_patches: tuple[str, ...] = (),
                 device: str = "cpu", dtype: torch.dtype = torch.bfloat16, threads: int | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 reward: tuple[str, str | None, str, str | None, str, int] | None = None, family: str | None = None):
        """`reward`: (spec, model path, device, url, on_error, frames) of a reward to build in the engine process, which
        then scores every rollout (`ScoredEngine`); None keeps rewards out of it. `family`: as `Engine`'s (where
        the checkpoint names none)."""
        ctx = mp.get_context("spawn")
        self.requests, self.replies = ctx.Queue(), ctx.Queue()
        self.bucket_bytes = bucket_bytes
        self.process = ctx.Process(target=_serve, daemon=True, args=(
            dict(checkpoint=checkpoint, patch_group=patch_group, disabled_patches=tuple(disabled_patches),
                 device=device, dtype=dtype, family=family),
            threads or torch.get_num_threads(), reward, self.requests, self.replies))
        self.process.start()
        self._reply()

    def _reply(self):
        while True:
            try:
                status, value = self.replies.get(timeout=1.0)
                break
            except queue.Empty:
                if not self.process.is_alive():
                    raise EngineProcessError(f"the engine process died (exit code {self.process.exitcode})")
        if status == "refused":
            raise EngineRequestRefused(value)
        if status == "reward_failed":
            raise RewardError(*value)
        if status != "ok":
            raise EngineProcessError(f"the engine process failed:\n{value}")
        return value

    def _call(self, op: str, *payload):
        self.requests.put((op, payload))
        return self._reply()

    def rollout(self, request: RolloutRequest) -> Rollout:
        return self._call("rollout", request)

    def update_weights(self, state: dict[str, torch.Tensor], lora_scale: float | None = None,
                       merge_mode: str | None = None) -> str:
        """Send the weights as buckets of IPC handles; returns the engine's checksum once the update is in place.
        A bad update (names, shapes, values in the engine's dtype) raises EngineRequestRefused, a ValueError,
        and leaves the engine's weights as they were."""
        buckets = pack(state, self.bucket_bytes)
        for b in buckets:
            if b.buffer.device.type == "cpu":
                b.buffer.share_memory_()
        return self._call("update_weights", buckets, lora_scale, merge_mode)  # the buckets live until it answers

    def checksum(self) -> str:
        return self._call("checksum")

    def health(self) -> dict:
        return {**self._call("health"), "process": self.process.pid}

    def shutdown(self) -> None:
        if self.process.is_alive():
            self._call("close")
            self.process.join(timeout=30)
