"""One copy of the frozen base weights (`--share-base-weights`): the peak memory of a LoRA run's trainer and its
in-process engine, the engine on the train side's base tensors ("shared") against an engine with a copy of its own
("own").

    python benchmarks/shared_base.py --out shared_base.json [--device cpu|cuda] [--size one_block]
        [--checkpoint DIR] [--resolution 64]

A Qwen-Image pipeline folder of the `--size` preset (seeded random transformer stored in bf16, the tiny VAE and
text encoder) is written to a temporary folder (by `trueflow init-checkpoint`, in a process of its own) unless
`--checkpoint` names one. Each mode then runs in a process of its own, since a peak is a process's own (`measure`):
it builds what `trueflow train` builds before its first rollout
(`train.run.start_trainer`: the policy from the checkpoint, its LoRA, FSDP2 on one rank, the engine, the first LoRA
sync), under the aligned settings with `--share-base-weights` true or false.
- CPU: the process's peak resident set (`resource.getrusage` ru_maxrss) once built, its resident set before (the
  imports done) and once built (what it keeps: the peak also holds the loads' transient copies). The two modes run
  at the same time (each its own process), which changes neither one's peak.
- CUDA: `torch.cuda.max_memory_allocated` of the build, then of one rollout after it (`reset_peak_memory_stats`
  between: the rollout phase's peak, what a colocated run holds while it samples), and the memory allocated as
  the rollout starts. The modes run one after the other (both at once could exceed the GPU).
What the shared mode saves is one bf16 copy of the transformer (`weights` in the table: its tensors' bytes, from
the safetensors headers), less the tensors the engine copies anyway (none under the parity group).
Prints a table last and writes every number as JSON (`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

MODES = {"shared": True, "own": False}
MIB = 2**20


def _settings(checkpoint: str, out: Path, device: str, resolution: int, share: bool):
    from trueflow.train.config import TrainConfig

    # The aligned defaults (docs/training.md): one prompt of 4 samples in one microgroup, one SDE step trained.
    return TrainConfig(checkpoint=checkpoint, output_dir=str(out), device=device, resolution=resolution, steps=2,
                       num_sde_steps=1, rollout_batch_size=1, n_samples_per_prompt=4, rollout_microgroup_size=4,
                       micro_batch_size_sample=4, sample_every=0, share_base_weights=share)


def resident() -> int:
    """This process's resident set now (/proc/self/statm's second field, in pages)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(mode: str, args: argparse.Namespace) -> dict:
    """One mode in this process: what it holds once the trainer and its engine are built (and, on CUDA, after a
    rollout)."""
    import torch

    from trueflow.train import run
    from trueflow.train.dist import init_distributed
    from trueflow.train.lock import holding_run_lock

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _settings(args.checkpoint, Path(tmp) / "run", args.device, args.resolution, MODES[mode])

        @holding_run_lock
        def build():
            resumed = run._check_before_loading(cfg)
            return run.start_trainer(cfg, init_distributed(args.device), resumed)

        t0 = time.perf_counter()
        trainer = build()
        row = {"mode": mode, "build_s": time.perf_counter() - t0, "rss_before_bytes": before,
               "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "rss_built_bytes": resident()}
        if args.device.startswith("cuda"):
            row["build_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            row["rollout_start_allocated_bytes"] = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            trainer._rollout(0)
            torch.cuda.synchronize()
            row["rollout_s"] = time.perf_counter() - t0
            row["rollout_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        trainer.engine.shutdown()
    return row


def weights_bytes(checkpoint: str) -> int:
    """One copy of the transformer: every tensor's bytes, read off the safetensors headers (an 8-byte length, then
    JSON naming each tensor's byte range)."""
    total = 0
    for f in sorted((Path(checkpoint) / "transformer").glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    return total


def forked(mode: str, args: argparse.Namespace) -> tuple[int, int]:
    """`child` of `mode` in a forked copy of this process: (its pid, the pipe its JSON row arrives on)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one row, then out without running this process's exit handlers
        os.close(r)
        code = 1
        try:
            row = json.dumps(child(mode, args)).encode()
            code = 0
        except BaseException:
            traceback.print_exc()
            row = b""
        with os.fdopen(w, "wb") as f:
            f.write(row)
        os._exit(code)
    os.close(w)
    return pid, r


def collect(pid: int, r: int) -> dict:
    with os.fdopen(r, "rb") as f:
        row = f.read()
    _, status = os.waitpid(pid, 0)
    if status:
        raise SystemExit(f"the measuring process {pid} failed (status {status})")
    return json.loads(row)


def measure(args: argparse.Namespace) -> list[dict]:
    """Both modes, each in a process of its own. CPU: forked copies of this process, at the same time; they start
    from its resident set (a fork's ru_maxrss starts at its current RSS) with the imports both need done once here,
    and this process computes nothing before it forks (no intra-op thread pool to inherit). CUDA: one after the
    other, each spawned afresh (a forked process cannot use a CUDA its parent may have touched)."""
    if args.device == "cpu":
        import torch  # noqa: F401  # the imports both modes need, paid once
        import trueflow.train.run  # noqa: F401
        import trueflow.train.trainer  # noqa: F401

        return [collect(*p) for p in [forked(m, args) for m in MODES]]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    rows = []
    for m in MODES:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as one:
            rows.append(one.submit(child, m, args).result())
    return rows


def summary(rows: list[dict], weights: int, device: str) -> dict:
    by = {r["mode"]: r for r in rows}
    key = "peak_rss_bytes" if device == "cpu" else "rollout_peak_allocated_bytes"
    drop = by["own"][key] - by["shared"][key]
    return {"peak": key, "drop_bytes": drop, "drop_of_one_copy": drop / weights}


def table(result: dict) -> str:
    w = result["weights_bytes"]
    lines = [f"transformer weights: {w / MIB:,.0f} MiB (one bf16 copy), {result['device']}, {result['size']}",
             "| mode | " + " | ".join(k.removesuffix("_bytes").replace("_", " ") + " MiB" for k in result["rows"][0]
                                    if k.endswith("_bytes")) + " |",
             "|---|" + "---|" * sum(k.endswith("_bytes") for k in result["rows"][0])]
    for r in result["rows"]:
        lines.append(f"| {r['mode']} | " + " | ".join(f"{v / MIB:,.0f}" for k, v in r.items() if k.endswith("_bytes"))
                     + " |")
    s = result["summary"]
    lines.append(f"drop of the {s['peak'].removesuffix('_bytes').replace('_', ' ')}: {s['drop_bytes'] / MIB:,.0f} MiB "
                 f"= {s['drop_of_one_copy']:.2f} x one copy of the weights")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="shared_base.json")
    p.add_argument("--device", default="cpu")
    p.add_argument("--size", default="one_block", help="Qwen-Image transformer preset of the written checkpoint")
    p.add_argument("--checkpoint", help="a pipeline folder to use instead of writing one")
    p.add_argument("--resolution", type=int, default=64)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint
        if checkpoint is None:  # in a process of its own: the forks start from this one's resident set
            checkpoint = str(Path(tmp) / "ckpt")
            subprocess.run([sys.executable, "-m", "trueflow", "init-checkpoint", "--family", "qwen_image", "--size",
                            args.size, "--dtype", "bf16", "--device", args.device, "--output-dir", checkpoint],
                           check=True,
                           stdout=subprocess.DEVNULL)
        args.checkpoint = checkpoint
        rows = measure(args)
        result = {"device": args.device, "size": args.size if checkpoint.startswith(tmp) else checkpoint,
                  "machine": platform.node(), "python": platform.python_version(),
                  "date": time.strftime("%Y-%m-%d"), "weights_bytes": weights_bytes(checkpoint), "rows": rows}
    result["summary"] = summary(rows, result["weights_bytes"], args.device)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
