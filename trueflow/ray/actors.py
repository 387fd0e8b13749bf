"""The trainer ranks of a Ray run. Each `TrainerActor` runs `train.run.run_training` as a torchrun worker would
(RANK, WORLD_SIZE, MASTER_ADDR/PORT set by the driver, `launch.run_ray`); its engine comes from the placement
factory (`trueflow.placement.ray`: the engine and reward actors beside it)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import ray
import torch

from ..net import free_port

if TYPE_CHECKING:
    from ..train.config import TrainConfig


@ray.remote
class TrainerActor:
    """One trainer rank: `run_training` with the environment torchrun would give it."""

    def address(self) -> tuple[str, int]:
        """(this node's address, a free port): the rendezvous of the trainers' process group (rank 0's)."""
        return ray.util.get_node_ip_address(), free_port()

    def run(self, cfg: TrainConfig, env: dict[str, str], threads: int, cwd: str) -> str | None:
        from ..train.run import run_training

        os.chdir(cwd)
        os.environ.update(env)
        torch.set_num_threads(threads)
        out = run_training(cfg)
        return None if out is None else str(out)
