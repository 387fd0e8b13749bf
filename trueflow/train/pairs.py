"""Train pairs — (sample, denoising step) — of one rank's rollout, ordered and tiled into micro-batches.

Each data-parallel rank rolls out its own share of the prompts (whole prompt groups, contiguous) and trains on it,
so no sample crosses ranks. Nothing is shuffled (parity condition 8, docs/patch-group.md): samples keep the
rollout's prompt-major order, and with the aligned settings (contiguous order, micro_batch_size_sample ==
rollout_microgroup_size, micro_batch_size_tstep == 1) a micro-batch is exactly one rollout microgroup at one step,
the batch the engine ran.
"""

from __future__ import annotations

from dataclasses import dataclass

SPLIT_MODES = ("contiguous", "stride")


@dataclass(frozen=True)
class Row:
    """One train pair: global sample index and the index of its SDE step among the trained steps (its slot)."""

    sample: int
    slot: int


def train_order(microgroup_sizes: list[int], mode: str) -> list[int]:
    """The rank's rollout samples in the order they are tiled into micro-batches. `contiguous` keeps the rollout's
    order (whole microgroups); `stride` takes the first sample of every microgroup, then the second, ..., which
    mixes prompts in one micro-batch (parity condition 4 broken on purpose)."""
    if mode not in SPLIT_MODES:
        raise ValueError(f"unknown split mode {mode!r}; choose one of {', '.join(SPLIT_MODES)}")
    starts = [sum(microgroup_sizes[:m]) for m in range(len(microgroup_sizes))]
    if mode == "contiguous":
        return list(range(sum(microgroup_sizes)))
    return [start + k for k in range(max(microgroup_sizes)) for start, size in zip(starts, microgroup_sizes)
            if k < size]


def micro_batches(samples: list[int], num_slots: int, mbs_sample: int, mbs_tstep: int) -> list[list[Row]]:
    """Tile (samples × SDE-step slots) into micro-batches of `mbs_sample` samples × `mbs_tstep` slots,
    slot-major, keeping sample order within each."""
    out = []
    for s0 in range(0, len(samples), mbs_sample):
        chunk = samples[s0:s0 + mbs_sample]
        for t0 in range(0, num_slots, mbs_tstep):
            out.append([Row(s, slot) for slot in range(t0, min(t0 + mbs_tstep, num_slots)) for s in chunk])
    return out
