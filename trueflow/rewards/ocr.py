"""`ocr`: does the image show the text the prompt quotes? flow-GRPO's OCR reward, with an offline OCR model.

For a prompt `a sign that says "Hello World"` and recognised text R (the texts of all detected lines with a
recognition score >= 0.5, joined in the OCR's reading order):
    t = the text after the prompt's first '"' up to the next one, r = R; both without spaces, lower-cased
    d = 0 if t is a substring of r, else min(levenshtein(r, t), len(t))
    reward = 1 - d / len(t)                                   (in [0, 1]; nothing recognised gives 0)
as flow-GRPO computes it, with PaddleOCR's recognition threshold 0.5. The OCR is RapidOCR (rapidocr-onnxruntime
1.4.4: PP-OCRv4 detection and recognition as ONNX models shipped inside the wheel, run by onnxruntime on the CPU;
like flow-GRPO, no text-direction classifier), set up with PaddleOCR's detection defaults. flow-GRPO's PaddleOCR
used its English recognition model; this one reads Chinese and English, so scores are close, not equal. A prompt
without quoted text raises, as in flow-GRPO; an OCR failure raises too (flow-GRPO scores it 0), so that `score`
reports the prompt instead of hiding it.
"""

from __future__ import annotations

import torch
from PIL import Image


def quoted_text(prompt: str) -> str:
    parts = prompt.split('"')
    if len(parts) < 2 or not parts[1].strip():
        raise ValueError('the ocr reward needs the target text in double quotes in the prompt, e.g. '
                         'a sign that says "hello"')
    return parts[1]


def levenshtein(a: str, b: str) -> int:
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def text_reward(recognised: str, prompt: str) -> float:
    target = quoted_text(prompt).replace(" ", "").lower()
    recognised = recognised.replace(" ", "").lower()
    dist = 0 if target in recognised else min(levenshtein(recognised, target), len(target))
    return 1 - dist / len(target)


class OcrReward:
    name = "ocr"

    def __init__(self) -> None:
        try:
            from rapidocr_onnxruntime import RapidOCR
        except ImportError as e:
            raise ImportError("the ocr reward needs rapidocr-onnxruntime: pip install 'trueflow[rewards]'") from e
        # Models: RapidOCR's config resolves them inside the installed package. Detection pre/post-processing as
        # PaddleOCR 2's defaults (flow-GRPO's OCR): longest side at most 960 px, never upscaled (RapidOCR's own
        # default upscales the shortest side to 736 px, ~10x slower on small images), box threshold 0.6, unclip 1.5.
        self.engine = RapidOCR(use_cls=False, text_score=0.5, det_limit_type="max", det_limit_side_len=960,
                               det_box_thresh=0.6, det_unclip_ratio=1.5)

    def read(self, image: Image.Image) -> str:
        lines, _ = self.engine(image, use_cls=False)  # None when no text is detected
        return "".join(text for _box, text, _conf in lines or ())

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        rewards = [text_reward(self.read(Image.fromarray(x)), p) for x, p in zip(images.numpy(), prompts, strict=True)]
        return torch.tensor(rewards, dtype=torch.float32)
