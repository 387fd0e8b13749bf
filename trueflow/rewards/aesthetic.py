"""`aesthetic`: the LAION aesthetic predictor v2 ("improved aesthetic predictor", C. Schuhmann), from local files.

    score = MLP(E / ||E||)        (about 1..10; LAION-Aesthetics used >= 6.5 for its "aesthetic" subsets)

with E the CLIP ViT-L/14 image embedding (768) and MLP the published head, trained on SAC + LAION-Logos + AVA:
Linear(768,1024), Dropout(0.2), Linear(1024,128), Dropout(0.2), Linear(128,64), Dropout(0.1), Linear(64,16),
Linear(16,1), no activations (its `simple_inference.py`; eval mode, so the dropouts do nothing). As DDPO and
flow-GRPO do, the CLIP is transformers' openai/clip-vit-large-patch14 (the weights of OpenAI's ViT-L/14).

The model path is `CLIP_DIR` holding `sac+logos+ava1-l14-linearMSE.pth` (the head as released), or
`CLIP_DIR:HEAD_FILE` (os.pathsep-separated).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from .clip_score import features, load_clip, normalize, pil_images, split_model_path

HEAD_FILE = "sac+logos+ava1-l14-linearMSE.pth"


def aesthetic_head(input_size: int = 768) -> nn.Sequential:
    """The head's layers; its state dict keys are the released file's ('layers.0.weight', ...) without 'layers.'."""
    return nn.Sequential(nn.Linear(input_size, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
                         nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1))


class Aesthetic:
    name = "aesthetic"

    def __init__(self, model_path: str | None, device: str = "cpu"):
        what = f"CLIP_DIR (with {HEAD_FILE} in it) or CLIP_DIR:HEAD_FILE (CLIP ViT-L/14 and the LAION head)"
        clip_dir, head_file = split_model_path(self.name, model_path, what)
        head_file = head_file or os.path.join(clip_dir, HEAD_FILE)
        if not os.path.isfile(head_file):
            raise FileNotFoundError(f"aesthetic: no head file {head_file}; give {what}")
        self.model, self.processor = load_clip(self.name, clip_dir, device)
        state = torch.load(head_file, map_location="cpu", weights_only=True)
        self.head = aesthetic_head(self.model.config.projection_dim)
        self.head.load_state_dict({k.removeprefix("layers."): v for k, v in state.items()})
        self.head.eval().to(device)
        self.device = device

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        pixels = self.processor(images=pil_images(images), return_tensors="pt")["pixel_values"].to(self.device)
        embedding = normalize(features(self.model.get_image_features(pixel_values=pixels)))
        return self.head(embedding).squeeze(-1).float().cpu()
