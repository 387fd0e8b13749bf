"""The engine's one worker thread: engine calls run one at a time, in arrival order, each with its deadline, and a
waiting request stops its call when its client leaves. In the batch-invariant mode (a `batcher` given) rollouts run
beside each other instead, up to `max_merged` at once, each on a thread of its own, and their forwards merge
(`engine.batcher`): a request arriving while others run joins them at their next step; any other call (a weight
update, a checksum) waits until every running rollout has finished, and the rollouts after it wait for it."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

from fastapi import Request

from ..engine.batcher import ForwardBatcher
from ..engine.interface import RolloutCancelled
from .errors import RequestError

_T = TypeVar("_T")
STUCK_GRACE_S = 30.0  # past its timeout, a running call has this long (or its timeout, if shorter) to stop
POLL_S = 0.2  # how often a waiting request looks for its client's disconnect


class Job(Generic[_T]):
    """One engine call: `fn(should_stop)`, its deadline, and why it was stopped (None: it was not)."""

    def __init__(self, fn: Callable[[Callable[[], bool]], _T], deadline: float | None, merge: bool = False):
        self.fn, self.deadline, self.merge = fn, deadline, merge
        self.future: Future[_T] = Future()
        self.started: float | None = None
        self.stop_reason: str | None = None

    def stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason

    def should_stop(self) -> bool:
        if self.stop_reason is None and self.deadline is not None and time.monotonic() > self.deadline:
            self.stop_reason = "timeout"
        return self.stop_reason is not None


class Worker:
    """Runs engine calls one at a time, in arrival order, on one daemon thread: a call stuck in the engine
    cannot keep the process from exiting."""

    def __init__(self, batcher: ForwardBatcher | None = None, max_merged: int = 8) -> None:
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.jobs: list[Job] = []  # waiting or running, in arrival order
        self.active: list[Job] = []  # running, oldest first
        self.batcher, self.max_merged = batcher, max_merged
        self._merged: list[threading.Thread] = []  # the running merged rollouts' threads
        self.closed = False
        self.thread = threading.Thread(target=self._loop, daemon=True, name="engine")
        self.thread.start()

    @property
    def running(self) -> Job | None:
        """The oldest running call (None: idle)."""
        return self.active[0] if self.active else None

    @property
    def depth(self) -> int:
        """Engine calls waiting or running."""
        return len(self.jobs)

    def submit(self, fn: Callable[[Callable[[], bool]], _T], deadline: float | None = None,
               max_waiting: int | None = None, merge: bool = False) -> Job[_T]:
        """Queue `fn`; with `max_waiting`, refuse it (503) when that many calls already wait. `merge`: a rollout,
        which the batch-invariant mode runs beside others."""
        with self._lock:
            if self.closed:
                raise RequestError("the server is shutting down", 503, code="shutting_down")
            waiting = sum(j.started is None for j in self.jobs)
            if max_waiting is not None and waiting >= max_waiting:
                raise RequestError(f"the server is busy: {waiting} requests already wait for the engine, the most it "
                                   f"queues (--max-queue); retry later", 503, code="queue_full")
            job = Job(fn, deadline, merge)
            self.jobs.append(job)
        self._queue.put(job)
        return job

    def close(self) -> None:
        """Take no more work and stop every queued or running call at its next step. Takes no lock: it runs in
        a signal handler, which may interrupt `submit` on the same thread."""
        self.closed = True
        for job in list(self.jobs):
            job.stop("shutdown")

    def join(self) -> None:
        """End the thread once the queue is drained (after `close`)."""
        self._queue.put(None)

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            if job.merge and self.batcher is not None:
                self._merged = [t for t in self._merged if t.is_alive()]
                if len(self._merged) >= self.max_merged:
                    self._merged.pop(0).join()
                thread = threading.Thread(target=self._run_merged, args=(job,), daemon=True, name="engine-merged")
                self._merged.append(thread)
                thread.start()
            else:
                self._drain()
                self._run(job)
        self._drain()

    def _drain(self) -> None:
        """Wait for every running merged rollout."""
        for thread in self._merged:
            thread.join()
        self._merged = []

    def _run_merged(self, job: Job) -> None:
        assert self.batcher is not None
        with self.batcher.participant():
            self._run(job)

    def _run(self, job: Job) -> None:
        error: BaseException | None
        result, error = None, None
        if job.should_stop():
            error = RolloutCancelled("stopped before it started")
        else:
            job.started = time.monotonic()
            with self._lock:
                self.active.append(job)
            try:
                result = job.fn(job.should_stop)
            except BaseException as e:  # noqa: BLE001 - handed to the request that waits for it
                error = e
            with self._lock:
                self.active.remove(job)
        with self._lock:  # off the list before the answer: a client that got its answer sees the call gone
            self.jobs.remove(job)
        if error is None:
            job.future.set_result(result)
        else:
            job.future.set_exception(error)

    async def wait(self, job: Job[_T], request: Request | None, timeout: float | None = None) -> _T:
        """The call's result; stops it when `request`'s client disconnects (or this waiting task is cancelled)."""
        future = asyncio.wrap_future(job.future)
        try:
            while not future.done():
                await asyncio.wait({future}, timeout=POLL_S)
                if not future.done() and request is not None and await request.is_disconnected():
                    job.stop("disconnected")
        except asyncio.CancelledError:  # uvicorn gave up waiting for this request at shutdown
            job.stop("shutdown")
            raise
        try:
            return future.result()
        except RolloutCancelled as e:
            raise stopped(job, timeout) from e
        except ValueError as e:  # the engine's contract: a ValueError is the caller's bad input, nothing applied
            raise RequestError(str(e)) from e


def stopped(job: Job, timeout: float | None) -> RequestError:
    when = "while it ran" if job.started is not None else "before it started"
    if job.stop_reason == "timeout":
        return RequestError(f"the request ran past this server's per-request timeout of {timeout:g} s "
                            f"(--request-timeout) and was stopped {when}", 504, code="timeout")
    if job.stop_reason == "disconnected":  # nobody reads this answer
        return RequestError(f"the client disconnected; the request was stopped {when}", 499, code="cancelled")
    return RequestError(f"the server is shutting down; the request was stopped {when}", 503, code="shutting_down")
