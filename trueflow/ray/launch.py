"""`trueflow train --ray`: the driver. It checks the settings (a mistake costs no cluster), starts a local Ray
cluster on loopback (or joins `--ray-address`), reserves one placement-group bundle per device (a CPU slot on CPU,
a GPU on CUDA) and places in it the trainer ranks, which run `run_training` as torchrun's workers do, and their
engine actors (`actors`). It waits for the ranks; the first that fails stops every actor, and its error, one line
naming the actor, is the run's. However the run ends, the shared-memory segments its processes made are unlinked
(`sync.shm.unlink_run`, by the run's tag).

A local cluster is this machine's alone (docs/scaling.md): every Ray process on 127.0.0.1 (Ray replaces 127.0.0.1
by the routable address unless `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` holds when Ray is imported), no dashboard,
usage stats off (`RAY_USAGE_STATS_ENABLED=0`, which every process the driver starts inherits), and Ray's token
authentication with a token of this run held in the environment (`RAY_AUTH_TOKEN`), never written to a file: on
loopback every local user can reach Ray's ports, and Ray runs whatever code an authenticated client sends."""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from . import RayRunError
from ..sync.shm import TAG_ENV, unlink_run
from ..train.config import TrainConfig
from ..train.lock import holding_run_lock

if TYPE_CHECKING:
    from ray.actor import ActorClass, ActorHandle

PLACEMENT_TIMEOUT_S = 120.0
WATCH_S = 10.0  # how often the driver checks that every engine and reward actor is alive
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError)  # bad input: the CLI's one line and exit 2


@holding_run_lock  # the driver holds the run folder's lock (`_check_before_loading`); its actors run inside it
def run_ray(cfg: TrainConfig) -> Path:
    """Run `cfg` (with `cfg.ray`) on Ray; returns the run folder. Raises what a rank raised for bad input (a
    reward's error included), `RayRunError` naming the actor for anything else."""
    local = cfg.ray_address is None or cfg.ray_address.startswith(("127.", "localhost:"))  # a cluster on loopback
    _environment(own_cluster=cfg.ray_address is None, loopback=local)
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'trueflow[ray]'") from None

    from ..rewards.base import RewardError
    from ..train.run import _check_before_loading, _ensure_checkpoint

    _check_before_loading(cfg)
    _ensure_checkpoint(cfg, True)
    out = Path(cfg.output_dir).resolve()
    tag = uuid.uuid4().hex[:16]  # this run's actor namespace and shared-memory segments
    temp = _start_cluster(cfg, out, tag)
    failed = True
    try:
        result = _place_and_run(cfg, tag)
        failed = False
        return result
    except ray.exceptions.RayTaskError as e:  # a rank's own error (raised in `_place_and_run`'s wait)
        cause = e.cause
        if isinstance(cause, (*USER_ERRORS, RewardError)):
            raise cause from None
        raise RayRunError(_stopped(str(cause), out)) from None
    finally:
        ray.shutdown()
        unlink_run(tag)  # what its killed actors left on this machine (a clean run has unlinked its own)
        if temp is not None and not failed:
            shutil.rmtree(temp, ignore_errors=True)


def _stopped(reason: str, out: Path) -> str:
    from ..train.checkpoint import resume_point  # says so when no checkpoint was written yet

    return f"{' '.join(reason.split())}; the run stopped, every actor with it; {resume_point(out)}"


def _environment(own_cluster: bool, loopback: bool) -> None:
    """What Ray reads from the environment, set before it is imported: this process's and every process it
    starts inherit it."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # else the head posts usage reports to an outside address
    if loopback:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # Ray keeps 127.0.0.1 as the node's address
        if "ray" in sys.modules:  # imported before (this interpreter ran Ray already): its once-read constant too
            from ray._private import ray_constants

            ray_constants.ENABLE_RAY_CLUSTER = False
    if own_cluster and "RAY_AUTH_MODE" not in os.environ:  # a user's explicit choice is kept
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))  # Ray then writes no ~/.ray/auth_token


def _start_cluster(cfg: TrainConfig, out: Path, tag: str) -> Path | None:
    """Join `cfg.ray_address`, or start a local cluster bound to 127.0.0.1 whose temporary folder (sockets, logs)
    lies in the run folder (elsewhere in the system's temp folder if that path is too long for Ray's sockets);
    returns that folder (None when joining)."""
    import ray

    namespace = f"trueflow-{tag}"  # this run's actor names
    if cfg.ray_address is not None:
        ray.init(address=cfg.ray_address, namespace=namespace, log_to_driver=True)
        return None
    temp = out / "ray"
    if len(str(temp)) > 48:  # Ray's socket paths (temp/session_<time>_<pid>/sockets/...) must fit 107 characters
        temp = Path(tempfile.mkdtemp(prefix="trueflow-ray-"))
    trainers, engines = cfg.ray_ranks()
    ray.init(num_cpus=max(os.cpu_count() or 1, trainers + engines), include_dashboard=False,
             _node_ip_address="127.0.0.1", _temp_dir=str(temp), namespace=namespace, log_to_driver=True)
    return temp


def _place_and_run(cfg: TrainConfig, tag: str) -> Path:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from ..placement.ray import EngineActor, RewardActor, death_reason, engine_name, reward_name, trainer_name
    from .actors import TrainerActor

    trainers, engines = cfg.ray_ranks()
    gpu = torch.device(cfg.device).type == "cuda"
    bundle = {"CPU": 1, "GPU": 1} if gpu else {"CPU": 1}
    pg = placement_group([bundle] * (trainers + engines), strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        raise ValueError(f"the Ray cluster has no room for {trainers + engines} bundles of {bundle} within "
                         f"{PLACEMENT_TIMEOUT_S:.0f} s: add nodes, or ask for fewer ranks (--world-size, "
                         "--train-gpus, --rollout-gpus)")
    # A rank's bundle holds the rank, its engine when colocated and its reward actor if any, in equal shares of
    # its CPU slot and GPU; a disaggregated engine has its bundle to itself.
    rewarded = cfg.reward_placement == "actor"
    share = 1 / (1 + (not engines) + rewarded)
    resources = {"num_cpus": share, "num_gpus": share if gpu else 0}

    def on(bundle_index: int, alone: bool = False) -> dict:
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle_index),
                **({"num_cpus": 1, "num_gpus": 1 if gpu else 0} if alone else resources)}

    # @ray.remote made each an ActorClass (mypy keeps a decorated class's own type)
    engine_actor, reward_actor, trainer_actor = (cast("ActorClass", c)
                                                 for c in (EngineActor, RewardActor, TrainerActor))
    actors = [engine_actor.options(name=engine_name(i), **on(trainers + i if engines else i, alone=bool(engines)))
              .remote() for i in range(engines or trainers)]
    if rewarded:
        actors += [reward_actor.options(name=reward_name(r), **on(r)).remote() for r in range(trainers)]
    ranks = [trainer_actor.options(name=trainer_name(r), **on(r)).remote() for r in range(trainers)]
    actors += ranks
    try:
        host, port = ray.get(ranks[0].address.remote())
        # The trainers' store and sockets bind `host` alone (`train.dist`); their segments carry the run's tag.
        env = {"MASTER_ADDR": host, "MASTER_PORT": str(port), "WORLD_SIZE": str(trainers), TAG_ENV: tag}
        # torchrun's default: one intra-op thread per rank unless OMP_NUM_THREADS (or --threads) says otherwise.
        threads = cfg.threads or int(os.environ.get("OMP_NUM_THREADS", "1"))
        runs = {ranks[r].run.remote(cfg, {**env, "RANK": str(r), "LOCAL_RANK": "0" if gpu else str(r)}, threads,
                                    os.getcwd()): trainer_name(r) for r in range(trainers)}
        result, pending = None, list(runs)
        helpers = {engine_name(i) for i in range(engines or trainers)}
        helpers |= {reward_name(r) for r in range(trainers)} if rewarded else set()
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=WATCH_S)
            if not done:  # a helper actor that died while no rank was calling it (a rank may wait on it)
                gone = sorted(helpers - set(ray.util.list_named_actors()))  # this namespace: names
                if gone:
                    raise RayRunError(_stopped(f"the Ray {gone[0].split('-')[0]} actor {gone[0]} died",
                                               Path(cfg.output_dir).resolve()))
                continue
            try:
                value = ray.get(done[0])
            except ray.exceptions.RayActorError as e:
                raise RayRunError(_stopped(f"the Ray trainer actor {runs[done[0]]} died ({death_reason(e)})",
                                           Path(cfg.output_dir).resolve())) from None
            result = result or value
        assert result is not None  # trainer rank 0's run folder
        return Path(result)
    finally:  # also on an error: the other ranks may wait in a collective for the one that failed
        for a in actors:
            ray.kill(cast("ActorHandle", a))  # ray types `.remote()` as the handle or the class (for its methods)
        remove_placement_group(pg)
