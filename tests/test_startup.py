"""A user error is refused before anything heavy loads, checked without a clock: one fresh interpreter runs each
typical mistake through `trueflow.cli.main` and reads `sys.modules` at the refusal. Mistakes that need no model family
(a flag, a missing file or folder) import no torch at all; the rest read the family registry (model_index.json and
the families' specs: torch's core) and import none of torch's heavy parts (the compiler, FSDP, DTensor), Triton,
diffusers, transformers or PEFT. Each refusal is one line, exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("diffusers", "transformers", "peft", "triton", "torch._dynamo", "torch._inductor", "torch.distributed.fsdp",
         "torch.distributed.tensor", "fastapi", "uvicorn", "matplotlib")
# In a fresh interpreter: each argv through the CLI, then what is imported at that point.
SCRIPT = r"""
import contextlib, io, json, sys
from trueflow.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse's own refusals
            rc = e.code
    out.append({"argv": argv, "rc": rc, "err": err.getvalue(), "modules": sorted(sys.modules)})
print(json.dumps(out))
"""


def refusals(cases: list[list[str]]) -> list[dict]:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(cases)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_mistakes_are_refused_before_anything_heavy_loads(tiny_checkpoint, ltx2_checkpoint, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    q, ltx, nowhere = str(tiny_checkpoint), str(ltx2_checkpoint), str(tmp_path / "nowhere")
    no_torch = [  # the order matters: a case that imported torch would hide the next one's imports
        ["train", "--num-rollout", "2"],  # a prefix of --num-rollouts
        ["generate", "--checkpoint", q, "--prompt", "p", "--output-dir", "o", "--sampler", "euler"],
        ["generate", "--checkpoint", nowhere, "--prompt", "p", "--output-dir", "o"],
        ["parity", "--checkpoint", nowhere],
        ["init-checkpoint", "--output-dir", str(tmp_path / "full")],
        ["serve", "--checkpoint", q, "--max-batch", "4"],
    ]
    light = [
        ["generate", "--checkpoint", ltx, "--prompt", "p", "--output-dir", "o", "--patch-group", "qwen_image"],
        ["generate", "--checkpoint", q, "--prompt", "p", "--output-dir", "o", "--resolution", "70"],
        ["generate", "--checkpoint", q, "--prompt", "p", "--output-dir", "o", "--lora", nowhere],
        ["generate", "--checkpoint", q, "--prompt", "p", "--output-dir", "o", "--disable-patch", "bogus"],
        ["generate", "--checkpoint", q, "--prompt", "p", "--output-dir", "o", "--patch-group", "none",
         "--disable-patch", "rms_norm"],
        ["generate", "--checkpoint", q, "--prompt", "p", "--output-dir", "o", "--threads", "0"],
        ["generate", "--checkpoint", q, "--prompt", "p", "--output-dir", "o", "--n-samples-per-prompt", "0"],
        ["generate", "--checkpoint", q, "--prompt", "p", "--output-dir", str(run / "metrics.jsonl")],
        ["generate", "--checkpoint", q, "--prompt", "p", "--output-dir", "o", "--ema"],
        ["parity", "--checkpoint", q, "--resolution", "70"],
        ["parity", "--checkpoint", q, "--batch", "0"],
        ["parity", "--checkpoint", q, "--train-micro-batch", "0"],
        ["generate", "--checkpoint", q, "--prompt", "p", "--output-dir", "o", "--image", nowhere],  # Qwen takes none
        ["serve", "--checkpoint", q, "--max-steps", "0"],
        ["serve", "--checkpoint", q, "--weights-root", nowhere],
        ["serve", "--checkpoint", ltx, "--patch-group", "qwen_image"],
        ["train", "--checkpoint", q, "--patch-group", "ltx"],
        ["train", "--checkpoint", q, "--resolution", "70"],
        ["train", "--checkpoint", q, "--output-dir", str(run)],
        ["train", "--checkpoint", q, "--prompts", nowhere],
        ["train", "--checkpoint", nowhere],
        ["train", "--config", nowhere],
        ["init-checkpoint", "--family", "nosuch", "--output-dir", str(tmp_path / "new")],
        ["patches", "--family", "ltx2", "--patch-group", "qwen_image"],
        ["reward", "--reward", "redness", "--image", nowhere, "--prompt", "p"],
        ["reward", "--reward", "redness", "--image", str(run / "metrics.jsonl"), "--prompt", "p"],
        ["reward-serve", "--reward", "redness", "--max-batch", "0"],
        ["reward-serve", "--reward", "redness", "--max-wait-ms", "-1"],
    ]
    results = refusals(no_torch + light)
    for i, r in enumerate(results):
        assert r["rc"] == 2, r
        lines = r["err"].strip().splitlines()
        assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in r["err"], r
        heavy = [m for m in r["modules"] if m.startswith(HEAVY)]
        assert not heavy, (r["argv"], lines[0], heavy[:5])
        if i < len(no_torch):
            assert "torch" not in r["modules"], (r["argv"], lines[0])
    assert "torch" in results[-1]["modules"]  # the family registry loaded torch's core, as said


def test_the_check_sees_a_refusal_that_comes_after_a_heavy_import(tiny_checkpoint, tmp_path):
    """The failing side: `--steps 1` is refused by the schedule itself, which diffusers computes."""
    (r,) = refusals([["train", "--checkpoint", str(tiny_checkpoint), "--output-dir", str(tmp_path / "r"),
                      "--steps", "1"]])
    assert r["rc"] == 2 and "--steps 1" in r["err"], r
    assert [m for m in r["modules"] if m.startswith(HEAVY)]
