"""`clip_score`: CLIPScore (Hessel et al., 2021) as torchmetrics computes it, from a local CLIP folder.

    score = max(100 * cos(E_image, E_text), 0)

with E the projected CLIP embeddings (`CLIPModel.get_image_features` / `get_text_features`), in [0, 100].
torchmetrics' default model is openai/clip-vit-large-patch14; any transformers CLIP folder works. The model path
is `MODEL_DIR` or `MODEL_DIR:PROCESSOR_DIR` (os.pathsep-separated). Prompts are cut to 77 tokens keeping the end
token (torchmetrics cuts the ids, end token included, and warns).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from PIL import Image


def features(out: Any) -> torch.Tensor:
    """The projected embedding from `get_image_features`/`get_text_features`: a tensor in transformers 4, an
    output whose `pooler_output` it is in transformers 5."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def split_model_path(name: str, model_path: str | None, what: str) -> tuple[str, str]:
    """`MODEL_DIR[:SECOND]` -> (MODEL_DIR, SECOND or ''), each checked to exist; a clear error without a path."""
    if not model_path:
        raise ValueError(f"the {name} reward needs a model path: {what}")
    first, _, second = model_path.partition(os.pathsep)
    for path in filter(None, (first, second)):
        if not os.path.exists(path):
            raise FileNotFoundError(f"{name}: no such file or folder {path}")
    return first, second


def load_clip(name: str, model_path: str | None, device: str) -> tuple[Any, Any]:
    """A transformers CLIPModel (fp32, eval) and its PIL processor from `MODEL_DIR[:PROCESSOR_DIR]`."""
    from transformers import AutoProcessor, CLIPModel

    model_dir, processor_dir = split_model_path(name, model_path, "MODEL_DIR or MODEL_DIR:PROCESSOR_DIR (a "
                                                "transformers CLIP folder, e.g. openai/clip-vit-large-patch14)")
    processor = AutoProcessor.from_pretrained(processor_dir or model_dir, backend="pil")
    return CLIPModel.from_pretrained(model_dir).eval().to(device), processor


def normalize(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(p=2, dim=-1, keepdim=True)


def pil_images(images: torch.Tensor) -> list[Image.Image]:
    return [Image.fromarray(x) for x in images.numpy()]


class ClipScore:
    name = "clip_score"

    def __init__(self, model_path: str | None, device: str = "cpu"):
        self.model, self.processor = load_clip(self.name, model_path, device)
        self.device = device

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        inputs = self.processor(text=list(prompts), images=pil_images(images), padding=True, truncation=True,
                                max_length=77, return_tensors="pt").to(self.device)
        image = features(self.model.get_image_features(pixel_values=inputs["pixel_values"]))
        text = features(self.model.get_text_features(input_ids=inputs["input_ids"],
                                                     attention_mask=inputs["attention_mask"]))
        cos = (normalize(image) * normalize(text)).sum(dim=-1)
        return (100 * cos).clamp(min=0).float().cpu()
