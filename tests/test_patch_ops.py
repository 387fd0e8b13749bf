"""Each op of the `qwen_image` rollout patch group against the diffusers code it mirrors, bitwise, on random bf16
inputs; and for each rounding patch, the engine's fast (unpatched) op on the same input differs from diffusers.

Kernel-selection patches (contiguous_split, unpacked_qkv, attention_kernel): only contiguous_split has a CPU
difference to show (a strided slice runs another GEMM at batch > 1). Packed vs separate q/k/v GEMMs and the
flash kernel vs PyTorch's own SDPA choice are bitwise equal on this CPU, so for those two only the equality side
is tested (their differences are GPU kernel choices: docs/patch-group.md).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import attention_backend, dispatch_attention_fn
from diffusers.models.embeddings import Timesteps
from diffusers.models.embeddings import TimestepEmbedding as DiffusersTimestepEmbedding
from diffusers.models.normalization import AdaLayerNormContinuous
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm
from diffusers.models.transformers.transformer_qwenimage import (
    QwenEmbedRope,
    QwenImageTransformerBlock,
    apply_rotary_emb_qwen,
)
from peft import LoraConfig, get_peft_model
from torch import nn

from conftest import BF16, EPS, assert_bitwise, assert_differs, pipeline_timestep, randn
from trueflow import loading
from trueflow.engine.weights import build_engine_transformer
from trueflow.layers.attention import attention
from trueflow.layers.linear import Linear, LoraAdapter
from trueflow.layers.modulation import (
    GatedResidual,
    LayerNormScaleShift,
    ScaleResidualLayerNormScaleShift,
    gated_residual_fused,
    layer_norm_scale_shift_fused,
    scale_residual_layer_norm_scale_shift_fused,
)
from trueflow.layers.norms import RMSNorm, rms_norm_fused
from trueflow.layers.rope import QKNormRope, qk_norm_rope_fused, rope_tables_fused
from trueflow.models.qwen_image import patches as P
from trueflow.models.qwen_image.transformer import (
    JointAttention,
    OutputNorm,
    QwenImageTransformer,
    RotaryEmbedding,
    TimestepEmbedding,
    build_model,
    timestep_proj_fused,
)
from trueflow.models import apply_patch_group

# [batch, sequence, hidden]: one sample and a microgroup, a short and a long text, tiny and real width.
SHAPES = [(1, 7, 64), (4, 33, 64), (1, 7, 3072), (4, 33, 3072)]
SHAPE_IDS = ["x".join(map(str, s)) for s in SHAPES]
THETA = 10000  # QwenImageTransformer2DModel builds QwenEmbedRope(theta=10000, scale_rope=True)
AXES = [(8, 12, 12), (16, 56, 56), (4, 6, 6)]  # tiny, the real model, a third config


@pytest.fixture(scope="module")
def block() -> QwenImageTransformerBlock:
    """A real diffusers block; only its `_modulate` arithmetic is used (it does not depend on the block's width)."""
    return QwenImageTransformerBlock(dim=64, num_attention_heads=2, attention_head_dim=32).to(BF16).eval()


def mod_params(batch: int, dim: int, seed: int) -> torch.Tensor:
    """One stream's modulation Linear output [B, 6·D] (shift, scale, gate for norm1, then for norm2)."""
    return randn((batch, 6 * dim), seed, std=0.5)


def diffusers_rms_norm(dim: int, weight: torch.Tensor) -> DiffusersRMSNorm:
    norm = DiffusersRMSNorm(dim, eps=EPS).to(BF16)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


# -- RMSNorm -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_rms_norm(shape):
    d = shape[-1]
    x = randn(shape, 1, std=2.0)
    weight = randn((d,), 2, std=0.1, mean=1.0)
    ref = diffusers_rms_norm(d, weight)(x)
    assert_bitwise(P.rms_norm_reference(x, weight, EPS), ref, "rms_norm_reference")
    engine = RMSNorm(d, EPS).to(BF16)
    with torch.no_grad():
        engine.weight.copy_(weight)
    engine.impl = P.rms_norm_reference
    assert_bitwise(engine(x), ref, "engine RMSNorm patched")
    # negative control: the fused fp32 kernel rounds once
    assert_differs(rms_norm_fused(x, weight, EPS), ref, "rms_norm_fused")


# -- LayerNorm + scale/shift (the blocks' (shift, scale, gate) and the output norm's (scale, shift)) ----------
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_layer_norm_scale_shift(shape, block):
    b, _, d = shape
    x = randn(shape, 3, std=3.0, mean=0.5)
    mod = mod_params(b, d, 4)
    mod1, _ = mod.chunk(2, dim=-1)  # diffusers: img_mod_params.chunk(2) then _modulate chunks (shift, scale, gate)
    shift1, scale1, _gate1, *_ = mod.chunk(6, dim=-1)  # the engine's chunking
    ref, _ = block._modulate(nn.LayerNorm(d, elementwise_affine=False, eps=EPS)(x), mod1)
    assert_bitwise(P.layer_norm_scale_shift_reference(x, shift1, scale1, EPS), ref, "layer_norm_scale_shift_reference")
    engine = LayerNormScaleShift(EPS)
    engine.impl = P.layer_norm_scale_shift_reference
    assert_bitwise(engine(x, shift1, scale1), ref, "engine LayerNormScaleShift patched")
    assert_differs(layer_norm_scale_shift_fused(x, shift1, scale1, EPS), ref, "layer_norm_scale_shift_fused")


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_output_norm_scale_shift_order(shape):
    """The final adaLN chunks its modulation as (scale, shift): engine OutputNorm vs AdaLayerNormContinuous."""
    b, _, d = shape
    x = randn(shape, 5, std=3.0)
    temb = randn((b, d), 6, std=1.0)
    ada = AdaLayerNormContinuous(d, d, elementwise_affine=False, eps=EPS).to(BF16).eval()
    engine = OutputNorm(d, EPS).to(BF16)
    with torch.no_grad():
        ada.linear.weight.copy_(randn(ada.linear.weight.shape, 7, std=0.02))
        ada.linear.bias.copy_(randn(ada.linear.bias.shape, 8, std=0.02))
        engine.linear.weight.copy_(ada.linear.weight)
        engine.linear.bias.copy_(ada.linear.bias)
        ref = ada(x, temb)
        engine.norm.impl = P.layer_norm_scale_shift_reference
        assert_bitwise(engine(x, temb), ref, "OutputNorm patched")
        engine.norm.impl = layer_norm_scale_shift_fused
        assert_differs(engine(x, temb), ref, "OutputNorm fused")


# -- gated residual + LayerNorm + scale/shift, and the final gated residual (the `mul_add` patch) ----------------
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_scale_residual_layer_norm_scale_shift(shape, block):
    b, _, d = shape
    residual = randn(shape, 9, std=4.0)
    y = randn(shape, 10, std=2.0)  # the attention output
    mod = mod_params(b, d, 11)
    mod1, mod2 = mod.chunk(2, dim=-1)
    _, _, gate1, shift2, scale2, _ = mod.chunk(6, dim=-1)
    norm2 = nn.LayerNorm(d, elementwise_affine=False, eps=EPS)
    # QwenImageTransformerBlock.forward: hidden_states = hidden_states + img_gate1 * img_attn_output; then norm2
    _, gate1_ref = block._modulate(norm2(residual), mod1)
    r_ref = residual + gate1_ref * y
    out_ref, _ = block._modulate(norm2(r_ref), mod2)
    r, out = P.scale_residual_layer_norm_scale_shift_reference(residual, y, gate1, shift2, scale2, EPS)
    assert_bitwise(r, r_ref, "residual")
    assert_bitwise(out, out_ref, "normed + modulated")
    engine = ScaleResidualLayerNormScaleShift(EPS)
    engine.impl = P.scale_residual_layer_norm_scale_shift_reference
    r_e, out_e = engine(residual, y, gate1, shift2, scale2)
    assert_bitwise(r_e, r_ref, "engine module residual")
    assert_bitwise(out_e, out_ref, "engine module output")
    r_f, out_f = scale_residual_layer_norm_scale_shift_fused(residual, y, gate1, shift2, scale2, EPS)
    assert_differs(r_f, r_ref, "fused residual")
    assert_differs(out_f, out_ref, "fused normed + modulated")


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_gated_residual(shape, block):
    b, _, d = shape
    h = randn(shape, 12, std=4.0)
    mlp_out = randn(shape, 13, std=2.0)
    _, mod2 = mod_params(b, d, 14).chunk(2, dim=-1)
    gate2 = mod2.chunk(3, dim=-1)[2]
    _, gate2_ref = block._modulate(h, mod2)
    ref = h + gate2_ref * mlp_out  # QwenImageTransformerBlock.forward: hidden_states + img_gate2 * img_mlp_output
    assert_bitwise(P.gated_residual_reference(mlp_out, gate2, h), ref, "gated_residual_reference")
    engine = GatedResidual()
    engine.impl = P.gated_residual_reference
    assert_bitwise(engine(mlp_out, gate2, h), ref, "engine GatedResidual patched")
    assert_differs(gated_residual_fused(mlp_out, gate2, h), ref, "gated_residual_fused")


# -- RoPE tables and qk-norm + RoPE --------------------------------------------------------------------------
ROPE_GRIDS = [(1, 1, 1), (4, 4, 7), (3, 5, 33), (7, 9, 12), (8, 8, 1), (2, 64, 3), (64, 64, 128), (37, 91, 300)]


@pytest.mark.parametrize("axes", AXES, ids=lambda a: "-".join(map(str, a)))
@pytest.mark.parametrize("grid", ROPE_GRIDS, ids=lambda g: "h{}w{}L{}".format(*g))
def test_rope_tables(axes, grid):
    h, w, text_len = grid
    vid_ref, txt_ref = QwenEmbedRope(theta=THETA, axes_dim=list(axes), scale_rope=True)(
        [(1, h, w)], device=torch.device("cpu"), max_txt_seq_len=text_len)
    rope = RotaryEmbedding(axes, THETA)
    rope.impl = P.rope_tables_reference
    img, txt = rope(h, w, text_len, torch.device("cpu"))
    assert_bitwise(img.freqs, vid_ref, "image table")
    assert_bitwise(txt.freqs, txt_ref, "text table")
    # negative control: tables from fp32 angles on the device (cos/sin) are not diffusers' polar tables
    rope.impl = rope_tables_fused
    img_f, txt_f = rope(h, w, text_len, torch.device("cpu"))
    assert_differs(torch.complex(img_f.cos, img_f.sin), vid_ref, "fused image table")


QK_CASES = [  # axes, heads, batch, h, w, text
    ((8, 12, 12), 2, 1, 4, 4, 7),
    ((8, 12, 12), 2, 4, 3, 5, 33),
    ((16, 56, 56), 24, 1, 4, 4, 7),
    ((16, 56, 56), 24, 4, 8, 8, 33),
]


@pytest.mark.parametrize("case", QK_CASES, ids=lambda c: f"hd{sum(c[0])}-H{c[1]}-B{c[2]}-{c[3]}x{c[4]}-L{c[5]}")
def test_qk_norm_rope(case):
    axes, heads, batch, h, w, text_len = case
    head_dim = sum(axes)
    vid_ref, txt_ref = QwenEmbedRope(theta=THETA, axes_dim=list(axes), scale_rope=True)(
        [(1, h, w)], device=torch.device("cpu"), max_txt_seq_len=text_len)
    rope = RotaryEmbedding(axes, THETA)
    rope.impl = P.rope_tables_reference
    img_t, txt_t = rope(h, w, text_len, torch.device("cpu"))
    weight = randn((head_dim,), 20, std=0.1, mean=1.0)
    norm = diffusers_rms_norm(head_dim, weight)
    engine = QKNormRope(head_dim, EPS).to(BF16)
    with torch.no_grad():
        engine.weight.copy_(weight)
    engine.impl = P.qk_norm_rope_reference
    rope.impl = rope_tables_fused
    img_f, txt_f = rope(h, w, text_len, torch.device("cpu"))
    for seed, seq, ref_freqs, tables, fast_tables in ((21, h * w, vid_ref, img_t, img_f),
                                                      (22, text_len, txt_ref, txt_t, txt_f)):
        x = randn((batch, seq, heads, head_dim), seed, std=1.5)
        ref = apply_rotary_emb_qwen(norm(x), ref_freqs, use_real=False)
        assert_bitwise(P.qk_norm_rope_reference(x, weight, EPS, tables), ref, "qk_norm_rope_reference")
        assert_bitwise(engine(x, tables), ref, "engine QKNormRope patched")
        assert_differs(qk_norm_rope_fused(x, weight, EPS, fast_tables), ref, "qk_norm_rope_fused")


def test_qk_norm_rope_exact_falls_back_when_no_variant_reproduces(monkeypatch):
    """If neither kernel variant reproduces the device's complex product (here a stand-in kernel that computes
    nothing right), `complex_fma` says so once, with a warning, and the chain runs as the reference: still bitwise."""
    from trueflow import kernels

    class Wrong:
        @staticmethod
        def rms_norm_eager_bf16(x, weight, eps, freqs=None, out=None, complex_fma=True):
            return torch.zeros_like(x)

    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    monkeypatch.setattr(kernels, "ops", lambda: Wrong)
    monkeypatch.setattr(P, "_COMPLEX_FMA", {})
    x, w = randn((2, 5, 24, 128), 23), randn((128,), 24, std=0.1, mean=1.0)
    rope = RotaryEmbedding((16, 56, 56), THETA)
    rope.impl = P.rope_tables_reference
    tables, _ = rope(1, 5, 3, torch.device("cpu"))
    with pytest.warns(UserWarning, match="no qk-norm"):
        got = P.qk_norm_rope_exact(x, w, EPS, tables)
    assert P._COMPLEX_FMA == {torch.device("cpu"): None}
    assert_bitwise(got, P.qk_norm_rope_reference(x, w, EPS, tables), "reference fallback")


# -- timestep ------------------------------------------------------------------------------------------------
def _timesteps() -> torch.Tensor:
    """Schedule timesteps (fp32, 0..1000): seeded random ones plus the ends and values bf16 cannot hold."""
    g = torch.Generator().manual_seed(30)
    return torch.cat([torch.rand(16, generator=g) * 1000, torch.tensor([0.0, 1000.0, 500.0, 1000 / 3, 999.0, 20.0])])


def _time_proj() -> Timesteps:
    return Timesteps(num_channels=256, flip_sin_to_cos=True, downscale_freq_shift=0, scale=1000)


def test_timestep_proj():
    t = _timesteps()
    # QwenImagePipeline: t.to(latents.dtype) / 1000; the model: time_proj(timestep) ... .to(hidden_states.dtype)
    ref = _time_proj()(pipeline_timestep(t, BF16)).to(BF16)
    assert_bitwise(P.timestep_proj_reference(t, BF16), ref, "timestep_proj_reference")
    # negative control: the fp32 timestep, never rounded
    assert_differs(timestep_proj_fused(t, BF16), ref, "timestep_proj_fused")


def test_timestep_embedding_module():
    """The engine's whole TimestepEmbedding (projection + two Linears) vs diffusers' QwenTimestepProjEmbeddings
    arithmetic (Timesteps, then TimestepEmbedding on the bf16 projection)."""
    dim, t = 64, _timesteps()
    ref_mlp = DiffusersTimestepEmbedding(in_channels=256, time_embed_dim=dim).to(BF16)
    engine = TimestepEmbedding(dim).to(BF16)
    with torch.no_grad():
        for i, (e, r) in enumerate(((engine.linear_1, ref_mlp.linear_1), (engine.linear_2, ref_mlp.linear_2))):
            r.weight.copy_(randn(r.weight.shape, 31 + i, std=0.02))
            r.bias.copy_(randn(r.bias.shape, 41 + i, std=0.02))
            e.weight.copy_(r.weight)
            e.bias.copy_(r.bias)
        ref = ref_mlp(_time_proj()(pipeline_timestep(t, BF16)).to(BF16))
        engine.proj_impl = P.timestep_proj_reference
        assert_bitwise(engine(t, BF16), ref, "TimestepEmbedding patched")
        engine.proj_impl = timestep_proj_fused
        assert_differs(engine(t, BF16), ref, "TimestepEmbedding fused")


# -- Linear: packed q/k/v, unpacked ----------------------------------------------------------------------------
def _linears(d: int, n: int, seed: int) -> list[nn.Linear]:
    out = []
    for i in range(n):
        lin = nn.Linear(d, d).to(BF16)
        with torch.no_grad():
            lin.weight.copy_(randn(lin.weight.shape, seed + 2 * i, std=0.02))
            lin.bias.copy_(randn(lin.bias.shape, seed + 2 * i + 1, std=0.02))
        out.append(lin)
    return out


def _packed(linears: list[nn.Linear]) -> Linear:
    d = linears[0].in_features
    packed = Linear(d, d * len(linears), splits=tuple(m.out_features for m in linears)).to(BF16)
    with torch.no_grad():
        packed.weight.copy_(torch.cat([m.weight for m in linears]))
        packed.bias.copy_(torch.cat([m.bias for m in linears]))
    return packed


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_unpacked_linear_equals_three_linears(shape):
    d = shape[-1]
    x = randn(shape, 50)
    q, k, v = _linears(d, 3, 51)
    packed = _packed([q, k, v])
    packed.unpacked = True
    with torch.no_grad():
        outs = packed(x)
        refs = (q(x), k(x), v(x))
    assert len(outs) == 3
    for name, o, r in zip("qkv", outs, refs):
        assert_bitwise(o, r, f"unpacked {name}")
    # The bias stays inside the GEMM call: F.linear(x, W) + b does not round as F.linear(x, W, b) does. (The packed
    # single GEMM itself is bitwise equal to three GEMMs on this CPU, so there is no CPU control for that patch.)
    plain = Linear(d, d).to(BF16)
    with torch.no_grad():
        plain.weight.copy_(q.weight)
        plain.bias.copy_(q.bias)
        assert_bitwise(plain(x), refs[0], "single Linear")


def test_bias_outside_the_gemm_differs():
    """Why the bias must stay in the call (a control for the rule `unpacked` and the LoRA path follow)."""
    x = randn((4, 33, 3072), 52)
    (lin,) = _linears(3072, 1, 53)
    with torch.no_grad():
        assert_differs(F.linear(x, lin.weight) + lin.bias, lin(x), "bias added after the GEMM")


# -- LoRA: the engine's unmerged path vs PEFT -----------------------------------------------------------------
class _TinyAttn(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.to_q, self.to_k, self.to_v, self.proj = _linears(d, 4, 60)


LORA_RANK, LORA_ALPHA = 8, 12  # scale 1.5: multiplying by it rounds in bf16, unlike a power of two


@pytest.fixture(scope="module", params=[64, 3072], ids=["d64", "d3072"])
def peft_model(request):
    d = request.param
    model = get_peft_model(_TinyAttn(d), LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA,
                                                    target_modules=["to_q", "to_k", "to_v", "proj"]),
                           autocast_adapter_dtype=False).eval()
    with torch.no_grad():
        for i, (name, p) in enumerate(sorted(model.named_parameters())):
            if ".lora_B." in name:  # PEFT starts B at zero; a trained adapter has B != 0
                p.copy_(randn(p.shape, 70 + i, std=0.02))
    lora_params = {n: p for n, p in model.named_parameters() if ".lora_" in n}
    assert {p.dtype for p in lora_params.values()} == {BF16}, \
        "adapters must stay bf16, as diffusers' add_adapter keeps them"
    assert all(p.abs().max() > 0 for n, p in lora_params.items() if ".lora_B." in n)
    return model


def _adapter(lora_layer) -> LoraAdapter:
    return LoraAdapter(lora_layer.lora_A["default"].weight.detach(), lora_layer.lora_B["default"].weight.detach(),
                       lora_layer.scaling["default"])


@pytest.mark.parametrize("shape", [(1, 7), (4, 33)], ids=["1x7", "4x33"])
def test_lora_unmerged_matches_peft(peft_model, shape):
    inner = peft_model.base_model.model
    d = inner.to_q.in_features
    x = randn((*shape, d), 80)
    qkv = [inner.to_q, inner.to_k, inner.to_v]
    assert qkv[0].scaling["default"] == LORA_ALPHA / LORA_RANK
    packed = _packed([m.base_layer for m in qkv])
    packed.unpacked = True  # the patch group's unpacked_qkv
    packed.set_lora([_adapter(m) for m in qkv], merge=False)  # the patch group's lora_unmerged
    plain = _packed([inner.proj.base_layer])
    plain.set_lora([_adapter(inner.proj)], merge=False)
    with torch.no_grad():
        refs = [m(x) for m in qkv]
        ref_proj = inner.proj(x)
        base = inner.proj.base_layer(x)
        for name, o, r in zip("qkv", packed(x), refs):
            assert_bitwise(o, r, f"unmerged LoRA {name}")
        assert_bitwise(plain(x), ref_proj, "unmerged LoRA proj")
        assert_differs(ref_proj, base, "the adapter changes the output")  # B != 0 really matters
        # negative control: W + s·B·A merged and rounded to bf16 (the fast engine's merge)
        plain.set_lora([_adapter(inner.proj)], merge=True)
        assert_differs(plain(x), ref_proj, "merged LoRA")
        # and clearing restores the exact base weights
        plain.clear_lora()
        assert_bitwise(plain(x), base, "after clear_lora")


# -- attention: joint attention module, kernel-selection patches ----------------------------------------------
def test_attention_kernel_vs_native_flash():
    """The engine's `flash` backend vs diffusers' `_native_flash` dispatch; the math kernel shows the comparison
    can see a kernel change. PyTorch's own choice (`sdpa`, the unpatched engine) is the flash kernel on this CPU."""
    for shape in ((1, 23, 2, 32), (4, 97, 24, 128)):
        q, k, v = (randn(shape, 90 + i) for i in range(3))
        with attention_backend("_native_flash"):
            ref = dispatch_attention_fn(q, k, v)
        assert_bitwise(attention(q, k, v, None, "flash"), ref, "flash")
        assert_bitwise(attention(q, k, v, None, "sdpa"), ref, "sdpa (no CPU difference to show)")
        assert_differs(attention(q, k, v, None, "math"), ref, "math kernel")


@pytest.fixture(scope="module")
def tiny_bf16(tiny_checkpoint):
    from diffusers import QwenImageTransformer2DModel

    diff = QwenImageTransformer2DModel.from_pretrained(tiny_checkpoint, subfolder="transformer", dtype=BF16).eval()
    return diff, loading.read_transformer_config(tiny_checkpoint), loading.read_transformer_state_dict(tiny_checkpoint)


@pytest.mark.parametrize("batch", [1, 4])
def test_joint_attention_module(tiny_bf16, batch):
    """Block 0's joint attention (q/k/v GEMMs, qk-norm + RoPE, attention, split, output GEMMs) vs diffusers'
    Attention + QwenDoubleStreamAttnProcessor2_0 under `_native_flash`, on the same modulated inputs."""
    diff, config, state = tiny_bf16
    h, w, text_len = 4, 5, 7
    dim = diff.inner_dim
    img, txt = randn((batch, h * w, dim), 100), randn((batch, text_len, dim), 101)
    with torch.no_grad(), attention_backend("_native_flash"):
        rope_ref = diff.pos_embed([(1, h, w)] * batch, max_txt_seq_len=text_len, device=torch.device("cpu"))
        img_ref, txt_ref = diff.transformer_blocks[0].attn(hidden_states=img, encoder_hidden_states=txt,
                                                           encoder_hidden_states_mask=None,
                                                           image_rotary_emb=rope_ref)

    def run(disabled=()):
        engine = build_engine_transformer(config, state, patch_group="qwen_image", disabled_patches=disabled)
        with torch.no_grad():
            rope = engine.rope(h, w, text_len, torch.device("cpu"))
            return engine.transformer_blocks[0].attn(img, txt, rope, None)

    img_out, txt_out = run()
    assert_bitwise(img_out, img_ref, "image stream")
    assert_bitwise(txt_out, txt_ref, "text stream")
    for disabled in ("unpacked_qkv", "attention_kernel"):  # kernel choices with no difference on this CPU
        i2, t2 = run((disabled,))
        assert_bitwise(i2, img_ref, f"without {disabled}")
        assert_bitwise(t2, txt_ref, f"without {disabled}")
    i3, t3 = run(("qk_norm_rope",))
    assert_differs(i3, img_ref, "without qk_norm_rope")
    if batch > 1:  # a strided slice of the joint output feeds to_out through another GEMM at batch > 1
        i4, t4 = run(("contiguous_split",))
        assert_differs(torch.cat([i4.flatten(), t4.flatten()]), torch.cat([img_ref.flatten(), txt_ref.flatten()]),
                       "without contiguous_split")


@pytest.mark.parametrize("train_backend", ["_native_flash", "_native_cudnn"])
def test_attention_pairing_layouts(tiny_bf16, monkeypatch, train_backend):
    """Block 0's joint attention under the group made for `train_backend` vs diffusers under that backend: SDPA gets
    q/k/v of the same shapes and strides (token-major views for flash, contiguous heads-major for cuDNN, which the
    engine's joint buffers already are: no copy), and the outputs are bitwise. cuDNN has no CPU kernel, so both
    sides' pinned cuDNN kernel runs as the math kernel here; the layouts are what this test is about."""
    from torch.nn.attention import SDPBackend

    import trueflow.layers.attention as A
    from trueflow.models import get_group

    diff, config, state = tiny_bf16
    batch, h, w, text_len = 2, 4, 5, 7
    img, txt = randn((batch, h * w, diff.inner_dim), 100), randn((batch, text_len, diff.inner_dim), 101)
    real_kernel, real_sdpa = torch.nn.attention.sdpa_kernel, F.scaled_dot_product_attention
    seen: list[tuple] = []

    def kernel(backends, *args, **kwargs):
        return real_kernel(SDPBackend.MATH if backends == SDPBackend.CUDNN_ATTENTION else backends, *args, **kwargs)

    def sdpa(query, key, value, **kwargs):  # diffusers passes them by keyword
        seen.append(tuple((t.shape, t.stride()) for t in (query, key, value)))
        return real_sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(torch.nn.attention, "sdpa_kernel", kernel)  # diffusers looks it up at call time
    monkeypatch.setattr(A, "sdpa_kernel", kernel)
    monkeypatch.setitem(A.KERNELS, "cudnn", dataclasses.replace(A.KERNELS["cudnn"], cuda_only=False))  # past the
    # engine's CUDA-only check; its pinned cuDNN kernel runs as the math kernel through the `sdpa_kernel` above
    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    with torch.no_grad(), attention_backend(train_backend):
        rope_ref = diff.pos_embed([(1, h, w)] * batch, max_txt_seq_len=text_len, device=torch.device("cpu"))
        img_ref, txt_ref = diff.transformer_blocks[0].attn(hidden_states=img, encoder_hidden_states=txt,
                                                           encoder_hidden_states_mask=None, image_rotary_emb=rope_ref)

    def run(group_name: str):
        group = get_group(group_name)
        engine = build_engine_transformer(config, state, patch_group=group_name)
        assert engine.patches_applied == list(group.patch_names)
        with torch.no_grad():
            return engine.transformer_blocks[0].attn(img, txt, engine.rope(h, w, text_len, torch.device("cpu")), None)

    img_out, txt_out = run(f"qwen_image:{train_backend}")
    (ref_layout, engine_layout) = seen
    assert engine_layout == ref_layout
    heads_major = train_backend == "_native_cudnn"
    assert all(torch.empty_strided(*t).is_contiguous() == heads_major for t in engine_layout)
    assert_bitwise(img_out, img_ref, "image stream")
    assert_bitwise(txt_out, txt_ref, "text stream")
    other = {"_native_flash": "qwen_image:_native_cudnn", "_native_cudnn": "qwen_image"}[train_backend]
    run(other)
    assert seen[-1] != ref_layout, "the other pairing hands the kernel another layout"


def test_group_follows_the_train_backend():
    """`qwen_image` is the `_native_flash` pairing; `qwen_image:<backend>` pins that backend's kernel; a backend no
    kernel reproduces is refused with the choices."""
    from trueflow.models import get_group

    def kernel(group) -> str:
        model = build_model({"num_layers": 1, "num_attention_heads": 2, "attention_head_dim": 32,
                             "joint_attention_dim": 48, "axes_dims_rope": (8, 12, 12)}, device="meta")
        next(p for p in group.patches if p.name == "attention_kernel").apply(model)
        return model.transformer_blocks[0].attn.backend

    assert kernel(get_group("qwen_image")) == kernel(get_group("qwen_image:_native_flash")) == "flash"
    assert kernel(get_group("qwen_image:_native_cudnn")) == "cudnn"
    assert get_group("qwen_image:_native_cudnn").patch_names == P.GROUP.patch_names
    with pytest.raises(ValueError, match="_native_flash, _native_cudnn"):
        get_group("qwen_image:native")


# -- the group's wiring ---------------------------------------------------------------------------------------
def test_group_installs_the_reference_ops():
    """Each patch puts the function tested above on every module of its kind; a disabled patch leaves the fast
    path; 'none' applies nothing."""
    config = {"num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 32, "joint_attention_dim": 48,
              "axes_dims_rope": (8, 12, 12)}
    expect = {  # module type -> (attribute, fast value, patched value, patch name)
        RMSNorm: ("impl", rms_norm_fused, P.rms_norm_exact, "rms_norm"),
        LayerNormScaleShift: ("impl", layer_norm_scale_shift_fused, P.layer_norm_scale_shift_exact,
                              "layer_norm_scale_shift"),
        ScaleResidualLayerNormScaleShift: ("impl", scale_residual_layer_norm_scale_shift_fused,
                                           P.scale_residual_layer_norm_scale_shift_exact,
                                           "scale_residual_layer_norm_scale_shift"),
        GatedResidual: ("impl", gated_residual_fused, P.gated_residual_exact, "mul_add"),
        QKNormRope: ("impl", qk_norm_rope_fused, P.qk_norm_rope_exact, "qk_norm_rope"),
        RotaryEmbedding: ("impl", rope_tables_fused, P.rope_tables_reference, "qk_norm_rope"),
        TimestepEmbedding: ("proj_impl", timestep_proj_fused, P.timestep_proj_reference, "timestep_dtype"),
        Linear: ("unpacked", False, True, "unpacked_qkv"),
        QwenImageTransformer: ("lora_merge", True, False, "lora_unmerged"),
    }
    joint = {"contiguous_split": ("contiguous_split", False, True), "attention_kernel": ("backend", "sdpa", "flash")}
    assert set(P.GROUP.patch_names) == {v[3] for v in expect.values()} | set(joint)
    for disabled in [()] + [(p,) for p in P.GROUP.patch_names] + [None]:
        model = build_model(config, device="meta")
        applied = (apply_patch_group(model, "none") if disabled is None
                   else apply_patch_group(model, "qwen_image", disabled))
        assert applied == ([] if disabled is None else [p for p in P.GROUP.patch_names if p not in disabled])
        on = set(applied)
        for mod in model.modules():
            for kind, (attr, fast, patched, patch) in expect.items():
                if isinstance(mod, kind):
                    assert getattr(mod, attr) == (patched if patch in on else fast), (kind.__name__, disabled)
            if isinstance(mod, JointAttention):
                for patch, (attr, fast, patched) in joint.items():
                    assert getattr(mod, attr) == (patched if patch in on else fast), (patch, disabled)
