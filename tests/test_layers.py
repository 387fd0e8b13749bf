"""The shared layers every family is wired from (`trueflow/layers`).

The attention dispatcher: its registry (an unknown name refused with the registered ones; a name registered twice
refused), each kernel against the SDPA call it stands for and diffusers' backend of that name (bitwise), the mask
forms both families pass, the flash kernel's masked fallback, and that both families' engine models route every
attention call through it (a kernel registered here and selected on a built tiny model is the one that runs).
The rotary embedding: both pairings, both table layouts, per-head and across-heads norms, against the complex
multiplication they are (float64). The modulation ops: [B, D] and [B, T, D] rows, and Triton only for [B, D] rows
(the kernels' layout), as before the families shared these ops.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import attention_backend, dispatch_attention_fn
from torch.nn.attention import SDPBackend, sdpa_kernel

from conftest import BF16, EPS, assert_bitwise, assert_differs, randn
from trueflow import kernels
from trueflow.layers import attention as A
from trueflow.layers import modulation as M
from trueflow.layers.rope import RopeTables, qk_norm_across_heads_rope_fused, qk_norm_rope_fused, rotate_f32

B, S, L, H, D = 2, 9, 6, 2, 16


def qkv(seed: int, dtype: torch.dtype = BF16) -> tuple[torch.Tensor, ...]:
    """q [B, S, H, D] and k/v [B, L, H, D], as strided views of packed projections (as the families pass them)."""
    q = randn((B, S, 3 * H * D), seed, dtype=dtype)[..., :H * D].unflatten(-1, (H, D))
    k, v = randn((B, L, 2 * H * D), seed + 1, dtype=dtype).chunk(2, dim=-1)
    return q, k.unflatten(-1, (H, D)), v.unflatten(-1, (H, D))


def key_mask() -> torch.Tensor:
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, 4:] = False
    return mask


def direct(q, k, v, mask=None, pinned: SDPBackend | None = None, contiguous: bool = False) -> torch.Tensor:
    """The SDPA call a kernel stands for, written out: permuted [B, H, S, D] views (contiguous copies for cuDNN)."""
    q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))
    if contiguous:
        q, k, v = (t.contiguous() for t in (q, k, v))
    if pinned is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).permute(0, 2, 1, 3)
    with sdpa_kernel(pinned):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).permute(0, 2, 1, 3)


# -- the registry ----------------------------------------------------------------------------------------------------
def test_registry_names_and_refusals():
    assert set(A.KERNELS) >= {"sdpa", "math", "efficient", "flash", "cudnn"}
    q, k, v = qkv(1)
    for call in (lambda: A.attention(q, k, v, None, "native"), lambda: A.joint_buffer(k, q, "native")):
        with pytest.raises(ValueError) as err:
            call()
        assert str(err.value) == f"unknown attention backend 'native'; choose one of {', '.join(A.KERNELS)}"
    with pytest.raises(ValueError, match="'flash' is registered already"):
        A.register("flash")(lambda q, k, v, mask: q)
    assert [n for n, kern in A.KERNELS.items() if kern.heads_major] == ["sdpa_heads_major", "cudnn"]
    assert {n for n, kern in A.KERNELS.items() if kern.cuda_only} == {"cudnn", "efficient"}


def test_sdpa_heads_major_is_sdpas_choice_on_contiguous_heads_major_tensors(monkeypatch):
    """What a processor that `torch.cat`s its streams' [B, H, S, D] views hands SDPA itself (SD3's): contiguous
    heads-major q/k/v, PyTorch's kernel choice; `joint_buffer` lays them out so, and the result is the written-out
    call's."""
    q, k, v = qkv(7)
    seen = []
    real_sdpa = F.scaled_dot_product_attention

    def spy(query, key, value, **kwargs):
        seen.append(all(t.is_contiguous() for t in (query, key, value)))
        return real_sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    assert_bitwise(A.attention(q, k, v, None, "sdpa_heads_major"), direct(q, k, v, None, None, contiguous=True),
                   "sdpa_heads_major vs SDPA")
    buffer = A.joint_buffer(q[:, :3], q[:, 3:], "sdpa_heads_major")
    assert buffer.permute(0, 2, 1, 3).is_contiguous() and seen == [True, True]


CPU_KERNELS = [("sdpa", None, "native"), ("math", SDPBackend.MATH, "_native_math"),
               ("flash", SDPBackend.FLASH_ATTENTION, "_native_flash")]


@pytest.mark.parametrize("name,pinned,backend", CPU_KERNELS, ids=[c[0] for c in CPU_KERNELS])
def test_kernel_is_the_sdpa_call_it_stands_for(name, pinned, backend, monkeypatch):
    """Bitwise the written-out SDPA call and diffusers' backend of that name, on the permuted views they pass."""
    q, k, v = qkv(2)
    seen = []
    real_sdpa = F.scaled_dot_product_attention

    def spy(query, key, value, **kwargs):
        seen.append(tuple(t.stride() for t in (query, key, value)))
        return real_sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    out = A.attention(q, k, v, None, name)
    assert_bitwise(out, direct(q, k, v, None, pinned), f"{name} vs SDPA")
    with attention_backend(backend):
        assert_bitwise(out, dispatch_attention_fn(q, k, v), f"{name} vs diffusers' {backend}")
    assert seen[0] == seen[1] == seen[2] == tuple(t.permute(0, 2, 1, 3).stride() for t in (q, k, v))


def test_the_pinned_kernel_is_the_one_that_runs():
    """The failure side: on ordinary scores with a bias, the pinned math kernel and SDPA's own (CPU flash) choice
    round apart, so a kernel that pinned nothing (or another kernel) would fail the equalities above."""
    q, k, v = qkv(3)
    bias = torch.where(key_mask(), 0.0, -10000.0).to(BF16)[:, None, None, :].expand(B, H, 1, L)
    assert_differs(A.attention(q, k, v, bias, "math"), A.attention(q, k, v, bias, "sdpa"), "math vs sdpa")


@pytest.mark.parametrize("name", ["cudnn", "efficient"])
def test_cuda_only_kernels_are_refused_elsewhere(name):
    q, k, v = qkv(4)
    with pytest.raises(ValueError, match=f"the {name} attention backend runs on CUDA only"):
        A.attention(q, k, v, None, name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name,pinned,backend,contiguous", [
    ("cudnn", SDPBackend.CUDNN_ATTENTION, "_native_cudnn", True),
    ("efficient", SDPBackend.EFFICIENT_ATTENTION, "_native_efficient", False),
    ("flash", SDPBackend.FLASH_ATTENTION, "_native_flash", False)], ids=["cudnn", "efficient", "flash"])
def test_cuda_kernel_is_the_sdpa_call_it_stands_for(name, pinned, backend, contiguous):
    q, k, v = (t.cuda() for t in qkv(5))
    out = A.attention(q, k, v, None, name)
    assert_bitwise(out, direct(q, k, v, None, pinned, contiguous), f"{name} vs SDPA")
    with attention_backend(backend):
        assert_bitwise(out, dispatch_attention_fn(q, k, v), f"{name} vs diffusers' {backend}")


def test_cudnn_hands_sdpa_contiguous_heads_major_copies(monkeypatch):
    """What `_native_cudnn` hands SDPA (contiguous [B, H, S, D]), and `joint_buffer` lays q/k/v out that way already;
    run past the CUDA-only check with the math kernel in cuDNN's place."""
    q, k, v = qkv(6)
    seen = []
    real_sdpa = F.scaled_dot_product_attention

    def spy(query, key, value, **kwargs):
        seen.append(all(t.is_contiguous() for t in (query, key, value)))
        return real_sdpa(query, key, value, **kwargs)

    real_kernel = sdpa_kernel
    monkeypatch.setattr(A, "sdpa_kernel", lambda b: real_kernel(SDPBackend.MATH if b == SDPBackend.CUDNN_ATTENTION
                                                                 else b))
    monkeypatch.setitem(A.KERNELS, "cudnn", dataclasses.replace(A.KERNELS["cudnn"], cuda_only=False))
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    out = A.attention(q, k, v, None, "cudnn")
    assert seen == [True]
    assert_bitwise(out, direct(q, k, v, None, SDPBackend.MATH, contiguous=True), "cudnn layout, math kernel")
    buf = A.joint_buffer(k, q, "cudnn")
    assert buf.shape == (B, L + S, H, D) and buf.permute(0, 2, 1, 3).is_contiguous()
    assert A.joint_buffer(k, q, "flash").is_contiguous()


# -- masks -----------------------------------------------------------------------------------------------------------
def test_mask_forms():
    """Qwen-Image's bool key mask [B, L] is expanded as diffusers' `native` expands a 2-d mask, and equals the same
    mask given as [B, 1, 1, L] (LTX-2.3's fast form); LTX-2.3's additive bias [B, H, 1, L] goes to SDPA as it is.
    Each masks: the result differs from the unmasked one."""
    q, k, v = qkv(7)
    mask = key_mask()
    out = A.attention(q, k, v, mask, "sdpa")
    assert_bitwise(out, A.attention(q, k, v, mask[:, None, None, :], "sdpa"), "[B, L] vs [B, 1, 1, L]")
    assert_bitwise(out, direct(q, k, v, mask[:, None, None, :]), "bool mask vs SDPA")
    with attention_backend("native"):
        assert_bitwise(out, dispatch_attention_fn(q, k, v, attn_mask=mask), "bool mask vs diffusers' native")
    assert_differs(out, A.attention(q, k, v, None, "sdpa"), "masked vs unmasked")
    bias = ((1 - mask.to(BF16)) * -10000.0)[:, None, None, :].repeat(1, H, 1, 1)
    for name, pinned in (("sdpa", None), ("math", SDPBackend.MATH)):
        got = A.attention(q, k, v, bias, name)
        assert_bitwise(got, direct(q, k, v, bias, pinned), f"bias, {name}")
        assert_differs(got, A.attention(q, k, v, None, name), f"biased vs unbiased, {name}")


def test_flash_falls_back_on_a_mask_with_a_warning_and_on_fp32_silently(recwarn):
    q, k, v = qkv(8)
    mask = key_mask()
    with pytest.warns(UserWarning, match="non-trivial text mask while the flash kernel is pinned"):
        out = A.attention(q, k, v, mask, "flash")
    assert_bitwise(out, A.attention(q, k, v, mask, "sdpa"), "masked flash = PyTorch's masked choice")
    q32, k32, v32 = qkv(9, torch.float32)
    recwarn.clear()
    assert_bitwise(A.attention(q32, k32, v32, None, "flash"), direct(q32, k32, v32), "fp32 flash = PyTorch's choice")
    assert not recwarn.list


# -- both families route every attention call through the dispatcher ----------------------------------------------
@pytest.fixture
def spy_kernel():
    """A kernel registered under a test-only name that records its calls and runs the `sdpa` kernel."""
    calls = []

    @A.register("test_spy")
    def spy(q, k, v, mask):
        calls.append(None if mask is None else tuple(mask.shape))
        return A.KERNELS["sdpa"].fn(q, k, v, mask)

    yield calls
    del A.KERNELS["test_spy"]


def seeded(model: torch.nn.Module) -> torch.nn.Module:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def qwen_image_call():
    from trueflow.models.qwen_image.transformer import build_model

    model = seeded(build_model({"num_layers": 2, "num_attention_heads": H, "attention_head_dim": 32,
                                "joint_attention_dim": 48, "axes_dims_rope": (8, 12, 12)}))
    h, w = 2, 3
    args = (randn((B, h * w, 64), 10), randn((B, L, 48), 11), torch.tensor([500.0, 900.0]), (h, w), key_mask())
    return model, lambda: model(*args), [(B, 1, 1, L + h * w)] * 2  # one joint attention per block


def ltx2_call():
    from trueflow.models.ltx2.transformer import build_model

    model = seeded(build_model({"in_channels": 16, "out_channels": 16, "num_attention_heads": H,
                                "attention_head_dim": D, "cross_attention_dim": H * D, "num_layers": 2,
                                "gated_attn": True, "cross_attn_mod": True, "rope_type": "split",
                                "use_prompt_embeddings": False}))
    kwargs = dict(hidden_states=randn((B, 12, 16), 12), timestep=torch.tensor([500.0, 900.0]), grid=(1, 3, 4),
                  encoder_hidden_states=randn((B, L, H * D), 13), encoder_attention_mask=key_mask().long())
    return model, lambda: model(**kwargs), [None, (B, 1, 1, L)] * 2  # per block: video self-, then text attention


@pytest.mark.parametrize("family_call", [qwen_image_call, ltx2_call], ids=["qwen_image", "ltx2"])
def test_every_attention_call_goes_through_the_dispatcher(family_call, spy_kernel, monkeypatch):
    """The kernel selected by name on every attention module of a built tiny model is the one that runs, once per
    attention, and no attention reaches SDPA past it; the output is the `sdpa` kernel's."""
    model, forward, expected = family_call()
    attentions = [m for m in model.modules() if hasattr(m, "backend")]
    assert attentions
    with torch.no_grad():
        reference = forward()
        for m in attentions:
            m.backend = "test_spy"
        sdpa_calls = []
        real_sdpa = F.scaled_dot_product_attention
        monkeypatch.setattr(F, "scaled_dot_product_attention",
                            lambda *a, **kw: sdpa_calls.append(1) or real_sdpa(*a, **kw))
        out = forward()
    assert spy_kernel == expected
    assert len(sdpa_calls) == len(expected)
    assert_bitwise(out, reference, "spy kernel output")


# -- rotary embeddings -------------------------------------------------------------------------------------------
def rotated64(y: torch.Tensor, angles: torch.Tensor, pairs: str) -> torch.Tensor:
    """The rotation as a complex product in float64: pairs (a, b) -> (a + ib)·e^{iθ}; y [B, S, H, D], angles
    broadcasting against [B, S, H, D/2]."""
    y = y.double()
    a, b = (y[..., 0::2], y[..., 1::2]) if pairs == "interleaved" else y.chunk(2, dim=-1)
    z = torch.complex(a, b) * torch.polar(torch.ones_like(angles), angles)
    if pairs == "interleaved":
        return torch.stack((z.real, z.imag), dim=-1).flatten(-2)
    return torch.cat([z.real, z.imag], dim=-1)


@pytest.mark.parametrize("pairs", ["interleaved", "split"])
@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per_head_tables"])
def test_rotation(pairs, per_head):
    """Both pairings from both table layouts: [S, D/2] shared by every head, or [1, H, S, D/2] one per head."""
    y = randn((B, S, H, D), 20, std=2.0, dtype=torch.float32)
    angles = randn((H, S, D // 2), 21, std=3.0, dtype=torch.float64) if per_head else \
        randn((S, D // 2), 21, std=3.0, dtype=torch.float64)
    tables = RopeTables(cos=angles.cos().float()[None] if per_head else angles.cos().float(),
                        sin=angles.sin().float()[None] if per_head else angles.sin().float(), pairs=pairs)
    per_token = angles.transpose(0, 1) if per_head else angles[:, None, :]
    got = rotate_f32(y, tables)
    torch.testing.assert_close(got.double(), rotated64(y, per_token, pairs), rtol=0, atol=1e-5)
    other = "split" if pairs == "interleaved" else "interleaved"
    assert (rotate_f32(y, dataclasses.replace(tables, pairs=other)) - got).abs().max() > 0.1
    with pytest.raises(ValueError, match="choose one of interleaved, split"):
        RopeTables(cos=tables.cos, sin=tables.sin, pairs="complex")
    with pytest.raises(ValueError, match="real cos/sin tables"):
        rotate_f32(y, RopeTables(freqs=torch.polar(torch.ones_like(angles), angles)))


def rms64(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt((x**2).mean(-1, keepdim=True) + EPS) * weight.double()


def test_qk_norms_per_head_and_across_heads():
    """Per head (weight [D]) normalises each head's D channels; across heads (weight [H·D]) all H·D at once, then
    splits the heads; either then rotates (here by interleaved tables: Wan2.2's pairing with its across-heads norm),
    or not (tables None: SD3.5's per-head norm, LTX-2.3's text attention)."""
    x = randn((B, S, H * D), 30, std=3.0)
    angles = randn((S, D // 2), 31, std=3.0, dtype=torch.float64)
    tables = RopeTables(cos=angles.cos().float(), sin=angles.sin().float())
    w_head, w_all = randn((D,), 32, std=0.2, mean=1.0), randn((H * D,), 33, std=0.2, mean=1.0)
    per_head = rms64(x.unflatten(-1, (H, D)), w_head)
    across = rms64(x, w_all).unflatten(-1, (H, D))
    cases = [(qk_norm_rope_fused(x.unflatten(-1, (H, D)), w_head, EPS, None), per_head),
             (qk_norm_rope_fused(x.unflatten(-1, (H, D)), w_head, EPS, tables),
              rotated64(per_head, angles[:, None, :], "interleaved")),
             (qk_norm_across_heads_rope_fused(x, w_all, EPS, H, None), across),
             (qk_norm_across_heads_rope_fused(x, w_all, EPS, H, tables),
              rotated64(across, angles[:, None, :], "interleaved"))]
    for got, ref in cases:  # one rounding to bf16 of the exact value: within half an ulp, plus fp32 slack
        assert got.shape == (B, S, H, D) and got.dtype == BF16
        assert ((got.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-5).all()
    assert (cases[0][0].double() - cases[2][1]).abs().max() > 1e-2, "the two norms must differ on this input"


# -- modulation rows -------------------------------------------------------------------------------------------------
def modulation_calls(shift, scale, gate, x, y):
    return {"layer_norm_scale_shift": lambda: M.layer_norm_scale_shift_fused(x, shift, scale, EPS),
            "scale_residual_layer_norm_scale_shift":
                lambda: M.scale_residual_layer_norm_scale_shift_fused(x, y, gate, shift, scale, EPS),
            "rms_norm_scale_shift": lambda: M.rms_norm_scale_shift_fused(x, shift, scale, EPS),
            "scale_shift": lambda: M.scale_shift_fused(x, shift, scale),
            "gated_residual": lambda: M.gated_residual_fused(y, gate, x)}


def test_modulation_rows_broadcast_as_b_d_or_b_t_d():
    """[B, D] rows (Qwen-Image) give the bits of the same rows as [B, 1, D] (LTX-2.3, Wan); per-token rows [B, S, D]
    modulate each token by its own row."""
    x, y = randn((B, S, 64), 40, std=2.0), randn((B, S, 64), 41)
    shift, scale, gate = randn((B, 3 * 64), 42, std=0.5).chunk(3, dim=-1)
    flat = modulation_calls(shift, scale, gate, x, y)
    rows = modulation_calls(shift[:, None], scale[:, None], gate[:, None], x, y)
    per_token = modulation_calls(*(t[:, None].expand(B, S, 64).contiguous() for t in (shift, scale, gate)), x, y)
    def outputs(call) -> tuple[torch.Tensor, ...]:
        out = call()
        return out if isinstance(out, tuple) else (out,)

    for name in flat:
        for a, b, c in zip(outputs(flat[name]), outputs(rows[name]), outputs(per_token[name])):
            assert_bitwise(b, a, f"{name}: [B, 1, D] rows")
            assert_bitwise(c, a, f"{name}: [B, S, D] rows")
    other = modulation_calls(shift, scale, gate.flip(0), x, y)["gated_residual"]()
    assert_differs(other, flat["gated_residual"](), "another sample's gate")
    with pytest.raises(ValueError, match="shift and scale come together"):
        M.rms_norm_scale_shift_fused(x, shift, None, EPS)


def test_triton_for_the_row_layouts_the_kernels_take(monkeypatch):
    """On CUDA every modulation op runs its Triton kernel for [B, D] rows (Qwen-Image's), [B, 1, D] rows (LTX-2.3's)
    and per-token [B, S, D] rows: the layouts the kernels take; anything else (a 4-d input, the bare norm) runs the
    PyTorch code."""
    def no_kernels():
        raise RuntimeError("a Triton kernel was reached")

    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    monkeypatch.setattr(kernels, "ops", no_kernels)
    x, y = randn((B, S, 64), 50), randn((B, S, 64), 51)
    shift, scale, gate = randn((B, 3 * 64), 52).chunk(3, dim=-1)
    for layout in (lambda t: t, lambda t: t[:, None], lambda t: t[:, None].expand(B, S, 64)):
        for call in modulation_calls(layout(shift), layout(scale), layout(gate), x, y).values():
            with pytest.raises(RuntimeError, match="Triton kernel was reached"):
                call()
    four_d = (t[:, None, None] for t in (shift, scale, gate))  # x [B, 3, 3, D]: not a layout the kernels take
    for call in modulation_calls(*four_d, x.unflatten(1, (3, 3)), y.unflatten(1, (3, 3))).values():
        call()  # no kernel reached
    M.rms_norm_scale_shift_fused(x, None, None, EPS)  # the bare norm: no kernel reached
