"""CLIPScore and the LAION aesthetic predictor on a tiny random CLIP written as their real folders, loaded offline;
and a weighted sum of the two, built as a run builds its reward."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from trueflow.rewards import WeightedSum, build_reward, score
from trueflow.rewards.tiny_clip import init_tiny_aesthetic

PROMPTS = ["a cat", "a photo of a red dog on a sofa", "x"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    """One folder: a tiny CLIP, its processor, and the aesthetic head file beside them."""
    return init_tiny_aesthetic(tmp_path_factory.mktemp("clip") / "tiny_clip_l14", seed=1)


def batch(n: int = 3, size: int = 40) -> torch.Tensor:
    rng = np.random.default_rng(1)
    return torch.from_numpy(rng.integers(0, 256, (n, size, size + 8, 3), dtype=np.uint8))


def clip_model(path):
    from transformers import AutoProcessor, CLIPModel

    return CLIPModel.from_pretrained(path).eval(), AutoProcessor.from_pretrained(path, backend="pil")


def embeddings(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.pooler_output  # transformers 4 | 5


# -- CLIPScore -------------------------------------------------------------------------------------------------
def test_clip_score_equals_torchmetrics(tiny) -> None:
    clip_score = pytest.importorskip("torchmetrics.functional.multimodal").clip_score
    model, processor = clip_model(tiny)

    class Features(nn.Module):
        """torchmetrics 1.9 expects transformers 4's tensors from get_*_features; v5 returns an output object."""

        def __init__(self, model):
            super().__init__()
            self.model, self.config = model, model.config

        def get_image_features(self, *args, **kwargs):
            return embeddings(self.model.get_image_features(*args, **kwargs))

        def get_text_features(self, *args, **kwargs):
            return embeddings(self.model.get_text_features(*args, **kwargs))

    x = batch()
    # one pair at a time: torchmetrics' clip_score is max(mean over pairs, 0), one pair's is the pair's score
    expected = torch.stack([clip_score(torch.from_numpy(a).permute(2, 0, 1), p, lambda: (Features(model), processor))
                            for a, p in zip(x.numpy(), PROMPTS)]).detach()
    reward = build_reward("clip_score", model_path=str(tiny))
    scores, dropped = score(reward, x, PROMPTS)
    assert reward.name == "clip_score" and dropped == [] and scores.dtype == torch.float32
    assert (expected > 1).any()  # scores above the clip at 0 are compared
    torch.testing.assert_close(scores, expected.float(), rtol=1e-5, atol=1e-5)


def test_clip_score_formula_and_clip_at_zero(tiny) -> None:
    model, processor = clip_model(tiny)
    x = batch(6)
    prompts = [f"prompt {i}" for i in range(3)] + PROMPTS
    with torch.no_grad():
        inputs = processor(text=prompts, images=[Image.fromarray(a) for a in x.numpy()], padding=True,
                           return_tensors="pt")
        image = embeddings(model.get_image_features(pixel_values=inputs["pixel_values"])).double()
        text = embeddings(model.get_text_features(input_ids=inputs["input_ids"],
                                                  attention_mask=inputs["attention_mask"])).double()
    cos = (image * text).sum(-1) / (image.norm(dim=-1) * text.norm(dim=-1))
    assert (cos < 0).any() and (cos > 0).any()  # random weights: both signs, so the clip at 0 is exercised
    got = build_reward("clip_score", model_path=str(tiny))(x, prompts)
    torch.testing.assert_close(got.double(), (100 * cos).clamp(min=0), rtol=1e-5, atol=1e-4)


# -- aesthetic -------------------------------------------------------------------------------------------------
class PublishedMLP(nn.Module):
    """improved-aesthetic-predictor's simple_inference.py `MLP` (pytorch_lightning parts left out)."""

    def __init__(self, input_size: int):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(input_size, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def published_aesthetic(path, x: torch.Tensor) -> torch.Tensor:
    """simple_inference.py: normalized(encode_image(preprocess(image))) -> MLP, with transformers' CLIP (as DDPO
    and flow-GRPO load it) in place of the `clip` package, in float64."""
    model, processor = clip_model(path)
    mlp = PublishedMLP(model.config.projection_dim)
    mlp.load_state_dict(torch.load(path / "sac+logos+ava1-l14-linearMSE.pth"))
    mlp.eval().double()
    with torch.no_grad():
        pixels = processor(images=[Image.fromarray(a) for a in x.numpy()], return_tensors="pt")["pixel_values"]
        e = embeddings(model.get_image_features(pixel_values=pixels)).double().numpy()
        l2 = np.atleast_1d(np.linalg.norm(e, 2, -1))
        l2[l2 == 0] = 1
        return mlp(torch.from_numpy(e / np.expand_dims(l2, -1)))[:, 0]


def test_aesthetic_equals_the_published_predictor(tiny) -> None:
    x = batch()
    reward = build_reward("aesthetic", model_path=str(tiny))
    scores, dropped = score(reward, x, PROMPTS)
    assert reward.name == "aesthetic" and dropped == [] and scores.dtype == torch.float32
    torch.testing.assert_close(scores.double(), published_aesthetic(tiny, x), rtol=1e-5, atol=1e-5)
    assert scores.unique().numel() == 3  # images differ, scores differ; prompts play no part
    torch.testing.assert_close(reward(x, ["other"] * 3), scores)


def test_aesthetic_head_file_and_errors(tiny, tmp_path) -> None:
    with pytest.raises(ValueError, match="needs a model path"):
        build_reward("aesthetic")
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        build_reward("aesthetic", model_path=str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="no head file"):
        build_reward("aesthetic", model_path=str(tmp_path))
    # CLIP_DIR:HEAD_FILE, the head kept elsewhere
    head = tmp_path / "head.pth"
    head.write_bytes((tiny / "sac+logos+ava1-l14-linearMSE.pth").read_bytes())
    x = batch(1)
    torch.testing.assert_close(build_reward("aesthetic", model_path=f"{tiny}{os.pathsep}{head}")(x, ["a"]),
                               build_reward("aesthetic", model_path=str(tiny))(x, ["a"]))


# -- weighted sum of two real rewards ---------------------------------------------------------------------------
def test_weighted_sum_of_clip_score_and_aesthetic(tiny, tmp_path) -> None:
    x = batch()
    expected = 0.5 * published_aesthetic(tiny, x) + 0.01 * build_reward("clip_score", str(tiny))(x, PROMPTS).double()
    # one folder for both terms (the head file beside the CLIP), as `--reward-model` gives it
    reward = build_reward("aesthetic:0.5,clip_score:0.01", model_path=str(tiny))
    assert isinstance(reward, WeightedSum) and reward.name == "aesthetic:0.5,clip_score:0.01"
    scores, dropped = score(reward, x, PROMPTS)
    assert dropped == []
    torch.testing.assert_close(scores.double(), expected, rtol=1e-5, atol=1e-5)
    # or one folder per term
    other = init_tiny_aesthetic(tmp_path / "other", seed=3)
    per_term = build_reward("aesthetic:0.5,clip_score:0.01", model_path=f"aesthetic={tiny},clip_score={other}")
    expected = 0.5 * published_aesthetic(tiny, x) + 0.01 * build_reward("clip_score", str(other))(x, PROMPTS).double()
    torch.testing.assert_close(per_term(x, PROMPTS).double(), expected, rtol=1e-5, atol=1e-5)


def test_per_term_model_paths_are_checked(tiny) -> None:
    with pytest.raises(ValueError, match="not 'NAME=PATH' for a distinct term"):
        build_reward("aesthetic,clip_score", model_path=f"aesthetic={tiny},pickscore={tiny}")
    with pytest.raises(ValueError, match="given for redness, which takes no model"):
        build_reward("aesthetic,redness", model_path=f"aesthetic={tiny},redness={tiny}")
    with pytest.raises(ValueError, match="clip_score reward needs a model path"):
        build_reward("aesthetic,clip_score", model_path=f"aesthetic={tiny}")
