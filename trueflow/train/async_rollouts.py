"""`--async-rollouts N`: the engine rolls out ahead of training, each rollout with the weights of a known version,
and the trainer corrects for the version it trains at with the decoupled PPO objective (`rl.decoupled`).

W_k denotes the weights after k optimizer steps (one per rollout: `--num-steps-per-rollout 1`). Rollout j is made
with W_v(j), v(j) = max(0, j − N), and trained on at W_j, so its staleness, j − v(j) = min(j, N), is bounded by N.
For N = 1 (one step off):

    engine:   rollout 0 (W_0) | rollout 1 (W_0)       | sync W_1, rollout 2 (W_1) | sync W_2, rollout 3 (W_2) | ...
    trainer:  (waits)         | train on 0: W_0 → W_1 | train on 1: W_1 → W_2    | train on 2: W_2 → W_3     | ...

A thread of the trainer's process drives the engine (in another process, server or Ray actor, so the engine's
compute and the trainer's overlap; the thread mostly waits). It takes jobs in order — install the version's LoRA
(the engine answers with its checksum), then roll out — so a sync never falls inside a running rollout. The main
thread submits the job of rollout j + N as soon as rollout j has arrived, before training on it. Every collective
(the LoRA's full state, the rewards, the checksums) stays on the main thread, in the same order on every rank.

Exactness: the masters of every version still in flight are kept (one LoRA copy each, N + 1 at most), so the
trainer re-scores each rollout at the very weights that made it (`parity_monitor`'s swapped forward) and logs the
train/rollout mismatch — behaviour log-prob and model output — at every step: 0.0 under the parity conditions, as
in a synchronous run. A checkpoint holds the kept versions of the rollouts in flight (in `optimizer.pt`), so a
resumed run redoes each of them with the weights the killed run used.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..engine.interface import RolloutCancelled
from ..rewards.base import RewardError
from ..rl.decoupled import truncated_is_weight
from ..sync.checksum import tensors_checksum
from .dist import all_gather_object, all_reduce
from .policy import full_state, set_lora_state

if TYPE_CHECKING:
    from .trainer import Trainer

CHECKPOINT_KEY = "async_rollouts"  # in a checkpoint's optimizer.pt: {"versions": {version: LoRA masters, fp32}}
CLOSE_TIMEOUT_S = 60.0  # how long closing waits for the thread (a stopped rollout ends at its next denoising step)


@dataclass
class Behaviour:
    """What made a rollout: the weight version (optimizer steps done) the engine held, its staleness when trained on
    (versions behind the trainer), the masters of that version (None: the trainer's current weights), the sync that
    installed it (trainer's and engine's checksums, time) and how long the trainer waited for the rollout."""

    version: int
    staleness: int
    kept: dict[str, torch.Tensor] | None
    sync: dict
    wait: float

    def record(self) -> dict:
        return {"staleness": self.staleness, "behaviour_version": self.version, "time_wait": self.wait}


class ImportanceWeights:
    """An optimizer step's truncated behaviour importance weights `min(ρ̄, π/μ)` (π: the policy before the step, μ:
    the engine's), over its micro-batches and ranks: their mean, the fraction the cap truncated, and the fraction
    the plain ratio π/μ already lies outside PPO's clip range (what a clip against μ would have cut, not the step)."""

    def __init__(self, cap: float, clip_range: float):
        self.cap, self.clip_range = cap, clip_range
        self.sums = {"weight_sum": 0.0, "truncated": 0.0, "outside_clip": 0.0, "rows": 0.0}

    def add(self, log_prob: torch.Tensor, behaviour_log_prob: torch.Tensor) -> None:
        w = truncated_is_weight(log_prob, behaviour_log_prob, self.cap)
        ratio = torch.exp(log_prob.detach().float() - behaviour_log_prob.float())
        self.sums["weight_sum"] += w.sum().item()
        self.sums["truncated"] += (ratio > self.cap).sum().item()
        self.sums["outside_clip"] += ((ratio - 1).abs() > self.clip_range).sum().item()
        self.sums["rows"] += w.numel()

    def reduce(self) -> dict:
        """Over every rank (a collective)."""
        s = all_reduce(self.sums, dist.ReduceOp.SUM)
        rows = max(s["rows"], 1)
        return {"is_weight_mean": s["weight_sum"] / rows, "is_truncated_frac": s["truncated"] / rows,
                "behaviour_clip_frac": s["outside_clip"] / rows}


def _clone(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of the masters, sharded as they are."""
    return {n: p.detach().clone() for n, p in params.items()}


class AsyncRollouts:
    """The rollouts in flight of a Trainer, N ahead; `next(j)` gives rollout j (gathered over ranks) and its
    Behaviour. Use `start()` before the first `next`, `done(j)` after training on rollout j, `close()` at the end."""

    def __init__(self, trainer: Trainer, saved: dict | None = None):
        """`saved`: a checkpoint's CHECKPOINT_KEY entry (a resumed run), None on a fresh start."""
        self.t, self.n = trainer, trainer.cfg.async_rollouts
        params = trainer.named_params
        if saved is None:
            self.versions = {trainer.state.step: _clone(params)}
        else:
            self.versions = {}
            for v, full in saved["versions"].items():
                self.versions[int(v)] = _clone(params)
                set_lora_state(self.versions[int(v)], full)
        first = trainer.state.rollout
        missing = sorted({self.version_of(j) for j in range(first, first + self.n)} - set(self.versions))
        if missing:
            raise ValueError(f"--resume: the checkpoint holds no weights of version(s) {missing}, which made the "
                             f"rollouts in flight; resume with the run's --async-rollouts, or start a new --output-dir")
        self.jobs: queue.Queue = queue.Queue()
        self.outcomes: dict[int, tuple | BaseException] = {}  # rollout index -> what the thread made of its job
        self.in_flight: set[int] = set()
        self.cv = threading.Condition()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._work, name="trueflow-async-rollouts", daemon=True)

    def version_of(self, index: int) -> int:
        """The weight version (optimizer steps done) that makes rollout `index`."""
        return max(0, index - self.n)

    # -- the main thread -------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()
        first = self.t.state.rollout
        for j in range(first, min(first + self.n, self.t.cfg.num_rollouts)):
            self._submit(j)

    def _submit(self, index: int) -> None:
        """Queue rollout `index` with its version's compute copies (a collective under FSDP2: every rank, in order)."""
        state = full_state(self.versions[self.version_of(index)], self.t.dtype)
        request = self.t._request(index)
        with self.cv:
            self.in_flight.add(index)
        self.jobs.put((index, state, request))

    def next(self, index: int):
        """(rollout, rewards, dropped, times, Behaviour) of rollout `index`, as `Trainer._rollout` gives them; then
        the job of rollout `index + N` is queued with the current weights, the version it is made with."""
        t0 = time.perf_counter()
        with self.cv:
            self.cv.wait_for(lambda: index in self.outcomes)
            outcome = self.outcomes.pop(index)
            self.in_flight.discard(index)
        wait = time.perf_counter() - t0
        if isinstance(outcome, BaseException):
            raise outcome
        rollout, failure, engine_sum, trainer_sum, took = outcome
        rollout, rewards, dropped, times = self.t._gathered(index, rollout, failure)
        sums = all_gather_object(engine_sum)
        sync = {"trainer_checksum": trainer_sum, "engine_checksum": sums[0],
                "checksums_equal": all(s == trainer_sum for s in sums),
                **all_reduce({"time_sync": took}, dist.ReduceOp.MAX)}
        step = self.t.state.step
        self.versions[step] = _clone(self.t.named_params)  # W_index: the version of rollout index + N
        if index + self.n < self.t.cfg.num_rollouts:
            self._submit(index + self.n)
        v = self.version_of(index)
        behaviour = Behaviour(v, step - v, self.versions[v] if v != step else None, sync, wait)
        return rollout, rewards, dropped, times, behaviour

    def done(self, index: int) -> None:
        """Rollout `index` is trained on: the versions no rollout from `index + 1` on needs are dropped."""
        for v in [v for v in self.versions if v < self.version_of(index + 1)]:
            del self.versions[v]

    def checkpoint_state(self) -> dict:
        """The kept versions, unsharded fp32 masters (a collective): what a resumed run rolls out again with."""
        versions = {v: {n: t.cpu() for n, t in full_state(m).items()} for v, m in sorted(self.versions.items())}
        return {CHECKPOINT_KEY: {"versions": versions}}

    @contextmanager
    def idle(self):
        """The engine free for the caller (every queued job done; their outcomes wait for `next`)."""
        with self.cv:
            self.cv.wait_for(lambda: self.in_flight <= set(self.outcomes))
        yield

    def close(self) -> None:
        """Stop the rollout in flight (at its next denoising step) and end the thread."""
        self.stop.set()
        self.jobs.put(None)
        if self.thread.is_alive():
            self.thread.join(CLOSE_TIMEOUT_S)

    # -- the thread ----------------------------------------------------------------------------------------------
    def _work(self) -> None:
        engine, spec, mode = self.t.engine, self.t.lora_spec, self.t.cfg.lora_merge_mode
        while (job := self.jobs.get()) is not None:
            index, state, request = job
            try:
                if self.stop.is_set():
                    raise RolloutCancelled("stopped before it started: the run is ending")
                t0 = time.perf_counter()
                engine_sum = engine.update_weights(state, spec.scale, mode)
                trainer_sum = tensors_checksum(state)
                took = time.perf_counter() - t0
                rollout = failure = None
                try:
                    rollout = engine.rollout(request, self.stop.is_set)
                except RewardError as e:  # every rank stops on it, once the main thread has gathered the failures
                    failure = (e.reward, e.prompts, e.reason)
                outcome: tuple | BaseException = (rollout, failure, engine_sum, trainer_sum, took)
            except BaseException as e:  # noqa: BLE001 - raised on the main thread, by `next`
                outcome = e
            with self.cv:
                self.outcomes[index] = outcome
                self.cv.notify_all()
