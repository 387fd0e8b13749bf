"""What one rollout request asks of the denoise loop: steps, sampler, guidance, image size and frames,
microgroups. A `SamplingParams` checks what holds for every family when made; the engine checks the rest against its
family (`check_family_limits`) before it rolls out."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:  # a leaf: the wire format and the HTTP client read it without loading a family
    from ..models.spec import ModelFamily

SAMPLERS = ("ode", "sde", "cps")
# The float inputs' ranges (TrainConfig takes the same): far beyond any real use (flow-GRPO's noise levels are
# 0.7-1.2 and its CFG 4.0; video runs at 8-120 fps), and narrow enough that what follows from them stays finite
# and meaningful: the SDE step's a·sqrt(σ/(1-σ)), CFG's s·(pos - neg) in bf16, and LTX-2.3's RoPE positions in
# seconds (frame / fps), which 1e-30 fps blows up and 1e308 fps collapses to 0.
NOISE_LEVEL_MAX = 100.0
CFG_SCALE_MAX = 100.0
FPS_MIN, FPS_MAX = 1.0, 1000.0


@dataclass
class SamplingParams:
    steps: int = 10
    sampler: str = "sde"  # "ode" | "sde" | "cps"
    noise_level: float = 0.7  # a, of the SDE and CPS steps
    cfg_scale: float = 4.0  # true CFG when > 1 (as the pipeline: 1 runs the positive branch alone)
    cfg_scale_2: float | None = None  # a second expert's CFG scale (WanPipeline's guidance_scale_2); None: cfg_scale
    distilled_guidance_scale: float | None = None  # a guidance-distilled model's input (FLUX); None: its default
    negative_prompt: str | None = None  # the CFG branch's; None: the family's (`Guidance.negative_prompt`)
    num_sde_steps: int | None = None  # stochastic steps per trajectory; None: every step (sde/cps)
    sde_window: tuple[int, int] | None = None  # half-open step range the window lies in; None: all steps
    height: int = 64
    width: int = 64
    num_frames: int = 1  # 1: images; video families take more (each its own rule)
    fps: float = 24.0  # a video's frame rate, which a video family conditions on (LTX-2.3's RoPE); images ignore it
    max_sequence_length: int = 512
    rollout_microgroup_size: int | None = None  # None: a prompt's n samples in one microgroup
    # Image-to-video: the path of the first frame (an image file on the engine's machine), which a family that takes
    # one conditions every sample on (Wan2.2 TI2V-5B); None: text-to-video
    image: str | None = None

    def __post_init__(self) -> None:
        if self.sde_window is not None:
            self.sde_window = cast("tuple[int, int]", tuple(self.sde_window))  # e.g. a list read back from JSON
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        for name in ("noise_level", "cfg_scale", "fps", "cfg_scale_2", "distilled_guidance_scale"):
            value = getattr(self, name)  # NaN slips through every comparison below
            if value is not None and not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"unknown sampler {self.sampler!r}; choose one of {', '.join(SAMPLERS)}")
        if self.sampler != "ode" and not self.noise_level > 0:
            raise ValueError(f"the {self.sampler} sampler needs noise_level > 0, got {self.noise_level}; "
                             f"use sampler='ode' for deterministic sampling")
        if not 0 <= self.noise_level <= NOISE_LEVEL_MAX:
            raise ValueError(f"noise_level must be in 0..{NOISE_LEVEL_MAX:g} (flow-GRPO uses 0.7-1.2), "
                             f"got {self.noise_level}")
        if self.cfg_scale < 1:
            raise ValueError(f"cfg_scale must be >= 1 (1 turns guidance off), got {self.cfg_scale}")
        if self.cfg_scale > CFG_SCALE_MAX:
            raise ValueError(f"cfg_scale must be at most {CFG_SCALE_MAX:g} (flow-GRPO uses 4.0), got {self.cfg_scale}")
        if self.cfg_scale_2 is not None and not 1 <= self.cfg_scale_2 <= CFG_SCALE_MAX:
            raise ValueError(f"cfg_scale_2 must be in 1..{CFG_SCALE_MAX:g} (None: cfg_scale), got {self.cfg_scale_2}")
        if self.distilled_guidance_scale is not None and not 0 <= self.distilled_guidance_scale <= CFG_SCALE_MAX:
            raise ValueError(f"distilled_guidance_scale must be in 0..{CFG_SCALE_MAX:g} (FLUX.1-dev's default is "
                             f"3.5), got {self.distilled_guidance_scale}")
        if self.sampler == "ode" and (self.num_sde_steps is not None or self.sde_window is not None):
            raise ValueError("num_sde_steps/sde_window need a stochastic sampler: set sampler='sde' or 'cps', "
                             "or leave them unset for ODE sampling")
        if self.num_sde_steps is not None and not 1 <= self.num_sde_steps <= self.steps:
            raise ValueError(f"num_sde_steps must be in 1..steps={self.steps} (None: every step), "
                             f"got {self.num_sde_steps}")
        if self.sde_window is not None:
            if self.num_sde_steps is None:
                raise ValueError("sde_window needs num_sde_steps (how many steps of the window are stochastic)")
            lo, hi = self.sde_window
            if not (0 <= lo < hi <= self.steps and hi - lo >= self.num_sde_steps):
                raise ValueError(f"sde_window {self.sde_window} must satisfy 0 <= lo < hi <= steps={self.steps} "
                                 f"and hold num_sde_steps={self.num_sde_steps} steps")
        if not FPS_MIN <= self.fps <= FPS_MAX:
            raise ValueError(f"fps must be in {FPS_MIN:g}..{FPS_MAX:g} frames a second, got {self.fps}")
        if self.num_frames < 1:
            raise ValueError(f"num_frames must be >= 1 (1: an image), got {self.num_frames}")
        if self.image is not None and (not isinstance(self.image, str) or not self.image.strip()):
            raise ValueError(f"image (--image) is the path of the first frame's image file, got {self.image!r}")
        if self.rollout_microgroup_size is not None and self.rollout_microgroup_size < 1:
            raise ValueError(f"rollout_microgroup_size must be >= 1 (None: all samples of a prompt), "
                             f"got {self.rollout_microgroup_size}")

    @property
    def cfg(self) -> bool:
        return self.cfg_scale > 1


def check_family_limits(params: SamplingParams, family: ModelFamily, experts: int | None = None) -> None:
    """The image sizes, frame count, text length and guidance `family`'s pipeline takes (ValueError naming the
    rule); `experts`: the checkpoint's expert count, where known (a per-expert scale needs two)."""
    from .guidance import check_guidance, check_negative_prompt

    check_guidance(family.name, family.guidance, params.cfg_scale, params.cfg_scale_2,
                   params.distilled_guidance_scale, experts)
    check_negative_prompt(family.name, family.guidance, params.cfg_scale, params.negative_prompt)
    granule = family.pipeline.pixels_per_token
    for name in ("height", "width"):
        v = getattr(params, name)
        if v < granule or v % granule:
            raise ValueError(f"{name} must be a positive multiple of {granule} pixels "
                             f"({family.pipeline.size_reason}), got {v}")
    family.pipeline.latent_grid(params.height, params.width, params.num_frames)  # refuses a frame count it can't make
    if params.image is not None and family.pipeline.image_cond is None:
        raise ValueError(f"{family.name} takes no first-frame image here (image-to-video is a family's, or a "
                         f"checkpoint layout's, e.g. Wan2.2 TI2V-5B): drop image (--image)")
    cap = family.pipeline.max_text_tokens
    if not 1 <= params.max_sequence_length <= cap:
        raise ValueError(f"max_sequence_length must be in 1..{cap}, got {params.max_sequence_length}")
