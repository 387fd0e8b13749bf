"""The optimizer of a run (`--optimizer`): torch's AdamW, or AdamW with its two moments stored in bf16.

`adamw` is `torch.optim.AdamW` (fp32 moments: 8 bytes per trained parameter). `adamw_bf16` keeps `exp_avg` and
`exp_avg_sq` in bf16 (4 bytes per parameter: for a 20B full fine-tune 80 GB less optimizer state over the ranks)
and does every step's arithmetic in fp32, exactly as torch's single-tensor AdamW orders it, on fp32 copies of the
moments, rounding them back to bf16 after the step. The update it applies therefore differs from AdamW's only
through the rounding of the stored moments: relative 2^-9 each, and a second moment that cannot move by less than
half a bf16 step, so `exp_avg_sq·β2` with β2 = 0.999 rounds back to itself once the gradient is steady (the
second moment then lags: docs/training.md, Full-parameter training). With `moment_dtype=float32` it is
torch's AdamW bit for bit (tests/test_fullft.py), which is what pins its arithmetic.

(torchao's `AdamW8bit`, blockwise 8-bit moments with DTensor support, would halve the state again; it is not
installed here.)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

OPTIMIZERS = ("adamw", "adamw_bf16")


class LeanAdamW(torch.optim.Optimizer):
    """AdamW (Loshchilov & Hutter, arXiv 1711.05101, Algorithm 2, decoupled weight decay) with moments stored in
    `moment_dtype`; works on plain tensors and FSDP2's DTensor shards alike (elementwise ops only)."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, moment_dtype: torch.dtype = torch.bfloat16):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.moment_dtype = moment_dtype

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("LeanAdamW.step takes no closure")
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad, state = p.grad, self.state[p]
                if not state:  # torch's AdamW: a float32 step counter on the CPU, zero moments like the parameter
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.moment_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.moment_dtype)
                state["step"] += 1
                step = state["step"].item()
                if wd != 0:
                    p.mul_(1 - lr * wd)
                # fp32 working copies (the stored tensors themselves when the moments are fp32)
                exp_avg, exp_avg_sq = state["exp_avg"].to(p.dtype), state["exp_avg_sq"].to(p.dtype)
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step_size = lr / (1 - beta1 ** step)
                denom = (exp_avg_sq.sqrt() / (1 - beta2 ** step) ** 0.5).add_(eps)
                p.addcdiv_(exp_avg, denom, value=-step_size)
                if exp_avg is not state["exp_avg"]:
                    state["exp_avg"].copy_(exp_avg)
                    state["exp_avg_sq"].copy_(exp_avg_sq)
        return None


def make_optimizer(params: Sequence[torch.Tensor], name: str, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer `name` (one of OPTIMIZERS) over `params`, AdamW's defaults otherwise."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw_bf16":
        return LeanAdamW(params, lr=lr, weight_decay=weight_decay, moment_dtype=torch.bfloat16)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
