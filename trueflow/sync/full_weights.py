"""Full-weight sync: what a full-parameter run sends its engines, and the checksum both sides compute of it.

The trainer sends the gathered bf16 compute copies of every transformer weight the engine holds, under diffusers'
names (`"<expert>."`-prefixed after the first expert, `models.spec.expert_prefix`), as one state dict. Every engine
answers an update with `weights_checksum` of what it then holds, read back from its own parameters under the same
names (`engine.weights.full_state`: views of its parameters, row slices of a packed q/k/v weight), so the two
checksums are equal exactly when the engine holds the trainer's bits.

The trainer sends them as a `models.weight_map.OwnedWeights`: an engine in its process may keep those tensors as its
parameters instead of copying them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from .checksum import tensors_checksum


def weights_checksum(weights: Mapping[str, torch.Tensor], lora: Mapping[str, torch.Tensor] | None = None,
                     lora_scales: Iterable[float] = ()) -> str:
    """The checksum of an engine's weights: every transformer weight under diffusers' names, any installed LoRA
    under `lora.`-prefixed PEFT names, and the LoRA scales in the hashed text (`sync.checksum.tensors_checksum`).
    A full-weight update holds no LoRA, so the trainer's checksum of what it sent is `weights_checksum(state)`."""
    tensors = dict(weights)
    tensors.update({f"lora.{k}": v for k, v in (lora or {}).items()})
    return tensors_checksum(tensors, extra=f"lora_scales={sorted(lora_scales)}")
