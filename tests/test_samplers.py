"""Samplers and schedule: diffusers-exact ODE and schedule, SDE/CPS log-probs against float64, the
step/re-score identity, the SDE window, per-sample noise and determinism."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps
from diffusers.schedulers import FlowMatchEulerDiscreteScheduler
from diffusers.utils.torch_utils import randn_tensor

from trueflow.engine.samplers import (
    cps_log_prob,
    cps_step,
    draw_sde_window,
    ode_step,
    sample_noise,
    sde_log_prob,
    sde_step,
)
from trueflow.models.qwen_image.schedule import QWEN_IMAGE_SCHEDULER_CONFIG, qwen_image_schedule

BF16 = torch.bfloat16
B, SEQ, CH = 4, 256, 64  # packed Qwen-Image latents: [batch, image tokens, 64 channels]
NUM_STEPS = 10


def _pipeline_scheduler(num_steps: int, image_seq_len: int) -> FlowMatchEulerDiscreteScheduler:
    """A scheduler after the calls `QwenImagePipeline.__call__` makes (step 5 and the loop's start)."""
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(QWEN_IMAGE_SCHEDULER_CONFIG)
    sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
    mu = calculate_shift(
        image_seq_len,
        scheduler.config.get("base_image_seq_len", 256),
        scheduler.config.get("max_image_seq_len", 4096),
        scheduler.config.get("base_shift", 0.5),
        scheduler.config.get("max_shift", 1.15),
    )
    retrieve_timesteps(scheduler, num_steps, "cpu", sigmas=sigmas, mu=mu)
    scheduler.set_begin_index(0)
    return scheduler


def _latents(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 (x, v) pairs of realistic size: unit-variance latents, velocities of a few units."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, SEQ, CH, generator=g).to(BF16)
    v = (2 * torch.randn(B, SEQ, CH, generator=g)).to(BF16)
    return x, v


def _noise(seed: int) -> torch.Tensor:
    return sample_noise((SEQ, CH), [torch.Generator().manual_seed(seed + i) for i in range(B)], torch.float32, "cpu")


SIGMAS, _ = qwen_image_schedule(QWEN_IMAGE_SCHEDULER_CONFIG, NUM_STEPS, SEQ)


# ------------------------------------------------------------------------------------------ schedule


@pytest.mark.parametrize("num_steps,image_seq_len", [(2, 256), (10, 1024), (10, 4096), (28, 8192), (50, 3600)])
def test_schedule_is_the_pipelines_bitwise(num_steps: int, image_seq_len: int):
    sigmas, timesteps = qwen_image_schedule(QWEN_IMAGE_SCHEDULER_CONFIG, num_steps, image_seq_len)
    ref = _pipeline_scheduler(num_steps, image_seq_len)
    assert sigmas.dtype == timesteps.dtype == torch.float32
    assert torch.equal(sigmas, ref.sigmas) and torch.equal(timesteps, ref.timesteps)
    assert sigmas.shape == (num_steps + 1,) and timesteps.shape == (num_steps,)
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0 and bool((sigmas[1:] < sigmas[:-1]).all())
    assert torch.equal(timesteps, sigmas[:-1] * 1000)
    # Independently: exponential shift by mu, then stretch so the last sigma is shift_terminal.
    mu = (image_seq_len - 256) * (0.9 - 0.5) / (8192 - 256) + 0.5
    t = np.linspace(1.0, 1 / num_steps, num_steps)
    shifted = math.exp(mu) / (math.exp(mu) + (1 / t - 1))
    stretched = 1 - (1 - shifted) * (1 - 0.02) / (1 - shifted[-1])
    np.testing.assert_allclose(sigmas[:-1].double().numpy(), stretched, rtol=0, atol=3e-7)


def test_schedule_refuses_what_diffusers_makes_nan():
    # one step: linspace gives [1.0], and the shift_terminal stretch divides by 1 - 1.0
    with pytest.raises(ValueError, match="non-finite"):
        qwen_image_schedule(QWEN_IMAGE_SCHEDULER_CONFIG, 1, 256)


# ----------------------------------------------------------------------------------------------- ODE


def test_ode_step_is_diffusers_step_bitwise_and_fp32_dt_v_is_not():
    scheduler = _pipeline_scheduler(NUM_STEPS, SEQ)
    x, _ = _latents(0)
    ref = ours = ours_float = ours_per_sample = x
    fp32_product_differs = False
    for i, t in enumerate(scheduler.timesteps):
        _, v = _latents(100 + i)
        s, s_next = SIGMAS[i], SIGMAS[i + 1]
        # the negative control: the same step with dt·v formed in fp32
        fp32_product = (ref.float() + (s_next - s) * v.float()).to(BF16)
        ref = scheduler.step(v, t, ref, return_dict=False)[0]
        fp32_product_differs |= not torch.equal(fp32_product, ref)
        ours = ode_step(ours, v, s, s_next)
        ours_float = ode_step(ours_float, v, s.item(), s_next.item())
        ours_per_sample = ode_step(ours_per_sample, v, s.expand(B), s_next.expand(B))
        assert ours.dtype == BF16
        assert torch.equal(ours, ref) and torch.equal(ours_float, ref) and torch.equal(ours_per_sample, ref), i
    assert fp32_product_differs


def test_ode_step_per_sample_sigmas_match_single_samples():
    x, v = _latents(1)
    steps = torch.tensor([0, 3, 7, 9])
    batched = ode_step(x, v, SIGMAS[steps], SIGMAS[steps + 1])
    for b, k in enumerate(steps.tolist()):
        assert torch.equal(batched[b : b + 1], ode_step(x[b : b + 1], v[b : b + 1], SIGMAS[k], SIGMAS[k + 1]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ode_step_is_diffusers_step_bitwise_on_cuda():
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(QWEN_IMAGE_SCHEDULER_CONFIG)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.1, NUM_STEPS), mu=0.7, device="cuda")
    scheduler.set_begin_index(0)
    x, _ = _latents(0)
    ref = ours = x.cuda()
    for i, t in enumerate(scheduler.timesteps):
        v = _latents(100 + i)[1].cuda()
        ref = scheduler.step(v, t, ref, return_dict=False)[0]
        ours = ode_step(ours, v, scheduler.sigmas[i], scheduler.sigmas[i + 1])
        assert torch.equal(ours, ref), i


# ---------------------------------------------------------------------------------- SDE and CPS


def _f64_sde_log_prob(x_next, x, v, s, s_next, s_1, a):
    """flow-GRPO's SDE log-prob, written out independently in float64 (s, s_next, s_1: python floats)."""
    x_next, x, v = x_next.double(), x.double(), v.double()
    std_t = a * math.sqrt(s / (1 - (s_1 if s == 1 else s)))
    dt = s_next - s
    mean = x * (1 + std_t**2 / (2 * s) * dt) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
    var = std_t**2 * abs(dt)
    lp = -((x_next - mean) ** 2) / (2 * var) - math.log(math.sqrt(var)) - math.log(math.sqrt(2 * math.pi))
    return lp.mean(dim=(1, 2))


def _f64_cps_log_prob(x_next, x, v, s, s_next, a):
    x_next, x, v = x_next.double(), x.double(), v.double()
    std = s_next * math.sin(a * math.pi / 2)
    mean = (x - s * v) * (1 - s_next) + (x + (1 - s) * v) * math.sqrt(s_next**2 - std**2)
    return (-((x_next - mean) ** 2)).mean(dim=(1, 2))


@pytest.mark.parametrize("noise_level", [0.7, 1.2])
def test_sde_log_prob_matches_float64(noise_level: float):
    s_1 = SIGMAS[1].item()
    for i in range(NUM_STEPS):  # every step: sigma = 1 first, sigma_next = 0 last
        x, v = _latents(i)
        s, s_next = SIGMAS[i].item(), SIGMAS[i + 1].item()
        out = sde_step(x, v, SIGMAS[i], SIGMAS[i + 1], SIGMAS[1], noise_level, _noise(10 * i), BF16)
        assert out.x_next.dtype == BF16 and out.log_prob.shape == (B,) and out.log_prob.dtype == torch.float32
        ref = _f64_sde_log_prob(out.x_next, x, v, s, s_next, s_1, noise_level)
        torch.testing.assert_close(out.log_prob.double(), ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("noise_level", [0.5, 0.7, 1.0])
def test_cps_log_prob_matches_float64(noise_level: float):
    for i in range(NUM_STEPS):
        x, v = _latents(i)
        s, s_next = SIGMAS[i].item(), SIGMAS[i + 1].item()
        out = cps_step(x, v, SIGMAS[i], SIGMAS[i + 1], noise_level, _noise(10 * i), BF16)
        assert out.x_next.dtype == BF16 and out.log_prob.shape == (B,)
        ref = _f64_cps_log_prob(out.x_next, x, v, s, s_next, noise_level)
        torch.testing.assert_close(out.log_prob.double(), ref, rtol=0, atol=1e-6)


def test_log_prob_is_of_the_stored_sample():
    x, v = _latents(2)
    out = sde_step(x, v, SIGMAS[3], SIGMAS[4], SIGMAS[1], 0.7, _noise(2), BF16)
    unrounded = out.mean + out.std * _noise(2)
    assert not torch.equal(sde_log_prob(unrounded, x, v, SIGMAS[3], SIGMAS[4], SIGMAS[1], 0.7)[0], out.log_prob)
    fp32 = sde_step(x, v, SIGMAS[3], SIGMAS[4], SIGMAS[1], 0.7, _noise(2), torch.float32)
    assert torch.equal(fp32.x_next, unrounded)


def test_sde_at_sigma_one_uses_sigma_1_in_the_denominator_only():
    x, v = _latents(3)
    a, s_next = 0.7, SIGMAS[1].item()
    assert SIGMAS[0] == 1.0
    for s_1 in (SIGMAS[1].item(), 0.5):
        _, _, std = sde_log_prob(x, x, v, 1.0, s_next, s_1, a)
        # numerator sigma = 1, denominator 1 - sigma_1: a·sqrt(1/(1 - s_1))·sqrt(1 - sigma_next)
        assert math.isclose(std.item(), a * math.sqrt(1 / (1 - s_1)) * math.sqrt(1 - s_next), rel_tol=1e-6)
    # below sigma = 1, sigma_1 plays no part
    std_a = sde_log_prob(x, x, v, SIGMAS[2], SIGMAS[3], SIGMAS[1], a)[2]
    std_b = sde_log_prob(x, x, v, SIGMAS[2], SIGMAS[3], 0.5, a)[2]
    assert torch.equal(std_a, std_b)


@pytest.mark.parametrize("per_sample", [False, True])
def test_step_log_prob_equals_rescoring_bitwise(per_sample: bool):
    x, v = _latents(4)
    steps = torch.tensor([0, 2, 5, 8]) if per_sample else torch.tensor(5)
    s, s_next = SIGMAS[steps], SIGMAS[steps + 1]
    out = sde_step(x, v, s, s_next, SIGMAS[1], 1.2, _noise(4), BF16)
    log_prob, mean, std = sde_log_prob(out.x_next, x, v, s, s_next, SIGMAS[1], 1.2)
    assert torch.equal(out.log_prob, log_prob) and torch.equal(out.mean, mean) and torch.equal(out.std, std)
    assert std.shape == ((B,) if per_sample else ())
    out = cps_step(x, v, s, s_next, 0.7, _noise(4), BF16)
    log_prob, mean, std = cps_log_prob(out.x_next, x, v, s, s_next, 0.7)
    assert torch.equal(out.log_prob, log_prob) and torch.equal(out.mean, mean) and torch.equal(out.std, std)


def test_per_sample_sigmas_broadcast_per_sample():
    x, v = _latents(5)
    steps = [0, 2, 5, 9]
    t = torch.tensor(steps)
    out = sde_step(x, v, SIGMAS[t], SIGMAS[t + 1], SIGMAS[1], 0.7, _noise(5), BF16)
    for b, k in enumerate(steps):
        one = sde_step(x[b : b + 1], v[b : b + 1], SIGMAS[k], SIGMAS[k + 1], SIGMAS[1], 0.7, _noise(5)[b : b + 1], BF16)
        assert torch.equal(out.x_next[b : b + 1], one.x_next) and torch.equal(out.mean[b : b + 1], one.mean)
        torch.testing.assert_close(out.log_prob[b : b + 1], one.log_prob, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="sigma"):
        sde_step(x, v, SIGMAS[:3], SIGMAS[1:4], SIGMAS[1], 0.7, _noise(5), BF16)
    with pytest.raises(ValueError, match="noise_level"):
        sde_log_prob(x, x, v, SIGMAS[2], SIGMAS[3], SIGMAS[1], 0.0)


def test_same_seeds_same_bits():
    def rollout(seed: int) -> list[torch.Tensor]:
        window = draw_sde_window(NUM_STEPS, 2, None, torch.Generator().manual_seed(seed))
        x = sample_noise((SEQ, CH), [torch.Generator().manual_seed(seed + i) for i in range(B)], BF16, "cpu")
        recorded = [x]
        for i in range(NUM_STEPS):
            v = (x.float() * 0.5 - 1).to(BF16)  # a deterministic stand-in for the model
            if i in window:
                gens = [torch.Generator().manual_seed(seed * 100 + i * 10 + b) for b in range(B)]
                eps = sample_noise((SEQ, CH), gens, torch.float32, "cpu")
                out = sde_step(x, v, SIGMAS[i], SIGMAS[i + 1], SIGMAS[1], 0.7, eps, BF16)
                x = out.x_next
                recorded += [out.log_prob, out.mean]
            else:
                x = ode_step(x, v, SIGMAS[i], SIGMAS[i + 1])
            recorded.append(x)
        return recorded

    first, second, other = rollout(7), rollout(7), rollout(8)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert not torch.equal(first[-1], other[-1])


# ---------------------------------------------------------------------------------- window, noise


def test_sde_window_properties():
    seen = set()
    g = torch.Generator().manual_seed(0)
    for _ in range(400):
        w = draw_sde_window(NUM_STEPS, 3, None, g)
        assert len(w) == 3 and w == sorted(w) and w == list(range(w[0], w[0] + 3))
        assert 0 <= w[0] and w[-1] < NUM_STEPS
        seen.add(w[0])
    assert seen == set(range(NUM_STEPS - 3 + 1))  # every start in 0..num_steps - num_sde_steps is drawn
    starts = {draw_sde_window(NUM_STEPS, 2, (2, 6), g)[0] for _ in range(200)}
    assert starts == {2, 3, 4}  # flow-GRPO's range: the window lies inside [2, 6)
    assert draw_sde_window(NUM_STEPS, NUM_STEPS, None, g) == list(range(NUM_STEPS))
    draws = [draw_sde_window(NUM_STEPS, 2, None, torch.Generator().manual_seed(s)) for s in (5, 5)]
    assert draws[0] == draws[1]


@pytest.mark.parametrize(
    "num_sde_steps,window_range",
    [(0, None), (11, None), (2, (3, 3)), (2, (-1, 5)), (2, (0, 11)), (3, (4, 6)), (1, (6, 4))],
)
def test_sde_window_rejects_impossible_arguments(num_sde_steps, window_range):
    with pytest.raises(ValueError):
        draw_sde_window(NUM_STEPS, num_sde_steps, window_range, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_noise_of_a_sample_does_not_depend_on_its_batch(dtype: torch.dtype):
    shape, seeds = (1, 16, 8, 8), [11, 12, 13, 14]
    batch = sample_noise(shape, [torch.Generator().manual_seed(s) for s in seeds], dtype, "cpu")
    assert batch.shape == (4, *shape) and batch.dtype == dtype
    for i, s in enumerate(seeds):
        assert torch.equal(batch[i : i + 1], sample_noise(shape, [torch.Generator().manual_seed(s)], dtype, "cpu"))
    # the same bits as diffusers' randn_tensor, which prepares the pipeline's initial latents
    ref = randn_tensor((4, *shape), generator=[torch.Generator().manual_seed(s) for s in seeds], dtype=dtype)
    assert torch.equal(batch, ref)
    assert not torch.equal(batch[0], batch[1])
    with pytest.raises(ValueError):
        sample_noise(shape, [], dtype, "cpu")
