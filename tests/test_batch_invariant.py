"""The batch-invariant kernels (`trueflow/kernels/batch_invariant.py`): each row's bits independent of the batch around
it, at the real model's widths, with the stock kernel's failure side; autograd through them against the stock ops
and by gradcheck in float64; the CPU's own norms, softmax and norms per row; the per-sample attention against the
unpadded sequence alone; the diffusers backend; and the CUDA kernels (Triton) under Triton's interpreter.

The oracle of invariance is the op itself on the sample alone (the definition); of values, the stock op or a float64
computation. Which GEMM shapes the stock CPU kernel rounds alike depends on the CPU's library (DESIGN §3: on this
CPU an M=4 GEMM differs from four M=1 ones at K=3072), so each failure side is asserted at real widths only.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import BF16, EPS, assert_bitwise, assert_differs, randn
from trueflow import kernels
from trueflow.kernels import batch_invariant as BI
from trueflow.layers import attention as A

F64 = torch.float64
WIDTHS = [(3072, 3072), (3072, 12288), (12288, 3072)]  # Qwen-Image's q/k/v and out projections, MLP in, MLP out


@pytest.fixture(scope="module")
def weights() -> dict:
    return {(k, n): (randn((n, k), 1, std=0.02), randn((n,), 2, std=0.1)) for k, n in WIDTHS}


def linear_cases(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(batched, alone) pairs that must agree bitwise in the mode: 16 rows vs each alone; a [4, 4, K] input vs the
    same; without the bias, 16 rows vs 4 calls of 4; rows 3..18 of a 21-row batch vs those 16; a row between zero
    rows vs alone."""
    alone = torch.cat([F.linear(r[None], w, b) for r in x])
    x21 = torch.cat([randn((3, x.shape[1]), 5).to(x.device), x, randn((2, x.shape[1]), 6).to(x.device)])
    zeros = x.new_zeros(5, x.shape[1])
    return {
        "16 vs 16x1": (F.linear(x, w, b), alone),
        "[4,4,K] vs 16x1": (F.linear(x.view(4, 4, -1), w, b).flatten(0, 1), alone),
        "16 vs 4x4, no bias": (F.linear(x, w), torch.cat([F.linear(x[i:i + 4], w) for i in range(0, 16, 4)])),
        "rows of 21 vs the 16": (F.linear(x21, w, b)[3:19], alone),
        "among zeros vs alone": (F.linear(torch.cat([zeros[:2], x[:1], zeros]), w, b)[2:3], alone[:1]),
    }


@pytest.mark.parametrize("k,n", WIDTHS, ids=[f"K{k}-N{n}" for k, n in WIDTHS])
def test_gemm_rows_are_batch_invariant_at_real_width(weights, k, n, bi_mode):
    w, b = weights[k, n]
    x = randn((16, k), 3)
    for what, (batched, alone) in linear_cases(x, w, b).items():
        assert_bitwise(batched, alone, what)
    # The stock kernel: the same comparison differs (DESIGN §3). Only a few of the 16·N outputs do (a reduction-order
    # change in fp32 shows only where it crosses a bf16 rounding boundary), hence 16 rows, not 4.
    BI.disable()
    batched, alone = linear_cases(x, w, b)["16 vs 16x1"]
    assert_differs(batched, alone, "stock GEMM, M=16 vs 16 x M=1")


def test_bmm_entries_are_batch_invariant(bi_mode):
    """Attention-shaped products (matmul of [B, H, S, D] by [B, H, D, L] runs bmm): each sample's entries alone."""
    a, b = randn((3, 2, 40, 128), 7), randn((3, 2, 128, 24), 8)
    batched = a @ b
    assert_bitwise(batched, torch.cat([a[i:i + 1] @ b[i:i + 1] for i in range(3)]), "bmm")
    assert_bitwise(batched[1, 0, 5:9], (a[1, 0, 5:9] @ b[1, 0]), "rows of one entry")


def test_enable_is_idempotent_and_disable_restores_the_stock_kernels(weights):
    w, b = weights[3072, 12288]
    x = randn((16, 3072), 3)
    stock = F.linear(x, w, b)
    with BI.mode():
        BI.enable()
        assert BI.enabled()
        inside = F.linear(x, w, b)
    assert not BI.enabled()
    assert_bitwise(F.linear(x, w, b), stock, "after the mode")
    assert_differs(inside, stock, "the mode's tiles vs the stock M=16 call")


# -- autograd ----------------------------------------------------------------------------------------------------------
def test_gemm_gradients_match_the_stock_ops(bi_mode):
    """fp32, a shape spanning two tiles: every gradient equals autograd's of the stock ops to fp32 rounding."""
    M = BI.M_TILE + 37
    x0, w0, b0 = (randn(s, i, dtype=torch.float32) for i, s in enumerate(((M, 96), (80, 96), (80,)), 20))
    a0, c0 = randn((3, 21, 16), 30, dtype=torch.float32), randn((3, 16, 9), 31, dtype=torch.float32)

    def grads():
        x, w, b, a, c = (t.clone().requires_grad_() for t in (x0, w0, b0, a0, c0))
        loss = (F.linear(x.view(1, M, 96), w, b).square().sum() + F.linear(x, w).sin().sum()
                + (a @ c).square().sum() + torch.mm(x[:5], w.t()).sum())
        loss.backward()
        return [t.grad for t in (x, w, b, a, c)]

    mode = grads()
    BI.disable()
    for got, want, name in zip(mode, grads(), ("x", "w", "b", "a", "c")):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"grad {name}: {m}")


def test_gemm_gradcheck_float64(bi_mode):
    x, w, b = (torch.randn(s, dtype=F64, generator=torch.Generator().manual_seed(i), requires_grad=True)
               for i, s in enumerate(((5, 4), (3, 4), (3,))))
    a, c = (torch.randn(s, dtype=F64, generator=torch.Generator().manual_seed(9 + i), requires_grad=True)
            for i, s in enumerate(((2, 3, 4), (2, 4, 2))))
    assert torch.autograd.gradcheck(lambda x, w, b: F.linear(x.view(1, 5, 4), w, b), (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w: torch.mm(x, w.t()), (x, w))
    assert torch.autograd.gradcheck(torch.bmm, (a, c))


# -- what the CPU computes per row already -----------------------------------------------------------------------------
def test_cpu_norms_softmax_and_reductions_are_per_row():
    """The stock CPU kernels of the model's per-row ops at real widths: a batch's rows are the rows alone, bitwise
    (so the mode overrides none of them on the CPU): LayerNorm (3072), diffusers' RMSNorm variance (3584), RMSNorm
    (LTX-2.3's `torch.nn.RMSNorm`, 4096), softmax over a joint sequence, and CFG's norm over the output channels."""
    ops = {
        "layer_norm": (lambda x: F.layer_norm(x, x.shape[-1:], eps=EPS), (4, 9, 3072)),
        "rms variance": (lambda x: x.float().pow(2).mean(-1, keepdim=True), (4, 9, 3584)),
        "rms_norm": (lambda x: F.rms_norm(x, x.shape[-1:], eps=EPS), (4, 9, 4096)),
        "softmax": (lambda x: x.float().softmax(-1), (4, 9, 4224)),
        "cfg norm": (lambda x: torch.norm(x, dim=-1, keepdim=True), (4, 9, 64)),
    }
    for what, (op, shape) in ops.items():
        x = randn(shape, 40, std=2.0)
        batched = op(x)
        assert_bitwise(batched, torch.cat([op(x[i:i + 1]) for i in range(shape[0])]), f"{what}: samples alone")
        assert_bitwise(batched[1, 3:5], op(x[1, 3:5]), f"{what}: rows alone")


# -- attention ---------------------------------------------------------------------------------------------------------
H, D = 24, 128  # Qwen-Image's heads


def joint_batch(image: int, texts: tuple[int, ...], seed: int):
    """Per-sample joint [text, image] q/k/v [1, L_i + S, H, D], and their batch with each text zero-padded to the
    longest (padding between text and image, as the joint attention lays it out) and its bool key mask."""
    alone = [randn((1, t + image, 3, H, D), seed + i) for i, t in enumerate(texts)]
    width = max(texts)
    padded, mask = [], torch.ones(len(texts), width + image, dtype=torch.bool)
    for i, (x, t) in enumerate(zip(alone, texts)):
        padded.append(torch.cat([x[:, :t], x.new_zeros(1, width - t, 3, H, D), x[:, t:]], 1))
        mask[i, t:width] = False
    return [x.unbind(2) for x in alone], torch.cat(padded).unbind(2), mask


def valid_rows(out: torch.Tensor, i: int, text: int, width: int) -> torch.Tensor:
    return torch.cat([out[i, :text], out[i, width:]])


@pytest.mark.parametrize("image", [16, 200])
def test_attention_rows_are_those_of_the_unpadded_sequence_alone(image):
    texts = (7, 20, 13)
    alone, (q, k, v), mask = joint_batch(image, texts, 50)
    out = A.attention(q, k, v, mask, "batch_invariant")
    for i, t in enumerate(texts):
        assert_bitwise(valid_rows(out, i, t, 20), A.attention(*alone[i], None, "batch_invariant")[0], f"sample {i}")
    assert_bitwise(A.attention(q[1:2], k[1:2], v[1:2], None, "batch_invariant"), out[1:2], "the longest, unmasked")
    bias = (~mask).to(BF16)[:, None, None, :].expand(-1, H, 1, -1) * -10000.0  # LTX-2's additive form, per head
    assert_bitwise(BI.attention(q, k, v, bias), out, "additive -10000 mask")
    # the failure side: PyTorch's masked SDPA on the padded batch (diffusers' `native` backend, what the train side
    # falls back to on a mask) does not give the short samples' rows their unpadded bits
    stock = A.attention(q, k, v, mask, "sdpa")
    assert_differs(valid_rows(stock, 0, 7, 20), A.attention(*alone[0], None, "sdpa")[0], "stock masked SDPA")


def test_attention_refuses_what_is_not_a_key_mask():
    q = randn((2, 5, 2, 16), 1)
    with pytest.raises(ValueError, match="not a general attention bias"):
        BI.attention(q, q, q, torch.full((2, 1, 1, 5), -0.5))
    per_query = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    per_query[0, 0, 2, 1] = False
    with pytest.raises(ValueError, match="same for every head and query"):
        BI.attention(q, q, q, per_query)
    with pytest.raises(ValueError, match="takes a key mask"):
        BI.attention(q, q, q, torch.ones(2, 4, dtype=torch.bool))


def test_attention_gradients_match_masked_sdpa():
    """fp32: gradients through the per-sample tiles equal autograd's of PyTorch's masked SDPA to fp32 rounding (the
    padded query rows read by nothing get a zero gradient in both); gradcheck in float64 on a tiny case."""
    g = torch.Generator().manual_seed(3)
    q0, k0, v0 = (torch.randn(2, BI.Q_TILE + 5, 2, 16, generator=g) for _ in range(3))
    mask = torch.ones(2, BI.Q_TILE + 5, dtype=torch.bool)
    mask[0, 3:9] = False
    w = torch.randn(2, BI.Q_TILE + 5, 2, 16, generator=g) * mask[:, :, None, None]

    def grads(fn):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        (fn(q, k, v) * w).sum().backward()
        return q.grad, k.grad, v.grad

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                              attn_mask=mask[:, None, None, :]).transpose(1, 2)

    for got, want in zip(grads(lambda q, k, v: BI.attention(q, k, v, mask)), grads(sdpa)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    qd, kd, vd = (torch.randn(2, 4, 1, 4, dtype=F64, generator=g, requires_grad=True) for _ in range(3))
    small = torch.tensor([[True, True, False, True], [True, True, True, True]])
    assert torch.autograd.gradcheck(lambda q, k, v: BI.attention(q, k, v, small)[:, [0, 1, 3]], (qd, kd, vd))


def test_set_kernel_refuses_a_model_that_bypasses_the_dispatcher():
    """A model whose attention does not go through `layers.attention` (no module names its kernel in `backend`)
    cannot be put on the mode's kernel: refused in one line rather than left on its own kernel."""
    with pytest.raises(ValueError, match="no module whose attention goes through the shared dispatcher"):
        A.set_kernel(torch.nn.Sequential(torch.nn.Linear(2, 2)), "batch_invariant")
    with pytest.raises(ValueError, match="unknown attention backend"):
        A.set_kernel(torch.nn.Sequential(), "nope")


def test_diffusers_dispatch_runs_the_backend():
    """The backend is one of diffusers' own: its dispatch, its `attention_backend` context and a model's
    `set_attention_backend` take the name, and the call reaches the same function as the engine's kernel."""
    from diffusers.models.attention_dispatch import attention_backend, dispatch_attention_fn

    from trueflow.train.batch_invariant import register_backend

    assert register_backend() == BI.BACKEND and BI.enabled()
    _, (q, k, v), mask = joint_batch(3, (2, 5), 60)
    with attention_backend(BI.BACKEND):
        got = dispatch_attention_fn(q, k, v, attn_mask=mask[:, None, None, :])
    assert_bitwise(got, A.attention(q, k, v, mask, "batch_invariant"), "diffusers dispatch")
    with pytest.raises(ValueError, match="no dropout"):
        dispatch_attention_fn(q, k, v, dropout_p=0.1, backend=BI.BACKEND)


# -- the CUDA kernels, under Triton's interpreter ----------------------------------------------------------------------
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
INTERPRETER = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 child of "
                                                          "test_triton_kernels_interpreted")


@pytest.mark.skipif(INTERPRETING or not kernels.HAS_TRITON, reason="the child itself, or no triton")
def test_triton_kernels_interpreted():
    """The CUDA path's Triton kernels on the CPU: this file's interpreter cases in a child with TRITON_INTERPRET=1
    (which triton reads when it first compiles, so before diffusers imports it)."""
    root = Path(__file__).resolve().parents[1]
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "interpreted_case",
                            str(Path(__file__).relative_to(root))], cwd=root, capture_output=True, text=True,
                           env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert child.returncode == 0 and " passed" in child.stdout, child.stdout[-4000:] + child.stderr[-2000:]


def triton_module():
    from trueflow.kernels import triton_batch_invariant

    return triton_batch_invariant


@INTERPRETER
@pytest.mark.parametrize("k", [8, 96])  # LoRA's rank; a width over one K block
def test_interpreted_case_gemm(k):
    """Values: within one bf16 ulp of float64 (the interpreter truncates to bf16), fp32 close. Invariance: a row's
    bits alone, at any M and position, with the bias in the epilogue."""
    T = triton_module()
    for dtype in (BF16, torch.float32):
        w, b, x = randn((k, 80), 1, dtype=dtype), randn((80,), 2, dtype=dtype), randn((T._gemm_config(80, k)["BLOCK_M"]
                                                                                      + 9, k), 3, dtype=dtype)
        out = T.matmul(x, w, b, beta=0.5, alpha=2.0)
        ref = 2.0 * (x.to(F64) @ w.to(F64)) + 0.5 * b.to(F64)
        err = (out.to(F64) - ref).abs()
        tol = ref.abs() * (2 ** -7 if dtype == BF16 else 1e-5) + 1e-4
        assert (err <= tol).all(), f"{dtype}: max error {err.max():.3e}"
        for rows in (slice(0, 1), slice(5, 8), slice(130, 137)):
            assert_bitwise(T.matmul(x[rows], w, b, beta=0.5, alpha=2.0), out[rows], f"{dtype} rows {rows}")
    assert T._gemm_config(80, k) == T._gemm_config(80, k)  # one config per (N, K), never M


@INTERPRETER
def test_interpreted_case_row_reduce():
    T = triton_module()
    x = randn((3, 7, 300), 4, std=2.0, dtype=torch.float32)
    torch.testing.assert_close(T.row_reduce(x, "mean", True), x.to(F64).mean(-1, keepdim=True).float())
    torch.testing.assert_close(T.row_reduce(x, "norm", False), x.to(F64).norm(dim=-1).float())
    assert_bitwise(T.row_reduce(x[1:2, 2:4], "mean", False), T.row_reduce(x, "mean", False)[1:2, 2:4], "rows alone")


@INTERPRETER
def test_interpreted_case_attention():
    """Against SDPA on the valid keys (fp32), a padded row vs the sequence alone (bitwise), and the recomputing
    backward against autograd of masked SDPA."""
    T = triton_module()
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 70, 2, 16, generator=g) for _ in range(3))
    valid = torch.ones(2, 70, dtype=torch.bool)
    valid[0, 4:11] = False
    out = T.attention(q, k, v, valid, None)
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                         attn_mask=valid[:, None, None, :]).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    keep = valid[0]
    alone = T.attention(q[:1, keep], k[:1, keep], v[:1, keep], None, None)
    assert_bitwise(out[:1, keep], alone, "padded sample vs alone")
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    T.attention(qg, kg, vg, valid, None).sum().backward()
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (qr, kr, vr)),
                                   attn_mask=valid[:, None, None, :]).transpose(1, 2).sum().backward()
    for got, want in ((qg.grad, qr.grad), (kg.grad, kr.grad), (vg.grad, vr.grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@INTERPRETER
def test_interpreted_case_cuda_routes():
    """What the CUDA overrides hand the Triton kernels (called here on CPU tensors, which the interpreter runs): an
    addmm bias of any broadcast form as one row, the last-dim mean and 2-norm of `dim=[-1]` (keepdim or not)."""
    T = triton_module()
    a, b = randn((5, 24), 1, dtype=torch.float32), randn((24, 16), 2, dtype=torch.float32)
    row = randn((16,), 3, dtype=torch.float32)
    want = T.matmul(a, b, row)
    for bias in (row, row[None]):
        assert_bitwise(BI._addmm_cuda(None, bias, a, b), want, f"bias {tuple(bias.shape)}")
    torch.testing.assert_close(BI._addmm_cuda(None, torch.tensor(0.5), a, b, beta=2.0), a @ b + 1.0)
    x = randn((3, 4, 40), 4, dtype=torch.float32)
    assert_bitwise(BI._mean_cuda(None, x, [-1], True), T.row_reduce(x, "mean", True), "mean")
    assert_bitwise(BI._vector_norm_cuda(None, x, 2, [2], False), T.row_reduce(x, "norm", False), "norm")


# -- on a GPU (skipped without one; run these where one is lent) -------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and kernels.HAS_TRITON), reason="needs CUDA and triton")
def test_cuda_kernels_are_batch_invariant(weights, bi_mode):
    """The compiled Triton kernels behind the overrides: GEMM rows at real widths, the last-dim reductions, and the
    varlen attention (a padded sample vs its sequence alone)."""
    for (k, n), (w, b) in weights.items():
        w, b, x = w.cuda(), b.cuda(), randn((64, k), 3).cuda()
        for what, (batched, alone) in linear_cases(x[:16], w, b).items():
            assert_bitwise(batched, alone, f"K{k} N{n} {what}")
    x = randn((8, 37, 3584), 4).cuda()
    assert_bitwise(x.float().pow(2).mean(-1), torch.cat([x[i:i + 1].float().pow(2).mean(-1) for i in range(8)]), "mean")
    alone, (q, k, v), mask = joint_batch(1024, (7, 128), 5)
    out = BI.attention(q.cuda(), k.cuda(), v.cuda(), mask.cuda())
    assert_bitwise(valid_rows(out, 0, 7, 128).cpu(), BI.attention(*(t.cuda() for t in alone[0]))[0].cpu(), "padded")
    # No stock-GEMM failure side here: on an H200 (2026-12-02) cuBLAS gave one [64, 3072] x [3072, 12288] GEMM the
    # bits of 16 x 4 rows and of 64 x 1 row alike. The mode's failure side is the whole block's below (the plain
    # group under train micro-batches of 2 differs) and the full-size cell of scripts/gpu_batch_invariant.sh.


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and kernels.HAS_TRITON), reason="needs CUDA and triton")
def test_one_block_microgroup_8_against_micro_batches_of_2_on_cuda():
    """The mode on a GPU at real width, 512², text 128, LoRA 64: the engine's microgroup of 8 against the train side in
    micro-batches of 2, bitwise; the plain group's pairing under the same micro-batches is not."""
    from trueflow.parity.probe import ParityProbe, ProbeSpec

    spec = dict(random_size="one_block", batch=8, text_len=128, resolution=512, lora_rank=64, device="cuda",
                train_micro_batch=2)
    probe = ParityProbe(ProbeSpec(**spec, batch_invariant=True))
    assert probe.run(f"qwen_image:{BI.BACKEND}")[0].bitwise_equal
    BI.disable()
    assert not ParityProbe(ProbeSpec(**spec)).run("qwen_image")[0].bitwise_equal
