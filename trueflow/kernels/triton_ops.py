"""Triton kernels for the engine's elementwise/normalisation paths, in two families.

Fast (`layer_norm_scale_shift` ... `qk_norm_rope`): each kernel computes in fp32 and rounds each output once to the
input dtype, with the semantics of the PyTorch fallback it replaces (`layers/*._fused`).

Eager-exact (`*_eager_bf16`, used by the `qwen_image` patch group on CUDA): each kernel replays a chain of eager bf16
PyTorch ops bit for bit. An eager elementwise op computes in fp32 and stores bf16, so the kernel computes each op in
fp32 and rounds to bf16 after each one, in the same order (`_bf16`). Reductions (LayerNorm, the RMS variance) stay
PyTorch's own calls, whose order nobody here reproduces; the kernels take over the elementwise ops around them.

All are memory-bound: one program per row (per token for qk-norm), the row held in registers, so every input is
read once and every output written once.

Self-contained (imports only torch and triton): the tests load this file afresh under `TRITON_INTERPRET=1`, which
triton reads when `@triton.jit` runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _num_warps(block: int) -> int:
    # ~512 elements per warp keeps 16-byte loads and few registers per thread.
    return max(1, min(16, block // 512))


def _last_dim_unit(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


# -- LayerNorm + scale/shift -------------------------------------------------------------------------------------
@triton.jit
def _ln_modulate(x, cols, mask, D, eps, scale_ptr, shift_ptr):
    """LN(x)·(1+scale)+shift of one fp32 row held in registers (padding lanes are 0 and stay masked)."""
    mean = tl.sum(x, 0) / D
    xc = tl.where(mask, x - mean, 0.0)
    rstd = tl.math.rsqrt(tl.sum(xc * xc, 0) / D + eps)
    scale = tl.load(scale_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    shift = tl.load(shift_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return xc * rstd * (1.0 + scale) + shift


@triton.jit
def _layer_norm_scale_shift_kernel(x_ptr, shift_ptr, scale_ptr, out_ptr, S, D, x_sb, x_ss, shift_sb, scale_sb, eps,
                                   BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b, s = row // S, row % S
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + b * x_sb + s * x_ss + cols, mask=mask, other=0.0).to(tl.float32)
    y = _ln_modulate(x, cols, mask, D, eps, scale_ptr + b * scale_sb, shift_ptr + b * shift_sb)
    tl.store(out_ptr + row * D + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def layer_norm_scale_shift(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """x [B, S, D]; shift, scale [B, D] (row-strided views such as `chunk` results are fine)."""
    x, shift, scale = _last_dim_unit(x), _last_dim_unit(shift), _last_dim_unit(scale)
    B, S, D = x.shape
    out = torch.empty((B, S, D), dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(D)
    _layer_norm_scale_shift_kernel[(B * S,)](x, shift, scale, out, S, D, x.stride(0), x.stride(1), shift.stride(0),
                                             scale.stride(0), eps, BLOCK_D=block, num_warps=_num_warps(block))
    return out


# -- gated residual + LayerNorm + scale/shift ----------------------------------------------------------------------
@triton.jit
def _scale_residual_ln_kernel(res_ptr, y_ptr, gate_ptr, shift_ptr, scale_ptr, r_out_ptr, out_ptr, S, D,
                              res_sb, res_ss, y_sb, y_ss, gate_sb, shift_sb, scale_sb, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b, s = row // S, row % S
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    res = tl.load(res_ptr + b * res_sb + s * res_ss + cols, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + b * y_sb + s * y_ss + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + b * gate_sb + cols, mask=mask, other=0.0).to(tl.float32)
    r = res + gate * y
    tl.store(r_out_ptr + row * D + cols, r.to(r_out_ptr.dtype.element_ty), mask=mask)
    # The norm reads the unrounded fp32 residual, as the PyTorch fallback does.
    out = _ln_modulate(r, cols, mask, D, eps, scale_ptr + b * scale_sb, shift_ptr + b * shift_sb)
    tl.store(out_ptr + row * D + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def scale_residual_layer_norm_scale_shift(residual: torch.Tensor, y: torch.Tensor, gate: torch.Tensor,
                                          shift: torch.Tensor, scale: torch.Tensor,
                                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """r = residual + gate·y; returns (r, LN(r)·(1+scale)+shift). residual, y [B, S, D]; gate, shift, scale [B, D]."""
    residual, y = _last_dim_unit(residual), _last_dim_unit(y)
    gate, shift, scale = _last_dim_unit(gate), _last_dim_unit(shift), _last_dim_unit(scale)
    B, S, D = residual.shape
    r = torch.empty((B, S, D), dtype=residual.dtype, device=residual.device)
    out = torch.empty_like(r)
    block = triton.next_power_of_2(D)
    _scale_residual_ln_kernel[(B * S,)](residual, y, gate, shift, scale, r, out, S, D, residual.stride(0),
                                        residual.stride(1), y.stride(0), y.stride(1), gate.stride(0), shift.stride(0),
                                        scale.stride(0), eps, BLOCK_D=block, num_warps=_num_warps(block))
    return r, out


# -- mul-add --------------------------------------------------------------------------------------------------------
@triton.jit
def _mul_add_kernel(a_ptr, b_ptr, c_ptr, out_ptr, S, D, a_sb, a_ss, b_sb, c_sb, c_ss, k, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    bi, s = row // S, row % S
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    a = tl.load(a_ptr + bi * a_sb + s * a_ss + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + bi * b_sb + cols, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + bi * c_sb + s * c_ss + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + cols, (c + a * (k + b)).to(out_ptr.dtype.element_ty), mask=mask)


def mul_add(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, k: float) -> torch.Tensor:
    """c + a·(k+b); a, c [B, S, D], b [B, D]; the output has a's dtype."""
    a, b, c = _last_dim_unit(a), _last_dim_unit(b), _last_dim_unit(c)
    B, S, D = a.shape
    out = torch.empty((B, S, D), dtype=a.dtype, device=a.device)
    block = triton.next_power_of_2(D)
    _mul_add_kernel[(B * S,)](a, b, c, out, S, D, a.stride(0), a.stride(1), b.stride(0), c.stride(0), c.stride(1),
                              float(k), BLOCK_D=block, num_warps=_num_warps(block))
    return out


# -- RMSNorm --------------------------------------------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.math.rsqrt(tl.sum(x * x, 0) / D + eps) * w
    tl.store(out_ptr + row * D + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., D] with weight [D]."""
    D = x.shape[-1]
    rows = x.reshape(-1, D).contiguous()
    out = torch.empty_like(rows)
    block = triton.next_power_of_2(D)
    _rms_norm_kernel[(rows.shape[0],)](rows, weight.contiguous(), out, D, eps, BLOCK_D=block,
                                       num_warps=_num_warps(block))
    return out.view(x.shape)


# -- qk RMSNorm + interleaved RoPE ------------------------------------------------------------------------------------
@triton.jit
def _qk_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, S, H, D, x_sb, x_ss, x_sh, o_sb, o_ss, o_sh, eps,
                         BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One token: all its heads as a [BLOCK_H, BLOCK_D] tile; pairs (2i, 2i+1) rotate by angle i of the token."""
    tok = tl.program_id(0).to(tl.int64)
    b, s = tok // S, tok % S
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < H) & (d < D)
    x = tl.load(x_ptr + b * x_sb + s * x_ss + h * x_sh + d, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None]
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    # D is even, so a pair is either wholly inside the row or wholly padding.
    x_even, x_odd = tl.split(tl.reshape(x * rstd * w, (BLOCK_H, BLOCK_D // 2, 2)))
    i = tl.arange(0, BLOCK_D // 2)[None, :]
    cos = tl.load(cos_ptr + s * (D // 2) + i, mask=i < D // 2, other=0.0)
    sin = tl.load(sin_ptr + s * (D // 2) + i, mask=i < D // 2, other=0.0)
    out = tl.reshape(tl.join(x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), (BLOCK_H, BLOCK_D))
    tl.store(out_ptr + b * o_sb + s * o_ss + h * o_sh + d, out.to(out_ptr.dtype.element_ty), mask=mask)


def _token_out(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`out` (a [B, S, H, D] view with a unit last stride, e.g. one stream's rows of the joint attention buffer), or a
    new contiguous tensor."""
    if out is None:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.shape != x.shape or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} (strides {out.stride()}) must be {tuple(x.shape)} "
                         "with unit last stride")
    return out


def qk_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, S, H, D] (any strides but a unit last one, e.g. a slice of a packed q/k/v GEMM output); weight [D];
    cos, sin [S, D/2] fp32. Writes into `out` (see `_token_out`) or returns a contiguous [B, S, H, D] tensor."""
    x = _last_dim_unit(x)
    B, S, H, D = x.shape
    out = _token_out(x, out)
    block_h, block_d = triton.next_power_of_2(H), triton.next_power_of_2(D)
    _qk_norm_rope_kernel[(B * S,)](x, weight.contiguous(), cos.contiguous(), sin.contiguous(), out, S, H, D,
                                   x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1), out.stride(2),
                                   eps, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=_num_warps(block_h * block_d))
    return out


# == eager-exact bf16 chains ==========================================================================================
@triton.jit
def _bf16(x):
    """fp32 `x` rounded to the nearest bf16 (ties to even) and kept in fp32: the value an eager bf16 op stores.
    Done on the bits, as c10::BFloat16 rounds, because the interpreter's own cast truncates; NaN passes through."""
    u = x.to(tl.uint32, bitcast=True)
    r = (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)
    return tl.where(x == x, r, x)


# -- mul-add: the gated residual `c + a·b` (k = 0) and `c + a·(k + b)` ---------------------------------------------
@triton.jit
def _mul_add_eager_kernel(a_ptr, b_ptr, c_ptr, out_ptr, S, D, a_sb, a_ss, b_sb, c_sb, c_ss, k,
                          HAS_K: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    bi, s = row // S, row % S
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    a = tl.load(a_ptr + bi * a_sb + s * a_ss + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + bi * b_sb + cols, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + bi * c_sb + s * c_ss + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_K:
        b = _bf16(k + b)
    out = _bf16(c + _bf16(a * b))
    tl.store(out_ptr + row * D + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def mul_add_eager_bf16(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, k: float) -> torch.Tensor:
    """Eager bf16 `c + a * b[:, None]` (k == 0: two roundings) or `c + a * (k + b[:, None])` (three); a, c [B, S, D],
    b [B, D] (row-strided views such as `chunk` results are fine), all bf16."""
    a, b, c = _last_dim_unit(a), _last_dim_unit(b), _last_dim_unit(c)
    B, S, D = a.shape
    out = torch.empty((B, S, D), dtype=a.dtype, device=a.device)
    block = triton.next_power_of_2(D)
    _mul_add_eager_kernel[(B * S,)](a, b, c, out, S, D, a.stride(0), a.stride(1), b.stride(0), c.stride(0),
                                    c.stride(1), float(k), HAS_K=k != 0, BLOCK_D=block, num_warps=_num_warps(block))
    return out


# -- the adaLN modulation after a LayerNorm: `xn * (1 + scale) + shift` --------------------------------------------
@triton.jit
def _scale_shift_eager_kernel(x_ptr, shift_ptr, scale_ptr, out_ptr, S, D, x_sb, x_ss, shift_sb, scale_sb,
                              BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b, s = row // S, row % S
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + b * x_sb + s * x_ss + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + b * scale_sb + cols, mask=mask, other=0.0).to(tl.float32)
    shift = tl.load(shift_ptr + b * shift_sb + cols, mask=mask, other=0.0).to(tl.float32)
    out = _bf16(_bf16(x * _bf16(1.0 + scale)) + shift)
    tl.store(out_ptr + row * D + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def scale_shift_eager_bf16(xn: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Eager bf16 `xn * (1 + scale[:, None]) + shift[:, None]` (three roundings); xn [B, S, D] (a LayerNorm's
    output), shift, scale [B, D], all bf16."""
    xn, shift, scale = _last_dim_unit(xn), _last_dim_unit(shift), _last_dim_unit(scale)
    B, S, D = xn.shape
    out = torch.empty((B, S, D), dtype=xn.dtype, device=xn.device)
    block = triton.next_power_of_2(D)
    _scale_shift_eager_kernel[(B * S,)](xn, shift, scale, out, S, D, xn.stride(0), xn.stride(1), shift.stride(0),
                                        scale.stride(0), BLOCK_D=block, num_warps=_num_warps(block))
    return out


# -- RMSNorm (diffusers' arithmetic), optionally followed by the complex-multiplication RoPE ---------------------------
@triton.jit
def _square_kernel(x_ptr, out_ptr, S, H, D, x_sb, x_ss, x_sh, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """`x.float().pow(2)` of one token [H, D] into a contiguous fp32 tensor (a bf16 square is exact in fp32)."""
    tok = tl.program_id(0).to(tl.int64)
    b, s = tok // S, tok % S
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < H) & (d < D)
    x = tl.load(x_ptr + b * x_sb + s * x_ss + h * x_sh + d, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + (tok * H + h) * D + d, x * x, mask=mask)


@triton.jit
def _rms_tail_kernel(x_ptr, r_ptr, w_ptr, f_ptr, out_ptr, S, H, D, x_sb, x_ss, x_sh, o_sb, o_ss, o_sh,
                     ROPE: tl.constexpr, COMPLEX_FMA: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One token [H, D]: `(x * r).to(bf16) * w` (r = rsqrt(variance + eps) per head, fp32), then with ROPE the pairs
    (2i, 2i+1) as complex numbers times f[s, i], rounded to bf16."""
    tok = tl.program_id(0).to(tl.int64)
    b, s = tok // S, tok % S
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < H) & (d < D)
    x = tl.load(x_ptr + b * x_sb + s * x_ss + h * x_sh + d, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + tok * H + h, mask=h < H, other=0.0)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    y = _bf16(_bf16(x * r) * w)
    if ROPE:
        even, odd = tl.split(tl.reshape(y, (BLOCK_H, BLOCK_D // 2, 2)))
        i = tl.arange(0, BLOCK_D // 2)[None, :]
        cos = tl.load(f_ptr + (s * (D // 2) + i) * 2, mask=i < D // 2, other=0.0)
        sin = tl.load(f_ptr + (s * (D // 2) + i) * 2 + 1, mask=i < D // 2, other=0.0)
        if COMPLEX_FMA:
            # c10::complex's (a+bi)(c+di) as nvcc contracts it in PyTorch's CUDA mul kernel: real = fma(a, c, -(b·d)),
            # imag = fma(b, c, a·d).
            re = tl.fma(even, cos, -(odd * sin))
            im = tl.fma(odd, cos, even * sin)
        else:  # PyTorch's CPU kernel: every product rounded, then the sum
            re = even * cos - odd * sin
            im = even * sin + odd * cos
        y = tl.reshape(tl.join(_bf16(re), _bf16(im)), (BLOCK_H, BLOCK_D))
    tl.store(out_ptr + b * o_sb + s * o_ss + h * o_sh + d, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_eager_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float, freqs: torch.Tensor | None = None,
                        out: torch.Tensor | None = None, complex_fma: bool = True) -> torch.Tensor:
    """diffusers' RMSNorm over the last dim of bf16 x, [B, S, D] or per head [B, S, H, D] (any strides but a unit
    last one), with a bf16 weight [D]: `variance = x.float().pow(2).mean(-1)`, `(x * rsqrt(variance + eps))
    .to(bf16) * weight`; with `freqs` (complex64 [S, D/2], 4-d x) then diffusers' RoPE,
    `(view_as_complex(y.float()) * freqs).type_as(y)`.

    The squares come from a kernel, the mean and the rsqrt from the very PyTorch calls diffusers makes, on a tensor
    of x's shape, contiguous as diffusers' is (so the same reduction), and the rest from one kernel that writes into
    `out` (see `_token_out`) or a new contiguous tensor. `complex_fma` picks how the complex product rounds: True as
    PyTorch's CUDA kernel does, False as its CPU kernel does."""
    x = _last_dim_unit(x)
    out = _token_out(x, out)
    squares = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    x4, out4 = (x, out) if x.dim() == 4 else (x.unsqueeze(2), out.unsqueeze(2))  # text: one "head" of width D
    B, S, H, D = x4.shape
    block_h, block_d = triton.next_power_of_2(H), triton.next_power_of_2(D)
    warps = _num_warps(block_h * block_d)
    _square_kernel[(B * S,)](x4, squares, S, H, D, x4.stride(0), x4.stride(1), x4.stride(2), BLOCK_H=block_h,
                             BLOCK_D=block_d, num_warps=warps)
    r = torch.rsqrt(squares.mean(-1, keepdim=True) + eps)
    f = squares if freqs is None else torch.view_as_real(freqs.contiguous())  # (an unread placeholder without RoPE)
    _rms_tail_kernel[(B * S,)](x4, r, weight.contiguous(), f, out4, S, H, D, x4.stride(0), x4.stride(1),
                               x4.stride(2), out4.stride(0), out4.stride(1), out4.stride(2), ROPE=freqs is not None,
                               COMPLEX_FMA=complex_fma, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=warps)
    return out
