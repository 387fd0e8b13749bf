"""Maps diffusers' `QwenImageTransformer2DModel` tensor names onto the engine's parameters.

Pure name/shape logic and tensor copies, no file I/O (`trueflow.loading` reads the files). The same map serves
full weights and LoRA module names, so a LoRA trained with PEFT on diffusers' model lands on the right engine
layer (and on the right slot of a packed q/k/v weight).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ...layers.linear import Linear, LoraAdapter

# diffusers module name -> (engine module name, packed slot or None); names not listed are the same on both sides.
# Inside a block (the "transformer_blocks.N." prefix is kept):
_BLOCK_RENAMES: dict[str, tuple[str, int | None]] = {
    "attn.to_q": ("attn.to_qkv", 0), "attn.to_k": ("attn.to_qkv", 1), "attn.to_v": ("attn.to_qkv", 2),
    "attn.add_q_proj": ("attn.add_qkv", 0), "attn.add_k_proj": ("attn.add_qkv", 1),
    "attn.add_v_proj": ("attn.add_qkv", 2),
    "attn.to_out.0": ("attn.to_out", None),
    "img_mlp.net.0.proj": ("img_mlp.proj_in", None), "img_mlp.net.2": ("img_mlp.proj_out", None),
    "txt_mlp.net.0.proj": ("txt_mlp.proj_in", None), "txt_mlp.net.2": ("txt_mlp.proj_out", None),
    "img_mod.1": ("img_mod", None), "txt_mod.1": ("txt_mod", None),
}
_TOP_RENAMES: dict[str, tuple[str, int | None]] = {
    "time_text_embed.timestep_embedder.linear_1": ("time_text_embed.linear_1", None),
    "time_text_embed.timestep_embedder.linear_2": ("time_text_embed.linear_2", None),
}
_BLOCK = re.compile(r"^(transformer_blocks\.\d+\.)(.+)$")
_REVERSE_BLOCK = {v: k for k, v in _BLOCK_RENAMES.items()}
_REVERSE_TOP = {v: k for k, v in _TOP_RENAMES.items()}


def map_module_name(diffusers_name: str) -> tuple[str, int | None]:
    """diffusers module name -> (engine module name, packed slot or None)."""
    m = _BLOCK.match(diffusers_name)
    if m:
        engine, slot = _BLOCK_RENAMES.get(m.group(2), (m.group(2), None))
        return m.group(1) + engine, slot
    return _TOP_RENAMES.get(diffusers_name, (diffusers_name, None))


def diffusers_module_name(engine_name: str, slot: int | None = None) -> str:
    """The inverse of `map_module_name`."""
    m = _BLOCK.match(engine_name)
    if m:
        return m.group(1) + _REVERSE_BLOCK.get((m.group(2), slot), m.group(2))
    return _REVERSE_TOP.get((engine_name, slot), engine_name)


class WeightLoadError(ValueError):
    """Raised with every missing, unexpected and mis-shaped tensor listed at once."""

    def __init__(self, missing: list[str], unexpected: list[str], mismatched: list[str], what: str = "weights"):
        self.missing, self.unexpected, self.mismatched = missing, unexpected, mismatched
        lines = [f"cannot load {what}:"]
        for title, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", mismatched)):
            if items:
                lines.append(f"  {title} ({len(items)}): " + ", ".join(items[:50]) + (" ..." if len(items) > 50 else ""))
        lines.append("  (is this a Qwen-Image transformer of the same config? `trueflow init-checkpoint` writes one)")
        super().__init__("\n".join(lines))


def _expected_tensors(model: nn.Module) -> dict[str, tuple[nn.Parameter, slice | None]]:
    """diffusers tensor name -> (engine parameter, row slice of it or None) for every engine parameter."""
    out = {}
    for mod_name, mod in model.named_modules():
        for p_name, param in mod.named_parameters(recurse=False):
            if isinstance(mod, Linear) and mod.packed:
                for i in range(len(mod.splits)):
                    out[f"{diffusers_module_name(mod_name, i)}.{p_name}"] = (param, mod._slot(i))
            else:
                out[f"{diffusers_module_name(mod_name)}.{p_name}"] = (param, None)
    return out


@torch.no_grad()
def load_weights(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy a diffusers-format transformer state dict into the engine model (cast to the model's dtype).
    Checks everything first: on any problem nothing is copied and one error lists all problems."""
    expected = _expected_tensors(model)
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    mismatched = []
    for name in sorted(set(expected) & set(state_dict)):
        param, rows = expected[name]
        want = tuple(param[rows].shape) if rows is not None else tuple(param.shape)
        if tuple(state_dict[name].shape) != want:
            mismatched.append(f"{name} {tuple(state_dict[name].shape)} != {want}")
    if missing or unexpected or mismatched:
        raise WeightLoadError(missing, unexpected, mismatched)
    for mod in model.modules():
        if isinstance(mod, Linear):
            mod.clear_lora()  # a full-weight update replaces the base weights; adapters do not carry over
    for name, (param, rows) in expected.items():
        (param[rows] if rows is not None else param).copy_(state_dict[name])


def parse_peft_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """PEFT/diffusers LoRA tensors -> {diffusers module name: (A, B)}. Accepts the prefixes PEFT and diffusers
    write (`base_model.model.`, `transformer.`) and PEFT's `.default` adapter infix."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    bad = []
    for key, t in state_dict.items():
        m = re.match(r"^(?:base_model\.model\.|transformer\.)?(.+)\.lora_([AB])(?:\.default)?\.weight$", key)
        if not m:
            bad.append(key)
            continue
        pairs.setdefault(m.group(1), {})[m.group(2)] = t
    incomplete = sorted(k for k, v in pairs.items() if set(v) != {"A", "B"})
    if bad or incomplete:
        raise WeightLoadError([f"{k}.lora_[AB].weight" for k in incomplete], bad, [], what="LoRA")
    return {k: (v["A"], v["B"]) for k, v in pairs.items()}


@torch.no_grad()
def set_lora(model: nn.Module, lora: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float, merge: bool) -> None:
    """Install a LoRA (diffusers module name -> (A, B)) on the engine, replacing any previous one. Validated
    first, applied only if valid, so a bad update leaves the previous weights in place."""
    modules = dict(model.named_modules())
    unexpected, mismatched = [], []
    per_layer: dict[str, list] = {}
    for name, (A, B) in lora.items():
        engine_name, slot = map_module_name(name)
        layer = modules.get(engine_name)
        if not isinstance(layer, Linear):
            unexpected.append(name)
            continue
        slot = slot or 0
        out_rows = layer.splits[slot]
        if A.ndim != 2 or B.ndim != 2 or A.shape[1] != layer.in_features or B.shape[0] != out_rows or A.shape[0] != B.shape[1]:
            mismatched.append(f"{name}: A {tuple(A.shape)}, B {tuple(B.shape)} for a {layer.in_features}->{out_rows} layer")
            continue
        per_layer.setdefault(engine_name, [None] * len(layer.splits))[slot] = (A, B)
    if unexpected or mismatched:
        raise WeightLoadError([], unexpected, mismatched, what="LoRA")
    for name, mod in modules.items():
        if isinstance(mod, Linear):
            slots = per_layer.get(name)
            if slots is None:
                mod.clear_lora()
                continue
            dtype = mod.weight.dtype
            mod.set_lora([None if s is None else LoraAdapter(s[0].to(mod.weight.device, dtype, copy=True),
                                                             s[1].to(mod.weight.device, dtype, copy=True), scale)
                          for s in slots], merge=merge)
