"""Shared fixtures and helpers: one tiny checkpoint per session, bitwise assertions, forwards of both sides.

Every parity assertion in these tests is `torch.equal` (bits), and every positive test shows its failing side
too. On CPU both sides must run with the same intra-op thread count (parity condition 9, docs/patch-group.md),
so the count is pinned once here, for the whole session, before any test runs, and handed to every process a test
starts (OMP_NUM_THREADS, read by torch at import). It is one: CI runs the suite on two workers (`pytest -n 2`), one per
core, and a worker of two threads would spin against the other.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

TEST_THREADS = 1
torch.set_num_threads(TEST_THREADS)
os.environ["OMP_NUM_THREADS"] = str(TEST_THREADS)

BF16 = torch.bfloat16
EPS = 1e-6  # every norm of Qwen-Image's transformer uses eps 1e-6
TRUEFLOW_EXE = Path(sys.executable).parent / "trueflow"  # the venv's console script


# -- the order of the files ------------------------------------------------------------------------------------
# CI runs the suite on two workers, each file whole on one (`-n 2`; pyproject's addopts: --dist loadfile, in this
# order). The longest files (seconds under -n 2 on 2 cores) go first, so the two workers end together instead of one
# running a long file while the other has nothing left; the rest keep pytest's order.
LONGEST_FIRST = ("test_ray.py", "test_resume.py", "test_rl_mutations.py", "test_train.py", "test_fullft.py",
                 "test_algorithms.py", "test_tp_ltx2.py", "test_tp.py", "test_batch_invariant_parity.py",
                 "test_tp_followups.py", "test_tp_engine.py", "test_serve_tp.py", "test_async_rollouts.py",
                 "test_kernels.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # a stable sort


# -- the batch-invariant mode ----------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _batch_invariant_mode_left_off():
    """No test leaves the batch-invariant mode's process-wide GEMM overrides on for the next one (an engine built in
    the mode turns them on): everything outside the mode keeps the stock kernels, and its bits."""
    yield
    from trueflow.kernels import batch_invariant

    batch_invariant.disable()


@pytest.fixture(autouse=True)
def _diffusers_attention_backend_left_alone():
    """No test leaves diffusers' process-wide attention backend changed for the next one (a model's
    `set_attention_backend` outside an `attention_backend` context changes it): a later module's diffusers code would
    run that backend, which test order alone decides (pytest -n 2 runs a worker's files in another order)."""
    dispatch = sys.modules.get("diffusers.models.attention_dispatch")
    before = dispatch._AttentionBackendRegistry._active_backend if dispatch is not None else None
    yield
    dispatch = sys.modules.get("diffusers.models.attention_dispatch")
    if dispatch is not None:
        registry = dispatch._AttentionBackendRegistry
        registry.set_active_backend(before or dispatch.AttentionBackendName(dispatch.DIFFUSERS_ATTN_BACKEND))


@pytest.fixture
def bi_mode():
    """The batch-invariant mode for one test (its GEMMs overridden; off again afterwards)."""
    from trueflow.kernels import batch_invariant

    batch_invariant.enable()
    yield
    batch_invariant.disable()


# -- checkpoints ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ONE tiny Qwen-Image pipeline folder (seed 0), written once and shared read-only by every test."""
    from trueflow.checkpoints import init_checkpoint

    return init_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


@pytest.fixture()
def tmpfs(tmp_path: Path):
    """`tmpfs(size)`: a folder on a new tmpfs of `size` bytes (a small disk that fills up); `tmpfs(size, folder)`
    remounts it at a new size, its files kept. Skips where mounting is refused (it needs root)."""
    import subprocess

    if shutil.which("mount") is None:
        pytest.skip("no mount command here: a full disk needs a tmpfs")
    mounted: list[Path] = []

    def mount(size: int, where: Path | None = None) -> Path:
        options = f"size={size}" + (",remount" if where is not None else "")
        where = where if where is not None else tmp_path / f"disk{len(mounted)}"
        where.mkdir(exist_ok=True)
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({' '.join(proc.stderr.split())}): a full disk needs one")
        if where not in mounted:
            mounted.append(where)
        return where

    yield mount
    import gc

    gc.collect()  # tensors read back with safetensors map their file; a test's traceback cycle may still hold some
    for where in mounted:
        subprocess.run(["umount", str(where)], check=True)


@pytest.fixture(scope="session")
def tiny() -> tuple[dict, dict]:
    """The tiny Qwen-Image transformer's config and seeded bf16 diffusers state dict (a module may define its own
    `tiny` for another model)."""
    from trueflow.models.qwen_image.presets import build_transformer, transformer_config

    config = transformer_config("tiny")
    return config, build_transformer(config, seed=0, dtype=BF16).state_dict()


@pytest.fixture(scope="session")
def ltx2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ONE tiny LTX-2.3 pipeline folder (seed 0, fp32), written once and shared read-only."""
    from trueflow.models.ltx2.checkpoint import write_checkpoint

    out = tmp_path_factory.mktemp("ltx2_tiny")
    write_checkpoint(out, "tiny", 0, torch.float32, "cpu")
    return out


@pytest.fixture(scope="session")
def sd3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ONE tiny SD3.5 pipeline folder (seed 0, fp32), written once and shared read-only."""
    from trueflow.checkpoints import init_checkpoint

    return init_checkpoint(tmp_path_factory.mktemp("sd3") / "tiny", family="sd3")


@pytest.fixture(scope="session")
def flux_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ONE tiny FLUX.1-dev pipeline folder (seed 0, fp32), written once and shared read-only."""
    from trueflow.checkpoints import init_checkpoint

    return init_checkpoint(tmp_path_factory.mktemp("flux") / "tiny", family="flux")


@pytest.fixture(scope="session")
def wan_a14b_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ONE tiny Wan2.2-A14B pipeline folder (two experts, boundary 0.875; seed 0, fp32), written once, read-only."""
    from trueflow.models.wan.checkpoint import write_checkpoint

    out = tmp_path_factory.mktemp("wan_a14b")
    write_checkpoint(out, "tiny", 0, torch.float32, "cpu")
    return out


@pytest.fixture(scope="session")
def wan_ti2v_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ONE tiny Wan2.2-TI2V-5B pipeline folder (one transformer, per-token timesteps, the z48 VAE; seed 0, fp32)."""
    from trueflow.models.wan.checkpoint import write_checkpoint

    out = tmp_path_factory.mktemp("wan_ti2v")
    write_checkpoint(out, "tiny_ti2v", 0, torch.float32, "cpu")
    return out


# LTX2Pipeline with guidance, STG, modality guidance and rescale off for both streams: the audio scales default to
# the video ones only when None, and the pipeline's audio defaults are 7 / 1 / 3 / 0.7.
LTX2_UNGUIDED = dict(guidance_scale=1.0, audio_guidance_scale=1.0, stg_scale=0.0, audio_stg_scale=0.0,
                     modality_scale=1.0, audio_modality_scale=1.0, guidance_rescale=0.0, audio_guidance_rescale=0.0)


def copy_transformer(checkpoint: Path, dst: Path) -> Path:
    """A writable copy of a checkpoint's transformer/ folder under `dst` (for tests that break files)."""
    shutil.copytree(checkpoint / "transformer", dst / "transformer")
    return dst


def write_transformer_checkpoint(dst: Path, config: dict, seed: int = 0) -> Path:
    """A checkpoint folder holding only transformer/ (diffusers' save_pretrained of a seeded random model)."""
    from trueflow.models import family_for_config

    family_for_config(config).presets.build_transformer(config, seed=seed).save_pretrained(dst / "transformer",
                                                                                          safe_serialization=True)
    return dst


# -- numerics ------------------------------------------------------------------------------------------------
def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.is_complex() or b.is_complex():
        return (a.to(torch.complex128) - b.to(torch.complex128)).abs().max().item()
    return (a.float() - b.float()).abs().max().item()


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Bits equal: same dtype, same shape, torch.equal (the diff is only reported for the failure message)."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.equal(actual, expected), \
        f"{what}: not bitwise equal, max abs diff {max_abs_diff(actual, expected):.3e}"


def assert_differs(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """The negative control: the two are NOT bitwise equal (and really differ in value, not just -0/+0)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert not torch.equal(actual, expected), f"{what}: expected a difference, got bitwise equality"
    assert max_abs_diff(actual, expected) > 0, f"{what}: differs only in the sign of zeros"


def randn(shape, seed: int, std: float = 1.0, mean: float = 0.0, dtype: torch.dtype = BF16) -> torch.Tensor:
    """Seeded N(mean, std²) drawn in fp32 from a local generator, then cast (the global RNG is left alone)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tuple(shape), generator=g) * std + mean).to(dtype)


# -- forwards of both sides on a ParityProbe's inputs ------------------------------------------------------
@torch.no_grad()
def engine_forward(engine, inputs: dict) -> torch.Tensor:
    return engine(hidden_states=inputs["hidden_states"], timestep=inputs["timestep"], grid=inputs["grid"],
                  **inputs["cond"])


def pipeline_timestep(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The transformer's timestep input for schedule timesteps `t` (fp32, 0..1000), written as QwenImagePipeline
    writes it: `timestep = t.expand(B).to(latents.dtype)`, then `transformer(timestep=timestep / 1000, ...)`."""
    return t.to(dtype) / 1000


@torch.no_grad()
def train_forward(probe) -> torch.Tensor:
    """The train side's forward (diffusers + PEFT, `_native_flash`) on the probe's inputs, with the timestep as
    the pipeline passes it (the engine takes the schedule's fp32 timestep as is)."""
    from trueflow.train import model as train_model

    i = probe.inputs
    return train_model.train_forward(probe.family, probe.train, i["hidden_states"],
                                     pipeline_timestep(i["timestep"], probe.spec.torch_dtype()), i["grid"], i["cond"],
                                     backend=probe.train_backend)


class LoraMasters:
    """fp32 master copies of a PEFT model's LoRA parameters (docs/precision.md): a stand-in optimizer step adds seeded
    noise to the masters and writes the rounded values into the model's bf16 compute copies, in place."""

    def __init__(self, model: torch.nn.Module):
        self.params = {n: p for n, p in sorted(model.named_parameters()) if ".lora_" in n}
        assert self.params, "the model has no LoRA parameters"
        self.masters = {n: p.detach().float().clone() for n, p in self.params.items()}

    @torch.no_grad()
    def step(self, seed: int, std: float) -> None:
        g = torch.Generator().manual_seed(seed)
        for n, p in self.params.items():
            self.masters[n] += torch.randn(p.shape, generator=g) * std
            p.copy_(self.masters[n].to(p.dtype))


def replay_snapshot_step(snapshot: Path, m: int, t: int, script: int | str = 0) -> dict:
    """Run a replay script of docs/snapshot.md as written, on step `t` of microgroup `m`, in this process (so with
    the test's thread count); returns the JSON line it prints. `script`: its index (0: Qwen-Image, 1: LTX-2.3) or its
    file name, the first word of its docstring (e.g. "replay_flux_step.py")."""
    import contextlib
    import io
    import json
    import re
    import runpy
    import sys

    doc = Path(__file__).parent.parent / "docs" / "snapshot.md"
    scripts = re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)
    code = scripts[script] if isinstance(script, int) else next(s for s in scripts if s.startswith(f'"""{script} '))
    path = snapshot.parent / f"replay_step_{script}.py"
    path.write_text(code)
    argv, out = sys.argv, io.StringIO()
    try:
        sys.argv = [str(path), str(snapshot), str(m), str(t)]
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(path), run_name="__main__")
    finally:
        sys.argv = argv
    return json.loads(out.getvalue().strip().splitlines()[-1])



# -- recorded runs ---------------------------------------------------------------------------------------------
GOLDEN = Path(__file__).parent / "golden"


def assert_matches_recorded_run(run: Path, name: str) -> None:
    """`run` (a finished `trueflow train` folder) reproduces the run recorded in tests/golden/NAME bit for bit: every
    metrics line less its wall-clock times, and the final LoRA masters tensor by tensor. The recording was made by the
    code at 7c92e73 (before the placement/layers/spec refactor) with `TRUEFLOW_RECORD_GOLDEN=1`, which writes instead
    of comparing; a CPU of another instruction set may round bf16 GEMMs otherwise, so it is compared only on the
    capability it was recorded on."""
    import json

    from safetensors.torch import load_file, save_file

    from trueflow.train.checkpoint import LORA_FILE, latest_checkpoint
    from trueflow.train.metrics import TIMING_KEYS, read_metrics

    rows = [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in read_metrics(run / "metrics.jsonl")]
    lora = load_file(str(latest_checkpoint(run) / LORA_FILE))
    where = GOLDEN / name
    capability = torch.backends.cpu.get_cpu_capability()
    if os.environ.get("TRUEFLOW_RECORD_GOLDEN") == "1":
        where.mkdir(parents=True, exist_ok=True)
        (where / "metrics.json").write_text(json.dumps({"cpu_capability": capability, "threads": TEST_THREADS,
                                                        "rows": rows}, indent=1) + "\n")
        save_file({k: v.contiguous() for k, v in lora.items()}, str(where / "lora.safetensors"))
        return
    recorded = json.loads((where / "metrics.json").read_text())
    if recorded["cpu_capability"] != capability:
        pytest.skip(f"{name} was recorded on a {recorded['cpu_capability']} CPU, this one is {capability}")
    assert rows == recorded["rows"], f"{name}: the metrics differ from the recorded run"
    expected = load_file(str(where / "lora.safetensors"))
    assert sorted(lora) == sorted(expected), f"{name}: other LoRA tensors than the recorded run's"
    for k in expected:
        assert_bitwise(lora[k], expected[k], f"{name}: {k}")


# -- the sockets a run listens on (from /proc: no psutil needed) ----------------------------------------------------
def process_tree(root: int) -> set[int]:
    """`root` and every live process below it."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    tree, grew = {root}, True
    while grew:
        below = {pid for pid, ppid in parents.items() if ppid in tree} - tree
        tree |= below
        grew = bool(below)
    return tree & (set(parents) | {root})


def _ip(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hex_address)  # /proc/net/tcp*: 32-bit words in host (little-endian) order
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(raw)


def listening(pids: set[int]) -> set[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket the processes `pids` listen on."""
    owner = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    owner[link[8:-1]] = pid
        except OSError:  # a process that ended meanwhile
            continue
    out = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in owner:  # LISTEN
                address, port = cols[1].split(":")
                out.add((owner[cols[9]], str(_ip(address)), int(port, 16)))
    return out


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return ip.is_loopback or mapped is not None and mapped.is_loopback


def watch_listeners(proc, until, seen: set | None = None, timeout: float = 300.0) -> set[tuple[int, str, int]]:
    """The sockets `proc`'s process tree listens on, polled until `until()` holds or `proc` ends (within
    `timeout`); added to `seen`, which is returned."""
    seen = set() if seen is None else seen
    deadline = time.monotonic() + timeout
    while proc.poll() is None and not until():
        assert time.monotonic() < deadline, "the run did not get there in time"
        seen |= listening(process_tree(proc.pid))
        time.sleep(0.1)
    return seen


def assert_loopback_only(seen: set[tuple[int, str, int]]) -> None:
    """Every listener of a run on loopback, naming the process of any that is not."""
    assert seen, "no listening socket was seen"
    wide = sorted({(pid, address, port) for pid, address, port in seen if not is_loopback(address)})
    names = {}
    for pid, _, _ in wide:
        try:
            names[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120].decode()
        except OSError:
            names[pid] = "?"
    assert not wide, "listening beyond loopback: " + "; ".join(f"{a}:{p} ({names[pid]})" for pid, a, p in wide)
