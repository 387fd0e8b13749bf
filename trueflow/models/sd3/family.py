"""Stable Diffusion 3 / 3.5 (`StableDiffusion3Pipeline`, `SD3Transformer2DModel`; SD3.5-Medium's MMDiT-X) as a
`ModelFamily`.

Classifier-free guidance is ONE batched forward, as the pipeline runs it; the pooled CLIP projection is a conditioning
entry beside the joint text tokens; the text is fixed-length (CLIP's 77 tokens + T5's `max_sequence_length`, no
mask), so nothing is padded. Heavy pieces (transformers' text encoders, diffusers' VAE, schedule and reference model,
the checkpoint writer) are imported when called (`spec.lazy`, `prompts.load_text`), so reading this spec loads none
of them.
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
from .scheduler_config import SD3_SCHEDULER_CONFIG
from .train import LORA_TARGETS, SHARD_UNITS, train_forward, train_timestep
from .transformer import (AdaNormContinuous, JointAttention, JointBlock, PatchEmbed, SelfAttention, TimeTextEmbed,
                          build_model)

FAMILY = ModelFamily(
    name="sd3",
    pipeline_class="StableDiffusion3Pipeline",
    default=False,
    blocks=("transformer_blocks",),
    engine=EngineSide(
        build_model=build_model,
        load_weights=weights.load_weights,
        parse_peft_state_dict=weights.parse_peft_state_dict,
        set_lora=weights.set_lora,
        map_module_name=weights.map_module_name,
        diffusers_module_name=weights.diffusers_module_name,
        # The fused norm + modulation modules have no single diffusers counterpart (diffusers' AdaLayerNormZero also
        # returns the gates), so they are compared through their consumers.
        comparable_modules=(Linear, PatchEmbed, TimeTextEmbed, JointAttention, SelfAttention, FeedForward, JointBlock,
                            AdaNormContinuous),
        attention_backend=lambda m: m.transformer_blocks[0].attn.backend if len(m.transformer_blocks) else "-",
        # Megatron's MMDiT split: both attentions' q/k/v (of both streams) by heads, the MLPs' first layers by
        # columns; their consumers (the output projections, the MLPs' second layers) by rows, one rank-ordered sum
        # each. The per-head q/k RMSNorm needs no gather (each rank's heads are whole). The patch embedding, the
        # modulation GEMMs, the embedders, the norms and the final projection are replicated.
        tp_plan=TPPlan(
            column=(r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj)",
                    r"transformer_blocks\.\d+\.attn2\.(to_q|to_k|to_v)",
                    r"transformer_blocks\.\d+\.(ff|ff_context)\.net\.0\.proj"),
            row=(r"transformer_blocks\.\d+\.attn\.(to_out\.0|to_add_out)", r"transformer_blocks\.\d+\.attn2\.to_out\.0",
                 r"transformer_blocks\.\d+\.(ff|ff_context)\.net\.2"),
            heads="num_attention_heads"),
    ),
    patch_groups={"sd3": PatchGroupSpec(patches.GROUP, patches.make_group, patches.TRAIN_ATTENTION_KERNELS)},
    pipeline=PipelineSide(
        folders=("tokenizer", "tokenizer_2", "tokenizer_3", "text_encoder", "text_encoder_2", "text_encoder_3", "vae",
                 "scheduler"),
        pixels_per_token=PIXELS_PER_TOKEN,
        size_reason=SIZE_REASON,
        max_text_tokens=MAX_TEXT_TOKENS,
        load_text=load_text,
        encode_prompts=encode_prompts,
        text_streams={},  # CLIP's 77 + T5's max_sequence_length tokens, every prompt alike, no mask: stacked
        latent_grid=latent_grid,
        noise_shape=noise_shape,
        pack_latents=pack_latents,
        schedule=lazy(f"{__package__}.schedule", "sd3_schedule"),
        load_decoder=lazy(f"{__package__}.vae", "VaeDecoder"),
        scheduler_config=SD3_SCHEDULER_CONFIG,
    ),
    probe_inputs=probe_inputs,
    train=TrainSide(
        transformer_class="SD3Transformer2DModel",
        lora_targets=LORA_TARGETS,
        shard_units=SHARD_UNITS,
        parity_backend=patches.DEFAULT_TRAIN_ATTENTION_BACKEND,
        masked_backend=patches.DEFAULT_TRAIN_ATTENTION_BACKEND,
        timestep=train_timestep,
        forward=train_forward,
    ),
    presets=Presets(
        transformer_config=lazy(f"{__package__}.presets", "transformer_config"),
        build_transformer=lazy(f"{__package__}.presets", "build_transformer"),
        write_checkpoint=lazy(f"{__package__}.checkpoint", "write_checkpoint"),
    ),
    # StableDiffusion3Pipeline.__call__: `torch.cat([latents] * 2)` with `torch.cat([negative, positive])` prompt
    # embeddings and pooled projections, `t.expand(2B)`, then `uncond + guidance_scale · (text − uncond)` on
    # `noise_pred.chunk(2)`: one batched forward, plain CFG. Its default negative prompt is "" (encode_prompt:
    # `negative_prompt = negative_prompt or ""`; flow_grpo's train_sd3.py encodes [""] too).
    guidance=Guidance("batched", plain_cfg, negative_prompt=""),
)
