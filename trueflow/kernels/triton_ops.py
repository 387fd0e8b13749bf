"""Triton kernels for the engine's elementwise/normalisation paths, in two families.

Fast (`layer_norm_scale_shift` ... `attention_gate`): each kernel computes in fp32 and rounds each output once to the
input dtype, with the semantics of the PyTorch fallback it replaces (`layers/*._fused`).

Eager-exact (`*_eager_bf16`, used by the `qwen_image`, `sd3`, `flux` and `ltx` patch groups on CUDA): each kernel
replays a chain of eager bf16 PyTorch ops bit for bit. An eager elementwise op computes in fp32 and stores bf16, so
the kernel computes each op in fp32 and rounds to bf16 after each one, in the same order (`_bf16`); an op PyTorch
runs in fp32 (the split RoPE's) rounds to fp32. Reductions (LayerNorm, the RMS variance, `rms_norm`) stay PyTorch's
own calls, whose order nobody here reproduces; the kernels take over the elementwise ops around them. They launch
with `enable_fp_fusion=False`, so the compiler contracts no multiply-add that eager PyTorch rounds twice (`tl.fma` is
written out where PyTorch's kernel fuses one); RMSNorm + complex RoPE is the exception, at `rms_norm_eager_bf16`.

Modulation rows (shift, scale, gate) come as [B, D] (one row per sample) or [B, T, D] with T = 1 or one row per
token (`_rows`); a row tensor may be a row-strided view (a `chunk` of one Linear output).

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


def _rows(t: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Modulation rows for x [B, S, D] as (rows with a unit last stride, batch stride, token stride): [B, D], or
    [B, T, D] with T = 1 (one row per sample) or T = S (one per token); a size-1 axis broadcasts (stride 0)."""
    B, S, D = x.shape
    ok = t.dim() in (2, 3) and t.shape[0] in (1, B) and t.shape[-1] == D and (t.dim() == 2 or t.shape[1] in (1, S))
    if not ok:
        raise ValueError(f"modulation rows {tuple(t.shape)} do not fit x {tuple(x.shape)}: "
                         "need [B, D] or [B, 1 or S, D]")
    t = _last_dim_unit(t)
    sb = t.stride(0) if t.shape[0] > 1 else 0
    ss = t.stride(1) if t.dim() == 3 and t.shape[1] > 1 else 0
    return t, sb, ss


_EXACT = {"enable_fp_fusion": False}  # launch option of every eager-exact kernel (see the module docstring)


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
def _layer_norm_scale_shift_kernel(x_ptr, shift_ptr, scale_ptr, out_ptr, S, D, x_sb, x_ss, shift_sb, shift_ss,
                                   scale_sb, scale_ss, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b, s = row // S, row % S
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + b * x_sb + s * x_ss + cols, mask=mask, other=0.0).to(tl.float32)
    y = _ln_modulate(x, cols, mask, D, eps, scale_ptr + b * scale_sb + s * scale_ss,
                     shift_ptr + b * shift_sb + s * shift_ss)
    tl.store(out_ptr + row * D + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def layer_norm_scale_shift(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """x [B, S, D]; shift, scale: rows (`_rows`)."""
    x = _last_dim_unit(x)
    (shift, shift_sb, shift_ss), (scale, scale_sb, scale_ss) = _rows(shift, x), _rows(scale, x)
    B, S, D = x.shape
    out = torch.empty((B, S, D), dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(D)
    _layer_norm_scale_shift_kernel[(B * S,)](x, shift, scale, out, S, D, x.stride(0), x.stride(1), shift_sb, shift_ss,
                                             scale_sb, scale_ss, eps, BLOCK_D=block, num_warps=_num_warps(block))
    return out


# -- gated residual + LayerNorm + scale/shift ----------------------------------------------------------------------
@triton.jit
def _scale_residual_ln_kernel(res_ptr, y_ptr, gate_ptr, shift_ptr, scale_ptr, r_out_ptr, out_ptr, S, D,
                              res_sb, res_ss, y_sb, y_ss, gate_sb, gate_ss, shift_sb, shift_ss, scale_sb, scale_ss,
                              eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b, s = row // S, row % S
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    res = tl.load(res_ptr + b * res_sb + s * res_ss + cols, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + b * y_sb + s * y_ss + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + b * gate_sb + s * gate_ss + cols, mask=mask, other=0.0).to(tl.float32)
    r = res + gate * y
    tl.store(r_out_ptr + row * D + cols, r.to(r_out_ptr.dtype.element_ty), mask=mask)
    # The norm reads the unrounded fp32 residual, as the PyTorch fallback does.
    out = _ln_modulate(r, cols, mask, D, eps, scale_ptr + b * scale_sb + s * scale_ss,
                       shift_ptr + b * shift_sb + s * shift_ss)
    tl.store(out_ptr + row * D + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def scale_residual_layer_norm_scale_shift(residual: torch.Tensor, y: torch.Tensor, gate: torch.Tensor,
                                          shift: torch.Tensor, scale: torch.Tensor,
                                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """r = residual + gate·y; returns (r, LN(r)·(1+scale)+shift). residual, y [B, S, D]; gate, shift, scale: rows
    (`_rows`)."""
    residual, y = _last_dim_unit(residual), _last_dim_unit(y)
    (gate, gate_sb, gate_ss), (shift, shift_sb, shift_ss) = _rows(gate, residual), _rows(shift, residual)
    scale, scale_sb, scale_ss = _rows(scale, residual)
    B, S, D = residual.shape
    r = torch.empty((B, S, D), dtype=residual.dtype, device=residual.device)
    out = torch.empty_like(r)
    block = triton.next_power_of_2(D)
    _scale_residual_ln_kernel[(B * S,)](residual, y, gate, shift, scale, r, out, S, D, residual.stride(0),
                                        residual.stride(1), y.stride(0), y.stride(1), gate_sb, gate_ss, shift_sb,
                                        shift_ss, scale_sb, scale_ss, eps, BLOCK_D=block, num_warps=_num_warps(block))
    return r, out


# -- mul-add --------------------------------------------------------------------------------------------------------
@triton.jit
def _mul_add_kernel(a_ptr, b_ptr, c_ptr, out_ptr, S, D, a_sb, a_ss, b_sb, b_ss, c_sb, c_ss, k,
                    BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    bi, s = row // S, row % S
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    a = tl.load(a_ptr + bi * a_sb + s * a_ss + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + bi * b_sb + s * b_ss + cols, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + bi * c_sb + s * c_ss + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + cols, (c + a * (k + b)).to(out_ptr.dtype.element_ty), mask=mask)


def mul_add(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, k: float) -> torch.Tensor:
    """c + a·(k+b); a, c [B, S, D], b: rows (`_rows`); the output has a's dtype."""
    a, c = _last_dim_unit(a), _last_dim_unit(c)
    b, b_sb, b_ss = _rows(b, a)
    B, S, D = a.shape
    out = torch.empty((B, S, D), dtype=a.dtype, device=a.device)
    block = triton.next_power_of_2(D)
    _mul_add_kernel[(B * S,)](a, b, c, out, S, D, a.stride(0), a.stride(1), b_sb, b_ss, c.stride(0), c.stride(1),
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


# -- weightless RMSNorm + scale/shift, and the bare scale/shift --------------------------------------------------------
@triton.jit
def _rms_modulate_kernel(x_ptr, shift_ptr, scale_ptr, out_ptr, S, D, x_sb, x_ss, shift_sb, shift_ss, scale_sb,
                         scale_ss, eps, NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b, s = row // S, row % S
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + b * x_sb + s * x_ss + cols, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        x = x * tl.math.rsqrt(tl.sum(x * x, 0) / D + eps)
    scale = tl.load(scale_ptr + b * scale_sb + s * scale_ss + cols, mask=mask, other=0.0).to(tl.float32)
    shift = tl.load(shift_ptr + b * shift_sb + s * shift_ss + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + cols, (x * (1.0 + scale) + shift).to(out_ptr.dtype.element_ty), mask=mask)


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, norm: bool) -> torch.Tensor:
    x = _last_dim_unit(x)
    (shift, shift_sb, shift_ss), (scale, scale_sb, scale_ss) = _rows(shift, x), _rows(scale, x)
    B, S, D = x.shape
    out = torch.empty((B, S, D), dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(D)
    _rms_modulate_kernel[(B * S,)](x, shift, scale, out, S, D, x.stride(0), x.stride(1), shift_sb, shift_ss, scale_sb,
                                   scale_ss, eps, NORM=norm, BLOCK_D=block, num_warps=_num_warps(block))
    return out


def rms_norm_scale_shift(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight, then ·(1+scale)+shift: x [B, S, D]; shift, scale: rows (`_rows`)."""
    return _modulate(x, shift, scale, eps, norm=True)


def scale_shift(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x·(1+scale)+shift: x [B, S, D]; shift, scale: rows (`_rows`)."""
    return _modulate(x, shift, scale, 0.0, norm=False)


# -- qk RMSNorm across heads (+ split or interleaved RoPE) -------------------------------------------------------------
@triton.jit
def _qk_norm_across_heads_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, S, H, D, x_sb, x_ss, x_sh, t_sh, t_ss,
                                 eps, ROPE: tl.constexpr, SPLIT: tl.constexpr, BLOCK_H: tl.constexpr,
                                 BLOCK_R: tl.constexpr):
    """One token: its H heads of D channels as two [BLOCK_H, BLOCK_R] tiles, the channels each pair rotates together
    (R = D/2): the halves (i, i + R) with SPLIT, else (2i, 2i + 1). The norm is over all H·D channels; pair i of
    head h rotates by the table entry (h, s, i)."""
    tok = tl.program_id(0).to(tl.int64)
    b, s = tok // S, tok % S
    R = D // 2
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_R)[None, :]
    mask = (h < H) & (i < R)
    if SPLIT:
        c1, c2 = i, i + R
    else:
        c1, c2 = 2 * i, 2 * i + 1
    x_row = x_ptr + b * x_sb + s * x_ss + h * x_sh
    x1 = tl.load(x_row + c1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + c2, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(tl.sum(x1 * x1 + x2 * x2, 1), 0) / (H * D) + eps)
    y1 = x1 * rstd * tl.load(w_ptr + h * D + c1, mask=mask, other=0.0).to(tl.float32)
    y2 = x2 * rstd * tl.load(w_ptr + h * D + c2, mask=mask, other=0.0).to(tl.float32)
    if ROPE:
        cos = tl.load(cos_ptr + h * t_sh + s * t_ss + i, mask=mask, other=0.0)
        sin = tl.load(sin_ptr + h * t_sh + s * t_ss + i, mask=mask, other=0.0)
        y1, y2 = y1 * cos - y2 * sin, y2 * cos + y1 * sin
    o_row = out_ptr + (tok * H + h) * D
    tl.store(o_row + c1, y1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_row + c2, y2.to(out_ptr.dtype.element_ty), mask=mask)


def _tables(cos: torch.Tensor, sin: torch.Tensor, S: int, H: int,
            R: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(cos, sin, head stride, token stride) of rotation tables [S, R] (every head shares them) or [1, H, S, R], read
    where they lie (a transposed view, as the LTX-2 tables are built, costs no copy) if both have the same unit-last
    strides, else from contiguous copies."""
    if tuple(cos.shape) not in ((S, R), (1, H, S, R)) or cos.shape != sin.shape:
        raise ValueError(f"rotation tables {tuple(cos.shape)} fit neither [{S}, {R}] nor [1, {H}, {S}, {R}]")
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    return (cos, sin, 0, cos.stride(0)) if cos.dim() == 2 else (cos, sin, cos.stride(1), cos.stride(2))


def qk_norm_across_heads_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor | None,
                              sin: torch.Tensor | None, split: bool) -> torch.Tensor:
    """x [B, S, H, D] (any strides but a unit last one, e.g. q of a packed q/k/v GEMM, unflattened); weight [H·D];
    with tables, cos/sin fp32 [S, D/2] or per head [1, H, S, D/2], pairs split (halves) or interleaved. Returns a
    contiguous [B, S, H, D] tensor."""
    x = _last_dim_unit(x)
    B, S, H, D = x.shape
    out = torch.empty((B, S, H, D), dtype=x.dtype, device=x.device)
    rope = cos is not None and sin is not None
    if cos is not None and sin is not None:
        cos, sin, t_sh, t_ss = _tables(cos, sin, S, H, D // 2)
    else:
        cos, sin, t_sh, t_ss = out, out, 0, 0  # unread placeholders without RoPE
    block_h, block_r = triton.next_power_of_2(H), triton.next_power_of_2(D // 2)
    _qk_norm_across_heads_kernel[(B * S,)](x, weight.contiguous(), cos, sin, out, S, H, D, x.stride(0), x.stride(1),
                                           x.stride(2), t_sh, t_ss, eps, ROPE=rope, SPLIT=split, BLOCK_H=block_h,
                                           BLOCK_R=block_r, num_warps=_num_warps(2 * block_h * block_r))
    return out


# -- the per-head attention gate `out·2σ(logits)` --------------------------------------------------------------------
@triton.jit
def _attention_gate_kernel(o_ptr, l_ptr, out_ptr, S, H, D, o_sb, o_ss, o_sh, l_sb, l_ss, BLOCK_H: tl.constexpr,
                           BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    b, s = tok // S, tok % S
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < H) & (d < D)
    o = tl.load(o_ptr + b * o_sb + s * o_ss + h * o_sh + d, mask=mask, other=0.0).to(tl.float32)
    logits = tl.load(l_ptr + b * l_sb + s * l_ss + h, mask=h < H, other=0.0).to(tl.float32)
    gate = 2.0 * tl.sigmoid(logits)
    tl.store(out_ptr + (tok * H + h) * D + d, (o * gate).to(out_ptr.dtype.element_ty), mask=mask)


def attention_gate(out: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """out [B, S, H, D] (any strides but a unit last one, e.g. SDPA's output permuted back); logits [B, S, H] (unit
    last stride, e.g. a slice of a packed GEMM). Returns a contiguous [B, S, H, D] tensor of out's dtype."""
    out, logits = _last_dim_unit(out), _last_dim_unit(logits)
    B, S, H, D = out.shape
    gated = torch.empty((B, S, H, D), dtype=out.dtype, device=out.device)
    block_h, block_d = triton.next_power_of_2(H), triton.next_power_of_2(D)
    _attention_gate_kernel[(B * S,)](out, logits, gated, S, H, D, out.stride(0), out.stride(1), out.stride(2),
                                     logits.stride(0), logits.stride(1), BLOCK_H=block_h, BLOCK_D=block_d,
                                     num_warps=_num_warps(block_h * block_d))
    return gated


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
def _mul_add_eager_kernel(a_ptr, b_ptr, c_ptr, out_ptr, S, D, a_sb, a_ss, b_sb, b_ss, c_sb, c_ss, k,
                          HAS_K: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    bi, s = row // S, row % S
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    a = tl.load(a_ptr + bi * a_sb + s * a_ss + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + bi * b_sb + s * b_ss + cols, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + bi * c_sb + s * c_ss + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_K:
        b = _bf16(k + b)
    out = _bf16(c + _bf16(a * b))
    tl.store(out_ptr + row * D + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def mul_add_eager_bf16(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, k: float) -> torch.Tensor:
    """Eager bf16 `c + a * b` (k == 0: two roundings) or `c + a * (k + b)` (three); a, c [B, S, D], b: rows
    (`_rows`, broadcast over the tokens as `b[:, None]` or `b` [B, 1 or S, D] broadcasts), all bf16."""
    a, c = _last_dim_unit(a), _last_dim_unit(c)
    b, b_sb, b_ss = _rows(b, a)
    B, S, D = a.shape
    out = torch.empty((B, S, D), dtype=a.dtype, device=a.device)
    block = triton.next_power_of_2(D)
    _mul_add_eager_kernel[(B * S,)](a, b, c, out, S, D, a.stride(0), a.stride(1), b_sb, b_ss, c.stride(0),
                                    c.stride(1), float(k), HAS_K=k != 0, BLOCK_D=block, num_warps=_num_warps(block),
                                    **_EXACT)
    return out


# -- the adaLN modulation `xn * (1 + scale) + shift`, after a LayerNorm or diffusers' weightless RMSNorm -------------
@triton.jit
def _scale_shift_eager_kernel(x_ptr, r_ptr, shift_ptr, scale_ptr, out_ptr, S, D, x_sb, x_ss, shift_sb, shift_ss,
                              scale_sb, scale_ss, NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    """With NORM, x is first normalised as diffusers' weightless RMSNorm does, `(x * r).to(bf16)` (r = rsqrt(variance
    + eps) of the row, fp32)."""
    row = tl.program_id(0).to(tl.int64)
    b, s = row // S, row % S
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + b * x_sb + s * x_ss + cols, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        x = _bf16(x * tl.load(r_ptr + row))
    scale = tl.load(scale_ptr + b * scale_sb + s * scale_ss + cols, mask=mask, other=0.0).to(tl.float32)
    shift = tl.load(shift_ptr + b * shift_sb + s * shift_ss + cols, mask=mask, other=0.0).to(tl.float32)
    out = _bf16(_bf16(x * _bf16(1.0 + scale)) + shift)
    tl.store(out_ptr + row * D + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _scale_shift_eager(x: torch.Tensor, r: torch.Tensor | None, shift: torch.Tensor,
                       scale: torch.Tensor) -> torch.Tensor:
    x = _last_dim_unit(x)
    (shift, shift_sb, shift_ss), (scale, scale_sb, scale_ss) = _rows(shift, x), _rows(scale, x)
    B, S, D = x.shape
    out = torch.empty((B, S, D), dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(D)
    _scale_shift_eager_kernel[(B * S,)](x, x if r is None else r, shift, scale, out, S, D, x.stride(0), x.stride(1),
                                        shift_sb, shift_ss, scale_sb, scale_ss, NORM=r is not None, BLOCK_D=block,
                                        num_warps=_num_warps(block), **_EXACT)
    return out


def scale_shift_eager_bf16(xn: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Eager bf16 `xn * (1 + scale) + shift` (three roundings), the rows broadcast over the tokens; xn [B, S, D] (a
    LayerNorm's output, or a stream modulated without a norm), shift, scale: rows (`_rows`), all bf16."""
    return _scale_shift_eager(xn, None, shift, scale)


def rms_norm_scale_shift_eager_bf16(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                                    eps: float) -> torch.Tensor:
    """diffusers' weightless `RMSNorm` then the modulation, in eager bf16: `(x * rsqrt(x.float().pow(2).mean(-1) +
    eps)).to(bf16) * (1 + scale) + shift` (four roundings); x [B, S, D], shift, scale: rows (`_rows`), all bf16. The
    variance is PyTorch's own mean (`_rms_rsqrt`)."""
    x = _last_dim_unit(x)
    return _scale_shift_eager(x, _rms_rsqrt(x, eps)[0], shift, scale)


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
        else:  # PyTorch's CPU kernel: every product rounded, then the sum (on CUDA the compiler may contract it)
            re = even * cos - odd * sin
            im = even * sin + odd * cos
        y = tl.reshape(tl.join(_bf16(re), _bf16(im)), (BLOCK_H, BLOCK_D))
    tl.store(out_ptr + b * o_sb + s * o_ss + h * o_sh + d, y.to(out_ptr.dtype.element_ty), mask=mask)


# The one eager-exact kernel launched with the compiler's contraction on, as before 2026-12-02, when a variant
# reproduced PyTorch's CUDA complex product on an H200. With `enable_fp_fusion=False` neither variant did
# (tests/test_kernels.py::test_qk_norm_rope_exact on CUDA, 2026-12-02), and parity mode fell back to eager ops. So
# the contraction, not only the written `tl.fma`, is part of what matched; this launch is to be re-run there.
def rms_norm_eager_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float, freqs: torch.Tensor | None = None,
                        out: torch.Tensor | None = None, complex_fma: bool = True) -> torch.Tensor:
    """diffusers' RMSNorm over the last dim of bf16 x, [B, S, D] or per head [B, S, H, D] (any strides but a unit
    last one), with a bf16 weight [D]: `variance = x.float().pow(2).mean(-1)`, `(x * rsqrt(variance + eps))
    .to(bf16) * weight`; with `freqs` (complex64 [S, D/2], 4-d x) then diffusers' RoPE,
    `(view_as_complex(y.float()) * freqs).type_as(y)`.

    The variance and its rsqrt as `_rms_rsqrt` makes them (PyTorch's own mean), the rest from one kernel that writes
    into `out` (see `_token_out`) or a new contiguous tensor. `complex_fma` picks how the complex product rounds: True
    as PyTorch's CUDA kernel does, False as its CPU kernel does."""
    x = _last_dim_unit(x)
    out = _token_out(x, out)
    r, squares = _rms_rsqrt(x, eps)
    x4, out4 = (x, out) if x.dim() == 4 else (x.unsqueeze(2), out.unsqueeze(2))  # text: one "head" of width D
    B, S, H, D = x4.shape
    block_h, block_d = triton.next_power_of_2(H), triton.next_power_of_2(D)
    f = squares if freqs is None else torch.view_as_real(freqs.contiguous())  # (an unread placeholder without RoPE)
    _rms_tail_kernel[(B * S,)](x4, r, weight.contiguous(), f, out4, S, H, D, x4.stride(0), x4.stride(1),
                               x4.stride(2), out4.stride(0), out4.stride(1), out4.stride(2), ROPE=freqs is not None,
                               COMPLEX_FMA=complex_fma, BLOCK_H=block_h, BLOCK_D=block_d,
                               num_warps=_num_warps(block_h * block_d))  # not _EXACT: see above
    return out


def _rms_rsqrt(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.rsqrt(x.to(float32).pow(2).mean(-1, keepdim=True) + eps)` of x [B, S, D] or [B, S, H, D] (unit last
    stride), and the squares: they come from a kernel into a contiguous fp32 tensor of x's shape (as diffusers' `.to`
    makes it), the mean and the rsqrt from the very PyTorch calls diffusers makes (so the same reduction)."""
    squares = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    x4 = x if x.dim() == 4 else x.unsqueeze(2)
    B, S, H, D = x4.shape
    block_h, block_d = triton.next_power_of_2(H), triton.next_power_of_2(D)
    _square_kernel[(B * S,)](x4, squares, S, H, D, x4.stride(0), x4.stride(1), x4.stride(2), BLOCK_H=block_h,
                             BLOCK_D=block_d, num_warps=_num_warps(block_h * block_d), **_EXACT)
    return torch.rsqrt(squares.mean(-1, keepdim=True) + eps), squares


# -- diffusers' split RoPE (`apply_split_rotary_emb`) on a normed bf16 q or k ------------------------------------------
@triton.jit
def _split_rope_eager_kernel(y_ptr, cos_ptr, sin_ptr, out_ptr, S, H, D, y_sb, y_ss, t_sh, t_ss, FMA: tl.constexpr,
                             BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr):
    """One token [H, D] of bf16 y, each head's halves (a, b) in fp32: `out = (a, b) * cos`, then `first -= sin·b` and
    `second += sin·a` as `addcmul_` computes them (FMA: the product fused into the sum, else rounded first), rounded
    to bf16."""
    tok = tl.program_id(0).to(tl.int64)
    bi, s = tok // S, tok % S
    R = D // 2
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_R)[None, :]
    mask = (h < H) & (i < R)
    row = y_ptr + bi * y_sb + s * y_ss + h * D
    a = tl.load(row + i, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(row + R + i, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + h * t_sh + s * t_ss + i, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + h * t_sh + s * t_ss + i, mask=mask, other=0.0)
    first, second = a * cos, b * cos
    if FMA:
        first, second = tl.fma(-sin, b, first), tl.fma(sin, a, second)
    else:
        first, second = first + (-sin) * b, second + sin * a
    o_row = out_ptr + (tok * H + h) * D
    tl.store(o_row + i, _bf16(first).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_row + R + i, _bf16(second).to(out_ptr.dtype.element_ty), mask=mask)


def split_rope_eager_bf16(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fma: bool) -> torch.Tensor:
    """diffusers' `apply_split_rotary_emb(y, (cos, sin))` on bf16 y [B, S, H·D] (e.g. `rms_norm`'s output) with
    per-head fp32 tables [1, H, S, D/2] (diffusers' LTX-2 layout): every op as diffusers runs it in fp32, the `addcmul_`
    products fused into their sums with `fma` (how PyTorch's kernel rounds on the device: `models.ltx2.patches.
    split_rope_fma` finds it), rounded to bf16 at the end. Returns a contiguous [B, S, H·D] tensor."""
    B, S, HD = y.shape
    H = cos.shape[1]
    D = HD // H
    y = _last_dim_unit(y)
    out = torch.empty((B, S, HD), dtype=y.dtype, device=y.device)
    cos, sin, t_sh, t_ss = _tables(cos, sin, S, H, D // 2)
    block_h, block_r = triton.next_power_of_2(H), triton.next_power_of_2(D // 2)
    _split_rope_eager_kernel[(B * S,)](y, cos, sin, out, S, H, D, y.stride(0), y.stride(1), t_sh, t_ss, FMA=fma,
                                       BLOCK_H=block_h, BLOCK_R=block_r, num_warps=_num_warps(2 * block_h * block_r),
                                       **_EXACT)
    return out
