"""The engine's SD3 transformer, op by op, against the diffusers modules each `sd3` patch mirrors
(`SD3Transformer2DModel`'s own submodules, with the checkpoint's weights): bitwise under the patch, and the engine's
fast op shown to differ on the same inputs (where it does on this CPU). Also the weight map (all or nothing, every
LoRA target), and the configs the engine refuses."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import BF16, assert_bitwise, assert_differs, randn
from trueflow.engine.weights import build_engine_transformer
from trueflow.layers.modulation import (GatedResidual, LayerNormScaleShift, ScaleResidualLayerNormScaleShift,
                                        gated_residual_fused, layer_norm_scale_shift_fused,
                                        scale_residual_layer_norm_scale_shift_fused)
from trueflow.layers.rope import qk_norm_rope_fused
from trueflow.models.sd3 import patches
from trueflow.models.sd3.latents import pack_latents, unpack_latents
from trueflow.models.sd3.presets import build_transformer, transformer_config
from trueflow.models.sd3.transformer import SD3Config, patch_embed_fused
from trueflow.models.sd3.weights import WeightLoadError, diffusers_module_name, map_module_name
from trueflow.models.sd3.train import LORA_TARGETS

B, ROWS, TEXT = 2, 8, 20  # batch 2: a strided GEMM and a contiguous one differ here


@pytest.fixture(scope="module")
def models():
    """The tiny diffusers transformer (bf16, seed 0) and the engine built from its tensors under the `sd3` group."""
    config = transformer_config("tiny")
    ref = build_transformer(config, seed=0, dtype=BF16)
    return ref, build_engine_transformer(config, ref.state_dict(), "cpu", BF16, "sd3", family="sd3")


def _x(shape, seed):
    return randn(shape, seed)


def test_adaln_modulations_are_diffusers(models):
    """AdaLayerNormZero (6 rows), SD3.5's SD35AdaLayerNormZeroX (9 rows, two modulations of one LayerNorm) and the
    context pre-only block's AdaLayerNormContinuous (scale first): the normed outputs and the gates."""
    ref, eng = models
    x, temb = _x((B, 16, 64), 1), _x((B, 64), 2)
    act = F.silu(temb)
    with torch.no_grad():
        for name in ("transformer_blocks.0.norm1", "transformer_blocks.1.norm1", "transformer_blocks.1.norm1_context"):
            theirs = ref.get_submodule(name)(x, emb=temb)
            (normed, *rest), mod = eng.get_submodule(name)(x, act)
            assert_bitwise(normed, theirs[0], name)
            if rest:  # MMDiT-X: the second attention's input and gate
                assert_bitwise(rest[0], theirs[5], f"{name} (attn2 input)")
                assert_bitwise(mod[8], theirs[6], f"{name} (attn2 gate)")
            for got, want in zip((mod[2], mod[3], mod[4], mod[5]), theirs[1:5]):  # gate, shift, scale, gate (MLP)
                assert_bitwise(got, want, f"{name} rows")
        theirs = ref.transformer_blocks[2].norm1_context(x, temb)
        assert_bitwise(eng.transformer_blocks[2].norm1_context(x, act), theirs, "AdaLayerNormContinuous")
        assert_bitwise(eng.norm_out(x, act), ref.norm_out(x, temb), "norm_out")
        # the fast op (one rounding) is not diffusers'
        scale, shift = ref.norm_out.linear(F.silu(temb)).chunk(2, dim=1)
        assert_differs(layer_norm_scale_shift_fused(x, shift, scale, 1e-6), ref.norm_out(x, temb), "fused LN")


@pytest.mark.parametrize("block", [0, 1, 2], ids=["dual", "joint", "context_pre_only"])
def test_each_block_is_diffusers(models, block):
    """A whole JointTransformerBlock (its residual and MLP lines: `scale_residual_layer_norm_scale_shift`, `mul_add`)
    bitwise; without each of the three modulation patches it differs."""
    ref, eng = models
    img, txt, temb = _x((B, 16, 64), 3), _x((B, TEXT, 64), 4), _x((B, 64), 5)
    with torch.no_grad():
        want = ref.transformer_blocks[block](hidden_states=img, encoder_hidden_states=txt, temb=temb)
        got = eng.transformer_blocks[block](img, txt, F.silu(temb))
        for g, w, what in zip(got, want, ("text", "image")):
            if w is None:
                assert g is None  # the context pre-only block drops the text stream
            else:
                assert_bitwise(g, w, f"block {block} {what}")
        blk = eng.transformer_blocks[block]
        for kind, fast in ((ScaleResidualLayerNormScaleShift, scale_residual_layer_norm_scale_shift_fused),
                           (GatedResidual, gated_residual_fused), (LayerNormScaleShift, layer_norm_scale_shift_fused)):
            mods = [m for m in blk.modules() if isinstance(m, kind)]
            saved = [m.impl for m in mods]
            try:
                for m in mods:
                    m.impl = fast
                assert_differs(blk(img, txt, F.silu(temb))[1], want[1], f"block {block}, {kind.__name__} fast")
            finally:
                for m, impl in zip(mods, saved):
                    m.impl = impl


def test_qk_norm_is_diffusers_rmsnorm_on_its_heads_major_view(models):
    ref, eng = models
    x = _x((B, 16, 2, 32), 6) * 3  # [B, S, H, D] as the projection unflattens it
    theirs_module = ref.transformer_blocks[0].attn.norm_q
    weight = eng.transformer_blocks[0].attn.norm_q.weight
    with torch.no_grad():
        theirs = theirs_module(x.transpose(1, 2))  # JointAttnProcessor2_0: view(B, -1, H, D).transpose(1, 2)
        ours = patches.qk_norm_reference(x, weight, 1e-6)
        assert_bitwise(ours.transpose(1, 2), theirs, "q norm")
        assert ours.transpose(1, 2).stride() == theirs.stride()  # the layout SDPA (or the cat) reads
        assert_differs(qk_norm_rope_fused(x, weight, 1e-6, None), ours, "fused qk norm")


def test_patch_embedding_is_diffusers_conv(models):
    ref, eng = models
    pe, side = eng.pos_embed, 16  # the whole 16x16 table (256 px): there the conv and the GEMM reduce differently
    latents = _x((B, 16, 2 * side, 2 * side), 7)
    tokens = pack_latents(latents)
    with torch.no_grad():
        theirs = ref.pos_embed(latents).contiguous()  # SD3Transformer2DModel.forward's `.contiguous()`
        ours = pe(tokens, (side, side))
        assert_bitwise(ours, theirs, "PatchEmbed")
        assert_bitwise(pe.cropped(4, 6), ref.pos_embed.cropped_pos_embed(8, 12), "a centred crop of the table")
        fast = patch_embed_fused(tokens, pe.proj.weight, pe.proj.bias, (side, side), pe.cropped(side, side))
        assert_differs(fast, theirs, "patch embedding as one GEMM")
        with pytest.raises(ValueError, match="exceeds the transformer's position table of 16x16"):
            pe.cropped(17, 4)


def test_joint_attention_is_diffusers_and_its_layout(models, monkeypatch):
    """`JointAttnProcessor2_0` bitwise (both q/k/v of both streams, the split, the projections; the pre-only block's
    raw text slice), SDPA handed the very layout diffusers hands it, and the contiguous split differing at batch 2."""
    ref, eng = models
    img, txt = _x((B, ROWS * ROWS, 64), 8), _x((B, TEXT, 64), 9)
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.shape, q.stride(), v.stride()))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        for block in (0, 2):
            want = ref.transformer_blocks[block].attn(hidden_states=img, encoder_hidden_states=txt)
            got = eng.transformer_blocks[block].attn(img, txt)
            assert seen[0] == seen[1], "the engine hands SDPA another layout than diffusers"
            seen.clear()
            for g, w in zip(got, want):
                assert_bitwise(g, w, f"block {block} attention")
        want = ref.transformer_blocks[0].attn2(hidden_states=img)
        assert_bitwise(eng.transformer_blocks[0].attn2(img), want, "attn2 (image only)")
        assert seen[0] == seen[1]
        attn = eng.transformer_blocks[0].attn
        attn.strided_split = False
        try:
            assert_differs(attn(img, txt)[0], ref.transformer_blocks[0].attn(img, txt)[0], "contiguous split")
        finally:
            attn.strided_split = True


def test_timestep_embedding_needs_no_patch(models):
    """The pipeline passes the fp32 schedule timestep; the engine's fast sinusoid of it is diffusers' bit for bit (a
    bf16 timestep, as other pipelines pass, would not be)."""
    ref, eng = models
    t, pooled = torch.tensor([999.0, 371.5]), _x((B, 32), 10)
    with torch.no_grad():
        want = ref.time_text_embed(t, pooled)
        assert_bitwise(eng.time_text_embed(t, pooled), want, "CombinedTimestepTextProjEmbeddings")
        assert_differs(eng.time_text_embed(t.to(BF16).float(), pooled), want, "a bf16 timestep")


def test_whole_model_and_output_order(models):
    ref, eng = models
    tokens, ehs, pooled = _x((B, ROWS * ROWS, 64), 11), _x((B, TEXT, 48), 12), _x((B, 32), 13)
    t = torch.full((B,), 642.0)
    with torch.no_grad():
        want = ref(hidden_states=unpack_latents(tokens, (ROWS, ROWS)).contiguous(), timestep=t,
                   encoder_hidden_states=ehs, pooled_projections=pooled, return_dict=False)[0]
        got = eng(hidden_states=tokens, timestep=t, grid=(ROWS, ROWS), encoder_hidden_states=ehs,
                  pooled_projections=pooled)
    assert_bitwise(got, pack_latents(want), "SD3Transformer2DModel")


def test_weight_map_and_refusals(models):
    ref, _ = models
    config = transformer_config("tiny")
    state = ref.state_dict()
    assert "pos_embed.pos_embed" in state  # diffusers' persistent buffer, loaded as a weight
    broken = {k: v for k, v in state.items() if k != "transformer_blocks.0.attn2.to_k.weight"}
    with pytest.raises(WeightLoadError, match=r"missing \(1\): transformer_blocks\.0\.attn2\.to_k\.weight"):
        build_engine_transformer(config, broken, "cpu", BF16, family="sd3")
    linears = [name for name, mod in ref.named_modules() if isinstance(mod, torch.nn.Linear)]
    for name in linears:  # every linear layer, so every LoRA target of any PEFT config, maps both ways
        engine, slot = map_module_name(name)
        assert diffusers_module_name(engine, slot) == name
    assert any(name.endswith("." + t) for t in LORA_TARGETS for name in linears)
    for bad, match in (({"qk_norm": "layer_norm"}, "qk_norm 'layer_norm'"),
                       ({"caption_projection_dim": 32}, "caption_projection_dim 32 must equal the model width 64"),
                       ({"pos_embed_max_size": None}, "needs pos_embed_max_size")):
        with pytest.raises(ValueError, match=match):
            SD3Config.from_dict({**config, **bad})


def test_the_gpu_script_smoke_path(tmp_path):
    """scripts/gpu_sd3.py on the tiny architecture on this CPU (parity after LoRA updates with batched CFG, the fast
    engine off, one timed guided step): the GPU run's code path, end to end."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "scripts" / "gpu_sd3.py"
    spec = importlib.util.spec_from_file_location("gpu_sd3", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "sd3_gpu.json"
    assert script.main(["--size", "tiny", "--device", "cpu", "--resolutions", "64", "--shapes", "64x1", "--batch", "2",
                        "--text-len", "8", "--lora-rank", "4", "--warmup", "1", "--reps", "1", "--no-ablate",
                        "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["parts"] == ["parity", "speed"]  # each a 10-minute slot of its own on the GPU (--parts)
    assert report["ok"] and [r["bitwise_equal"] for r in report["parity"]["rows"]] == [True, True, True, False]
    rows = {r["row"]: r for r in report["speed"]}
    assert set(rows) == {"diffusers_eager", "engine_parity", "engine_fast"}
    assert rows["engine_parity"]["max_abs_diff"] == 0.0 and rows["engine_fast"]["max_abs_diff"] > 0
    with pytest.raises(SystemExit, match="2"):
        script.main(["--parts", "parity,bogus", "--out", str(out)])
