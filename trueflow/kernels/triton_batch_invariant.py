"""Triton kernels of the batch-invariant mode on CUDA (`batch_invariant.py` routes to them): a GEMM, a last-dim row
reduction and a varlen attention forward, each computing one output row with the same arithmetic whatever the
batch around it.

- `matmul`: one tile config per (N, K) (`_gemm_config`: never M), no split-K, the K loop in one order, fp32
  accumulation, `alpha·acc + beta·bias` in fp32 and one rounding (cuBLAS's epilogue). A row's bits depend on its own
  values, K and N only: the tile it falls in changes which rows share an MMA, not any row's sums.
- `row_reduce`: the mean or the 2-norm of each row in one program, in fp32, in one order.
- `attention`: per (query block, head, sample), the sample's valid keys only (compacted, in their order) in blocks
  of BLOCK_N, online softmax in fp32: the row's bits are those of its sequence alone. Its backward recomputes each
  sample with PyTorch's own ops (correct, not batch-invariant: parity compares forwards).

Self-contained (imports only torch and triton): the tests load this file under `TRITON_INTERPRET=1`.
"""


from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton's interpreter (numpy) has no bf16 matrix product: there the tiles are multiplied in fp32 (a bf16 product is
# exact in fp32, so only the accumulation order can differ from a GPU's MMA; the tests check invariance, not bits
# against a GPU).
UPCAST = os.environ.get("TRITON_INTERPRET") == "1"


# -- GEMM ------------------------------------------------------------------------------------------------------------
def _gemm_config(n: int, k: int) -> dict:
    """The one config of an (N, K) GEMM: block sizes from N and K alone (small K: LoRA's rank)."""
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    block_n = min(128, max(16, triton.next_power_of_2(n)))
    return {"BLOCK_M": 128, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}


@triton.jit
def _gemm_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, sam, sak, sbk, sbn, scm, scn, alpha, beta,
                 HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, UPCAST_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * grid_n)  # grouped order: reuse of B tiles in L2 (changes no arithmetic)
    first_m = group * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * grid_n)) % size_m
    pid_n = (pid % (GROUP_M * grid_n)) // size_m
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        a = tl.load(a_ptr + rm[:, None] * sam + ks[None, :] * sak, mask=(rm[:, None] < M) & (ks[None, :] < K),
                    other=0.0)
        b = tl.load(b_ptr + ks[:, None] * sbk + rn[None, :] * sbn, mask=(ks[:, None] < K) & (rn[None, :] < N),
                    other=0.0)
        if UPCAST_DOT:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        elif IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    acc = acc * alpha
    if HAS_BIAS:
        acc += beta * tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rm[:, None] * scm + rn[None, :] * scn, acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, beta: float = 1.0,
           alpha: float = 1.0) -> torch.Tensor:
    """`alpha·(a @ b) + beta·bias` for a [M, K], b [K, N] of one dtype, bias [N] or None -> [M, N] in a's dtype.
    fp32 inputs multiply in IEEE fp32 (no TF32)."""
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    if K == 0:
        return c.zero_() if bias is None else c.copy_((beta * bias.float()).expand(M, N))
    cfg = _gemm_config(N, K)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    _gemm_kernel[grid](a, b, c, bias if bias is not None else c, M, N, K, a.stride(0), a.stride(1), b.stride(0),
                       b.stride(1), c.stride(0), c.stride(1), float(alpha), float(beta), HAS_BIAS=bias is not None,
                       IEEE=a.dtype == torch.float32, UPCAST_DOT=UPCAST, **cfg)
    return c


# -- last-dim reductions ---------------------------------------------------------------------------------------------
@triton.jit
def _row_reduce_kernel(x_ptr, out_ptr, D, NORM: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK):
        cols = d0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * D + cols, mask=cols < D, other=0.0).to(tl.float32)
        acc += x * x if NORM else x
    total = tl.sum(acc, 0)
    y = tl.sqrt(total) if NORM else total / D
    tl.store(out_ptr + row, y.to(out_ptr.dtype.element_ty))


def row_reduce(x: torch.Tensor, kind: str, keepdim: bool) -> torch.Tensor:
    """The mean (`kind="mean"`) or 2-norm (`"norm"`) over the last dim, one program per row, in fp32."""
    D = x.shape[-1]
    xc = x.contiguous()
    out = torch.empty(x.shape[:-1], dtype=x.dtype, device=x.device)
    rows = out.numel()
    if rows:
        block = min(4096, triton.next_power_of_2(max(D, 1)))
        _row_reduce_kernel[(rows,)](xc, out, D, NORM=kind == "norm", BLOCK=block, num_warps=4)
    return out.unsqueeze(-1) if keepdim else out


# -- varlen attention ------------------------------------------------------------------------------------------------
ATTN_BLOCK_M, ATTN_BLOCK_N = 64, 64


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, idx_ptr, len_ptr, S, L, H, sm_scale,
                      sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      UPCAST_DOT: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rd = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + b * sqb + rm[:, None] * sqs + h * sqh + rd[None, :],
                mask=(rm[:, None] < S) & (rd[None, :] < D), other=0.0)
    n_keys = tl.load(len_ptr + b)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for n0 in range(0, n_keys, BLOCK_N):  # the sample's valid keys, compacted, in their order
        rn = n0 + tl.arange(0, BLOCK_N)
        live = rn < n_keys
        key = tl.load(idx_ptr + b * L + rn, mask=live, other=0).to(tl.int64)
        k = tl.load(k_ptr + b * skb + key[:, None] * sks + h * skh + rd[None, :],
                    mask=live[:, None] & (rd[None, :] < D), other=0.0)
        v = tl.load(v_ptr + b * svb + key[:, None] * svs + h * svh + rd[None, :],
                    mask=live[:, None] & (rd[None, :] < D), other=0.0)
        if UPCAST_DOT:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * sm_scale
        else:
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * sm_scale
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        corr = tl.exp(m_i - m_new)
        l_i = l_i * corr + tl.sum(p, 1)
        if UPCAST_DOT:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v).to(tl.float32)
        acc = acc * corr[:, None] + pv
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + b * sob + rm[:, None] * sos + h * soh + rd[None, :], out.to(o_ptr.dtype.element_ty),
             mask=(rm[:, None] < S) & (rd[None, :] < D))


def _attention_forward(q, k, v, valid, scale):
    B, S, H, D = q.shape
    L = k.shape[1]
    if valid is None:
        idx = torch.arange(L, device=q.device, dtype=torch.int32).expand(B, L).contiguous()
        lens = torch.full((B,), L, device=q.device, dtype=torch.int32)
    else:  # valid keys first, each sample's in its order (a stable sort): no host sync, so CUDA graphs capture it
        idx = torch.argsort((~valid).to(torch.int8), dim=1, stable=True).to(torch.int32).contiguous()
        lens = valid.sum(1).to(torch.int32)
    out = torch.empty_like(q)
    grid = (triton.cdiv(S, ATTN_BLOCK_M), B * H)
    _attention_kernel[grid](q, k, v, out, idx, lens, S, L, H, scale if scale is not None else D ** -0.5,
                            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
                            D=D, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_M=ATTN_BLOCK_M,
                            BLOCK_N=ATTN_BLOCK_N, UPCAST_DOT=UPCAST, num_warps=4, num_stages=2)
    return out


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, valid, scale):
        ctx.save_for_backward(q, k, v, valid if valid is not None else torch.empty(0))
        ctx.has_valid, ctx.scale = valid is not None, scale
        return _attention_forward(q, k, v, valid, scale)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, valid = ctx.saved_tensors
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            mask = valid[:, None, None, :] if ctx.has_valid else None
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=ctx.scale)
            dq, dk, dv = torch.autograd.grad(out.transpose(1, 2), (q, k, v), grad)
        return dq, dk, dv, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None,
              scale: float | None) -> torch.Tensor:
    """q [B, S, H, D], k/v [B, L, H, D], valid bool [B, L] or None -> [B, S, H, D] (see the module docstring)."""
    return _Attention.apply(q, k, v, valid, scale)
