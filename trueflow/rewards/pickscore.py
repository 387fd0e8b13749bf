"""`pickscore`: PickScore (Kirstain et al., 2023), a CLIP-H fine-tuned on human preferences, from a local folder.

Scored as its authors do: `logit_scale.exp() * cosine(text_embedding, image_embedding)` (around 20 for real
images). `pickscore_flowgrpo` divides by 26 as flow-GRPO does. The model path is `MODEL_DIR` or
`MODEL_DIR:PROCESSOR_DIR` (os.pathsep-separated): the authors pair PickScore_v1 with the processor of
CLIP-ViT-H-14-laion2B-s32B-b79K; without PROCESSOR_DIR the processor is read from MODEL_DIR.
"""

from __future__ import annotations

import os

import torch
from PIL import Image


class PickScore:
    def __init__(self, model_path: str | None, device: str = "cpu", normalize: bool = False):
        from transformers import AutoProcessor, CLIPModel

        if not model_path:
            raise ValueError("the pickscore reward needs a model path: MODEL_DIR or MODEL_DIR:PROCESSOR_DIR "
                             "(PickScore_v1 and the CLIP-ViT-H-14 processor)")
        model_dir, _, processor_dir = model_path.partition(os.pathsep)
        for path in filter(None, (model_dir, processor_dir)):
            if not os.path.isdir(path):
                raise FileNotFoundError(f"pickscore: no folder {path}")
        # The PIL image processor is the one PickScore was trained and evaluated with (transformers 4's default).
        self.processor = AutoProcessor.from_pretrained(processor_dir or model_dir, backend="pil")
        self.model = CLIPModel.from_pretrained(model_dir).eval().to(device)
        self.device = device
        self.scale = 1 / 26 if normalize else 1.0
        self.name = "pickscore_flowgrpo" if normalize else "pickscore"

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        inputs = self.processor(text=list(prompts), images=[Image.fromarray(x) for x in images.numpy()],
                                padding=True, truncation=True, max_length=77, return_tensors="pt").to(self.device)
        # logits_per_text = logit_scale.exp() * normalised text @ normalised image.T; the diagonal pairs each
        # prompt with its own image.
        scores = self.model(**inputs).logits_per_text.diagonal()
        return (scores * self.scale).float().cpu()
