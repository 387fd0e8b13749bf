"""`trueflow train` on bad input: one line on stderr naming the fix, exit status 2, no traceback, nothing lost.
Settings fail before any model loads; a failing reward stops the run with its last checkpoint intact; a resume
falls back past a damaged checkpoint and refuses settings that change the run's math."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trueflow.cli import main
from trueflow.train import checkpoint as ckpt
from trueflow.train.config import TrainConfig, resume_changes
from trueflow.train.lock import LOCK_FILE
from trueflow.train.run import DEFAULT_CHECKPOINT
from trueflow.train.metrics import read_metrics

FAST = ["--steps", "2", "--num-sde-steps", "1", "--rollout-batch-size", "1", "--n-samples-per-prompt", "2",
        "--rollout-microgroup-size", "2", "--micro-batch-size-sample", "2", "--sample-every", "0"]
REWARD_MODULE = "trueflow_test_reward"
# A custom reward that misbehaves when told to (the spec stays the same, so a resume may use it).
REWARD_SOURCE = '''
import os
import torch


def score(images, prompts):
    mode = os.environ.get("TRUEFLOW_TEST_REWARD", "")
    scores = images.float().mean(dim=(1, 2, 3)) / 255
    if mode == "nan":
        scores[0] = float("nan")
    if mode == "count":
        scores = scores[:-1]
    return scores
'''


def train(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(["train", *argv])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, err: str, *fragments: str) -> str:
    assert rc == 2, err
    assert "Traceback" not in err, err
    errors = [line for line in err.strip().splitlines() if "error:" in line]
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err
    for f in fragments:
        assert f in errors[0], (f, errors[0])
    return errors[0]


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# -- settings: refused before anything loads ------------------------------------------------------------------------
@pytest.mark.parametrize("text, fragments", [
    ("rollout:\n  steps: ten\n", ("rollout.steps", "'ten'", "integer", "--rollout.steps")),
    ("steps: ten\n", ("rollout.steps", "'ten'", "integer")),  # the flat layout: the same error
    ("optim:\n  lr: fast\n", ("optim.lr", "'fast'", "number", "--optim.lr")),
    ("- steps: 3\n- lr: 0.1\n", ("expected a mapping", "got a list")),
    ("rollout:\n  steps: [3\n", ("not valid YAML", "line 3")),
    ("rollout: 3\n", ("rollout must be a section",)),
    ("rollout:\n  stepz: 3\n", ("unknown setting", "rollout.stepz")),
    ("optim:\n  lr: .nan\n", ("optim.lr", "finite")),
    ("rollout:\n  n_samples_per_prompt: 6\n", ("multiple of --rollout-microgroup-size",)),
])
def test_a_bad_settings_file_is_one_line(tmp_path, capsys, text, fragments):
    (tmp_path / "c.yaml").write_text(text)
    t0 = time.perf_counter()
    rc, out, err = train(capsys, "--config", str(tmp_path / "c.yaml"), "--output-dir", str(tmp_path / "run"))
    assert time.perf_counter() - t0 < 1.0, "settings are checked before anything loads"
    assert_one_line_error(rc, err, *fragments)
    assert out == "" and not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv, fragments", [
    (["--steps", "ten"], ("rollout.steps", "'ten'")),
    (["--rollout.steps", "0"], ("rollout.steps", "greater than or equal to 1")),
    (["--sampler", "ode"], ("rollout.sampler", "'sde' or 'cps'")),
    (["--stepz", "3"], ("unrecognized arguments: --stepz",)),
    (["--config", "no/such.yaml"], ("--config no/such.yaml", "no such file")),
    (["--reward-placement", "engine"], ("needs --engine-process",)),
    (["--num-sde-steps", "3", "--steps", "2"], ("--num-sde-steps 3 must be in 1..--steps (2)",)),
    (["--lora-target-modules", "to_q,,to_k"], ("model.lora_target_modules", "names must not be empty")),
    (["--device", "foo"], ("--device foo: not a torch device",)),
    (["--fsdp-attention-backend", "bogus"], ("--fsdp-attention-backend bogus", "use _native_flash")),
    (["--patch-group", "bogus"], ("unknown patch group 'bogus'", "qwen_image")),
    (["--disable-patch", "bogus"], ("--disable-patch bogus: not a patch of group 'qwen_image'", "rms_norm")),
    # every float in range: LTX-2.3's fps took 1e-30 and 1e308
    (["--fps", "1e-30"], ("rollout.fps", "greater than or equal to 1")),
    (["--fps", "1e308"], ("rollout.fps", "less than or equal to 1000")),
    (["--noise-level", "1e300"], ("rollout.noise_level", "less than or equal to 100")),
    (["--cfg-scale", "1e9"], ("rollout.cfg_scale", "less than or equal to 100")),
    (["--lr", "3"], ("optim.lr", "less than or equal to 1")),
    (["--clip-range", "1"], ("algorithm.clip_range", "less than 1")),
    (["--max-grad-norm", "1e300"], ("optim.max_grad_norm", "less than or equal to 1000000")),
])
def test_a_bad_flag_is_one_line(tmp_path, capsys, argv, fragments):
    rc, _, err = train(capsys, *argv, "--output-dir", str(tmp_path / "run"))
    assert_one_line_error(rc, err, *fragments)


def test_wandb_without_its_package(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    rc, _, err = train(capsys, "--wandb", "--output-dir", str(tmp_path / "run"))
    assert_one_line_error(rc, err, "--wandb needs the wandb package")


def test_a_bad_reward_fails_before_the_engine_loads(tiny_checkpoint, tmp_path, capsys):
    t0 = time.perf_counter()
    rc, _, err = train(capsys, "--checkpoint", str(tiny_checkpoint), "--reward", "bogus", "--output-dir",
                       str(tmp_path / "run"))
    assert_one_line_error(rc, err, "unknown reward 'bogus'", "redness")
    assert time.perf_counter() - t0 < 5.0 and "Loading weights" not in err


def test_a_bad_setting_fails_without_importing_torch(tmp_path):
    """The audit's `lr: fast` failed after 18 s of loading: now nothing heavy is imported before the check."""
    (tmp_path / "c.yaml").write_text("optim:\n  lr: fast\n")
    code = ("import sys; from trueflow.cli import main; rc = main(['train', '--config', sys.argv[1]]); "
            "print('torch' in sys.modules); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "c.yaml")], capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.strip() == "False"
    assert_one_line_error(proc.returncode, proc.stderr, "optim.lr", "'fast'")


def test_prompts_that_are_a_folder(tmp_path, capsys):
    rc, _, err = train(capsys, "--prompts", str(tmp_path), "--output-dir", str(tmp_path / "run"))
    assert_one_line_error(rc, err, f"--prompts {tmp_path}", "a folder", "text file")


def test_paths_that_cannot_be_used(tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    rc, _, err = train(capsys, "--output-dir", str(tmp_path / "a_file" / "run"))
    assert_one_line_error(rc, err, "--output-dir", "cannot create it")
    rc, _, err = train(capsys, "--checkpoint", str(tmp_path), "--output-dir", str(tmp_path / "run"))
    assert_one_line_error(rc, err, f"--checkpoint {tmp_path}: not a diffusers pipeline folder")
    rc, _, err = train(capsys, "--output-dir", "")
    assert_one_line_error(rc, err, "output_dir = ''", "at least 1 character")


def test_an_existing_run_is_kept(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    rc, _, err = train(capsys, "--output-dir", str(run))
    assert_one_line_error(rc, err, "holds a run", "--resume", "--output-dir")
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_one_step_is_refused_for_the_real_reason(tmp_path, capsys):
    """`--steps 1` failed on `--num-sde-steps` (default 2); the default now follows `steps`, and what one step
    really cannot do is Qwen-Image's terminal stretch, which the check computes as the engine will."""
    assert TrainConfig(steps=1).num_sde_steps == 1
    rc, _, err = train(capsys, "--steps", "1", "--output-dir", str(tmp_path / "run"))
    assert_one_line_error(rc, err, "--steps 1", "at least 2 steps")
    assert "num-sde-steps" not in err


# -- resume: damaged checkpoints and changed settings, on checkpoints written by the real writer --------------------
def fake_checkpoint(root: Path, step: int, cfg: TrainConfig) -> Path:
    """A checkpoint as the trainer writes one, of a one-tensor LoRA, recording `cfg`."""
    lora = {"blocks.0.lora_A.weight": torch.full((2, 3), float(step))}
    optim = {"state": {}, "param_groups": [{"lr": cfg.lr, "params": []}]}
    state = {"step": step, "rollout": step, "metrics_lines": step, "config": cfg.to_dict()}
    return ckpt.save_checkpoint(cfg.model_family(), root, step, lora, {"r": 2}, optim, state)


def test_a_truncated_latest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    cfg = TrainConfig(output_dir=str(tmp_path))
    fake_checkpoint(tmp_path, 1, cfg)
    latest = fake_checkpoint(tmp_path, 2, cfg)
    assert ckpt.load_latest(tmp_path)[0] == latest
    for name in ("optimizer.pt", ckpt.LORA_FILE, "trainer_state.json"):
        broken = tmp_path / "broken" / name
        shutil.copytree(tmp_path / "checkpoints", broken / "checkpoints")
        f = broken / "checkpoints" / latest.name / name
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        with pytest.warns(UserWarning, match=f"{latest.name} cannot be read.*resuming from step-000001"):
            path, lora, extra, state = ckpt.load_latest(broken)
        assert path.name == "step-000001" and state["step"] == 1
        assert torch.equal(lora["blocks.0.lora_A.weight"], torch.full((2, 3), 1.0))
    # every checkpoint damaged: an error naming the fix, never a silent start over that would drop the metrics
    for f in (tmp_path / "checkpoints").glob("step-*/optimizer.pt"):
        f.write_bytes(b"")
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint .* reads back.*start over"):
        ckpt.load_latest(tmp_path)


def test_optimizer_state_loads_weights_only(tmp_path):
    """optimizer.pt holds tensors and plain values: a pickled object in it is refused, not run."""
    cfg = TrainConfig(output_dir=str(tmp_path))
    path = fake_checkpoint(tmp_path, 1, cfg)
    _, _, extra, _ = ckpt.load_latest(tmp_path)
    assert set(extra) == {"optimizer", "rng"}
    torch.save({"optimizer": {}, "rng": {}, "payload": _Opaque()}, path / "optimizer.pt")
    with pytest.raises(ckpt.CheckpointError, match="cannot be read"):
        ckpt.load_checkpoint(path)


class _Opaque:
    pass


@pytest.mark.parametrize("argv, shown", [
    (["--lr", "0.1"], "--optim.lr 0.1 (the run has 0.003)"),
    (["--lora-rank", "4"], "--model.lora-rank 4 (the run has 8)"),
    (["--sampler", "cps"], "--rollout.sampler cps (the run has sde)"),
    (["--seed", "1"], "--seed 1 (the run has 0)"),
    (["--checkpoint", "pipe"], "--model.checkpoint pipe (the run has runs/tiny-checkpoint)"),
    (["--resume", "auto", "--lr", "0.1"], "--optim.lr 0.1 (the run has 0.003)"),  # auto: that checkpoint too
])
def test_a_resume_refuses_settings_that_change_the_math(tmp_path, capsys, monkeypatch, argv, shown):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pipe").mkdir()
    # enough for the checks before loading
    (tmp_path / "pipe" / "model_index.json").write_text('{"_class_name": "QwenImagePipeline"}')
    run = tmp_path / "run"
    fake_checkpoint(run, 1, TrainConfig(output_dir=str(run), checkpoint=str(DEFAULT_CHECKPOINT)))
    before = digest(run)
    rc, _, err = train(capsys, "--output-dir", str(run), "--resume", *argv)
    assert_one_line_error(rc, err, f"--resume: {shown} would change the run's math", "trainer_state.json",
                          "new --output-dir")
    assert digest(run) == before


def test_a_resume_may_change_where_and_how_long():
    saved = TrainConfig(output_dir="a").to_dict()
    changed = TrainConfig(output_dir="b", resume=True, num_rollouts=9, save_every=2, tensorboard=True, sample_every=3,
                          debug=True, engine_process=True, reward_placement="engine", gradient_checkpointing=True)
    assert resume_changes(saved, changed) == ([], [])
    assert resume_changes(saved, TrainConfig(device="cuda")) == ([], ["--parallel.device cuda (the run has cpu)"])
    # a setting the checkpoint does not record (older than the setting) counts as its default
    assert resume_changes({k: v for k, v in saved.items() if k != "kl_beta"}, TrainConfig()) == ([], [])
    assert resume_changes({k: v for k, v in saved.items() if k != "kl_beta"}, TrainConfig(kl_beta=0.1))[0]


# -- a failing reward, in a real run ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_run(tiny_checkpoint, tmp_path_factory):
    """A run of 2 rollouts with a checkpoint after each, scored by the test's custom reward."""
    tmp = tmp_path_factory.mktemp("reward_run")
    (tmp / f"{REWARD_MODULE}.py").write_text(REWARD_SOURCE)
    sys.path.insert(0, str(tmp))
    try:
        argv = ["train", "--checkpoint", str(tiny_checkpoint), "--output-dir", str(tmp / "run"), *FAST,
                "--reward", f"{REWARD_MODULE}:score", "--save-every", "1"]
        assert main([*argv, "--num-rollouts", "2"]) == 0
        yield tmp / "run", argv
    finally:
        sys.path.remove(str(tmp))


def resume(argv: list[str], run: Path) -> list[str]:
    """The saved run's command, on `run`, one rollout longer, resumed."""
    i = argv.index("--output-dir")
    return [*argv[:i], "--output-dir", str(run), *argv[i + 2:], "--num-rollouts", "3", "--resume"]


@pytest.mark.parametrize("mode, reason", [("nan", "returned nan for image 0"),
                                          ("count", "returned shape (1,), expected (2,)")])
def test_a_failing_reward_stops_with_the_last_checkpoint_intact(saved_run, tmp_path, capsys, monkeypatch, mode,
                                                                reason):
    src, argv = saved_run
    run = tmp_path / "run"
    shutil.copytree(src, run)
    monkeypatch.syspath_prepend(str(src.parent))
    monkeypatch.setenv("TRUEFLOW_TEST_REWARD", mode)
    before = digest(run)
    capsys.readouterr()
    rc = main(resume(argv, run))
    assert_one_line_error(rc, capsys.readouterr().err, f"reward '{REWARD_MODULE}:score' failed", reason,
                          "last checkpoint is intact", "--resume", "--reward-on-error skip")
    assert digest(run) == before, "the failed rollout changed no file of the run"


def test_a_failing_reward_before_any_checkpoint_says_none_exists(saved_run, tmp_path, capsys, monkeypatch):
    """At the default cadence (--save-every 10) a reward failing at the first rollout finds no checkpoint: the line
    says so and how to start again, instead of promising an intact one."""
    src, argv = saved_run
    monkeypatch.syspath_prepend(str(src.parent))
    monkeypatch.setenv("TRUEFLOW_TEST_REWARD", "nan")
    i = argv.index("--save-every")
    fresh = [*argv[:i], *argv[i + 2:]]
    fresh[fresh.index("--output-dir") + 1] = str(tmp_path / "run")
    capsys.readouterr()
    rc = main(fresh)
    line = assert_one_line_error(rc, capsys.readouterr().err, "returned nan for image 0",
                                 "no checkpoint was written before it stopped", "start again with --resume auto")
    assert "is intact" not in line and ckpt.latest_checkpoint(tmp_path / "run") is None


def test_ctrl_c_names_the_checkpoint_a_resume_continues_from(tmp_path, capsys, monkeypatch):
    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr("trueflow.train.run.run_training", interrupted)
    run = tmp_path / "run"
    assert main(["train", "--output-dir", str(run)]) == 130
    assert capsys.readouterr().err == (f"trueflow train: interrupted (no checkpoint was written before it stopped "
                                       f"(none in {run / 'checkpoints'}): start again with --resume auto)\n")
    latest = fake_checkpoint(run, 1, TrainConfig(output_dir=str(run)))
    assert main(["train", "--output-dir", str(run)]) == 130
    assert capsys.readouterr().err == (f"trueflow train: interrupted (its last checkpoint is intact ({latest}): "
                                       "--resume continues from it)\n")


def test_a_full_disk_stops_the_run_in_one_line_and_it_resumes(saved_run, tmpfs, capsys, monkeypatch):
    """ENOSPC in a real run, its folder on a small tmpfs: the save of step 3 fails with one line naming the folder,
    the bytes needed and free; no temporary folder stays, step 2 is untouched, and with room again `--resume`
    finishes the run."""
    src, argv = saved_run
    monkeypatch.syspath_prepend(str(src.parent))
    disk = tmpfs(64 << 20)
    run = disk / "run"
    shutil.copytree(src, run)
    st = os.statvfs(disk)
    one = sum(f.stat().st_size for f in (src / "checkpoints" / "step-000002").iterdir())
    tmpfs((st.f_blocks - st.f_bfree) * st.f_frsize + one // 2, disk)  # room for a metrics line, not a checkpoint
    before = digest(run / "checkpoints")
    capsys.readouterr()
    rc = main(resume(argv, run))
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    errors = [line.partition("trueflow train: error: ")[2] for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err  # (on the line of the progress bar, which is redrawn below it when it closes)
    for fragment in (f"cannot write checkpoint {run / 'checkpoints' / 'step-000003'} (the disk is full)", "bytes,",
                     "are free there", "step-000002 is intact: free space and --resume"):
        assert fragment in errors[0], (fragment, errors[0])
    assert digest(run / "checkpoints") == before, "no temporary folder left, the checkpoints untouched"
    assert not (run / LOCK_FILE).exists()
    tmpfs(64 << 20, disk)
    assert main(resume(argv, run)) == 0, capsys.readouterr().err
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]
    assert ckpt.latest_checkpoint(run).name == "step-000003"


def test_a_resume_past_a_truncated_checkpoint_runs_on(saved_run, tmp_path, capsys, monkeypatch):
    src, argv = saved_run
    run = tmp_path / "run"
    shutil.copytree(src, run)
    monkeypatch.syspath_prepend(str(src.parent))
    opt = run / "checkpoints" / "step-000002" / "optimizer.pt"
    opt.write_bytes(opt.read_bytes()[:100])
    with pytest.warns(UserWarning, match="step-000002 cannot be read .*: resuming from step-000001 instead"):
        rc = main(resume(argv, run))
    assert rc == 0, capsys.readouterr().err
    rows, reference = read_metrics(run / "metrics.jsonl"), read_metrics(src / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["trainer_checksum"] == reference[1]["trainer_checksum"], "step 2 redone from step 1's state"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000003"


@pytest.mark.slow
def test_a_failing_reward_stops_every_rank(tiny_checkpoint, tmp_path):
    """Two FSDP ranks: the reward runs on rank 0 only, and its failure reaches rank 1, which would otherwise wait
    for the rollout forever."""
    from trueflow.net import free_port

    (tmp_path / f"{REWARD_MODULE}.py").write_text(REWARD_SOURCE)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "TRUEFLOW_TEST_REWARD": "nan",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "trueflow", "train", "--checkpoint", str(tiny_checkpoint),
           "--output-dir", str(tmp_path / "run"), *FAST, "--rollout-batch-size", "2",
           "--reward", f"{REWARD_MODULE}:score"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    # each rank exits 2 with the one line (rank 0's may follow its progress bar on the same line)
    assert proc.stderr.count("trueflow train: error: reward") == 2, proc.stderr[-3000:]
    assert proc.stderr.count("returned nan for image 0") == 2 and "exitcode  : 2" in proc.stderr
    assert "/trueflow/" not in proc.stderr, "no traceback through trueflow (torchrun prints its own)"
    assert not (tmp_path / "run" / LOCK_FILE).exists(), "rank 0 released the run folder's lock on the error"
