"""Shared fixtures and helpers: one tiny checkpoint per session, bitwise assertions, forwards of both sides.

Every parity assertion in these tests is `torch.equal` (bits), and every positive test shows its failing side
too. On CPU both sides must run with the same intra-op thread count (parity condition 9, docs/patch-group.md),
so the count is
pinned once here, for the whole session, before any test runs.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

TEST_THREADS = 2
torch.set_num_threads(TEST_THREADS)

BF16 = torch.bfloat16
EPS = 1e-6  # every norm of Qwen-Image's transformer uses eps 1e-6
TRUEFLOW_EXE = Path(sys.executable).parent / "trueflow"  # the venv's console script


# -- the batch-invariant mode ----------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _batch_invariant_mode_left_off():
    """No test leaves the batch-invariant mode's process-wide GEMM overrides on for the next one (an engine built in
    the mode turns them on): everything outside the mode keeps the stock kernels, and its bits."""
    yield
    from trueflow.kernels import batch_invariant

    batch_invariant.disable()


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

    family_for_config(config).presets.build_transformer(config, seed=seed).save_pretrained(dst / "transformer", safe_serialization=True)
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
    assert torch.equal(actual, expected), f"{what}: not bitwise equal, max abs diff {max_abs_diff(actual, expected):.3e}"


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


def replay_snapshot_step(snapshot: Path, m: int, t: int, script: int = 0) -> dict:
    """Run the `script`-th replay script of docs/snapshot.md (0: Qwen-Image, 1: LTX-2.3) as written, on step `t` of
    microgroup `m`, in this process (so with the test's thread count); returns the JSON line it prints."""
    import contextlib
    import io
    import json
    import re
    import runpy
    import sys

    doc = Path(__file__).parent.parent / "docs" / "snapshot.md"
    code = re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)[script]
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
