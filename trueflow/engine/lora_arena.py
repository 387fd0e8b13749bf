"""The engine's unmerged LoRA held in flat buffers laid out as the sender's buckets (`sync.buckets`).

A weight sync of rank 64 on Qwen-Image's 720 targets is 1,440 tensors. Handled tensor by tensor (one reduction
each to validate, one copy each to install, one more to checksum) it is launch-bound: thousands of small kernels
for 0.85 GB. After the first install from buckets the engine keeps its adapters as views into an arena with the
buckets' layout; an update of the same layout (the trainer's every sync) is then validated off the incoming
buffers with a few kernels per bucket, installed with one copy per bucket, and checksummed off the arena's
buffers (`sync.checksum.buckets_checksum`, one fused pass). The adapters' addresses never change, so captured
CUDA graphs stay valid.

The fast check only approves: it computes each tensor's largest |value| (NaN counted as inf) and from them the
same tests as `weight_map.set_lora` (finite in the engine's dtype, scale·B finite, the merged-weight bound). Any
doubt sends the update down the general path, which names every problem and installs nothing.
"""

from __future__ import annotations

import numbers

import torch

from ..layers.linear import Linear, LoraAdapter
from ..models.weight_map import MERGE_MARGIN
from ..sync.buckets import Bucket, aligned, pack, tensor_bytes, unpack
from ..sync.checksum import buckets_checksum, packed_in_order, tensors_checksum
from ..models import lora
from ..models.spec import EngineModel

Layout = list[tuple[int, list[tuple[str, torch.dtype, tuple[int, ...], int]]]]


def layout(buckets: list[Bucket]) -> Layout:
    """What a same-layout update must repeat: each bucket's size and manifest (names, dtypes, shapes, offsets)."""
    return [(b.buffer.numel(), b.manifest) for b in buckets]


class LoraArena:
    """Flat buffers holding the installed adapters, and what the fast check needs of the layers they feed."""

    def __init__(self, model: EngineModel, buckets: list[Bucket], scale: float):
        slots = lora.lora_slots(model)
        self.layout, self.scale = layout(buckets), float(scale)  # as `weight_map.set_lora` stores it
        device = next(model.parameters()).device
        self.buffers = [b.buffer.to(device, copy=True) for b in buckets]
        self.buckets = [Bucket(buf, b.manifest) for buf, b in zip(self.buffers, buckets)]
        views = unpack(self.buckets)
        order = {name: i for i, name in enumerate(views)}  # the manifests' order: the fast check's maxima
        held: dict[Linear, list[LoraAdapter | None]] = {}
        a_idx, b_idx, ranks, base, self.dtypes = [], [], [], [], set()
        for prefix, layer, slot in slots:
            a, b = f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"
            held.setdefault(layer, [None] * len(layer.splits))[slot] = LoraAdapter(views[a], views[b], self.scale)
            a_idx.append(order[a])
            b_idx.append(order[b])
            ranks.append(views[a].shape[0])
            base.append(layer.slot_weight(slot))
            self.dtypes.add(layer.dtype)
        for layer, adapters in held.items():
            layer.hold_lora(adapters)
        self.held = [(layer, layer.adapters, layer.weights_version) for layer in held]
        self.a_idx, self.b_idx = torch.tensor(a_idx), torch.tensor(b_idx)
        self.ranks = torch.tensor(ranks, dtype=torch.float64)
        # The base rows' largest |value|, fixed while the base weights are (checked by version in `accepts`).
        self.base_max = torch.stack([w.abs().amax() for w in base]).double().cpu()
        self.lengths = [torch.tensor([aligned_elems(shape, dtype) for _, dtype, shape, _ in b.manifest],
                                     device=buf.device) for buf, b in zip(self.buffers, buckets)]

    @staticmethod
    def adoptable(model: EngineModel, buckets: list[Bucket]) -> bool:
        """Whether the LoRA just installed from `buckets` can move into an arena of their layout: each bucket one
        dtype, the engine's, tensors packed in name order, and exactly the installed adapters' names."""
        names = [n for b in buckets for n, _, _, _ in b.manifest]
        slots = lora.lora_slots(model)
        installed = sorted(f"{p}.lora_{ab}.weight" for p, _, _ in slots for ab in "AB")
        dtypes = {layer.dtype for _, layer, _ in slots}
        return (bool(names) and names == installed and len(dtypes) == 1
                and not any(layer.merged for _, layer, _ in slots)
                and all(packed_in_order(b) and {d for _, d, _, _ in b.manifest} == dtypes for b in buckets))

    def holds(self) -> bool:
        """Whether the layers still hold this arena's adapters (no other install, clear or merge since)."""
        return all(layer.adapters is adapters and not layer.merged for layer, adapters, _ in self.held)

    def accepts(self, buckets: list[Bucket], scale: float) -> bool:
        """Whether an update can take the fast path: same layout and scale, the arena still installed, and the
        base weights unchanged since their ranges were taken."""
        return (isinstance(scale, numbers.Real) and not isinstance(scale, bool) and float(scale) == self.scale
                and self.holds() and layout(buckets) == self.layout
                and all(layer.weights_version == v for layer, _, v in self.held))

    @torch.no_grad()
    def approves(self, buckets: list[Bucket]) -> bool:
        """True if every test of `weight_map.set_lora` passes for these values (False: let it name the problem)."""
        maxima = []
        for b, lengths in zip(buckets, self.lengths):
            (dtype,) = {d for _, d, _, _ in b.manifest}
            x = b.buffer.view(dtype).abs()
            # NaN as inf, so that a NaN fails the finiteness test whatever the reduction does with NaN.
            x = torch.nan_to_num(x, nan=float("inf"), posinf=float("inf"))
            # The update may sit on another device than the arena (CPU tensors sent to a GPU engine).
            maxima.append(torch.segment_reduce(x, "max", lengths=lengths.to(x.device), unsafe=True))
        m = torch.cat([t.double().cpu() for t in maxima])  # one transfer per bucket
        (dtype,) = self.dtypes
        a_max, b_max = m[self.a_idx], m[self.b_idx]
        s = abs(float(self.scale))
        limit = torch.finfo(dtype).max
        return bool(torch.isfinite(m).all() and torch.isfinite((s * b_max).to(dtype)).all()
                    and (self.base_max + s * self.ranks * a_max * b_max <= limit * MERGE_MARGIN).all())

    @torch.no_grad()
    def install(self, buckets: list[Bucket]) -> None:
        for dst, b in zip(self.buffers, buckets):
            dst.copy_(b.buffer)

    def checksum(self) -> str:
        return buckets_checksum(self.buckets)


def aligned_elems(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Elements a tensor takes in a bucket, its zero padding included (zeros leave a largest |value| unchanged)."""
    return aligned(tensor_bytes(shape, dtype)) // dtype.itemsize


def update_lora_packed(model: EngineModel, buckets: list[Bucket], scale: float, merge_mode: str | None = None) -> None:
    """`lora.update_lora` from buckets: the fast path where the model's arena accepts and approves the update;
    else the general path (which refuses a bad update naming every problem, installing nothing), after which an
    unmerged LoRA moves into a new arena of the buckets' layout where it can."""
    arena: LoraArena | None = getattr(model, "lora_arena", None)
    unmerged = merge_mode == "unmerged" or (merge_mode is None and not model.lora_merge)
    if unmerged and arena is not None and arena.accepts(buckets, scale) and arena.approves(buckets):
        arena.install(buckets)
        return
    model.lora_arena = None
    lora.update_lora(model, unpack(buckets), scale, merge_mode)
    if LoraArena.adoptable(model, buckets):
        model.lora_arena = LoraArena(model, buckets, scale)


def lora_checksum(model: EngineModel) -> str:
    """The installed LoRA's checksum, read off the arena's buffers while the layers hold its views."""
    arena: LoraArena | None = getattr(model, "lora_arena", None)
    if arena is not None and arena.holds():
        return arena.checksum()
    return tensors_checksum(lora.lora_state(model))


def as_buckets(state: dict[str, torch.Tensor]) -> list[Bucket] | None:
    """The tensors packed (one concatenation per bucket) where they are all floating-point tensors on one device;
    None otherwise (the general path then names what is wrong with them)."""
    values = list(state.values())
    if not values or not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in values) \
            or len({t.device for t in values}) != 1:
        return None
    return pack(state)
