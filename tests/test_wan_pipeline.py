"""The wan family's pipeline pieces against `WanPipeline` / `WanImageToVideoPipeline` themselves (diffusers 0.42.1), bit
for bit, on the tiny checkpoints of both layouts: the oracle is always what the pipeline computed (its latents after
each step, its transformer calls recorded with hooks, its decoded frames), never this package's own code.

The pipelines run with the RL schedule's scheduler, `FlowMatchEulerDiscreteScheduler(shift=<the checkpoint's
flow_shift>)` (schedule.py says why not UniPC): then the engine's ODE rollout under the `wan` group is the pipeline's
own loop, CFG lines (`uncond + g·(cond − uncond)`), expert switch (`t >= boundary_ratio · 1000`) and per-expert scale
included."""

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanPipeline
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from diffusers.utils import load_image
from PIL import Image

from conftest import BF16, assert_bitwise, assert_differs
from trueflow.engine.engine import Engine
from trueflow.engine.request import RolloutRequest
from trueflow.engine.sampling_params import SamplingParams
from trueflow.models.wan.latents import latent_grid, noise_shape, pack_latents, unpack_latents
from trueflow.models.wan.prompts import encode_prompts, load_text
from trueflow.models.wan.schedule import wan_schedule
from trueflow.models.wan.scheduler_config import WAN_A14B_SCHEDULER_CONFIG, WAN_TI2V_SCHEDULER_CONFIG
from trueflow.models.wan.train import train_forward
from trueflow.models.wan.vae import VideoDecoder

TEXT_LEN, STEPS, FRAMES = 16, 2, 5  # 2 steps at shift 3.0: t = 1000 (transformer), 9 (transformer_2)
SIZES = {"a14b": 32, "ti2v": 64}  # one 2x2-patch token = 16 px (A14B) / 32 px (TI2V-5B)


def _pipeline(cls, checkpoint):
    pipe = cls.from_pretrained(checkpoint, dtype=BF16)
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=pipe.scheduler.config.flow_shift)
    pipe.set_progress_bar_config(disable=True)
    calls = []

    def pre(model, _args, kwargs):
        calls.append({"model": model, **{k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items()}})

    def post(_model, _args, _kwargs, out):
        calls[-1]["output"] = out[0].clone()

    for model in (pipe.transformer, pipe.transformer_2):
        if model is not None:
            model.register_forward_pre_hook(pre, with_kwargs=True)
            model.register_forward_hook(post, with_kwargs=True)
    return pipe, calls


def _rollout(checkpoint, size: int, **params):
    engine = Engine(checkpoint, "wan")  # the negative prompt: the family's default, the pipeline's
    p = SamplingParams(steps=STEPS, sampler="ode", cfg_scale=4.0, height=size, width=size, num_frames=FRAMES,
                       max_sequence_length=TEXT_LEN, **params)
    return engine, engine.rollout(RolloutRequest(["a red apple"], 2, p, seed=0))


def test_the_rollout_is_the_pipelines(wan_a14b_checkpoint):
    """The engine's ODE rollout (`wan` group) on the A14B and WanPipeline, from the same initial noise: the latents
    after every step and the decoded frames are the same bits; each transformer call of the pipeline is the recorded
    expert's (the boundary falls inside the rollout), at the recorded timestep, with the recorded embeddings, and
    `train_forward` reproduces its output. (The TI2V-5B's per-token timesteps: the image-to-video test below.)"""
    layout, checkpoint = "a14b", wan_a14b_checkpoint
    size = SIZES[layout]
    scale_2 = {"cfg_scale_2": 3.0}
    _, rollout = _rollout(checkpoint, size, **scale_2)
    mg = rollout.microgroups[0]
    pipe, calls = _pipeline(WanPipeline, checkpoint)
    stepped = []
    out = pipe(prompt="a red apple", height=size, width=size, num_frames=FRAMES,
               num_inference_steps=STEPS, guidance_scale=4.0, guidance_scale_2=scale_2.get("cfg_scale_2"),
               num_videos_per_prompt=2, latents=unpack_latents(mg.latents[0], mg.grid), max_sequence_length=TEXT_LEN,
               output_type="np", callback_on_step_end=lambda p, i, t, kw: stepped.append(kw["latents"]) or {})
    for i in range(STEPS):  # the scheduler's step returns the model output's dtype (bf16); the record holds fp32
        assert_bitwise(pack_latents(stepped[i]).float(), mg.latents[i + 1], f"latents after step {i}")
    assert_bitwise(rollout.images, torch.from_numpy((out.frames * 255).round().astype(np.uint8)), "frames")
    assert len(calls) == 2 * STEPS  # CFG: the positive call, then the negative
    experts = {"transformer": pipe.transformer, "transformer_2": pipe.transformer_2}
    assert mg.experts == ["transformer" if t >= 875 else "transformer_2" for t in mg.timesteps.tolist()]
    assert set(mg.experts) == {"transformer", "transformer_2"}  # the boundary falls inside the rollout
    for k, call in enumerate(list(calls)):  # (train_forward below calls the hooked models again)
        i, branch = divmod(k, 2)
        assert call["model"] is experts[mg.experts[i]], f"step {i}: the pipeline ran another expert"
        assert call["timestep"].dtype == torch.float32
        assert torch.equal(call["timestep"], mg.timesteps[i].expand(2, *mg.timesteps.shape[1:]))
        cond = (mg.cond if branch == 0 else mg.negative_cond)
        assert_bitwise(call["encoder_hidden_states"], cond["encoder_hidden_states"], "prompt embeddings")
        with torch.no_grad():
            ours = train_forward(call["model"], pack_latents(call["hidden_states"]), call["timestep"], mg.grid, cond)
        assert_bitwise(ours, pack_latents(call["output"]), f"train_forward of call {k}")


def test_image_to_video_is_the_i2v_pipelines(wan_ti2v_checkpoint, tmp_path):
    """TI2V-5B's image-to-video: the engine's rollout with `image` against WanImageToVideoPipeline (its
    `expand_timesteps` path) from the same noise and embeddings: the first frame's latents, the per-token timesteps
    (0 on the first frame), every transformer call's output (`train_forward`), the latents after every step and the
    frames (the first frame put back) bit for bit."""
    rng = np.random.default_rng(0)
    image = tmp_path / "first.png"
    Image.fromarray(rng.integers(0, 255, (48, 80, 3), dtype=np.uint8)).save(image)  # resized to the video's size
    _, rollout = _rollout(wan_ti2v_checkpoint, SIZES["ti2v"], image=str(image))
    mg = rollout.microgroups[0]
    first = mg.grid[1] * mg.grid[2]
    assert mg.cond["image_latents"].shape == (2, first, mg.latents.shape[-1])
    assert torch.equal(mg.cond["image_latents"], mg.negative_cond["image_latents"])  # both branches
    pipe, calls = _pipeline(WanImageToVideoPipeline, wan_ti2v_checkpoint)
    stepped = []
    # The embeddings are the recorded ones: WanImageToVideoPipeline's own prompt cleaning calls ftfy, which it does
    # not check is installed (pipeline_wan_i2v.basic_clean); WanPipeline's (the engine's) does.
    out = pipe(image=load_image(str(image)), prompt_embeds=mg.cond["encoder_hidden_states"],
               negative_prompt_embeds=mg.negative_cond["encoder_hidden_states"], height=SIZES["ti2v"],
               width=SIZES["ti2v"], num_frames=FRAMES, num_inference_steps=STEPS, guidance_scale=4.0,
               latents=unpack_latents(mg.latents[0], mg.grid), max_sequence_length=TEXT_LEN, output_type="np",
               callback_on_step_end=lambda p, i, t, kw: stepped.append(kw["latents"]) or {})
    model_input = pack_latents(calls[0]["hidden_states"])
    assert_bitwise(model_input[:, :first].float(), mg.cond["image_latents"].to(BF16).float(), "first frame")
    assert (calls[0]["timestep"][:, :first] == 0).all() and (calls[0]["timestep"][:, first:] == 1000).all()
    for k, call in enumerate(list(calls)):
        cond = mg.cond if k % 2 == 0 else mg.negative_cond
        with torch.no_grad():  # the recorded (unblended) latents in: train_forward blends them as the pipeline does
            ours = train_forward(pipe.transformer, mg.latents[k // 2].to(BF16), mg.timesteps[k // 2].expand(2, -1),
                                 mg.grid, cond)
        assert_bitwise(ours, pack_latents(call["output"]), f"train_forward of call {k}")
    for i in range(STEPS):
        assert_bitwise(pack_latents(stepped[i]).float(), mg.latents[i + 1], f"latents after step {i}")
    assert_bitwise(rollout.images, torch.from_numpy((out.frames * 255).round().astype(np.uint8)), "frames")
    # the failing side: the stepped latents decoded as they are (the image not put back) are another video
    plain = VideoDecoder(wan_ti2v_checkpoint, "cpu", BF16).decode(mg.latents[-1], SIZES["ti2v"], SIZES["ti2v"],
                                                                   FRAMES)
    assert_differs(plain, rollout.images, "frames without the image")


def test_prompts_bitwise(wan_a14b_checkpoint):
    pipe = WanPipeline.from_pretrained(wan_a14b_checkpoint, dtype=BF16)
    tokenizer, text = load_text(wan_a14b_checkpoint, "cpu", BF16)
    for prompt in ("a red apple on a wooden table", "  a  &amp; small\tcat  ", ""):
        (ours,) = encode_prompts(tokenizer, text, [prompt], TEXT_LEN)
        with torch.no_grad():  # as __call__ runs it
            expected = pipe.encode_prompt(prompt, do_classifier_free_guidance=False,
                                          max_sequence_length=TEXT_LEN)[0][0]
        assert_bitwise(ours["encoder_hidden_states"], expected, repr(prompt))
        valid = len(tokenizer(prompt_clean(prompt), max_length=TEXT_LEN, truncation=True).input_ids)
        assert (expected[valid:] == 0).all() and (expected[:valid] != 0).any()  # the pipeline's zero padding
    long = encode_prompts(tokenizer, text, ["word " * 40], TEXT_LEN)[0]["encoder_hidden_states"]
    assert long.shape == (TEXT_LEN, text.config.d_model) and (long != 0).all(dim=-1).all()  # truncated, unpadded


def test_schedule_bitwise():
    for config in (WAN_A14B_SCHEDULER_CONFIG, WAN_TI2V_SCHEDULER_CONFIG):
        sigmas, timesteps = wan_schedule(config, 10, 48)
        scheduler = FlowMatchEulerDiscreteScheduler(shift=config["flow_shift"])
        scheduler.set_timesteps(10)
        assert sigmas.dtype == timesteps.dtype == torch.float32
        assert torch.equal(sigmas, scheduler.sigmas) and torch.equal(timesteps, scheduler.timesteps)
        per_token = wan_schedule(config, 10, 48, per_token=True)[1]
        assert per_token.shape == (10, 48) and torch.equal(per_token, timesteps[:, None].expand(10, 48))
    a14b, ti2v = wan_schedule(WAN_A14B_SCHEDULER_CONFIG, 10, 48)[0], wan_schedule(WAN_TI2V_SCHEDULER_CONFIG, 10, 48)[0]
    assert not torch.equal(a14b, ti2v)  # the shift is the checkpoint's (3.0 / 5.0)
    euler = {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 5.0, "num_train_timesteps": 1000}
    assert torch.equal(wan_schedule(euler, 10, 48)[0], ti2v)
    with pytest.raises(ValueError, match="not in flow mode"):
        wan_schedule({**WAN_A14B_SCHEDULER_CONFIG, "use_flow_sigmas": False}, 10, 48)
    with pytest.raises(ValueError, match="DPMSolverMultistepScheduler"):
        wan_schedule({"_class_name": "DPMSolverMultistepScheduler"}, 10, 48)


def test_latents(wan_a14b_checkpoint):
    """The grid and noise shape as WanPipeline.prepare_latents sizes them, and 4k + 1 frames."""
    pipe = WanPipeline.from_pretrained(wan_a14b_checkpoint)
    config = dict(pipe.transformer.config)
    generator = torch.Generator().manual_seed(3)
    drawn = pipe.prepare_latents(2, 16, 480, 832, 81, torch.float32, "cpu", generator)
    assert drawn.shape == (2, *noise_shape(config, latent_grid(480, 832, 81)))
    assert latent_grid(480, 832, 81) == (21, 30, 52) and latent_grid(480, 832, 81, spatial=16) == (21, 15, 26)
    assert latent_grid(480, 832, 33) == (9, 30, 52) and latent_grid(32, 32, 1) == (1, 2, 2)
    for bad in ((480, 832, 80), (480, 832, 0), (488, 832, 81), (480, 840, 81, 16)):
        with pytest.raises(ValueError, match="4k \\+ 1|multiples of"):
            latent_grid(*bad)
