"""The per-step math `LTX2Pipeline` does around the transformer, unguided (guidance 1, STG 0, modality guidance 1,
rescale 0, for both streams): its velocity -> x0 -> velocity round trip in fp32, then its scheduler's Euler step."""

from __future__ import annotations

import torch


def _as_sigma(sigma: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    sigma = torch.as_tensor(sigma, dtype=torch.float32, device=like.device)
    return sigma.reshape(-1, *([1] * (like.dim() - 1))) if sigma.dim() == 1 else sigma


def model_output(output: torch.Tensor, latents: torch.Tensor, sigma: torch.Tensor | float) -> torch.Tensor:
    """The velocity the pipeline steps with, from the transformer's video output.

    The pipeline casts the output to fp32, converts it to x0 (`latents - v·sigma`) and, with every guidance term
    zero, straight back (`(latents - x0) / sigma`), all in fp32 with the schedule's fp32 `sigmas[i]`; the round trip
    is an identity in exact arithmetic but not in floating point. `latents` are the fp32 latents of the step;
    `sigma` the step's sigma (0-dim, or `[B]` with one per sample)."""
    sigma = _as_sigma(sigma, latents)
    velocity = output.float()
    x0 = latents - velocity * sigma
    return (latents - x0) / sigma


def euler_step(velocity: torch.Tensor, latents: torch.Tensor, sigma: torch.Tensor | float,
               sigma_next: torch.Tensor | float) -> torch.Tensor:
    """`FlowMatchEulerDiscreteScheduler.step` (no stochastic sampling): fp32 `latents + (sigma_next - sigma)·v`."""
    dt = _as_sigma(sigma_next, latents) - _as_sigma(sigma, latents)
    return (latents.float() + dt * velocity).to(velocity.dtype)


PROBE_FRAMES = 9  # pixel frames of a probe video: 2 latent frames, so the temporal RoPE axis has two positions


def probe_inputs(config: dict, batch: int, text_len: int, resolution: int, dtype: torch.dtype, seed: int,
                 device: torch.device | str) -> dict:
    """Seeded probe inputs for a transformer `config`: packed latents of a `resolution`-square, 9-frame video, both
    text streams (`text_len` tokens, every one valid, as after the connectors), and one schedule timestep (fp32,
    0..1000) shared by the batch, as a denoising step has. The engine takes the timestep as is; so does the train
    side (`train_timestep` keeps it fp32)."""
    g = torch.Generator().manual_seed(seed)
    side = resolution // 32
    grid = ((PROBE_FRAMES - 1) // 8 + 1, side, side)
    hs = torch.randn(batch, grid[0] * side * side, config["in_channels"], generator=g)
    text = torch.randn(batch, text_len, config["cross_attention_dim"], generator=g)
    audio_text = torch.randn(batch, text_len, config["audio_cross_attention_dim"], generator=g)
    t = (torch.rand(1, generator=g) * 1000).expand(batch).contiguous()
    return {"hidden_states": hs.to(device, dtype), "timestep": t.to(device), "grid": grid,
            "cond": {"encoder_hidden_states": text.to(device, dtype),
                     "audio_encoder_hidden_states": audio_text.to(device, dtype)}}
