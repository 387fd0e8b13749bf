"""Debug snapshots: every step of a rollout, with the inputs to replay it, in one safetensors file.

The layout (every key, dtype and shape, and the metadata) is documented in docs/snapshot.md, with a script
that replays a step with diffusers alone. A snapshot needs a rollout run with `record_snapshot=True`.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import diffusers
import torch
import transformers
from safetensors.torch import save_file

from ..files import publish
from ..models import get_family
from .guidance import expert_scale
from .trajectory import Rollout

FORMAT = "trueflow-snapshot/2"  # /2: conditioning under its model-input names, `grid` for `img_shape`
METADATA_KEY = "trueflow"  # the safetensors metadata entry holding the JSON description


def snapshot_tensors(rollout: Rollout) -> dict[str, torch.Tensor]:
    """The snapshot's tensors under their documented keys, on the CPU."""
    out: dict[str, torch.Tensor] = {}
    model_timestep = get_family(rollout.engine["family"]).train.timestep  # what the pipeline passes the transformer
    for m, mg in enumerate(rollout.microgroups):
        if mg.records is None:
            raise ValueError("this rollout kept no step records: run it with record_snapshot=True")
        # Each branch's conditioning under the names the family's transformer takes it by (the replay passes them
        # through as keyword arguments).
        mine = {f"{branch}/{k}": v for branch, cond in (("positive", mg.cond), ("negative", mg.negative_cond or {}))
                for k, v in cond.items()}
        mine |= {"sigmas": mg.sigmas, "timesteps": mg.timesteps, "log_probs": mg.log_probs,
                 "final_latents": mg.latents[-1],
                 "rewards": None if rollout.rewards is None else rollout.rewards[mg.sample_indices]}
        b = len(mg.sample_indices)
        for t, rec in enumerate(mg.records):
            timestep = model_timestep(mg.timesteps[t], mg.latents.dtype)
            step = {"latents": mg.latents[t], "timestep": timestep.expand(b, *timestep.shape),
                    "positive_output": rec.positive_output, "negative_output": rec.negative_output,
                    "guided_output": rec.guided_output, "mean": rec.mean, "std": rec.std, "noise": rec.noise}
            mine.update({f"step{t}/{k}": v for k, v in step.items()})
        # safetensors stores dense, contiguous, unshared CPU tensors; None marks what a microgroup lacks.
        out.update({f"mg{m}/{k}": v.detach().cpu().contiguous().clone() for k, v in mine.items() if v is not None})
    return out


def snapshot_metadata(rollout: Rollout) -> dict:
    """The JSON description stored in the file's metadata (documented in docs/snapshot.md)."""
    guidance, params = get_family(rollout.engine["family"]).guidance, rollout.params
    order = rollout.engine["experts"]  # the engine's experts, in the pipeline's order

    def cfg_scales(experts: list[str]) -> list[float]:  # what each step was guided with (CFG on: cfg_scale > 1)
        return [expert_scale(order.index(e), params.cfg_scale, params.cfg_scale_2) for e in experts]

    return {
        "format": FORMAT,
        "engine": rollout.engine,
        "prompts": rollout.prompts,
        "n_per_prompt": rollout.n_per_prompt,
        "seed": rollout.seed,
        "first_prompt": rollout.first_prompt,
        "dropped": rollout.dropped,
        "params": asdict(rollout.params),
        "guidance": {"branches": guidance.branches,
                     "formula": None if guidance.formula is None else guidance.formula.__name__,
                     "distilled_input": guidance.distilled_input},
        "microgroups": [{"prompt_index": mg.prompt_index, "sample_indices": mg.sample_indices,
                         "grid": list(mg.grid), "static": mg.static, "sde_steps": mg.sde_steps,
                         "experts": mg.experts, "cfg_scales": cfg_scales(mg.experts)}
                        for mg in rollout.microgroups],
        # A replay is bitwise only with the same kernels: same versions, and on CPU the same thread count.
        "torch_num_threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "diffusers": diffusers.__version__,
                     "transformers": transformers.__version__},
    }


def save_snapshot(rollout: Rollout, path: str | Path) -> Path:
    """Write the rollout's snapshot to `path` (a .safetensors file; parent folders are created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(snapshot_tensors(rollout), str(path),
              metadata={"format": FORMAT, METADATA_KEY: json.dumps(snapshot_metadata(rollout))})
    publish(path)  # safetensors writes 0600
    return path
