"""`trueflow train --ray` on local Ray clusters bound to 127.0.0.1 (2 CPUs, no dashboard, temp folders inside the
tests' folders): the same metrics, bit for bit, as torchrun with the same flags; a run of its own cluster listens on
loopback only, with usage stats off and no token file; the actors it places; an engine or reward actor killed
mid-run (a one-line error naming it, intact checkpoints, no shared memory left behind, a bitwise --resume);
disaggregated 1+1 and 2+1 at parity 0.0, and an engine that dies on the weight broadcast named at once."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest

# Ray reads this once, on import: without it, Ray on Linux replaces 127.0.0.1 by the routable address.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_AUTH_MODE"] = "disabled"
import ray  # noqa: E402

from trueflow.cli import main
from trueflow.train.checkpoint import load_latest
from trueflow.train.lock import LOCK_FILE
from trueflow.train.metrics import read_metrics

from conftest import TRUEFLOW_EXE, assert_loopback_only, listening, process_tree
from test_train import FAST, assert_bitwise_run, assert_same_metrics, cli_flags, comparable, torchrun

ROLLOUTS = 4  # one more than test_train's runs: the kill below lands while the run still has rollouts to go


def ray_train(out, checkpoint, *flags: str, wait: bool = True, env: dict | None = None):
    """`trueflow train --ray ...` with the FAST settings (a Popen with `wait=False`)."""
    cmd = [str(TRUEFLOW_EXE), "train", "--ray", "--checkpoint", str(checkpoint), "--output-dir", str(out),
           *cli_flags(**FAST), "--num-rollouts", str(ROLLOUTS), *flags]
    if wait:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


class RayRun(NamedTuple):
    out: Path
    rows: list[dict]
    listeners: set  # (pid, address, port) of every socket its processes listened on
    usage_stats: dict[str, str | None]  # RAY_USAGE_STATS_ENABLED in the environment of each Ray process seen
    home: Path  # its HOME, where Ray would write ~/.ray/auth_token


@pytest.fixture(scope="module")
def ray_run(tiny_checkpoint, tmp_path_factory) -> RayRun:
    """`trueflow train --ray --world-size 2`, which starts its own local cluster (temp folder: the run's `ray/`),
    in an environment that sets none of Ray's variables (this module's own cluster sets two) and a HOME of its
    own; its sockets and the environment of its Ray processes are watched while it runs."""
    out, home = tmp_path_factory.mktemp("a") / "run", tmp_path_factory.mktemp("home")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"HOME": str(home)}
    proc = ray_train(out, tiny_checkpoint, "--world-size", "2", wait=False, env=env)
    seen, usage, deadline = set(), {}, time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        tree = process_tree(proc.pid)
        seen |= listening(tree)
        for pid in tree - {proc.pid}:
            try:
                name = Path(f"/proc/{pid}/comm").read_text().strip()
                variables = Path(f"/proc/{pid}/environ").read_text().split("\0")
            except OSError:
                continue
            if name in ("gcs_server", "raylet"):
                usage[name] = dict(v.split("=", 1) for v in variables if "=" in v).get("RAY_USAGE_STATS_ENABLED")
        time.sleep(0.1)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-3000:]
    return RayRun(out, read_metrics(out / "metrics.jsonl"), seen, usage, home)


def test_a_ray_run_listens_on_loopback_only(ray_run):
    """Every Ray process (GCS, raylet, agents, workers) and the trainers' process group on 127.0.0.1; the driver
    turned usage stats off for the processes it starts, and Ray's token stayed in the environment (no file)."""
    assert_loopback_only(ray_run.listeners)
    assert ray_run.usage_stats == {"gcs_server": "0", "raylet": "0"}
    assert not (ray_run.home / ".ray").exists()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A local cluster the tests watch (2 CPUs, 127.0.0.1); runs join it with --ray-address, one at a time."""
    temp = tmp_path_factory.mktemp("r")
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", _temp_dir=str(temp),
             object_store_memory=100 << 20)
    try:
        address = ray.get_runtime_context().gcs_address
        assert address.startswith("127.0.0.1:"), address
        yield address
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def test_ray_matches_torchrun_bit_for_bit(ray_run, tiny_checkpoint, tmp_path):
    """2 trainer actors with 2 colocated engine actors write the very metrics of `torchrun --nproc-per-node 2`
    (the grad norm and mean loss too: both add the same 2 ranks' pieces), parity 0.0 at every step, exit 0; the
    local cluster's temp folder is gone with it."""
    out, rows = ray_run.out, ray_run.rows
    proc = torchrun(tmp_path / "run", tiny_checkpoint, "--num-rollouts", str(ROLLOUTS))
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert_bitwise_run(rows, ROLLOUTS)
    assert comparable(rows) == comparable(expected)
    assert not (out / "ray").exists()


def kill_when(proc, ready, victim: str) -> tuple[set[str], str, str]:
    """Watch the cluster's named actors until `ready(seen)`, then `ray.kill` the actor `victim` of the run; (the names
    of the run's actors seen, the run's stderr, its tag: its namespace less the `trueflow-` prefix)."""
    seen, deadline = set(), time.monotonic() + 240
    try:
        while True:
            seen |= {(a["namespace"], a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)}
            if ready(seen):
                break
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.01)
        namespace = next(ns for ns, name in seen if name == victim)
        ray.kill(ray.get_actor(victim, namespace=namespace))
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    while ray.util.list_named_actors(all_namespaces=True) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.util.list_named_actors(all_namespaces=True) == [], "the driver ended every actor of the run"
    return {name for ns, name in seen if ns == namespace}, stderr, namespace.removeprefix("trueflow-")


def assert_named_error(proc, stderr: str, actor: str, resume: str) -> None:
    assert proc.returncode == 1, stderr[-3000:]
    error = stderr.strip().splitlines()[-1]
    # "died", or "is not alive (it died, ...)" when it died before its rank looked it up
    assert error.startswith(f"trueflow train: error: the Ray {actor} ") and "died" in error, error
    assert resume in error, error  # where --resume goes on (checkpoint.resume_point)


def test_killed_engine_actor_is_named_and_the_run_resumes_bit_for_bit(ray_run, cluster, tiny_checkpoint, tmp_path):
    """While the run goes, the cluster holds its 2 trainer, 2 engine and 2 reward actors; `ray.kill` of engine-1
    after the first checkpoint stops the run with one line naming engine-1, the checkpoint stays complete, and
    --resume finishes the run with the uninterrupted run's metrics, bit for bit (whose rewards were computed in
    the trainer ranks: the reward's placement changes no bit)."""
    reference = ray_run.rows
    out = tmp_path / "run"
    flags = ("--world-size", "2", "--ray-address", cluster, "--save-every", "1", "--reward-placement", "actor")
    proc = ray_train(out, tiny_checkpoint, *flags, wait=False)
    first_checkpoint = out / "checkpoints" / "step-000001" / "COMPLETE"
    seen, stderr, tag = kill_when(proc, lambda _: first_checkpoint.is_file(), "engine-1")
    assert sorted(seen) == ["engine-0", "engine-1", "reward-0", "reward-1", "trainer-0", "trainer-1"]
    assert_named_error(proc, stderr, "engine actor engine-1", "its last checkpoint is intact")
    assert not (out / LOCK_FILE).exists(), "the driver held the run folder's lock and released it on the error"
    # the run's segments by its tag (the trainer actors' TRUEFLOW_RUN_TAG): another test worker makes its own meanwhile
    assert not list(Path("/dev/shm").glob(f"trueflow-{tag}-*")), "the failed run left its LoRA buffers behind"
    _, _, _, state = load_latest(out)
    assert state["step"] >= 1, "the checkpoint written before the kill is complete"
    resumed = ray_train(out, tiny_checkpoint, *flags, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert comparable(rows) == comparable(reference)


def test_killed_reward_actor_is_named(cluster, tiny_checkpoint, tmp_path):
    """A reward actor killed as soon as it exists stops the run with one line naming it, whatever
    --reward-on-error says (a dead actor is not a failing prompt)."""
    proc = ray_train(tmp_path / "run", tiny_checkpoint, "--world-size", "2", "--ray-address", cluster,
                     "--reward-placement", "actor", "--reward-on-error", "skip", wait=False)
    _, stderr, _ = kill_when(proc, lambda seen: "reward-1" in {name for _, name in seen}, "reward-1")
    # killed before the first checkpoint: the line says none was written, not that one is intact
    assert_named_error(proc, stderr, "reward actor reward-1", "no checkpoint was written before it stopped")


@pytest.mark.parametrize("trainers", [1, 2])
def test_disaggregated_one_engine(ray_run, tiny_checkpoint, tmp_path, request, trainers):
    """--rollout-gpus 1 --train-gpus T: the engine actor on a slot of its own takes every LoRA by broadcast from
    trainer rank 0 and confirms it by checksum (with 2 ranks it serves both shares, and rank 1 waits for its LoRA
    there): parity 0.0 and equal checksums at every step. With 2 ranks the metrics are the colocated run's bit for
    bit; with 1, as one rank's against two (grad norm and loss to rounding)."""
    reference = ray_run.rows
    out = tmp_path / "run"
    # 1+1 joins the 2-CPU cluster; 2+1 needs 3 bundles, which the run's own local cluster makes.
    where = ("--ray-address", request.getfixturevalue("cluster")) if trainers == 1 else ()
    proc = ray_train(out, tiny_checkpoint, "--rollout-gpus", "1", "--train-gpus", str(trainers), *where)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert_bitwise_run(rows, ROLLOUTS)
    assert_same_metrics(rows, reference)
    if trainers == 2:
        assert comparable(rows) == comparable(reference)


BROADCAST_TO_A_DEAD_ENGINE = """
import os, sys, time
import ray, torch
from trueflow.placement import EngineSpec
from trueflow.placement.ray import BroadcastEngine, EngineActor, weights_group
from trueflow.net import free_port

checkpoint, temp = sys.argv[1:]
ray.init(num_cpus=1, include_dashboard=False, _node_ip_address="127.0.0.1", _temp_dir=temp, log_to_driver=False)
engine = EngineActor.options(name="engine-0").remote()
ray.get(engine.load.remote(EngineSpec(checkpoint, "qwen_image", threads=1), os.getcwd()))
port = free_port()
joined = engine.join_weights_group.remote("127.0.0.1", port, 1, 2, "gloo")
client = BroadcastEngine(engine, "engine-0", [("engine-0", engine)],
                         weights_group("127.0.0.1", port, 0, 2, "gloo", "127.0.0.1"), bucket_bytes=1 << 20)
ray.get(joined)
state = {f"transformer_blocks.{i}.attn.to_q.lora_{x}.weight": torch.zeros(1 << 20, dtype=torch.bfloat16)
         for i in range(8) for x in "AB"}
ray.kill(engine)  # joined to the group, then gone
t0 = time.monotonic()
try:
    client.update_weights(state, 1.0)
except Exception as e:
    print(f"{type(e).__name__} after {time.monotonic() - t0:.1f} s: {e}", flush=True)
ray.shutdown()  # the cluster's processes end with it
os._exit(0)  # the group's pending broadcast would hold the interpreter's exit for its timeout
"""


def test_broadcast_to_a_dead_engine_names_it(tiny_checkpoint, tmp_path_factory):
    """Disaggregated: an engine that died after joining trainer rank 0's weight group is named within seconds (the
    broadcast alone fails with gloo's connection error, naming no one; killed mid-broadcast, it waits out the
    collective's 30-minute timeout)."""
    temp = tmp_path_factory.mktemp("b")
    try:
        proc = subprocess.run([sys.executable, "-c", BROADCAST_TO_A_DEAD_ENGINE, str(tiny_checkpoint), str(temp)],
                              capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    line = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-3000:]
    assert line.startswith("ActorDied after ") and "the Ray engine actor engine-0 died" in line, line
    assert float(line.split()[2]) < 10, line


STOP_A_RAY_ROLLOUT = """
import os, sys
import ray
from trueflow.engine.interface import RolloutCancelled, RolloutRequest
from trueflow.engine.sampling_params import SamplingParams
from trueflow.placement import EngineSpec
from trueflow.placement.ray import EngineActor, RayEngine

checkpoint, temp = sys.argv[1:]
ray.init(num_cpus=1, include_dashboard=False, _node_ip_address="127.0.0.1", _temp_dir=temp, log_to_driver=False)
actor = EngineActor.options(name="engine-0").remote()
ray.get(actor.load.remote(EngineSpec(checkpoint, "qwen_image", threads=1), os.getcwd()))
engine = RayEngine(actor, "engine-0")
request = RolloutRequest(["a red apple"], 2, SamplingParams(steps=100, cfg_scale=1.0), seed=1)
asked = []
try:
    engine.rollout(request, lambda: asked.append(1) or len(asked) > 1)  # asked at once, then after STOP_POLL_S
    print("not stopped", flush=True)
except RolloutCancelled as e:
    print(f"cancelled: {e}", flush=True)
print("after:", engine.rollout(RolloutRequest(["a red apple"], 2, SamplingParams(steps=2, cfg_scale=1.0), seed=1),
                               lambda: False).images.shape[0], flush=True)
ray.shutdown()
"""


def test_a_ray_engine_rollout_stops_when_its_caller_says_so(tiny_checkpoint, tmp_path_factory):
    """`should_stop` reaches an engine actor mid-rollout (its `stop` runs beside the rollout), and the actor serves
    the next rollout."""
    temp = tmp_path_factory.mktemp("s")
    try:
        proc = subprocess.run([sys.executable, "-c", STOP_A_RAY_ROLLOUT, str(tiny_checkpoint), str(temp)],
                              capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("cancelled: stopped before step"), proc.stdout + proc.stderr[-3000:]
    assert lines[1] == "after: 2", lines


@pytest.mark.parametrize("flags, fix", [
    (["--world-size", "2"], "--world-size: settings of a Ray run; add --ray"),
    (["--ray", "--engine-process"], "drop --engine-process"),
    (["--ray", "--rollout-gpus", "1"], "takes both --rollout-gpus R and --train-gpus T"),
    (["--ray", "--rollout-gpus", "2", "--train-gpus", "1"], "use at most T engines"),
    (["--ray", "--world-size", "3"], "multiple of the 3 trainer ranks"),
    (["--reward-placement", "actor"], "--reward-placement actor: settings of a Ray run; add --ray"),
    (["--ray", "--reward-placement", "engine"], "--reward-placement trainer"),
    (["--ray", "--tp", "2"], "drop --tp or --ray"),
])
def test_bad_ray_settings_are_one_line_with_the_fix(tmp_path, capsys, flags, fix):
    assert main(["train", "--output-dir", str(tmp_path / "run"), *flags]) == 2
    err = capsys.readouterr().err
    assert fix in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists(), "refused before anything was written"
