"""`hpsv2`: Human Preference Score v2.1 (Wu et al., 2023), an open_clip ViT-H-14 fine-tuned on human preferences.

Scored as the hpsv2 package does (`hpsv2.score`): the cosine of the L2-normalised image and text features,

    score = <f_img / |f_img|, f_txt / |f_txt|>           (no logit scale; about 0.2 .. 0.35 on real images)

The released checkpoint `HPS_v2.1_compressed.pt` is an open_clip state dict (`{"state_dict": ...}`); it is loaded
into transformers' `CLIPModel`, whose architecture is open_clip's ViT-H-14 (pre-LN transformer, exact GELU, class
token pooled after `ln_post`, text pooled at the end token after `ln_final`): the fused `in_proj` of each
attention is split into q, k, v and the projections transposed. The image transform is hpsv2's validation one:
ToTensor, then Resize(224, bicubic, antialiased, on the float tensor), CenterCrop(224), Normalize(OpenAI mean/std).

The model path is `DIR` holding `HPS_v2.1_compressed.pt` and the CLIP tokenizer (ViT-H-14's: the tokenizer files
of laion/CLIP-ViT-H-14-laion2B-s32B-b79K, as PickScore's processor), or `CHECKPOINT_OR_DIR:TOKENIZER_DIR`
(os.pathsep-separated). An `open_clip_config.json` beside the checkpoint (open_clip's hub layout,
`{"model_cfg": ...}`) gives the architecture; without it, ViT-H-14's.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch.nn import functional as F

from .clip_score import features, normalize, split_model_path

CHECKPOINT = "HPS_v2.1_compressed.pt"
VIT_H_14: dict[str, Any] = {  # open_clip's model_configs/ViT-H-14.json
    "embed_dim": 1024,
    "vision_cfg": {"image_size": 224, "layers": 32, "width": 1280, "head_width": 80, "patch_size": 14},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 1024, "heads": 16, "layers": 24},
}
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
# open_clip config keys this conversion reproduces; any other option (layer scale, attentional pooling, ...) is refused
_VISION_KEYS = {"image_size", "layers", "width", "head_width", "patch_size", "mlp_ratio"}
_TEXT_KEYS = {"context_length", "vocab_size", "width", "heads", "layers", "mlp_ratio"}


def clip_config(cfg: dict[str, Any], tokenizer: Any) -> Any:
    """transformers' CLIPConfig equal to an open_clip `model_cfg`."""
    from transformers import CLIPConfig

    vision, text = cfg["vision_cfg"], cfg["text_cfg"]
    unknown = (set(vision) - _VISION_KEYS) | (set(text) - _TEXT_KEYS) | (set(cfg) - {"embed_dim", "vision_cfg",
                                                                                      "text_cfg", "quick_gelu"})
    if unknown:
        raise ValueError(f"hpsv2: open_clip options {sorted(unknown)} are not supported")
    act = "quick_gelu" if cfg.get("quick_gelu") else "gelu"
    return CLIPConfig(
        vision_config=dict(hidden_size=vision["width"], num_hidden_layers=vision["layers"],
                           intermediate_size=int(vision["width"] * vision.get("mlp_ratio", 4.0)),
                           num_attention_heads=vision["width"] // vision.get("head_width", 64),
                           image_size=vision["image_size"], patch_size=vision["patch_size"], hidden_act=act,
                           layer_norm_eps=1e-5),
        text_config=dict(vocab_size=text["vocab_size"], hidden_size=text["width"], num_hidden_layers=text["layers"],
                         intermediate_size=int(text["width"] * text.get("mlp_ratio", 4.0)),
                         num_attention_heads=text["heads"], max_position_embeddings=text["context_length"],
                         hidden_act=act, layer_norm_eps=1e-5, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id),
        projection_dim=cfg["embed_dim"],
    )


def clip_state_dict(open_clip_state: dict[str, torch.Tensor], vision_layers: int,
                    text_layers: int) -> dict[str, torch.Tensor]:
    """An open_clip CLIP state dict under transformers' CLIPModel names; every key must be used."""
    src = dict(open_clip_state)
    out: dict[str, torch.Tensor] = {}

    def move(old: str, new: str) -> None:
        for p in ("weight", "bias"):
            out[f"{new}.{p}"] = src.pop(f"{old}.{p}")

    def blocks(old: str, new: str, n: int) -> None:
        for i in range(n):
            o, h = f"{old}.{i}", f"{new}.{i}"
            for name, w, b in zip("qkv", src.pop(f"{o}.attn.in_proj_weight").chunk(3),
                                  src.pop(f"{o}.attn.in_proj_bias").chunk(3)):
                out[f"{h}.self_attn.{name}_proj.weight"], out[f"{h}.self_attn.{name}_proj.bias"] = w, b
            for a, c in (("attn.out_proj", "self_attn.out_proj"), ("ln_1", "layer_norm1"), ("ln_2", "layer_norm2"),
                         ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")):
                move(f"{o}.{a}", f"{h}.{c}")

    blocks("visual.transformer.resblocks", "vision_model.encoder.layers", vision_layers)
    blocks("transformer.resblocks", "text_model.encoder.layers", text_layers)
    out["vision_model.embeddings.class_embedding"] = src.pop("visual.class_embedding")
    out["vision_model.embeddings.patch_embedding.weight"] = src.pop("visual.conv1.weight")
    out["vision_model.embeddings.position_embedding.weight"] = src.pop("visual.positional_embedding")
    move("visual.ln_pre", "vision_model.pre_layrnorm")
    move("visual.ln_post", "vision_model.post_layernorm")
    out["visual_projection.weight"] = src.pop("visual.proj").T.contiguous()
    out["text_model.embeddings.token_embedding.weight"] = src.pop("token_embedding.weight")
    out["text_model.embeddings.position_embedding.weight"] = src.pop("positional_embedding")
    move("ln_final", "text_model.final_layer_norm")
    out["text_projection.weight"] = src.pop("text_projection").T.contiguous()
    out["logit_scale"] = src.pop("logit_scale")
    if src:
        raise ValueError(f"hpsv2: checkpoint keys not in open_clip's CLIP: {sorted(src)[:5]}")
    return out


def load_open_clip_as_clip(checkpoint: str, cfg: dict[str, Any], tokenizer: Any) -> Any:
    """transformers' CLIPModel (fp32, eval, CPU) holding an open_clip checkpoint's weights."""
    from transformers import CLIPModel

    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    state = state.get("state_dict", state)
    config = clip_config(cfg, tokenizer)
    converted = clip_state_dict(state, config.vision_config.num_hidden_layers, config.text_config.num_hidden_layers)
    with torch.device("meta"):  # no random init of a billion parameters that are overwritten at once
        model = CLIPModel(config)
    model.load_state_dict(converted, strict=True, assign=True)
    for embeddings in (model.vision_model.embeddings, model.text_model.embeddings):  # non-persistent buffers
        embeddings.position_ids = torch.arange(embeddings.position_ids.shape[-1]).unsqueeze(0)
    return model.float().eval()


def hps_transform(images: torch.Tensor, size: int) -> torch.Tensor:
    """hpsv2's validation transform on uint8 [N, H, W, 3]: ToTensor, Resize(size) of the shorter side (bicubic,
    antialiased, as torchvision resizes a float tensor), CenterCrop(size) (torchvision's rounding), Normalize."""
    x = images.permute(0, 3, 1, 2).float() / 255
    h, w = x.shape[-2:]
    short, long = (h, w) if h <= w else (w, h)
    if short != size:
        resized = (size, int(size * long / short))
        x = F.interpolate(x, size=resized if h <= w else resized[::-1], mode="bicubic", align_corners=False,
                          antialias=True)
    h, w = x.shape[-2:]
    top, left = int(round((h - size) / 2.0)), int(round((w - size) / 2.0))
    x = x[..., top:top + size, left:left + size]
    return (x - torch.tensor(OPENAI_MEAN).view(3, 1, 1)) / torch.tensor(OPENAI_STD).view(3, 1, 1)


class HPSv2:
    name = "hpsv2"

    def __init__(self, model_path: str | None, device: str = "cpu"):
        from transformers import AutoTokenizer

        first, tokenizer_dir = split_model_path(self.name, model_path, f"DIR (with {CHECKPOINT} and the CLIP "
                                                "tokenizer) or CHECKPOINT_OR_DIR:TOKENIZER_DIR")
        checkpoint = os.path.join(first, CHECKPOINT) if os.path.isdir(first) else first
        if not os.path.isfile(checkpoint):
            raise FileNotFoundError(f"hpsv2: no checkpoint {checkpoint}")
        config_file = os.path.join(os.path.dirname(checkpoint), "open_clip_config.json")
        cfg = VIT_H_14
        if os.path.isfile(config_file):
            with open(config_file) as f:
                cfg = json.load(f)["model_cfg"]
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or os.path.dirname(checkpoint))
        self.model = load_open_clip_as_clip(checkpoint, cfg, self.tokenizer).to(device)
        self.image_size = self.model.config.vision_config.image_size
        self.context = self.model.config.text_config.max_position_embeddings
        self.device = device

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        pixels = hps_transform(images, self.image_size).to(self.device)
        text = self.tokenizer(list(prompts), padding=True, truncation=True, max_length=self.context,
                              return_tensors="pt").to(self.device)
        image = features(self.model.get_image_features(pixel_values=pixels))
        text = features(self.model.get_text_features(input_ids=text["input_ids"],
                                                     attention_mask=text["attention_mask"]))
        return (normalize(image) * normalize(text)).sum(dim=-1).float().cpu()
