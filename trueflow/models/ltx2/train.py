"""The train side's call of diffusers' `LTX2VideoTransformer3DModel`, as `LTX2Pipeline.__call__` makes it (its main,
unguided pass), except for the audio stream. No diffusers import: the model arrives built.

The pipeline's call (diffusers 0.42.1): `timestep=t` and `sigma=t` (the schedule timestep, sigma x 1000, fp32, one per
sample, whatever the model dtype); the connectors' all-ones mask as `encoder_attention_mask` and
`audio_encoder_attention_mask`; RoPE coordinates from (latent frames, rows, cols) at `fps` = frame_rate /
motion_speed (24 by default); `use_cross_timestep=True`; no STG blocks, no perturbation mask; the latents cast from
fp32 to the text embeddings' dtype; `isolate_modalities=False` with a real audio stream.

What differs here: `isolate_modalities=True` and a one-token audio stream (zero audio tokens crash the transformer).
With the audio->video and video->audio attentions skipped, the video output does not depend on the audio stream at
all (tests/test_ltx2_pipeline.py checks it bit for bit for any audio content), so the audio stream can be a
placeholder. It also means the video prediction is NOT the pipeline's main pass: that one mixes audio into video in
every block. The prediction is the one the pipeline computes for modality-isolation guidance (its "uncond_modality"
pass), off the model's joint audio-video distribution; training adapts the video stream under that call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

DEFAULT_FPS = 24.0  # LTX2Pipeline's frame_rate default (motion_speed 1)

# LoRA on the video stream only: each block's video self-attention (attn1), video-text cross-attention (attn2) and
# video feed-forward (ff). PEFT matches a list entry as a suffix after a dot, so "attn1.to_q" does not hit
# "audio_attn1.to_q" and "ff.net.2" not "audio_ff.net.2"; the bare "to_q" / "net.0.proj" would also hit the audio
# stream and both cross-modal attentions (audio_to_video_attn, video_to_audio_attn).
LORA_TARGETS: tuple[str, ...] = tuple(
    f"{attn}.{proj}" for attn in ("attn1", "attn2") for proj in ("to_q", "to_k", "to_v", "to_out.0")
) + ("ff.net.0.proj", "ff.net.2")

# The same set as one full-name regex (PEFT's `target_modules` as a string is `re.fullmatch`ed on module names).
LORA_TARGET_REGEX = r"transformer_blocks\.\d+\.(?:attn[12]\.(?:to_q|to_k|to_v|to_out\.0)|ff\.net\.(?:0\.proj|2))"

SHARD_UNITS: tuple[str, ...] = ("transformer_blocks",)  # each block one FSDP unit, the rest one more


def lora_target_names(model: nn.Module) -> list[str]:
    """The module names LORA_TARGETS selects in `model`, by PEFT's suffix rule."""
    return [name for name, _ in model.named_modules() if any(name == t or name.endswith("." + t) for t in LORA_TARGETS)]


def train_timestep(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the pipeline passes as `timestep` (and `sigma`) for schedule timestep t: t itself, fp32, whatever the
    model `dtype` (the timestep embedding casts after its fp32 sinusoids)."""
    return t.to(torch.float32)



def train_forward(model: nn.Module, hidden_states: torch.Tensor, timestep: torch.Tensor, grid: tuple[int, int, int],
                  cond: dict[str, torch.Tensor | None], fps: float = DEFAULT_FPS) -> torch.Tensor:
    """The video prediction `[B, S, C]` for packed latents `hidden_states` (in the model dtype), `timestep` =
    `train_timestep(t)` (`[B]`), `grid` = (latent frames, rows, cols), and `cond` from `encode_prompts` (collated)."""
    batch = hidden_states.shape[0]
    config: Any = model.config  # diffusers' FrozenDict (attribute access; nn.Module types it as a tensor/module)
    text = cond["encoder_hidden_states"]
    assert text is not None  # the pipeline always passes the video text stream
    audio_text = cond.get("audio_encoder_hidden_states")
    if audio_text is None:  # the isolated video output never reads it; one token keeps the audio stream well formed
        audio_text = text.new_zeros(batch, 1, config.audio_cross_attention_dim)

    def ones_if_none(mask: torch.Tensor | None, stream: torch.Tensor) -> torch.Tensor:
        # The connectors' mask is all ones and the pipeline passes it: the transformer makes it a -0.0 bias and the
        # cross attentions run their masked kernel, so a missing (all-true) mask must be passed back, not dropped.
        return torch.ones(stream.shape[:2], dtype=torch.int64, device=stream.device) if mask is None else mask

    audio = hidden_states.new_zeros(batch, 1, config.audio_in_channels)
    frames, rows, cols = grid
    return model(
        hidden_states=hidden_states,
        audio_hidden_states=audio,
        encoder_hidden_states=text,
        audio_encoder_hidden_states=audio_text,
        timestep=timestep,
        sigma=timestep,
        encoder_attention_mask=ones_if_none(cond.get("encoder_attention_mask"), text),
        audio_encoder_attention_mask=ones_if_none(cond.get("audio_encoder_attention_mask"), audio_text),
        num_frames=frames,
        height=rows,
        width=cols,
        fps=fps,
        audio_num_frames=1,
        isolate_modalities=True,
        spatio_temporal_guidance_blocks=None,
        perturbation_mask=None,
        use_cross_timestep=True,
        return_dict=False,
    )[0]
