"""Rerun the train side of a saved parity probe with diffusers + PEFT alone (no trueflow import), and compare
with the engine output the probe recorded. See docs/parity-probe.md.

    python scripts/rerun_parity_probe.py PROBE_DIR [--checkpoint DIR]

Prints one JSON object: {"model_output_max_abs_diff": ..., "bitwise_equal": ...}. Exit status 1 unless the
recorded result said bitwise and the rerun agrees.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from diffusers import QwenImageTransformer2DModel
from diffusers.models.attention_dispatch import attention_backend
from peft import LoraConfig, set_peft_model_state_dict
from safetensors.torch import load_file


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("probe_dir")
    ap.add_argument("--checkpoint", help="override the checkpoint path recorded in the manifest")
    a = ap.parse_args()
    d = Path(a.probe_dir)
    m = json.loads((d / "manifest.json").read_text())
    if m.get("family", "qwen_image") != "qwen_image":  # each other family's outside check is its snapshot replay
        print(f"this script reruns Qwen-Image probes; {m['family']}'s outside check is its snapshot replay script "
              "(docs/snapshot.md)", file=sys.stderr)
        return 2
    if m["checkpoint"] is None and a.checkpoint is None:
        sys.exit("this probe used in-memory random weights; only checkpoint probes can be rerun from disk")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[m["dtype"]]
    t = load_file(str(d / "inputs.safetensors"))
    # The train side's compute copy: the checkpoint's fp32 weights cast once to the compute dtype.
    model = QwenImageTransformer2DModel.from_pretrained(a.checkpoint or m["checkpoint"], subfolder="transformer",
                                                        dtype=dtype).eval()
    if m["lora"]:
        lora = m["lora"]
        model.add_adapter(LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], target_modules=lora["target_modules"]))
        set_peft_model_state_dict(model, load_file(str(d / lora["file"])))
    h, w = m["grid"]
    batch = t["hidden_states"].shape[0]
    with torch.no_grad(), attention_backend(m["train_attention_backend"]):
        out = model(hidden_states=t["hidden_states"], encoder_hidden_states=t["encoder_hidden_states"],
                    encoder_hidden_states_mask=None, timestep=t["timestep_train"],
                    img_shapes=[(1, h, w)] * batch, return_dict=False)[0]
    diff = (out.float() - t["engine_output"].float()).abs()
    result = {"model_output_max_abs_diff": diff.max().item(), "model_output_mean_abs_diff": diff.mean().item(),
              "bitwise_equal": torch.equal(out, t["engine_output"]),
              "recorded_bitwise_equal": m["result"]["bitwise_equal"]}
    print(json.dumps(result))
    return 0 if result["bitwise_equal"] and result["recorded_bitwise_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
