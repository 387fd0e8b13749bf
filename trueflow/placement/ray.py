"""The Ray placements: engine (and reward) actors of a `trueflow train --ray` run, and the clients that put an
engine actor behind the one engine interface.

A trainer rank (`trueflow.ray.actors.TrainerActor`, run by the driver `trueflow.ray.launch`) asks the placement
factory for its engine; `ray_engine` finds this rank's `EngineActor` of the same placement group by name:

- colocated (`--world-size N`): engine `engine-r` shares trainer rank r's bundle (its device); LoRA updates cross
  as weight buckets of IPC handles (`engine.wire.dump_handles`: the trainer's shared-memory segments on CPU,
  `sync.shm`; CUDA IPC on GPU), and the engine answers with the checksum of what it installed.
- disaggregated (`--rollout-gpus R --train-gpus T`): R engines on bundles of their own. Trainer rank r rolls out on
  engine r·R//T (an engine serves T/R ranks' shares, one request after another). Trainer rank 0 broadcasts each
  update in buckets over a process group of its own with the R engines (gloo on CPU, NCCL on GPU; not the
  trainers' group); every engine answers with its checksum. The other ranks confirm that their engine holds the
  LoRA they hold (by its checksum) before they roll out again.

With `--reward-placement actor` a `RewardActor` beside each rank scores its rollouts (`ActorScored`). A dead
actor, found dead or dying during a call, raises `ActorDied` naming it. A rollout's `should_stop` is asked while the
actor works; a true answer tells the actor (whose `stop` runs in a concurrency group of its own, beside the rollout)
to stop that rollout at its next denoising step.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import ray
import torch

from ..engine.interface import EngineWrapper, RolloutEngine, RolloutRequest, StopCheck
from ..net import free_port, tcp_store
from ..sync.buckets import DEFAULT_BUCKET_BYTES, Bucket, BucketPacker
from ..sync.checksum import tensors_checksum
from ..sync.shm import SharedSegments
from .spec import EngineSpec, Placement, RewardSpec

if TYPE_CHECKING:
    from ..engine.trajectory import Rollout

CONFIRM_TIMEOUT_S = 600.0  # how long a rank waits for rank 0's broadcast to reach its engine
STOP_POLL_S = 0.2  # how often a waiting rollout asks its `should_stop`


def trainer_name(rank: int) -> str:
    return f"trainer-{rank}"


def engine_name(index: int) -> str:
    return f"engine-{index}"


def reward_name(rank: int) -> str:
    return f"reward-{rank}"


def engine_of_rank(rank: int, trainers: int, engines: int) -> int:
    """The engine a disaggregated trainer rank rolls out on: contiguous blocks of ranks per engine."""
    return rank * engines // trainers


class ActorDied(RuntimeError):
    """An actor of the run died; the message names it."""


def death_reason(e: BaseException) -> str:
    """Where and why an actor died, from Ray's error: "pid 123 on 127.0.0.1: it was killed by `ray.kill`"."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    fields = dict(line.split(": ", 1) for line in lines if line.startswith(("pid: ", "ip: ")))
    why = next((line.removeprefix("The actor is dead because ").rstrip(".") for line in lines
                if line.startswith("The actor is dead because ")), lines[0] if lines else type(e).__name__)
    where = f"pid {fields['pid']} on {fields['ip']}: " if fields.keys() == {"pid", "ip"} else ""
    return (where + why)[:300]


def weights_group(host: str, port: int, rank: int, size: int, backend: str, own_host: str):
    """The process group of a disaggregated run's weight broadcast: trainer rank 0 (rank 0, its TCP store's
    host) and the engines, beside (not inside) the trainers' default group."""
    import torch.distributed as dist

    store = tcp_store(host, port, rank, size)  # rank 0's bound to `host` alone
    prefixed = dist.PrefixStore("trueflow-weights/", store)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(prefixed, rank, size, dist.ProcessGroupNCCL.Options())
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, absent from torch's stubs
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=own_host)]
    options._timeout = timedelta(minutes=30)
    return dist.ProcessGroupGloo(prefixed, rank, size, options)


# Engine calls run one at a time in arrival order (the default group, as a plain actor runs them); `stop` runs in a
# group of its own, beside a rollout, so that a caller can stop its rollout between denoising steps.
@ray.remote(concurrency_groups={"control": 1})  # type: ignore[call-overload]  # a valid option ray's overloads omit
class EngineActor:
    """An `engine.engine.Engine` in an actor of its own, loaded by the first trainer rank that connects."""

    def __init__(self):
        self.engine, self.spec, self.group = None, None, None
        self._stops: dict[str, threading.Event] = {}  # stop token -> its rollout's event (callers may share an actor)

    def load(self, spec: EngineSpec, cwd: str) -> dict:
        """Load the engine (a second call with the same spec does nothing); `cwd`: the driver's, against which the
        run's relative paths are meant. On CPU it runs the spec's thread count (the trainer's: parity condition 9)."""
        if self.engine is None:
            from .local import build_local

            os.chdir(cwd)
            torch.set_num_threads(spec.threads or torch.get_num_threads())
            self.engine, self.spec = build_local(spec), spec
        elif self.spec != spec:
            raise ValueError(f"{ray.get_runtime_context().get_actor_name()} already runs {self.spec}, not {spec}")
        return self.health()

    def rollout(self, request: RolloutRequest, stop_token: str | None = None) -> Rollout:
        """`stop_token`: `stop(stop_token)` stops this rollout at its next denoising step (RolloutCancelled)."""
        from .process import to_cpu

        if stop_token is None:
            return to_cpu(self.engine.rollout(request))
        event = self._stops.setdefault(stop_token, threading.Event())
        try:
            return to_cpu(self.engine.rollout(request, event.is_set))
        finally:
            self._stops.pop(stop_token, None)

    @ray.method(concurrency_group="control")
    def stop(self, stop_token: str) -> None:
        """Stop the rollout of `stop_token`, running or not yet started."""
        self._stops.setdefault(stop_token, threading.Event()).set()

    def update_ipc(self, payload: bytes) -> str:
        """An update sent as IPC handles (colocated): copied out of the sender's buffers, which it frees once it
        has this answer."""
        from ..engine.wire import load_handles

        buckets, fields = load_handles(payload)  # the engine copies out of the buffers, never keeps them
        return self.engine.update_weights(buckets, fields["lora_scale"], fields["merge_mode"])

    def join_weights_group(self, host: str, port: int, rank: int, size: int, backend: str) -> None:
        self.group = weights_group(host, port, rank, size, backend, ray.util.get_node_ip_address())

    def receive(self, layout: list[tuple[list, int]], lora_scale: float | None, merge_mode: str | None) -> str:
        """An update broadcast by trainer rank 0, bucket by bucket (`layout`: each bucket's manifest and size)."""
        buckets = []
        for manifest, nbytes in layout:
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.engine.device)
            self.group.broadcast(buffer, 0).wait()
            buckets.append(Bucket(buffer, manifest))
        return self.engine.update_weights(buckets, lora_scale, merge_mode)

    def checksum(self) -> str:
        return self.engine.checksum()

    def health(self) -> dict:
        return {**self.engine.health(), "threads": torch.get_num_threads(),
                "actor": ray.get_runtime_context().get_actor_name(), "node": ray.util.get_node_ip_address()}


@ray.remote
class RewardActor:
    """A trainer rank's reward (`--reward-placement actor`), on a share of the rank's device: it scores a rollout's
    images as every placement scores them (`rewards.base.score_samples`: video frames, on_error included)."""

    def load(self, reward: RewardSpec, cwd: str) -> None:
        from ..rewards.base import build_reward

        os.chdir(cwd)
        self.spec = reward
        self.reward = build_reward(reward.spec, reward.model, reward.device, url=reward.url)

    def score(self, images: torch.Tensor, prompts: list[str]) -> tuple[torch.Tensor, list[int], float]:
        """(rewards, dropped samples, seconds) of the images, one prompt each."""
        from ..rewards.base import score_samples

        t0 = time.perf_counter()
        rewards, dropped = score_samples(self.reward, images, prompts, self.spec.on_error, self.spec.frames)
        return rewards, dropped, time.perf_counter() - t0


class ActorScored(EngineWrapper):
    """An engine whose rollouts a reward actor scores (the `ScoredEngine` of `--reward-placement actor`). A dead
    reward actor raises `ActorDied` naming it, whatever `on_error` says; the reward's own failure arrives as the
    `RewardError` it is."""

    def __init__(self, engine: RolloutEngine, actor, name: str):
        super().__init__(engine)
        self.actor, self.name = actor, name

    def rollout(self, request: RolloutRequest, should_stop: StopCheck | None = None) -> Rollout:
        rollout = self.engine.rollout(request, should_stop)
        rollout.rewards, rollout.dropped, rollout.times["reward"] = answer(
            self.actor.score.remote(rollout.images, request.sample_prompts()), self.name, "reward")
        return rollout

    def health(self) -> dict:
        return {**self.engine.health(), "reward": self.name}


def answer(ref, name: str, kind: str = "engine"):
    """`ray.get(ref)` of a call to the actor `name` (an engine or reward actor): its death raises `ActorDied`
    naming it, an error the actor raised is raised as itself."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError as e:
        raise ActorDied(f"the Ray {kind} actor {name} died ({death_reason(e)})") from None
    except ray.exceptions.RayTaskError as e:
        raise e.cause if isinstance(e.cause, Exception) else e from None


class RayEngine:
    """The engine interface (`engine.interface.RolloutEngine`) over an `EngineActor`: every call is
    `ray.get(actor.method.remote(...))`. A dead actor raises `ActorDied` naming it; a request the engine refused
    raises the engine's own error (a bad update: ValueError, nothing applied)."""

    def __init__(self, actor, name: str, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.actor, self.name, self.bucket_bytes = actor, name, bucket_bytes
        self.segments = SharedSegments()  # where the LoRA's CPU buffers live (unlinked at shutdown, or by the driver)
        self.packer = BucketPacker(bucket_bytes, self.segments.allocate)  # the LoRA's buffers, refilled every sync

    def _get(self, ref):
        return answer(ref, self.name)

    def rollout(self, request: RolloutRequest, should_stop: StopCheck | None = None) -> Rollout:
        token = uuid.uuid4().hex if should_stop is not None else None
        ref = self.actor.rollout.remote(request, token)
        if should_stop is not None:  # asked now, then every STOP_POLL_S while the actor works
            while not should_stop():
                if ray.wait([ref], timeout=STOP_POLL_S)[0]:
                    break
            else:
                self.actor.stop.remote(token)  # the rollout raises RolloutCancelled at its next step
        return self._get(ref)

    def update_weights(self, state: dict[str, torch.Tensor], lora_scale: float | None = None,
                       merge_mode: str | None = None) -> str:
        from ..engine.wire import dump_handles

        buckets = self.packer.pack(state)
        payload = dump_handles(buckets, self.segments, lora_scale=lora_scale, merge_mode=merge_mode)
        return self._get(self.actor.update_ipc.remote(payload))  # `buckets` lives until the engine answered

    def checksum(self) -> str:
        return self._get(self.actor.checksum.remote())

    def health(self) -> dict:
        return self._get(self.actor.health.remote())

    def shutdown(self) -> None:
        """The driver ends the actors with the run; the update buffers are unlinked here."""
        self.packer = BucketPacker(self.bucket_bytes, self.segments.allocate)
        self.segments.close()


class BroadcastEngine(RayEngine):
    """A disaggregated rank's engine. On trainer rank 0 (`group` set) an update is broadcast to every engine, and
    its answer is their common checksum (or, when they differ, a line naming the engine that differs, so the run's
    `checksums_equal` is false); on another rank an update waits until this rank's engine holds it."""

    def __init__(self, actor, name: str, engines: list[tuple[str, Any]] | None = None, group=None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        super().__init__(actor, name, bucket_bytes)
        self.engines, self.group = engines, group

    def update_weights(self, state: dict[str, torch.Tensor], lora_scale: float | None = None,
                       merge_mode: str | None = None) -> str:
        if self.group is None:
            return self._confirm(state, lora_scale)
        assert self.engines is not None  # trainer rank 0 (`group` set) knows every engine
        buckets = self.packer.pack(state)
        layout = [(b.manifest, b.buffer.numel()) for b in buckets]
        refs = [(name, actor.receive.remote(layout, lora_scale, merge_mode)) for name, actor in self.engines]
        for b in buckets:
            work = self.group.broadcast(b.buffer, 0)
            # A collective may not notice a dead peer (it waits out its timeout), or fail without naming it: the
            # engines' answers say which died (a dead engine's arrives at once, as ActorDied naming it).
            while not work.is_completed():
                _raise_if_dead(refs, 0.01)
            try:
                work.wait()
            except RuntimeError:
                _raise_if_dead(refs, 10.0)
                raise
        sums = [(name, answer(ref, name)) for name, ref in refs]
        differ = [f"{name} holds {s}" for name, s in sums if s != sums[0][1]]
        return sums[0][1] if not differ else f"engines disagree: {sums[0][0]} holds {sums[0][1]}, {', '.join(differ)}"

    def _confirm(self, state: dict[str, torch.Tensor], lora_scale: float | None) -> str:
        if lora_scale is None:
            raise ValueError("full weights are broadcast by trainer rank 0 alone")
        want, deadline = tensors_checksum(state), time.monotonic() + CONFIRM_TIMEOUT_S
        while (got := self.checksum()) != want and time.monotonic() < deadline:
            time.sleep(0.02)
        return got


def _raise_if_dead(refs: list[tuple[str, object]], timeout: float) -> None:
    """Raise ActorDied for an engine among `refs` (name, pending call) that died within `timeout` seconds."""
    done, _ = ray.wait([ref for _, ref in refs], num_returns=1, timeout=timeout)
    for name, ref in refs:
        if ref in done:
            answer(ref, name)


def _find(name: str, kind: str):
    """The live actor `name` of this job (the driver placed it)."""
    try:
        return ray.get_actor(name)
    except ValueError:
        raise ActorDied(f"the Ray {kind} actor {name} is not alive (it died, or the run did not start with "
                        "`trueflow train --ray`)") from None


def ray_engine(spec: EngineSpec, placement: Placement) -> RolloutEngine:
    """The `ray_colocated` / `ray_disaggregated` placements: this trainer rank's engine actor, loaded with `spec`
    (its device's type: Ray gives each actor its own GPU); on disaggregated rank 0 every engine, joined to the weight
    broadcast group. With `placement.reward_at == "actor"`, behind this rank's reward actor, loaded with the reward."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    trainers, engines = placement.ray_trainers, placement.ray_engines
    if world != trainers:
        raise ValueError(f"this Ray run places {trainers} trainer ranks, but the process group has {world}")
    if (placement.kind == "ray_disaggregated") != (engines > 0):
        raise ValueError(f"the {placement.kind} placement takes {'no' if engines == 0 else 'some'} engine actors "
                         f"of their own, got {engines}")
    spec = dataclasses.replace(spec, device=torch.device(spec.device).type,
                               threads=spec.threads or torch.get_num_threads())
    bucket_bytes = placement.bucket_bytes or DEFAULT_BUCKET_BYTES
    engine = _connect(spec, rank, trainers, engines, bucket_bytes)
    if placement.reward_at != "actor":
        return engine
    name = reward_name(rank)
    actor = _find(name, "reward")
    assert placement.reward is not None  # reward_at="actor" takes a reward (`Placement`)
    reward = dataclasses.replace(placement.reward, device=torch.device(placement.reward.device).type)
    answer(actor.load.remote(reward, os.getcwd()), name, "reward")
    return ActorScored(engine, actor, name)


def _connect(spec: EngineSpec, rank: int, trainers: int, engines: int, bucket_bytes: int) -> RolloutEngine:
    def actor(index: int):
        return _find(engine_name(index), "engine")

    load = (spec, os.getcwd())
    if not engines:  # colocated
        client = RayEngine(actor(rank), engine_name(rank), bucket_bytes)
        client._get(client.actor.load.remote(*load))
        return client
    mine = engine_of_rank(rank, trainers, engines)
    if rank:
        client = BroadcastEngine(actor(mine), engine_name(mine), bucket_bytes=bucket_bytes)
        client._get(client.actor.load.remote(*load))
        return client
    named = [(engine_name(i), actor(i)) for i in range(engines)]
    for name, ref in [(name, a.load.remote(*load)) for name, a in named]:  # loaded before the first broadcast
        answer(ref, name)
    host, port = ray.util.get_node_ip_address(), free_port()
    backend = "nccl" if torch.device(spec.device).type == "cuda" else "gloo"
    joins = [(name, a.join_weights_group.remote(host, port, i + 1, engines + 1, backend))
             for i, (name, a) in enumerate(named)]
    group = weights_group(host, port, 0, engines + 1, backend, host)
    for name, ref in joins:
        answer(ref, name)
    return BroadcastEngine(named[mine][1], engine_name(mine), named, group, bucket_bytes)
