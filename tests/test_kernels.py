"""The fast ops (Triton kernels and their PyTorch fallbacks) against a float64 reference; and the eager-exact kernels
of the `qwen_image` and `ltx` patch groups against the diffusers op sequences they replace, bitwise (second half).

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
    attention_gate_fused,
    gated_residual_fused,
    layer_norm_scale_shift_fused,
    rms_norm_scale_shift_fused,
    scale_residual_layer_norm_scale_shift_fused,
    scale_shift_fused,
)
from trueflow.layers.norms import rms_norm_fused
from trueflow.layers.rope import RopeTables, qk_norm_across_heads_rope_fused, qk_norm_rope_fused, rope_tables_fused
from trueflow.models.ltx2 import patches as LTX
from trueflow.models.ltx2.transformer import LTX2Config
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
    rms_norm_scale_shift = staticmethod(rms_norm_scale_shift_fused)
    scale_shift = staticmethod(scale_shift_fused)
    attention_gate = staticmethod(attention_gate_fused)

    @staticmethod
    def qk_norm_across_heads_rope(x, weight, eps, cos, sin, split):
        tables = None if cos is None else RopeTables(cos=cos, sin=sin, pairs="split" if split else "interleaved")
        return qk_norm_across_heads_rope_fused(x.flatten(2), weight, eps, x.shape[2], tables)

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


# -- LTX-2.3's fast ops: rows [B, 1, D] and per token [B, S, D], the weightless RMSNorm, qk-norm across heads, gate ----
ROW_LAYOUTS = ["per_sample", "per_token"]


def rows_of(layout: str, B: int, S: int, D: int, seed: int) -> tuple[torch.Tensor, ...]:
    """(shift, scale, gate) [B, 1, D] (`get_mod_params` of one timestep a sample) or [B, S, D] (a timestep per token),
    row-strided chunks of one tensor as the model makes them."""
    return randn((B, 1 if layout == "per_sample" else S, 3 * D), seed, std=0.5).chunk(3, dim=-1)


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
@pytest.mark.parametrize("layout", ROW_LAYOUTS)
def test_row_layouts(impl, layout):
    """Every row kernel with [B, 1, D] and [B, S, D] rows; the weightless RMSNorm + modulation and the bare
    modulation (LTX-2.3's norms and its text k/v modulation)."""
    ops, dev, ulps = impl
    B, S, D = 2, 5, 200
    x, y = randn((B, S, D), 1, std=2.0, mean=0.5), randn((B, S, D), 2)
    shift, scale, gate = rows_of(layout, B, S, D, 3)
    X, Y, sh, sc, g = (t.to(F64) for t in (x, y, shift, scale, gate))
    x, y, shift, scale, gate = (t.to(dev) for t in (x, y, shift, scale, gate))
    assert_one_rounding(ops.layer_norm_scale_shift(x, shift, scale, EPS), ln64(X) * (1 + sc) + sh, "ln", ulps)
    r, out = ops.scale_residual_layer_norm_scale_shift(x, y, gate, shift, scale, EPS)
    assert_one_rounding(r, X + g * Y, "residual", ulps)
    assert_one_rounding(out, ln64(X + g * Y) * (1 + sc) + sh, "normed residual", ulps)
    assert_one_rounding(ops.mul_add(y, gate, x, 0.0), X + Y * g, "gated residual", ulps)
    assert_one_rounding(ops.rms_norm_scale_shift(x, shift, scale, EPS), rms64(X) * (1 + sc) + sh, "rms", ulps)
    assert_one_rounding(ops.scale_shift(x, shift, scale), X * (1 + sc) + sh, "scale_shift", ulps)


def rotate64(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, split: bool) -> torch.Tensor:
    """y [B, S, H, D] float64 rotated by tables [S, D/2] or [1, H, S, D/2]: split halves or interleaved pairs."""
    c, s = ((t.to(F64)[:, None, :] if t.dim() == 2 else t.to(F64)[0].transpose(0, 1)) for t in (cos, sin))
    if split:
        a, b = y.chunk(2, dim=-1)
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    even, odd = y[..., 0::2], y[..., 1::2]
    return torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)


# (pairing, [B, S, H, D]): LTX-2.3's split halves with per-head tables at its head width; Wan's interleaved pairs with
# one shared table at an odd head count and width; the text attention's norm alone.
QK_ACROSS = [("split", (1, 6, 2, 128)), ("interleaved", (2, 5, 3, 48)), ("none", (1, 3, 4, 32))]


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
@pytest.mark.parametrize("pairs,shape", QK_ACROSS, ids=[p for p, _ in QK_ACROSS])
def test_qk_norm_across_heads_rope(impl, pairs, shape):
    """q as the packed q/k/v/gate GEMM gives it (a strided slice), normed over all heads, then rotated."""
    ops, dev, ulps = impl
    B, S, H, D = shape
    x = randn((B, S, 3 * H * D + H), 11, std=2.0)[..., :H * D].unflatten(-1, (H, D))
    weight = randn((H * D,), 12, std=0.1, mean=1.0)
    angles = randn((S, H, D // 2) if pairs == "split" else (S, D // 2), 13, std=3.0, dtype=torch.float32)
    if pairs == "split":  # per head [1, H, S, D/2], a transposed view as LTX-2's tables are built (no copy)
        angles = angles.transpose(0, 1).unsqueeze(0)
    cos, sin = (angles.cos(), angles.sin()) if pairs != "none" else (None, None)
    out = ops.qk_norm_across_heads_rope(x.to(dev), weight.to(dev), EPS, None if cos is None else cos.to(dev),
                                        None if sin is None else sin.to(dev), pairs == "split")
    assert out.is_contiguous() and out.shape == (B, S, H, D)
    y = (rms64(x.flatten(2).to(F64)) * weight.to(F64)).unflatten(-1, (H, D))
    assert_one_rounding(out, y if cos is None else rotate64(y, cos, sin, pairs == "split"), "qk across heads", ulps)


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
def test_attention_gate(impl):
    """SDPA's output permuted back to [B, S, H, D], the logits a slice of the packed q/gate GEMM."""
    ops, dev, ulps = impl
    B, S, H, D = 2, 5, 3, 32
    out = randn((B, H, S, D), 14, std=2.0).permute(0, 2, 1, 3)
    logits = randn((B, S, H * D + H), 15, std=2.0)[..., H * D:]
    gated = ops.attention_gate(out.to(dev), logits.to(dev))
    gate64 = 2 * torch.sigmoid(logits.to(F64))
    assert_one_rounding(gated, out.to(F64) * gate64[..., None], "attention gate", ulps)


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
    split = RopeTables(cos=tables.cos[None, None].expand(1, 2, 5, 16).contiguous(),
                       sin=tables.sin[None, None].expand(1, 2, 5, 16).contiguous(), pairs="split")
    rows, logits = modulation(2, 64, 6)[0][:, None], randn((2, 5, 2), 7)
    ops = kernels.ops()
    calls = {  # fast layer function -> (its arguments, the kernel's output)
        layer_norm_scale_shift_fused: ((x, shift, scale, EPS), ops.layer_norm_scale_shift(x, shift, scale, EPS)),
        scale_residual_layer_norm_scale_shift_fused: (
            (x, y, gate, shift, scale, EPS), ops.scale_residual_layer_norm_scale_shift(x, y, gate, shift, scale, EPS)),
        gated_residual_fused: ((x, gate, y), ops.mul_add(x, gate, y, 0.0)),
        rms_norm_fused: ((x, w, EPS), ops.rms_norm(x, w, EPS)),
        qk_norm_rope_fused: ((q, w[:32], EPS, tables), ops.qk_norm_rope(q, w[:32], EPS, tables.cos, tables.sin)),
        rms_norm_scale_shift_fused: ((x, rows, shift, EPS), ops.rms_norm_scale_shift(x, rows, shift, EPS)),
        scale_shift_fused: ((x, rows, shift), ops.scale_shift(x, rows, shift)),
        attention_gate_fused: ((q, logits), ops.attention_gate(q, logits)),
        qk_norm_across_heads_rope_fused: ((q.flatten(2), w, EPS, 2, split),
                                          ops.qk_norm_across_heads_rope(q, w, EPS, split.cos, split.sin, True)),
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


# -- the `ltx` group's eager-exact kernels against diffusers' LTX-2.3 op sequences (LTX2VideoTransformerBlock.forward,
# LTX2AudioVideoAttnProcessor, apply_split_rotary_emb), bitwise --------------------------------------------------------
@pytest.mark.parametrize("exact", EXACT_IMPLS, indirect=True)
@pytest.mark.parametrize("layout", ROW_LAYOUTS)
def test_ltx_modulation_exact(exact, layout):
    """The block's weightless RMSNorm + modulation, the text's k/v modulation, the gated residual and the output
    LayerNorm + modulation, with rows [B, 1, D] (one timestep a sample) and [B, S, D] (one a token)."""
    from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm

    dev, (B, S, D) = exact, (2, 5, 1024)
    x, y = randn((B, S, D), 1, std=2.0, mean=0.5).to(dev), randn((B, S, D), 2).to(dev)
    shift, scale, gate = (t.to(dev) for t in rows_of(layout, B, S, D, 3))
    with torch.no_grad():
        normed = DiffusersRMSNorm(D, eps=EPS, elementwise_affine=False)(x)  # the block's norm1/norm2/norm3
        layer_normed = torch.nn.LayerNorm(D, eps=1e-6, elementwise_affine=False)(x)  # the output norm_out
    cases = {  # what: (the group's exact function's output, diffusers' expression, the fast op's output)
        "rms_norm_scale_shift": (LTX.rms_norm_scale_shift_exact(x, shift, scale, EPS), normed * (1 + scale) + shift,
                                 rms_norm_scale_shift_fused(x, shift, scale, EPS)),
        "text_kv_modulation": (LTX.scale_shift_exact(x, shift, scale), x * (1 + scale) + shift,
                               scale_shift_fused(x, shift, scale)),
        "gated_residual": (LTX.gated_residual_exact(y, gate, x), x + y * gate, gated_residual_fused(y, gate, x)),
        "layer_norm_scale_shift": (LTX.layer_norm_scale_shift_exact(x, shift, scale, 1e-6),
                                   layer_normed * (1 + scale) + shift,
                                   layer_norm_scale_shift_fused(x, shift, scale, 1e-6)),
    }
    for what, (got, ref, once) in cases.items():
        assert_bitwise(got, ref, what)
        failure_side(once, ref, f"once-rounded {what}")


@pytest.mark.parametrize("exact", EXACT_IMPLS, indirect=True)
def test_ltx_qk_norm_rope_exact(exact):
    """`torch.nn.RMSNorm(H·D)` then the split RoPE with the group's (diffusers-built) per-head tables, at the real
    head width (2 x 128); the text attention's norm alone."""
    from diffusers.models.transformers.transformer_ltx2 import apply_split_rotary_emb

    dev, (B, grid, H, D) = exact, (2, (2, 2, 3), 2, 128)
    S = grid[0] * grid[1] * grid[2]
    x = randn((B, S, H * D), 50, std=3.0).to(dev)
    norm = torch.nn.RMSNorm(H * D, eps=EPS).to(BF16).to(dev)  # LTX2Attention's norm_q / norm_k
    with torch.no_grad():
        norm.weight.copy_(randn((H * D,), 51, std=0.3, mean=1.0))
        normed = norm(x)
    w = norm.weight.detach()
    tables = LTX.rope_tables_reference(LTX2Config(num_attention_heads=H, attention_head_dim=D), grid, 24.0, dev)
    ref = apply_split_rotary_emb(normed, tuple(t.expand(B, -1, -1, -1) for t in (tables.cos, tables.sin)))
    assert LTX.split_rope_fma(x.device) is not None
    assert_bitwise(LTX.qk_norm_rope_exact(x, w, EPS, H, tables), ref.unflatten(-1, (H, D)), "qk_norm_rope_exact")
    assert_bitwise(LTX.qk_norm_rope_exact(x, w, EPS, H, None), normed.unflatten(-1, (H, D)), "norm alone")
    failure_side(qk_norm_across_heads_rope_fused(x, w, EPS, H, tables), ref.unflatten(-1, (H, D)),
                 "once-rounded qk_norm_rope")


@pytest.mark.parametrize("exact", EXACT_IMPLS, indirect=True)
def test_split_rope_fma_sample_decides(exact):
    """The sample `split_rope_fma` decides on: in head 0's first half and head 1's second, `1 + q·3` with the product
    fused into the sum is bf16 1 + 2^-7, with the product rounded first 1.0; every other entry is 3.0 either way.
    diffusers' split RoPE on the device is one of the two, and `split_rope_fma` names which."""
    from diffusers.models.transformers.transformer_ltx2 import apply_split_rotary_emb

    y, tables = LTX.split_rope_fma_sample(exact)
    fused, rounded = (kernels.ops().split_rope_eager_bf16(y, tables.cos, tables.sin, fma) for fma in (True, False))
    first = torch.zeros(256, dtype=torch.bool)
    first[:64] = first[192:] = True  # the two halves that tell them apart
    assert (fused[0, 0, first] == 1 + 2**-7).all() and (rounded[0, 0, first] == 1).all()
    assert (fused[0, 0, ~first] == 3).all() and (rounded[0, 0, ~first] == 3).all()
    ref = apply_split_rotary_emb(y, (tables.cos, tables.sin))
    assert torch.equal(ref, fused) or torch.equal(ref, rounded), "neither rounding is the device's"
    assert LTX.split_rope_fma(y.device) is torch.equal(ref, fused)
