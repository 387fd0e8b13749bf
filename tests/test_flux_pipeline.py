"""The flux family's pipeline and train pieces against `FluxPipeline` itself (diffusers 0.42.1), bit for bit, on the
tiny checkpoint: the oracle is always what the pipeline computed (its return value, or its transformer's calls
recorded with hooks), never this package's own code. The denoising steps are the pipeline's own calls: the
distilled-guidance step (no negative branch) and true CFG (a negative prompt and `true_cfg_scale > 1`: a second,
separate call and `neg + s·(pos − neg)`), against the engine's rollout of the same noise."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline
from diffusers.models.attention_dispatch import attention_backend
from peft import LoraConfig, get_peft_model_state_dict

from conftest import BF16, assert_bitwise, assert_differs
from trueflow.collate import collate_cond
from trueflow.engine.engine import Engine, derive_seed
from trueflow.engine.request import RolloutRequest
from trueflow.engine.samplers import sample_noise
from trueflow.engine.weights import load_engine_transformer
from trueflow.engine.sampling_params import SamplingParams
from trueflow.models.flux import weights as W
from trueflow.models.flux.latents import image_ids, latent_grid, noise_shape, pack_latents, unpack_latents
from trueflow.models.flux.prompts import encode_prompts
from trueflow.models.flux.schedule import flux_schedule
from trueflow.models.flux.scheduler_config import FLUX_SCHEDULER_CONFIG
from trueflow.models.flux.train import LORA_TARGETS, model_timestep, train_forward
from trueflow.models.flux.transformer import FluxConfig

PROMPT, NEGATIVE = "a red apple on a wooden table", "blurry"
SIDE, STEPS, TEXT_LEN, N, SEED = 64, 2, 16, 2, 0


@pytest.fixture(scope="module")
def pipe(flux_checkpoint) -> FluxPipeline:
    pipe = FluxPipeline.from_pretrained(flux_checkpoint, dtype=BF16)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _generators() -> list[torch.Generator]:
    """The engine's noise generators of sample k of the rollout's first prompt (`Engine.rollout`), so the pipeline
    draws the very same initial noise (`randn_tensor` with a list: one draw per sample, in the latent dtype)."""
    return [torch.Generator().manual_seed(derive_seed(SEED, 0, 0, k)) for k in range(N)]


def run_pipeline(pipe: FluxPipeline, **kwargs) -> tuple[list[dict], list[torch.Tensor], object]:
    """Run the pipeline (its transformer on `_native_flash`, the pairing of the flux group) and record every
    transformer call (keyword inputs and output) and the latents after each step."""
    calls, stepped = [], []

    def pre(_mod, _args, kw):
        calls.append({k: v.clone() if torch.is_tensor(v) else v for k, v in kw.items()})

    def post(_mod, _args, _kw, out):
        calls[-1]["output"] = out[0].clone()

    def on_step(_pipe, _i, _t, kw):
        stepped.append(kw["latents"].clone())
        return {}

    handles = [pipe.transformer.register_forward_pre_hook(pre, with_kwargs=True),
               pipe.transformer.register_forward_hook(post, with_kwargs=True)]
    try:
        with attention_backend("_native_flash"):
            out = pipe(prompt=PROMPT, height=SIDE, width=SIDE, num_inference_steps=STEPS, max_sequence_length=TEXT_LEN,
                       num_images_per_prompt=N, generator=_generators(), callback_on_step_end=on_step, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return calls, stepped, out


@pytest.fixture(scope="module")
def engine(flux_checkpoint) -> Engine:
    return Engine(flux_checkpoint, "flux")


def engine_rollout(engine: Engine, **params):
    defaults = dict(steps=STEPS, sampler="ode", cfg_scale=1.0, height=SIDE, width=SIDE, max_sequence_length=TEXT_LEN)
    return engine.rollout(RolloutRequest([PROMPT], N, SamplingParams(**(defaults | params)), seed=SEED,
                                         record_snapshot=True))


@pytest.fixture(scope="module")
def distilled(pipe):
    """The pipeline's default guidance: the distilled scale (3.5) as a model input, no negative branch."""
    return run_pipeline(pipe, output_type="latent")


def test_the_distilled_guidance_steps_are_flux_pipelines_own_calls(flux_checkpoint, pipe, engine, distilled):
    """FluxPipeline at its defaults (guidance_scale 3.5, true_cfg_scale 1, no negative prompt; latent output) and the
    engine's ODE rollout of the same noise under the flux group: the same latents after every step, bit for bit; one
    transformer call per step, each the train side's `train_forward` of the recorded inputs. Not bitwise without the
    group, nor at another distilled scale."""
    calls, stepped, out = distilled
    rollout = engine_rollout(engine)
    mg = rollout.microgroups[0]
    assert len(calls) == STEPS and mg.negative_cond is None  # no negative branch
    for i in range(STEPS):
        assert_bitwise(mg.latents[i + 1], stepped[i], f"latents after step {i}")
    assert_bitwise(mg.latents[-1], out.images, "the pipeline's latent output")
    grid = latent_grid(SIDE, SIDE)
    for i, call in enumerate(calls):
        # FluxPipeline: `torch.full([1], guidance_scale, dtype=torch.float32).expand(B)`, every call
        assert call["guidance"].dtype == torch.float32 and torch.equal(call["guidance"], torch.full((N,), 3.5))
        assert_bitwise(call["guidance"], mg.cond["guidance"], "the recorded distilled input")
        # `timestep = t.expand(B).to(latents.dtype)`, passed as `timestep / 1000`
        assert_bitwise(call["timestep"], model_timestep(mg.timesteps[i].expand(N), BF16), f"timestep {i}")
        assert_bitwise(call["img_ids"], image_ids(grid, "cpu", BF16), "img_ids")
        assert_bitwise(call["txt_ids"], torch.zeros(TEXT_LEN, 3, dtype=BF16), "txt_ids")
        with torch.no_grad(), attention_backend("_native_flash"):
            again = train_forward(pipe.transformer, call["hidden_states"], call["timestep"], grid, mg.cond)
        assert_bitwise(again, call["output"], f"train_forward of call {i}")
        assert_bitwise(call["encoder_hidden_states"], mg.cond["encoder_hidden_states"], "T5 embeddings")
        assert_bitwise(call["pooled_projections"], mg.cond["pooled_projections"], "CLIP pooled")
    # the failing side: the engine's fast numerics (no patch group) on the pipeline's first call's inputs
    fast = load_engine_transformer(flux_checkpoint, "cpu", BF16, "none", family="flux")
    first = calls[0]
    with torch.no_grad():
        assert_differs(fast(hidden_states=first["hidden_states"], timestep=mg.timesteps[0].expand(N), grid=grid,
                            **mg.cond), first["output"], "group none")
    other = engine_rollout(engine, distilled_guidance_scale=5.0).microgroups[0]
    assert torch.equal(other.cond["guidance"], torch.full((N,), 5.0))
    assert_differs(other.latents[-1], out.images, "distilled scale 5")


def test_true_cfg_is_a_second_call_and_the_images_decode_as_the_pipelines(pipe, engine):
    """With a negative prompt and true_cfg_scale 4 the pipeline calls the transformer twice per step (positive,
    then negative, both with the distilled scale) and steps with `neg + 4·(pos − neg)`: the engine's rollout at
    --cfg-scale 4 --negative-prompt gives its latents and, decoded, its images bit for bit."""
    calls, stepped, out = run_pipeline(pipe, negative_prompt=NEGATIVE, true_cfg_scale=4.0, output_type="np")
    rollout = engine_rollout(engine, cfg_scale=4.0, negative_prompt=NEGATIVE)
    mg = rollout.microgroups[0]
    assert len(calls) == 2 * STEPS and rollout.params.negative_prompt == NEGATIVE
    for i in range(STEPS):
        positive, negative = calls[2 * i], calls[2 * i + 1]
        assert_bitwise(positive["encoder_hidden_states"], mg.cond["encoder_hidden_states"], "positive text")
        assert_bitwise(negative["encoder_hidden_states"], mg.negative_cond["encoder_hidden_states"], "negative text")
        assert_bitwise(negative["guidance"], mg.negative_cond["guidance"], "the negative call's distilled input")
        rec = mg.records[i]
        assert_bitwise(rec.positive_output, positive["output"], f"positive output {i}")
        assert_bitwise(rec.negative_output, negative["output"], f"negative output {i}")
        # FluxPipeline.__call__: `neg_noise_pred + true_cfg_scale * (noise_pred - neg_noise_pred)`
        assert_bitwise(rec.guided_output, negative["output"] + 4.0 * (positive["output"] - negative["output"]),
                       f"guided {i}")
        assert_bitwise(mg.latents[i + 1], stepped[i], f"latents after step {i}")
    expected = torch.from_numpy((out.images * 255).round().astype(np.uint8))  # numpy_to_pil's conversion
    assert len(np.unique(out.images)) > 50  # a picture, not a constant
    assert_bitwise(rollout.images, expected, "decoded images")


def test_prompts_bitwise(flux_checkpoint, pipe, engine):
    """encode_prompt's T5 embeddings (padded to the window, no mask) and CLIP's pooled output, for a batch with a
    prompt longer than the window (truncated)."""
    prompts = [PROMPT, "a small black cat " * 10]
    with torch.no_grad():  # as __call__ runs it
        embeds, pooled, text_ids = pipe.encode_prompt(prompt=prompts, prompt_2=None, max_sequence_length=TEXT_LEN)
    tokenizers, text = engine.tokenizer, engine.text_encoder  # the family's load_text, as the engine loaded them
    batch = collate_cond(encode_prompts(tokenizers, text, prompts, TEXT_LEN), {})
    assert_bitwise(batch["encoder_hidden_states"], embeds, "T5")
    assert_bitwise(batch["pooled_projections"], pooled, "CLIP pooled")
    assert embeds.shape[1] == TEXT_LEN and torch.equal(text_ids, torch.zeros(TEXT_LEN, 3, dtype=BF16))
    with pytest.raises(ValueError, match="max_sequence_length must be in 1..512"):
        encode_prompts(tokenizers, text, prompts, 513)


def test_schedule_latents_and_noise_bitwise(pipe, distilled):
    """The schedule the pipeline set (its dynamic shift of the packed token count), its packing, image ids and
    initial noise."""
    grid = latent_grid(SIDE, SIDE)
    sigmas, timesteps = flux_schedule(FLUX_SCHEDULER_CONFIG, STEPS, grid[0] * grid[1])
    assert torch.equal(sigmas, pipe.scheduler.sigmas) and torch.equal(timesteps, pipe.scheduler.timesteps)
    assert dict(pipe.scheduler.config) | FLUX_SCHEDULER_CONFIG == dict(pipe.scheduler.config)  # the checkpoint's
    assert not torch.equal(flux_schedule(FLUX_SCHEDULER_CONFIG, STEPS, 4 * grid[0] * grid[1])[0], sigmas)
    calls = distilled[0]
    shape = noise_shape(FluxConfig.from_dict(dict(pipe.transformer.config)), grid)
    noise = pack_latents(sample_noise(shape, _generators(), BF16, "cpu"))
    assert_bitwise(noise, calls[0]["hidden_states"], "initial noise")
    drawn, ids = pipe.prepare_latents(N, 16, SIDE, SIDE, BF16, "cpu", _generators())
    assert_bitwise(noise, drawn, "prepare_latents") and assert_bitwise(image_ids(grid, "cpu", BF16), ids, "ids")
    x = torch.randn(2, 16, 6, 8)
    assert torch.equal(pack_latents(x), FluxPipeline._pack_latents(x, 2, 16, 6, 8))
    packed = pack_latents(x)
    assert torch.equal(unpack_latents(packed, 48, 64), FluxPipeline._unpack_latents(packed, 48, 64, 8))
    for bad in ((64, 64, 2),):
        with pytest.raises(ValueError, match="FLUX.1 makes images"):
            latent_grid(*bad)


def test_flow_grpos_lora_targets_cover_both_block_kinds_and_load_in_the_pipeline(flux_checkpoint, pipe, tmp_path):
    """flow_grpo's FLUX LoRA targets adapt the double-stream blocks' attention and FFNs and the single-stream blocks'
    q/k/v; a LoRA saved with FluxPipeline.save_lora_weights loads in the pipeline and in the engine (every tensor
    lands on an engine layer) with the same forward."""
    from trueflow.layers.linear import Linear
    from trueflow.models.flux.presets import build_transformer
    from trueflow.models.flux.transformer import build_model

    model = build_transformer(dict(pipe.transformer.config), seed=0, dtype=BF16)
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS), init_lora_weights="gaussian"))
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_modules() if n.endswith(".lora_A")}
    assert {n.split(".")[0] for n in adapted} == {"transformer_blocks", "single_transformer_blocks"}
    assert sorted(n.split(".", 2)[2] for n in adapted if n.startswith("single_transformer_blocks.0.")) == \
        ["attn.to_k", "attn.to_q", "attn.to_v"]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(generator=torch.Generator().manual_seed(len(name)))
    state = get_peft_model_state_dict(model)
    metadata = json.loads(json.dumps(model.peft_config["default"].to_dict(), default=list))
    FluxPipeline.save_lora_weights(tmp_path, transformer_lora_layers=state, transformer_lora_adapter_metadata=metadata)
    loaded = FluxPipeline.from_pretrained(flux_checkpoint, dtype=BF16)
    loaded.load_lora_weights(tmp_path)
    (adapter,) = loaded.transformer.peft_config
    assert get_peft_model_state_dict(loaded.transformer, adapter_name=adapter).keys() == state.keys()
    # Every PEFT module name maps onto an engine layer (a packed slot for q/k/v), none refused.
    built = build_model(dict(pipe.transformer.config), "cpu", BF16)
    W.load_weights(built, build_transformer(dict(pipe.transformer.config), seed=0, dtype=BF16).state_dict())
    peft = W.parse_peft_state_dict(state)
    W.set_lora(built, peft, 2.0, merge=False)
    assert sum(a is not None for m in built.modules() if isinstance(m, Linear) for a in m.adapters) == len(peft)
