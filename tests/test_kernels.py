"""The fast ops (Triton kernels and their PyTorch fallbacks) against a float64 reference; and the eager-exact kernels
of the `qwen_image` patch group against the diffusers op sequences they replace, bitwise (second half).

Both compute in fp32 and round once per output, so every output must lie within half a bf16 ulp of the exact
(float64) value, plus an fp32-sized slack: `|out - ref| <= ulp(ref)/2 + 1e-5·(1 + |ref|)`. A double rounding (the
patch group's bf16 arithmetic) breaks that bound, which the negative control shows.

Where the Triton kernels run: on CUDA (tests marked gpu, skipped without it), and on the CPU under Triton's
interpreter when triton is installed (`pip install -e .[test]` installs it; skipped otherwise). The interpreter must
be on before anything imports triton (diffusers does, at import), so `test_triton_interpreter` runs this file's
interpreter cases in a child pytest started with TRITON_INTERPRET=1. (The interpreter truncates fp32 to bf16, so
there the bound is one ulp; a GPU rounds to nearest.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import BF16, EPS, assert_bitwise, assert_differs, randn
from trueflow import kernels
from trueflow.layers.modulation import (
    gated_residual_fused,
    layer_norm_scale_shift_fused,
    scale_residual_layer_norm_scale_shift_fused,
    scale_shift_fused,
)
from trueflow.layers.norms import rms_norm_fused
from trueflow.layers.rope import RopeTables, qk_norm_rope_fused, rope_tables_fused
from trueflow.models.qwen_image import patches as P
from trueflow.models.qwen_image.transformer import rope_positions

F64 = torch.float64
# [B, S, D]: a single token, an odd sequence at the real width (3072, not a power of two), and an odd width.
ROW_SHAPES = [(1, 1, 64), (2, 37, 3072), (3, 9, 200)]
RMS_SHAPES = [(2, 11, 3584), (5, 48)]  # the text norm's width (joint_attention_dim), and a 2-d input
# [B, S, H, D]: tiny heads; the real 24 heads x 128 at an odd sequence length; a non-power-of-2 head count and dim.
QK_SHAPES = [(1, 3, 2, 32), (2, 37, 24, 128), (1, 5, 3, 48)]


def ids(shapes):
    return ["x".join(map(str, s)) for s in shapes]


# -- the implementations under test: fallback, interpreter, CUDA -----------------------------------------------
class Fallback:
    """The layers' PyTorch code (what runs on a CPU)."""

    layer_norm_scale_shift = staticmethod(layer_norm_scale_shift_fused)
    scale_residual_layer_norm_scale_shift = staticmethod(scale_residual_layer_norm_scale_shift_fused)
    rms_norm = staticmethod(rms_norm_fused)

    @staticmethod
    def mul_add(a, b, c, k):
        """The kernel's `c + a·(k+b)` is the layers' gated residual for k = 0 and their scale-shift modulation
        `x·(1+scale)+shift` for k = 1."""
        assert k in (0.0, 1.0), k
        return gated_residual_fused(a, b, c) if k == 0 else scale_shift_fused(a, c, b)

    @staticmethod
    def qk_norm_rope(x, weight, eps, cos, sin, out=None):
        return qk_norm_rope_fused(x, weight, eps, RopeTables(cos=cos, sin=sin), out)


INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"  # set from the process's start: the child run
INTERPRETER = pytest.mark.skipif(not INTERPRETING,
                                 reason="runs in the TRITON_INTERPRET=1 child of test_triton_interpreter")
IMPLS = [
    pytest.param("fallback", id="fallback"),
    pytest.param("interpreter", id="interpreter", marks=INTERPRETER),
    pytest.param("cuda", id="triton-cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not (torch.cuda.is_available() and kernels.HAS_TRITON), reason="needs CUDA and triton")]),
]


@pytest.fixture
def impl(request) -> tuple[object, str, float]:
    """(ops, device, error bound in bf16 ulps) of the parametrized implementation."""
    if request.param == "fallback":
        return Fallback, "cpu", 0.5
    if request.param == "interpreter":
        # The interpreter casts fp32 to bf16 by truncation (numpy has no bf16; triton 3.9's `cast_impl`), where the
        # GPU rounds to nearest: up to one ulp here.
        return kernels.ops(), "cpu", 1.0
    return kernels.ops(), "cuda", 0.5


@pytest.mark.skipif(INTERPRETING or not kernels.HAS_TRITON or torch.cuda.is_available(),
                    reason="the child itself, or triton is not installed (pip install -e .[kernels]), or CUDA is "
                           "present (the compiled kernels are tested instead)")
def test_triton_interpreter():
    """The Triton kernels on the CPU: this file's interpreter cases in a child process with TRITON_INTERPRET=1."""
    root = Path(__file__).resolve().parents[1]
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "interpreter",
                            str(Path(__file__).relative_to(root))], cwd=root, capture_output=True, text=True,
                           env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert child.returncode == 0 and " passed" in child.stdout, child.stdout[-4000:] + child.stderr[-2000:]


# -- float64 references and the bound ------------------------------------------------------------------------------
def ln64(x: torch.Tensor) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(((x - mean) ** 2).mean(-1, keepdim=True) + EPS)


def rms64(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x**2).mean(-1, keepdim=True) + EPS)


def assert_one_rounding(out: torch.Tensor, ref: torch.Tensor, what: str, ulps: float = 0.5) -> None:
    """`out` (bf16) is the exact value `ref` (float64) rounded once: within `ulps` bf16 ulps plus fp32 slack."""
    assert out.dtype == BF16 and out.shape == ref.shape, (what, out.dtype, out.shape, ref.shape)
    out, ref = out.cpu().to(F64), ref.cpu()
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    mag = ref.abs().clamp_min(torch.finfo(F64).tiny)
    ulp = torch.exp2(torch.floor(torch.log2(mag)) - 7)  # bf16 keeps 8 significant bits
    err = (out - ref).abs()
    excess = err - (ulps * ulp + 1e-5 * (1 + ref.abs()))
    assert (excess <= 0).all(), f"{what}: max error {err.max():.3e} exceeds {ulps} bf16 ulp at {excess.argmax()}"


def modulation(batch: int, dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    """(shift, scale, gate) as the model passes them: row-strided chunks of one [B, 3·D] Linear output."""
    return randn((batch, 3 * dim), seed, std=0.5).chunk(3, dim=-1)


# -- tests -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS, indirect=True)
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=ids(ROW_SHAPES))
def test_layer_norm_scale_shift(impl, shape):
    ops, dev, ulps = impl
    x = randn(shape, 1, std=2.0, mean=0.5)
    shift, scale, _ = modulation(shape[0], shape[-1], 2)
    out = ops.layer_norm_scale_shift(x.to(dev), shift.to(dev), scale.to(dev), EPS)
    s64, sc64 = shift.to(F64)[:, None], scale.to(F64)[:, None]
    assert_one_rounding(out, ln64(x.to(F64)) * (1 + sc64) + s64, "layer_norm_scale_shift", ulps)


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=ids(ROW_SHAPES))
def test_scale_residual_layer_norm_scale_shift(impl, shape):
    ops, dev, ulps = impl
    residual, y = randn(shape, 3, std=4.0), randn(shape, 4)
    shift, scale, gate = modulation(shape[0], shape[-1], 5)
    r, out = ops.scale_residual_layer_norm_scale_shift(residual.to(dev), y.to(dev), gate.to(dev), shift.to(dev),
                                                       scale.to(dev), EPS)
    r64 = residual.to(F64) + gate.to(F64)[:, None] * y.to(F64)
    assert_one_rounding(r, r64, "residual", ulps)
    assert_one_rounding(out, ln64(r64) * (1 + scale.to(F64)[:, None]) + shift.to(F64)[:, None], "normed residual", ulps)


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
@pytest.mark.parametrize("k", [0.0, 1.0])
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=ids(ROW_SHAPES))
def test_mul_add(impl, shape, k):
    ops, dev, ulps = impl
    a, c = randn(shape, 6), randn(shape, 7, std=3.0)
    b = modulation(shape[0], shape[-1], 8)[2]
    out = ops.mul_add(a.to(dev), b.to(dev), c.to(dev), k)
    assert_one_rounding(out, c.to(F64) + a.to(F64) * (k + b.to(F64)[:, None]), "mul_add", ulps)


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
@pytest.mark.parametrize("shape", RMS_SHAPES, ids=ids(RMS_SHAPES))
def test_rms_norm(impl, shape):
    ops, dev, ulps = impl
    x = randn(shape, 9, std=2.0)
    weight = randn(shape[-1:], 10, std=0.1, mean=1.0)
    out = ops.rms_norm(x.to(dev), weight.to(dev), EPS)
    assert_one_rounding(out, rms64(x.to(F64)) * weight.to(F64), "rms_norm", ulps)


def rope64(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xn = rms64(x.to(F64)) * weight.to(F64)
    even, odd = xn[..., 0::2], xn[..., 1::2]
    c, s = cos.to(F64)[:, None, :], sin.to(F64)[:, None, :]
    return torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
@pytest.mark.parametrize("shape", QK_SHAPES, ids=ids(QK_SHAPES))
def test_qk_norm_rope(impl, shape):
    """k as the packed q/k/v GEMM gives it (a strided slice of [B, S, 3·H·D]), and the engine's own fp32 tables
    for a 1 x S image grid (positions up to ±S/2, so the rotation is far from the identity)."""
    ops, dev, ulps = impl
    B, S, H, D = shape
    qkv = randn((B, S, 3 * H * D), 11, std=2.0)
    x = qkv[..., H * D:2 * H * D].unflatten(-1, (H, D))  # k: a non-contiguous view, as the engine passes it
    weight = randn((D,), 12, std=0.1, mean=1.0)
    axes = {32: (8, 12, 12), 128: (16, 56, 56), 48: (8, 20, 20)}[D]
    grid, _ = rope_positions(1, S, 0)
    tables = rope_tables_fused(grid, axes, 10000, "cpu")
    out = ops.qk_norm_rope(x.to(dev), weight.to(dev), EPS, tables.cos.to(dev), tables.sin.to(dev))
    assert out.is_contiguous()
    assert_one_rounding(out, rope64(x, weight, tables.cos, tables.sin), "qk_norm_rope", ulps)
    # into the image rows of a joint attention buffer, as JointAttention passes it: the same bits, nothing else written
    buf = torch.zeros(B, S + 3, H, D, dtype=BF16, device=dev)
    into = ops.qk_norm_rope(x.to(dev), weight.to(dev), EPS, tables.cos.to(dev), tables.sin.to(dev), buf[:, 3:])
    assert into.data_ptr() == buf[:, 3:].data_ptr() and torch.equal(buf[:, 3:], out) and (buf[:, :3] == 0).all()


def test_double_rounding_breaks_the_bound():
    """Negative control: the patch group's bf16 arithmetic (each op rounded) is outside the one-rounding bound."""
    x = randn((2, 37, 3072), 1, std=2.0, mean=0.5)
    shift, scale, _ = modulation(2, 3072, 2)
    ref = ln64(x.to(F64)) * (1 + scale.to(F64)[:, None]) + shift.to(F64)[:, None]
    with pytest.raises(AssertionError, match="exceeds 0.5 bf16 ulp"):
        assert_one_rounding(P.layer_norm_scale_shift_reference(x, shift, scale, EPS), ref, "reference")


@INTERPRETER
def test_layers_dispatch_to_kernels_interpreter(monkeypatch):
    """The layers' fast functions hand CUDA tensors to the kernels: with the device check forced on, each one's
    output is the (interpreted) kernel's, bitwise; a CPU tensor normally takes the fallback."""
    assert not kernels.use_triton(torch.zeros(1))
    x, y, w = randn((2, 5, 64), 1), randn((2, 5, 64), 2), randn((64,), 3, mean=1.0)
    shift, scale, gate = modulation(2, 64, 4)
    q = randn((2, 5, 2, 32), 5)
    tables = rope_tables_fused(rope_positions(1, 5, 0)[0], (8, 12, 12), 10000, "cpu")
    ops = kernels.ops()
    calls = {  # fast layer function -> (its arguments, the kernel's output)
        layer_norm_scale_shift_fused: ((x, shift, scale, EPS), ops.layer_norm_scale_shift(x, shift, scale, EPS)),
        scale_residual_layer_norm_scale_shift_fused: (
            (x, y, gate, shift, scale, EPS), ops.scale_residual_layer_norm_scale_shift(x, y, gate, shift, scale, EPS)),
        gated_residual_fused: ((x, gate, y), ops.mul_add(x, gate, y, 0.0)),
        rms_norm_fused: ((x, w, EPS), ops.rms_norm(x, w, EPS)),
        qk_norm_rope_fused: ((q, w[:32], EPS, tables), ops.qk_norm_rope(q, w[:32], EPS, tables.cos, tables.sin)),
    }
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    for fused, (args, expect) in calls.items():
        got = fused(*args)
        for g, e in zip(got if isinstance(got, tuple) else (got,), expect if isinstance(expect, tuple) else (expect,)):
            assert torch.equal(g, e), fused.__name__


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and kernels.HAS_TRITON), reason="needs CUDA and triton")
def test_layers_use_triton_on_cuda(monkeypatch):
    x, w = randn((2, 37, 3584), 1).cuda(), randn((3584,), 2, mean=1.0).cuda()
    assert kernels.use_triton(x)
    assert torch.equal(rms_norm_fused(x, w, EPS), kernels.ops().rms_norm(x, w, EPS))
    monkeypatch.setattr(kernels, "ENABLED", False)  # TRUEFLOW_TRITON=0
    assert not kernels.use_triton(x)


# == eager-exact kernels (the qwen_image patch group on CUDA) against the diffusers op sequences, bitwise ===========
# Oracles: diffusers' own modules and expressions, run eagerly on the same device. The patch group's `*_exact`
# functions are called, so the dispatch is tested too: in the interpreter child `use_triton` is forced on (its
# tensors are CPU ones); on CUDA it is on by itself.
EXACT_IMPLS = [
    pytest.param("interpreter", id="interpreter", marks=INTERPRETER),
    pytest.param("cuda", id="triton-cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not (torch.cuda.is_available() and kernels.HAS_TRITON), reason="needs CUDA and triton")]),
]


@pytest.fixture
def exact(request, monkeypatch) -> str:
    """The device the eager-exact kernels run on, with the patch group's kernel dispatch on."""
    if request.param == "interpreter":
        monkeypatch.setattr(kernels, "use_triton", lambda t: True)
        return "cpu"
    return "cuda"


@pytest.fixture(scope="module")
def diffusers_block():
    """A diffusers block for its `_modulate` arithmetic (independent of the block's width)."""
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock

    return QwenImageTransformerBlock(dim=64, num_attention_heads=2, attention_head_dim=32).to(BF16).eval()


def layer_norm(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.LayerNorm(x.shape[-1], elementwise_affine=False, eps=EPS)(x)  # diffusers' norm1/norm2



def failure_side(once: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """The engine's once-rounded fast op differs from the op sequence: shown on the inputs large enough to be sure
    of it (a few dozen elements may all round alike; the crafted tests show it for single values)."""
    if ref.numel() >= 4096:
        assert_differs(once, ref, what)


def craft(value: float, shape, dev: str) -> torch.Tensor:
    return torch.full(shape, value, dtype=BF16, device=dev)


# Double rounding, by hand: p = (1 - 2^-8)(1 + 2^-7) = 1 + 2^-8 - 2^-15 rounds to 1.0 in bf16, and 256 + 1.0 = 257 is
# a tie that rounds to even, 256. Rounded once, 256 + p = 257.0039 rounds to 258.
BELOW_ONE, ABOVE_ONE, BIG = 1 - 2**-8, 1 + 2**-7, 256.0


@pytest.mark.parametrize("exact", EXACT_IMPLS, indirect=True)
@pytest.mark.parametrize("k", [0.0, 1.0])
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=ids(ROW_SHAPES))
def test_mul_add_exact(exact, shape, k):
    dev = exact
    a, c = randn(shape, 6).to(dev), randn(shape, 7, std=3.0).to(dev)
    b = modulation(shape[0], shape[-1], 8)[2].to(dev)
    # diffusers' gated residual `hidden_states + gate.unsqueeze(1) * output` (k = 0, what the patch group runs); the
    # kernel's mul-add for k != 0
    ref = c + b[:, None] * a if k == 0 else c + a * (k + b[:, None])
    got = P.gated_residual_exact(a, b, c) if k == 0 else kernels.ops().mul_add_eager_bf16(a, b, c, k)
    assert_bitwise(got, ref, "gated_residual_exact" if k == 0 else "mul_add_eager_bf16")
    failure_side(Fallback.mul_add(a, b, c, k), ref, "once-rounded mul_add")


@pytest.mark.parametrize("exact", EXACT_IMPLS, indirect=True)
def test_mul_add_exact_crafted(exact):
    dev, shape = exact, (2, 3, 200)
    a, b, c = craft(BELOW_ONE, shape, dev), craft(ABOVE_ONE, shape[::2], dev), craft(BIG, shape, dev)
    ref = c + b[:, None] * a
    assert (ref == BIG).all()
    assert_bitwise(kernels.ops().mul_add_eager_bf16(a, b, c, 0.0), ref, "kernel")
    once = (c.float() + a.float() * b.float()[:, None]).to(BF16)
    assert (once == BIG + 2).all(), "the once-rounded mul-add rounds 257.0039 up"


@pytest.mark.parametrize("exact", EXACT_IMPLS, indirect=True)
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=ids(ROW_SHAPES))
def test_layer_norm_scale_shift_exact(exact, shape, diffusers_block):
    dev = exact
    x = randn(shape, 1, std=2.0, mean=0.5).to(dev)
    mod = randn((shape[0], 3 * shape[-1]), 2, std=0.5).to(dev)
    shift, scale, _ = mod.chunk(3, dim=-1)
    ref, _ = diffusers_block.to(dev)._modulate(layer_norm(x), mod)
    assert_bitwise(P.layer_norm_scale_shift_exact(x, shift, scale, EPS), ref, "layer_norm_scale_shift_exact")
    failure_side(layer_norm_scale_shift_fused(x, shift, scale, EPS), ref, "once-rounded layer_norm_scale_shift")


@pytest.mark.parametrize("exact", EXACT_IMPLS, indirect=True)
def test_scale_shift_exact_crafted(exact, diffusers_block):
    dev, (B, S, D) = exact, (2, 3, 64)
    xn = craft(BELOW_ONE, (B, S, D), dev)
    mod = torch.cat([craft(BIG, (B, D), dev), craft(2**-7, (B, D), dev), craft(0.0, (B, D), dev)], dim=-1)
    shift, scale, _ = mod.chunk(3, dim=-1)
    ref, _ = diffusers_block.to(dev)._modulate(xn, mod)
    assert (ref == BIG).all()
    assert_bitwise(kernels.ops().scale_shift_eager_bf16(xn, shift, scale), ref, "kernel")
    once = (xn.float() * (1 + scale.float()[:, None]) + shift.float()[:, None]).to(BF16)
    assert (once == BIG + 2).all(), "the once-rounded modulation rounds 257.0039 up"


@pytest.mark.parametrize("exact", EXACT_IMPLS, indirect=True)
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=ids(ROW_SHAPES))
def test_scale_residual_layer_norm_scale_shift_exact(exact, shape, diffusers_block):
    dev = exact
    residual, y = randn(shape, 3, std=4.0).to(dev), randn(shape, 4).to(dev)
    mod = randn((shape[0], 6 * shape[-1]), 5, std=0.5).to(dev)
    mod1, mod2 = mod.chunk(2, dim=-1)
    _, _, gate1, shift2, scale2, _ = mod.chunk(6, dim=-1)
    block = diffusers_block.to(dev)
    # QwenImageTransformerBlock.forward: hidden_states = hidden_states + img_gate1 * img_attn_output; then norm2
    r_ref = residual + mod1.chunk(3, dim=-1)[2].unsqueeze(1) * y
    out_ref, _ = block._modulate(layer_norm(r_ref), mod2)
    r, out = P.scale_residual_layer_norm_scale_shift_exact(residual, y, gate1, shift2, scale2, EPS)
    assert_bitwise(r, r_ref, "residual")
    assert_bitwise(out, out_ref, "normed + modulated")
    r_once, out_once = scale_residual_layer_norm_scale_shift_fused(residual, y, gate1, shift2, scale2, EPS)
    failure_side(out_once, out_ref, "once-rounded")


@pytest.mark.parametrize("exact", EXACT_IMPLS, indirect=True)
@pytest.mark.parametrize("shape", [(2, 11, 3584), (1, 5, 3, 48)], ids=["2x11x3584", "1x5x3x48"])
def test_rms_norm_exact(exact, shape):
    from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm

    dev = exact
    x = randn(shape, 9, std=2.0).to(dev)
    norm = DiffusersRMSNorm(shape[-1], eps=EPS).to(BF16).to(dev)
    with torch.no_grad():
        norm.weight.copy_(randn(shape[-1:], 10, std=0.1, mean=1.0))
        ref = norm(x)
    assert_bitwise(P.rms_norm_exact(x, norm.weight.detach(), EPS), ref, "rms_norm_exact")
    failure_side(rms_norm_fused(x, norm.weight.detach(), EPS), ref, "once-rounded rms_norm")


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fma(a, b, c), exactly, for a bf16-valued a: the product is exact in float64 (8 + 24 bits); the sum's
    float64 error (TwoSum) decides a float64 result that sits exactly halfway between two fp32 numbers."""
    p, z = a.double() * b.double(), c.double()
    s = p + z
    bb = s - p
    err = (p - (s - bb)) + (z - bb)
    r = s.float()
    toward = torch.nextafter(r, torch.where(s > r.double(), torch.inf, -torch.inf).float())
    tie = (s != r.double()) & ((s - r.double()).abs() == (toward.double() - s).abs())
    return torch.where(tie & (err != 0) & ((err > 0) == (s > r.double())), toward, r)


def cuda_complex_rope(y: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """diffusers' `view_as_complex(y.float()) * freqs` as PyTorch's CUDA kernel rounds it (c10::complex's product with
    nvcc's contraction: real = fma(a, c, -(b·d)), imag = fma(b, c, a·d); verified bitwise against PyTorch on GPUs by
    PaddlePaddle PR #79469), then `.type_as(y)`."""
    a, b = y.float()[..., 0::2], y.float()[..., 1::2]
    c, d = freqs.real[:, None, :], freqs.imag[:, None, :]
    re, im = fma32(a, c.expand_as(a), -(b * d)), fma32(b, c.expand_as(b), a * d)
    return torch.stack((re, im), dim=-1).flatten(-2).to(y.dtype)


@pytest.mark.parametrize("exact", EXACT_IMPLS, indirect=True)
@pytest.mark.parametrize("shape", [(1, 3, 2, 32), (2, 37, 24, 128)], ids=ids([(1, 3, 2, 32), (2, 37, 24, 128)]))
def test_qk_norm_rope_exact(exact, shape):
    """k as the packed q/k/v GEMM gives it (a strided slice), diffusers' polar tables for a 1 x S grid; written into
    a heads-major joint buffer (the cuDNN layout) as the engine does, and returned fresh."""
    from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm
    from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

    dev = exact
    B, S, H, D = shape
    x = randn((B, S, 3 * H * D), 11, std=2.0)[..., H * D:2 * H * D].unflatten(-1, (H, D)).to(dev)
    norm = DiffusersRMSNorm(D, eps=EPS).to(BF16).to(dev)
    with torch.no_grad():
        norm.weight.copy_(randn((D,), 12, std=0.1, mean=1.0))
    w = norm.weight.detach()
    axes = {32: (8, 12, 12), 128: (16, 56, 56)}[D]
    tables = P.rope_tables_reference(rope_positions(1, S, 0)[0], axes, 10000, dev)
    with torch.no_grad():
        ref = apply_rotary_emb_qwen(norm(x), tables.freqs, use_real=False)
    buf = torch.zeros(B, H, S + 2, D, dtype=BF16, device=dev).permute(0, 2, 1, 3)
    got = P.qk_norm_rope_exact(x, w, EPS, tables, out=buf[:, 2:])
    # The kernel variant is the device's complex-product rounding, found by running PyTorch's: on the CPU every
    # product rounds; on CUDA some variant must reproduce it (nvcc's contraction: True).
    fma = P.complex_fma(x.device)
    assert fma is False if dev == "cpu" else fma is not None, fma
    assert got.data_ptr() == buf[:, 2:].data_ptr() and (buf[:, :2] == 0).all(), "written in place, rows 2.. only"
    assert_bitwise(got, ref, "qk_norm_rope_exact")
    failure_side(qk_norm_rope_fused(x, w, EPS, RopeTables(cos=tables.freqs.real.contiguous(),
                                                          sin=tables.freqs.imag.contiguous())),
                 ref, "once-rounded qk_norm_rope")


@INTERPRETER
def test_qk_norm_rope_cuda_variant_interpreter():
    """The kernel's CUDA variant (what `qk_norm_rope_exact` runs where PyTorch fuses the complex product's
    multiply-add) is the CUDA formula bitwise, on a sample (seed 101) in which fusing changes both a real and an
    imaginary part."""
    S, H, D = 37, 24, 128
    x = randn((1, S, H, D), 101, std=2.0)
    w = randn((D,), 12, std=0.1, mean=1.0)
    tables = P.rope_tables_reference(rope_positions(1, S, 0)[0], (16, 56, 56), 10000, "cpu")
    y = P.rms_norm_reference(x, w, EPS)
    formula = cuda_complex_rope(y, tables.freqs)
    cpu = P.qk_norm_rope_reference(x, w, EPS, tables)  # every product rounded
    differs = (formula != cpu).flatten(-2).unflatten(-1, (-1, 2))
    assert differs[..., 0].any() and differs[..., 1].any(), "the sample must tell the two roundings apart"
    got = kernels.ops().rms_norm_eager_bf16(x, w, EPS, tables.freqs, complex_fma=True)
    assert_bitwise(got, formula, "CUDA variant vs the CUDA formula")
