"""The ltx2 family's pipeline and train pieces against `LTX2Pipeline` itself (diffusers 0.42.1), bit for bit, on the
tiny checkpoint: the oracle is always what the pipeline computed (recorded with hooks on its transformer), never
this package's own code."""

import json
import re

import numpy as np
import pytest
import torch
from diffusers import LTX2Pipeline
from diffusers.models.attention_dispatch import attention_backend
from peft import LoraConfig, get_peft_model_state_dict

from conftest import LTX2_UNGUIDED
from trueflow.collate import collate_cond
from trueflow.models.ltx2.latents import latent_grid, noise_shape, pack_latents, unpack_latents
from trueflow.models.ltx2.pipeline import euler_step, model_output, probe_inputs
from trueflow.models.ltx2.presets import RECIPE, build_transformer, transformer_config
from trueflow.models.ltx2.prompts import TEXT_STREAMS, encode_prompts, load_text
from trueflow.models.ltx2.schedule import ltx2_schedule
from trueflow.models.ltx2.scheduler_config import LTX2_SCHEDULER_CONFIG
from trueflow.models.ltx2.train import (LORA_TARGET_REGEX, LORA_TARGETS, lora_target_names, train_forward,
                                        train_timestep)
from trueflow.models.ltx2.vae import VideoDecoder

PROMPTS = ["a red apple on a wooden table", "  a small cat  "]
FRAMES, HEIGHT, WIDTH, STEPS, TEXT_LEN = 9, 64, 96, 2, 32


def run_pipeline(ltx2_checkpoint, seed=0, dtype=torch.float32, **overrides):
    """Run LTX2Pipeline in `dtype` and record every transformer call (its keyword inputs and its video output) and
    the latents after each step."""
    pipe = LTX2Pipeline.from_pretrained(ltx2_checkpoint, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    calls, stepped = [], []

    def pre(_mod, _args, kwargs):
        calls.append({k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items()})

    def post(_mod, _args, _kwargs, out):
        calls[-1]["output"] = out[0].clone()

    pipe.transformer.register_forward_pre_hook(pre, with_kwargs=True)
    pipe.transformer.register_forward_hook(post, with_kwargs=True)

    def on_step(_pipe, _i, _t, kw):
        stepped.append(kw["latents"].clone())
        return {}

    args = dict(prompt=PROMPTS, num_frames=FRAMES, height=HEIGHT, width=WIDTH, num_inference_steps=STEPS,
                max_sequence_length=TEXT_LEN, output_type="np", generator=torch.Generator().manual_seed(seed),
                callback_on_step_end=on_step, **LTX2_UNGUIDED)
    args.update(overrides)
    out = pipe(**args)
    return pipe, calls, stepped, out


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def recorded(ltx2_checkpoint, request):
    return (*run_pipeline(ltx2_checkpoint, dtype=request.param), request.param)


def test_prompts_bitwise(ltx2_checkpoint, recorded):
    _, calls, _, _, dtype = recorded
    tokenizer, text = load_text(ltx2_checkpoint, "cpu", dtype)
    conds = encode_prompts(tokenizer, text, PROMPTS, TEXT_LEN)
    batch = collate_cond(conds, TEXT_STREAMS)
    for call in calls:
        assert batch["encoder_hidden_states"].dtype == dtype
        assert torch.equal(batch["encoder_hidden_states"], call["encoder_hidden_states"])
        assert torch.equal(batch["audio_encoder_hidden_states"], call["audio_encoder_hidden_states"])
        # The connectors leave every position valid: the collate drops the mask, the pipeline passes all ones.
        assert batch["encoder_attention_mask"] is None and batch["audio_encoder_attention_mask"] is None
        for key in ("encoder_attention_mask", "audio_encoder_attention_mask"):
            assert call[key].dtype == torch.int64 and bool((call[key] == 1).all())
    with pytest.raises(ValueError, match="multiple of the connectors' 8 learnable registers"):
        encode_prompts(tokenizer, text, PROMPTS, 30)


def test_schedule_and_timesteps_bitwise(recorded):
    pipe, calls, _, _, _ = recorded
    grid = latent_grid(HEIGHT, WIDTH, FRAMES)
    sigmas, timesteps = ltx2_schedule(LTX2_SCHEDULER_CONFIG, STEPS, grid[0] * grid[1] * grid[2])
    assert sigmas.dtype == timesteps.dtype == torch.float32
    assert torch.equal(sigmas, pipe.scheduler.sigmas) and torch.equal(timesteps, pipe.scheduler.timesteps)
    assert len(calls) == STEPS
    for call, t in zip(calls, timesteps):
        # timestep and sigma are the same fp32 schedule timestep (sigma x 1000), one per sample
        assert torch.equal(call["timestep"], train_timestep(t.expand(len(PROMPTS)), torch.bfloat16))
        assert torch.equal(call["sigma"], call["timestep"])
        assert call["timestep"].dtype == torch.float32
        assert (call["num_frames"], call["height"], call["width"]) == grid
        assert call["isolate_modalities"] is False and call["use_cross_timestep"] is True
    # the shift follows the token count: a longer video gets other sigmas
    assert not torch.equal(ltx2_schedule(LTX2_SCHEDULER_CONFIG, STEPS, 4 * grid[0] * grid[1] * grid[2])[0], sigmas)
    with pytest.raises(ValueError, match="at least 2 steps"):
        ltx2_schedule(LTX2_SCHEDULER_CONFIG, 1, 64)


def test_latents_pack_bitwise(ltx2_checkpoint):
    noise = torch.randn(2, 16, 2, 2, 3)
    assert torch.equal(pack_latents(noise), LTX2Pipeline._pack_latents(noise, 1, 1))
    packed = pack_latents(noise)
    assert torch.equal(unpack_latents(packed, (2, 2, 3)), LTX2Pipeline._unpack_latents(packed, 2, 2, 3, 1, 1))
    assert latent_grid(64, 96, 9) == (2, 2, 3) and latent_grid(512, 768, 57) == (8, 16, 24)
    assert noise_shape(transformer_config("tiny"), (2, 2, 3)) == (16, 2, 2, 3)
    for bad in ((64, 96, 8), (60, 96, 9), (64, 100, 9)):
        with pytest.raises(ValueError):
            latent_grid(*bad)


def test_denoising_loop_bitwise(recorded):
    """Schedule + model_output + a plain Euler step reproduce the pipeline's latents, from its own transformer
    outputs, bit for bit at every step."""
    _, calls, stepped, _, dtype = recorded
    grid = latent_grid(HEIGHT, WIDTH, FRAMES)
    sigmas, _ = ltx2_schedule(LTX2_SCHEDULER_CONFIG, STEPS, grid[0] * grid[1] * grid[2])
    cfg = transformer_config("tiny")
    # prepare_latents: one fp32 draw for the batch from the generator, packed
    noise = torch.randn((len(PROMPTS), *noise_shape(cfg, grid)), generator=torch.Generator().manual_seed(0))
    latents = pack_latents(noise)
    changed = 0
    for i, call in enumerate(calls):
        # the model gets the fp32 latents cast to the pipeline's dtype; its output comes back in that dtype
        assert call["hidden_states"].dtype == dtype and torch.equal(call["hidden_states"], latents.to(dtype))
        assert call["output"].dtype == dtype
        velocity = model_output(call["output"], latents, sigmas[i])
        changed += int((velocity != call["output"]).sum())
        latents = euler_step(velocity, latents, sigmas[i], sigmas[i + 1])
        assert latents.dtype == torch.float32 and torch.equal(latents, stepped[i])
    assert changed > 0  # the fp32 round trip is not an identity: skipping it would fail the step check


def test_decoder_bitwise(ltx2_checkpoint, recorded):
    _, _, stepped, out, dtype = recorded
    frames = VideoDecoder(ltx2_checkpoint, "cpu", dtype).decode(stepped[-1], HEIGHT, WIDTH, FRAMES)
    assert frames.shape == (len(PROMPTS), FRAMES, HEIGHT, WIDTH, 3) and frames.dtype == torch.uint8
    expected = torch.from_numpy((out.frames * 255).round().astype(np.uint8))  # numpy_to_pil's conversion
    assert len(np.unique(out.frames)) > 100  # a picture, not a constant
    assert torch.equal(frames, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_train_forward_is_the_pipelines_isolated_pass(ltx2_checkpoint, dtype):
    """With modality guidance on, the pipeline runs the transformer a second time with isolate_modalities=True and
    its real audio stream; train_forward (one placeholder audio token, no masks in cond) gives that very output."""
    pipe, calls, _, _ = run_pipeline(ltx2_checkpoint, dtype=dtype, modality_scale=2.0, audio_modality_scale=2.0)
    isolated = [c for c in calls if c["isolate_modalities"]]
    assert len(isolated) == STEPS and isolated[0]["audio_hidden_states"].shape[1] > 1
    grid = latent_grid(HEIGHT, WIDTH, FRAMES)
    for call in isolated:
        cond = {"encoder_hidden_states": call["encoder_hidden_states"],
                "audio_encoder_hidden_states": call["audio_encoder_hidden_states"],
                "encoder_attention_mask": None, "audio_encoder_attention_mask": None}
        with torch.no_grad():
            pred = train_forward(pipe.transformer, call["hidden_states"], call["timestep"], grid, cond)
        assert torch.equal(pred, call["output"])
        # The call itself (the hooks recorded it last) is the pipeline's but for the audio stream. The mask matters
        # on a GPU only (CPU SDPA gives the same bits with or without a -0.0 bias), so it is compared as passed.
        ours = calls.pop()
        for key, value in call.items():
            if key.startswith("audio_") or key in ("output", "video_coords"):
                continue
            if torch.is_tensor(value):
                assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key
            else:
                assert ours.get(key, value) == value, key
        assert ours["audio_hidden_states"].shape[1] == ours["audio_num_frames"] == 1
    # the main pass (audio mixed into video) differs
    main = [c for c in calls if not c["isolate_modalities"]]
    assert not torch.equal(main[0]["output"], isolated[0]["output"])


def test_isolated_video_ignores_audio():
    model = build_transformer("tiny", 0)
    inputs = probe_inputs(transformer_config("tiny"), 2, 16, 64, torch.float32, 0, "cpu")
    hs, t, grid, cond = inputs["hidden_states"], inputs["timestep"], inputs["grid"], inputs["cond"]
    base = dict(hidden_states=hs, encoder_hidden_states=cond["encoder_hidden_states"],
                audio_encoder_hidden_states=cond["audio_encoder_hidden_states"], timestep=t, sigma=t,
                num_frames=grid[0], height=grid[1], width=grid[2], use_cross_timestep=True, return_dict=False)
    with torch.no_grad():
        ref = train_forward(model, hs, t, grid, cond)
        for audio_len, scale in ((1, 0.0), (5, 1.0), (7, 30.0)):
            audio = torch.randn(2, audio_len, 4, generator=torch.Generator().manual_seed(audio_len)) * scale
            out = model(audio_hidden_states=audio, audio_num_frames=audio_len, isolate_modalities=True, **base)[0]
            assert torch.equal(out, ref)
            joint = model(audio_hidden_states=audio, audio_num_frames=audio_len, isolate_modalities=False, **base)[0]
            assert not torch.equal(joint, ref)  # without isolation the audio reaches the video
        with pytest.raises(RuntimeError):  # zero audio tokens crash the transformer
            model(audio_hidden_states=torch.zeros(2, 0, 4), audio_num_frames=0, isolate_modalities=True, **base)
        # the text mask is always passed, so a mask-refusing backend cannot run the train call. (The context manager
        # restores the process-wide default; `set_attention_backend` would leave it set for every diffusers module.)
        with attention_backend("_native_flash"), pytest.raises(ValueError, match="attn_mask"):
            train_forward(model, hs, t, grid, cond)


EXPECTED_TARGETS = [f"transformer_blocks.{i}.{m}" for i in range(2) for m in (
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k", "attn2.to_v",
    "attn2.to_out.0", "ff.net.0.proj", "ff.net.2")]


def test_lora_targets_video_stream_only(tmp_path, ltx2_checkpoint):
    model = build_transformer("tiny", 0)
    assert lora_target_names(model) == EXPECTED_TARGETS
    assert [n for n, _ in model.named_modules() if re.fullmatch(LORA_TARGET_REGEX, n)] == EXPECTED_TARGETS
    # PEFT's bare suffixes would also adapt the audio stream and both cross-modal attentions
    bare = [n for n, _ in model.named_modules() if n.endswith(".to_q")]
    assert any("audio_to_video_attn" in n for n in bare) and any("audio_attn1" in n for n in bare)
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS), init_lora_weights="gaussian"))
    adapted = sorted({n.rsplit(".lora_", 1)[0] for n, _ in model.named_modules() if ".lora_A" in n})
    assert adapted == sorted(EXPECTED_TARGETS)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(generator=torch.Generator().manual_seed(len(name)))
    state = get_peft_model_state_dict(model)
    # as the trainer writes it: the adapter config as metadata, which load_lora_weights reads for alpha
    metadata = json.loads(json.dumps(model.peft_config["default"].to_dict(), default=list))
    LTX2Pipeline.save_lora_weights(tmp_path, transformer_lora_layers=state, transformer_lora_adapter_metadata=metadata)
    pipe = LTX2Pipeline.from_pretrained(ltx2_checkpoint)  # its transformer is build_transformer("tiny", 0)
    pipe.load_lora_weights(tmp_path)
    (adapter,) = pipe.transformer.peft_config  # load_lora_weights names it
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name=adapter)
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
    inputs = probe_inputs(transformer_config("tiny"), 2, 16, 64, torch.float32, 1, "cpu")
    with torch.no_grad():
        ours = train_forward(model, inputs["hidden_states"], inputs["timestep"], inputs["grid"], inputs["cond"])
        theirs = train_forward(pipe.transformer, inputs["hidden_states"], inputs["timestep"], inputs["grid"],
                               inputs["cond"])
        model.disable_adapters()
        base = train_forward(model, inputs["hidden_states"], inputs["timestep"], inputs["grid"], inputs["cond"])
    assert torch.equal(ours, theirs) and not torch.equal(ours, base)


def test_presets():
    tiny, full = transformer_config("tiny"), transformer_config("full")
    for cfg in (tiny, full):
        assert cfg["gated_attn"] and cfg["audio_gated_attn"] and cfg["cross_attn_mod"] and cfg["audio_cross_attn_mod"]
        assert cfg["rope_type"] == "split" and cfg["rope_double_precision"] and not cfg["use_prompt_embeddings"]
        assert cfg["caption_channels"] == 3840
    assert (full["num_layers"], full["num_attention_heads"] * full["attention_head_dim"],
            full["audio_num_attention_heads"] * full["audio_attention_head_dim"]) == (48, 4096, 2048)
    a, b = build_transformer("tiny", 3), build_transformer("tiny", 3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert RECIPE["sampler"] == "cps" and RECIPE["cfg_scale"] == 1.0
    with pytest.raises(ValueError, match="known sizes"):
        transformer_config("huge")
