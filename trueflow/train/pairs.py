"""Train pairs — (sample, denoising step) — split across data-parallel ranks and tiled into micro-batches.

Nothing is shuffled (parity condition 8, docs/patch-group.md): samples keep the rollout's prompt-major order, and
with the aligned settings (contiguous split, micro_batch_size_sample == rollout_microgroup_size,
micro_batch_size_tstep == 1) a micro-batch is exactly one rollout microgroup at one step, the batch the engine ran.
"""

from __future__ import annotations

from dataclasses import dataclass

SPLIT_MODES = ("contiguous", "stride")


@dataclass(frozen=True)
class Row:
    """One train pair: global sample index and the index of its SDE step among the trained steps (its slot)."""

    sample: int
    slot: int


def rank_samples(microgroup_sizes: list[int], world: int, rank: int, mode: str) -> list[int]:
    """Global sample indices this rank trains on. `contiguous` gives each rank whole microgroups (a block of
    them); `stride` deals samples round-robin, which mixes prompts across ranks and micro-batches."""
    if mode not in SPLIT_MODES:
        raise ValueError(f"unknown DP split mode {mode!r}; choose one of {', '.join(SPLIT_MODES)}")
    n = sum(microgroup_sizes)
    if mode == "stride":
        if n % world:
            raise ValueError(f"{n} samples cannot be dealt evenly to {world} ranks")
        return list(range(rank, n, world))
    if len(microgroup_sizes) % world:
        raise ValueError(f"{len(microgroup_sizes)} microgroups cannot be split contiguously over {world} ranks; "
                         "make rollout_batch_size * n_samples_per_prompt / rollout_microgroup_size a multiple "
                         "of the number of ranks")
    per_rank = len(microgroup_sizes) // world
    start = sum(microgroup_sizes[: rank * per_rank])
    return list(range(start, start + sum(microgroup_sizes[rank * per_rank:(rank + 1) * per_rank])))


def micro_batches(samples: list[int], num_slots: int, mbs_sample: int, mbs_tstep: int) -> list[list[Row]]:
    """Tile (samples × SDE-step slots) into micro-batches of `mbs_sample` samples × `mbs_tstep` slots,
    slot-major, keeping sample order within each."""
    out = []
    for s0 in range(0, len(samples), mbs_sample):
        chunk = samples[s0:s0 + mbs_sample]
        for t0 in range(0, num_slots, mbs_tstep):
            out.append([Row(s, slot) for slot in range(t0, min(t0 + mbs_tstep, num_slots)) for s in chunk])
    return out
