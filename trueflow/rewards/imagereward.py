"""`imagereward`: ImageReward v1.0 (Xu et al., 2023), a BLIP reward model of human preference, from local files.

As the image-reward package scores (`ImageReward.score`): a BLIP ViT-L/16 encodes the image (all tokens, after its
final LayerNorm); a BERT text encoder with cross-attention to those tokens reads the prompt (bert-base-uncased
tokens, padded to 35, [CLS] first, bidirectional); the [CLS] output goes through an MLP head, then

    score = (MLP(h_cls) - 0.16717362830052426) / 1.0333394966054072          (about -2 .. 2)

The head is Linear(768,1024), Dropout(0.2), Linear(1024,128), Dropout(0.2), Linear(128,64), Dropout(0.1),
Linear(64,16), Linear(16,1). The image transform is CLIP's: Resize(224, bicubic, PIL), CenterCrop(224), ToTensor,
Normalize(OpenAI mean/std).

The released `ImageReward.pt` (the ImageReward module's state dict) is loaded into transformers' BLIP pieces,
`BlipVisionModel` and `BlipTextModel` (ported from the same BLIP code; `med_config.json` is the text encoder's
BERT config): BLIP's `visual_encoder.*` names are renamed, its text encoder's names are transformers' own.
Keys outside the ViT, the text encoder and the head (BLIP's unused projections) are ignored, as the package's
`load_state_dict(strict=False)` does. The ViT's shape is read from the weights (heads = width / 64, as in BLIP's
base and large ViTs).

The model path is `DIR` holding `ImageReward.pt`, `med_config.json` (as released) and the bert-base-uncased
tokenizer files, or `DIR:TOKENIZER_DIR` (os.pathsep-separated).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from PIL import Image
from torch import nn

from .aesthetic import aesthetic_head
from .clip_score import split_model_path
from .hps import OPENAI_MEAN, OPENAI_STD

if TYPE_CHECKING:
    from transformers import BlipTextModel, BlipVisionModel

CHECKPOINT, MED_CONFIG = "ImageReward.pt", "med_config.json"
MEAN, STD = 0.16717362830052426, 1.0333394966054072  # ImageReward.__init__: the score's normalisation
MAX_LENGTH = 35  # ImageReward.score: padding="max_length", truncation=True, max_length=35
_VIT_NAMES = {"norm1": "layer_norm1", "norm2": "layer_norm2", "attn.qkv": "self_attn.qkv",
              "attn.proj": "self_attn.projection", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}


def blip_tokenizer(path: str) -> Any:
    """bert-base-uncased with BLIP's added [DEC] (bos) and [ENC] tokens, as BLIP's `init_tokenizer`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    return tokenizer


def vision_state_dict(vit: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """BLIP's VisionTransformer state dict -> (BlipVisionConfig kwargs, BlipVisionModel state dict)."""
    src = dict(vit)
    width, _, patch, _ = src["patch_embed.proj.weight"].shape
    layers = 1 + max(int(k.split(".")[1]) for k in src if k.startswith("blocks."))
    grid = round((src["pos_embed"].shape[1] - 1) ** 0.5)
    config = dict(hidden_size=width, intermediate_size=src["blocks.0.mlp.fc1.weight"].shape[0],
                  num_hidden_layers=layers, num_attention_heads=width // 64, image_size=grid * patch,
                  patch_size=patch, hidden_act="gelu", layer_norm_eps=1e-6)
    out = {"embeddings.class_embedding": src.pop("cls_token"),
           "embeddings.position_embedding": src.pop("pos_embed")}
    for p in ("weight", "bias"):
        out[f"embeddings.patch_embedding.{p}"] = src.pop(f"patch_embed.proj.{p}")
        out[f"post_layernorm.{p}"] = src.pop(f"norm.{p}")
        for i in range(layers):
            for old, new in _VIT_NAMES.items():
                out[f"encoder.layers.{i}.{new}.{p}"] = src.pop(f"blocks.{i}.{old}.{p}")
    if src:
        raise ValueError(f"imagereward: ViT keys not in BLIP's VisionTransformer: {sorted(src)[:5]}")
    return config, out


def load_imagereward(checkpoint: str, med_config: str) -> tuple[BlipVisionModel, BlipTextModel, nn.Module]:
    """(BlipVisionModel, BlipTextModel, MLP head), fp32, eval, on the CPU, from the released files."""
    from transformers import BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    parts: dict[str, dict[str, torch.Tensor]] = {"blip.visual_encoder.": {}, "blip.text_encoder.": {}, "mlp.": {}}
    for key, value in state.items():
        for prefix, part in parts.items():
            if key.startswith(prefix):
                part[key.removeprefix(prefix)] = value
    vision_config, vision_state = vision_state_dict(parts["blip.visual_encoder."])
    vision = BlipVisionModel(BlipVisionConfig(**vision_config))
    vision.load_state_dict(vision_state, strict=True)

    with open(med_config) as f:
        bert = json.load(f)
    text_config = BlipTextConfig(
        vocab_size=bert["vocab_size"], hidden_size=bert["hidden_size"], intermediate_size=bert["intermediate_size"],
        num_hidden_layers=bert["num_hidden_layers"], num_attention_heads=bert["num_attention_heads"],
        max_position_embeddings=bert["max_position_embeddings"], hidden_act=bert["hidden_act"],
        layer_norm_eps=bert["layer_norm_eps"], pad_token_id=bert.get("pad_token_id", 0), bos_token_id=None,
        eos_token_id=None, sep_token_id=None,  # generation-only ids, unused by the score
        encoder_hidden_size=vision_config["hidden_size"],  # BLIP_Pretrain sets encoder_width = the ViT's width
        is_decoder=True)  # builds the cross-attention layers; the forward runs bidirectionally (is_decoder=False)
    if bert.get("position_embedding_type", "absolute") != "absolute" or not bert.get("add_cross_attention", True):
        raise ValueError(f"imagereward: {med_config} is not a BLIP text encoder with cross-attention")
    text = BlipTextModel(text_config, add_pooling_layer=False)
    text_state = parts["blip.text_encoder."]
    text_state.pop("embeddings.position_ids", None)  # a buffer in BLIP's BERT, rebuilt here
    missing, unexpected = text.load_state_dict(text_state, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        raise ValueError(f"imagereward: text encoder keys missing {missing[:5]}, unexpected {unexpected[:5]}")

    head = aesthetic_head(bert["hidden_size"])  # ImageReward's MLP is the aesthetic predictor's layer stack
    head.load_state_dict({k.removeprefix("layers."): v for k, v in parts["mlp."].items()})
    return vision.eval(), text.eval(), head.eval()


def clip_transform(images: torch.Tensor, size: int) -> torch.Tensor:
    """CLIP's transform as ImageReward applies it to a PIL image: Resize(size) of the shorter side (PIL bicubic),
    CenterCrop(size) (torchvision's rounding), ToTensor, Normalize."""
    out = []
    for array in images.numpy():
        image = Image.fromarray(array)
        w, h = image.size
        if min(w, h) != size:  # torchvision's Resize: the longer side becomes int(size * long / short)
            image = image.resize((size, int(size * h / w)) if w <= h else (int(size * w / h), size),
                                 Image.Resampling.BICUBIC)
        w, h = image.size
        top, left = int(round((h - size) / 2.0)), int(round((w - size) / 2.0))
        out.append(np.asarray(image.crop((left, top, left + size, top + size))))
    x = torch.from_numpy(np.stack(out)).permute(0, 3, 1, 2).float() / 255
    return (x - torch.tensor(OPENAI_MEAN).view(3, 1, 1)) / torch.tensor(OPENAI_STD).view(3, 1, 1)


class ImageReward:
    name = "imagereward"

    def __init__(self, model_path: str | None, device: str = "cpu"):
        model_dir, tokenizer_dir = split_model_path(self.name, model_path, f"DIR (with {CHECKPOINT}, {MED_CONFIG} "
                                                    "and the bert-base-uncased tokenizer) or DIR:TOKENIZER_DIR")
        files = [os.path.join(model_dir, name) for name in (CHECKPOINT, MED_CONFIG)]
        for path in files:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"imagereward: no {path}")
        self.tokenizer = blip_tokenizer(tokenizer_dir or model_dir)
        self.vision, self.text, self.head = (m.to(device) for m in load_imagereward(*files))
        vision_config = cast("BlipVisionModel", self.vision).config  # load_imagereward's first model
        self.image_size = cast(int, vision_config.image_size)  # one side (ImageReward's: 224)
        self.device = device

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        text = self.tokenizer(list(prompts), padding="max_length", truncation=True, max_length=MAX_LENGTH,
                              return_tensors="pt").to(self.device)
        image_embeds = self.vision(pixel_values=clip_transform(images, self.image_size).to(self.device))[0]
        image_atts = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=self.device)
        hidden = self.text(input_ids=text["input_ids"], attention_mask=text["attention_mask"],
                           encoder_hidden_states=image_embeds, encoder_attention_mask=image_atts,
                           is_decoder=False)[0]
        return ((self.head(hidden[:, 0].float()).squeeze(-1) - MEAN) / STD).float().cpu()
