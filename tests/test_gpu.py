"""GPU parity (issue B.6) on whatever CUDA device is present; skipped without one. The full-size run with its
ablation table is scripts/gpu_parity.py (too heavy for a test)."""

import pytest
import torch

from trueflow.parity.probe import ParityProbe, ProbeSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("batch", [1, 4])
def test_tiny_bitwise_on_cuda_with_flash_pinned(tiny_checkpoint, batch):
    probe = ParityProbe(ProbeSpec(checkpoint=str(tiny_checkpoint), batch=batch, text_len=33, lora_rank=8,
                                  device="cuda"))
    on, _ = probe.run("qwen_image")
    assert on.train_attention_backend == "_native_flash" and on.engine_attention_backend == "flash"
    assert on.bitwise_equal and on.model_output_max_abs_diff == 0.0
    engine = probe.build_engine("qwen_image")
    for step in range(3):
        probe.step_lora(engine, seed=step)
        assert probe.compare_engine(engine, "qwen_image")[0].bitwise_equal
    off, _ = probe.run("none")
    assert not off.bitwise_equal and off.model_output_max_abs_diff > 0


def test_real_width_block_bitwise_on_cuda():
    probe = ParityProbe(ProbeSpec(random_size="one_block", batch=4, text_len=128, resolution=512, lora_rank=64,
                                  device="cuda"))
    assert probe.run("qwen_image")[0].bitwise_equal
    for patch in ("contiguous_split", "attention_kernel"):
        assert not probe.run("qwen_image", (patch,))[0].bitwise_equal, patch


def test_a_cuda_lora_crosses_to_a_server_by_cuda_ipc(tiny_checkpoint):
    """`push_lora` of CUDA tensors to `trueflow serve --device cuda` in another process: the payload's CUDA handles
    (torch's own reduction, as plain fields, its refcount file checked) open there, and the server holds the LoRA."""
    from test_server import make_lora, serve_subprocess
    from trueflow.engine import wire
    from trueflow.placement.http import push_lora
    from trueflow.sync.buckets import pack
    from trueflow.sync.checksum import tensors_checksum
    from trueflow.sync.shm import SharedSegments

    lora = {k: v.cuda() for k, v in make_lora(0).items()}
    handles = wire.parse_handles(wire.dump_handles(pack(lora), SharedSegments(), scale=1.0))
    assert handles.cuda and all(b.cuda is not None for b in handles.buckets)
    with serve_subprocess(tiny_checkpoint, "--device", "cuda") as (url, _proc):
        assert push_lora(url, lora, 1.0) == tensors_checksum(make_lora(0))
