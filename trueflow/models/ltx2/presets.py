"""LTX-2.3 transformer presets: the sizes `init-checkpoint --size` takes, the train side's diffusers model built from
one with seeded random weights, and the family's default GRPO recipe (train side only: the engine never imports
this file).

The 2.3 flags (diffusers' `LTX2VideoTransformer3DModel` keys, as diffusers' LTX-2.3 conversion writes them): gated
attention (`gated_attn`, `audio_gated_attn`), cross-attention modulation (`cross_attn_mod`, `audio_cross_attn_mod`),
split RoPE in double precision (`rope_type="split"`, `rope_double_precision=True`), no caption projection in the
transformer (`use_prompt_embeddings=False`: the connectors' per-modality projections replace it, so
`caption_channels` builds no weight there), perturbed attention (STG) processors, caption channels 3840 (Gemma-3-12B).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from accelerate import init_empty_weights
# # from `diffusers.models`: `diffusers`' own TYPE_CHECKING imports name its dummy classes first.
from diffusers.models import LTX2VideoTransformer3DModel
from torch import nn

from ..random_init import M, init_weights_

# The real LTX-2.3 transformer (19B; 21B with the text connectors): 48 layers, 32 heads x 128 (4096-wide video),
# 32 heads x 64 (2048-wide audio).
_FULL: dict[str, Any] = {
    "in_channels": 128,
    "out_channels": 128,
    "patch_size": 1,
    "patch_size_t": 1,
    "num_attention_heads": 32,
    "attention_head_dim": 128,
    "cross_attention_dim": 4096,
    "vae_scale_factors": (8, 32, 32),
    "pos_embed_max_pos": 20,
    "base_height": 2048,
    "base_width": 2048,
    "gated_attn": True,
    "cross_attn_mod": True,
    "audio_in_channels": 128,
    "audio_out_channels": 128,
    "audio_patch_size": 1,
    "audio_patch_size_t": 1,
    "audio_num_attention_heads": 32,
    "audio_attention_head_dim": 64,
    "audio_cross_attention_dim": 2048,
    "audio_scale_factor": 4,
    "audio_pos_embed_max_pos": 20,
    "audio_sampling_rate": 16000,
    "audio_hop_length": 160,
    "audio_gated_attn": True,
    "audio_cross_attn_mod": True,
    "num_layers": 48,
    "activation_fn": "gelu-approximate",
    "qk_norm": "rms_norm_across_heads",
    "norm_elementwise_affine": False,
    "norm_eps": 1e-6,
    "caption_channels": 3840,
    "attention_bias": True,
    "attention_out_bias": True,
    "rope_theta": 10000.0,
    "rope_double_precision": True,
    "causal_offset": 1,
    "timestep_scale_multiplier": 1000,
    "cross_attn_timestep_scale_multiplier": 1000,
    "rope_type": "split",
    "use_prompt_embeddings": False,
    "perturbed_attn": True,
}

TRANSFORMER_CONFIGS: dict[str, dict[str, Any]] = {
    # Two layers at small widths with every 2.3 flag on. The split RoPE divides each stream's width over the video
    # heads and the cross-modal RoPE (audio_cross_attention_dim wide) over the video heads too, so the audio width
    # equals video heads x audio head dim, as in the real model (32 x 64 = 2048).
    "tiny": {
        **_FULL,
        "in_channels": 16,
        "out_channels": 16,
        "num_attention_heads": 2,
        "attention_head_dim": 16,
        "cross_attention_dim": 32,
        "audio_in_channels": 4,  # the tiny audio VAE's 2 latent channels x 2 latent mel bins
        "audio_out_channels": 4,
        "audio_num_attention_heads": 2,
        "audio_attention_head_dim": 8,
        "audio_cross_attention_dim": 16,
        "num_layers": 2,
    },
    "full": dict(_FULL),
    # The real video stream's GEMMs and attention (4096 wide, 32 heads x 128) at one block, for CPU numerics tests; the
    # audio stream, which the isolated video output never reads, at 32 heads x 8 (the audio width is the video heads
    # x the audio head dim, as in the real model).
    "one_block": {**_FULL, "num_layers": 1, "audio_attention_head_dim": 8, "audio_cross_attention_dim": 256},
}


def transformer_config(size: str) -> dict[str, Any]:
    """A copy of the preset `size` (one of TRANSFORMER_CONFIGS)."""
    if size not in TRANSFORMER_CONFIGS:
        raise ValueError(f"unknown transformer size {size!r}; known sizes: {', '.join(TRANSFORMER_CONFIGS)}")
    return dict(TRANSFORMER_CONFIGS[size])


_SMALL_RANDN = ("alpha", "beta", "mm_input_projection_weight", "keyframes_abs_pos_embedding")


def _special(name: str) -> bool:
    return name.endswith("scale_shift_table") or name == "learnable_registers" or name in _SMALL_RANDN


@torch.no_grad()
def seeded_init_(model: M, seed: int, device: str | torch.device = "cpu") -> M:
    """Seeded random weights for a model with LTX-2's parameter kinds, in place.

    Linear, Embedding, conv and norm parameters (the leaf modules) get `init_weights_`'s rules, each leaf from its
    own generator seeded by (seed, position), so the same seed gives the same weights whatever the dtype. The
    parameters LTX-2 keeps directly on a container module get their own rules: modulation tables (`*scale_shift_table`,
    randn / sqrt(width), as diffusers initialises the main ones), the connectors' learnable registers (uniform in
    [-1, 1), as diffusers), the vocoder's log-scale Snake alpha/beta and Gemma-3's image projection (small randn).
    """
    for index, (name, mod) in enumerate(model.named_modules()):
        own = dict(mod.named_parameters(recurse=False))
        if not own:
            continue
        mod_seed = seed * 1_000_003 + index
        if not any(_special(p) for p in own) and not any(True for _ in mod.children()):
            init_weights_(mod, mod_seed, device)
            continue
        gen = torch.Generator(device=device).manual_seed(mod_seed)
        for pname, p in own.items():
            shape = p.shape
            if not _special(pname):
                raise TypeError(f"no init rule for {name}.{pname} ({type(mod).__name__})")
            if pname.endswith("scale_shift_table"):
                value = torch.randn(shape, generator=gen, device=device) * shape[-1] ** -0.5
            elif pname == "learnable_registers":
                value = torch.rand(shape, generator=gen, device=device) * 2.0 - 1.0
            else:
                value = torch.randn(shape, generator=gen, device=device) * 0.02
            p.copy_(value)
    return model


def build_transformer(
    size_or_config: str | Mapping[str, Any], seed: int = 0, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> LTX2VideoTransformer3DModel:
    """diffusers' LTX2VideoTransformer3DModel with seeded random weights, built in memory in `dtype` on `device`
    (the weights drawn there too), eval mode."""
    config = transformer_config(size_or_config) if isinstance(size_or_config, str) else dict(size_or_config)
    config = {k: v for k, v in config.items() if not k.startswith("_")}  # a config.json's _class_name etc.
    return build_seeded(lambda: LTX2VideoTransformer3DModel(**config), seed, dtype, device)


def build_seeded(make: Callable[[], M], seed: int, dtype: torch.dtype, device: str | torch.device) -> M:
    """`make()` with seeded random weights in `dtype` on `device` (drawn there), eval mode. The parameters start on
    the meta device, so a large model is allocated once, directly in `dtype`, and never default-initialised. Only
    for modules without tied parameters or buffers (the LTX-2 transformer and connectors compute RoPE per call)."""
    with init_empty_weights():
        model = make()
    if any(True for _ in model.buffers()):
        raise ValueError(f"{type(model).__name__} has buffers; build it directly and use seeded_init_")
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            empty = torch.empty(p.shape, dtype=dtype, device=device)
            mod.register_parameter(name, nn.Parameter(empty, p.requires_grad))
    return seeded_init_(model, seed, device).eval()


# The public LTX-2.3 GRPO recipe (radixark/miles_diffusion, scripts/run_diffusion_grpo_ltx23_sglang.py, "FG - fully
# gated" in its docs/models/ltx/ltx2.md): unguided CPS-SDE, 24 steps, 57 frames at 24 fps, 512x768, noise level 0.8,
# 3 stochastic steps drawn per epoch from steps 0-9, clip range 1e-5, no KL, LoRA rank 64 / alpha 128 (gaussian
# init), lr 2e-4, 8 prompts x 8 samples per rollout, PickScore on 3 evenly spaced frames.
RECIPE: dict[str, Any] = {
    "steps": 24,
    "sampler": "cps",
    "noise_level": 0.8,
    "cfg_scale": 1.0,
    "num_sde_steps": 3,
    "sde_window": (0, 10),
    "height": 512,
    "width": 768,
    "num_frames": 57,
    "fps": 24.0,
    "max_sequence_length": 1024,  # LTX2Pipeline's default
    "clip_range": 1e-5,
    "kl_beta": 0.0,
    "lora_rank": 64,
    "lora_alpha": 128,
    "learning_rate": 2e-4,
    "num_prompts": 8,
    "samples_per_prompt": 8,
    "reward_frames": 3,
}
