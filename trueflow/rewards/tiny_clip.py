"""A tiny random CLIP saved as a PickScore-style folder (model + processor), for tests and demos offline.

Nothing can be downloaded here, so the PickScore reward is exercised on this folder through exactly the loading
code a real PickScore_v1 + CLIP-ViT-H-14 processor goes through (`CLIPModel` / `AutoProcessor.from_pretrained`).
"""

from __future__ import annotations

from pathlib import Path

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
