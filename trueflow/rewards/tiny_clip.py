"""A tiny random CLIP saved as a PickScore-style folder (model + processor), for tests and demos offline.

Nothing can be downloaded here, so the PickScore reward is exercised on this folder through exactly the loading
code a real PickScore_v1 + CLIP-ViT-H-14 processor goes through (`CLIPModel` / `AutoProcessor.from_pretrained`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

_BOS, _EOS = "<|startoftext|>", "<|endoftext|>"


def _tokenizer():
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    # Byte-level alphabet with CLIP's end-of-word variants and no merges: every string encodes, one token a byte.
    chars = list(bytes_to_unicode().values())
    tokens = chars + [c + "</w>" for c in chars] + [_BOS, _EOS]
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[])


def init_tiny_clip(out: str | Path, seed: int = 0, image_size: int = 32) -> Path:
    """Write a seeded random `CLIPModel` and a `CLIPProcessor` (PIL image processor + byte-level tokenizer) to `out`."""
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPProcessor

    tokenizer = _tokenizer()
    ids = tokenizer.convert_tokens_to_ids([_BOS, _EOS])
    config = CLIPConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=77, bos_token_id=ids[0],
                         eos_token_id=ids[1], pad_token_id=ids[1]),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=image_size, patch_size=8),
        projection_dim=16,
    )
    with torch.random.fork_rng(devices=[]):  # seeded without touching the caller's global RNG
        torch.manual_seed(seed)
        model = CLIPModel(config).eval()
    out = Path(out)
    model.save_pretrained(out)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": image_size},
                                            crop_size={"height": image_size, "width": image_size})
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(out)
    return out


# CLIP ViT-H/14: PickScore_v1's architecture.
VIT_H14: dict[str, Any] = {
    "text_config": {"vocab_size": 49408, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                    "num_attention_heads": 16, "max_position_embeddings": 77, "hidden_act": "gelu"},
    "vision_config": {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
                      "num_attention_heads": 16, "image_size": 224, "patch_size": 14, "hidden_act": "gelu"},
    "projection_dim": 1024,
}


def init_clip_h(out: str | Path, device: str = "cpu", seed: int = 0) -> Path:
    """A PickScore-layout folder with a random CLIP of ViT-H/14's size (about 1B parameters, fp32, as PickScore
    runs) and the tiny folder's processor at 224 px: PickScore's cost without its weights. Drawn on `device`."""
    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer

    out = Path(out)
    init_tiny_clip(out, image_size=VIT_H14["vision_config"]["image_size"])  # the processor; the model is replaced
    tokenizer = CLIPTokenizer.from_pretrained(out)
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.eos_token_id}
    config = CLIPConfig(text_config={**VIT_H14["text_config"], **ids}, vision_config=VIT_H14["vision_config"],
                        projection_dim=VIT_H14["projection_dim"])
    rng_devices = [torch.cuda.current_device()] if str(device).startswith("cuda") else []
    with torch.random.fork_rng(devices=rng_devices), torch.device(device):
        torch.manual_seed(seed)
        model = CLIPModel(config).eval()
    model.save_pretrained(out)
    return out


def init_tiny_aesthetic(out: str | Path, seed: int = 0, image_size: int = 32) -> Path:
    """A tiny CLIP folder (as `init_tiny_clip`) holding a random LAION aesthetic head as the released file
    `sac+logos+ava1-l14-linearMSE.pth` lays it out: the state dict of its `layers` Sequential, input = CLIP's
    projection size (768 for the real ViT-L/14, 16 here)."""
    out = init_tiny_clip(out, seed, image_size)
    sizes = [(16, 1024), (1024, 128), (128, 64), (64, 16), (16, 1)]  # (in, out) of layers 0, 2, 4, 6, 7
    generator = torch.Generator().manual_seed(seed + 1)
    state = {}
    for index, (n_in, n_out) in zip((0, 2, 4, 6, 7), sizes):
        bound = n_in ** -0.5  # nn.Linear's default init range
        state[f"layers.{index}.weight"] = (torch.rand(n_out, n_in, generator=generator) * 2 - 1) * bound
        state[f"layers.{index}.bias"] = (torch.rand(n_out, generator=generator) * 2 - 1) * bound
    torch.save(state, out / "sac+logos+ava1-l14-linearMSE.pth")
    return out


def tiny_open_clip_config(vocab_size: int, image_size: int = 32) -> dict:
    """An open_clip `model_cfg` of ViT-H-14's shape (pre-LN ViT, exact GELU, heads from head_width), tiny."""
    return {"embed_dim": 16,
            "vision_cfg": {"image_size": image_size, "layers": 2, "width": 32, "head_width": 16, "patch_size": 8},
            "text_cfg": {"context_length": 77, "vocab_size": vocab_size, "width": 32, "heads": 2, "layers": 2}}


def open_clip_state_dict(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under open_clip's CLIP state-dict names and shapes (as open_clip's `CLIP(**cfg)` has them)."""
    vision, text, embed = cfg["vision_cfg"], cfg["text_cfg"], cfg["embed_dim"]
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}

    def randn(*shape: int, std: float = 0.02, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std + mean

    def norm(name: str, width: int) -> None:
        state[f"{name}.weight"], state[f"{name}.bias"] = randn(width, std=0.1, mean=1.0), randn(width, std=0.1)

    def blocks(prefix: str, width: int, layers: int) -> None:
        for i in range(layers):
            b = f"{prefix}.{i}"
            norm(f"{b}.ln_1", width)
            norm(f"{b}.ln_2", width)
            linears = (("attn.in_proj", 3 * width, width, 0.2), ("attn.out_proj", width, width, 0.2),
                       ("mlp.c_fc", 4 * width, width, 0.2), ("mlp.c_proj", width, 4 * width, 0.1))
            for name, n_out, n_in, std in linears:
                # nn.MultiheadAttention names its fused input projection in_proj_weight / in_proj_bias
                sep = "_" if name == "attn.in_proj" else "."
                state[f"{b}.{name}{sep}weight"] = randn(n_out, n_in, std=std)
                state[f"{b}.{name}{sep}bias"] = randn(n_out)

    w, grid = vision["width"], vision["image_size"] // vision["patch_size"]
    state["visual.class_embedding"] = randn(w, std=0.5)
    state["visual.positional_embedding"] = randn(grid * grid + 1, w, std=0.5)
    state["visual.proj"] = randn(w, embed, std=0.2)
    state["visual.conv1.weight"] = randn(w, 3, vision["patch_size"], vision["patch_size"], std=0.1)
    norm("visual.ln_pre", w)
    blocks("visual.transformer.resblocks", w, vision["layers"])
    norm("visual.ln_post", w)
    t = text["width"]
    state["positional_embedding"] = randn(text["context_length"], t, std=0.5)
    state["text_projection"] = randn(t, embed, std=0.2)
    state["logit_scale"] = torch.tensor(2.6592)  # log(1 / 0.07), open_clip's init
    state["token_embedding.weight"] = randn(text["vocab_size"], t, std=0.5)
    blocks("transformer.resblocks", t, text["layers"])
    norm("ln_final", t)
    return state


def init_tiny_hps(out: str | Path, seed: int = 0, image_size: int = 32) -> Path:
    """A folder laid out as HPS v2.1 is used: `HPS_v2.1_compressed.pt` (`{"state_dict": open_clip weights}`), here
    random and tiny, with `open_clip_config.json` (open_clip's hub layout) and a CLIP tokenizer (byte-level)."""
    import json

    tokenizer = _tokenizer()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_open_clip_config(len(tokenizer), image_size)
    torch.save({"state_dict": open_clip_state_dict(cfg, seed)}, out / "HPS_v2.1_compressed.pt")
    (out / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg}))
    tokenizer.save_pretrained(out)
    return out


def _bert_tokenizer(out: Path):
    """A BERT WordPiece tokenizer over lower-case letters, digits and punctuation (every ASCII word encodes)."""
    from transformers import BertTokenizer

    chars = [chr(c) for c in range(33, 127) if not chr(c).isupper()]
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + chars + ["##" + c for c in chars if c.isalnum()]
    (out / "vocab.txt").write_text("\n".join(tokens) + "\n")
    tokenizer = BertTokenizer(str(out / "vocab.txt"), do_lower_case=True)
    tokenizer.save_pretrained(out)
    return tokenizer


def init_tiny_imagereward(out: str | Path, seed: int = 0, image_size: int = 32) -> Path:
    """A folder laid out as ImageReward v1.0 is released (`ImageReward.pt`: the ImageReward module's state dict under
    BLIP's names; `med_config.json`: the BERT config), plus a BERT tokenizer; random and small: a 2-layer ViT of
    width 128 (2 heads of 64, as BLIP's), a 1-layer text encoder of ImageReward's width 768 (its head takes 768)."""
    import json

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = len(_bert_tokenizer(out)) + 2  # + BLIP's [DEC] and [ENC]
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}

    def randn(*shape: int, std: float = 0.02, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std + mean

    def linear(name: str, n_out: int, n_in: int, std: float = 0.05) -> None:
        state[f"{name}.weight"], state[f"{name}.bias"] = randn(n_out, n_in, std=std), randn(n_out)

    def norm(name: str, width: int) -> None:
        state[f"{name}.weight"], state[f"{name}.bias"] = randn(width, std=0.1, mean=1.0), randn(width, std=0.1)

    width, patch, hidden, positions = 128, 16, 768, 40
    v = "blip.visual_encoder"
    state[f"{v}.cls_token"] = randn(1, 1, width, std=0.5)
    state[f"{v}.pos_embed"] = randn(1, (image_size // patch) ** 2 + 1, width, std=0.5)
    state[f"{v}.patch_embed.proj.weight"] = randn(width, 3, patch, patch)
    state[f"{v}.patch_embed.proj.bias"] = randn(width)
    for i in range(2):
        b = f"{v}.blocks.{i}"
        norm(f"{b}.norm1", width)
        norm(f"{b}.norm2", width)
        linear(f"{b}.attn.qkv", 3 * width, width, std=0.2)
        linear(f"{b}.attn.proj", width, width, std=0.2)
        linear(f"{b}.mlp.fc1", 4 * width, width, std=0.2)
        linear(f"{b}.mlp.fc2", width, 4 * width, std=0.1)
    norm(f"{v}.norm", width)
    t = "blip.text_encoder"
    state[f"{t}.embeddings.word_embeddings.weight"] = randn(vocab, hidden, std=0.5)
    state[f"{t}.embeddings.position_embeddings.weight"] = randn(positions, hidden, std=0.5)
    state[f"{t}.embeddings.position_ids"] = torch.arange(positions).unsqueeze(0)  # a buffer BLIP's BERT saves
    norm(f"{t}.embeddings.LayerNorm", hidden)
    layer = f"{t}.encoder.layer.0"
    for attention, key_width in (("attention", hidden), ("crossattention", width)):
        linear(f"{layer}.{attention}.self.query", hidden, hidden)
        linear(f"{layer}.{attention}.self.key", hidden, key_width)
        linear(f"{layer}.{attention}.self.value", hidden, key_width, std=0.2)
        linear(f"{layer}.{attention}.output.dense", hidden, hidden)
        norm(f"{layer}.{attention}.output.LayerNorm", hidden)
    linear(f"{layer}.intermediate.dense", 64, hidden)
    linear(f"{layer}.output.dense", hidden, 64)
    norm(f"{layer}.output.LayerNorm", hidden)
    linear("blip.vision_proj", 256, width)  # BLIP_Pretrain's contrastive projections: saved, unused by the score
    linear("blip.text_proj", 256, hidden)
    for index, (n_in, n_out) in zip((0, 2, 4, 6, 7), [(hidden, 1024), (1024, 128), (128, 64), (64, 16), (16, 1)]):
        linear(f"mlp.layers.{index}", n_out, n_in, std=(n_in + 1) ** -0.5)
    torch.save(state, out / "ImageReward.pt")
    med = {"architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
           "hidden_dropout_prob": 0.1, "hidden_size": hidden, "initializer_range": 0.02, "intermediate_size": 64,
           "layer_norm_eps": 1e-12, "max_position_embeddings": positions, "model_type": "bert",
           "num_attention_heads": 12, "num_hidden_layers": 1, "pad_token_id": 0, "type_vocab_size": 2,
           "vocab_size": vocab, "encoder_width": 768, "add_cross_attention": True}
    (out / "med_config.json").write_text(json.dumps(med, indent=2))
    return out
