"""scripts/mutate_rl.py in CI: every mutation of trueflow/rl is killed by the float64-oracle tests, and the
script itself can fail (a neutral mutation survives, a stale one is reported)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "mutate_rl.py"


def _load():
    spec = importlib.util.spec_from_file_location("mutate_rl", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_every_mutation_of_rl_is_killed():
    mutate_rl = _load()
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    n = len(mutate_rl.MUTATIONS)
    assert f"{n}/{n} mutations killed" in proc.stdout


def test_the_script_reports_a_surviving_and_a_stale_mutation(tmp_path: Path):
    mutate_rl = _load()
    tests = [str(SCRIPT.parents[1] / "tests" / "test_rl_loss.py")]
    neutral = ("neutral", "trueflow/rl/loss.py", 'SAMPLERS = ("sde", "cps")', "SAMPLERS = ('sde', 'cps')")
    killed, line = mutate_rl.check(tmp_path, 0, neutral, tests)
    assert not killed and line.startswith("SURVIVED")
    stale = ("stale", "trueflow/rl/loss.py", "no such text", "x")
    killed, line = mutate_rl.check(tmp_path, 1, stale, tests)
    assert not killed and line.startswith("NOT APPLIED")
