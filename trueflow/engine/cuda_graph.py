"""CUDA-graph capture of the engine transformer's forward, one graph per input shape, with an eager fallback.

A 60-block forward launches thousands of small kernels; at small shapes (512², batch 1) the GPU idles between
them. Replaying a captured graph removes that launch overhead and runs the very same kernels, so its output is
bitwise the eager forward's (the same holds for the diffusers
forward: measured on an H200, a replayed graph of it equals its eager bits).

Design:
- Inputs are named, as the engine model takes them (`hidden_states`, `timestep`, the family's conditioning), plus
  the static token `grid` and any non-tensor input (a video's fps). One graph per key: every tensor input's name,
  shape and dtype (batch, image tokens, text length, mask or not), every other input's value, the grid, the device,
  the model's patch group and whether the Triton kernels are on.
  Ambient settings at capture time (e.g. an `sdpa_kernel` context choosing the attention kernel) are frozen into
  that graph.
- CFG: a guided step calls the same graph twice (positive, then negative branch: the same shapes); each call
  copies its inputs into the graph's static buffers, replays, and returns a copy of the output, so the two
  branches' outputs never alias. Two separate forwards are also what parity
  requires (a concatenated two-branch batch runs other GEMM shapes). All graphs of one `GraphedForward` share
  one memory pool: they never run at once.
- Eager fallback: when disabled, off CUDA, with autograd on, or when a floating input of 3 or more dims (the
  latents, a text stream) is not contiguous (a GEMM on a strided input may run another kernel than on the static
  buffer's copy). Timesteps (`[B]`, `[B, S]`) and masks are only read elementwise, so any layout is fine (the
  engine passes `timesteps[i].expand(B)`).
- Weights: a graph reads every tensor by the address it had at capture. Parameters updated in place stay valid
  (`load_weights` and the merged LoRA update copy into the parameters), and so do unmerged LoRA adapters updated
  with the same shapes and scale (`Linear.set_lora` copies into them). A first install, another rank or scale, a
  cleared LoRA or a change of merge mode installs *new* tensors or changes which tensors the forward reads; so
  before each replay the layers' LoRA state (`LoraState`) is checked against what the graphs were captured with,
  and any change drops every graph (each is re-captured on its next call): a stale graph can never replay.
  Not covered: replacing parameter tensors themselves (`module.weight = ...`, `.to()`, `load_state_dict(assign=
  True)`); call `reset()` after such a change.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar, cast

import torch
from torch import nn

from .. import kernels
from ..layers.linear import Linear

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

T = TypeVar("T")
_MERGED, _NO_LORA = object(), object()


class LoraState:
    """What captured graphs baked in of the model's LoRA, per Linear: merged (the adapters are folded into the
    weight, which updates copy in place: any merged LoRA is fine), no LoRA, or the list of unmerged adapters it
    held.

    `Linear.set_lora`/`clear_lora` assign a new adapter list whenever they install new tensors (an in-place update
    keeps the list and its tensors), so a list compared by identity tells whether a layer's unmerged adapters
    were replaced. The lists are held strongly, so a freed list's id can never be reused by a
    new one; the cost is that a replaced LoRA stays allocated until the next forward drops the stale graphs. The
    check is one pass over ~600 layers at full size (about 0.1 ms on a slow CPU) per forward."""

    def __init__(self, model: nn.Module):
        self.layers = [m.__dict__ for m in model.modules() if isinstance(m, Linear)]  # direct: no Module.__getattr__
        self.state = self._read()

    def _read(self) -> list:
        return [_MERGED if d["base_weight"] is not None else a if any(a := d["adapters"]) else _NO_LORA
                for d in self.layers]

    def matches(self) -> bool:
        """Whether every layer still holds the LoRA state recorded at construction."""
        return all(map(operator.is_, self._read(), self.state))


def capture(fn: Callable[[], T], pool=None, warmup: int = 1) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run `fn` `warmup` times on a side stream (lazy inits, Triton JIT, cuBLAS handles, cached RoPE tables happen
    there, not in the graph), then capture one call; returns the graph and that call's (static) output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = fn()
    return graph, output


Inputs = dict[str, "torch.Tensor | float | None"]  # the forward's keyword inputs besides the grid


class _Graph:
    """One captured forward: static inputs, the graph, its static output."""

    def __init__(self, model: nn.Module, inputs: Inputs, grid: tuple[int, ...], pool, warmup: int):
        # Tensors get static buffers; other inputs (None, a float) are part of the graph's key and passed as they are.
        self.inputs = {k: t.contiguous().clone() if isinstance(t, torch.Tensor) else t for k, t in inputs.items()}
        self.graph, self.output = capture(lambda: model(grid=grid, **self.inputs), pool, warmup)

    def __call__(self, inputs: Inputs) -> torch.Tensor:
        for name, t in inputs.items():
            if isinstance(t, torch.Tensor):
                static = self.inputs[name]
                assert isinstance(static, torch.Tensor)  # a tensor input's static buffer
                static.copy_(t)
        self.graph.replay()
        return self.output.clone()


class GraphedForward:
    """The engine transformer's forward through CUDA graphs, called as the model is:
    `forward(hidden_states=..., timestep=..., grid=..., **cond)`.

    `enabled=False` (or a CPU model) always runs eagerly. `warmup` eager forwards precede each capture.
    Counters: `captures` (graphs captured so far), `invalidations` (times a LoRA change dropped the graphs).
    """

    def __init__(self, model: nn.Module, enabled: bool = True, warmup: int = 1):
        self.model, self.enabled, self.warmup = model, enabled, warmup
        self.graphs: dict[tuple, _Graph] = {}
        self.lora_state: LoraState | None = None
        self.pool: _POOL_HANDLE | None = None
        self.captures = self.invalidations = 0

    def reset(self) -> None:
        """Drop every graph and its memory pool; the next call of each shape re-captures."""
        self.graphs.clear()
        self.lora_state = self.pool = None

    def _key(self, inputs: Inputs, grid: tuple[int, ...]) -> tuple:
        return (tuple((k, (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t)
                      for k, t in sorted(inputs.items())),
                tuple(grid), cast(torch.Tensor, inputs["hidden_states"]).device,  # always a tensor
                tuple(getattr(self.model, "patches_applied", ())),
                kernels.ENABLED)

    def _graphable(self, inputs: Inputs) -> bool:
        tensors = [t for t in inputs.values() if isinstance(t, torch.Tensor)]
        return (self.enabled and not torch.is_grad_enabled() and all(t.is_cuda for t in tensors)
                and all(t.is_contiguous() for t in tensors if t.is_floating_point() and t.dim() >= 3))

    def _replay(self, inputs: Inputs, grid: tuple[int, ...]) -> torch.Tensor:
        if self.lora_state is not None and not self.lora_state.matches():
            self.reset()
            self.invalidations += 1
        if not self.graphs:
            self.lora_state = LoraState(self.model)
        key = self._key(inputs, grid)
        graph = self.graphs.get(key)
        if graph is None:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = self.graphs[key] = _Graph(self.model, inputs, grid, self.pool, self.warmup)
            self.captures += 1
        return graph(inputs)

    def __call__(self, *, grid: tuple[int, ...], **inputs: torch.Tensor | float | None) -> torch.Tensor:
        if not self._graphable(inputs):
            return self.model(grid=grid, **inputs)
        return self._replay(inputs, grid)
