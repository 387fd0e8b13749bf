"""The train-side reference model: the model family's diffusers transformer (`family.train`), LoRA through PEFT.

Precision contract (docs/precision.md): fp32 master weights (LoRA included) that the optimizer
updates, and bf16 *compute copies* that run the forward without autocast. The rollout engine receives exactly
the compute copies' values.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self

import torch
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from ..collate import Cond, cond_mask
from ..kernels.batch_invariant import BACKEND as BATCH_INVARIANT
from ..models.spec import ModelFamily

if TYPE_CHECKING:
    from diffusers.configuration_utils import ConfigMixin
    from diffusers.loaders.peft import PeftAdapterMixin
    from diffusers.models.modeling_utils import ModelMixin

    # diffusers' ModelMixin and ConfigMixin type `config_name` differently (str, None); its own classes combine them
    class DiffusersTransformer(ModelMixin, ConfigMixin, PeftAdapterMixin):  # type: ignore[misc]
        """What a family's train-side model is, for the checker: every diffusers transformer class the families
        name (`TrainSide.transformer_class`) derives from these three."""

        # ModelMixin.to is `@wraps(nn.Module.to)`, which typeshed types as an unbound function (the model first)
        def to(self, *args: Any, **kwargs: Any) -> Self: ...  # type: ignore[override]


@dataclass
class LoraSpec:
    rank: int
    target_modules: tuple[str, ...]  # PEFT's; the family's `train.lora_targets` by default
    alpha: float | None = None  # default: alpha = rank (scale 1)
    init: str | bool = True  # PEFT's init_lora_weights: B = 0 (True), "gaussian", ...
    extra: dict = field(default_factory=dict)

    @property
    def scale(self) -> float:
        return (self.alpha if self.alpha is not None else self.rank) / self.rank

    def peft_config(self) -> LoraConfig:
        # PEFT types lora_alpha as int (a float alpha scales as one) and init_lora_weights as a Literal of its names
        return LoraConfig(r=self.rank, lora_alpha=self.alpha if self.alpha is not None else self.rank,  # type: ignore[arg-type]
                          target_modules=list(self.target_modules), init_lora_weights=self.init,  # type: ignore[arg-type]
                          **self.extra)


def add_lora(model: DiffusersTransformer, spec: LoraSpec, b_init_std: float = 0.0, seed: int = 0) -> None:
    """Attach a PEFT LoRA adapter through diffusers' `add_adapter` (which keeps the model's dtype). PEFT draws A
    from the global RNG, so the attach runs under a forked RNG seeded with `seed`: the same seed, the same
    adapter. With `b_init_std > 0`, B is drawn from a seeded normal so the adapter matters from the start."""
    # Fork only the model's own device: forking every visible GPU would make each torchrun rank create a context
    # on every other rank's GPU.
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
        torch.manual_seed(seed)
        model.add_adapter(spec.peft_config())
    if b_init_std > 0:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in sorted(model.named_parameters()):
                if ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=g) * b_init_std)


def lora_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors in PEFT's format (`...to_q.lora_A.weight`), as the engine and diffusers load them."""
    return {k: v.detach() for k, v in get_peft_model_state_dict(model).items()}


def train_forward(
    family: ModelFamily,
    model: DiffusersTransformer,
    hidden_states: torch.Tensor,
    timestep: torch.Tensor,
    grid: tuple[int, ...],
    cond: Cond,
    backend: str | None = None,
    **static,
) -> torch.Tensor:
    """One forward of the family's train call with the attention backend chosen through diffusers' dispatch.
    `timestep` is what the family's pipeline passes the transformer (`family.train.timestep`); `cond` a batch's
    conditioning (`trueflow.collate`). A stream mask under the family's parity backend, where that backend refuses
    masks (it differs from the masked one), falls back to the masked backend, with a warning that the batch is no
    longer bitwise comparable."""
    train = family.train
    backend = backend or train.backend(hidden_states.dtype)
    if backend == BATCH_INVARIANT:  # added to diffusers' dispatch, and this process's GEMMs made batch-invariant
        from .batch_invariant import register_backend

        register_backend()
    masked = cond_mask(cond, family.pipeline.text_streams) is not None
    if masked and backend == train.parity_backend != train.masked_backend:
        warnings.warn(f"train forward got a non-trivial text mask: falling back from `{train.parity_backend}` to the "
                      f"masked `{train.masked_backend}` backend; the kernel differs from the rollout's, so parity is "
                      "not bitwise (parity condition 2, docs/patch-group.md: mixed prompt lengths in one "
                      "micro-batch)", stacklevel=2)
        backend = train.masked_backend
    # Set on the model, not as a context around this call: with gradient checkpointing the blocks run again in
    # backward, after this function returned, and must take the same kernel.
    if getattr(model, "_trueflow_attention_backend", None) != backend:  # diffusers logs on every set
        from diffusers.models.attention_dispatch import attention_backend

        # `set_attention_backend` also makes `backend` diffusers' process-wide default, which every other diffusers
        # module then runs (e.g. LTX-2's text connectors, whose masked attention `_native_flash` refuses): the
        # context puts the default back, and the model's own processors keep `backend`.
        with attention_backend(backend):
            model.set_attention_backend(backend)
        model._trueflow_attention_backend = backend  # type: ignore[assignment]  # torch's stub: Module.__setattr__ takes only Tensor | Module
    return train.forward(model, hidden_states, timestep, grid, cond, **static)


def load_transformer(family: ModelFamily, checkpoint: str, dtype: torch.dtype = torch.float32,
                     subfolder: str = "transformer") -> DiffusersTransformer:
    """The family's diffusers transformer `subfolder` (an expert's pipeline component) from a checkpoint folder:
    fp32 for masters, or cast once to a compute dtype."""
    model_class: type[DiffusersTransformer] = family.train.model_class()
    return model_class.from_pretrained(checkpoint, subfolder=subfolder, dtype=dtype)
