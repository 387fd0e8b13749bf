"""Full-parameter training on one H200 (issue 28, item 5): Qwen-Image's architecture shrunk to fit one GPU — the
`h200_fullft` preset, the real widths at 12 of the 60 blocks (4.12B weights; docs/training.md's memory plan puts
a full-parameter run of it at about 73 GiB) — with seeded random weights. Each call is one phase, well under 10
minutes; each writes its numbers to RUN/<phase>.json and prints them:

    python scripts/gpu_fullft.py write --root ROOT    # the checkpoint (drawn on the GPU, bf16)
    python scripts/gpu_fullft.py full  --root ROOT    # 3 steps --no-use-lora: parity 0.0 each, sync time, images/GPU/s
    python scripts/gpu_fullft.py lora  --root ROOT    # the same recipe as a LoRA run: its images/GPU/s
    python scripts/gpu_fullft.py resume --root ROOT   # step 2's checkpoint resumed: step 3 and the weights bit for bit

`--smoke` runs every phase in turn on the CPU at the tiny size (tests/test_fullft.py runs it). images/GPU/s is the
samples a step rolls out and trains on over the step's wall time (rollout, reward, train, sync), per GPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

PRESET = "h200_fullft"
RECIPE = dict(steps=10, num_sde_steps=2, rollout_batch_size=2, n_samples_per_prompt=4, rollout_microgroup_size=4,
              micro_batch_size_sample=4, resolution=512, num_rollouts=3, save_every=1, sample_every=0,
              deterministic=True)
SMOKE = dict(RECIPE, steps=2, num_sde_steps=1, rollout_batch_size=1, n_samples_per_prompt=2,
             rollout_microgroup_size=2, micro_batch_size_sample=2, resolution=64, deterministic=False)
PARITY = ("model_output_max_abs_diff", "model_output_mean_abs_diff", "log_prob_max_abs_diff")
TIMES = ("time_rollout", "time_reward", "time_train", "time_sync")


def write(root: Path, smoke: bool) -> dict:
    import torch

    from trueflow.checkpoints import init_checkpoint

    size, device = ("tiny", "cpu") if smoke else (PRESET, "cuda")
    init_checkpoint(root / "checkpoint", size=size, seed=0, overwrite=True,
                    dtype=torch.float32 if smoke else torch.bfloat16, device=device)
    return {"checkpoint": str(root / "checkpoint"), "size": size}


def _train(root: Path, name: str, smoke: bool, **overrides) -> list[dict]:
    from trueflow.train.config import TrainConfig
    from trueflow.train.metrics import read_metrics
    from trueflow.train.run import run_training

    out = root / name
    shutil.rmtree(out, ignore_errors=True)
    recipe = SMOKE if smoke else RECIPE
    run_training(TrainConfig(output_dir=str(out), checkpoint=str(root / "checkpoint"),
                             device="cpu" if smoke else "cuda", engine_process=False, **{**recipe, **overrides}))
    return read_metrics(out / "metrics.jsonl")


def _throughput(rows: list[dict], smoke: bool) -> float:
    """Samples per step over the step's wall time, per GPU (one GPU), the first step (warm-up) left out."""
    recipe = SMOKE if smoke else RECIPE
    samples = recipe["rollout_batch_size"] * recipe["n_samples_per_prompt"]
    timed = rows[1:] or rows
    return samples * len(timed) / sum(sum(r[k] for k in TIMES) for r in timed)


def full(root: Path, smoke: bool) -> dict:
    rows = _train(root, "full", smoke, use_lora=False, gradient_checkpointing=not smoke)
    return {"steps": len(rows), "parity": [{k: r[k] for k in PARITY} for r in rows],
            "bitwise_every_step": all(r[k] == 0.0 for r in rows for k in PARITY),
            "checksums_equal": all(r["checksums_equal"] for r in rows),
            "time_sync_s": [r["time_sync"] for r in rows], "images_per_gpu_s": _throughput(rows, smoke)}


def lora(root: Path, smoke: bool) -> dict:
    rows = _train(root, "lora", smoke, gradient_checkpointing=not smoke)
    return {"steps": len(rows), "bitwise_every_step": all(r[k] == 0.0 for r in rows for k in PARITY),
            "time_sync_s": [r["time_sync"] for r in rows], "images_per_gpu_s": _throughput(rows, smoke)}


def resume(root: Path, smoke: bool) -> dict:
    """The `full` run's folder, rewound to its step-2 checkpoint, resumed: its metrics and its last checkpoint's
    masters and export equal the uninterrupted run's."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from trueflow.train.config import TrainConfig
    from trueflow.train.metrics import TIMING_KEYS, read_metrics
    from trueflow.train.run import run_training

    src, out = root / "full", root / "resumed"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(src, out)
    shutil.rmtree(out / "checkpoints" / "step-000003")
    (out / "checkpoints" / "latest").write_text("step-000002\n")
    saved = json.loads((out / "checkpoints" / "step-000002" / "trainer_state.json").read_text())
    run_training(TrainConfig(**{**saved["config"], "output_dir": str(out), "resume": True}))

    def strip(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


    def masters(ckpt: Path) -> dict:
        dcp_to_torch_save(ckpt / "dcp", ckpt / "masters.pt")
        return torch.load(ckpt / "masters.pt", weights_only=False)["model"]

    a, b = masters(src / "checkpoints" / "step-000003"), masters(out / "checkpoints" / "step-000003")
    export = "transformer/diffusion_pytorch_model.safetensors"
    return {"metrics_equal": strip(read_metrics(out / "metrics.jsonl")) == strip(read_metrics(src / "metrics.jsonl")),
            "masters_equal": a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a),
            "export_equal": (src / "checkpoints" / "step-000003" / export).read_bytes()
            == (out / "checkpoints" / "step-000003" / export).read_bytes()}


PHASES = {"write": write, "full": full, "lora": lora, "resume": resume}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("phase", choices=[*PHASES, "all"])
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="the tiny size on the CPU")
    args = parser.parse_args(argv)
    args.root.mkdir(parents=True, exist_ok=True)
    results = {}
    for phase in PHASES if args.phase == "all" else [args.phase]:
        results[phase] = PHASES[phase](args.root, args.smoke)
        (args.root / f"{phase}.json").write_text(json.dumps(results[phase], indent=2))
        print(json.dumps({phase: results[phase]}), flush=True)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
