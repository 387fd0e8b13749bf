"""Weight sync from the trainer to an engine in another process by CUDA IPC, timed until the engine confirms.

    python benchmarks/weight_sync.py --out sync.json [--rows full,lora_unmerged,lora_merged] [--bucket-gb 8]
        [--rank 64] [--repeats 10]

This process is the trainer: it holds the bf16 compute copy of the full-size Qwen-Image transformer (seeded random
weights, diffusers names) and a LoRA. A spawned process is the engine, reduced to what a weight update touches:
the engine transformer alone (`placement/process.py` builds a whole `Engine` from a pipeline folder, which a
benchmark of random weights has not got). Buckets (`sync/buckets.py`: one flat buffer and a manifest each) cross
as CUDA IPC handles through a `torch.multiprocessing` queue; no tensor data goes through the pipe. Every row is
timed from the first byte packed to the engine's checksum (`sync/checksum.py`) of what it now holds, read back
from its parameters/layers, and the checksum is compared with the trainer's checksum of what it sent (for
LoRA, computed in the timed sync as the trainer does in every sync; for full weights, once beforehand).

Rows:
    full            every transformer tensor, streamed in buckets of --bucket-gb with at most two in flight (the
                    trainer packs bucket i+1 while the engine copies bucket i into its parameters), then the
                    engine's checksum of all its weights
    lora_unmerged   LoRA A/B of --rank on the attention + MLP targets (12 per block, the trainer's default), packed
                    as `EngineClient` packs them (`sync.buckets.BucketPacker`: 512 MiB buckets, refilled in place)
                    and installed as an engine process does (`engine.lora_arena.update_lora_packed`), kept unmerged
                    (parity mode): after the warm-up, a same-layout update checked off the buckets and copied into
                    the arena the adapters view; then the LoRA checksum (off the arena's buffers). The trainer's
                    checksum is `Trainer._sync`'s (`tensors_checksum` of the tensors it sent). Two LoRAs alternate,
                    so every sync changes the values and its checksum must change with them.
    lora_merged     the same, merged into the weights in fp32 (the engine's fast mode)
The first sync of each row is a warm-up (IPC handles opened, allocator grown, adapters first installed); the
median and min-max of --repeats follow. Without the full row the engine's weights are seeded random values
instead. Without CUDA (`--size tiny`, a CPU smoke run) buckets travel through shared memory instead.
"""

from __future__ import annotations

import argparse
import json
import platform
import queue
import statistics
import time
import traceback
from collections import deque
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

from trueflow.models.qwen_image.presets import build_transformer, transformer_config
from trueflow.engine.lora_arena import lora_checksum, update_lora_packed
from trueflow.models.qwen_image.transformer import build_model
from trueflow.models.qwen_image.weights import _expected_tensors
from trueflow.sync.buckets import Bucket, BucketPacker, pack, unpack
from trueflow.sync.checksum import tensors_checksum
from trueflow.models.qwen_image.family import FAMILY

BF16 = torch.bfloat16
GB = 1e9


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# -- the engine process ----------------------------------------------------------------------------------------------
def engine_worker(config: dict, device: str, requests, replies) -> None:
    """Holds the engine transformer; answers each request with (value, engine-side seconds) or an error."""
    try:
        model = build_model(config, device=device, dtype=BF16)
        model.family = FAMILY  # what `update_lora` maps names with (as `build_engine_transformer` sets it)
        g = torch.Generator(device=device).manual_seed(2)
        with torch.no_grad():
            for p in model.parameters():  # finite values for a merged LoRA when no full sync fills them
                p.normal_(0.0, 0.02, generator=g)
        # diffusers tensor name -> (engine parameter, row slice of a packed q/k/v weight or None). Private to
        # models/qwen_image/weights.py: `load_weights` takes only a complete state dict, a stream needs per-bucket.
        targets = _expected_tensors(model)
        replies.put(("ready", 0.0))
    except Exception:  # noqa: BLE001 - reported to the trainer
        replies.put(("error", traceback.format_exc()))
        return
    while True:
        op, payload = requests.get()
        t0 = time.perf_counter()
        try:
            if op == "close":
                replies.put(("closed", 0.0))
                return
            if op == "weights":  # one bucket of full weights, copied into place
                with torch.no_grad():
                    for name, t in unpack([payload]).items():
                        param, rows = targets[name]
                        (param if rows is None else param[rows]).copy_(t)
                del payload, t  # release the trainer's buffer (CUDA IPC counts the receiver's references)
                _sync(device)
                value = "copied"
            elif op == "weights_checksum":
                value = tensors_checksum({n: p if rows is None else p[rows] for n, (p, rows) in targets.items()})
            elif op == "lora":
                buckets, scale, merge_mode = payload
                update_lora_packed(model, buckets, scale, merge_mode)  # as `Engine.update_weights`: copies out
                del buckets, payload
                _sync(device)
                t1 = time.perf_counter()
                value = (lora_checksum(model), t1 - t0)  # one transfer: waits for the kernels
            else:
                raise ValueError(f"unknown request {op!r}")
            replies.put((value, time.perf_counter() - t0))
        except Exception:  # noqa: BLE001
            replies.put(("error", traceback.format_exc()))


class EngineProcess:
    """The engine side, in a spawned process, driven through two queues."""

    def __init__(self, config: dict, device: str):
        ctx = mp.get_context("spawn")
        self.requests, self.replies, self.device = ctx.Queue(), ctx.Queue(), device
        self.process = ctx.Process(target=engine_worker, args=(config, device, self.requests, self.replies),
                                   daemon=True)
        self.process.start()

    def send(self, op: str, payload=None, buckets: list[Bucket] = ()) -> None:
        """`buckets`: the ones inside `payload`; on CPU they are moved to shared memory first (as EngineClient does)."""
        if self.device == "cpu":
            for b in buckets:
                b.buffer.share_memory_()
        self.requests.put((op, payload))

    def reply(self):
        while True:
            try:
                value, seconds = self.replies.get(timeout=1.0)
                break
            except queue.Empty:
                if not self.process.is_alive():
                    raise RuntimeError(f"the engine process died (exit code {self.process.exitcode})") from None
        if value == "error":
            raise RuntimeError(f"engine process failed:\n{seconds}")
        return value, seconds

    def close(self) -> None:
        if self.process.is_alive():
            self.send("close")
            self.reply()
        self.process.join(timeout=60)


# -- the trainer side ------------------------------------------------------------------------------------------------
def plan_buckets(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Names per bucket, in name order, each bucket at most `max_bytes` (a bigger tensor gets one of its own):
    planned up front so the trainer can pack one bucket at a time."""
    plans, size = [[]], 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if plans[-1] and size + nbytes > max_bytes:
            plans.append([])
            size = 0
        plans[-1].append(name)
        size += nbytes
    return plans


def sync_full(engine: EngineProcess, state: dict[str, torch.Tensor], plans: list[list[str]], device: str) -> dict:
    _sync(device)
    t0 = time.perf_counter()
    in_flight: deque[Bucket] = deque()
    copy_s = 0.0
    for names in plans:
        bucket = pack({n: state[n] for n in names}, max_bytes=1 << 62)[0]
        engine.send("weights", bucket, [bucket])
        in_flight.append(bucket)
        if len(in_flight) == 2:  # keep the trainer at most one bucket ahead of the engine
            copy_s += engine.reply()[1]
            in_flight.popleft()
    while in_flight:
        copy_s += engine.reply()[1]
        in_flight.popleft()
    transfer = time.perf_counter() - t0
    engine.send("weights_checksum")
    checksum, checksum_s = engine.reply()
    return {"total_s": time.perf_counter() - t0, "transfer_s": transfer, "engine_copy_s": copy_s,
            "engine_checksum_s": checksum_s, "checksum": checksum}


def sync_lora(engine: EngineProcess, packer: BucketPacker, lora: dict[str, torch.Tensor], merge_mode: str,
              device: str) -> dict:
    """One sync, timed until the engine's checksum is confirmed: pack, send, the trainer's checksum of the buckets
    it sent (while the engine installs), the engine's install and checksum, the comparison."""
    _sync(device)
    t0 = time.perf_counter()
    buckets = packer.pack(lora)  # as `EngineClient.update_weights`: the same buffers, refilled
    _sync(device)
    pack_s = time.perf_counter() - t0
    engine.send("lora", (buckets, 1.0, merge_mode), buckets)
    t1 = time.perf_counter()
    sent = tensors_checksum(lora)  # what the trainer sent, as `Trainer._sync` computes it
    trainer_checksum_s = time.perf_counter() - t1
    (checksum, install_s), engine_s = engine.reply()
    confirmed = checksum == sent
    return {"total_s": time.perf_counter() - t0, "transfer_s": None, "pack_s": pack_s,
            "trainer_checksum_s": trainer_checksum_s, "engine_copy_s": install_s,
            "engine_checksum_s": engine_s - install_s, "checksum": checksum, "confirmed": confirmed,
            "buckets": len(buckets)}


def random_lora(config: dict, rank: int, device: str, seed: int) -> dict[str, torch.Tensor]:
    """PEFT-format A/B on every module PEFT's suffix matching picks for the default targets (shapes read off a
    meta-device diffusers model)."""
    from diffusers import QwenImageTransformer2DModel

    with torch.device("meta"):
        meta = QwenImageTransformer2DModel(**config)
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=g, device=device) * 0.01).to(BF16)

    out = {}
    for name, mod in meta.named_modules():
        if isinstance(mod, torch.nn.Linear) and any(name == t or name.endswith("." + t)
                                                    for t in FAMILY.train.lora_targets):
            out[f"{name}.lora_A.weight"], out[f"{name}.lora_B.weight"] = randn(rank, mod.in_features), randn(
                mod.out_features, rank)
    return out


ROWS = ("full", "lora_unmerged", "lora_merged")
PHASES = ("total_s", "transfer_s", "pack_s", "trainer_checksum_s", "engine_copy_s", "engine_checksum_s")


def timed_rows(name: str, run: Callable[[int], dict], expected: Callable[[int], str], nbytes: int, repeats: int,
               extra: dict) -> dict:
    """Sync `1 + repeats` times (`run(i)`, whose checksum must be `expected(i)`); the first is the warm-up."""
    runs = [run(i) for i in range(1 + repeats)]
    timed = runs[1:]
    med = {k: statistics.median(r[k] for r in timed) if timed[0].get(k) is not None else None for k in PHASES}
    totals = [r["total_s"] for r in timed]
    row = {"row": name, "gb": nbytes / GB, **med, "min_total_s": min(totals), "max_total_s": max(totals),
           "gb_per_s": nbytes / GB / med["total_s"], "warmup_total_s": runs[0]["total_s"], "totals_s": totals,
           "checksum_ok": all(r["checksum"] == expected(i) and r.get("confirmed", True) for i, r in enumerate(runs)),
           "repeats": repeats, **extra}
    print(f"  {name:14s} {row['gb']:7.2f} GB  {row['total_s']:7.3f} s (min {row['min_total_s']:.3f}, max "
          f"{row['max_total_s']:.3f})  checksum ok: {row['checksum_ok']}", flush=True)
    return row


def full_row(engine: EngineProcess, state: dict[str, torch.Tensor], args: argparse.Namespace, device: str) -> dict:
    plans = plan_buckets(state, int(args.bucket_gb * GB))
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    expected = tensors_checksum(state)
    return timed_rows("full", lambda _: sync_full(engine, state, plans, device), lambda _: expected, nbytes,
                      args.repeats, {"buckets": len(plans), "tensors": len(state)})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", default="full", help="transformer preset (tiny: a CPU smoke run)")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--bucket-gb", type=float, default=8.0, help="full-weight bucket size")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    wanted = [r for r in args.rows.split(",") if r]
    if not wanted or any(r not in ROWS for r in wanted):
        print(f"error: --rows {args.rows!r}: give a comma-separated list of {', '.join(ROWS)}")
        return 2
    if args.repeats < 1:
        print("error: --repeats must be at least 1")
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = transformer_config(args.size)
    info = {"torch": torch.__version__, "python": platform.python_version(), "size": args.size,
            "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
            "date": time.strftime("%Y-%m-%d"), "bucket_gb": args.bucket_gb, "lora_rank": args.rank,
            "repeats": args.repeats}
    print(info, flush=True)
    t0 = time.perf_counter()
    engine = EngineProcess(config, device)  # builds its model while the trainer builds its own
    rows = []
    try:
        if "full" in wanted:
            with torch.no_grad():
                state = build_transformer(config, seed=0, dtype=BF16, device=device).state_dict()
        engine.reply()  # ready
        print(f"trainer and engine models built in {time.perf_counter() - t0:.0f} s", flush=True)
        if "full" in wanted:
            rows.append(full_row(engine, state, args, device))
            del state
            if device == "cuda":
                torch.cuda.empty_cache()  # hand the 40 GB back to the driver: the merged LoRA's base copies need room
        loras = [random_lora(config, args.rank, device, seed) for seed in (1, 2)]  # alternated: every sync changes
        nbytes = sum(t.numel() * t.element_size() for t in loras[0].values())
        expected = [tensors_checksum(lora) for lora in loras]
        for mode in ("unmerged", "merged"):
            if f"lora_{mode}" in wanted:
                packer = BucketPacker()
                rows.append(timed_rows(f"lora_{mode}", lambda i, packer=packer, mode=mode:
                                       sync_lora(engine, packer, loras[i % 2], mode, device),
                                       lambda i: expected[i % 2], nbytes, args.repeats, {"tensors": len(loras[0])}))
    finally:
        with open(args.out, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)
        engine.close()
    head = (f"{'row':14s} {'GB':>7s} {'total s':>8s} {'min-max s':>13s} {'GB/s':>7s} {'transfer s':>10s} "
            f"{'pack s':>7s} {'trainer sum s':>13s} {'engine copy s':>13s} {'engine sum s':>12s} {'warm-up s':>9s} "
            f"{'checksum ok':>11s}")
    print("\n" + head + "\n" + "-" * len(head))

    def cell(value: float | None, width: int) -> str:
        return f"{'-' if value is None else f'{value:.3f}':>{width}s}"

    for r in rows:
        print(f"{r['row']:14s} {r['gb']:7.2f} {r['total_s']:8.3f} {r['min_total_s']:6.3f}-{r['max_total_s']:6.3f} "
              f"{r['gb_per_s']:7.1f} {cell(r['transfer_s'], 10)} {cell(r['pack_s'], 7)} "
              f"{cell(r['trainer_checksum_s'], 13)} {r['engine_copy_s']:13.3f} {r['engine_checksum_s']:12.3f} "
              f"{r['warmup_total_s']:9.3f} {str(r['checksum_ok']):>11s}")
    print("(engine copy: the engine's copy-in for full weights, summed over buckets; for LoRA, update_lora's "
          "install, merge included)")
    return 0 if all(r["checksum_ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
