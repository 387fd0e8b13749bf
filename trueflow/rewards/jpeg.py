"""`jpeg_compressibility` / `jpeg_incompressibility`: minus / plus the image's JPEG size in kB (1 kB = 1000 bytes)
at quality 95, as DDPO defines them (flow-GRPO's `jpeg_compressibility` further divides by 500: use weight 0.002).
"""

from __future__ import annotations

import io

import torch
from PIL import Image


class JpegSize:
    def __init__(self, compressible: bool):
        self.sign = -1.0 if compressible else 1.0
        self.name = "jpeg_compressibility" if compressible else "jpeg_incompressibility"

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        sizes = []
        for image in images.numpy():
            buffer = io.BytesIO()
            Image.fromarray(image).save(buffer, format="JPEG", quality=95)
            sizes.append(buffer.tell() / 1000)
        return self.sign * torch.tensor(sizes, dtype=torch.float32)
