"""HPS v2.1 on a tiny random open_clip checkpoint laid out as the released one, loaded offline into transformers'
CLIP; checked against open_clip's published forward written out in float64, and against the hpsv2 package's
own scorer where it imports."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.nn import functional as F

from trueflow.rewards import build_reward, score
from trueflow.rewards.hps import hps_transform
from trueflow.rewards.tiny_clip import init_tiny_hps, open_clip_state_dict, tiny_open_clip_config

MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)  # OpenAI's, in open_clip
PROMPTS = ["a cat", "a photo of a red dog on a sofa", "x", "a cat"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_hps(tmp_path_factory.mktemp("hps") / "HPSv2", seed=0)


def batch(n: int, h: int = 32, w: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8))


def open_clip_features(state: dict, cfg: dict, pixels: torch.Tensor, ids: torch.Tensor):
    """open_clip's CLIP.encode_image / encode_text (model.py, transformer.py), float64, from its state dict."""
    sd = {k: v.double() for k, v in state.items()}

    def ln(x, name):
        return F.layer_norm(x, x.shape[-1:], sd[f"{name}.weight"], sd[f"{name}.bias"], eps=1e-5)

    def linear(x, name):
        return x @ sd[f"{name}.weight"].T + sd[f"{name}.bias"]

    def resblock(x, name, heads, mask):  # x + attn(ln_1(x)); x + mlp(ln_2(x)); nn.MultiheadAttention inside
        n, length, width = x.shape
        q, k, v = (ln(x, f"{name}.ln_1") @ sd[f"{name}.attn.in_proj_weight"].T
                   + sd[f"{name}.attn.in_proj_bias"]).chunk(3, dim=-1)
        q, k, v = (t.reshape(n, length, heads, width // heads).transpose(1, 2) for t in (q, k, v))
        attention = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(width // heads) + mask, dim=-1)
        x = x + linear((attention @ v).transpose(1, 2).reshape(n, length, width), f"{name}.attn.out_proj")
        hidden = F.gelu(linear(ln(x, f"{name}.ln_2"), f"{name}.mlp.c_fc"))
        return x + linear(hidden, f"{name}.mlp.c_proj")

    vision, text = cfg["vision_cfg"], cfg["text_cfg"]
    x = F.conv2d(pixels.double(), sd["visual.conv1.weight"], stride=vision["patch_size"]).flatten(2).transpose(1, 2)
    x = torch.cat([sd["visual.class_embedding"].expand(x.shape[0], 1, -1), x], dim=1)
    x = x + sd["visual.positional_embedding"]
    x = ln(x, "visual.ln_pre")
    for i in range(vision["layers"]):
        x = resblock(x, f"visual.transformer.resblocks.{i}", vision["width"] // vision["head_width"], 0.0)
    image = ln(x[:, 0], "visual.ln_post") @ sd["visual.proj"]

    length = ids.shape[1]
    causal = torch.full((length, length), float("-inf"), dtype=torch.float64).triu(1)
    x = sd["token_embedding.weight"][ids] + sd["positional_embedding"][:length]
    for i in range(text["layers"]):
        x = resblock(x, f"transformer.resblocks.{i}", text["heads"], causal)
    x = ln(x, "ln_final")
    text_features = x[torch.arange(len(ids)), ids.argmax(dim=-1)] @ sd["text_projection"]  # the end token: top id
    return image, text_features


def test_hps_equals_the_published_architecture(tiny: Path) -> None:
    from transformers import AutoTokenizer

    x = batch(4)  # 32 x 32 = the tiny model's input size: the resize and crop do nothing, pixels only normalised
    reward = build_reward("hpsv2", model_path=str(tiny))
    scores, dropped = score(reward, x, PROMPTS)
    assert reward.name == "hpsv2" and dropped == [] and scores.dtype == torch.float32

    cfg = json.loads((tiny / "open_clip_config.json").read_text())["model_cfg"]
    state = torch.load(tiny / "HPS_v2.1_compressed.pt")["state_dict"]
    pixels = (x.permute(0, 3, 1, 2).double() / 255 - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor(STD).view(3, 1, 1)
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    ids = torch.zeros(len(PROMPTS), 77, dtype=torch.long)  # open_clip's tokenize(): zero-padded to 77
    for row, prompt in zip(ids, PROMPTS):
        tokens = tokenizer(prompt)["input_ids"]
        row[: len(tokens)] = torch.tensor(tokens)
    image, text = open_clip_features(state, cfg, pixels, ids)
    expected = F.normalize(image, dim=-1).mul(F.normalize(text, dim=-1)).sum(-1)  # hpsv2: diag(img @ txt.T)
    assert (expected > 0).any() and (expected < 0).any()
    torch.testing.assert_close(scores.double(), expected, rtol=1e-5, atol=1e-5)
    single = torch.cat([reward(x[i:i + 1], [p]) for i, p in enumerate(PROMPTS)])  # text padding changes nothing
    torch.testing.assert_close(scores, single, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("h, w", [(45, 37), (32, 70), (101, 64), (20, 20)])
def test_hps_transform_equals_torchvision(h: int, w: int) -> None:
    """hpsv2's preprocess_val: ToTensor, Resize(bicubic) on the tensor, CenterCrop, Normalize."""
    transforms = pytest.importorskip("torchvision.transforms")
    val = transforms.Compose([transforms.ToTensor(),
                              transforms.Resize(32, interpolation=transforms.InterpolationMode.BICUBIC),
                              transforms.CenterCrop(32), transforms.Normalize(MEAN, STD)])
    x = batch(2, h, w)
    expected = torch.stack([val(Image.fromarray(a)) for a in x.numpy()])
    torch.testing.assert_close(hps_transform(x, 32), expected, rtol=0, atol=1e-5)


def test_hps_transform_resizes_and_crops() -> None:
    # a vertical ramp 64 x 48 -> shorter side 32 (42 x 32 after resize), centre crop rows 5..36 of 42
    ramp = torch.linspace(0, 255, 64).round().to(torch.uint8).view(1, 64, 1, 1).expand(1, 64, 48, 3).contiguous()
    out = hps_transform(ramp, 32)
    assert out.shape == (1, 3, 32, 32)
    rows = out[0, 0, :, 0] * STD[0] + MEAN[0]
    assert (rows.diff() > 0).all() and torch.allclose(out[0, :, :, 0:1].expand_as(out[0]), out[0], atol=1e-6)
    assert rows[0].item() == pytest.approx((5 + 0.5) * 64 / 42 / 64, abs=0.02)  # the crop starts at row 5


def test_hps_model_path_forms_and_errors(tiny: Path, tmp_path: Path) -> None:
    import os

    with pytest.raises(ValueError, match="needs a model path"):
        build_reward("hpsv2")
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        build_reward("hpsv2", model_path=str(tmp_path))
    # CHECKPOINT:TOKENIZER_DIR
    x = batch(1)
    torch.testing.assert_close(
        build_reward("hpsv2", model_path=f"{tiny / 'HPS_v2.1_compressed.pt'}{os.pathsep}{tiny}")(x, ["a"]),
        build_reward("hpsv2", model_path=str(tiny))(x, ["a"]))
    # a checkpoint with a key open_clip's CLIP does not have is refused, not silently dropped
    state = torch.load(tiny / "HPS_v2.1_compressed.pt")
    state["state_dict"]["visual.extra"] = torch.zeros(1)
    bad = tmp_path / "bad"
    bad.mkdir()
    torch.save(state, bad / "HPS_v2.1_compressed.pt")
    (bad / "open_clip_config.json").write_text((tiny / "open_clip_config.json").read_text())
    with pytest.raises(ValueError, match=r"keys not in open_clip's CLIP: \['visual.extra'\]"):
        build_reward("hpsv2", model_path=f"{bad}{os.pathsep}{tiny}")


def test_hps_equals_the_hpsv2_package(tmp_path: Path) -> None:
    """The hpsv2 package's scorer (img_score.score, fp32) on the same random weights. It needs torchvision, which
    this project's CPU environment does not have (PyPI's wheel is built for CUDA torch): skipped there."""
    oc = pytest.importorskip("hpsv2.src.open_clip")
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    # the HF tokenizer files of the same BPE (as laion's CLIP-ViT-H-14 tokenizer is): vocab as open_clip builds it
    bpe = Path(oc.__file__).parent / "bpe_simple_vocab_16e6.txt.gz"
    if not bpe.exists():
        pytest.skip("the hpsv2 wheel lacks its tokenizer's bpe_simple_vocab_16e6.txt.gz (the repository has it)")
    merges = gzip.open(bpe).read().decode("utf-8").split("\n")[1:49152 - 256 - 2 + 1]
    chars = list(bytes_to_unicode().values())
    vocab = chars + [c + "</w>" for c in chars] + ["".join(m.split()) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    CLIPTokenizer(vocab={t: i for i, t in enumerate(vocab)}, merges=[tuple(m.split()) for m in merges],
                  pad_token="<|endoftext|>").save_pretrained(tmp_path)
    cfg = tiny_open_clip_config(len(vocab))
    state = open_clip_state_dict(cfg, seed=1)
    torch.save({"state_dict": state}, tmp_path / "HPS_v2.1_compressed.pt")
    (tmp_path / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg}))

    model = oc.CLIP(**cfg, output_dict=True)
    model.load_state_dict(state)
    model.eval()
    preprocess_val = oc.image_transform(cfg["vision_cfg"]["image_size"], is_train=False)
    tokenizer = oc.get_tokenizer("ViT-H-14")
    prompts = ["A Photo of a cat, 4k!", "a red dog on a sofa " * 30, "x", "über café"]
    x = batch(4, 45, 61)
    expected = []
    with torch.no_grad():
        for a, prompt in zip(x.numpy(), prompts):
            outputs = model(preprocess_val(Image.fromarray(a)).unsqueeze(0), tokenizer([prompt]))
            expected.append(torch.diagonal(outputs["image_features"] @ outputs["text_features"].T)[0])
    torch.testing.assert_close(build_reward("hpsv2", model_path=str(tmp_path))(x, prompts), torch.stack(expected),
                               rtol=1e-5, atol=1e-5)
