"""FLUX.1-dev (`FluxPipeline`, `FluxTransformer2DModel`, guidance-distilled) as a `ModelFamily`.

Heavy pieces (transformers' text encoders, diffusers' VAE, schedule and reference model, the checkpoint writer) are
imported when called (`spec.lazy`), so reading this spec loads none of them.
"""

from __future__ import annotations

from ...layers.feed_forward import FeedForward
from ...layers.linear import Linear
from ..cfg import plain_cfg
from ..spec import EngineSide, Guidance, ModelFamily, PatchGroupSpec, PipelineSide, Presets, TrainSide, lazy
from ..tp_plan import TPPlan
from . import patches, weights
from .latents import PIXELS_PER_TOKEN, SIZE_REASON, latent_grid, noise_shape, pack_latents
from .pipeline import probe_inputs
from .prompts import MAX_TEXT_TOKENS, encode_prompts, load_text
from .scheduler_config import FLUX_SCHEDULER_CONFIG
from .train import LORA_TARGETS, SHARD_UNITS, model_timestep, train_forward
from .transformer import OutputNorm, TimeGuidanceTextEmbedding, TransformerBlock, build_model

FAMILY = ModelFamily(
    name="flux",
    pipeline_class="FluxPipeline",
    default=False,
    blocks=("transformer_blocks", "single_transformer_blocks"),
    engine=EngineSide(
        build_model=build_model,
        load_weights=weights.load_weights,
        parse_peft_state_dict=weights.parse_peft_state_dict,
        set_lora=weights.set_lora,
        map_module_name=weights.map_module_name,
        diffusers_module_name=weights.diffusers_module_name,
        # A single-stream block keeps the joint sequence whole where diffusers' returns (text, image), and the
        # engine's fused norm+modulation modules have no single diffusers counterpart: compared through their
        # consumers.
        comparable_modules=(Linear, TimeGuidanceTextEmbedding, FeedForward, TransformerBlock, OutputNorm),
        attention_backend=lambda m: m.transformer_blocks[0].attn.backend if len(m.transformer_blocks) else "-",
        # Megatron's split, as diffusers' own `_tp_plan` for FLUX.1: q/k/v of both streams and of the single-stream
        # blocks by heads, the FFNs' and the single-stream MLP's first layers by columns; the double-stream blocks'
        # consumers (output projections, the FFNs' second layers) by rows, one rank-ordered sum each. A
        # single-stream block's `proj_out` reads the attention output and the MLP activation concatenated (two
        # column-parallel streams: diffusers' PackedRowwiseParallel): it runs whole on every rank, on both inputs
        # all-gathered. Modulation, norms, embedders and the final projection are replicated.
        tp_plan=TPPlan(
            column=(r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj)",
                    r"transformer_blocks\.\d+\.(ff|ff_context)\.net\.0\.proj",
                    r"single_transformer_blocks\.\d+\.(attn\.to_q|attn\.to_k|attn\.to_v|proj_mlp)"),
            row=(r"transformer_blocks\.\d+\.attn\.(to_out\.0|to_add_out)",
                 r"transformer_blocks\.\d+\.(ff|ff_context)\.net\.2"),
            heads="num_attention_heads",
            gathered_inputs=(r"single_transformer_blocks\.\d+\.proj_out",)),
    ),
    patch_groups={"flux": PatchGroupSpec(patches.GROUP, patches.make_group, patches.TRAIN_ATTENTION_KERNELS)},
    pipeline=PipelineSide(
        folders=("tokenizer", "tokenizer_2", "text_encoder", "text_encoder_2", "vae", "scheduler"),
        pixels_per_token=PIXELS_PER_TOKEN,
        size_reason=SIZE_REASON,
        max_text_tokens=MAX_TEXT_TOKENS,
        load_text=load_text,
        encode_prompts=encode_prompts,
        text_streams={},  # T5 is padded to the whole window and fed without a mask: every prompt has one length
        latent_grid=latent_grid,
        noise_shape=noise_shape,
        pack_latents=pack_latents,
        schedule=lazy(f"{__package__}.schedule", "flux_schedule"),
        load_decoder=lazy(f"{__package__}.vae", "VaeDecoder"),
        scheduler_config=FLUX_SCHEDULER_CONFIG,
    ),
    probe_inputs=probe_inputs,
    train=TrainSide(
        transformer_class="FluxTransformer2DModel",
        lora_targets=LORA_TARGETS,
        shard_units=SHARD_UNITS,
        parity_backend=patches.DEFAULT_TRAIN_ATTENTION_BACKEND,
        masked_backend="native",
        timestep=model_timestep,
        forward=train_forward,
    ),
    presets=Presets(
        transformer_config=lazy(f"{__package__}.presets", "transformer_config"),
        build_transformer=lazy(f"{__package__}.presets", "build_transformer"),
        write_checkpoint=lazy(f"{__package__}.checkpoint", "write_checkpoint"),
    ),
    # FluxPipeline.__call__: the guidance-distilled scale is a model input (`guidance`, default 3.5) of every call;
    # true CFG runs only with `true_cfg_scale > 1` AND a negative prompt (its default is none), as a second, separate
    # call, combined as `neg + true_cfg_scale · (pos − neg)`.
    guidance=Guidance("separate", plain_cfg, distilled_input="guidance", distilled_default=3.5,
                      negative_prompt=None),
)
