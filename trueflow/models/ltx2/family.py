"""LTX-2.3 text-to-video (`LTX2Pipeline`, `LTX2VideoTransformer3DModel` in its 2.3 configuration) as a `ModelFamily`.

The train side calls diffusers' transformer as the pipeline's unguided pass does, except `isolate_modalities=True`
and a one-token audio stream (`train.py` says why and what that means); the engine computes the video stream alone
(`transformer.py`), bitwise with it under the `ltx` patch group (`patches.py`). Heavy pieces (Gemma-3 and the
connectors, the video VAE, diffusers' schedule and reference model, the checkpoint writer) are imported when called
(`spec.lazy`), so reading this spec loads none of them.
"""

from __future__ import annotations

from ...layers.linear import Linear
from ..spec import NO_GUIDANCE, EngineSide, ModelFamily, PatchGroupSpec, PipelineSide, Presets, TrainSide, lazy
from ..tp_plan import TPPlan
from . import patches, weights
from .latents import LATENT_DTYPE, PIXELS_PER_TOKEN, SIZE_REASON, latent_grid, noise_shape, pack_latents
from .pipeline import model_output, probe_inputs
from .prompts import MAX_TEXT_TOKENS, TEXT_STREAMS, encode_prompts, load_text
from .scheduler_config import LTX2_SCHEDULER_CONFIG
from .train import LORA_TARGETS, SHARD_UNITS, train_forward, train_timestep
from .transformer import CrossAttention, FeedForward, SelfAttention, build_model


FAMILY = ModelFamily(
    name="ltx2",
    pipeline_class="LTX2Pipeline",
    default=False,
    blocks=("transformer_blocks",),
    engine=EngineSide(
        build_model=build_model,
        load_weights=weights.load_weights,
        drops=weights.is_audio_only,
        parse_peft_state_dict=weights.parse_peft_state_dict,
        set_lora=weights.set_lora,
        map_module_name=weights.map_module_name,
        diffusers_module_name=weights.diffusers_module_name,
        # A block returns the video stream alone where diffusers' returns (video, audio), and the timestep
        # embedding returns viewed shapes: both are compared through their consumers.
        comparable_modules=(Linear, SelfAttention, CrossAttention, FeedForward),
        attention_backend=lambda m: m.transformer_blocks[0].attn1.backend if len(m.transformer_blocks) else "-",
        # Megatron's split, per block: both attentions' q/k/v and per-head gate logits by heads (the text attention's
        # k/v from the caption stream), the FFN's first layer by columns; their consumers (the output projections,
        # the FFN's second layer) by rows, one rank-ordered sum each. What reads every head at once runs whole on
        # the gathered heads, as the train side computes it: the q/k RMSNorm across heads (with the RoPE after it)
        # and the gate `out·2σ(logits)` (inline in diffusers' processor; the engine's `gate` module). Modulation,
        # the other norms, embedders and the output projection are replicated.
        tp_plan=TPPlan(
            column=(r"transformer_blocks\.\d+\.attn[12]\.(to_q|to_k|to_v|to_gate_logits)",
                    r"transformer_blocks\.\d+\.ff\.net\.0\.proj"),
            row=(r"transformer_blocks\.\d+\.attn[12]\.to_out\.0", r"transformer_blocks\.\d+\.ff\.net\.2"),
            heads="num_attention_heads",
            gathered=(r"transformer_blocks\.\d+\.attn[12]\.(norm_q|norm_k|gate)",)),
    ),
    patch_groups={"ltx": PatchGroupSpec(patches.GROUP, patches.make_group, patches.TRAIN_ATTENTION_KERNELS)},
    pipeline=PipelineSide(
        folders=("tokenizer", "text_encoder", "connectors", "vae", "audio_vae", "vocoder", "scheduler"),
        pixels_per_token=PIXELS_PER_TOKEN,
        size_reason=SIZE_REASON,
        max_text_tokens=MAX_TEXT_TOKENS,
        load_text=load_text,
        encode_prompts=encode_prompts,
        text_streams=TEXT_STREAMS,
        latent_grid=latent_grid,
        noise_shape=noise_shape,
        pack_latents=pack_latents,
        schedule=lazy(f"{__package__}.schedule", "ltx2_schedule"),
        load_decoder=lazy(f"{__package__}.vae", "VideoDecoder"),
        latent_dtype=LATENT_DTYPE,
        model_output=model_output,
        static_inputs=lambda params: {"fps": float(params.fps)},  # RoPE positions are in seconds
        scheduler_config=LTX2_SCHEDULER_CONFIG,
    ),
    probe_inputs=probe_inputs,
    train=TrainSide(
        transformer_class="LTX2VideoTransformer3DModel",
        lora_targets=LORA_TARGETS,
        shard_units=SHARD_UNITS,
        # The transformer turns the connectors' all-ones mask into an additive bias for every text attention, which
        # `_native_flash` refuses: the parity pairing is `native` (SDPA's own choice, the same call on both sides).
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
    # The engine runs the modality-isolated pass unguided (train.py); LTX2Pipeline's guidance (x0-space delta CFG on
    # a batched forward, STG, modality guidance, rescale) is another computation, so `cfg_scale > 1` is refused.
    guidance=NO_GUIDANCE,
)
