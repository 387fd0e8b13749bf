"""`redness`: the weight-free demo reward (the default of `trueflow train`).

mean(R) - (mean(G) + mean(B)) / 2 over the image, on pixels scaled to [0, 1]: in [-1, 1] (pure red 1, pure cyan
-1, any grey 0). A linear function of every pixel, so any change of the policy shows in it. Colour balance is
what the random tiny Qwen-Image decoder varies most between seeds: on 8 samples of one prompt (64x64, 10 steps)
redness spread by 0.016, twice as much as mean brightness on the same [-1, 1] scale.
"""

from __future__ import annotations

import torch


class Redness:
    name = "redness"

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        means = images.float().mean(dim=(1, 2)) / 255  # [N, 3]
        return means[:, 0] - (means[:, 1] + means[:, 2]) / 2
