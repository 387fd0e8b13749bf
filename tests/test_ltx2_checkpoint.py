"""The tiny LTX-2.3 checkpoint: a pipeline folder of the real layout that diffusers alone loads and runs, decoding
exactly the requested frames at the requested size (a mismatched VAE fails silently: 9 frames come out as 5)."""

import json

import pytest
import torch
from diffusers import LTX2Pipeline

from conftest import LTX2_UNGUIDED
from trueflow.models.ltx2.checkpoint import write_checkpoint
from trueflow.models.ltx2.presets import transformer_config


def test_layout(ltx2_checkpoint):
    index = json.loads((ltx2_checkpoint / "model_index.json").read_text())
    assert index["_class_name"] == "LTX2Pipeline"
    assert {k: v[1] for k, v in index.items() if not k.startswith("_") and v[0] is not None} == {
        "scheduler": "FlowMatchEulerDiscreteScheduler", "vae": "AutoencoderKLLTX2Video",
        "audio_vae": "AutoencoderKLLTX2Audio", "text_encoder": "Gemma3ForConditionalGeneration",
        "tokenizer": "GemmaTokenizer", "connectors": "LTX2TextConnectors",
        "transformer": "LTX2VideoTransformer3DModel", "vocoder": "LTX2VocoderWithBWE"}
    config = json.loads((ltx2_checkpoint / "transformer" / "config.json").read_text())
    assert {k: config[k] for k in transformer_config("tiny")} == {
        k: list(v) if isinstance(v, tuple) else v for k, v in transformer_config("tiny").items()}
    text = json.loads((ltx2_checkpoint / "text_encoder" / "config.json").read_text())
    assert text["vision_config"]["model_type"] == "siglip_vision_model"  # Gemma-3 keeps its vision tower


@pytest.mark.parametrize("num_frames,height,width", [(9, 64, 96), (17, 32, 64)])
def test_diffusers_decodes_the_requested_frames(ltx2_checkpoint, num_frames, height, width):
    pipe = LTX2Pipeline.from_pretrained(ltx2_checkpoint)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(prompt=["a red apple on a table", "a cat"], num_frames=num_frames, height=height, width=width,
               num_inference_steps=2, max_sequence_length=32, output_type="np",
               generator=torch.Generator().manual_seed(0), **LTX2_UNGUIDED)
    assert out.frames.shape == (2, num_frames, height, width, 3)
    assert out.frames.std() > 0.01  # random weights still give a picture that varies
    assert out.audio.shape[:2] == (2, 2) and out.audio.shape[2] > 0


def test_seeded(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for folder, seed in ((a, 0), (b, 0), (c, 1)):
        write_checkpoint(folder, "tiny", seed, torch.float32, "cpu")
    shard = "transformer/diffusion_pytorch_model.safetensors"
    assert (a / shard).read_bytes() == (b / shard).read_bytes()
    assert (a / shard).read_bytes() != (c / shard).read_bytes()
