"""The in-process rollout engine: prompts -> microgroups -> denoise loop -> recorded trajectories (+ images).

A prompt's `n` samples run in microgroups of `rollout_microgroup_size`, in order; the model runner
(`model_runner.py`) takes each microgroup, as one batch, through the whole loop. Randomness is per sample: sample
k of prompt p owns one CPU generator (its initial noise, then its step noise), so a sample's noise does not depend
on the batch it runs in; the SDE window is drawn once per microgroup from its own generator. Both follow the
prompt's global index (`RolloutRequest.first_prompt` + p), so data-parallel engines drawing shares of one rollout
draw what one engine would. The model family
(from the checkpoint's model_index.json) supplies the text encoder, latent layout, schedule and decoder.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from ..collate import Cond
from .. import loading
from ..loading import CheckpointError
from ..models import checkpoint_experts, family_for_checkpoint
from ..models.spec import EngineModel
from ..sync.buckets import Bucket, unpack
from . import weights
from .batcher import ForwardBatcher
from .guidance import distilled_entry, negative_prompt
from .interface import RolloutRequest, StopCheck
from .model_runner import ModelRunner
from .sampling_params import SamplingParams, check_family_limits
from .samplers import draw_sde_window
from .trajectory import Rollout

if TYPE_CHECKING:
    from ..parallel.comm import TPGroup

# Random streams, kept apart: the noise of one sample, the SDE window of one microgroup.
_NOISE_STREAM, _WINDOW_STREAM = 0, 1


def shared_base_line(own: Sequence[Mapping[str, str]], models: Sequence[EngineModel]) -> str:
    """The one line an engine on the train side's base says: what it shares, and what it copied and why (`own`: per
    expert, the copied tensors' names -> why)."""
    sizes = [(name in part, t.numel() * t.element_size()) for part, m in zip(own, models)
             for name, t in weights.full_state(m).items()]
    shared, copied = (sum(n for is_own, n in sizes if is_own is flag) for flag in (False, True))
    line = f"engine: reads the train side's base weights ({shared / 2**20:,.1f} MiB, no copy)"
    whys = sorted({why for part in own for why in part.values()})
    if not whys:
        return line + "; it holds no copy of its own"
    count = sum(len(part) for part in own)
    return line + f"; own copies of {count} tensors ({copied / 2**20:,.1f} MiB): {'; '.join(whys)}"


def derive_seed(seed: int, *path: int) -> int:
    """A 63-bit seed for the random stream at `path` under `seed` (blake2b of the signed 64-bit integers): the
    same on every platform, and unrelated for neighbouring paths, unlike `seed + k`."""
    digest = hashlib.blake2b(struct.pack(f"<{1 + len(path)}q", seed, *path), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Engine:
    """Loads a diffusers pipeline folder of any model family: the engine transformer of each expert (the family's
    `experts` of the folder; one patch group applied to each) in a model runner, the text encoder and tokenizer,
    the VAE and the scheduler config. On CUDA the transformers' forwards replay CUDA graphs (one per shape and
    expert, bitwise equal to eager; `cuda_graphs=False` runs eagerly). `family` names the family where the folder's
    model_index.json does not. `tp`: this process is one rank of a tensor-parallel engine (`parallel.comm.TPGroup`):
    its transformer holds the rank's shard of the family's plan, loaded from rank 0's copy; every rank runs the same
    calls (`placement.process` drives them). `progress`: every rollout shows a tqdm bar over its denoising steps on
    stderr. `base`: per expert, the train side's frozen base tensors (diffusers names, `train.shared_base`), which
    the transformers read instead of a copy from the checkpoint (`weights.share_engine_transformer`; one line says
    what had to be copied)."""

    def __init__(self, checkpoint: str | Path, patch_group: str = "none", disabled_patches: tuple[str, ...] = (),
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16, cuda_graphs: bool = True,
                 family: str | None = None, tp: TPGroup | None = None, progress: bool = False,
                 base: Sequence[Mapping[str, torch.Tensor]] | None = None):
        root = Path(checkpoint)
        self.family = fam = family_for_checkpoint(root, family)
        for sub in fam.pipeline.folders:
            if not (root / sub).is_dir():
                raise CheckpointError(f"{root}: no {sub}/ folder; the engine needs a whole diffusers pipeline folder "
                                      f"(`trueflow init-checkpoint --family {fam.name} --size tiny --out DIR` "
                                      f"writes one)")
        self.checkpoint, self.device, self.dtype = str(root), torch.device(device), dtype
        self.patch_group, self.disabled_patches = patch_group, tuple(disabled_patches)
        self.progress = progress
        self.experts = checkpoint_experts(root, fam)
        if base is not None:
            if tp is not None or len(base) != len(self.experts):
                raise ValueError("an engine on the train side's base weights takes one base per expert, at --tp 1")
            built = [weights.share_engine_transformer(root, b, self.device, dtype, patch_group, disabled_patches,
                                                      family=fam.name, subfolder=e.name)
                     for e, b in zip(self.experts, base)]
            self.transformers = [m for m, _ in built]
            print(shared_base_line([own for _, own in built], self.transformers), flush=True)
        elif tp is None:
            self.transformers = [weights.load_engine_transformer(root, self.device, dtype, patch_group,
                                                                 disabled_patches, family=fam.name, subfolder=e.name)
                                 for e in self.experts]
        else:
            from ..parallel.engine import build_tp_engine_transformer, scatter_shards, tp_plan

            if len(self.experts) > 1:
                raise ValueError(f"a tensor-parallel engine of several experts "
                                 f"({', '.join(e.name for e in self.experts)}) is not supported: run it at --tp 1")
            # What the engine drops (LTX-2.3's audio stream) is left unread, so no rank is sent it.
            full = loading.read_transformer_state_dict(root, fam.engine.drops) if tp.rank == 0 else None
            shards = scatter_shards(tp_plan(fam, tp.size), full, tp, self.device)
            del full
            self.transformers = [build_tp_engine_transformer(loading.read_transformer_config(root), shards, tp,
                                                             self.device, dtype, patch_group, disabled_patches,
                                                             family=fam.name)]
        self.transformer = self.transformers[0]  # the first expert's (the only one of most families)
        self.runner = ModelRunner(list(zip(self.experts, self.transformers)), fam, self.device, dtype, cuda_graphs)
        self.tokenizer, self.text_encoder = fam.pipeline.load_text(root, self.device, dtype)
        self.vae = fam.pipeline.load_decoder(root, self.device, dtype)
        self.scheduler_config = json.loads((root / "scheduler" / "scheduler_config.json").read_text())

    # -- weights -------------------------------------------------------------------------------------------
    def weights_checksum(self) -> str:
        """`sync.checksum.tensors_checksum` of every transformer parameter (engine names) and the installed LoRA
        (diffusers names, merged or not; its scale in the hashed text): a few integer sums per tensor on the
        device, hashed on the CPU, so it is cheap on GPU and identical across devices and runs."""
        return self.runner.weights_checksum()

    # -- the engine interface (`interface.RolloutEngine`) ----------------------------------------------------
    def update_weights(self, state: dict[str, torch.Tensor] | list[Bucket], lora_scale: float | None = None,
                       merge_mode: str | None = None) -> str:
        """The interface's update; `state` may also be buckets (`sync.buckets`), as an engine process receives
        them: a LoRA then installs without unpacking (`lora_arena`), merged or not as `models.lora.resolve_lora_merge`
        decides; full weights (diffusers names) drop any LoRA. The sender's buffers are never kept."""
        if lora_scale is None:
            self.runner.load_weights(unpack(state) if isinstance(state, list) else state)
            return self.weights_checksum()
        self.runner.update_lora(state, lora_scale, merge_mode)
        return self.checksum()

    def checksum(self) -> str:
        """Checksum of the installed LoRA read back from the engine's layers (`sync.checksum`); equal to the
        trainer's checksum of what it sent once an update is in place."""
        return self.runner.lora_checksum()

    def health(self) -> dict:
        return {"status": "ok", "checkpoint": self.checkpoint, "family": self.family.name,
                "patch_group": self.patch_group, "disabled_patches": list(self.disabled_patches),
                "patches_applied": list(self.transformer.patches_applied),
                "dtype": str(self.dtype).removeprefix("torch."), "device": str(self.device)}

    def shutdown(self) -> None:
        """Nothing to release: the engine lives and ends with this process."""

    def merge_forwards(self) -> ForwardBatcher:
        """Rollouts run concurrently on threads, each inside the returned batcher's `participant()`, share one forward
        per round from now on (the server's worker does this in the batch-invariant mode; refused outside it)."""
        return self.runner.merge_forwards()

    # -- rollout -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def rollout(self, request: RolloutRequest, should_stop: StopCheck | None = None) -> Rollout:
        """`request.n_per_prompt` samples of each prompt, microgroup by microgroup, prompt-major.

        `request.record_snapshot` keeps each step's debug data (branch outputs, SDE mean/std/noise) for
        `snapshot.save_snapshot`; `should_stop` is called before every denoising step, and a true answer raises
        `interface.RolloutCancelled` (a server's client left).
        """
        t0 = time.perf_counter()
        prompts, n_per_prompt, params, seed = request.prompts, request.n_per_prompt, request.params, request.seed
        if not prompts:
            raise ValueError("rollout needs at least one prompt")
        size = params.rollout_microgroup_size or n_per_prompt
        # In the batch-invariant mode a microgroup may hold several whole prompts (their text lengths masked).
        spans = self.runner.batch_invariant and n_per_prompt >= 1 and size > n_per_prompt and size % n_per_prompt == 0
        if (n_per_prompt < 1 or n_per_prompt % size) and not spans:
            raise ValueError(f"n_per_prompt={n_per_prompt} must be a positive multiple of rollout_microgroup_size="
                             f"{size}: every microgroup has the train micro-batch's size (parity condition 4, "
                             f"docs/patch-group.md)" + (" (or, in the batch-invariant mode, the microgroup a multiple "
                                                        "of it: whole prompts)" if self.runner.batch_invariant else ""))
        pipe = self.family.pipeline
        check_family_limits(params, self.family, len(self.experts))
        # The negative prompt the CFG branch runs with (a request naming none takes the family's), recorded as run.
        params = replace(params, negative_prompt=negative_prompt(self.family.guidance, params.negative_prompt))
        grid = pipe.latent_grid(params.height, params.width, params.num_frames)
        sigmas, timesteps = pipe.schedule(self.scheduler_config, params.steps, math.prod(grid), self.device)
        # The first frame of image-to-video: one conditioning of every sample, in both branches (the pipeline hands
        # both the same model input).
        assert not params.image or pipe.image_cond is not None  # check_family_limits refused an image otherwise
        image = pipe.image_cond(self.vae, params.image, params.height, params.width) \
            if params.image and pipe.image_cond is not None else {}
        negative_text = params.negative_prompt if params.cfg else None
        assert not params.cfg or negative_text is not None  # check_family_limits refused CFG without one
        negative = {**self._encode(negative_text, params), **image} if negative_text is not None else None
        microgroups, images = [], []
        # Each microgroup as [(prompt, its first sample, samples)]: a prompt's microgroups one after another, or
        # (spanning) whole prompts, `size // n_per_prompt` of them per microgroup.
        if spans:
            per = size // n_per_prompt
            groups = [[(p, 0, n_per_prompt) for p in range(q, min(q + per, len(prompts)))]
                      for q in range(0, len(prompts), per)]
        else:
            groups = [[(p, first, size)] for p in range(len(prompts)) for first in range(0, n_per_prompt, size)]
        with tqdm(total=len(groups) * params.steps, disable=not self.progress, unit="step") as bar:
            encoded: dict[int, Cond] = {}
            for group in groups:
                conds, gens, samples = [], [], []
                for p, first, count in group:
                    if p not in encoded:  # each prompt encoded once (its microgroups follow one another)
                        encoded[p] = {**self._encode(prompts[p], params), **image}
                    g = request.first_prompt + p  # the global prompt index: what the random streams follow
                    ks = range(first, first + count)
                    gens += [torch.Generator().manual_seed(derive_seed(seed, _NOISE_STREAM, g, k)) for k in ks]
                    samples += [p * n_per_prompt + k for k in ks]
                    conds += [encoded[p]] * count
                # the SDE window follows the microgroup's first (prompt, microgroup of that prompt)
                p0, first0, _ = group[0]
                positive = conds[0] if len(group) == 1 else conds
                mg = self.runner.denoise(p0, samples, gens, (positive, negative), grid, (sigmas, timesteps), params,
                                         self._sde_steps(params, seed, request.first_prompt + p0, first0 // size),
                                         request.record_snapshot, bar, should_stop)
                microgroups.append(mg)
                if request.decode:
                    final = mg.latents[-1]
                    if pipe.final_latents is not None:  # e.g. image-to-video's first frame put back
                        final = pipe.final_latents(final, mg.cond)
                    images.append(self.vae.decode(final, params.height, params.width, params.num_frames))
        info = {"checkpoint": self.checkpoint, "family": self.family.name,
                "experts": [e.name for e in self.experts], "patch_group": self.patch_group,
                "disabled_patches": list(self.disabled_patches),
                "patches_applied": list(self.transformer.patches_applied),
                "dtype": str(self.dtype).removeprefix("torch."), "device": str(self.device)}
        if request.record_snapshot:
            info["weights_checksum"] = self.weights_checksum()
        return Rollout(list(prompts), n_per_prompt, params, seed, microgroups,
                       torch.cat(images) if request.decode else None, info, request.first_prompt,
                       times={"rollout": time.perf_counter() - t0})

    def _encode(self, prompt: str, params: SamplingParams) -> Cond:
        # One prompt per text-encoder call: its embeddings then never depend on the other prompts of a request.
        cond = self.family.pipeline.encode_prompts(self.tokenizer, self.text_encoder, [prompt],
                                                  params.max_sequence_length)[0]
        # A guidance-distilled model's scale is a model input of each branch, recorded with its conditioning.
        return {**cond, **distilled_entry(self.family.guidance, params.distilled_guidance_scale, self.device)}

    @staticmethod
    def _sde_steps(params: SamplingParams, seed: int, g: int, m: int) -> list[int]:
        if params.sampler == "ode":
            return []
        if params.num_sde_steps is None:
            return list(range(params.steps))
        gen = torch.Generator().manual_seed(derive_seed(seed, _WINDOW_STREAM, g, m))
        return draw_sde_window(params.steps, params.num_sde_steps, params.sde_window, gen)
