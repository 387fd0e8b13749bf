"""What to build an engine from, as typed values: what the engine runs (`EngineSpec`), where it runs (`Placement`),
and the reward that scores its rollouts (`RewardSpec`). Leaves: they import nothing heavy, so a verb can check a
placement before it loads torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..dtypes import DTYPES

RewardAt = Literal["caller", "engine", "actor"]


@dataclass(frozen=True)
class EngineSpec:
    """What the engine runs, whichever process runs it: the pipeline folder, the patch group (and the patches switched
    off), the compute dtype's name, the device, the family where the folder names none, the intra-op CPU threads of
    an engine in another process (None: this process's count; on CPU parity needs the trainer's, condition 9), CUDA
    graphs, and a progress bar on stderr for each rollout (an in-process engine only)."""

    checkpoint: str
    patch_group: str = "none"
    disabled_patches: tuple[str, ...] = ()
    dtype: str = "bf16"
    device: str = "cpu"
    family: str | None = None
    threads: int | None = None
    cuda_graphs: bool = True
    progress: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        object.__setattr__(self, "disabled_patches", tuple(self.disabled_patches))


@dataclass(frozen=True)
class RewardSpec:
    """A reward as `rewards.build_reward` builds it (a spec string, its model folder, device and URL), what a failing
    reward does (`raise` or `skip` the prompt's group), and how many frames of a video it scores (averaged)."""

    spec: str
    model: str | None = None
    device: str = "cpu"
    url: str | None = None
    on_error: Literal["raise", "skip"] = "raise"
    frames: int = 1


@dataclass(frozen=True)
class Placement:
    """Where the engine runs, by a name of the placement registry (`trueflow.placement.PLACEMENTS`):

    - `local`: in this process (`engine.Engine`);
    - `process`: in a process of its own, or with `tp` > 1 over `tp` tensor-parallel processes (`tp`, the same
      placement; `tp_matched`: the caller's train side computes each sharded layer as those ranks do, so the TP gate
      does not warn);
    - `http`: a `trueflow serve` server at `url` on this machine;
    - `ray_colocated` / `ray_disaggregated`: this trainer rank's engine actor of a `trueflow train --ray` run, beside
      the rank or on devices of its own (`ray_trainers` ranks, `ray_engines` engine actors).

    `reward`, if given, scores every rollout, in the caller's process (`reward_at="caller"`), in the engine's process
    (`engine`: `process` only) or in a Ray reward actor beside the rank (`actor`: Ray only)."""

    kind: str = "local"
    tp: int = 1
    tp_matched: bool = False
    url: str | None = None
    ray_trainers: int = 1
    ray_engines: int = 0
    reward: RewardSpec | None = None
    reward_at: RewardAt = "caller"
    bucket_bytes: int | None = field(default=None, repr=False)  # weight-sync bucket size (None: sync's default)

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"--tp must be >= 1, got {self.tp}")
        if self.reward_at == "engine" and self.kind not in ("process", "tp"):
            raise ValueError("a reward in the engine's process needs the engine in a process of its own "
                             "(--engine-process)")
        if self.reward_at == "actor" and not self.kind.startswith("ray_"):
            raise ValueError("a reward actor needs a Ray placement (--ray)")
        if self.reward_at != "caller" and self.reward is None:
            raise ValueError(f"reward_at={self.reward_at!r} names where a reward runs, but no reward is given")
        if self.tp > 1 and self.kind not in ("process", "tp"):
            raise ValueError(f"--tp {self.tp} runs the engine over {self.tp} processes of its own: that is the "
                             f"`process` placement (--engine-process), not {self.kind!r}")
        if self.kind == "http" and not self.url:
            raise ValueError("the http placement needs the server's URL (--engine-url)")
