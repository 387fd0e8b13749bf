"""Qwen-Image (`QwenImagePipeline`, `QwenImageTransformer2DModel`) as a `ModelFamily`.

Heavy pieces (transformers' text encoder, diffusers' VAE, schedule and reference model, the checkpoint writer) are
imported when called (`spec.lazy`, `_load_text`), so reading this spec loads none of them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...collate import Cond
from ...layers.linear import Linear
from ...layers.norms import RMSNorm
from ..cfg import rescaled_cfg
from ..spec import EngineSide, Grid, Guidance, ModelFamily, PatchGroupSpec, PipelineSide, Presets, TrainSide, lazy
from ..tp_plan import TPPlan
from . import patches, weights
from .latents import PATCH, PIXELS_PER_TOKEN, VAE_SCALE_FACTOR, latent_grid, pack_latents
from .prompts import TOKENIZER_MAX_LENGTH, encode_prompts
from .scheduler_config import QWEN_IMAGE_SCHEDULER_CONFIG
from .train import model_timestep, train_forward
from .transformer import (FeedForward, JointAttention, OutputNorm, QwenImageConfig, TimestepEmbedding,
                          TransformerBlock, build_model)


def _load_text(root: Path, device: torch.device, dtype: torch.dtype):
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

    tokenizer = Qwen2Tokenizer.from_pretrained(root / "tokenizer")
    text_encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(root / "text_encoder", dtype=dtype)
    return tokenizer, text_encoder.to(device).eval()  # type: ignore[arg-type]  # transformers' `@wraps` .to, typed unbound by typeshed


def _encode_prompts(tokenizer, text_encoder, prompts: list[str], max_sequence_length: int) -> list[Cond]:
    # Each prompt's valid tokens; the collate pads a batch's batch-locally with the pipeline's zeros and bool mask.
    return [{"encoder_hidden_states": e} for e in encode_prompts(tokenizer, text_encoder, prompts, max_sequence_length)]


def _noise_shape(config: QwenImageConfig, grid: Grid) -> tuple[int, ...]:  # (rows, cols)
    # The pipeline's prepare_latents: [B, 1, C/4, 2·rows, 2·cols], packed 2x2 into tokens of C channels.
    return 1, config.in_channels // 4, PATCH * grid[0], PATCH * grid[1]


def _probe_inputs(config: dict, batch: int, text_len: int, resolution: int, dtype, seed: int, device) -> dict:
    """Seeded probe inputs: packed latents, text embeddings, and one schedule timestep (fp32, 0..1000) shared by
    the batch, as a denoising step has. The engine takes it as is; the train side as the pipeline passes it."""
    g = torch.Generator().manual_seed(seed)
    side = resolution // PIXELS_PER_TOKEN
    hs = torch.randn(batch, side * side, config["in_channels"], generator=g)
    ehs = torch.randn(batch, text_len, config["joint_attention_dim"], generator=g)
    t = (torch.rand(1, generator=g) * 1000).expand(batch).contiguous()
    return {"hidden_states": hs.to(device, dtype), "timestep": t.to(device), "grid": (side, side),
            "cond": {"encoder_hidden_states": ehs.to(device, dtype), "encoder_hidden_states_mask": None}}


FAMILY = ModelFamily(
    name="qwen_image",
    pipeline_class="QwenImagePipeline",
    default=True,
    blocks=("transformer_blocks",),
    engine=EngineSide(
        build_model=build_model,
        load_weights=weights.load_weights,
        parse_peft_state_dict=weights.parse_peft_state_dict,
        set_lora=weights.set_lora,
        map_module_name=weights.map_module_name,
        diffusers_module_name=weights.diffusers_module_name,
        # The engine's fused norm+modulation modules have no single diffusers counterpart, so they are compared
        # through their consumers.
        comparable_modules=(Linear, RMSNorm, TimestepEmbedding, JointAttention, FeedForward, TransformerBlock,
                            OutputNorm),
        attention_backend=lambda m: m.transformer_blocks[0].attn.backend if len(m.transformer_blocks) else "-",
        # Megatron's MMDiT split: q/k/v of both streams by heads and the FFNs' first layers by columns; their
        # consumers (the output projections, the FFNs' second layers) by rows, one rank-ordered sum each. The
        # modulation, norms, embedders and the final projection are replicated.
        tp_plan=TPPlan(
            column=(r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj)",
                    r"transformer_blocks\.\d+\.(img|txt)_mlp\.net\.0\.proj"),
            row=(r"transformer_blocks\.\d+\.attn\.(to_out\.0|to_add_out)",
                 r"transformer_blocks\.\d+\.(img|txt)_mlp\.net\.2"),
            heads="num_attention_heads"),
    ),
    patch_groups={"qwen_image": PatchGroupSpec(patches.GROUP, patches.make_group, patches.TRAIN_ATTENTION_KERNELS)},
    pipeline=PipelineSide(
        folders=("tokenizer", "text_encoder", "vae", "scheduler"),
        pixels_per_token=PIXELS_PER_TOKEN,
        size_reason=f"VAE factor {VAE_SCALE_FACTOR} x patch {PATCH}",
        max_text_tokens=TOKENIZER_MAX_LENGTH,
        load_text=_load_text,
        encode_prompts=_encode_prompts,
        text_streams={"encoder_hidden_states": "encoder_hidden_states_mask"},
        latent_grid=latent_grid,
        noise_shape=_noise_shape,
        pack_latents=pack_latents,
        schedule=lazy(f"{__package__}.schedule", "qwen_image_schedule"),
        load_decoder=lazy(f"{__package__}.vae", "VaeDecoder"),
        scheduler_config=QWEN_IMAGE_SCHEDULER_CONFIG,
    ),
    probe_inputs=_probe_inputs,
    train=TrainSide(
        transformer_class="QwenImageTransformer2DModel",
        lora_targets=("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                      "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"),
        shard_units=("transformer_blocks",),
        parity_backend=patches.DEFAULT_TRAIN_ATTENTION_BACKEND,
        masked_backend="native",
        timestep=model_timestep,
        forward=train_forward,
        fused_kernels=lazy(f"{__package__}.train_kernels", "install"),
    ),
    presets=Presets(
        transformer_config=lazy(f"{__package__}.presets", "transformer_config"),
        build_transformer=lazy(f"{__package__}.presets", "build_transformer"),
        write_checkpoint=lazy(f"{__package__}.checkpoint", "write_checkpoint"),
    ),
    # QwenImagePipeline.__call__: two transformer calls (positive, then negative) per step, norm-rescaled true CFG.
    guidance=Guidance("separate", rescaled_cfg),
)
