"""Wan2.2 text-to-video (`WanPipeline`, `WanTransformer3DModel`) as a `ModelFamily`, in both of its layouts:

- the two-expert A14B (`Wan-AI/Wan2.2-T2V-A14B-Diffusers`): `transformer` for the high-noise steps and
  `transformer_2` below `boundary_ratio · 1000` (`spec.boundary_experts`), each with its own CFG scale
  (`guidance_scale` / `guidance_scale_2`), Wan2.1's VAE (8x spatial, z 16);
- the dense TI2V-5B (`Wan-AI/Wan2.2-TI2V-5B-Diffusers`): one transformer, `expand_timesteps` (one timestep per token),
  Wan2.2's VAE (16x spatial, z 48).
`FAMILY` is the A14B layout's spec (Wan2.1's T2V checkpoints have it too, with one expert); `layout` gives the spec of
a folder's layout from its model_index.json and VAE config (`family_for_checkpoint` applies it).

CFG as `WanPipeline.__call__` runs it: the positive branch, then the negative (two forwards), combined as
`uncond + g·(cond − uncond)` (`cfg.plain_cfg`) in the model dtype, `g` the step's expert's scale. Heavy pieces
(transformers' UMT5, diffusers' VAE, schedule and reference model, the checkpoint writer) are imported when called
(`spec.lazy`), so reading this spec loads none of them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from ...layers.feed_forward import FeedForward
from ...layers.linear import Linear
from ..cfg import plain_cfg
from ..spec import (EngineSide, Guidance, ModelFamily, PatchGroupSpec, PipelineSide, Presets, TrainSide,
                    boundary_experts, lazy)
from ..tp_plan import TPPlan
from . import patches, weights
from .latents import (FRAMES_PER_LATENT, LATENT_DTYPE, PATCH, final_latents, latent_grid, noise_shape, pack_latents,
                      size_reason)
from .pipeline import probe_inputs
from .prompts import MAX_TEXT_TOKENS, TEXT_STREAMS, encode_prompts, load_text
from .scheduler_config import WAN_A14B_SCHEDULER_CONFIG, WAN_TI2V_SCHEDULER_CONFIG
from .train import LORA_TARGETS, SHARD_UNITS, train_forward, train_timestep
from .transformer import CrossAttention, SelfAttention, TransformerBlock, build_model

A14B_SPATIAL, TI2V_SPATIAL = 8, 16  # the VAEs' scale_factor_spatial: Wan2.1's (A14B), Wan2.2's (TI2V-5B)


def _pipeline(spatial: int, per_token: bool) -> PipelineSide:
    """The pipeline pieces of the layout with a VAE of spatial factor `spatial` and, with `per_token`, a timestep
    per token (`expand_timesteps`): that layout (TI2V-5B) also takes image-to-video's first frame, as
    `WanImageToVideoPipeline` conditions the same checkpoint on it."""
    schedule = lazy(f"{__package__}.schedule", "wan_schedule")
    return PipelineSide(
        folders=("tokenizer", "text_encoder", "vae", "scheduler"),
        pixels_per_token=spatial * PATCH[1],
        size_reason=size_reason(spatial),
        max_text_tokens=MAX_TEXT_TOKENS,
        load_text=load_text,
        encode_prompts=encode_prompts,
        text_streams=TEXT_STREAMS,
        latent_grid=functools.partial(latent_grid, spatial=spatial),
        noise_shape=noise_shape,
        pack_latents=pack_latents,
        schedule=functools.partial(schedule, per_token=True) if per_token else schedule,
        load_decoder=lazy(f"{__package__}.vae", "VideoDecoder"),
        latent_dtype=LATENT_DTYPE,
        scheduler_config=WAN_TI2V_SCHEDULER_CONFIG if spatial == TI2V_SPATIAL else WAN_A14B_SCHEDULER_CONFIG,
        image_cond=lazy(f"{__package__}.vae", "image_cond") if per_token else None,
        final_latents=final_latents if per_token else None,
    )


@functools.cache
def _layout_family(spatial: int, per_token: bool) -> ModelFamily:
    return replace(FAMILY, pipeline=_pipeline(spatial, per_token),
                   probe_inputs=functools.partial(probe_inputs, spatial=spatial, per_token=per_token))


def layout(model_index: Mapping[str, Any], component_config: Callable[[str], Mapping[str, Any] | None]) -> ModelFamily:
    """The spec of a Wan pipeline folder's layout: the VAE's spatial factor (8: Wan2.1's VAE, the A14B's; 16: Wan2.2's,
    the TI2V-5B's) and model_index.json's `expand_timesteps` (a timestep per token). A folder without a VAE config is
    read as the A14B's."""
    vae = component_config("vae") or {}
    spatial, temporal = vae.get("scale_factor_spatial", A14B_SPATIAL), vae.get("scale_factor_temporal", 4)
    if spatial not in (A14B_SPATIAL, TI2V_SPATIAL) or temporal != FRAMES_PER_LATENT:
        raise ValueError(f"vae/config.json: a Wan VAE compresses 8x or 16x spatially and {FRAMES_PER_LATENT}x in time, "
                         f"this one {spatial}x and {temporal}x")
    per_token = bool(model_index.get("expand_timesteps", False))
    return FAMILY if (spatial, per_token) == (A14B_SPATIAL, False) else _layout_family(spatial, per_token)


FAMILY = ModelFamily(
    name="wan",
    pipeline_class="WanPipeline",
    default=False,
    blocks=("blocks",),
    engine=EngineSide(
        build_model=build_model,
        load_weights=weights.load_weights,
        parse_peft_state_dict=weights.parse_peft_state_dict,
        set_lora=weights.set_lora,
        map_module_name=weights.map_module_name,
        diffusers_module_name=weights.diffusers_module_name,
        # The patch embedding returns tokens where diffusers' Conv3d returns a video, and the norms return the model
        # dtype where diffusers' FP32LayerNorm returns fp32: both are compared through their consumers.
        comparable_modules=(Linear, SelfAttention, CrossAttention, FeedForward, TransformerBlock),
        attention_backend=lambda m: m.blocks[0].attn1.backend if len(m.blocks) else "-",
        # Megatron's split, per block: both attentions' q/k/v by heads (the text attention's k/v from the text), the
        # FFN's first layer by columns; their consumers (the output projections, the FFN's second layer) by rows, one
        # rank-ordered sum each. The q/k RMSNorm across all heads (with the RoPE after it) runs whole on the gathered
        # heads, as the train side computes it. Modulation, the cross-attention norm, the embedders and the output
        # projection are replicated.
        tp_plan=TPPlan(
            column=(r"blocks\.\d+\.attn[12]\.(to_q|to_k|to_v)", r"blocks\.\d+\.ffn\.net\.0\.proj"),
            row=(r"blocks\.\d+\.attn[12]\.to_out\.0", r"blocks\.\d+\.ffn\.net\.2"),
            heads="num_attention_heads",
            gathered=(r"blocks\.\d+\.attn[12]\.(norm_q|norm_k)",)),
    ),
    patch_groups={"wan": PatchGroupSpec(patches.GROUP, patches.make_group, patches.TRAIN_ATTENTION_KERNELS)},
    pipeline=_pipeline(A14B_SPATIAL, per_token=False),
    probe_inputs=probe_inputs,
    train=TrainSide(
        transformer_class="WanTransformer3DModel",
        lora_targets=LORA_TARGETS,
        shard_units=SHARD_UNITS,
        parity_backend=patches.DEFAULT_TRAIN_ATTENTION_BACKEND,
        masked_backend="native",  # never used: the pipeline passes no text mask
        timestep=train_timestep,
        forward=train_forward,
    ),
    presets=Presets(
        transformer_config=lazy(f"{__package__}.presets", "transformer_config"),
        build_transformer=lazy(f"{__package__}.presets", "build_transformer"),
        write_checkpoint=lazy(f"{__package__}.checkpoint", "write_checkpoint"),
    ),
    # The negative prompt of a request naming none: WanPipeline.encode_prompt's `negative_prompt or ""`
    guidance=Guidance("separate", plain_cfg, per_expert_scale=True, negative_prompt=""),
    experts=boundary_experts,
    layout=layout,
)
