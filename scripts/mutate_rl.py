"""Mutation check of trueflow/rl: every mutation below, applied to a temporary copy of the package, must make one
of the float64-oracle tests (tests/test_rl_*.py, those not marked slow) fail. Exits 1 if a mutation survives, no
longer applies (its text is not found exactly once), or breaks the run instead of failing a test; exits 0 when
every one is killed.

    python scripts/mutate_rl.py            # all mutations
    python scripts/mutate_rl.py -k kl      # those whose name contains "kl"

The tests run with the copy first on the import path (PYTHONPATH and the working directory); a baseline run
checks that the copy is what `import trueflow` loads and that the unmutated copy passes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RL = "trueflow/rl/"

# (name, file, text, replacement): each text must occur exactly once in its file.
MUTATIONS: list[tuple[str, str, str, str]] = [
    ("ppo: max -> min", RL + "loss.py", "per_pair = torch.maximum(", "per_pair = torch.minimum("),
    ("ppo: advantage sign", RL + "loss.py", "torch.maximum(-advantages * ratio, -advantages * clipped)",
     "torch.maximum(advantages * ratio, advantages * clipped)"),
    ("ppo: clip bound 1+eps -> 1+2eps", RL + "loss.py", "1.0 - clip_range, 1.0 + clip_range)",
     "1.0 - clip_range, 1.0 + 2 * clip_range)"),
    ("ppo: clamp bounds swapped", RL + "loss.py", "torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)",
     "torch.clamp(ratio, 1.0 + clip_range, 1.0 - clip_range)"),
    ("ppo: ratio inverted", RL + "loss.py", "torch.exp(log_prob - old_log_prob)", "torch.exp(old_log_prob - log_prob)"),
    ("ppo: weight ignored", RL + "loss.py", "(per_pair if weight is None else weight * per_pair)", "per_pair"),
    ("kl: the 2 in the denominator", RL + "loss.py", "sq / (2 * torch.where(defined, var, 1.0))",
     "sq / torch.where(defined, var, 1.0)"),
    ("kl: |dt| factor on CPS too", RL + "loss.py", 'if sampler == "sde":', "if sampler in SAMPLERS:"),
    ("kl: no |dt| factor on the SDE", RL + "loss.py", 'if sampler == "sde":', 'if sampler == "ode":'),
    ("kl: last step not excluded", RL + "loss.py", "defined = var > 0", "defined = var >= 0"),
    ("adv: sign", RL + "advantages.py", "return (centred / (std + STD_EPS))", "return (-centred / (std + STD_EPS))"),
    ("adv: std epsilon 1e-4 -> 1e-6", RL + "advantages.py", "STD_EPS = 1e-4", "STD_EPS = 1e-6"),
    ("adv: global vs group std", RL + "advantages.py", "if global_std:", "if not global_std:"),
    ("adv: clip bound", RL + "advantages.py", ".clamp(-clip_max, clip_max)", ".clamp(-clip_max, 2 * clip_max)"),
    ("adv: unbiased group std", RL + "advantages.py", "/ count).sqrt()", "/ (count - 1).clamp_min(1)).sqrt()"),
    ("adv: unbiased global std", RL + "advantages.py", ".std(unbiased=False)", ".std(unbiased=True)"),
    ("adv: skipped samples counted in the mean", RL + "advantages.py",
     "count = valid.sum(dim=1, keepdim=True).clamp_min(1)", "count = torch.full_like(r[:, :1], n_per_prompt)"),
    ("guard: bias sign", RL + "grpo_guard.py", "old_log_prob.float() + bias)", "old_log_prob.float() - bias)"),
    ("guard: the 2 in the bias", RL + "grpo_guard.py", "/ (2 * s**2)", "/ s**2"),
    ("guard: outer scale dropped", RL + "grpo_guard.py", "torch.exp(s * (", "torch.exp(1 * ("),
    ("guard: bias without gradient", RL + "grpo_guard.py", "bias = ((mean.float() - old_mean.float())",
     "bias = ((mean.float().detach() - old_mean.float())"),
    ("guard: step weight 1/sqrt|dt|", RL + "grpo_guard.py", "1.0 / dt.float().abs()", "1.0 / dt.float().abs().sqrt()"),
    ("nft: implicit positive mix swapped", RL + "nft.py", "v_pos = (1 - beta) * v_old + beta * v",
     "v_pos = beta * v_old + (1 - beta) * v"),
    ("nft: beta's sign in the negative policy", RL + "nft.py", "v_neg = (1 + beta) * v_old - beta * v",
     "v_neg = (1 + beta) * v_old + beta * v"),
    ("nft: r and 1-r swapped", RL + "nft.py", "(r * branch(v_pos) + (1 - r) * branch(v_neg))",
     "((1 - r) * branch(v_pos) + r * branch(v_neg))"),
    ("nft: 1/beta dropped", RL + "nft.py", "branch(v_neg)) / beta", "branch(v_neg))"),
    ("nft: adaptive weight not stop-gradient", RL + "nft.py", "_mean(err.detach().abs())", "_mean(err.abs())"),
    ("nft: x0 prediction sign", RL + "nft.py", "err = x_t - tt * u - x0.float()", "err = x_t + tt * u - x0.float()"),
    ("nft: forward process reversed", RL + "nft.py", "(1 - tt) * x0.float() + tt * noise.float()",
     "tt * x0.float() + (1 - tt) * noise.float()"),
    ("nft: optimality offset", RL + "nft.py", "0.5 + 0.5 * (advantages", "0.5 * (advantages"),
    ("decoupled: truncation from below", RL + "decoupled.py", "torch.clamp(ratio, max=cap)",
     "torch.clamp(ratio, min=cap)"),
    ("decoupled: weight inverted", RL + "decoupled.py",
     "proximal_log_prob.detach().float() - behaviour_log_prob.float()",
     "behaviour_log_prob.float() - proximal_log_prob.detach().float()"),
    ("decoupled: weight with gradient", RL + "decoupled.py", "torch.exp(proximal_log_prob.detach().float()",
     "torch.exp(proximal_log_prob.float()"),
    ("decoupled: weight dropped", RL + "decoupled.py", "clipped_surrogate(ratio, advantages, clip_range, w)",
     "clipped_surrogate(ratio, advantages, clip_range, weight)"),
    ("decoupled: pair weight dropped", RL + "decoupled.py", "else is_weight.detach() * weight",
     "else is_weight.detach()"),
    ("decoupled: proximal not held fixed", RL + "decoupled.py", "torch.exp(log_prob - log_prob.detach())",
     "torch.exp(log_prob - log_prob)"),
]


def rl_tests() -> list[str]:
    return [str(p) for p in sorted((REPO / "tests").glob("test_rl_*.py")) if p.name != "test_rl_mutations.py"]


def make_copy(root: Path, mutation: tuple[str, str, str, str] | None) -> None:
    """`root/trueflow`: a copy of the package, with `mutation` applied. Raises ValueError if it does not apply."""
    shutil.copytree(REPO / "trueflow", root / "trueflow", ignore=shutil.ignore_patterns("__pycache__"))
    if mutation is not None:
        name, rel, old, new = mutation
        path = root / rel
        text = path.read_text()
        if text.count(old) != 1:
            raise ValueError(f"{name}: {old!r} occurs {text.count(old)} times in {rel}, not once (stale mutation)")
        path.write_text(text.replace(old, new))


def run(root: Path, args: list[str]) -> subprocess.CompletedProcess:
    # The copy first: as the working directory of `python -m` and on PYTHONPATH (ahead of the editable install).
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True, text=True, timeout=600)


def pytest_args(tests: list[str]) -> list[str]:
    # Those marked slow (a whole training run) are integration tests, kept out of these 30 runs.
    return ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=", "-m", "not slow", *tests]


def own_tests_first(tests: list[str], rel: str) -> list[str]:
    """`tests` with the mutated module's own file (trueflow/rl/loss.py: test_rl_loss.py) first: with -x the run
    stops at the first failure, most often there, before another file's slower test (one imports the trainer)."""
    own = f"test_rl_{Path(rel).stem}.py"
    return sorted(tests, key=lambda t: Path(t).name != own)


def check(tmp: Path, index: int, mutation: tuple[str, str, str, str], tests: list[str]) -> tuple[bool, str]:
    """(killed, what happened) for one mutation."""
    root = tmp / f"m{index}"
    try:
        make_copy(root, mutation)
    except ValueError as e:
        return False, f"NOT APPLIED  {e}"
    proc = run(root, pytest_args(own_tests_first(tests, mutation[1])))
    failed = [line for line in proc.stdout.splitlines() if line.startswith("FAILED ")]
    if proc.returncode == 1 and failed:
        return True, f"killed       {mutation[0]}  <- {failed[0].split(' - ')[0].rsplit('/', 1)[-1]}"
    if proc.returncode == 0:
        return False, f"SURVIVED     {mutation[0]}"
    tail = proc.stdout[-2000:] + proc.stderr[-2000:]
    return False, f"BROKE        {mutation[0]} (pytest exit {proc.returncode}):\n{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", default="", help="only the mutations whose name contains this text")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="mutations run at once")
    args = parser.parse_args()
    tests = rl_tests()
    chosen = [m for m in MUTATIONS if args.k in m[0]]
    if not tests or not chosen:
        print(f"mutate_rl: nothing to run ({len(tests)} test files, {len(chosen)} mutations)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="mutate_rl_") as tmp_name:
        tmp = Path(tmp_name)
        base = tmp / "baseline"
        make_copy(base, None)
        where = run(base, ["-c", "import trueflow.rl.loss as m; print(m.__file__)"])
        if where.returncode != 0 or not Path(where.stdout.strip()).is_relative_to(base):
            print(f"mutate_rl: the tests would not import the copy: {where.stdout.strip()}{where.stderr}",
                  file=sys.stderr)
            return 1
        baseline = run(base, pytest_args(tests))
        if baseline.returncode != 0:
            print(f"mutate_rl: the unmutated tests fail:\n{baseline.stdout[-3000:]}{baseline.stderr[-3000:]}",
                  file=sys.stderr)
            return 1
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            results = list(pool.map(lambda im: check(tmp, im[0], im[1], tests), enumerate(chosen)))
    for _, line in results:
        print(line)
    survivors = sum(not killed for killed, _ in results)
    print(f"{len(results) - survivors}/{len(results)} mutations killed by {len(tests)} test files")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
