"""The sd3 family's pipeline and train pieces against `StableDiffusion3Pipeline` itself (diffusers 0.42.1), bit for
bit, on the tiny checkpoint. The oracle is always what the pipeline computed: its `encode_prompt`, its
`prepare_latents`, its scheduler, its transformer calls recorded with hooks, and its own `__call__` end to end (the
batched CFG step), never this package's code."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from diffusers import StableDiffusion3Pipeline
from peft import LoraConfig, get_peft_model_state_dict

from conftest import BF16, assert_bitwise, assert_differs
from trueflow.engine.engine import Engine, derive_seed
from trueflow.engine.request import RolloutRequest
from trueflow.engine.sampling_params import SamplingParams
from trueflow.engine.samplers import sample_noise
from trueflow.models.sd3.latents import latent_grid, noise_shape, pack_latents, unpack_latents
from trueflow.models.sd3.presets import build_transformer, transformer_config
from trueflow.models.sd3.prompts import encode_prompts, load_text
from trueflow.models.sd3.schedule import sd3_schedule
from trueflow.models.sd3.scheduler_config import SD3_SCHEDULER_CONFIG
from trueflow.models.sd3.train import LORA_TARGETS, train_forward, train_timestep
from trueflow.models.sd3.vae import VaeDecoder

PROMPT, NEGATIVE = "a red apple on a wooden table", ""
STEPS, SIZE, TEXT_LEN, SCALE, N, SEED = 2, 64, 16, 4.5, 2, 7
GRID = latent_grid(SIZE, SIZE)


@pytest.fixture(scope="module")
def pipe(sd3_checkpoint) -> StableDiffusion3Pipeline:
    p = StableDiffusion3Pipeline.from_pretrained(sd3_checkpoint, dtype=BF16)
    p.set_progress_bar_config(disable=True)
    return p


def _generators() -> list[torch.Generator]:
    """The engine's generator of each sample of prompt 0 (its noise stream, `Engine.rollout`)."""
    return [torch.Generator().manual_seed(derive_seed(SEED, 0, 0, k)) for k in range(N)]


def run_pipeline(pipe: StableDiffusion3Pipeline):
    """The pipeline's own call on the engine's per-sample generators, recording every transformer call (its keyword
    inputs and output), every guided `noise_pred` it hands its scheduler and the latents the scheduler returns;
    returns those and the decoded images (`output_type="np"`)."""
    calls, guided, stepped = [], [], []
    handles = [pipe.transformer.register_forward_pre_hook(
                   lambda _m, _a, kw: calls.append({k: v.clone() if torch.is_tensor(v) else v for k, v in kw.items()}),
                   with_kwargs=True),
               pipe.transformer.register_forward_hook(
                   lambda _m, _a, _kw, out: calls[-1].__setitem__("output", out[0].clone()), with_kwargs=True)]
    step = pipe.scheduler.step

    def recording_step(model_output, *args, **kwargs):
        guided.append(model_output.clone())
        out = step(model_output, *args, **kwargs)
        stepped.append(out[0].clone())
        return out

    pipe.scheduler.step = recording_step
    try:
        out = pipe(prompt=PROMPT, num_images_per_prompt=N, generator=_generators(),
                   num_inference_steps=STEPS, guidance_scale=SCALE, height=SIZE, width=SIZE,
                   max_sequence_length=TEXT_LEN, output_type="np")
    finally:
        del pipe.scheduler.step
        for h in handles:
            h.remove()
    return calls, guided, stepped[-1], out.images


@pytest.fixture(scope="module")
def recorded(pipe):
    return run_pipeline(pipe)


def _rollout(checkpoint, group: str):
    params = SamplingParams(steps=STEPS, sampler="ode", cfg_scale=SCALE, height=SIZE, width=SIZE,
                            max_sequence_length=TEXT_LEN, rollout_microgroup_size=N)
    engine = Engine(checkpoint, patch_group=group)
    return engine.rollout(RolloutRequest([PROMPT], N, params, SEED, decode=False, record_snapshot=True))


def test_prompts_bitwise(pipe, sd3_checkpoint):
    tokenizers, text = load_text(sd3_checkpoint, "cpu", BF16)
    prompts = ["a red apple on a wooden table", "  a small cat  "]
    # The pipeline's __call__ encodes under no_grad (T5 in bf16 rounds otherwise with autograd recording on the CPU).
    with torch.no_grad():
        pe, ne, pp, npp = pipe.encode_prompt(prompts, None, None, do_classifier_free_guidance=True,
                                             negative_prompt=[NEGATIVE] * 2, max_sequence_length=TEXT_LEN)
        one = pipe.encode_prompt(PROMPT, None, None, do_classifier_free_guidance=False,
                                 max_sequence_length=TEXT_LEN)
    for got, embeds, pooled in ((encode_prompts(tokenizers, text, prompts, TEXT_LEN), pe, pp),
                                (encode_prompts(tokenizers, text, [NEGATIVE] * 2, TEXT_LEN), ne, npp),
                                (encode_prompts(tokenizers, text, [PROMPT], TEXT_LEN), one[0], one[2])):
        assert_bitwise(torch.stack([c["encoder_hidden_states"] for c in got]), embeds, "prompt embeddings")
        assert_bitwise(torch.stack([c["pooled_projections"] for c in got]), pooled, "pooled projections")
    config = transformer_config("tiny")
    assert pe.shape == (2, 77 + TEXT_LEN, config["joint_attention_dim"]) and pp.shape == (2, 32)
    assert (pe[:, :77, 32:] == 0).all() and (pe[:, :77, :32] != 0).any()  # CLIP L + G (16 + 16), zero-padded to T5's
    with pytest.raises(ValueError, match="max_sequence_length must be in 1..512"):
        encode_prompts(tokenizers, text, prompts, 513)


def test_schedule_and_timesteps_bitwise(pipe, recorded):
    calls = recorded[0]
    sigmas, timesteps = sd3_schedule(SD3_SCHEDULER_CONFIG, STEPS, GRID[0] * GRID[1])
    assert sigmas.dtype == timesteps.dtype == torch.float32
    assert_bitwise(sigmas, pipe.scheduler.sigmas, "sigmas")
    assert_bitwise(timesteps, pipe.scheduler.timesteps, "timesteps")
    assert len(calls) == STEPS
    for call, t in zip(calls, timesteps):  # t.expand(2B) of the batched CFG forward, fp32 on the 0..1000 scale
        assert_bitwise(call["timestep"], train_timestep(t.expand(2 * N), BF16), "the transformer's timestep")
    # shift 3.0, no dynamic shifting (FlowMatchEulerDiscreteScheduler.set_timesteps without sigmas): the shifted
    # sigmas linearly spaced from 1 to the scheduler's own (already shifted) minimum, shifted again
    shift = lambda s: 3 * s / (1 + 2 * s)  # noqa: E731
    expected = [shift(s) for s in np.linspace(1.0, shift(1 / 1000), STEPS)] + [0.0]
    assert sigmas.tolist() == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="num_steps must be >= 1"):
        sd3_schedule(SD3_SCHEDULER_CONFIG, 0, 16)


def test_noise_and_packing_are_the_pipelines(pipe):
    config = transformer_config("tiny")
    ours = sample_noise(noise_shape(config, GRID), _generators(), BF16, "cpu")
    theirs = pipe.prepare_latents(N, config["in_channels"], SIZE, SIZE, BF16, "cpu", _generators())
    assert_bitwise(ours, theirs, "initial noise")
    packed = pack_latents(ours)
    assert packed.shape == (N, GRID[0] * GRID[1], 4 * config["in_channels"])
    assert_bitwise(unpack_latents(packed, GRID), ours, "unpack(pack(x))")
    # a token is one 2x2 patch, channels (c, p, q): the conv weight's flattening
    assert torch.equal(packed[0, 1], ours[0, :, 0:2, 2:4].flatten())
    assert latent_grid(512, 768) == (32, 48)
    for bad in ((64, 72, 1), (0, 64, 1), (64, 64, 9)):
        with pytest.raises(ValueError):
            latent_grid(*bad)


def test_the_batched_cfg_step_is_the_pipelines_own_call(sd3_checkpoint, recorded):
    """The engine's rollout (ODE, CFG 4.5, the pipeline's defaults otherwise: the family's negative prompt against
    the pipeline's own) against `StableDiffusion3Pipeline.__call__` on the same generators: each step's ONE
    transformer call of `[negative × B, positive × B]`, each guided `noise_pred`, and the final latents, bit for bit;
    without the patch group they differ."""
    calls, guided, final, _ = recorded
    rollout = _rollout(sd3_checkpoint, "sd3")
    assert rollout.params.negative_prompt == ""  # the engine records the prompt it ran: the pipeline's default
    mg = rollout.microgroups[0]
    assert mg.negative_cond is not None and len(mg.records) == STEPS
    for i, call in enumerate(calls):
        x = unpack_latents(mg.latents[i], GRID)
        assert_bitwise(call["hidden_states"], torch.cat([x] * 2), f"step {i}: torch.cat([latents] * 2)")
        for key in ("encoder_hidden_states", "pooled_projections"):
            assert_bitwise(call[key], torch.cat([mg.negative_cond[key], mg.cond[key]]), f"step {i}: [negative, {key}]")
        uncond, text = (pack_latents(o) for o in call["output"].chunk(2))
        assert_bitwise(mg.records[i].negative_output, uncond, f"step {i}: the negative chunk")
        assert_bitwise(mg.records[i].positive_output, text, f"step {i}: the positive chunk")
        assert_bitwise(mg.records[i].guided_output, pack_latents(guided[i]), f"step {i}: the guided noise_pred")
    assert_bitwise(mg.latents[-1], pack_latents(final), "final latents")
    assert_differs(_rollout(sd3_checkpoint, "none").microgroups[0].latents[-1], pack_latents(final), "the fast engine")


def test_decoder_bitwise(sd3_checkpoint, recorded):
    _, _, final, expected = recorded
    images = VaeDecoder(sd3_checkpoint, "cpu", BF16).decode(pack_latents(final), SIZE, SIZE)
    assert images.shape == (N, SIZE, SIZE, 3) and images.dtype == torch.uint8
    assert len(np.unique(expected)) > 50  # a picture, not a constant
    assert torch.equal(images, torch.from_numpy((expected * 255).round().astype(np.uint8)))  # numpy_to_pil's


def test_train_forward_is_the_pipelines_call(pipe, recorded):
    calls = recorded[0]
    for call in calls:
        cond = {"encoder_hidden_states": call["encoder_hidden_states"],
                "pooled_projections": call["pooled_projections"]}
        with torch.no_grad():
            pred = train_forward(pipe.transformer, pack_latents(call["hidden_states"]), call["timestep"], GRID, cond)
        assert_bitwise(pred, pack_latents(call["output"]), "train_forward")
        assert call.get("joint_attention_kwargs") is None and call.get("skip_layers") is None


def test_lora_targets_are_flow_grpos_and_load_in_the_pipeline(tmp_path, pipe):
    model = build_transformer("tiny", 0, BF16)
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS), init_lora_weights="gaussian"))
    adapted = sorted({n.rsplit(".lora_", 1)[0] for n, _ in model.named_modules() if ".lora_A" in n})
    expected = sorted(f"transformer_blocks.{i}.attn.{m}" for i in range(3) for m in (
        "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out") if
                      not (i == 2 and m == "to_add_out"))  # the context pre-only block has no text output
    assert adapted == expected  # and MMDiT-X's image-only attn2 is left alone, as in flow_grpo
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(generator=torch.Generator().manual_seed(len(name)))
    state = get_peft_model_state_dict(model)
    metadata = json.loads(json.dumps(model.peft_config["default"].to_dict(), default=list))
    StableDiffusion3Pipeline.save_lora_weights(tmp_path, transformer_lora_layers=state,
                                               transformer_lora_adapter_metadata=metadata)
    pipe.load_lora_weights(tmp_path)  # the checkpoint's transformer is build_transformer("tiny", 0)
    try:
        (adapter,) = pipe.transformer.peft_config
        loaded = get_peft_model_state_dict(pipe.transformer, adapter_name=adapter)
        assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(2, GRID[0] * GRID[1], 64, generator=g).to(BF16)
        cond = {"encoder_hidden_states": torch.randn(2, 9, 48, generator=g).to(BF16),
                "pooled_projections": torch.randn(2, 32, generator=g).to(BF16)}
        t = torch.full((2,), 500.0)
        with torch.no_grad():
            ours, theirs = (train_forward(m, x, t, GRID, cond) for m in (model, pipe.transformer))
            model.disable_adapters()
            base = train_forward(model, x, t, GRID, cond)
    finally:
        pipe.unload_lora_weights()
    assert_bitwise(ours, theirs, "LoRA through the pipeline's loader")
    assert_differs(ours, base, "LoRA on vs off")
