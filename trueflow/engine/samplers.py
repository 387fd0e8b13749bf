"""Samplers of the denoise loop: ODE (Euler), flow-GRPO SDE and CPS steps, their log-probs, the SDE
window and per-sample noise.

The rollout engine steps with these functions and the trainer re-scores recorded transitions with
them: one implementation on both sides is part of the parity guarantee, so everything here is a pure,
deterministic function, and the step functions have no data-dependent control flow (no host syncs;
CUDA-graph friendly).

Conventions (shared by every function):
- `x` is the latent at noise level `sigma` (sigmas run from 1.0 = pure noise down to 0.0), `v` the
  model's (guided) velocity prediction; both `[B, ...]`, usually bf16.
- `sigma`, `sigma_next`, `sigma_1` are a python float, a 0-dim tensor or a per-sample `[B]` tensor;
  they are made fp32 on the latent's device and a `[B]` tensor is viewed as `[B, 1, ..., 1]`. A python
  float is rounded to fp32, so pass values read from the fp32 schedule (the family's `pipeline.schedule`).
- `sigma_next < sigma` is the caller's contract (not checked: a check would sync the device).
- Stochastic steps compute in fp32, round the new latent once to the stored dtype, and score *the
  stored bits*: the trainer only ever sees what was stored, so a log-prob of the unrounded fp32
  sample could never be reproduced by re-scoring.
- `std` in results is the transition's standard deviation (`x_next ~ N(mean, std²)` per element),
  `[B]` for per-sample sigmas, else 0-dim. NB: flow-GRPO returns, and its KL divides by, the SDE's
  diffusion coefficient `std_t` without the `sqrt(|dt|)` factor.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

Sigma = float | torch.Tensor

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


class SDEStepResult(NamedTuple):
    """One stochastic (SDE or CPS) step."""

    x_next: torch.Tensor  # the new latent as stored (out_dtype); log_prob scores exactly these bits
    mean: torch.Tensor  # fp32, shape of x
    std: torch.Tensor  # fp32, [B] or 0-dim
    log_prob: torch.Tensor  # fp32 [B], averaged over the non-batch dims


def _as_sigma(s: Sigma, x: torch.Tensor) -> torch.Tensor:
    """`s` as fp32 on `x`'s device, broadcastable against `x`: 0-dim, or `[B]` viewed as `[B, 1, ..., 1]`."""
    t = torch.as_tensor(s, dtype=torch.float32, device=x.device)
    if t.ndim == 0:
        return t
    if t.ndim == 1 and t.shape[0] == x.shape[0]:
        return t.view(-1, *([1] * (x.ndim - 1)))
    raise ValueError(f"a sigma must be a float, a 0-dim or a [B={x.shape[0]}] tensor, got shape {tuple(t.shape)}")


def _per_sample(t: torch.Tensor) -> torch.Tensor:
    """`[B, 1, ..., 1]` -> `[B]`; a 0-dim tensor stays 0-dim."""
    return t.reshape(-1) if t.ndim else t


def _mean_per_sample(t: torch.Tensor) -> torch.Tensor:
    return t.mean(dim=tuple(range(1, t.ndim)))


# ---------------------------------------------------------------------------------------------- ODE


def ode_step(x: torch.Tensor, v: torch.Tensor, sigma: Sigma, sigma_next: Sigma) -> torch.Tensor:
    """Euler step, bitwise as `FlowMatchEulerDiscreteScheduler.step` computes it in `QwenImagePipeline`.

    diffusers upcasts the sample to fp32 and computes `sample + dt * model_output` with `dt` a 0-dim
    fp32 tensor on the model output's device (the pipeline keeps the sigmas there). A 0-dim tensor
    takes no part in type promotion, so `dt * model_output` is a bf16 op: dt is rounded to bf16, the
    product is rounded to bf16, and only then added in fp32 (seen on CPU and CUDA; a python-float dt,
    or a CPU 0-dim dt against a CUDA `v`, would *not* be rounded). We round dt explicitly so a
    per-sample `[B, 1, ...]` dt, which would promote the product to fp32, gives the same bits. The
    result is cast to `v.dtype`, as diffusers casts back to the model output's dtype.
    """
    dt = _as_sigma(sigma_next, v) - _as_sigma(sigma, v)  # fp32 subtraction, as diffusers'
    return (x.float() + dt.to(v.dtype) * v).to(v.dtype)


# ---------------------------------------------------------------------------------------------- SDE


def _sde_mean_std(
    x: torch.Tensor, v: torch.Tensor, sigma: Sigma, sigma_next: Sigma, sigma_1: Sigma, noise_level: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """flow-GRPO's SDE transition `N(mean, std²)`, in fp32, with flow-GRPO's operation order."""
    if noise_level <= 0:
        raise ValueError(f"the SDE needs noise_level > 0 (use ode_step for a deterministic step), got {noise_level}")
    x, v = x.float(), v.float()
    s, s_next, s_1 = _as_sigma(sigma, x), _as_sigma(sigma_next, x), _as_sigma(sigma_1, x)
    dt = s_next - s
    # sigma/(1 - sigma) is infinite at sigma = 1 (the schedule's first step): flow-GRPO puts sigmas[1]
    # in the denominator there, and only there.
    std_t = torch.sqrt(s / (1 - torch.where(s == 1, s_1, s))) * noise_level
    mean = x * (1 + std_t**2 / (2 * s) * dt) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
    return mean, std_t * torch.sqrt(-dt)


def _gaussian_log_prob(x_next_stored: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Per-sample mean over elements of `log N(x_next; mean, std²)`, on the stored bits upcast to fp32."""
    log_prob = -((x_next_stored.float() - mean) ** 2) / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    return _mean_per_sample(log_prob)


def sde_log_prob(
    x_next_stored: torch.Tensor,
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: Sigma,
    sigma_next: Sigma,
    sigma_1: Sigma,
    noise_level: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Re-score a recorded SDE transition `x -> x_next_stored` under velocity `v`.

    `std_t = a·sqrt(σ/(1−σ'))` (σ' = σ, except `sigma_1` = sigmas[1] when σ = 1), `dt = σ_next − σ`,
    `mean = x·(1 + std_t²/(2σ)·dt) + v·(1 + std_t²(1−σ)/(2σ))·dt`, `std = std_t·sqrt(−dt)`;
    log-prob `−(x'−mean)²/(2·std²) − log(std) − log sqrt(2π)`, averaged over the non-batch dims.

    Returns `(log_prob [B], mean, std)`, all fp32.
    """
    mean, std = _sde_mean_std(x, v, sigma, sigma_next, sigma_1, noise_level)
    return _gaussian_log_prob(x_next_stored, mean, std), mean, _per_sample(std)


def sde_step(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: Sigma,
    sigma_next: Sigma,
    sigma_1: Sigma,
    noise_level: float,
    noise: torch.Tensor,
    out_dtype: torch.dtype,
) -> SDEStepResult:
    """flow-GRPO SDE step `x' = mean + std·noise`, stored as `out_dtype`, with its log-prob.

    Shares `sde_log_prob`'s transition and scoring code, so `log_prob` is bitwise what the trainer's
    `sde_log_prob(result.x_next, x, v, ...)` gives on the same inputs.
    """
    mean, std = _sde_mean_std(x, v, sigma, sigma_next, sigma_1, noise_level)
    x_next = (mean + std * noise.float()).to(out_dtype)  # the one rounding: to the stored dtype
    return SDEStepResult(x_next, mean, _per_sample(std), _gaussian_log_prob(x_next, mean, std))


# ---------------------------------------------------------------------------------------------- CPS


def _cps_mean_std(
    x: torch.Tensor, v: torch.Tensor, sigma: Sigma, sigma_next: Sigma, noise_level: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Coefficients-preserving sampling's transition `N(mean, std²)`, in fp32, in flow-GRPO's order."""
    x, v = x.float(), v.float()
    s, s_next = _as_sigma(sigma, x), _as_sigma(sigma_next, x)
    std = s_next * math.sin(noise_level * math.pi / 2)
    x0 = x - s * v  # predicted clean latent
    x1 = x + (1 - s) * v  # predicted noise
    # std <= s_next survives fp32 rounding (rounding is monotonic), so the sqrt never sees a negative.
    mean = x0 * (1 - s_next) + x1 * torch.sqrt(s_next**2 - std**2)
    return mean, std


def _cps_score(x_next_stored: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    # flow-GRPO drops all constants *and* the 1/(2·std²) scale: only the squared error is kept.
    return _mean_per_sample(-((x_next_stored.float() - mean) ** 2))


def cps_log_prob(
    x_next_stored: torch.Tensor, x: torch.Tensor, v: torch.Tensor, sigma: Sigma, sigma_next: Sigma, noise_level: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Re-score a recorded CPS transition `x -> x_next_stored` under velocity `v`.

    `std = σ_next·sin(a·π/2)`, `x̂0 = x − σ·v`, `x̂1 = x + (1−σ)·v`,
    `mean = x̂0·(1−σ_next) + x̂1·sqrt(σ_next² − std²)`; log-prob `−(x'−mean)²` averaged over the
    non-batch dims (flow-GRPO's unnormalised form). At σ_next = 0 the step is deterministic (std = 0).

    Returns `(log_prob [B], mean, std)`, all fp32.
    """
    mean, std = _cps_mean_std(x, v, sigma, sigma_next, noise_level)
    return _cps_score(x_next_stored, mean), mean, _per_sample(std)


def cps_step(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: Sigma,
    sigma_next: Sigma,
    noise_level: float,
    noise: torch.Tensor,
    out_dtype: torch.dtype,
) -> SDEStepResult:
    """CPS step `x' = mean + std·noise`, stored as `out_dtype`, with its (unnormalised) log-prob.

    Shares `cps_log_prob`'s code, so `log_prob` is bitwise what re-scoring the stored `x_next` gives.
    """
    mean, std = _cps_mean_std(x, v, sigma, sigma_next, noise_level)
    x_next = (mean + std * noise.float()).to(out_dtype)  # the one rounding: to the stored dtype
    return SDEStepResult(x_next, mean, _per_sample(std), _cps_score(x_next, mean))


# ------------------------------------------------------------------------------- window and noise


def draw_sde_window(
    num_steps: int, num_sde_steps: int, window_range: tuple[int, int] | None, generator: torch.Generator
) -> list[int]:
    """Draw flow-GRPO-Fast's SDE window: the step indices that run stochastic (and are trained).

    The window is `num_sde_steps` contiguous steps lying inside `window_range = (lo, hi)`, a half-open
    range of step indices as in flow-GRPO's `sde_window_range`: its start is uniform over
    `lo .. hi - num_sde_steps` (inclusive). The default `(0, num_steps)` lets the start be anything in
    `0 .. num_steps - num_sde_steps`. All other steps run the ODE. One draw from `generator` (a CPU
    generator keeps the draw device-independent); the engine draws once per microgroup (parity
    condition 8, docs/patch-group.md).

    Returns the window's step indices, sorted.
    """
    lo, hi = (0, num_steps) if window_range is None else window_range
    if not 1 <= num_sde_steps <= num_steps:
        raise ValueError(f"num_sde_steps must be in 1..num_steps={num_steps}, got {num_sde_steps}")
    if not 0 <= lo < hi <= num_steps:
        raise ValueError(f"window_range must satisfy 0 <= lo < hi <= num_steps={num_steps}, got {(lo, hi)}")
    if hi - lo < num_sde_steps:
        raise ValueError(f"window_range {(lo, hi)} holds {hi - lo} steps, fewer than num_sde_steps={num_sde_steps}")
    start = lo + int(torch.randint(hi - lo - num_sde_steps + 1, (1,), generator=generator, device=generator.device))
    return list(range(start, start + num_sde_steps))


def sample_noise(
    shape_per_sample: tuple[int, ...] | torch.Size,
    generators: list[torch.Generator],
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """Standard normal noise `[len(generators), *shape_per_sample]`, sample i drawn from `generators[i]`.

    One generator per sample, so a sample's noise depends only on its own generator, not on the batch
    it runs in. Each draw is on the CPU and in `dtype` directly, as diffusers' `randn_tensor` draws
    with a list of CPU generators (so initial latents equal the pipeline's for the same generators;
    note a bf16 draw is not always the fp32 draw rounded), then moved: the same bits on every device.
    """
    if not generators:
        raise ValueError("sample_noise needs one generator per sample, got none")
    if any(g.device.type != "cpu" for g in generators):
        raise ValueError("sample_noise draws on the CPU so noise is device-independent: pass CPU generators")
    draws = [torch.randn(tuple(shape_per_sample), generator=g, dtype=dtype) for g in generators]
    return torch.stack(draws).to(device)
