"""One forward for several rollouts at once: the rollouts run on threads of their own, and each round of their forward
calls is merged into one batch (the batch-invariant mode only, where a sample's output does not depend on the batch
it runs in: so each rollout's outputs, trajectories and images are the bits it gets alone).

A rollout joins with `participant()` for its whole run. A call waits until every participant has made its call of
the round (or left), then the last one to arrive runs the merged forward for all of them and hands each caller its
rows. Between forwards the participants take turns (one holds the turn at a time and gives it up while it waits for
a round): every op of a rollout, its text encoder and VAE included, runs with the process's whole intra-op thread
pool as it does alone (on a CPU the thread count changes bf16 bits: parity condition 9), and no CUDA graph is
captured while another thread launches kernels. Calls that cannot share a batch (another expert: a family of several
switches transformer by step, and two rollouts may be at steps of different experts; another token grid, other
static inputs or conditioning keys) run as one forward per kind in the same round. Each call's conditioning is cut
into samples and collated again with the others' (`collate.sample_cond`, `collate.collate_cond`): prompts of other
lengths pad batch-locally with a text mask, which the mode's attention reads. A rollout that leaves (done,
cancelled, failed) no longer holds the others up.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..collate import collate_cond, sample_cond

_TENSOR_KEYS = ("hidden_states", "timestep")


class _Call:
    def __init__(self, expert: int, kwargs: dict[str, Any]):
        self.expert, self.kwargs = expert, kwargs
        self.out: torch.Tensor | None = None
        self.error: BaseException | None = None
        self.done = False


class ForwardBatcher:
    """`__call__(k, **inputs)` is expert k's forward (keyword inputs as the model takes them); `solo[k]` runs a call
    alone (no other rollout is in), `merged[k]` runs a merged batch. `streams`: the family's text streams
    (`PipelineSide.text_streams`)."""

    def __init__(self, solo: Sequence[Callable[..., torch.Tensor]], merged: Sequence[Callable[..., torch.Tensor]],
                 streams: Mapping[str, str]):
        self.solo, self.merged, self.streams = solo, merged, streams
        self._cv = threading.Condition()
        self._turn = threading.Lock()  # held by the one participant running its own ops (lock order: turn, then cv)
        self._members = 0
        self._pending: list[_Call] = []
        self.merged_forwards = 0  # merged forwards run (each of several rollouts' calls)

    @property
    def members(self) -> int:
        """The rollouts in now (running, or waiting for their turn)."""
        return self._members

    @contextlib.contextmanager
    def participant(self) -> Iterator[None]:
        with self._cv:
            self._members += 1
        self._turn.acquire()
        try:
            yield
        finally:
            with self._cv:
                self._members -= 1
                if self._pending and len(self._pending) >= self._members:
                    self._run_round()
            self._turn.release()

    def __call__(self, expert: int, **kwargs: Any) -> torch.Tensor:
        """Expert `expert`'s forward of one participant's call (a caller outside any participant runs alone)."""
        waited = False
        with self._cv:
            alone = self._members <= 1 and not self._pending
            if not alone:
                call = _Call(expert, kwargs)
                self._pending.append(call)
                if len(self._pending) >= self._members:
                    self._run_round()  # the last to arrive runs the round, holding the turn
                else:
                    self._turn.release()  # the others run their own ops meanwhile
                    waited = True
                    while not call.done:
                        self._cv.wait()
        if alone:
            return self.solo[expert](**kwargs)
        if waited:
            self._turn.acquire()
        if call.error is not None:
            raise call.error
        assert call.out is not None  # the round set it (or the error)
        return call.out

    # -- one round (under the lock) ---------------------------------------------------------------------------------
    def _run_round(self) -> None:
        calls, self._pending = self._pending, []
        kinds: dict[tuple, list[_Call]] = {}
        for c in calls:
            kinds.setdefault((c.expert, _kind(c.kwargs)), []).append(c)
        for group in kinds.values():
            try:
                outs = self._forward(group)
            except BaseException as e:  # noqa: BLE001 - every caller of the batch gets it
                for c in group:
                    c.error = e
            else:
                for c, out in zip(group, outs):
                    c.out = out
            for c in group:
                c.done = True
        self._cv.notify_all()

    def _forward(self, group: list[_Call]) -> list[torch.Tensor]:
        k = group[0].expert
        if len(group) == 1:
            return [self.solo[k](**group[0].kwargs)]
        first = group[0].kwargs
        conds = [{k: v for k, v in c.kwargs.items() if k not in _TENSOR_KEYS and k in _cond_keys(first)}
                 for c in group]
        rest = {k: v for k, v in first.items() if k not in _TENSOR_KEYS and k not in _cond_keys(first)}
        sizes = [c.kwargs["hidden_states"].shape[0] for c in group]
        cond = collate_cond([sample_cond(c, i, self.streams) for c, n in zip(conds, sizes) for i in range(n)],
                            self.streams)
        out = self.merged[k](hidden_states=torch.cat([c.kwargs["hidden_states"] for c in group]),
                             timestep=torch.cat([c.kwargs["timestep"] for c in group]), **rest, **cond)
        self.merged_forwards += 1
        return list(out.split(sizes))


def _cond_keys(kwargs: dict[str, Any]) -> set[str]:
    """The conditioning entries of a call: its batched tensors (and None masks) besides the latents and timestep."""
    return {k for k, v in kwargs.items() if k not in _TENSOR_KEYS and (v is None or isinstance(v, torch.Tensor))}


def _kind(kwargs: dict[str, Any]) -> tuple:
    """What calls must share to run in one batch: every non-tensor input (grid, fps, ...), the conditioning keys, and
    each tensor's dtype and shape past the batch dim (text streams excepted: they pad)."""
    static = tuple(sorted((k, repr(v)) for k, v in kwargs.items() if k not in _cond_keys(kwargs)
                          and k not in _TENSOR_KEYS))
    x, t = kwargs["hidden_states"], kwargs["timestep"]
    return static, tuple(sorted(_cond_keys(kwargs))), x.dtype, tuple(x.shape[1:]), t.dtype, tuple(t.shape[1:])
