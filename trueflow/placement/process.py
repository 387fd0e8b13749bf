"""The rollout engine in its own process (or over N tensor-parallel processes), driven through queues.

LoRA updates cross as weight buckets (`buckets.py`): on CPU each bucket's buffer is moved to shared memory and
torch's multiprocessing pickler sends its handle; on CUDA it sends a CUDA IPC handle. Either way no tensor data is
copied through a pipe. The engine copies the update into place, and answers with the checksum of what it now holds
(read back from its layers), so the trainer knows the new weights are in place. Rollouts come back on the CPU.

A process that dies (a rank's OOM, a kill) is found within REPLY_POLL_S and named in one line (`EngineProcessDied`);
under TP it is the cause whatever its peers then report, and they are killed at shutdown (they would wait in
their next collective for ever). An engine's own failure is one line too; its traceback goes to the log.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import signal
import time
import traceback
from typing import TYPE_CHECKING

import torch
import torch.multiprocessing as mp

from .. import loading
from ..dtypes import torch_dtype
from ..engine.interface import EngineDied, RolloutCancelled, StopCheck
from ..models import family_for_checkpoint
from ..rewards.base import RewardError
from ..sync.buckets import DEFAULT_BUCKET_BYTES, BucketPacker
from ..sync.checksum import tensors_checksum
from .spec import EngineSpec, Placement, RewardSpec

PARENT_POLL_S = 1.0  # how often an idle engine process checks that its client is still alive
REPLY_POLL_S = 0.2  # how often a waiting client checks that every engine process is alive
PEER_DEATH_S = 2.0  # a TP rank's failure waits this long for a peer's death, its likely cause, to show
log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from ..engine.interface import RolloutEngine, RolloutRequest
    from ..engine.trajectory import Rollout


class EngineProcessError(RuntimeError):
    """The engine process failed; the message is one line, `traceback` the process's own (logged, not shown)."""

    def __init__(self, message: str, traceback: str | None = None):
        super().__init__(message)
        self.traceback = traceback


class EngineProcessDied(EngineProcessError, EngineDied):
    """An engine process (or a tensor-parallel rank's) died; the message names it and its exit code."""


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


def _stop_check(stop, device: torch.device | str, tp: bool) -> StopCheck:
    """A rollout's `should_stop` in an engine process: the client's `stop` event; under TP agreed by every rank at
    every step (the max over ranks), so that all stop at the same step and none waits for ever in a collective."""
    if not tp:
        return stop.is_set

    def agreed() -> bool:
        import torch.distributed as dist

        flag = torch.tensor([int(stop.is_set())], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    return agreed


def _serve(spec: EngineSpec, threads: int, reward: RewardSpec | None, requests, replies,
           tp: tuple[int, int, int] | None = None, stop=None) -> None:
    """One engine process; with `tp` = (rank, size, port) one rank of a tensor-parallel engine (a process group on
    loopback; on CUDA the rank takes GPU `rank`). `reward`: scored here, before the images leave the process. `stop`:
    the client's event that stops a rollout."""
    # Its client ends it (close, or kill): a Ctrl-C, which the terminal sends to every process, is the client's.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # On CPU the engine must use the trainer's intra-op thread count (parity condition 9, docs/patch-group.md).
    torch.set_num_threads(threads)
    group, device = None, torch.device(spec.device)
    try:
        from ..rewards.base import build_reward
        from .local import build_local
        from .scored import ScoredEngine

        if tp is not None:
            from ..parallel.comm import init_tp

            rank, size, port = tp
            if device.type == "cuda":
                device = torch.device("cuda", rank)
                torch.cuda.set_device(device)
            group = init_tp(rank, size, port, device)
        engine: RolloutEngine = build_local(spec, str(device), group)
        if reward is not None:  # scored here: the images never leave this process unscored
            engine = ScoredEngine(engine, build_reward(reward.spec, reward.model, reward.device, url=reward.url),
                                  reward.on_error, reward.frames)
        replies.put(("ok", "ready"))
    except ValueError as e:  # a bad setting (a reward spec, a patch name): the user's to fix, one line
        replies.put(("refused", str(e)))
        return
    except Exception:  # noqa: BLE001 - reported to the trainer, which raises it
        replies.put(("failed", traceback.format_exc()))
        return
    try:
        _requests(engine, requests, replies, _stop_check(stop, device, group is not None))
    finally:
        if group is not None:
            import torch.distributed as dist

            dist.destroy_process_group()


def _requests(engine, requests, replies, should_stop: StopCheck) -> None:
    parent = mp.parent_process()
    while True:
        try:
            op, payload = requests.get(timeout=PARENT_POLL_S)
        except queue.Empty:
            # A client killed without a word (SIGKILL, OOM) never sends "close": leave with it rather than hold the
            # device's memory as an orphan.
            if parent is not None and not parent.is_alive():
                return
            continue
        try:
            if op == "close":
                replies.put(("ok", None))
                return
            if op == "rollout":
                request, stoppable = payload
                value = to_cpu(engine.rollout(request, should_stop if stoppable else None))
            elif op == "update_weights":
                buckets, scale, merge_mode = payload
                # The sender's buffers, freed once it has our answer: the engine copies out of them, never keeps them.
                value = engine.update_weights(buckets, scale, merge_mode)
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
        except RolloutCancelled as e:  # its client's should_stop said so
            replies.put(("cancelled", str(e)))
        except ValueError as e:  # the request's fault: its reason is the message
            replies.put(("refused", str(e)))
        except Exception:  # noqa: BLE001 - the engine keeps serving; the trainer raises
            replies.put(("failed", traceback.format_exc()))


class EngineClient:
    """The engine interface (`engine.interface.RolloutEngine`) served by an `Engine` in another process, or with
    `tp` > 1 by a tensor-parallel engine over `tp` processes (docs/tensor-parallel.md): every rank gets every request
    (their forwards meet in the rank-ordered sums), rank 0 alone decodes, scores and answers with the rollout; a
    LoRA update goes to all, each rank installs its slice and answers with the slice's checksum read back, and the
    update stands only when every slice is the one the sender meant for that rank."""

    def __init__(self, spec: EngineSpec, tp: int = 1, tp_matched: bool = False, reward: RewardSpec | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        """`spec`: what the engine runs (its `threads`: the processes' intra-op CPU threads, default this process's).
        `tp`: tensor-parallel ranks (the family must declare a plan). `tp_matched`: the caller's train side computes
        each sharded layer as these ranks do (`--train-tp-match`): no TP gate warning. `reward`: built in the engine
        process (rank 0's), which then scores every rollout (`ScoredEngine`); None keeps rewards out of it."""
        if tp < 1:
            raise ValueError(f"--tp must be >= 1, got {tp}")
        self.tp, self.dtype, self.bucket_bytes = tp, torch_dtype(spec.dtype), bucket_bytes
        self.packer = BucketPacker(bucket_bytes)  # the LoRA's buffers, refilled every sync
        self.family = family_for_checkpoint(spec.checkpoint, spec.family)
        if tp > 1:
            from ..net import free_port
            from ..parallel.engine import tp_gate, tp_plan

            tp_plan(self.family, tp).check(loading.read_transformer_config(spec.checkpoint), tp)  # before spawning
            tp_gate(tp, spec.patch_group, None, matched=tp_matched)
            port = free_port()
        ctx = mp.get_context("spawn")
        self.stop = ctx.Event()  # set to stop the running rollout
        self.requests = [ctx.Queue() for _ in range(tp)]
        self.replies = [ctx.Queue() for _ in range(tp)]
        self.processes = [ctx.Process(target=_serve, daemon=True, args=(
            spec, spec.threads or torch.get_num_threads(), reward if r == 0 else None, self.requests[r],
            self.replies[r], (r, tp, port) if tp > 1 else None, self.stop)) for r in range(tp)]
        for p in self.processes:
            p.start()
        self._replies()
        self.expected: list[str] | None = None  # each rank's LoRA slice checksum, after a confirmed update
        self.confirmed: str | None = None  # the LoRA's checksum once every slice was confirmed

    @classmethod
    def from_placement(cls, spec: EngineSpec, placement: Placement) -> EngineClient:
        """The `process` placement (with `placement.tp` > 1, N tensor-parallel processes)."""
        reward = placement.reward if placement.reward_at == "engine" else None
        return cls(spec, placement.tp, placement.tp_matched, reward,
                   placement.bucket_bytes or DEFAULT_BUCKET_BYTES)

    def _dead(self) -> EngineProcessDied | None:
        """The first engine process found dead, as the error naming it."""
        for i, p in enumerate(self.processes):
            if not p.is_alive():
                what = "the engine process" if self.tp == 1 else f"engine rank {i} of {self.tp}"
                return EngineProcessDied(f"{what} died (exit code {p.exitcode})")
        return None

    def _reply(self, r: int, should_stop: StopCheck | None = None):
        while True:
            try:
                status, value = self.replies[r].get(timeout=REPLY_POLL_S)
                break
            except queue.Empty:
                if should_stop is not None and should_stop():
                    self.stop.set()
                dead = self._dead()  # any rank that died (its peers would wait in their next collective for ever)
                if dead is not None:
                    raise dead from None  # the empty poll is not the cause
        if status == "refused":
            raise EngineRequestRefused(value)
        if status == "reward_failed":
            raise RewardError(*value)
        if status == "cancelled":
            raise RolloutCancelled(value)
        if status != "ok":
            where = "the engine process" if self.tp == 1 else f"engine rank {r} of {self.tp}"
            last = value.strip().splitlines()[-1] if value.strip() else "no traceback"
            raise EngineProcessError(f"{where} failed ({last[:300]}; the traceback is in the log)", value)
        return value

    def _replies(self, should_stop: StopCheck | None = None) -> list:
        """Every rank's answer, rank 0's first; the first failure raises once all have answered. A rank that died is
        the cause of its peers' failures (a collective that lost a member): under TP a failure first waits up to
        PEER_DEATH_S for a death to show, and a death is raised before anything else."""
        values, error = [], None
        for r in range(self.tp):
            try:
                values.append(self._reply(r, should_stop))
            except (EngineProcessError, RewardError, RolloutCancelled) as e:
                error = error or e
        if isinstance(error, EngineProcessError) and not isinstance(error, EngineProcessDied) and self.tp > 1:
            deadline = time.monotonic() + PEER_DEATH_S
            while self._dead() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        if error is None:
            return values
        dead = self._dead()
        if isinstance(error, EngineProcessError) and error.traceback:  # a peer's death's consequence, or the cause
            log.log(logging.DEBUG if dead else logging.ERROR, "%s\n%s", error, error.traceback)
        raise dead or error

    def _call(self, op: str, *payload, others: tuple | None = None,
              should_stop: StopCheck | None = None) -> list:
        """Send `op` to every rank (the other ranks get `others` as the payload, if given) and collect the answers."""
        for r, q in enumerate(self.requests):
            q.put((op, payload if r == 0 or others is None else others))
        return self._replies(should_stop)

    def rollout(self, request: RolloutRequest, should_stop: StopCheck | None = None) -> Rollout:
        """`should_stop`, as `Engine.rollout`'s (asked every 0.2 s while the ranks run): a true answer stops every rank
        at its next denoising step, and RolloutCancelled is raised."""
        stoppable = should_stop is not None
        if should_stop is not None and should_stop():  # asked before the first step too: the ranks then stop before it
            self.stop.set()
        else:
            self.stop.clear()
        # The other ranks run the same forwards; only rank 0 decodes and records.
        return self._call("rollout", request, stoppable, should_stop=should_stop, others=(
            dataclasses.replace(request, decode=False, record_snapshot=False), stoppable))[0]

    def update_weights(self, state: dict[str, torch.Tensor], lora_scale: float | None = None,
                       merge_mode: str | None = None) -> str:
        """Send the weights as buckets of IPC handles; returns the engine's checksum once the update is in place.
        A bad update (names, shapes, values in the engine's dtype) raises EngineRequestRefused, a ValueError,
        and leaves the engine's weights as they were."""
        buckets = self.packer.pack(state)
        for b in buckets:
            if b.buffer.device.type == "cpu":
                b.buffer.share_memory_()
        sums = self._call("update_weights", buckets, lora_scale, merge_mode)  # the buckets live until all answer
        if self.tp == 1:
            return sums[0]
        from ..parallel.engine import lora_shard_checksums

        self.expected = lora_shard_checksums(self.family, state, self.tp, self.dtype)
        self.confirmed = tensors_checksum({k: v.to(self.dtype) for k, v in state.items()})
        return self._confirm(sums)

    def _confirm(self, sums: list[str]) -> str:
        """The LoRA's checksum when every rank holds the slice meant for it; else a line naming the ranks."""
        assert self.expected is not None and self.confirmed is not None  # `_confirm` runs after an update set them
        bad = [r for r in range(self.tp) if sums[r] != self.expected[r]]
        return self.confirmed if not bad else f"tp ranks {bad} hold another LoRA slice"

    def checksum(self) -> str:
        sums = self._call("checksum")
        return sums[0] if self.tp == 1 or self.expected is None else self._confirm(sums)

    def health(self) -> dict:
        return {**self._call("health")[0], "process": self.processes[0].pid,
                "processes": [p.pid for p in self.processes], "tp": self.tp}

    def shutdown(self) -> None:
        """Close every process; where one has died, kill the others at once (a peer of a dead rank may wait in a
        collective, and a lone engine whose client failed has nothing left to finish)."""
        alive = all(p.is_alive() for p in self.processes)
        if alive:
            try:
                self._call("close")
            except EngineProcessError:  # one died meanwhile
                alive = False
        for p in self.processes:
            if alive:
                p.join(timeout=30)
            if p.is_alive():
                p.kill()
            p.join()
        # The LoRA's buffers were shared by IPC: freed now, once their receivers are gone and while CUDA is still up,
        # not in the interpreter's teardown.
        self.packer = BucketPacker(self.bucket_bytes)
