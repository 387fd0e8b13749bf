"""Wan2.2 transformer presets: the sizes `init-checkpoint --size` takes (each of a layout: the two-expert A14B or the
dense TI2V-5B), and the train side's diffusers model built from one with seeded random weights (train side only: the
engine never imports this file).

The full sizes are the published configs as diffusers' conversion writes them (`scripts/convert_wan_to_diffusers.py`,
`get_transformer_config`): "Wan2.2-T2V-A14B" (each of `transformer` / `transformer_2`: 40 heads x 128, 40 layers, FFN
13824, 16 channels, text 4096) and "Wan2.2-TI2V-5B" (24 heads x 128, 30 layers, FFN 14336, 48 channels, text 4096);
both patch (1, 2, 2), `rms_norm_across_heads`, cross-attention norm, eps 1e-6, and the model defaults for the rest
(`freq_dim` 256, `rope_max_seq_len` 1024, no image stream). The hub's config.json files could not be read here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from accelerate import init_empty_weights
# from `diffusers.models`: `diffusers`' own TYPE_CHECKING imports name its dummy classes first.
from diffusers.models import WanTransformer3DModel
from torch import nn

from ..random_init import M, init_weights_
from .transformer import KEEP_IN_FP32

_A14B: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 40,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 13824,
    "num_layers": 40,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "image_dim": None,
    "added_kv_proj_dim": None,
    "rope_max_seq_len": 1024,
    "pos_embed_seq_len": None,
}
_TI2V: dict[str, Any] = {**_A14B, "num_attention_heads": 24, "in_channels": 48, "out_channels": 48,
                         "ffn_dim": 14336, "num_layers": 30}
# Two layers at small widths (2 heads x 32: the three RoPE axes get 12/10/10 channels; at 16 the fast engine's
# rounding met diffusers' by chance on some 12-token inputs), the text as wide as a tiny UMT5; 2 heads so that --tp 2
# splits them.
_TINY = {"num_attention_heads": 2, "attention_head_dim": 32, "text_dim": 32, "ffn_dim": 128, "num_layers": 2}

TRANSFORMER_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": {**_A14B, **_TINY},
    "tiny_ti2v": {**_TI2V, **_TINY},
    "full": dict(_A14B),
    "full_ti2v": dict(_TI2V),
    # TI2V-5B's real widths (24 x 128 heads, FFN 14336, UMT5's 4096-wide text) in one block: the batch-invariant
    # tests' GEMM widths at a third of the A14B block's cost.
    "one_block": {**_TI2V, "num_layers": 1},
}
# The pipeline layout each size is written in (checkpoint.py): the A14B's two experts and Wan2.1 VAE, or the TI2V-5B's
# one transformer, Wan2.2 VAE and per-token timesteps.
LAYOUT_OF_SIZE = {"tiny": "a14b", "tiny_ti2v": "ti2v", "full": "a14b", "full_ti2v": "ti2v", "one_block": "ti2v"}


def transformer_config(size: str) -> dict[str, Any]:
    """A copy of the preset `size` (one of TRANSFORMER_CONFIGS)."""
    if size not in TRANSFORMER_CONFIGS:
        raise ValueError(f"unknown transformer size {size!r}; known sizes: {', '.join(TRANSFORMER_CONFIGS)}")
    return dict(TRANSFORMER_CONFIGS[size])


def kept_in_fp32(name: str) -> bool:
    """Whether diffusers keeps parameter `name` in fp32 when it loads the model in another dtype (`from_pretrained`'s
    rule: a component of the name is one of `_keep_in_fp32_modules`)."""
    return bool(set(KEEP_IN_FP32) & set(name.split(".")))


@torch.no_grad()
def seeded_init_(model: M, seed: int, device: str | torch.device = "cpu") -> M:
    """Seeded random weights in place: each leaf module (Linear, Conv, norms) by `init_weights_` from its own
    generator seeded by (seed, position), so the same seed gives the same weights whatever the dtype; the modulation
    tables (`scale_shift_table`, kept directly on a block or the model) randn / sqrt(width), as diffusers draws them."""
    for index, (name, mod) in enumerate(model.named_modules()):
        own = dict(mod.named_parameters(recurse=False))
        if not own:
            continue
        mod_seed = seed * 1_000_003 + index
        if "scale_shift_table" not in own:
            init_weights_(mod, mod_seed, device)
            continue
        if set(own) != {"scale_shift_table"} and any(True for _ in mod.children()):
            raise TypeError(f"no init rule for {name}: {sorted(own)}")
        gen = torch.Generator(device=device).manual_seed(mod_seed)
        p = own["scale_shift_table"]
        p.copy_(torch.randn(p.shape, generator=gen, device=device) * p.shape[-1] ** -0.5)
    return model


def build_transformer(size_or_config: str | Mapping[str, Any], seed: int = 0, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu") -> WanTransformer3DModel:
    """diffusers' WanTransformer3DModel with seeded random weights, in `dtype` on `device` (the weights drawn there),
    eval mode, with the dtypes `from_pretrained(torch_dtype=dtype)` gives it: fp32 where diffusers keeps fp32
    (`_keep_in_fp32_modules`; `model.to(dtype)` would round those too). The parameters start on the meta device (a
    large model is allocated once, directly in its dtypes); the RoPE tables are buffers built in the constructor,
    as diffusers builds them."""
    config = transformer_config(size_or_config) if isinstance(size_or_config, str) else dict(size_or_config)
    config = {k: v for k, v in config.items() if not k.startswith("_")}  # a config.json's _class_name etc.
    with init_empty_weights():  # parameters only: the buffers (RoPE tables) are computed for real
        model = WanTransformer3DModel(**config)
    for mod_name, mod in model.named_modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            full = f"{mod_name}.{name}" if mod_name else name
            empty = torch.empty(p.shape, dtype=torch.float32 if kept_in_fp32(full) else dtype, device=device)
            mod.register_parameter(name, nn.Parameter(empty, p.requires_grad))
    return seeded_init_(model, seed, device).to(device).eval()

