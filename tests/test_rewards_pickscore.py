"""PickScore on a tiny random CLIP saved with save_pretrained (model + processor), loaded offline."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image

from trueflow.cli import main
from trueflow.rewards import build_reward, score
from trueflow.rewards.tiny_clip import init_tiny_clip


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory: pytest.TempPathFactory):
    return init_tiny_clip(tmp_path_factory.mktemp("clip") / "tiny_clip", seed=0)


def pil_images(n: int, size: int = 48) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (size, size + 8, 3), dtype=np.uint8)) for _ in range(n)]


def direct_pickscore(path, images: list[Image.Image], prompts: list[str]) -> torch.Tensor:
    """logit_scale.exp() * cosine(text, image), computed as PickScore's authors do, straight from transformers."""
    from transformers import AutoProcessor, CLIPModel

    processor = AutoProcessor.from_pretrained(path, backend="pil")
    model = CLIPModel.from_pretrained(path).eval()
    with torch.no_grad():
        image_inputs = processor(images=images, return_tensors="pt")
        text_inputs = processor(text=prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
        image_embs = model.get_image_features(**image_inputs)
        text_embs = model.get_text_features(**text_inputs)
        image_embs, text_embs = (e if isinstance(e, torch.Tensor) else e.pooler_output  # transformers 4 vs 5
                                 for e in (image_embs, text_embs))
        image_embs = image_embs / image_embs.norm(p=2, dim=-1, keepdim=True)
        text_embs = text_embs / text_embs.norm(p=2, dim=-1, keepdim=True)
        return (model.logit_scale.exp() * (text_embs @ image_embs.T)).diag()


def test_pickscore_equals_the_authors_formula(tiny_clip) -> None:
    images = pil_images(3)
    prompts = ["a cat", "a photo of a red dog on a sofa", "x"]
    reward = build_reward("pickscore", model_path=str(tiny_clip))
    assert reward.name == "pickscore"
    scores, dropped = score(reward, torch.from_numpy(np.stack([np.array(i) for i in images])), prompts)
    expected = direct_pickscore(tiny_clip, images, prompts)
    assert dropped == [] and scores.dtype == torch.float32 and torch.isfinite(scores).all()
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)
    # batched == one by one (text padding to the batch's longest prompt does not change a score)
    single = torch.cat([reward(torch.from_numpy(np.array(i))[None], [p]) for i, p in zip(images, prompts)])
    torch.testing.assert_close(scores, single, rtol=1e-5, atol=1e-5)
    norm = build_reward("pickscore_flowgrpo", model_path=str(tiny_clip))
    torch.testing.assert_close(norm(torch.from_numpy(np.stack([np.array(i) for i in images])), prompts),
                               scores / 26)


def test_pickscore_separate_processor_folder_and_errors(tiny_clip, tmp_path) -> None:
    with pytest.raises(ValueError, match="needs a model path"):
        build_reward("pickscore")
    with pytest.raises(FileNotFoundError, match="no folder"):
        build_reward("pickscore", model_path=str(tmp_path / "missing"))
    # MODEL_DIR:PROCESSOR_DIR, as PickScore_v1 is used with CLIP-ViT-H-14's processor
    reward = build_reward("pickscore", model_path=f"{tiny_clip}{os.pathsep}{tiny_clip}")
    assert torch.isfinite(reward(torch.zeros(1, 8, 8, 3, dtype=torch.uint8), ["a cat"])).all()


def test_cli_pickscore_acceptance(tiny_clip, tmp_path, capsys: pytest.CaptureFixture) -> None:
    image = pil_images(1, size=40)[0]
    image.save(tmp_path / "x.png")
    argv = ["reward", "--name", "pickscore", "--model", str(tiny_clip), "--image", str(tmp_path / "x.png"),
            "--prompt", "a cat"]
    assert main(argv) == 0
    printed = float(capsys.readouterr().out)
    assert np.isfinite(printed)
    assert printed == pytest.approx(direct_pickscore(tiny_clip, [image], ["a cat"]).item(), rel=1e-5, abs=1e-5)
