"""The `wan` engine DiT against diffusers' `WanTransformer3DModel` (both Wan2.2 layouts' configs).

The train side runs diffusers' model as `WanPipeline` calls it, loaded as `from_pretrained(torch_dtype=bf16)` loads it
(its `_keep_in_fp32_modules` in fp32; `presets.build_transformer` builds it so), on `_native_flash`. With the `wan`
patch group the engine's output is bitwise (`torch.equal`) diffusers' at batch 2, with and without an unmerged LoRA of
rank 8, with one timestep per sample (the A14B) and one per token with the first frame's latents (the TI2V-5B's
image-to-video step); without the group it is not. Each patch's reference op is compared with the diffusers code it
mirrors, and the engine's fast op is shown to differ on the same input where this CPU can show it: `eager_modulation`
(the fast path is these very PyTorch ops on the CPU; Triton kernels on CUDA) and `unpacked_qkv` (a packed GEMM is
bitwise three GEMMs here) have their equality sides tested.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import attention_backend, dispatch_attention_fn
from diffusers.models.normalization import FP32LayerNorm
from diffusers.models.transformers import transformer_wan
from diffusers.models.transformers.transformer_wan import (WanAttention, WanRotaryPosEmbed,
                                                           WanTimeTextImageEmbedding)
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from conftest import BF16, assert_bitwise, assert_differs, randn
from trueflow.layers import modulation as M
from trueflow.layers.attention import attention
from trueflow.layers.rope import RopeTables, qk_norm_across_heads_rope_fused
from trueflow.models.wan import patches as P
from trueflow.models.wan import transformer as T
from trueflow.models.wan import weights as W
from trueflow.models.wan.latents import pack_latents, unpack_latents
from trueflow.models.wan.pipeline import probe_inputs
from trueflow.models.wan.presets import build_transformer, kept_in_fp32, transformer_config
from trueflow.models.wan.train import LORA_TARGETS, train_forward

EPS = 1e-6
LORA_RANK, LORA_ALPHA = 8, 12  # scale 1.5: the scale multiply rounds in bf16


def diffusers_model(size: str, seed: int = 0):
    from diffusers.models.attention_dispatch import attention_backend

    model = build_transformer(size, seed=seed, dtype=BF16)
    with attention_backend("_native_flash"):  # the model's processors only, not diffusers' process-wide default
        model.set_attention_backend("_native_flash")
    return model


def engine_model(ref, group: bool) -> T.WanTransformer:
    model = T.build_model(dict(ref.config), "cpu", BF16)
    W.load_weights(model, ref.state_dict())
    if group:
        for patch in P.GROUP.patches:
            patch.apply(model)
    return model


def forward(model, inp: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(hidden_states=inp["hidden_states"], timestep=inp["timestep"], grid=inp["grid"], **inp["cond"])


def diffusers_forward(ref, inp: dict) -> torch.Tensor:
    with torch.no_grad():
        return train_forward(ref, inp["hidden_states"], inp["timestep"], inp["grid"], inp["cond"])


LAYOUTS = {"a14b": ("tiny", 64, 8, False), "ti2v": ("tiny_ti2v", 128, 16, True)}


# -- the whole model --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lora", [False, True], ids=["no_lora", "lora8"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_group_bitwise_with_diffusers(layout, lora):
    size, resolution, spatial, per_token = LAYOUTS[layout]
    ref = diffusers_model(size)
    fast, exact = engine_model(ref, group=False), engine_model(ref, group=True)
    held = W.weight_map.expected_tensors(exact, W.NAMES)  # diffusers name -> (engine parameter, rows)
    assert {n: held[n][0].dtype for n in held} == {n: p.dtype for n, p in ref.named_parameters()}, \
        "the engine holds each tensor in the dtype diffusers loads it in (fp32 where it keeps fp32)"
    if lora:
        ref.add_adapter(LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=list(LORA_TARGETS)))
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for name, p in sorted(ref.named_parameters()):
                if ".lora_B." in name:  # PEFT starts B at zero; a trained adapter has B != 0
                    p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        peft = W.parse_peft_state_dict(get_peft_model_state_dict(ref))
        assert len(peft) == 10 * ref.config.num_layers  # attn1/attn2 q, k, v, out and the FFN's two, per block
        for model in (fast, exact):
            W.set_lora(model, peft, LORA_ALPHA / LORA_RANK, merge=model.lora_merge)
    inp = probe_inputs(transformer_config(size), 2, 7, resolution, BF16, 1, "cpu", spatial, per_token)
    if per_token:
        assert inp["timestep"].shape == (2, inp["hidden_states"].shape[1]) and len(inp["timestep"].unique()) == 2
    expected = diffusers_forward(ref, inp)
    assert_bitwise(forward(exact, inp), expected, f"{layout}: group wan")
    assert_differs(forward(fast, inp), expected, f"{layout}: group none")
    if lora:  # the fast engine's merged LoRA alone already breaks parity
        W.set_lora(exact, peft, LORA_ALPHA / LORA_RANK, merge=True)
        assert_differs(forward(exact, inp), expected, "merged LoRA")


def test_the_pipelines_token_layout_is_a_permutation():
    """pack/unpack are inverse permutations, and a token is its patch's values in the Conv3d weight's order: the fast
    patch embedding (a GEMM with the flattened conv weight) computes the conv's sums."""
    video = torch.randn(2, 16, 3, 8, 12)
    tokens = pack_latents(video)
    assert tokens.shape == (2, 3 * 4 * 6, 16 * 4) and torch.equal(unpack_latents(tokens, (3, 4, 6)), video)
    assert unpack_latents(tokens, (3, 4, 6)).is_contiguous()
    w, b = torch.randn(24, 16, 1, 2, 2, dtype=torch.float64), torch.randn(24, dtype=torch.float64)
    conv = F.conv3d(video.double(), w, b, stride=(1, 2, 2)).flatten(2).transpose(1, 2)
    torch.testing.assert_close(T.patch_embed_fused(tokens.double(), w, b, (3, 4, 6), (1, 2, 2)), conv)


# -- each patch's op against the diffusers code it mirrors -----------------------------------------------------------
ROPE_CASES = [(16, (3, 4, 4)), (128, (21, 30, 52))]  # the tiny heads; the real 128-wide heads at 480x832, 81 frames


@pytest.mark.parametrize("head_dim,grid", ROPE_CASES, ids=["tiny", "full_81f_480x832"])
def test_rope_tables(head_dim, grid):
    config = T.WanConfig(attention_head_dim=head_dim)
    rope = WanRotaryPosEmbed(head_dim, (1, 2, 2), config.rope_max_seq_len)
    f, h, w = grid
    cos, sin = rope(torch.empty(1, 1, f, 2 * h, 2 * w))  # [1, S, 1, D]; the rotation reads [..., 0::2]
    ref = P.rope_tables_reference(config, grid, "cpu")
    assert_bitwise(ref.cos, cos[0, :, 0, 0::2], "cos")
    assert_bitwise(ref.sin, sin[0, :, 0, 0::2], "sin")
    assert_bitwise(cos[0, :, 0, 1::2], cos[0, :, 0, 0::2], "each frequency serves one pair")
    fast = T.rope_tables_fused(config, grid, "cpu")
    assert_differs(torch.cat([fast.cos, fast.sin]), torch.cat([ref.cos, ref.sin]), "fp32 tables on the device")


def _captured_qk(attn: WanAttention, x: torch.Tensor, rotary, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The q and k diffusers' WanAttnProcessor hands its attention backend (normed, rotated)."""
    seen = []

    def record(query, key, value, **kw):
        seen.append((query, key))
        return dispatch_attention_fn(query, key, value, **kw)

    monkeypatch.setattr(transformer_wan, "dispatch_attention_fn", record)
    with torch.no_grad():
        attn(x, None, None, rotary)
    return seen[0]


def test_qk_norm_rope(monkeypatch):
    heads, head_dim, grid = 4, 32, (3, 4, 6)
    dim, S = heads * head_dim, 3 * 4 * 6
    attn = WanAttention(dim, heads, head_dim, eps=EPS, processor=transformer_wan.WanAttnProcessor()).to(BF16)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, p in sorted(attn.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 1 else 0.2) + (1 if p.dim() == 1 else 0))
    x = randn((2, S, dim), 8, std=2.0)
    rotary = WanRotaryPosEmbed(head_dim, (1, 2, 2), 1024)(torch.empty(1, 1, grid[0], 2 * grid[1], 2 * grid[2]))
    q_ref, k_ref = _captured_qk(attn, x, rotary, monkeypatch)
    tables = RopeTables(cos=rotary[0][0, :, 0, 0::2], sin=rotary[1][0, :, 0, 0::2])
    with torch.no_grad():
        q, k = attn.to_q(x), attn.to_k(x)
    assert_bitwise(P.qk_norm_rope_reference(q, attn.norm_q.weight, EPS, heads, tables), q_ref, "q")
    assert_bitwise(P.qk_norm_rope_reference(k, attn.norm_k.weight, EPS, heads, tables), k_ref, "k")
    assert_differs(qk_norm_across_heads_rope_fused(q, attn.norm_q.weight, EPS, heads, tables), q_ref, "fused")
    # the text attention: the norm alone
    cross = WanAttention(dim, heads, head_dim, eps=EPS, cross_attention_dim_head=head_dim,
                         processor=transformer_wan.WanAttnProcessor()).to(BF16)
    text = randn((2, 9, dim), 9)
    seen = []
    monkeypatch.setattr(transformer_wan, "dispatch_attention_fn",
                        lambda q_, k_, v_, **kw: seen.append((q_, k_)) or dispatch_attention_fn(q_, k_, v_, **kw))
    with torch.no_grad():
        cross(x, text, None, None)
        qc, kc = cross.to_q(x), cross.to_k(text)
    assert_bitwise(P.qk_norm_rope_reference(qc, cross.norm_q.weight, EPS, heads, None), seen[0][0], "text q")
    assert_bitwise(P.qk_norm_rope_reference(kc, cross.norm_k.weight, EPS, heads, None), seen[0][1], "text k")


def test_conv_patch_embed():
    grid, C, D = (3, 8, 8), 16, 512
    conv = torch.nn.Conv3d(C, D, kernel_size=(1, 2, 2), stride=(1, 2, 2)).to(BF16)  # diffusers' patch_embedding
    video = randn((2, C, grid[0], 2 * grid[1], 2 * grid[2]), 10)
    with torch.no_grad():
        expected = conv(video).flatten(2).transpose(1, 2).contiguous()  # WanTransformer3DModel.forward's lines
    tokens = pack_latents(video)
    assert_bitwise(P.patch_embed_reference(tokens, conv.weight, conv.bias, grid, (1, 2, 2)), expected, "reference")
    assert_differs(T.patch_embed_fused(tokens, conv.weight, conv.bias, grid, (1, 2, 2)), expected, "one GEMM")


def _condition_embedders(dim: int, text_dim: int = 32, seed: int = 11):
    """diffusers' WanTimeTextImageEmbedding as from_pretrained(bf16) holds it (the time embedder fp32) and the
    engine's ConditionEmbedder with its weights."""
    ref = WanTimeTextImageEmbedding(dim, 256, 6 * dim, text_dim)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(ref.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    ref.to(BF16).time_embedder.float()
    mine = T.ConditionEmbedder(dim, text_dim).to(BF16)
    mine.time_embedder.float()
    with torch.no_grad():
        mine.time_embedder.linear_1.weight.copy_(ref.time_embedder.linear_1.weight)
        mine.time_embedder.linear_1.bias.copy_(ref.time_embedder.linear_1.bias)
        mine.time_embedder.linear_2.weight.copy_(ref.time_embedder.linear_2.weight)
        mine.time_embedder.linear_2.bias.copy_(ref.time_embedder.linear_2.bias)
        mine.time_proj.weight.copy_(ref.time_proj.weight)
        mine.time_proj.bias.copy_(ref.time_proj.bias)
    return ref, mine


def test_time_rows():
    """One row per sample (per token) as diffusers' condition embedder computes them; the fast path's one row per
    distinct timestep equals them on a narrow model and not at a real width (a GEMM of another M rounds otherwise)."""
    ref, mine = _condition_embedders(32)
    text = randn((2, 5, 32), 12)
    t = torch.tensor([637.5, 637.5])
    per_token = torch.tensor([0.0] * 4 + [637.5] * 8).expand(2, -1).contiguous()  # I2V: the first frame at 0
    with torch.no_grad():
        for timestep in (t, per_token):
            seq = timestep.shape[1] if timestep.dim() == 2 else None
            temb, proj, _, _ = ref(timestep.flatten(), text, None, timestep_seq_len=seq)
            ours = P.time_rows_reference(mine, timestep, BF16)
            assert_bitwise(ours[0], temb, "temb")
            assert_bitwise(ours[1], proj, "timestep_proj")
            fused = T.time_rows_fused(mine, timestep, BF16)
            assert_bitwise(fused[1], proj, "narrow: the distinct rows alone give the same bits")
    with torch.device("meta"):  # TI2V-5B's width (3072; six rows of 18432), filled in place: cheap to build
        wide = T.ConditionEmbedder(3072, 32).to(BF16)
    wide = wide.to_empty(device="cpu")
    wide.time_embedder.float()
    g = torch.Generator().manual_seed(13)
    with torch.no_grad():
        for _, p in sorted(wide.named_parameters()):
            p.normal_(0, p.shape[-1] ** -0.5, generator=g)
        expected = P.time_rows_reference(wide, t, BF16)[1]
        assert_differs(T.time_rows_fused(wide, t, BF16)[1], expected, "wide: one row instead of two")


def test_eager_modulation():
    """The block's fp32 modulation lines: the references are diffusers' expressions; on this CPU the fast ops are the
    same PyTorch ops (bitwise too: the patch changes nothing here, and the Triton kernels it keeps off run on CUDA)."""
    x, y = randn((2, 40, 64), 20, std=3.0), randn((2, 40, 64), 21, std=2.0)
    table, proj = randn((1, 6, 64), 22, dtype=torch.float32), randn((2, 6 * 64), 23)
    shift, scale, gate, _, _, _ = (table + proj.float().unflatten(1, (6, -1))).chunk(6, dim=1)  # diffusers' [B, 1, D]
    norm = FP32LayerNorm(64, EPS, elementwise_affine=False)
    expected_norm = (norm(x.float()) * (1 + scale) + shift).type_as(x)
    expected_residual = (x.float() + y * gate).type_as(x)
    rows = T.modulation_rows(table, proj)
    assert all(r.shape == (2, 64) for r in rows)  # [B, D]: the Triton kernels' shape
    assert_bitwise(P.layer_norm_scale_shift_reference(x, rows[0], rows[1], EPS), expected_norm, "norm reference")
    assert_bitwise(P.gated_residual_reference(y, rows[2], x), expected_residual, "residual reference")
    assert_bitwise(M.layer_norm_scale_shift_fused(x, rows[0], rows[1], EPS), expected_norm, "norm, fast on CPU")
    assert_bitwise(M.gated_residual_fused(y, rows[2], x), expected_residual, "residual, fast on CPU")


def test_unpacked_qkv_and_the_attention_pairings():
    attn = WanAttention(64, 4, 16, eps=EPS, processor=transformer_wan.WanAttnProcessor()).to(BF16)
    mine = T.SelfAttention(64, 4, EPS).to(BF16)
    with torch.no_grad():
        mine.to_qkv.weight.copy_(torch.cat([attn.to_q.weight, attn.to_k.weight, attn.to_v.weight]))
        mine.to_qkv.bias.copy_(torch.cat([attn.to_q.bias, attn.to_k.bias, attn.to_v.bias]))
    x = randn((2, 33, 64), 30)
    with torch.no_grad():
        separate = (attn.to_q(x), attn.to_k(x), attn.to_v(x))
        packed = mine.to_qkv(x)
        mine.to_qkv.unpacked = True
        for o, r, name in zip(mine.to_qkv(x), separate, "qkv"):
            assert_bitwise(o, r, f"unpacked {name}")
        for o, r, name in zip(packed, separate, "qkv"):
            assert_bitwise(o, r, f"packed {name} (equal on this CPU)")
    q, k, v = randn((2, 33, 4, 16), 31), randn((2, 40, 4, 16), 32), randn((2, 40, 4, 16), 33)
    for backend, kernel in P.TRAIN_ATTENTION_KERNELS.items():
        if kernel == "cudnn":
            continue  # CUDA only
        with attention_backend(backend):
            expected = dispatch_attention_fn(q, k, v)
        assert_bitwise(attention(q, k, v, None, kernel), expected, f"{backend} pairing")
    with attention_backend("_native_math"):
        math_out = dispatch_attention_fn(q, k, v)
    assert_differs(attention(q, k, v, None, "flash"), math_out, "flash vs the math pairing")


# -- weights and config ------------------------------------------------------------------------------------------------
def test_name_map_round_trips_and_loads_all_or_nothing():
    ref = diffusers_model("tiny")
    model = T.build_model(dict(ref.config), "cpu", BF16)
    assert set(W.weight_map.expected_tensors(model, W.NAMES)) == set(ref.state_dict())
    for name, mod in model.named_modules():
        if isinstance(mod, W.weight_map.Linear):
            for slot in (range(len(mod.splits)) if mod.packed else (None,)):
                assert W.map_module_name(W.diffusers_module_name(name, slot)) == (name, slot)
    W.load_weights(model, ref.state_dict())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sd = {k: torch.zeros_like(v) for k, v in ref.state_dict().items()}
    del sd["blocks.1.attn2.to_k.bias"]
    sd["proj_out.weight"] = torch.zeros(3, 3)
    with pytest.raises(W.WeightLoadError) as err:
        W.load_weights(model, sd)
    assert "blocks.1.attn2.to_k.bias" in str(err.value)
    assert "proj_out.weight (3, 3) != expected (64, 64)" in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "a refused load changed weights"
    # what diffusers keeps in fp32 is what the presets keep and the engine holds in fp32
    assert {n for n, p in ref.named_parameters() if p.dtype == torch.float32} == {
        n for n, _ in ref.named_parameters() if kept_in_fp32(n)}
    assert set(ref._keep_in_fp32_modules) >= set(T.KEEP_IN_FP32)


def test_config_refuses_unimplemented_variants():
    base = transformer_config("tiny")
    with pytest.raises(ValueError, match="image_dim=1280"):
        T.WanConfig.from_dict({**base, "image_dim": 1280, "added_kv_proj_dim": 64})  # Wan2.1 I2V's CLIP stream
    with pytest.raises(ValueError, match="qk_norm='rms_norm'"):
        T.WanConfig.from_dict({**base, "qk_norm": "rms_norm"})
    with pytest.raises(ValueError, match=r"patch_size=\[1, 4, 4\]"):
        T.WanConfig.from_dict({**base, "patch_size": [1, 4, 4]})
    model = T.build_model(base, "cpu", BF16)
    inp = probe_inputs(base, 1, 3, 32, BF16, 0, "cpu")
    with pytest.raises(ValueError, match="does not hold"):
        forward(model, {**inp, "grid": (1, 2, 3)})
    with pytest.raises(ValueError, match=r"timestep \(1, 5\) must be \[B\] or one per token"):
        forward(model, {**inp, "timestep": torch.zeros(1, 5)})
