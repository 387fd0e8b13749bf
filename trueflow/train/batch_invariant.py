"""The train side of the batch-invariant mode: diffusers' attention dispatch gets one more backend,
`trueflow_batch_invariant`, that runs `kernels.batch_invariant.attention` (the engine's `batch_invariant` kernel is
the same function), and the process's GEMMs go through the batch-invariant kernels. diffusers' model code is not
touched: its processors call `dispatch_attention_fn`, which looks the backend up in its registry.

diffusers 0.42.1 (`models/attention_dispatch.py`): `_AttentionBackendRegistry.register(backend)` is the decorator
its own backends use, keyed by an `AttentionBackendName` member; `dispatch_attention_fn` and the models'
`set_attention_backend` accept only names of that enum, so the name is added to it as a member first (Python's Enum
has no public way to extend itself; `_member_map_` and `_value2member_map_` are where `__members__` and a value
lookup find members, which is what aenum's `extend_enum` sets too).
"""

from __future__ import annotations

import torch

from ..kernels import batch_invariant
from ..kernels.batch_invariant import BACKEND


def _backend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
             dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
             return_lse: bool = False, _parallel_config=None) -> torch.Tensor:
    """diffusers' backend signature (q/k/v [B, S, H, D], as its `native` backend takes them)."""
    if dropout_p or is_causal or enable_gqa or return_lse or _parallel_config is not None:
        raise ValueError("the trueflow_batch_invariant attention backend takes no dropout, causal mask, GQA, "
                         "log-sum-exp output or context parallelism")
    return batch_invariant.attention(query, key, value, attn_mask, scale)


def register_backend() -> str:
    """Add the backend to diffusers' dispatch (once per process) and turn the mode's GEMMs on; returns its name."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    if BACKEND not in AttentionBackendName._value2member_map_:
        member = str.__new__(AttentionBackendName, BACKEND)
        member._name_, member._value_ = "TRUEFLOW_BATCH_INVARIANT", BACKEND
        AttentionBackendName._member_map_[member._name_] = member
        AttentionBackendName._value2member_map_[BACKEND] = member
        AttentionBackendName._member_names_.append(member._name_)
        _AttentionBackendRegistry.register(member)(_backend)
    batch_invariant.enable()
    return BACKEND
