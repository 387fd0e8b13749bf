"""ImageReward on a tiny random checkpoint laid out as the released one (ImageReward.pt under BLIP's names,
med_config.json, a BERT tokenizer), loaded offline into transformers' BLIP pieces; checked against BLIP's published
ViT and BERT-with-cross-attention forward written out in float64, and against the image-reward package where it
imports."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.nn import functional as F

from trueflow.rewards import build_reward, score
from trueflow.rewards.imagereward import clip_transform
from trueflow.rewards.tiny_clip import init_tiny_imagereward

from test_rewards_hps import MEAN, STD, batch  # OpenAI's CLIP normalisation and the random uint8 images

PROMPTS = ["a cat", "A photo of a red dog on a sofa!", "x", "a cat"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_imagereward(tmp_path_factory.mktemp("ir") / "ImageReward", seed=0)


def published_imagereward(state: dict, med: dict, pixels: torch.Tensor, ids: torch.Tensor,
                          mask: torch.Tensor) -> torch.Tensor:
    """ImageReward.score: BLIP vit.py's VisionTransformer, med.py's BertModel (multimodal mode, bidirectional),
    the MLP on [CLS], (r - mean) / std; float64, from the state dict."""
    sd = {k: v.double() for k, v in state.items() if v.is_floating_point()}

    def ln(x, name, eps):
        return F.layer_norm(x, x.shape[-1:], sd[f"{name}.weight"], sd[f"{name}.bias"], eps=eps)

    def linear(x, name):
        return x @ sd[f"{name}.weight"].T + sd[f"{name}.bias"]

    def attend(q, k, v, heads, bias):
        n, lq, width = q.shape
        q, k, v = (t.reshape(n, t.shape[1], heads, width // heads).transpose(1, 2) for t in (q, k, v))
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(width // heads) + bias, dim=-1)
        return (weights @ v).transpose(1, 2).reshape(n, lq, width)

    # vit.py: patch_embed, cls + pos_embed, pre-LN blocks (eps 1e-6), final norm; all tokens are the image embeds
    v = "blip.visual_encoder"
    x = F.conv2d(pixels.double(), sd[f"{v}.patch_embed.proj.weight"], sd[f"{v}.patch_embed.proj.bias"],
                 stride=sd[f"{v}.patch_embed.proj.weight"].shape[-1]).flatten(2).transpose(1, 2)
    x = torch.cat([sd[f"{v}.cls_token"].expand(len(x), -1, -1), x], dim=1) + sd[f"{v}.pos_embed"]
    heads = x.shape[-1] // 64
    blocks = 1 + max(int(k.split(".")[3]) for k in sd if k.startswith(f"{v}.blocks."))
    for i in range(blocks):
        b = f"{v}.blocks.{i}"
        q, k, val = linear(ln(x, f"{b}.norm1", 1e-6), f"{b}.attn.qkv").chunk(3, dim=-1)
        x = x + linear(attend(q, k, val, heads, 0.0), f"{b}.attn.proj")
        x = x + linear(F.gelu(linear(ln(x, f"{b}.norm2", 1e-6), f"{b}.mlp.fc1")), f"{b}.mlp.fc2")
    image = ln(x, f"{v}.norm", 1e-6)

    # med.py: BertEmbeddings (word + absolute position, LayerNorm), post-LN layers: self-attention with the padding
    # mask ((1 - mask) * -10000), cross-attention to every image token, feed-forward
    t, eps, heads = "blip.text_encoder", med["layer_norm_eps"], med["num_attention_heads"]
    h = ln(sd[f"{t}.embeddings.word_embeddings.weight"][ids]
           + sd[f"{t}.embeddings.position_embeddings.weight"][: ids.shape[1]], f"{t}.embeddings.LayerNorm", eps)
    pad = (1.0 - mask.double())[:, None, None, :] * -10000.0
    for i in range(med["num_hidden_layers"]):
        layer = f"{t}.encoder.layer.{i}"
        for kind, source, bias in (("attention", None, pad), ("crossattention", image, 0.0)):
            kv = h if source is None else source
            a = attend(linear(h, f"{layer}.{kind}.self.query"), linear(kv, f"{layer}.{kind}.self.key"),
                       linear(kv, f"{layer}.{kind}.self.value"), heads, bias)
            h = ln(linear(a, f"{layer}.{kind}.output.dense") + h, f"{layer}.{kind}.output.LayerNorm", eps)
        inner = F.gelu(linear(h, f"{layer}.intermediate.dense"))
        h = ln(linear(inner, f"{layer}.output.dense") + h, f"{layer}.output.LayerNorm", eps)

    r = h[:, 0]
    for index in (0, 2, 4, 6, 7):  # the MLP: Linear, Dropout, ..., no activations
        r = linear(r, f"mlp.layers.{index}")
    return (r[:, 0] - 0.16717362830052426) / 1.0333394966054072


def test_imagereward_equals_the_published_model(tiny: Path) -> None:
    from transformers import AutoTokenizer

    x = batch(4)  # 32 x 32 = the tiny ViT's input size: the resize and crop do nothing, pixels only normalised
    reward = build_reward("imagereward", model_path=str(tiny))
    scores, dropped = score(reward, x, PROMPTS)
    assert reward.name == "imagereward" and dropped == [] and scores.dtype == torch.float32

    state = torch.load(tiny / "ImageReward.pt")
    med = json.loads((tiny / "med_config.json").read_text())
    pixels = (x.permute(0, 3, 1, 2).double() / 255 - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor(STD).view(3, 1, 1)
    text = AutoTokenizer.from_pretrained(tiny)(PROMPTS, padding="max_length", truncation=True, max_length=35,
                                                return_tensors="pt")
    expected = published_imagereward(state, med, pixels, text["input_ids"], text["attention_mask"])
    assert expected.std() > 0.05  # images and prompts move the score
    torch.testing.assert_close(scores.double(), expected, rtol=1e-5, atol=1e-5)
    single = torch.cat([reward(x[i:i + 1], [p]) for i, p in enumerate(PROMPTS)])
    torch.testing.assert_close(scores, single, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("h, w", [(45, 37), (32, 70), (101, 64), (20, 20)])
def test_clip_transform_equals_torchvision(h: int, w: int) -> None:
    """ImageReward's _transform: Resize(bicubic) and CenterCrop of the PIL image, ToTensor, Normalize."""
    transforms = pytest.importorskip("torchvision.transforms")
    clip = transforms.Compose([transforms.Resize(32, interpolation=transforms.InterpolationMode.BICUBIC),
                               transforms.CenterCrop(32), transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    x = batch(2, h, w)
    expected = torch.stack([clip(Image.fromarray(a)) for a in x.numpy()])
    torch.testing.assert_close(clip_transform(x, 32), expected, rtol=0, atol=1e-6)


def test_clip_transform_resizes_with_pil_and_crops_centred() -> None:
    x = batch(1, 45, 37)  # shorter side 37 -> 32; the other int(32 * 45 / 37) = 38; crop rows round(3.0) = 3
    resized = np.asarray(Image.fromarray(x[0].numpy()).resize((32, 38), Image.BICUBIC))[3:35]
    expected = (torch.from_numpy(resized.copy()).permute(2, 0, 1).float() / 255 - torch.tensor(MEAN).view(3, 1, 1))
    torch.testing.assert_close(clip_transform(x, 32)[0], expected / torch.tensor(STD).view(3, 1, 1))


def test_imagereward_files_and_errors(tiny: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs a model path"):
        build_reward("imagereward")
    with pytest.raises(FileNotFoundError, match="no .*ImageReward.pt"):
        build_reward("imagereward", model_path=str(tmp_path))
    # DIR:TOKENIZER_DIR, the tokenizer kept apart from the released files
    model_dir, tokenizer_dir = tmp_path / "model", tmp_path / "tokenizer"
    model_dir.mkdir()
    for name in ("ImageReward.pt", "med_config.json"):
        (model_dir / name).write_bytes((tiny / name).read_bytes())
    reward = build_reward("imagereward", model_path=f"{model_dir}{os.pathsep}{tiny}")
    torch.testing.assert_close(reward(batch(1), ["a"]), build_reward("imagereward", str(tiny))(batch(1), ["a"]))
    with pytest.raises(FileNotFoundError, match="no such file or folder .*tokenizer"):
        build_reward("imagereward", model_path=f"{model_dir}{os.pathsep}{tokenizer_dir}")


def test_imagereward_equals_the_image_reward_package(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """image-reward's ImageReward.score (its own BLIP code) on the same random weights. Its BLIP is built for ViT-L
    at 224 px with the hub's bert-base-uncased tokenizer; both are swapped for the tiny ones here through its own
    constructors. It needs torchvision, timm and fairscale and was written for transformers 4: skipped where it does
    not import."""
    upstream = pytest.importorskip("ImageReward.ImageReward")
    from ImageReward.models.BLIP import blip, blip_pretrain
    from ImageReward.models.BLIP.vit import VisionTransformer
    from transformers import BertTokenizer

    monkeypatch.setattr(blip, "BertTokenizer", type("Local", (), {
        "from_pretrained": staticmethod(lambda name: BertTokenizer.from_pretrained(tiny))}))
    monkeypatch.setattr(blip_pretrain, "create_vit", lambda *args, **kwargs: (VisionTransformer(
        img_size=32, patch_size=16, embed_dim=128, depth=2, num_heads=2), 128))
    model = upstream.ImageReward(med_config=str(tiny / "med_config.json"), device="cpu")
    model.preprocess = upstream._transform(32)
    missing, unexpected = model.load_state_dict(torch.load(tiny / "ImageReward.pt"), strict=False)
    assert missing == [] and unexpected == []  # the tiny file has the released file's keys, no more, no fewer
    model.eval()
    x = batch(4, 45, 37)
    with torch.no_grad():
        expected = torch.tensor([model.score(p, Image.fromarray(a)) for a, p in zip(x.numpy(), PROMPTS)])
    torch.testing.assert_close(build_reward("imagereward", model_path=str(tiny))(x, PROMPTS), expected.float(),
                               rtol=1e-5, atol=1e-5)
