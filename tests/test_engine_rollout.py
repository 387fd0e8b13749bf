"""The rollout engine: prompt encoding, collate, CFG and VAE decode as the pipeline does them; ODE rollouts equal
to diffusers' pipeline bitwise under the patch group; seeds, per-sample noise, log-probs and the record layout."""

from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline
from diffusers.models.attention_dispatch import attention_backend

from conftest import BF16, assert_bitwise, assert_differs, pipeline_timestep, randn
from trueflow.engine.interface import RolloutRequest
from trueflow.collate import collate_text, warn_if_masked
from trueflow.engine.engine import Engine
from trueflow.engine.sampling_params import SamplingParams
from trueflow.engine.samplers import cps_log_prob, sde_log_prob
from trueflow.models.qwen_image.train import model_timestep
from trueflow.loading import read_transformer_state_dict
from trueflow.models.cfg import plain_cfg, rescaled_cfg
from trueflow.models.qwen_image.prompts import PROMPT_TEMPLATE, PROMPT_TEMPLATE_START_IDX, encode_prompts
from trueflow.train.batch import assemble
from trueflow.engine.sampling_params import check_family_limits
from trueflow.models import default_family
from trueflow.train.pairs import micro_batches, train_order

PROMPTS = ["a red apple on a wooden table", "a cat", "an old lighthouse on a rocky coast at sunset, waves below"]


@pytest.fixture(scope="module")
def exact(tiny_checkpoint) -> Engine:
    return Engine(tiny_checkpoint, patch_group="qwen_image")


@pytest.fixture(scope="module")
def fast(tiny_checkpoint) -> Engine:
    return Engine(tiny_checkpoint)


@pytest.fixture(scope="module")
def pipe(tiny_checkpoint) -> QwenImagePipeline:
    """diffusers' own pipeline in bf16 (the components the engine does not share are loaded from the folder)."""
    pipe = QwenImagePipeline.from_pretrained(tiny_checkpoint, dtype=BF16)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# -- prompts, collate, CFG, VAE --------------------------------------------------------------------------------
def test_prompt_template_is_the_pipelines(pipe):
    assert (PROMPT_TEMPLATE, PROMPT_TEMPLATE_START_IDX) == (pipe.prompt_template_encode,
                                                          pipe.prompt_template_encode_start_idx)


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["one", "mixed_lengths"])
def test_encode_prompts_is_the_pipelines_bitwise(exact, pipe, prompts):
    for max_len in (512, 5):  # 5 cuts every prompt
        ref_embeds, ref_mask = pipe.encode_prompt(prompts, max_sequence_length=max_len)
        embeds, mask = collate_text(encode_prompts(exact.tokenizer, exact.text_encoder, prompts, max_len))
        assert_bitwise(embeds, ref_embeds, f"embeddings, max length {max_len}")
        if ref_mask is None:
            assert mask is None
        else:
            assert mask is not None and torch.equal(mask, ref_mask.bool())
    assert mask is None and ref_embeds.shape[1] == 5
    if len(prompts) > 1:  # the mixed batch really is masked at 512
        assert pipe.encode_prompt(prompts, max_sequence_length=512)[1] is not None


def test_collate_pads_batch_locally_and_drops_an_all_true_mask():
    a, b = randn((3, 4), 0), randn((5, 4), 1)
    padded, mask = collate_text([a, b])
    assert padded.shape == (2, 5, 4) and padded.dtype == BF16  # the batch's longest, not a fixed window
    assert torch.equal(padded[0, :3], a) and (padded[0, 3:] == 0).all() and torch.equal(padded[1], b)
    assert torch.equal(mask, torch.tensor([[True] * 3 + [False] * 2, [True] * 5]))
    same, none = collate_text([a, a])
    assert none is None and torch.equal(same, torch.stack([a, a]))
    # per-sample masks are kept (a recorded microgroup's padding), and all-true ones still collapse
    own = torch.tensor([True, True, False])
    assert torch.equal(collate_text([a, b], [own, None])[1][0], torch.tensor([True, True, False, False, False]))
    assert collate_text([a, a], [torch.ones(3, dtype=torch.bool), None])[1] is None
    with pytest.raises(ValueError):
        collate_text([])


def test_warn_if_masked_only_in_parity_mode_with_a_mask():
    mask = collate_text([randn((3, 4), 0), randn((5, 4), 1)])[1]
    with pytest.warns(UserWarning, match="mixed prompt lengths in one batch.*not bitwise"):
        warn_if_masked(mask, parity=True, cause="mixed prompt lengths in one batch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_masked(mask, parity=False, cause="x")
        warn_if_masked(None, parity=True, cause="x")


def test_rescaled_cfg_is_the_qwen_image_pipelines_arithmetic_bitwise():
    noise_pred, neg_noise_pred = randn((2, 16, 64), 0, std=2), randn((2, 16, 64), 1, std=2)
    for true_cfg_scale in (4.0, 1.5):
        # QwenImagePipeline.__call__'s lines, with the clamp
        comb_pred = neg_noise_pred + true_cfg_scale * (noise_pred - neg_noise_pred)
        cond_norm = torch.norm(noise_pred, dim=-1, keepdim=True)
        noise_norm = torch.norm(comb_pred, dim=-1, keepdim=True)
        ref = comb_pred * (cond_norm / noise_norm.clamp_min(1e-12))
        assert_bitwise(rescaled_cfg(noise_pred, neg_noise_pred, true_cfg_scale), ref, f"scale {true_cfg_scale}")
    # the failing side: the algebraically equal s·pos + (1−s)·neg rounds differently
    s = 4.0
    other = s * noise_pred + (1 - s) * neg_noise_pred
    other = other * (torch.norm(noise_pred, dim=-1, keepdim=True) / torch.norm(other, dim=-1, keepdim=True))
    assert_differs(other, rescaled_cfg(noise_pred, neg_noise_pred, s))
    zero = torch.zeros(1, 2, 8, dtype=BF16)  # pos == neg == 0: the clamp gives 0, not NaN
    assert torch.equal(rescaled_cfg(zero, zero, 4.0), zero)


def test_plain_cfg_is_the_sd3_wan_and_flux_pipelines_arithmetic_bitwise():
    noise_pred_text, noise_pred_uncond = randn((2, 16, 64), 2, std=2), randn((2, 16, 64), 3, std=2)
    for guidance_scale in (4.5, 1.5):
        # StableDiffusion3Pipeline.__call__ (WanPipeline's and FluxPipeline's true CFG are the same line)
        ref = noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)
        assert_bitwise(plain_cfg(noise_pred_text, noise_pred_uncond, guidance_scale), ref, f"scale {guidance_scale}")
        # the failing side: the branches swapped, and the algebraically equal s·pos + (1−s)·neg
        assert_differs(plain_cfg(noise_pred_uncond, noise_pred_text, guidance_scale), ref)
        assert_differs(guidance_scale * noise_pred_text + (1 - guidance_scale) * noise_pred_uncond, ref)


def test_vae_decode_is_the_pipelines(exact, pipe):
    latents = randn((2, 16, 64), 3)
    common = dict(prompt_embeds=randn((2, 7, 48), 4), height=64, width=64, num_inference_steps=2, true_cfg_scale=1.0)
    final = pipe(latents=latents, output_type="latent", **common).images
    images = pipe(latents=latents, output_type="pil", **common).images
    assert_bitwise(exact.vae.decode(final, 64, 64), torch.from_numpy(np.stack([np.asarray(i) for i in images])))


# -- the denoise loop against diffusers' pipeline --------------------------------------------------------------
def _pipeline_final_latents(pipe, mg, steps: int, cfg_scale: float) -> torch.Tensor:
    neg = mg.negative_cond
    negative = dict(negative_prompt_embeds=neg["encoder_hidden_states"],
                    negative_prompt_embeds_mask=neg["encoder_hidden_states_mask"]) if cfg_scale > 1 else {}
    with attention_backend("_native_flash"):
        return pipe(prompt_embeds=mg.cond["encoder_hidden_states"],
                    prompt_embeds_mask=mg.cond["encoder_hidden_states_mask"], latents=mg.latents[0],
                    height=64, width=64, num_inference_steps=steps, true_cfg_scale=cfg_scale, output_type="latent",
                    **negative).images


@pytest.mark.parametrize("cfg_scale", [1.0, 4.0])
def test_ode_rollout_is_the_pipeline_bitwise_under_the_patch_group(exact, fast, pipe, cfg_scale):
    params = SamplingParams(steps=6, sampler="ode", cfg_scale=cfg_scale)
    mg = exact.rollout(RolloutRequest(PROMPTS[:1], 2, params, seed=3, decode=False)).microgroups[0]
    assert (mg.negative_cond is not None) == (cfg_scale > 1)
    assert_bitwise(mg.latents[-1], _pipeline_final_latents(pipe, mg, 6, cfg_scale), "final latents")
    # the failing side: the engine's fast numerics, from the same embeddings and noise
    fast_mg = fast.rollout(RolloutRequest(PROMPTS[:1], 2, params, seed=3, decode=False)).microgroups[0]
    assert_bitwise(fast_mg.latents[0], mg.latents[0], "initial noise")
    assert_bitwise(fast_mg.cond["encoder_hidden_states"], mg.cond["encoder_hidden_states"], "prompt embeddings")
    assert_differs(fast_mg.latents[-1], _pipeline_final_latents(pipe, fast_mg, 6, cfg_scale), "patch group none")


# -- seeds, noise, log-probs -----------------------------------------------------------------------------------
SDE = SamplingParams(steps=4, sampler="sde", noise_level=0.9, num_sde_steps=2, rollout_microgroup_size=2)


def test_same_seed_same_rollout_bitwise(fast):
    a, b = (fast.rollout(RolloutRequest(PROMPTS[:2], 2, SDE, seed=5, decode=False)) for _ in range(2))
    other = fast.rollout(RolloutRequest(PROMPTS[:2], 2, SDE, seed=6, decode=False))
    for x, y, z in zip(a.microgroups, b.microgroups, other.microgroups, strict=True):
        assert x.sde_steps == y.sde_steps
        for name in ("latents", "log_probs", "guided_outputs"):
            assert_bitwise(getattr(x, name), getattr(y, name), name)
        for branch in ("cond", "negative_cond"):
            assert_bitwise(getattr(x, branch)["encoder_hidden_states"], getattr(y, branch)["encoder_hidden_states"],
                           branch)
        assert_differs(x.latents[0], z.latents[0], "another seed")


def test_a_samples_noise_does_not_depend_on_its_batch(fast):
    params = SamplingParams(steps=2, sampler="sde", cfg_scale=1.0)  # every step stochastic: no window draw

    def noise_by_sample(n: int, size: int) -> dict[int, list[torch.Tensor]]:
        run = fast.rollout(RolloutRequest(PROMPTS[:2], n, replace(params, rollout_microgroup_size=size), 9,
                                          decode=False,
                           record_snapshot=True))
        out = {}
        for mg in run.microgroups:
            for row, i in enumerate(mg.sample_indices):
                p, k = divmod(i, n)
                out[(p, k)] = [mg.latents[0, row]] + [r.noise[row] for r in mg.records]
        return out

    runs = [noise_by_sample(1, 1), noise_by_sample(4, 2), noise_by_sample(4, 4)]
    for key, draws in runs[0].items():
        for run in runs[1:]:
            for a, b in zip(draws, run[key], strict=True):
                assert_bitwise(a, b, f"sample {key}")
    assert_differs(runs[1][(0, 0)][0], runs[1][(0, 1)][0], "two samples")


@pytest.mark.parametrize("sampler", ["sde", "cps"])
def test_log_probs_equal_rescoring_the_recorded_transitions(fast, sampler):
    params = replace(SDE, sampler=sampler)
    rollout = fast.rollout(RolloutRequest(PROMPTS[:1], 2, params, seed=1, decode=False))
    steps = 0
    for b in _train_batches(rollout):
        if sampler == "sde":
            log_prob = sde_log_prob(b.next_latents, b.latents, b.engine_guided, b.sigma, b.sigma_next, b.sigma_1,
                                    params.noise_level)[0]
        else:
            log_prob = cps_log_prob(b.next_latents, b.latents, b.engine_guided, b.sigma, b.sigma_next,
                                    params.noise_level)[0]
        assert_bitwise(log_prob, b.old_log_prob, f"rows {b.rows}")
        steps += 1
    assert steps == len(rollout.microgroups) * 2


def _train_batches(rollout):
    """The trainer's own micro-batches of a rollout (one microgroup at one SDE step, as the aligned settings cut)."""
    sizes = [len(mg.sample_indices) for mg in rollout.microgroups]
    slots = len(rollout.microgroups[0].sde_steps)
    advantages = torch.zeros(sum(sizes))
    return [assemble(rollout, rows, advantages, torch.device("cpu"), default_family())
            for rows in micro_batches(train_order(sizes, "contiguous"), slots, sizes[0], 1)]


# -- the record ------------------------------------------------------------------------------------------------
def test_rollout_layout(fast, tiny_checkpoint):
    rollout = fast.rollout(RolloutRequest(PROMPTS[:2], 4, SDE, seed=2))
    assert rollout.images.shape == (8, 64, 64, 3) and rollout.images.dtype == torch.uint8
    assert [(mg.prompt_index, mg.sample_indices) for mg in rollout.microgroups] == \
        [(0, [0, 1]), (0, [2, 3]), (1, [4, 5]), (1, [6, 7])]
    mg = rollout.microgroups[0]
    assert mg.latents.shape == (5, 2, 16, 64) and mg.latents.dtype == BF16
    assert mg.sigmas.shape == (5,) and mg.timesteps.shape == (4,) and mg.log_probs.shape == (4, 2)
    assert mg.grid == (4, 4) and mg.cond["encoder_hidden_states_mask"] is None
    assert mg.negative_cond["encoder_hidden_states_mask"] is None
    assert len(mg.sde_steps) == 2 and mg.guided_outputs.shape == (2, 2, 16, 64)
    assert all((mg.log_probs[t] == 0).all() for t in range(4) if t not in mg.sde_steps)
    assert all((mg.log_probs[t] != 0).all() for t in mg.sde_steps)
    assert rollout.engine["patch_group"] == "none" and rollout.engine["checkpoint"] == str(tiny_checkpoint)
    b = _train_batches(rollout)[0]
    step = mg.sde_steps[b.rows[0].slot]
    assert [r.sample for r in b.rows] == [0, 1]
    assert_bitwise(b.timestep, pipeline_timestep(mg.timesteps[step], BF16).expand(2), "diffusers' timestep")
    assert torch.equal(b.timestep, model_timestep(mg.timesteps[step], BF16).expand(2))
    ode = fast.rollout(RolloutRequest(PROMPTS[:1], 1, SamplingParams(steps=2, sampler="ode"), seed=2, decode=False))
    assert ode.images is None and ode.microgroups[0].sde_steps == [] and not ode.microgroups[0].guided_outputs.numel()


@pytest.mark.parametrize("kwargs,match", [
    ({"sampler": "euler"}, "unknown sampler"),
    ({"noise_level": 0.0}, "noise_level > 0"),
    ({"cfg_scale": 0.5}, "cfg_scale"),
    ({"sampler": "ode", "num_sde_steps": 2}, "stochastic sampler"),
    ({"num_sde_steps": 11}, "num_sde_steps"),
    ({"sde_window": (0, 4)}, "needs num_sde_steps"),
    ({"num_sde_steps": 3, "sde_window": (2, 4)}, "sde_window"),
    ({"rollout_microgroup_size": 0}, "rollout_microgroup_size"),
    ({"num_frames": 0}, "num_frames must be >= 1"),
])
def test_sampling_params_refuse_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"height": 72}, "multiple of 16"),
    ({"max_sequence_length": 2000}, "max_sequence_length"),
    ({"num_frames": 9}, "Qwen-Image makes images: num_frames must be 1"),
])
def test_the_engine_refuses_what_its_family_cannot_make(fast, kwargs, match):
    """Rules of one family are checked against the engine's family (a `SamplingParams` carries none)."""
    params = SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=match):
        check_family_limits(params, default_family())
    with pytest.raises(ValueError, match=match):
        fast.rollout(RolloutRequest(["x"], 1, params, seed=0))


def test_rollout_refuses_a_microgroup_that_does_not_divide_the_group(fast):
    with pytest.raises(ValueError, match="multiple of rollout_microgroup_size"):
        fast.rollout(RolloutRequest(["x"], 3, SamplingParams(rollout_microgroup_size=2), seed=0))


def test_weights_checksum_tracks_weights_and_lora(tiny_checkpoint, fast):
    engine = Engine(tiny_checkpoint, patch_group="qwen_image")
    base = engine.weights_checksum()
    assert base == engine.weights_checksum() == fast.weights_checksum()  # patches change no weight
    lora = {"transformer_blocks.0.attn.to_q.lora_A.weight": randn((4, 64), 0, std=0.1),
            "transformer_blocks.0.attn.to_q.lora_B.weight": randn((64, 4), 1, std=0.1)}
    engine.update_weights(lora, lora_scale=1.0)
    with_lora = engine.weights_checksum()
    assert with_lora != base
    engine.update_weights(lora, lora_scale=0.5)
    assert engine.weights_checksum() not in (base, with_lora)
    state = read_transformer_state_dict(tiny_checkpoint)
    engine.update_weights(state)  # drops the LoRA
    assert engine.weights_checksum() == base
    state["proj_out.bias"][0] += 1
    engine.update_weights(state)
    assert engine.weights_checksum() != base


def test_scheduler_config_is_the_checkpoints(fast, tiny_checkpoint):
    assert FlowMatchEulerDiscreteScheduler.from_config(fast.scheduler_config).config == \
        FlowMatchEulerDiscreteScheduler.from_pretrained(tiny_checkpoint, subfolder="scheduler").config
