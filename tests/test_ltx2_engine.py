"""The `ltx2` engine DiT against diffusers' `LTX2VideoTransformer3DModel` in its 2.3 configuration.

The train side runs diffusers' model as `LTX2Pipeline` calls it, except `isolate_modalities=True` and a one-token
audio stream: bf16 on the CPU, the `native` attention backend (the text mask becomes an additive bias that
`_native_flash` refuses), an all-ones text mask, `sigma` = the timestep. With the `ltx` patch group the engine's
output is bitwise (`torch.equal`) diffusers' at batch 2, with and without an unmerged LoRA of rank 8, and for another
2.3 config; without the group it is not. Each patch's reference op is compared with the diffusers code it mirrors,
and the engine's fast op is shown to differ on the same (crafted) input.

Kernel-selection patches with no CPU difference to show: `unpacked_qkv` (a packed GEMM is bitwise three GEMMs on
this CPU) and `attention_kernel` in the default `native` pairing (the engine hands SDPA the same call); their
equality sides are tested, and the `_native_math` pairing shows the pin can see a kernel change.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import LTX2VideoTransformer3DModel
from diffusers.models.attention_dispatch import attention_backend, dispatch_attention_fn
from diffusers.models.embeddings import Timesteps
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm
from diffusers.models.transformers.transformer_ltx2 import (LTX2Attention, LTX2AudioVideoRotaryPosEmbed,
                                                            apply_split_rotary_emb)
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from torch import nn

from conftest import BF16, EPS, assert_bitwise, assert_differs, randn
from trueflow import kernels
from trueflow.layers import modulation as M
from trueflow.layers.attention import attention
from trueflow.layers.rope import RopeTables, qk_norm_across_heads_rope_fused
from trueflow.models.ltx2 import patches as P
from trueflow.models.ltx2 import transformer as T
from trueflow.models.ltx2 import weights as W

# A tiny LTX-2.3: every 2.3 flag on (gated attention, cross-attention modulation, split RoPE in double precision, no
# caption projection, perturbed-attention processors), two layers. The audio sizes follow the real model's ratios.
TINY = {
    "in_channels": 16, "out_channels": 16, "num_attention_heads": 2, "attention_head_dim": 16,
    "cross_attention_dim": 32, "caption_channels": 3840, "num_layers": 2,
    "gated_attn": True, "cross_attn_mod": True, "audio_gated_attn": True, "audio_cross_attn_mod": True,
    "rope_type": "split", "rope_double_precision": True, "use_prompt_embeddings": False, "perturbed_attn": True,
    "audio_in_channels": 4, "audio_out_channels": 4, "audio_num_attention_heads": 2, "audio_attention_head_dim": 8,
    "audio_cross_attention_dim": 16,
}
# The same family with other heads, head width, layers and text width (the text is modulated by the video rows, so
# it is as wide as the video stream), run with another frame count below.
OTHER = {**TINY, "num_attention_heads": 4, "attention_head_dim": 12, "cross_attention_dim": 48, "num_layers": 3,
         "audio_num_attention_heads": 4, "audio_attention_head_dim": 4}
LORA_RANK, LORA_ALPHA = 8, 12  # scale 1.5: the scale multiply rounds in bf16
# Every video-stream Linear, the gate logits included (a packed slot of the engine), and one audio module, which the
# engine must skip without losing parity.
LORA_TARGETS = (r"transformer_blocks\.\d+\.(attn1|attn2)\.(to_q|to_k|to_v|to_out\.0|to_gate_logits)"
                r"|transformer_blocks\.\d+\.ff\.net\.(0\.proj|2)|transformer_blocks\.\d+\.audio_attn1\.to_q")
FPS = 24.0


def diffusers_model(config: dict, seed: int) -> LTX2VideoTransformer3DModel:
    """The train side with seeded random weights (tables larger than diffusers' init, so modulation matters)."""
    model = LTX2VideoTransformer3DModel(**config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if name.endswith("table") else 0.2))
    model = model.to(BF16).eval()
    model.set_attention_backend("native")
    return model


def engine_model(ref: nn.Module, group: bool) -> T.LTX2Transformer:
    model = T.build_model(dict(ref.config), "cpu", BF16)
    W.load_weights(model, ref.state_dict())
    if group:
        for patch in P.GROUP.patches:
            patch.apply(model)
    return model


def inputs(config: dict, batch: int, grid: tuple[int, int, int], text_len: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    frames, rows, cols = grid
    t = (torch.rand(1, generator=g) * 1000).expand(batch).contiguous()  # one schedule timestep, fp32
    return {"hidden_states": (torch.randn(batch, frames * rows * cols, config["in_channels"], generator=g)).to(BF16),
            "encoder_hidden_states": torch.randn(batch, text_len, config["cross_attention_dim"], generator=g).to(BF16),
            "timestep": t, "grid": grid}


def diffusers_forward(ref, inp: dict, mask: torch.Tensor | None = None, audio_seed: int = 0,
                      audio_len: int = 1) -> torch.Tensor:
    """The pipeline's call, isolated, with a one-token (or `audio_len`) audio stream of seeded content (its timestep
    the per-sample sigma when the video's is per token)."""
    B, L = inp["encoder_hidden_states"].shape[:2]
    frames, rows, cols = inp["grid"]
    g = torch.Generator().manual_seed(1000 + audio_seed)
    c = ref.config
    mask = torch.ones(B, L, dtype=torch.int64) if mask is None else mask
    with torch.no_grad():
        return ref(hidden_states=inp["hidden_states"],
                   audio_hidden_states=torch.randn(B, audio_len, c.audio_in_channels, generator=g).to(BF16),
                   encoder_hidden_states=inp["encoder_hidden_states"],
                   audio_encoder_hidden_states=torch.randn(B, L, c.audio_cross_attention_dim, generator=g).to(BF16),
                   timestep=inp["timestep"], sigma=inp.get("sigma", inp["timestep"]),
                   audio_timestep=inp.get("sigma"), encoder_attention_mask=mask,
                   audio_encoder_attention_mask=mask, num_frames=frames, height=rows, width=cols, fps=FPS,
                   audio_num_frames=audio_len, isolate_modalities=True, use_cross_timestep=True,
                   return_dict=False)[0]


def engine_forward(model, inp: dict, mask: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        return model(hidden_states=inp["hidden_states"], timestep=inp["timestep"], grid=inp["grid"],
                     encoder_hidden_states=inp["encoder_hidden_states"], encoder_attention_mask=mask,
                     sigma=inp.get("sigma"), fps=FPS)


@pytest.fixture(scope="module")
def tiny() -> LTX2VideoTransformer3DModel:
    return diffusers_model(TINY, seed=0)


# -- the whole model ----------------------------------------------------------------------------------------------
def test_isolated_video_output_ignores_the_audio_stream(tiny):
    """What lets the engine skip the audio stream: with the modalities isolated, other audio content and another
    audio length leave the video output's bits unchanged."""
    inp = inputs(TINY, 2, (2, 3, 4), 5, seed=1)
    base = diffusers_forward(tiny, inp)
    assert_bitwise(diffusers_forward(tiny, inp, audio_seed=7), base, "other audio content")
    assert_bitwise(diffusers_forward(tiny, inp, audio_seed=8, audio_len=3), base, "three audio tokens")


@pytest.mark.parametrize("lora", [False, True], ids=["no_lora", "lora8"])
def test_group_bitwise_with_diffusers(lora):
    ref = diffusers_model(TINY, seed=0)  # its own copy: the adapter is added to it
    fast, exact = engine_model(ref, group=False), engine_model(ref, group=True)
    if lora:
        ref.add_adapter(LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=LORA_TARGETS))
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for name, p in sorted(ref.named_parameters()):
                if ".lora_B." in name:  # PEFT starts B at zero; a trained adapter has B != 0
                    p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        peft = W.parse_peft_state_dict(get_peft_model_state_dict(ref))
        assert any(W.is_audio_only(k) for k in peft) and any(".to_gate_logits" in k for k in peft)
        for model in (fast, exact):
            W.set_lora(model, peft, LORA_ALPHA / LORA_RANK, merge=model.lora_merge)
    inp = inputs(TINY, 2, (2, 3, 4), 5, seed=2)
    expected = diffusers_forward(ref, inp)
    assert_bitwise(engine_forward(exact, inp), expected, "group ltx")
    assert_differs(engine_forward(fast, inp), expected, "group none")
    if lora:  # the fast engine's merged LoRA alone already breaks parity
        W.set_lora(exact, peft, LORA_ALPHA / LORA_RANK, merge=True)
        assert_differs(engine_forward(exact, inp), expected, "merged LoRA")


@pytest.mark.parametrize("grid,padded,per_token", [((5, 2, 3), False, False), ((3, 4, 2), True, False),
                                                   ((2, 2, 3), False, True)],
                         ids=["9x64x96", "padded_text", "per_token_timesteps"])
def test_other_config_bitwise_without_code_changes(grid, padded, per_token):
    """Other heads, head width, layers, text width and frame count; a text mask with padding (the bias then masks
    real tokens); per-token timesteps [B, S] with the prompt modulation's own sigma [B]."""
    ref = diffusers_model(OTHER, seed=3)
    inp = inputs(OTHER, 2, grid, 6, seed=4)
    if per_token:
        g = torch.Generator().manual_seed(9)
        inp["timestep"] = torch.rand(2, inp["hidden_states"].shape[1], generator=g) * 1000
        inp["sigma"] = torch.rand(2, generator=g) * 1000
    mask = torch.ones(2, 6, dtype=torch.int64)
    if padded:
        mask[1, 4:] = 0
    assert_bitwise(engine_forward(engine_model(ref, group=True), inp, mask if padded else None),
                   diffusers_forward(ref, inp, mask), f"OTHER {grid}")


# -- each patch's op against the diffusers code it mirrors; the fast op differs --------------------------------
def mods(shape, seed):
    """Modulation rows [B, 1, D] as `get_mod_params` gives them (bf16)."""
    return randn((shape[0], 1, shape[-1]), seed, std=0.5), randn((shape[0], 1, shape[-1]), seed + 1, std=0.5)


SHAPES = [(2, 24, 32), (2, 60, 4096)]


@pytest.mark.parametrize("shape", SHAPES, ids=["2x24x32", "2x60x4096"])
def test_rms_norm_scale_shift(shape):
    x = randn(shape, 10, std=3.0)
    shift, scale = mods(shape, 11)
    norm = DiffusersRMSNorm(shape[-1], eps=EPS, elementwise_affine=False)  # the block's norm1/norm2/norm3
    with torch.no_grad():
        expected = norm(x) * (1 + scale) + shift
        bare = norm(x)
    assert_bitwise(P.rms_norm_scale_shift_reference(x, shift, scale, EPS), expected, "reference")
    assert_differs(M.rms_norm_scale_shift_fused(x, shift, scale, EPS), expected, "fused")
    # Without modulation (LTX-2.0's norm2) the bare norm rounds once on both paths.
    assert_bitwise(M.rms_norm_scale_shift_fused(x, None, None, EPS), bare, "bare norm, fused")


@pytest.mark.parametrize("shape", SHAPES, ids=["2x24x32", "2x60x4096"])
def test_text_kv_modulation_and_gated_residual(shape):
    x, y = randn(shape, 20, std=2.0), randn(shape, 21, std=2.0)
    shift, scale = mods(shape, 22)
    gate = randn((shape[0], 1, shape[-1]), 24, std=0.5)
    # diffusers' block: `encoder_hidden_states * (1 + scale_text_kv) + shift_text_kv` and
    # `hidden_states + attn_hidden_states * gate_msa`
    kv, res = x * (1 + scale) + shift, x + y * gate
    assert_bitwise(P.scale_shift_reference(x, shift, scale), kv, "kv reference")
    assert_differs(M.scale_shift_fused(x, shift, scale), kv, "kv fused")
    assert_bitwise(P.gated_residual_reference(y, gate, x), res, "residual reference")
    assert_differs(M.gated_residual_fused(y, gate, x), res, "residual fused")


@pytest.mark.parametrize("shape", SHAPES, ids=["2x24x32", "2x60x4096"])
def test_output_layer_norm_scale_shift(shape):
    x = randn(shape, 30, std=3.0)
    embedded = randn((shape[0], 1, shape[-1]), 31)
    table = randn((2, shape[-1]), 32, std=0.5)
    # diffusers' output layer: the table plus the embedded timestep, (shift, scale), LayerNorm, modulation
    values = table[None, None] + embedded[:, :, None]
    shift, scale = values[:, :, 0], values[:, :, 1]
    with torch.no_grad():
        expected = nn.LayerNorm(shape[-1], eps=1e-6, elementwise_affine=False)(x) * (1 + scale) + shift
    assert_bitwise(P.layer_norm_scale_shift_reference(x, shift, scale, 1e-6), expected, "reference")
    assert_differs(M.layer_norm_scale_shift_fused(x, shift, scale, 1e-6), expected, "fused")


def test_attention_gate():
    out, logits = randn((2, 40, 4, 32), 40, std=2.0), randn((2, 40, 4), 41, std=2.0)
    # diffusers' processor: gates = 2.0 * torch.sigmoid(gate_logits); hidden_states * gates.unsqueeze(-1)
    expected = out * (2.0 * torch.sigmoid(logits)).unsqueeze(-1)
    assert_bitwise(P.attention_gate_reference(out, logits), expected, "reference")
    assert_differs(M.attention_gate_fused(out, logits), expected, "fused")


def diffusers_rope(config: T.LTX2Config, grid, batch: int = 1):
    rope = LTX2AudioVideoRotaryPosEmbed(dim=config.inner_dim, base_num_frames=config.pos_embed_max_pos,
                                        base_height=config.base_height, base_width=config.base_width,
                                        scale_factors=config.vae_scale_factors, theta=config.rope_theta,
                                        causal_offset=config.causal_offset, modality="video",
                                        double_precision=True, rope_type="split",
                                        num_attention_heads=config.num_attention_heads)
    return rope(rope.prepare_video_coords(batch, *grid, torch.device("cpu"), fps=FPS))


# The real model's heads and width (48 frames x 16 x 24 tokens would be slow: the tables do not depend on the batch).
ROPE_CASES = [(T.LTX2Config.from_dict(TINY), (3, 4, 5)), (T.LTX2Config.from_dict(OTHER), (5, 2, 3)),
              (T.LTX2Config.from_dict({**TINY, "num_attention_heads": 32, "attention_head_dim": 128,
                                      "cross_attention_dim": 4096}), (8, 4, 6))]


@pytest.mark.parametrize("config,grid", ROPE_CASES, ids=["tiny", "other", "full_width"])
def test_rope_tables(config, grid):
    cos, sin = diffusers_rope(config, grid, batch=2)
    ref = P.rope_tables_reference(config, grid, FPS, "cpu")
    for b in range(2):  # one table serves every sample
        assert_bitwise(ref.cos[0], cos[b], "cos")
        assert_bitwise(ref.sin[0], sin[b], "sin")
    fast = T.rope_tables_fused(config, grid, FPS, "cpu")
    assert ref.pairs == fast.pairs == "split"
    assert_differs(torch.cat([fast.cos, fast.sin]), torch.cat([cos[:1], sin[:1]]), "fp32 tables")


@pytest.mark.parametrize("config,grid", ROPE_CASES, ids=["tiny", "other", "full_width"])
def test_qk_norm_rope(config, grid):
    heads, inner = config.num_attention_heads, config.inner_dim
    S = grid[0] * grid[1] * grid[2]
    x = randn((2, S, inner), 50, std=3.0)
    weight = randn((inner,), 51, std=0.3, mean=1.0)
    tables = diffusers_rope(config, grid, batch=2)
    norm = nn.RMSNorm(inner, eps=EPS).to(BF16)  # LTX2Attention's norm_q / norm_k
    with torch.no_grad():
        norm.weight.copy_(weight)
        normed = norm(x)
    expected = apply_split_rotary_emb(normed, tables).unflatten(-1, (heads, -1))
    own = RopeTables(cos=tables[0][:1], sin=tables[1][:1], pairs="split")
    assert_bitwise(P.qk_norm_rope_reference(x, weight, EPS, heads, own), expected, "with RoPE")
    assert_differs(qk_norm_across_heads_rope_fused(x, weight, EPS, heads, own), expected, "fused")
    assert_bitwise(P.qk_norm_rope_reference(x, weight, EPS, heads, None), normed.unflatten(-1, (heads, -1)),
                   "text attention: norm only")


def test_timestep_projection_is_diffusers():
    """No patch needed: the fp32 timestep is not rounded, and folding the /128 into the exponent's constant is exact
    (a power of two), so the engine's sinusoid is diffusers' bit for bit."""
    t = torch.cat([torch.rand(4096, generator=torch.Generator().manual_seed(60)) * 1000, torch.tensor([0.0, 1000.0])])
    assert_bitwise(T.timestep_proj(t), Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)(t), "proj")


def test_text_mask_bias_and_attention_kernel():
    """The engine's text mask under the group is the bias diffusers builds (the model's conversion, then the
    attention's `prepare_attention_mask`); attention with it equals diffusers' dispatch under the `native` and
    `_native_math` pairings; on padded keys that score above 10^4 a -10000 bias does not mask as the fast bool mask
    does."""
    B, H, S, L, D = 2, 2, 9, 6, 16
    mask = torch.ones(B, L, dtype=torch.int64)
    mask[1, 3:] = 0
    model = T.build_model({**TINY, "num_attention_heads": H, "attention_head_dim": D}, "cpu", BF16)
    model.text_mask_bias = True
    attn = LTX2Attention(query_dim=H * D, heads=H, kv_heads=H, dim_head=D)
    bias = (1 - mask.to(BF16)) * -10000.0  # LTX2VideoTransformer3DModel.forward
    bias = attn.prepare_attention_mask(bias.unsqueeze(1), L, B).view(B, H, -1, L)  # the processor
    assert_bitwise(model.text_mask(mask, B, L, BF16, "cpu"), bias, "bias")
    assert_bitwise(model.text_mask(None, B, L, BF16, "cpu"), torch.zeros_like(bias), "no mask: all ones")
    q = randn((B, S, H, D), 70, std=0.1, mean=60.0)
    k = randn((B, L, H, D), 71)
    k[1, 3:] = 60.0  # the padded keys score 60·60·16/4 = 14400 against q: more than the bias takes away
    v = randn((B, L, H, D), 72)
    for backend, kernel in P.TRAIN_ATTENTION_KERNELS.items():
        if kernel == "efficient":
            continue  # CUDA only
        with attention_backend(backend):
            expected = dispatch_attention_fn(q, k, v, attn_mask=bias)
        assert_bitwise(attention(q, k, v, bias, kernel), expected, f"{backend} pairing")
    model.text_mask_bias = False
    with attention_backend("native"):
        expected = dispatch_attention_fn(q, k, v, attn_mask=bias)
    assert_differs(attention(q, k, v, model.text_mask(mask, B, L, BF16, "cpu"), "sdpa"), expected, "bool mask")
    q, k = randn((B, S, H, D), 73), randn((B, L, H, D), 74)  # ordinary scores: the kernels round apart
    with attention_backend("_native_math"):
        expected = dispatch_attention_fn(q, k, v, attn_mask=bias)
    assert_bitwise(attention(q, k, v, bias, "math"), expected, "math pinned")
    assert_differs(attention(q, k, v, bias, "sdpa"), expected, "the sdpa choice vs the math pairing")
    with attention_backend("_native_flash"), pytest.raises(ValueError, match="attn_mask"):
        dispatch_attention_fn(q, k, v, attn_mask=bias)  # why the flash pairing is not offered


def test_unpacked_qkv_gate_equals_separate_linears():
    """The packed self-attention GEMM (q, k, v, gate logits) unpacked is four diffusers Linears' bits."""
    ref = LTX2Attention(query_dim=64, heads=4, kv_heads=4, dim_head=16, apply_gated_attention=True).to(BF16)
    g = torch.Generator().manual_seed(80)
    with torch.no_grad():
        for _, p in sorted(ref.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    mine = T.SelfAttention(64, 4, 16, gated=True, bias=True, out_bias=True, eps=EPS).to(BF16)
    layers = [ref.to_q, ref.to_k, ref.to_v, ref.to_gate_logits]
    with torch.no_grad():
        mine.to_qkv.weight.copy_(torch.cat([m.weight for m in layers]))
        mine.to_qkv.bias.copy_(torch.cat([m.bias for m in layers]))
    mine.to_qkv.unpacked = True
    x = randn((2, 33, 64), 81)
    with torch.no_grad():
        for name, o, r in zip(("q", "k", "v", "gate"), mine.to_qkv(x), (m(x) for m in layers)):
            assert_bitwise(o, r, name)


# -- weights and config ----------------------------------------------------------------------------------------------
def test_name_map_round_trips_and_covers_the_video_stream(tiny):
    model = T.build_model(dict(tiny.config), "cpu", BF16)
    video = {k for k in tiny.state_dict() if not W.is_audio_only(k)}
    assert set(W.weight_map.expected_tensors(model, W.NAMES)) == video
    for name, mod in model.named_modules():
        if isinstance(mod, W.weight_map.Linear):
            for slot in (range(len(mod.splits)) if mod.packed else (None,)):
                assert W.map_module_name(W.diffusers_module_name(name, slot)) == (name, slot)
    skipped = {k.split(".")[0] if not k.startswith("transformer_blocks") else k.split(".")[2]
               for k in tiny.state_dict() if W.is_audio_only(k)}
    assert skipped == {"audio_proj_in", "audio_time_embed", "audio_prompt_adaln", "av_cross_attn_video_scale_shift",
                       "av_cross_attn_audio_scale_shift", "av_cross_attn_video_a2v_gate",
                       "av_cross_attn_audio_v2a_gate", "audio_scale_shift_table", "audio_proj_out", "audio_attn1",
                       "audio_attn2", "audio_to_video_attn", "video_to_audio_attn", "audio_ff",
                       "audio_prompt_scale_shift_table", "video_a2v_cross_attn_scale_shift_table",
                       "audio_a2v_cross_attn_scale_shift_table"}


def test_load_weights_is_all_or_nothing(tiny):
    model = engine_model(tiny, group=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sd = {k: torch.zeros_like(v) for k, v in tiny.state_dict().items()}
    del sd["transformer_blocks.1.attn2.to_gate_logits.bias"]
    sd["proj_out.weight"] = torch.zeros(3, 3)
    with pytest.raises(W.WeightLoadError) as err:
        W.load_weights(model, sd)
    assert "transformer_blocks.1.attn2.to_gate_logits.bias" in str(err.value)
    assert "proj_out.weight (3, 3) != expected (16, 32)" in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "a refused load changed weights"


def test_config_refuses_unimplemented_variants():
    with pytest.raises(ValueError, match="rope_type='interleaved'"):
        T.LTX2Config.from_dict({k: v for k, v in TINY.items() if k != "rope_type"})  # diffusers' default: 2.0
    with pytest.raises(ValueError, match="use_prompt_adaln_single=False"):
        T.LTX2Config.from_dict({**TINY, "use_prompt_adaln_single": False})
    model = T.build_model(TINY, "cpu", BF16)
    inp = inputs(TINY, 1, (1, 2, 2), 3, seed=0)
    with pytest.raises(ValueError, match="does not hold"):
        model(**{**inp, "grid": (1, 2, 3)})
    with pytest.raises(TypeError, match="video_coords"):
        model(**inp, video_coords=None)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and kernels.HAS_TRITON), reason="needs CUDA and triton")
def test_cuda_graphs_replay_the_group_bitwise_on_cuda():
    """One block at the real width (32 heads x 128, 4096 wide) on CUDA, LoRA 8: the `ltx` group's engine (its
    eager-exact kernels) is diffusers' bits eagerly and replayed from a captured CUDA graph (the warm-up finds the
    split RoPE's rounding, the capture replays it); an unmerged LoRA update keeps the graph and the bits; the fast
    engine (its Triton kernels) replays its own eager bits and differs from diffusers."""
    from trueflow.engine.cuda_graph import GraphedForward
    from trueflow.parity.probe import ParityProbe, ProbeSpec

    probe = ParityProbe(ProbeSpec(random_size="one_block", family="ltx2", batch=2, text_len=16, resolution=256,
                                  lora_rank=8, device="cuda", layer_report="none"))
    i = probe.inputs

    def call(forward) -> torch.Tensor:
        with torch.no_grad():
            return forward(hidden_states=i["hidden_states"], timestep=i["timestep"], grid=i["grid"], **i["cond"])

    engine = probe.build_engine("ltx")
    graphed = GraphedForward(engine)
    assert_bitwise(call(engine), probe.train_output, "eager, group ltx")
    for replay in range(2):
        assert_bitwise(call(graphed), probe.train_output, f"replay {replay}")
    assert graphed.captures == 1 and P.split_rope_fma(i["hidden_states"].device) is not None
    probe.step_lora(engine, seed=3)
    assert_bitwise(call(graphed), probe.train_output, "replay after a LoRA update")
    assert graphed.captures == 1 and graphed.invalidations == 0
    fast = GraphedForward(probe.build_engine("none"))
    assert_bitwise(call(fast), call(fast.model), "fast replay vs eager")
    assert fast.captures == 1
    assert_differs(call(fast), probe.train_output, "fast vs diffusers")
