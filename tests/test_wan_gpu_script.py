"""scripts/gpu_wan.py's CPU smoke path: its full-size parts (parity per expert, speed) on the tiny architecture and a
tiny video, so the GPU run cannot fail on the script itself. The script's claims (parity 0.0 after 0, 1 and 2 LoRA
updates with the group, not without it) hold here too."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_wan.py"


def test_the_gpu_script_runs_on_the_tiny_architecture(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_wan", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "wan_gpu.json"
    assert script.main(["--out", str(out), "--size", "tiny", "--device", "cpu", "--parts", "parity,speed",
                        "--experts", "transformer_2", "--speed-expert", "transformer_2", "--height", "32", "--width",
                        "32", "--frames", "5", "--speed-frames", "5", "--text-len", "16", "--reps", "1"]) == 0
    report = json.loads(out.read_text())
    assert report["ok"] and [r["bitwise_equal"] for r in report["transformer_2"]["rows"]] == [True, True, True, False]
    assert {"diffusers", "engine_parity", "engine_fast"} <= set(report["speed"])
    with pytest.raises(SystemExit) as exit_:  # argparse's one line
        script.main(["--out", str(out), "--parts", "parity,nothing"])
    assert exit_.value.code == 2
