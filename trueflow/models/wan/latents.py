"""Wan2.2's latent layout, as `WanPipeline.prepare_latents` makes it, and the token packing of the engine.

The VAE compresses 4 frames (plus the causal first frame) and `spatial` x `spatial` pixels into one latent:
Wan2.1's VAE (the A14B's) 8 x 8 with 16 channels, Wan2.2's (the TI2V-5B's) 16 x 16 with 48 channels. The
transformer's Conv3d patch is (1, 2, 2), so a token is one latent frame's 2 x 2 latents: `pixels_per_token` is
`spatial` x 2 (16 for the A14B, 32 for the TI2V-5B). The noise is drawn fp32 as `[B, C, frames, H, W]` (in latents);
`pack_latents` lays each patch's values out as one token `[B, F'·H'·W', C·1·2·2]`, in the order the conv weight
reads them (`patch_embedding.weight.flatten(1)`), so the engine's patch embedding is one GEMM on the tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..spec import Grid

PATCH = (1, 2, 2)  # every published Wan2.x transformer's patch_size (transformer.WanConfig requires it)
FRAMES_PER_LATENT = 4  # both VAEs' scale_factor_temporal: frame counts are 4k + 1
FRAME_REASON = f"the VAE's causal temporal factor {FRAMES_PER_LATENT}: {FRAMES_PER_LATENT}k + 1 frames"
LATENT_DTYPE = torch.float32  # WanPipeline draws and steps the latents in fp32, casting them for each model call


def size_reason(spatial: int) -> str:
    return f"VAE spatial factor {spatial} x patch {PATCH[1]}"


def check_size(height: int, width: int, num_frames: int, spatial: int) -> None:
    """One clear error for a size WanPipeline would round down with a warning (or not make)."""
    granule = spatial * PATCH[1]
    if height < granule or width < granule or height % granule or width % granule:
        raise ValueError(f"height and width must be positive multiples of {granule} ({size_reason(spatial)}), got "
                         f"{height}x{width}")
    if num_frames < 1 or num_frames % FRAMES_PER_LATENT != 1:
        raise ValueError(f"num_frames must be 1, 5, 9, ... ({FRAME_REASON}), got {num_frames}")


def latent_grid(height: int, width: int, num_frames: int, spatial: int = 8) -> tuple[int, int, int]:
    """The token grid (frames, rows, cols) of a video of `num_frames` frames of `height x width` pixels, for a VAE
    of spatial factor `spatial`."""
    check_size(height, width, num_frames, spatial)
    granule = spatial * PATCH[1]
    return (num_frames - 1) // FRAMES_PER_LATENT + 1, height // granule, width // granule


def noise_shape(config: Mapping[str, Any] | Any, grid: Grid) -> tuple[int, ...]:  # (frames, rows, cols)
    """One sample's initial noise `(C, frames, H, W)` in latents (`prepare_latents` draws the batch
    `[B, C, F, H, W]`): `in_channels` of the transformer (the VAE's z_dim), the grid times the patch."""
    channels = config["in_channels"] if isinstance(config, Mapping) else config.in_channels
    return (channels, *(n * p for n, p in zip(grid, PATCH)))


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """`[B, C, F, H, W]` -> tokens `[B, F'·H'·W', C·pt·ph·pw]`: each (1, 2, 2) patch one token, its values in the conv
    weight's order (C, pt, ph, pw). A permutation: no value changes."""
    B, C, Fr, H, W = latents.shape
    pt, ph, pw = PATCH
    x = latents.reshape(B, C, Fr // pt, pt, H // ph, ph, W // pw, pw)
    return x.permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4).flatten(1, 3)


def unpack_latents(tokens: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
    """Tokens `[B, S, C·pt·ph·pw]` -> the contiguous latent video `[B, C, F, H, W]` (the inverse of `pack_latents`;
    contiguous, as the pipeline hands the transformer its latents)."""
    B = tokens.shape[0]
    pt, ph, pw = PATCH
    f, h, w = grid
    x = tokens.reshape(B, f, h, w, -1, pt, ph, pw)
    return x.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(B, -1, f * pt, h * ph, w * pw).contiguous()



def first_frame_mask(tokens: int, first: int, device=None) -> torch.Tensor:
    """`WanImageToVideoPipeline`'s `first_frame_mask` (with `expand_timesteps`) per token, fp32 `[tokens]`: 0 on the
    first latent frame's `first` tokens (rows x cols), 1 on the others (tokens are frame-major)."""
    mask = torch.ones(tokens, dtype=torch.float32, device=device)
    mask[:first] = 0
    return mask


def blend_first_frame(tokens: torch.Tensor, image_latents: torch.Tensor) -> torch.Tensor:
    """`(1 - first_frame_mask) * condition + first_frame_mask * latents` on packed tokens `[B, S, C·4]`, in fp32 as
    the pipeline computes it, cast back to the tokens' dtype: the image's latents (`image_latents` `[B, rows·cols,
    C·4]`, the first frame's tokens, broadcast over the frames as the pipeline's one-frame condition is) in the first
    frame. Every product is by 0 or 1 and every sum has a zero term, so it is exact in any dtype: the same values
    whether the latents were cast before (the model's input) or after (the pipeline's)."""
    B, S, C = tokens.shape
    first = image_latents.shape[1]
    mask = first_frame_mask(S, first, tokens.device)[:, None]
    condition = image_latents.float()[:, None].expand(B, S // first, first, C).reshape(B, S, C)
    return ((1 - mask) * condition + mask * tokens.float()).to(tokens.dtype)


def first_frame_inputs(tokens: torch.Tensor, timestep: torch.Tensor, image_latents: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The model inputs of an image-to-video step, as `WanImageToVideoPipeline.__call__` makes them with
    `expand_timesteps`: the first frame replaced by the image's latents, and the timestep per token
    `first_frame_mask · t` (0 on the first frame: it is clean), from `timestep` `[B]` or per token `[B, S]`."""
    B, S, _ = tokens.shape
    t = timestep[:, None].expand(B, S) if timestep.dim() == 1 else timestep
    return blend_first_frame(tokens, image_latents), first_frame_mask(S, image_latents.shape[1], t.device) * t


def final_latents(latents: torch.Tensor, cond: dict) -> torch.Tensor:
    """What `WanImageToVideoPipeline` decodes: after the loop, `(1 - mask) * condition + mask * latents` once more
    (the first frame's latents stepped along with the others, and are replaced); text-to-video: the latents."""
    image = cond.get("image_latents")
    return latents if image is None else blend_first_frame(latents, image.to(latents.device))
