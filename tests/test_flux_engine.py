"""The `flux` engine DiT against diffusers' `FluxTransformer2DModel` (bf16 on the CPU, `_native_flash`, called as
`FluxPipeline` calls it): with the `flux` patch group the engine's output is bitwise diffusers' at batch 2, with and
without an unmerged LoRA on every kind of linear layer, and for another config; without the group it is not. Each
patch's reference is compared with the diffusers module it mirrors (diffusers' own class run on the same weights
and inputs), and the engine's fast op is shown to differ on the same input.

Kernel-selection patches with no CPU difference to show: `unpacked_qkv` (a packed GEMM is bitwise the separate GEMMs
on this CPU; its equality side is tested) and `attention_kernel` (on the CPU SDPA's own choice is the flash kernel).
"""

from __future__ import annotations

import pytest
import torch
from diffusers import FluxTransformer2DModel
from diffusers.models.attention_dispatch import attention_backend
from diffusers.models.embeddings import Timesteps, apply_rotary_emb
from diffusers.models.normalization import AdaLayerNormContinuous, AdaLayerNormZero, AdaLayerNormZeroSingle
from diffusers.models.transformers.transformer_flux import FluxPosEmbed, FluxSingleTransformerBlock
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from conftest import BF16, EPS, assert_bitwise, assert_differs, randn
from trueflow.layers import modulation as M
from trueflow.layers.rope import qk_norm_rope_fused
from trueflow.models.flux import patches as P
from trueflow.models.flux import transformer as T
from trueflow.models.flux import weights as W
from trueflow.models.flux.latents import image_ids
from trueflow.models.flux.presets import build_transformer, transformer_config

TINY = transformer_config("tiny")
# Other heads, head width, RoPE axes, depths and text widths, run at another grid, text length and batch below.
OTHER = {**TINY, "num_attention_heads": 3, "attention_head_dim": 24, "axes_dims_rope": (8, 8, 8), "num_layers": 1,
         "num_single_layers": 3, "joint_attention_dim": 40, "pooled_projection_dim": 24}
# Every kind of linear layer: both streams' q/k/v and outputs, the FFNs, the single blocks' packed q/k/v/MLP slots
# and their output projection, a modulation linear, the embedders (scale 1.5: the scale multiply rounds in bf16).
LORA_TARGETS = (r".*(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)|proj_mlp|"
                r"single_transformer_blocks\.\d+\.proj_out|ff(_context)?\.net\.(0\.proj|2)|norm1\.linear|"
                r"x_embedder|context_embedder|guidance_embedder\.linear_1)")
LORA_RANK, LORA_ALPHA = 8, 12


def diffusers_model(config: dict, seed: int) -> FluxTransformer2DModel:
    model = build_transformer(config, seed=seed, dtype=BF16)
    with attention_backend("_native_flash"):
        model.set_attention_backend("_native_flash")
    return model


def engine_model(ref: torch.nn.Module, group: bool) -> T.FluxTransformer:
    """The engine of `ref`'s weights (built before any adapter is added to `ref`)."""
    model = T.build_model(dict(ref.config), "cpu", BF16)
    W.load_weights(model, ref.state_dict())
    if group:
        for patch in P.GROUP.patches:
            patch.apply(model)
    return model


def inputs(config: dict, batch: int, grid: tuple[int, int], text_len: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"hidden_states": torch.randn(batch, grid[0] * grid[1], config["in_channels"], generator=g).to(BF16),
            "encoder_hidden_states": torch.randn(batch, text_len, config["joint_attention_dim"], generator=g).to(BF16),
            "pooled_projections": torch.randn(batch, config["pooled_projection_dim"], generator=g).to(BF16),
            "timestep": (torch.rand(1, generator=g) * 1000).expand(batch).contiguous(),  # one schedule t, fp32
            "guidance": 1 + 4 * torch.rand(batch, generator=g), "grid": grid}


def diffusers_forward(ref, inp: dict) -> torch.Tensor:
    """FluxPipeline's call: `timestep / 1000` in the latent dtype, the fp32 guidance, txt_ids zeros, img_ids."""
    text = inp["encoder_hidden_states"]
    with torch.no_grad(), attention_backend("_native_flash"):
        return ref(hidden_states=inp["hidden_states"], timestep=inp["timestep"].to(BF16) / 1000,
                   guidance=inp["guidance"], pooled_projections=inp["pooled_projections"], encoder_hidden_states=text,
                   txt_ids=torch.zeros(text.shape[1], 3).to(BF16), img_ids=image_ids(inp["grid"], "cpu", BF16),
                   return_dict=False)[0]


def engine_forward(model, inp: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inp)


def add_lora(ref: torch.nn.Module) -> dict:
    ref.add_adapter(LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=LORA_TARGETS))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in sorted(ref.named_parameters()):
            if ".lora_B." in name:  # PEFT starts B at zero; a trained adapter has B != 0
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return W.parse_peft_state_dict(get_peft_model_state_dict(ref))


# -- the whole model ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lora", [False, True], ids=["no_lora", "lora8"])
def test_group_bitwise_with_diffusers(lora):
    ref = diffusers_model(TINY, seed=0)
    fast, exact = engine_model(ref, group=False), engine_model(ref, group=True)
    if lora:
        peft = add_lora(ref)
        assert any(k.endswith("proj_mlp") for k in peft) and any(k.startswith("single_transformer_blocks") and
                                                                 k.endswith("proj_out") for k in peft)
        for model in (fast, exact):
            W.set_lora(model, peft, LORA_ALPHA / LORA_RANK, merge=model.lora_merge)
    inp = inputs(TINY, 2, (3, 4), 7, seed=2)
    expected = diffusers_forward(ref, inp)
    assert_bitwise(engine_forward(exact, inp), expected, "group flux")
    assert_differs(engine_forward(fast, inp), expected, "group none")
    if lora:  # the fast engine's merged LoRA alone already breaks parity
        W.set_lora(exact, peft, LORA_ALPHA / LORA_RANK, merge=True)
        assert_differs(engine_forward(exact, inp), expected, "merged LoRA")


def test_other_config_bitwise_without_code_changes():
    ref = diffusers_model(OTHER, seed=3)
    inp = inputs(OTHER, 3, (2, 5), 9, seed=4)
    assert_bitwise(engine_forward(engine_model(ref, group=True), inp), diffusers_forward(ref, inp), "OTHER")


# -- each patch's op against the diffusers module it mirrors; the fast op differs ------------------------------------
def _seeded(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module.to(BF16).eval()


SHAPES = [(2, 24, 64), (2, 60, 3072)]  # tiny, and FLUX.1's width


@pytest.mark.parametrize("shape", [(2, 24, 64), (2, 60, 512)], ids=["2x24x64", "2x60x512"])
def test_adaptive_layer_norms(shape):
    """AdaLayerNormZero (double-stream norm1), AdaLayerNormZeroSingle (single-stream norm) and AdaLayerNormContinuous
    (norm_out) against the engine's modules on their weights: every output bitwise under the patch, the modulated
    one not with the fast op."""
    B, S, D = shape
    x, temb = randn(shape, 10, std=3.0), randn((B, D), 11)
    for theirs, rows in ((AdaLayerNormZero(D), 6), (AdaLayerNormZeroSingle(D), 3)):
        theirs = _seeded(theirs, rows)
        mine = T.AdaNormZero(D, rows).to(BF16)
        mine.linear.load_state_dict(theirs.linear.state_dict())
        with torch.no_grad():
            expected = theirs(x, emb=temb)
            act = torch.nn.functional.silu(temb)
            fast = mine(x, act)
            mine.norm.impl = P.layer_norm_scale_shift_exact
            exact = mine(x, act)
        for e, o in zip(expected, exact):
            assert_bitwise(o, e, f"{type(theirs).__name__}")
        assert_differs(fast[0], expected[0], f"{type(theirs).__name__}, fast")
    theirs = _seeded(AdaLayerNormContinuous(D, D, elementwise_affine=False, eps=1e-6), 12)
    mine = T.OutputNorm(D).to(BF16)
    mine.linear.load_state_dict(theirs.linear.state_dict())
    with torch.no_grad():
        expected, fast = theirs(x, temb), mine(x, temb)
        mine.norm.impl = P.layer_norm_scale_shift_exact
        assert_bitwise(mine(x, temb), expected, "AdaLayerNormContinuous")
    assert_differs(fast, expected, "AdaLayerNormContinuous, fast")


@pytest.mark.parametrize("shape", SHAPES, ids=["2x24x64", "2x60x3072"])
def test_gated_residuals(shape):
    x, y = randn(shape, 20, std=2.0), randn(shape, 21, std=2.0)
    gate, shift, scale = (randn((shape[0], shape[-1]), s, std=0.5) for s in (22, 23, 24))
    # FluxTransformerBlock.forward: `hidden_states + gate_msa.unsqueeze(1) * attn_output`, then norm2 on that sum
    res = x + gate.unsqueeze(1) * y
    with torch.no_grad():
        normed = torch.nn.LayerNorm(shape[-1], elementwise_affine=False, eps=1e-6)(res)
    assert_bitwise(P.gated_residual_reference(y, gate, x), res, "residual reference")
    assert_differs(M.gated_residual_fused(y, gate, x), res, "residual fused")
    r, out = P.scale_residual_layer_norm_scale_shift_reference(x, y, gate, shift, scale, 1e-6)
    assert_bitwise(r, res, "the new residual")
    assert_bitwise(out, normed * (1 + scale[:, None]) + shift[:, None], "norm2 and its modulation")
    assert_differs(M.scale_residual_layer_norm_scale_shift_fused(x, y, gate, shift, scale, 1e-6)[1],
                   normed * (1 + scale[:, None]) + shift[:, None], "fused")


def test_rope_tables_are_flux_pos_embeds():
    """FluxPosEmbed on the pipeline's bf16 ids (FLUX.1's axes, 1024² image tokens after 64 text tokens): bitwise, one
    table for every head; the fast fp32 tables differ."""
    axes, grid, text_len = (16, 56, 56), (64, 64), 64
    ids = torch.cat([torch.zeros(text_len, 3).to(BF16), image_ids(grid, "cpu", BF16)])
    cos, sin = FluxPosEmbed(theta=10000, axes_dim=list(axes))(ids)
    ref = P.rope_tables_reference(grid, text_len, axes, "cpu", BF16)
    assert_bitwise(ref.cos.repeat_interleave(2, dim=-1), cos, "cos")
    assert_bitwise(ref.sin.repeat_interleave(2, dim=-1), sin, "sin")
    fast = T.rope_tables_fast(grid, text_len, axes, "cpu", BF16)
    assert ref.pairs == fast.pairs == "interleaved"
    assert_differs(fast.cos, ref.cos, "fp32 cos")


@pytest.mark.parametrize("heads,axes", [(2, (8, 12, 12)), (24, (16, 56, 56))], ids=["tiny", "full_width"])
def test_qk_norm_rope(heads, axes):
    """FluxAttention's `norm_q` (`torch.nn.RMSNorm`) then `apply_rotary_emb(..., sequence_dim=1)` over the joint
    sequence: bitwise; the fused op differs."""
    grid, text_len = (4, 6), 8
    D = sum(axes)
    x = randn((2, text_len + grid[0] * grid[1], heads, D), 50, std=3.0)
    weight = randn((D,), 51, std=0.3, mean=1.0)
    norm = torch.nn.RMSNorm(D, eps=EPS).to(BF16)
    ids = torch.cat([torch.zeros(text_len, 3).to(BF16), image_ids(grid, "cpu", BF16)])
    tables = P.rope_tables_reference(grid, text_len, axes, "cpu", BF16)
    with torch.no_grad():
        norm.weight.copy_(weight)
        expected = apply_rotary_emb(norm(x), FluxPosEmbed(10000, list(axes))(ids), sequence_dim=1)
    assert_bitwise(P.qk_norm_rope_reference(x, weight, EPS, tables), expected, "with RoPE")
    assert_differs(qk_norm_rope_fused(x, weight, EPS, tables), expected, "fused")


def test_timestep_and_guidance_projections():
    """The sinusoids of FluxTransformer2DModel's `timestep.to(dtype) * 1000` (the pipeline passed `t.to(dtype) /
    1000`) and `guidance.to(dtype) * 1000` (the pipeline passed the fp32 scale), by diffusers' Timesteps; the fast
    fp32 path differs."""
    g = torch.Generator().manual_seed(60)
    t = torch.cat([torch.rand(512, generator=g) * 1000, torch.tensor([0.0, 1000.0])])
    scale = torch.cat([1 + 9 * torch.rand(512, generator=g), torch.tensor([3.5, 1.0])])
    proj = Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)
    pipeline_timestep = t.to(BF16) / 1000
    expected = proj(pipeline_timestep.to(BF16) * 1000).to(BF16)
    assert_bitwise(P.timestep_proj_reference(t, BF16), expected, "timestep")
    assert_differs(T.timestep_proj_fused(t, BF16), expected, "timestep, fp32")
    expected = proj(scale.to(BF16) * 1000).to(BF16)
    assert float((torch.tensor(3.5).to(BF16) * 1000).float()) == 3504.0  # FLUX.1-dev's default scale, as embedded
    assert_bitwise(P.guidance_proj_reference(scale, BF16), expected, "guidance")
    assert_differs(T.guidance_proj_fused(scale, BF16), expected, "guidance, fp32")


def test_unpacked_projections_equal_separate_linears():
    """A single-stream block's packed GEMM (q, k, v and the MLP's input projection) unpacked is the block's four
    diffusers Linears' bits; the weight map puts each in its slot."""
    D, heads, head_dim = 64, 2, 32
    theirs = _seeded(FluxSingleTransformerBlock(D, heads, head_dim), 80)
    mine = T.SingleTransformerBlock(D, heads, head_dim).to(BF16)
    layers = [theirs.attn.to_q, theirs.attn.to_k, theirs.attn.to_v, theirs.proj_mlp]
    with torch.no_grad():
        mine.attn_mlp.weight.copy_(torch.cat([m.weight for m in layers]))
        mine.attn_mlp.bias.copy_(torch.cat([m.bias for m in layers]))
    mine.attn_mlp.unpacked = True
    x = randn((2, 33, D), 81)
    with torch.no_grad():
        for name, o, r in zip(("q", "k", "v", "mlp"), mine.attn_mlp(x), (m(x) for m in layers)):
            assert_bitwise(o, r, name)
    assert [W.map_module_name(f"single_transformer_blocks.3.{n}") for n in
            ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")] == [("single_transformer_blocks.3.attn_mlp", i)
                                                                     for i in range(4)]
    assert W.map_module_name("transformer_blocks.3.attn.to_q") == ("transformer_blocks.3.attn.to_qkv", 0)


# -- weights and config ----------------------------------------------------------------------------------------------
def test_name_map_round_trips_and_covers_every_tensor():
    ref = build_transformer(TINY, seed=0, dtype=BF16)
    model = T.build_model(dict(ref.config), "cpu", BF16)
    assert set(W.weight_map.expected_tensors(model, W.NAMES)) == set(ref.state_dict())
    W.load_weights(model, ref.state_dict())
    for name, mod in model.named_modules():
        if isinstance(mod, W.weight_map.Linear):
            for slot in (range(len(mod.splits)) if mod.packed else (None,)):
                assert W.map_module_name(W.diffusers_module_name(name, slot)) == (name, slot)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sd = {k: torch.zeros_like(v) for k, v in ref.state_dict().items()}
    del sd["single_transformer_blocks.1.proj_mlp.bias"]
    sd["proj_out.weight"] = torch.zeros(3, 3)
    with pytest.raises(W.WeightLoadError) as err:
        W.load_weights(model, sd)
    assert "single_transformer_blocks.1.proj_mlp.bias" in str(err.value)
    assert "proj_out.weight (3, 3) != expected (64, 64)" in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "a refused load changed weights"


def test_config_refuses_what_the_engine_does_not_implement():
    with pytest.raises(ValueError, match="guidance_embeds=False.*FLUX.1-schnell"):
        T.FluxConfig.from_dict({**TINY, "guidance_embeds": False})
    with pytest.raises(ValueError, match=r"axes_dims_rope \(8, 12, 10\) must sum to attention_head_dim 32"):
        T.FluxConfig.from_dict({**TINY, "axes_dims_rope": [8, 12, 10]})
