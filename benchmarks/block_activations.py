"""The activation bytes one transformer block keeps for the backward, measured, against the memory plan's count
(`train/memory.py`: 34·d bytes per token and block, Korthikanti et al.'s for a GPT layer).

    python benchmarks/block_activations.py --out block_activations.json [--heads 2,8,24] [--tokens 256]
        [--text 32] [--device cpu]

A Qwen-Image transformer of two blocks at each head count (128 per head; the tiny text width) with seeded random
weights in bf16 and the run's default LoRA (PEFT, rank 8), the train forward at batch 1 (`train.model.train_forward`,
the family's `_native_flash` attention): every tensor autograd saves is counted once by its storage
(`torch.autograd.graph.saved_tensors_hooks`), the weights left out, with no block checkpointed and then with the
first checkpointed (`train.activations.checkpoint_blocks`); the difference is what the first block keeps, over
(image + text tokens) x width is its bytes per token and unit of width. Prints a table last and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from trueflow.models import get_family
from trueflow.models.qwen_image.presets import build_transformer, transformer_config
from trueflow.models.qwen_image.train import model_timestep
from trueflow.parity.probe import make_inputs
from trueflow.train.activations import checkpoint_blocks
from trueflow.train.config import TrainConfig
from trueflow.train.memory import ACT_PER_TOKEN_WIDTH, saved_activation_bytes
from trueflow.train.model import LoraSpec, add_lora, train_forward

QWEN = get_family("qwen_image")


def saved_bytes(model: torch.nn.Module, inputs: dict) -> int:
    return saved_activation_bytes(model, lambda: train_forward(
        QWEN, model, inputs["hidden_states"], model_timestep(inputs["timestep"], torch.bfloat16), inputs["grid"],
        inputs["cond"]))


def row(heads: int, tokens: int, text: int, device: str) -> dict:
    config = {**transformer_config("tiny"), "num_layers": 2, "num_attention_heads": heads, "attention_head_dim": 128,
              "axes_dims_rope": (16, 56, 56)}
    model = build_transformer(config, seed=0, dtype=torch.bfloat16, device=device)
    add_lora(model, LoraSpec(TrainConfig().lora_rank, tuple(QWEN.train.lora_targets)), seed=0)
    side = int(tokens ** 0.5) * 16  # Qwen-Image: 16 pixels a latent token
    inputs = make_inputs(config, 1, text, side, torch.bfloat16, 0, device)
    whole = saved_bytes(model, inputs)
    checkpoint_blocks(model, QWEN.train.shard_units, 1)
    block = whole - saved_bytes(model, inputs)
    width = heads * 128
    seq = inputs["hidden_states"].shape[1] + text
    return {"width": width, "tokens": seq, "block_bytes": block, "per_token_width": block / (seq * width),
            "plan_per_token_width": ACT_PER_TOKEN_WIDTH}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="block_activations.json")
    p.add_argument("--heads", default="2,8,24", help="head counts (128 each; 24 is Qwen-Image's width, 3072)")
    p.add_argument("--tokens", type=int, default=256, help="image tokens (a square latent grid)")
    p.add_argument("--text", type=int, default=32, help="text tokens")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    rows = [row(int(h), args.tokens, args.text, args.device) for h in args.heads.split(",")]
    result = {"device": args.device, "machine": platform.node(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("| width | tokens | first block keeps | bytes per token and width | the plan's |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['width']} | {r['tokens']} | {r['block_bytes'] / 2**20:.1f} MiB | {r['per_token_width']:.1f} | "
              f"{r['plan_per_token_width']} |")


if __name__ == "__main__":
    main()
