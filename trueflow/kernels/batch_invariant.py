"""Batch-invariant kernels: what one sample's forward computes does not depend on the other samples of its batch, on
the batch size, on its position in the batch or on padding (the batch-invariant parity mode, docs/patch-group.md).

Two kinds of op carry the batch shape into the bits of a bf16 forward (DESIGN §3; measured on this repo's CPUs and
an H200): GEMMs, whose library picks its blocking (and on GPUs a split of the reduction) by the shape, so a row of
an M=4 GEMM differs from the same row alone; and attention, whose kernel blocks the keys by the padded length and
reads a padding mask. Norms, softmax and elementwise ops already compute each row alone on the CPU (tested); on
CUDA the last-dim mean and vector norm get per-row kernels too.

- GEMMs (`aten::mm`, `aten::addmm`, `aten::bmm`, and `aten::linear`'s layout choice: `_linear`) are overridden
  process-wide with `torch.library` while the mode is
  on (`enable`), beneath autograd, so diffusers + PEFT (the train side) and the engine's `Linear` run them without a
  line changed and autograd differentiates them as it does the stock ops (its backward GEMMs go through the same
  kernels: correct, not required to be batch-invariant). On the CPU the stock kernel (oneDNN/MKL, fetched with
  `torch.library.get_kernel` before the override) runs on fixed tiles of `M_TILE` rows, the last one zero-padded,
  in one operand layout: every call the library sees has the same shape whatever M is, and a row's bits do not
  depend on its position in the tile or on the other rows (measured: tests/test_batch_invariant.py). On CUDA a
  Triton kernel with one tile config per (N, K) and no split-K (`triton_batch_invariant.py`).
- `attention`: each sample against its own valid keys only (the mask's), the queries in fixed tiles of `Q_TILE`
  rows (CPU: PyTorch's flash kernel per tile; CUDA: one varlen Triton launch), so a padded row of a mixed-length
  batch gets the bits of its unpadded sequence run alone. The engine registers it in its attention registry
  (`layers/attention.py`, kernel `batch_invariant`), the train side as a diffusers backend
  (`train/batch_invariant.py`).

The mode is off by default: nothing is registered until `enable()`, and `disable()` puts the stock kernels back.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import HAS_TRITON

BACKEND = "trueflow_batch_invariant"  # the train side's diffusers attention backend (`train/batch_invariant.py`)
KERNEL = "batch_invariant"  # the engine's attention kernel (`layers/attention.py`)
M_TILE = 128  # rows per GEMM call on the CPU (a cost trade: more pads small GEMMs, fewer re-packs W more often)
Q_TILE = 64  # query rows per attention call on the CPU
MASKED_AT = -1e3  # an additive mask entry at or below this masks its key (diffusers' LTX-2 bias is -10000)
GEMM_OPS = ("mm", "addmm", "bmm")
CUDA_REDUCTION_OPS = ("mean.dim", "linalg_vector_norm")

_lock = threading.Lock()
_lib: torch.library.Library | None = None
_stock: dict[tuple[str, str], Any] = {}  # (op, dispatch key) -> the stock kernel, fetched before the override


def enabled() -> bool:
    return _lib is not None


def enable() -> None:
    """Route this process's GEMMs (and on CUDA its last-dim reductions) through the batch-invariant kernels, until
    `disable()`. Idempotent. Refused in one line on CUDA without triton."""
    global _lib
    with _lock:
        if _lib is not None:
            return
        cuda = torch.cuda.is_available()
        if cuda and not HAS_TRITON:
            raise ValueError("the batch-invariant mode on CUDA needs triton (pip install trueflow[kernels])")
        lib = torch.library.Library("aten", "IMPL")
        impls = [(op, "CPU", _CPU_GEMMS[op]) for op in GEMM_OPS]
        if cuda:
            impls += [(op, "CUDA", _CUDA_IMPLS[op]) for op in (*GEMM_OPS, *CUDA_REDUCTION_OPS)]
        with warnings.catch_warnings():  # "Overriding a previously registered kernel": that is the point
            warnings.simplefilter("ignore")
            for op, key, fn in impls:
                _stock[op, key] = torch.library.get_kernel(f"aten::{op}", key)
                lib.impl(op, fn, key, with_keyset=True)
            lib.impl("linear", _linear, "CompositeImplicitAutograd")  # above autograd: it decomposes as the stock one
        _lib = lib


def disable() -> None:
    """Put the stock kernels back."""
    global _lib
    with _lock:
        if _lib is not None:
            _lib._destroy()
            _lib = None
            _stock.clear()


@contextlib.contextmanager
def mode() -> Iterator[None]:
    """The mode for the block (and left as it was found after it)."""
    was = enabled()
    enable()
    try:
        yield
    finally:
        if not was:
            disable()


# -- F.linear, on every device ---------------------------------------------------------------------------------------
def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` with one path for every input layout. The stock decomposition (aten/src/ATen/native/Linear.cpp)
    adds a bias in the GEMM's epilogue (`addmm`, one rounding) for a 2-D input or a contiguous one, but as a second
    op after `matmul` (two roundings) for a strided input of 3 or more dims. A slice of a joint `[B, S+L, D]`
    output, which diffusers' SD3 processor (`JointAttnProcessor2_0`) hands `to_out` and `to_add_out`, is
    contiguous at batch 1 and strided above it, so a row's bits would follow the batch size. The mode takes the
    epilogue path for every input, copying a strided one to rows first (the 2-D and contiguous cases are the stock
    calls). Runs on every device (CompositeImplicitAutograd)."""
    if bias is None or x.dim() < 2:
        return torch.matmul(x, weight.t()) if bias is None else torch.matmul(x, weight.t()) + bias
    out = torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight.t())
    return out.view(*x.shape[:-1], weight.shape[0])


# -- GEMMs on the CPU: the stock kernel on fixed row tiles -----------------------------------------------------------
def _canonical(b: torch.Tensor) -> torch.Tensor:
    """The right operand [K, N] as the library is always handed it: row-major or column-major as it comes (F.linear
    hands `W.t()` of a contiguous weight, column-major, on both sides), anything else copied row-major."""
    if b.is_contiguous() or b.t().is_contiguous():
        return b
    return b.contiguous()


def _tiled(stock: Any, keyset: Any, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
           **scalars: Any) -> torch.Tensor:
    """`a @ b` (+ `bias`) [M, N] by the stock kernel on tiles of M_TILE rows of `a`, each copied into one zeroed
    contiguous [M_TILE, K] buffer. A bias with M rows is tiled with them; a row bias is passed whole."""
    M, K = a.shape
    b = _canonical(b)
    row_bias = bias is not None and bias.dim() == 2 and bias.shape[0] == M and M > 1
    out = a.new_empty(M, b.shape[1])
    for i in range(0, M, M_TILE):
        rows = min(M_TILE, M - i)
        tile = a.new_zeros(M_TILE, K)
        tile[:rows] = a[i:i + rows]
        if bias is None:
            y = stock.call_boxed(keyset, tile, b)
        else:
            t_bias = bias
            if row_bias:
                t_bias = bias.new_zeros(M_TILE, bias.shape[1])
                t_bias[:rows] = bias[i:i + rows]
            y = stock.call_boxed(keyset, t_bias, tile, b, **scalars)
        out[i:i + rows] = y[:rows]
    return out


def _floating(*tensors: torch.Tensor) -> bool:
    return all(t.is_floating_point() and not t.is_complex() for t in tensors)


def _mm_cpu(keyset, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    stock = _stock["mm", "CPU"]
    if not _floating(a, b) or a.numel() == 0 or b.numel() == 0:
        return stock.call_boxed(keyset, a, b)
    return _tiled(stock, keyset, a, b)


def _addmm_cpu(keyset, bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    stock = _stock["addmm", "CPU"]
    if not _floating(bias, a, b) or a.numel() == 0 or b.numel() == 0:
        return stock.call_boxed(keyset, bias, a, b, beta=beta, alpha=alpha)
    return _tiled(stock, keyset, a, b, bias, beta=beta, alpha=alpha)


def _bmm_cpu(keyset, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Each matrix of the batch as its own tiled GEMM: the library's bmm blocks by the batch count too."""
    if not _floating(a, b) or a.numel() == 0 or b.numel() == 0:
        return _stock["bmm", "CPU"].call_boxed(keyset, a, b)
    stock = _stock["mm", "CPU"]
    return torch.stack([_tiled(stock, keyset, a[i], b[i]) for i in range(a.shape[0])])


_CPU_GEMMS = {"mm": _mm_cpu, "addmm": _addmm_cpu, "bmm": _bmm_cpu}


# -- CUDA: Triton kernels --------------------------------------------------------------------------------------------
def _triton() -> Any:
    from . import triton_batch_invariant

    return triton_batch_invariant


_TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _mm_cuda(keyset, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype not in _TRITON_DTYPES or a.dtype != b.dtype:
        return _stock["mm", "CUDA"].call_boxed(keyset, a, b)
    return _triton().matmul(a, b)


def _addmm_cuda(keyset, bias, a, b, *, beta=1, alpha=1) -> torch.Tensor:
    if a.dtype not in _TRITON_DTYPES or a.dtype != b.dtype or bias.dim() > 1 and bias.shape[0] != 1:
        return _stock["addmm", "CUDA"].call_boxed(keyset, bias, a, b, beta=beta, alpha=alpha)
    row = bias.reshape(-1).expand(b.shape[1]).contiguous()  # the kernel reads the bias row with stride 1
    return _triton().matmul(a, b, row, beta=float(beta), alpha=float(alpha))


def _bmm_cuda(keyset, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype not in _TRITON_DTYPES or a.dtype != b.dtype:
        return _stock["bmm", "CUDA"].call_boxed(keyset, a, b)
    return torch.stack([_triton().matmul(a[i], b[i]) for i in range(a.shape[0])])


def _last_dim(x: torch.Tensor, dim: Any) -> bool:
    dims = [dim] if isinstance(dim, int) else list(dim or [])
    return len(dims) == 1 and dims[0] % x.dim() == x.dim() - 1 and x.dim() >= 1


def _mean_cuda(keyset, x: torch.Tensor, dim=None, keepdim: bool = False, *, dtype=None) -> torch.Tensor:
    """The mean over the last dim, one program per row (CUDA's reduction splits a row over blocks when rows are
    few); any other mean is the stock one."""
    if dtype is not None or x.dtype not in _TRITON_DTYPES or not _last_dim(x, dim):
        return _stock["mean.dim", "CUDA"].call_boxed(keyset, x, dim, keepdim, dtype=dtype)
    return _triton().row_reduce(x, "mean", keepdim)


def _vector_norm_cuda(keyset, x: torch.Tensor, ord=2, dim=None, keepdim: bool = False, *, dtype=None):
    if ord != 2 or dtype is not None or x.dtype not in _TRITON_DTYPES or not _last_dim(x, dim):
        return _stock["linalg_vector_norm", "CUDA"].call_boxed(keyset, x, ord, dim, keepdim, dtype=dtype)
    return _triton().row_reduce(x, "norm", keepdim)


_CUDA_IMPLS = {"mm": _mm_cuda, "addmm": _addmm_cuda, "bmm": _bmm_cuda, "mean.dim": _mean_cuda,
               "linalg_vector_norm": _vector_norm_cuda}


# -- attention -------------------------------------------------------------------------------------------------------
def key_validity(mask: torch.Tensor | None, batch: int, keys: int) -> torch.Tensor | None:
    """The [B, L] bool key validity a mask encodes, or None (every key valid). Taken: a bool key mask (True =
    attend) [B, L] or broadcastable [B, 1|H, 1|S, L] that is the same for every head and query; an additive mask of
    the same shapes whose entries are 0 (attend) or at most MASKED_AT (diffusers' `(1 - m)·-10000`, or -inf). Any
    other mask (per query, a real bias) is refused: the mode runs no kernel that reads one."""
    if mask is None:
        return None
    if mask.dim() == 2:
        mask = mask[:, None, None, :]
    if mask.dim() != 4 or mask.shape[-1] != keys or mask.shape[0] not in (1, batch):
        raise ValueError(f"the batch-invariant attention takes a key mask [B, L] or [B, 1, 1, L]; got "
                         f"{tuple(mask.shape)} for {batch} samples of {keys} keys")
    # The checks read values back (a host sync), which a CUDA graph capture cannot: it records the call as it is.
    check = not (mask.is_cuda and torch.cuda.is_current_stream_capturing())
    if mask.dtype == torch.bool:
        valid = mask
    else:
        valid = mask == 0
        if check and not bool((valid | (mask <= MASKED_AT)).all()):
            raise ValueError("the batch-invariant attention takes an additive mask of 0 (attend) and "
                             f"<= {MASKED_AT:g} (masked) only, not a general attention bias")
    flat = valid.expand(batch, *valid.shape[1:]).flatten(1, 2)  # [B, H·S, L]
    if check and not bool((flat == flat[:, :1]).all()):
        raise ValueError("the batch-invariant attention takes a key mask that is the same for every head and query")
    return flat[:, 0]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
              scale: float | None = None) -> torch.Tensor:
    """Softmax attention q [B, S, H, D], k/v [B, L, H, D] -> [B, S, H, D], each sample against its own valid keys
    (`key_validity(mask)`) in their order, every query row computed without regard to the others: so a sample's
    rows are the bits of that sample alone, unpadded, at any batch size or position. A padded query row gets a
    finite value nothing reads (its key is masked wherever it could be read). Differentiable (autograd through
    the per-tile SDPA calls on the CPU; a recomputing backward on CUDA)."""
    B, S, H, D = q.shape
    valid = key_validity(mask, B, k.shape[1])
    if q.is_cuda:
        return _triton().attention(q, k, v, valid, scale)
    outs = []
    for b in range(B):
        kb, vb = (t[b] if valid is None else t[b][valid[b]] for t in (k, v))
        kb, vb = (t.permute(1, 0, 2)[None].contiguous() for t in (kb, vb))  # [1, H, L_b, D]
        rows = []
        for i in range(0, S, Q_TILE):
            qt = q[b, i:i + Q_TILE]
            n = qt.shape[0]
            qt = F.pad(qt, (0, 0, 0, 0, 0, Q_TILE - n)).permute(1, 0, 2)[None].contiguous()  # [1, H, Q_TILE, D]
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                o = F.scaled_dot_product_attention(qt, kb, vb, scale=scale)
            rows.append(o[0, :, :n].permute(1, 0, 2))
        outs.append(torch.cat(rows))
    return torch.stack(outs)
