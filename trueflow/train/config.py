"""`trueflow train` settings, validated by pydantic before anything heavy starts.

In Python a `TrainConfig` is flat (`cfg.steps`, `TrainConfig(steps=3)`). In YAML and on the command line the same
settings sit in sections (model, rollout, algorithm, optim, parallel, checkpoint, reward), under the same names:
`rollout: {steps: 3}` in a file is `--rollout.steps 3` on the command line. Each field says where it sits (`_f`),
so the sectioned form is derived from this one class; pydantic-settings builds the flags from it, and every
setting also keeps its flat flag (`--steps`, `--patch-group`...) as an alias. A flat YAML file still loads, with
a warning. Invalid values and combinations raise with the fix; combinations that break a condition of bitwise
parity are allowed but warned about loudly, naming the condition (ParityConditionWarning)."""

from __future__ import annotations

import argparse
import os
import types
import typing
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator
from pydantic.fields import FieldInfo

from ..engine.sampling_params import CFG_SCALE_MAX, FPS_MAX, FPS_MIN, NOISE_LEVEL_MAX  # a leaf: no torch

if TYPE_CHECKING:
    from ..models.spec import ModelFamily

SECTIONS = ("model", "rollout", "algorithm", "optim", "parallel", "checkpoint", "reward")
DEFAULT_NUM_SDE_STEPS = 2  # capped at `steps`, so that `--steps 1` runs as it is


class ParityConditionWarning(UserWarning):
    """A setting breaks one of the conditions for bitwise train/rollout parity."""


class FlatConfigWarning(UserWarning):
    """A YAML file written without sections (the layout before sections existed)."""


def _batch_invariant_backend() -> str:
    from ..kernels.batch_invariant import BACKEND  # imported when asked: reading the settings loads no torch

    return BACKEND


def _f(default: Any, help: str, section: str | None, key: str | None = None, **constraints: Any) -> Any:
    """A setting: `section.key` in YAML and flags (`key` defaults to the field's name; no section: top level)."""
    return Field(default, description=help, json_schema_extra={"section": section, "key": key}, **constraints)


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    # top level: the run itself
    output_dir: str = _f("runs/train", "run folder: metrics.jsonl, checkpoints/, samples/, summary.md", None,
                         min_length=1)
    seed: int = _f(0, "random seed", None, ge=0, le=2**32 - 1)
    sample_every: int = _f(1, "write a sample grid every K rollouts (0: never)", None, ge=0)
    tensorboard: bool = _f(False, "also write TensorBoard events", None)
    wandb: bool = _f(False, "also log to Weights & Biases (WANDB_MODE=offline keeps it on disk, in the run folder)",
                     None)
    wandb_project: str = _f("trueflow", "W&B project", None, min_length=1)
    wandb_name: str | None = _f(None, "W&B run name (default: W&B picks one)", None)
    debug: bool = _f(False, "write snapshots of every rollout step", None)
    # model
    checkpoint: str | None = _f(None, "diffusers pipeline folder (default: a tiny one of the model family, made "
                                      "under runs/tiny-checkpoint on first use)", "model", min_length=1)
    family: str | None = _f(None, "model family (trueflow/models/<family>), where the checkpoint's "
                                  "model_index.json names none (default: the checkpoint's, else qwen_image)", "model",
                            min_length=1)
    dtype: Literal["bf16", "fp32"] = _f("bf16", "compute dtype", "model")
    use_lora: bool = _f(True, "train a LoRA; --no-use-lora trains every weight of the trained experts (fp32 "
                              "masters, FSDP2-sharded; docs/training.md, Full-parameter training)", "model")
    lora_rank: int = _f(8, "LoRA rank", "model", ge=1)
    lora_alpha: float | None = _f(None, "LoRA alpha (default: the rank)", "model", gt=0, le=1e4)
    lora_target_modules: list[str] | None = _f(None, "LoRA target modules (default: the model family's)", "model",
                                               min_length=1)
    lora_experts: list[str] | None = _f(None, "the experts (pipeline components, e.g. transformer_2) whose LoRA is "
                                              "trained (default: every expert of the checkpoint)", "model",
                                        min_length=1)
    gradient_checkpointing: bool | Literal["auto"] = _f(False, "recompute block activations in backward (memory for "
                                                               "time; the forward's values, hence parity, are "
                                                               "unchanged); auto: the fewest blocks the memory plan "
                                                               "needs against --gpu-memory-gib, none where it fits "
                                                               "(docs/training.md)", "model")
    train_kernels: Literal["stock", "fused"] = _f("stock", "fused: the train forward runs the engine's eager-exact "
                                                           "fused kernels (CUDA, bf16) as autograd Functions under "
                                                           "diffusers' model, its bits unchanged (parity too) with "
                                                           "fewer kernels, no consistent speed gain on an H200; "
                                                           "Qwen-Image (docs/training.md)", "model")
    fsdp_attention_backend: str | None = _f(None, "diffusers attention backend of the train forward (default: the "
                                                  "one the family's patch group pairs with)", "model")
    batch_invariant: bool = _f(False, "batch-invariant parity mode: batch-invariant GEMMs and per-sample attention "
                                      "on both sides, so parity holds for any train micro-batch, DP split, text "
                                      "lengths and microgroups of several prompts (docs/patch-group.md)", "model")
    # rollout
    prompts: str | None = _f(None, "text file, one prompt per line (default: the embedded demo prompts)", "rollout",
                             min_length=1)
    num_rollouts: int = _f(3, "rollouts (each followed by num_steps_per_rollout optimizer steps)", "rollout", ge=1)
    rollout_batch_size: int = _f(2, "prompts per rollout", "rollout", "batch_size", ge=1)
    n_samples_per_prompt: int = _f(4, "samples per prompt (the GRPO group)", "rollout", ge=2)
    rollout_microgroup_size: int = _f(4, "samples of one prompt the engine runs as one batch", "rollout",
                                      "microgroup_size", ge=1)
    steps: int = _f(6, "denoising steps", "rollout", ge=1)
    sampler: Literal["sde", "cps"] = _f("sde", "sde or cps (ode has no log-probs to train on)", "rollout")
    noise_level: float = _f(0.7, "SDE/CPS noise level a", "rollout", gt=0, le=NOISE_LEVEL_MAX)
    num_sde_steps: int | None = _f(None, f"stochastic (and trained) steps per trajectory, in one window (default: "
                                         f"{DEFAULT_NUM_SDE_STEPS}, or steps if fewer)", "rollout", ge=1)
    sde_window: tuple[int, int] | None = _f(None, "half-open step range [lo, hi] the SDE window lies in "
                                                  "(default: all steps)", "rollout")
    cfg_scale: float = _f(4.0, "true-CFG scale (1: no guidance)", "rollout", ge=1, le=CFG_SCALE_MAX)
    cfg_scale_2: float | None = _f(None, "CFG scale of the experts after the first (Wan2.2's guidance_scale_2; "
                                         "default: --cfg-scale)", "rollout", ge=1, le=CFG_SCALE_MAX)
    distilled_guidance_scale: float | None = _f(None, "a guidance-distilled model's scale input (FLUX.1-dev's "
                                                      "guidance_scale; default: the family's)", "rollout", ge=0,
                                                le=CFG_SCALE_MAX)
    negative_prompt: str | None = _f(None, "negative prompt of the CFG branch (default: the family's: ' ' for "
                                           "Qwen-Image, '' for SD3; none for FLUX.1, whose pipeline runs no CFG "
                                           "without one)", "rollout")
    max_sequence_length: int = _f(512, "text tokens of a prompt: the pipeline's `max_sequence_length` (FLUX.1 and "
                                       "SD3 pad T5 to it; Qwen-Image cuts to it)", "rollout", ge=1)
    resolution: int = _f(64, "image side in pixels (a multiple of the family's granule: Qwen-Image 16, LTX-2.3 32)",
                         "rollout", ge=16)
    height: int | None = _f(None, "image height in pixels (default: --resolution)", "rollout", ge=16)
    width: int | None = _f(None, "image width in pixels (default: --resolution)", "rollout", ge=16)
    num_frames: int = _f(1, "frames per sample: 1 for images; a video family's count (LTX-2.3: 8k + 1)", "rollout",
                         ge=1)
    fps: float = _f(24.0, "a video's frame rate, which a video family conditions on (images ignore it)", "rollout",
                    ge=FPS_MIN, le=FPS_MAX)
    rollout_patch_group: str | None = _f(None, "the engine's patch group (default: the model family's)", "rollout",
                                         "patch_group")
    disable_patch: list[str] = _f([], "switch one patch of the group off (repeatable)", "rollout")
    lora_merge_mode: Literal["unmerged", "merged"] = _f("unmerged", "how the engine takes LoRA updates", "rollout")
    # algorithm
    num_steps_per_rollout: int = _f(1, "optimizer steps per rollout; only the first is on-policy", "algorithm", ge=1)
    # PPO clips the ratio to [1 - clip_range, 1 + clip_range]: from 1 on, the lower bound is no bound.
    clip_range: float = _f(1e-4, "PPO clip range", "algorithm", gt=0, lt=1)
    adv_clip_max: float = _f(5.0, "advantages are clipped to ±this", "algorithm", gt=0, le=100)
    global_std: bool = _f(False, "normalise advantages by the std of all rewards instead of each group's",
                          "algorithm")
    kl_beta: float = _f(0.0, "weight of the KL to the LoRA-disabled base", "algorithm", ge=0, le=100)
    algorithm: Literal["grpo", "nft"] = _f("grpo", "grpo (PPO-clip on the sampler's log-probs) or nft "
                                                   "(DiffusionNFT: KL- and CFG-free, needs --cfg-scale 1)", "algorithm",
                                           "name")
    ratio_norm: Literal["none", "grpo_guard"] = _f("none", "grpo_guard: GRPO-Guard's RatioNorm and 1/dt step "
                                                           "reweighting (sde sampler only)", "algorithm")
    nft_beta: float = _f(1.0, "DiffusionNFT's beta: how far the implicit policies lie from the old one",
                         "algorithm", gt=0, le=100)
    nft_adaptive_weight: bool = _f(True, "DiffusionNFT's self-normalised x0 loss weight (else plain velocity MSE)",
                                   "algorithm")
    parity_on_every_step: bool = _f(False, "measure the train/rollout mismatch on a rollout's later optimizer "
                                           "steps too, against a kept copy of the rolled-out LoRA (an extra "
                                           "forward per micro-batch); else those steps report it as null",
                                    "algorithm")
    async_rollouts: int = _f(0, "roll out N rollouts ahead of training (1: one step off): rollout k is made with "
                                "the weights of step k - N while the trainer trains, and trained with the decoupled "
                                "PPO objective; needs the engine outside the trainer's process (0: synchronous)",
                             "algorithm", ge=0, le=64)
    async_is_cap: float = _f(2.0, "--async-rollouts: the cap of the behaviour importance weight min(cap, pi/mu) "
                                  "(V-trace's rho-bar)", "algorithm", ge=1, le=1e6)
    # optim
    # AdamW's decoupled decay scales a weight by 1 - lr·weight_decay: both at most 1 keep it in [0, 1].
    lr: float = _f(3e-3, "AdamW learning rate", "optim", ge=0, le=1)
    weight_decay: float = _f(0.0, "AdamW weight decay", "optim", ge=0, le=1)
    lr_schedule: Literal["constant", "linear", "cosine"] = _f("constant", "learning-rate schedule over the run's "
                                                                          "optimizer steps, after the warmup",
                                                              "optim")
    lr_warmup_steps: int = _f(0, "optimizer steps of linear warmup from 0", "optim", ge=0)
    ema_decay: float = _f(0.0, "EMA of the LoRA (0: off); checkpoints keep it and sample grids show it too",
                          "optim", ge=0, lt=1)
    max_grad_norm: float = _f(1.0, "gradient clipping norm", "optim", gt=0, le=1e6)
    optimizer: Literal["adamw", "adamw_bf16"] = _f(
        "adamw", "adamw (fp32 moments) or adamw_bf16 (moments stored in bf16: half the optimizer state; "
        "train/optim.py)", "optim")
    ema_offload: bool = _f(False, "keep the EMA (--ema-decay) in CPU memory, each rank its shards", "optim")
    debug_skip_optimizer_step: bool = _f(False, "compute everything but do not step the optimizer", "optim")
    # parallel
    device: str = _f("cpu", "torch device", "parallel")
    deterministic: bool = _f(False, "deterministic kernels only (torch.use_deterministic_algorithms, a fixed cuBLAS "
                                    "workspace, no cuDNN autotuning), so two runs on one GPU train bit for bit alike; "
                                    "an op with no deterministic kernel then stops the run, naming it", "parallel")
    engine_process: bool = _f(False, "run the engine in its own process; LoRA synced by IPC handles", "parallel")
    share_base_weights: bool | Literal["auto"] = _f(
        "auto", "the in-process engine reads the train side's frozen base weights instead of a copy of its own; auto: "
        "where it is safe (a LoRA run, unmerged, one rank), true: refuse a run where it is not (docs/training.md)",
        "parallel")
    engine_url: list[str] | None = _f(None, "use running `trueflow serve` engines on this machine, one per rank in "
                                            "rank order (repeatable); each must run this run's checkpoint, patch "
                                            "group, dtype and CPU threads", "parallel", min_length=1)
    ray: bool = _f(False, "place the trainer ranks and their engines as Ray actors (docs/scaling.md)", "parallel")
    world_size: int | None = _f(None, "--ray: trainer ranks, each with its engine on its device (default: 1)",
                                "parallel", ge=1)
    ray_address: str | None = _f(None, "--ray: join this Ray cluster (`auto`, or the head's HOST:PORT) instead of "
                                       "starting a local one", "parallel", min_length=1)
    rollout_gpus: int | None = _f(None, "--ray, disaggregated: engine actors on devices of their own (CPU slots on "
                                        "CPU), weights broadcast from trainer rank 0", "parallel", ge=1)
    train_gpus: int | None = _f(None, "--ray, disaggregated: trainer ranks on devices of their own", "parallel",
                                ge=1)
    tp: int = _f(1, "tensor-parallel ranks of the engine, one process each (with --engine-process and one trainer "
                    "rank; docs/tensor-parallel.md)", "parallel", ge=1)
    train_tp_match: int | None = _f(None, "compute each sharded layer of the train side as the engine's --tp ranks "
                                          "do (= --tp): bitwise under tensor parallelism", "parallel", ge=2)
    threads: int | None = _f(None, "intra-op CPU threads of every rank and its engine (default: torch's; torchrun "
                                   "sets 1)", "parallel", ge=1)
    train_dp_split_mode: Literal["contiguous", "stride"] = _f("contiguous", "how train pairs go to DP ranks",
                                                              "parallel")
    micro_batch_size_sample: int = _f(4, "samples per train micro-batch", "parallel", ge=1)
    micro_batch_size_tstep: int = _f(1, "denoising steps per train micro-batch", "parallel", ge=1)
    gpu_memory_gib: float | None = _f(
        None, "plan the run's memory against GPUs of this many GiB (default on CUDA: the device's; on CPU: no plan)",
        "parallel", gt=0)
    pad_text_to: int | None = _f(None, "pad train text to this many tokens (a whole-window pad; breaks parity)",
                                 "parallel", ge=1)
    # checkpoint
    save_every: int = _f(10, "checkpoint every K optimizer steps, at the next rollout boundary (and at the end; "
                             "0: at the end only)", "checkpoint", ge=0)
    keep_checkpoints: int = _f(3, "after each checkpoint, prune all but the N newest complete ones (the latest is "
                                  "never pruned; 0: keep all)", "checkpoint", ge=0)
    resume: bool | Literal["auto"] = _f(False, "continue from the latest complete checkpoint in output_dir (none: "
                                               "an error); auto: continue if there is one, else start afresh",
                                        "checkpoint")
    # reward
    reward: str = _f("redness", "reward spec: name, name:w,name2:w2, module:function or http://HOST:PORT",
                     "reward", "name", min_length=1)
    reward_model: str | None = _f(None, "local model folder of the reward (e.g. PickScore)", "reward", "model",
                                  min_length=1)
    reward_placement: Literal["trainer", "engine", "actor"] = _f(
        "trainer", "where the reward runs: each trainer rank's process, the engine process (with engine_process), "
                   "or a Ray actor beside each trainer rank (with ray)", "reward", "placement")
    reward_url: str | None = _f(None, "URL given to the reward terms that take one (vlm_judge's chat server)",
                                "reward", "url", min_length=1)
    reward_frames: int = _f(3, "video: the image reward scores this many evenly spread frames of each sample and "
                               "averages them", "reward", "frames", ge=1)
    reward_on_error: Literal["raise", "skip"] = _f("raise", "a failing reward: stop cleanly, or skip that "
                                                            "prompt's group", "reward", "on_error")

    # -- checks ---------------------------------------------------------------------------------------------------
    @model_validator(mode="before")
    @classmethod
    def _default_sde_steps(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("num_sde_steps") is None:
            steps = data.get("steps", cls.model_fields["steps"].default)
            if isinstance(steps, str) and steps.strip().isdigit():  # as flags give it
                steps = int(steps)
            if isinstance(steps, int) and not isinstance(steps, bool):  # a bad `steps` is reported by its own check
                data = {**data, "num_sde_steps": min(DEFAULT_NUM_SDE_STEPS, steps)}
        return data

    @field_validator("lora_target_modules", "lora_experts", "disable_patch", "engine_url", mode="before")
    @classmethod
    def _names_in(cls, v: Any) -> Any:
        if v == [None]:  # `--section.key null` on the command line: unset
            return None
        return list(v) if isinstance(v, tuple) else v

    @field_validator("gradient_checkpointing", "share_base_weights", mode="before")
    @classmethod
    def _switch_or_auto(cls, v: Any) -> Any:
        if isinstance(v, str) and v.strip().lower() not in {"auto", "true", "false", "yes", "no", "on", "off", "1",
                                                             "0"}:
            raise ValueError("takes no value (on), false (off) or auto")
        return v

    @field_validator("resume", mode="before")
    @classmethod
    def _resume_mode(cls, v: Any) -> Any:
        if isinstance(v, str) and v.strip().lower() not in {"auto", "true", "false", "yes", "no", "on", "off", "1",
                                                             "0"}:
            raise ValueError("takes no value (continue from the latest checkpoint, which must be there) or auto "
                             "(continue if there is one, else start afresh)")
        return v

    @field_validator("lora_target_modules", "lora_experts", "disable_patch")
    @classmethod
    def _names(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and not all(name.strip() for name in v):
            raise ValueError("names must not be empty")
        return v

    @model_validator(mode="after")
    def _combinations(self) -> "TrainConfig":
        errors = self.combination_errors()
        if errors:
            raise ValueError("; ".join(errors))
        return self

    def combination_errors(self) -> list[str]:
        errors = []
        n, size = self.n_samples_per_prompt, self.rollout_microgroup_size
        if n % size and not (self.batch_invariant and size % n == 0):
            errors.append(f"--n-samples-per-prompt {n} must be a multiple of --rollout-microgroup-size {size}"
                          + (" (or, in the batch-invariant mode, the microgroup a multiple of it: whole prompts)"
                             if self.batch_invariant else ""))
        if self.batch_invariant and self.rollout_patch_group == "none":
            errors.append("--batch-invariant adds to a patch group's train-exact numerics: give --patch-group (the "
                          "family's), not none")
        if self.batch_invariant and self.fsdp_attention_backend not in (None, _batch_invariant_backend()):
            errors.append(f"--batch-invariant runs the train side's {_batch_invariant_backend()} attention backend: "
                          f"drop --fsdp-attention-backend {self.fsdp_attention_backend}")
        if self.train_kernels == "fused" and self.model_family().train.fused_kernels is None:
            errors.append(f"--train-kernels fused: the {self.model_family().name} family has no train kernels "
                          "(Qwen-Image has); use --train-kernels stock")
        if self.train_kernels == "fused" and self.dtype != "bf16":
            errors.append(f"--train-kernels fused replays diffusers' bf16 roundings: use --dtype bf16 (not "
                          f"{self.dtype}) or --train-kernels stock")
        if self.num_sde_steps is not None and self.num_sde_steps > self.steps:
            errors.append(f"--num-sde-steps {self.num_sde_steps} must be in 1..--steps ({self.steps})")
        if self.sde_window is not None:
            lo, hi = self.sde_window
            if not (0 <= lo < hi <= self.steps and hi - lo >= (self.num_sde_steps or 0)):
                errors.append(f"--sde-window {lo},{hi} must satisfy 0 <= lo < hi <= --steps ({self.steps}) and "
                              f"hold --num-sde-steps ({self.num_sde_steps}) steps")
        if not self.use_lora:
            if self.kl_beta:
                errors.append("--no-use-lora with --kl-beta: the KL reference of a full fine-tune needs a frozen copy "
                              "of the base model, which is not implemented; set --kl-beta 0, or train a LoRA")
            if self.lora_merge_mode == "merged":
                errors.append("--lora-merge-mode merged: a full fine-tune sends no LoRA; drop it")
            if self.tp > 1:
                errors.append(f"--no-use-lora with --tp {self.tp}: a tensor-parallel engine takes no full-weight "
                              "updates; run the engine at --tp 1")
        if self.train_tp_match is not None and self.train_tp_match != self.tp:
            errors.append(f"--train-tp-match {self.train_tp_match} must equal --tp {self.tp}: the train side computes "
                          "each sharded layer as the engine's ranks do")
        if self.tp > 1 and not self.engine_process and not self.ray:  # --ray refuses --tp itself
            errors.append(f"--tp {self.tp} runs the engine over {self.tp} processes of its own: add --engine-process")
        if self.engine_url and self.engine_process:
            errors.append("--engine-url and --engine-process are two placements of the engine: choose one")
        errors += self._ray_errors()
        if self.reward_placement == "engine" and not self.engine_process:
            errors.append("--reward-placement engine needs --engine-process (without it the engine runs in the "
                          "trainer's process, which is --reward-placement trainer)")
        granule = self.model_family().pipeline.pixels_per_token
        sides = {f"--{name} {side}": side for name, side in (("resolution", self.resolution), ("height", self.height),
                                                             ("width", self.width)) if side is not None}
        bad = [flag for flag, side in sides.items() if side % granule]
        if bad:
            errors += [f"{flag} must be a multiple of {granule} ({self.model_family().pipeline.size_reason})"
                       for flag in bad]
        else:
            try:
                self.model_family().pipeline.latent_grid(*self.frame_size(), self.num_frames)
            except ValueError as e:
                errors.append(f"--num-frames {self.num_frames}: {e}")
        if self.disable_patch and self.rollout_patch_group == "none":
            errors.append("--disable-patch needs a patch group; --patch-group none applies no patches")
        if self.rollout_patch_group is not None:
            from ..models import patch_group_for

            try:
                patch_group_for(self.model_family(), self.rollout_patch_group)
            except ValueError as e:
                errors.append(str(e))
        if self.ratio_norm == "grpo_guard" and self.sampler == "cps":
            errors.append("--ratio-norm grpo_guard needs --sampler sde: CPS's log-prob drops the 1/(2s^2) term "
                          "RatioNorm cancels")
        if self.algorithm == "nft":
            if self.cfg_scale != 1:
                errors.append(f"--algorithm nft is CFG-free: set --cfg-scale 1 (got {self.cfg_scale}); the old "
                              "policy's velocity is the engine's recorded output, which must be the model's own")
            if self.kl_beta:
                errors.append("--algorithm nft is KL-free: set --kl-beta 0")
            if self.ratio_norm != "none":
                errors.append("--ratio-norm applies to --algorithm grpo (nft has no likelihood ratio)")
        errors += self._async_errors()
        total = self.num_rollouts * self.num_steps_per_rollout
        if self.lr_warmup_steps and self.lr_warmup_steps >= total:
            errors.append(f"--lr-warmup-steps {self.lr_warmup_steps} must be less than the run's optimizer steps "
                          f"({total} = --num-rollouts x --num-steps-per-rollout)")
        return errors

    def _async_errors(self) -> list[str]:
        n = self.async_rollouts
        if not n:
            return []
        errors = []
        if not (self.engine_process or self.engine_url or self.ray):
            errors.append(f"--async-rollouts {n} overlaps the engine's rollout with training: run the engine outside "
                          "the trainer's process (--engine-process, --engine-url or --ray); the in-process engine "
                          "shares the trainer's process and devices")
        if self.num_steps_per_rollout > 1:
            errors.append(f"--async-rollouts {n} takes --num-steps-per-rollout 1: its proximal policy is the policy "
                          "before the step, free on a rollout's one step (a later step would need another forward)")
        if n > 1 and self.ray and (self.train_gpus or 1) > 1:
            errors.append(f"--async-rollouts {n} with {self.train_gpus} disaggregated --ray trainer ranks: rank 0 "
                          "broadcasts each update to every engine when it sends it, so one rollout at most may run "
                          "ahead; use --async-rollouts 1")
        if not self.use_lora:
            errors.append(f"--async-rollouts {n} keeps the trained weights of every rollout in flight: a LoRA's, "
                          "not a whole transformer's; drop --no-use-lora or --async-rollouts")
        return errors

    def ray_ranks(self) -> tuple[int, int]:
        """(trainer ranks, engine actors of their own) of a --ray run; 0 engines: each rank's engine shares its
        device (colocated)."""
        if self.train_gpus is not None:
            return self.train_gpus, self.rollout_gpus or 0
        return self.world_size or 1, 0

    def trainer_ranks(self) -> int:
        """How many trainer ranks this run has: --ray's, or torchrun's WORLD_SIZE (1 without torchrun)."""
        return self.ray_ranks()[0] if self.ray else int(os.environ.get("WORLD_SIZE", 1))

    def _ray_errors(self) -> list[str]:
        named = [flag for flag, v in (("--world-size", self.world_size), ("--ray-address", self.ray_address),
                                      ("--rollout-gpus", self.rollout_gpus), ("--train-gpus", self.train_gpus))
                 if v is not None]
        if self.reward_placement == "actor":
            named.append("--reward-placement actor")
        if not self.ray:
            return [f"{', '.join(named)}: settings of a Ray run; add --ray"] if named else []
        errors = []
        if self.engine_process or self.engine_url:
            errors.append("--ray places each rank's engine as a Ray actor: drop --engine-process / --engine-url")
        if self.tp > 1:
            errors.append(f"--tp {self.tp}: a Ray run's engine actors run at --tp 1 (tensor-parallel engine actors "
                          "are not implemented); drop --tp or --ray")
        if self.reward_placement == "engine":
            errors.append("--ray scores in each trainer rank (--reward-placement trainer) or in a reward actor "
                          "beside it (--reward-placement actor)")
        if (self.rollout_gpus is None) != (self.train_gpus is None):
            errors.append("a disaggregated --ray run takes both --rollout-gpus R and --train-gpus T")
        elif self.train_gpus is not None and self.rollout_gpus is not None:  # both or neither (just above)
            if self.world_size not in (None, self.train_gpus):
                errors.append(f"--world-size {self.world_size} and --train-gpus {self.train_gpus} both count the "
                              "trainer ranks: give one")
            if self.rollout_gpus > self.train_gpus:
                errors.append(f"--rollout-gpus {self.rollout_gpus} exceeds --train-gpus {self.train_gpus}: each "
                              "engine serves whole trainer ranks (rank r uses engine r*R//T); use at most T engines")
        trainers = self.ray_ranks()[0]
        if self.rollout_batch_size % trainers:
            errors.append(f"--rollout-batch-size {self.rollout_batch_size} must be a multiple of the {trainers} "
                          "trainer ranks: each rank rolls out an equal share of whole prompts")
        return errors

    def frame_size(self) -> tuple[int, int]:
        """(height, width) in pixels: `height`/`width` where given, else the square `resolution`."""
        return (self.resolution if self.height is None else self.height,
                self.resolution if self.width is None else self.width)

    def model_family(self) -> "ModelFamily":
        """The family of `checkpoint` (its model_index.json), else `family`, else the default family."""
        from ..models import default_family, family_for_checkpoint, get_family

        if self.checkpoint is not None:
            return family_for_checkpoint(self.checkpoint, self.family)
        return get_family(self.family) if self.family is not None else default_family()

    def fill_family_defaults(self) -> "ModelFamily":
        """Sets the settings left to the model family (LoRA targets, train attention backend, patch group, negative
        prompt) to the family's values, so that a run records them; returns the family."""
        fam = self.model_family()
        if self.lora_target_modules is None:
            self.lora_target_modules = list(fam.train.lora_targets)
        if self.fsdp_attention_backend is None:
            self.fsdp_attention_backend = _batch_invariant_backend() if self.batch_invariant else \
                fam.train.parity_backend
        if self.rollout_patch_group is None:
            self.rollout_patch_group = next(iter(fam.patch_groups))
        if self.negative_prompt is None:  # stays None where the family's pipeline has none (FLUX.1)
            self.negative_prompt = fam.guidance.negative_prompt
        return fam

    def preflight(self) -> None:
        """What is checked before anything heavy loads (torch's core and the family registry only; no model, no
        diffusers): the prompts file, the checkpoint folder, the run folder, the patch group's patches, the
        device. `trueflow train` runs it before it imports the trainer, and `validate` again."""
        import torch

        from ..engine.guidance import check_guidance, check_negative_prompt
        from ..models import get_group
        from .prompts import load_prompts

        load_prompts(self.prompts)
        if self.checkpoint is not None and not (Path(self.checkpoint) / "model_index.json").is_file():
            raise FileNotFoundError(f"--checkpoint {self.checkpoint}: not a diffusers pipeline folder (no "
                                    "model_index.json); leave it unset for the tiny demo checkpoint")
        out = Path(self.output_dir)
        if out.exists() and not out.is_dir():
            raise FileExistsError(f"--output-dir {out} is a file: name a folder")
        if not self.resume and (out / "metrics.jsonl").exists():
            raise FileExistsError(f"{out} holds a run: use --resume to continue it, or another --output-dir")
        fam, group_name, _ = self._family_choices()
        group = get_group(group_name)  # raises with the known names
        unknown = sorted(set(self.disable_patch) - set(group.patch_names if group else ()))
        if unknown:
            assert group is not None  # a disabled patch needs a patch group (refused on construction)
            raise ValueError(f"--disable-patch {', '.join(unknown)}: not a patch of group {group_name!r} "
                             f"(its patches: {', '.join(group.patch_names)})")
        # What the family's guidance cannot take (the checkpoint's expert count is checked by the trainer).
        negative = self.negative_prompt if self.negative_prompt is not None else fam.guidance.negative_prompt
        check_guidance(fam.name, fam.guidance, self.cfg_scale, self.cfg_scale_2, self.distilled_guidance_scale)
        check_negative_prompt(fam.name, fam.guidance, self.cfg_scale, negative)
        if not self.max_sequence_length <= fam.pipeline.max_text_tokens:
            raise ValueError(f"--max-sequence-length {self.max_sequence_length}: {fam.name} takes at most "
                             f"{fam.pipeline.max_text_tokens} text tokens")
        try:
            device = torch.device(self.device)
        except RuntimeError:
            raise ValueError(f"--device {self.device}: not a torch device (e.g. cpu, cuda, cuda:1)") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {self.device}: this machine has no CUDA device; use --device cpu")

    # shadows pydantic's BaseModel.validate (its deprecated v1 classmethod, unused here): the run's own checks
    def validate(self) -> None:  # type: ignore[override]
        """Everything not checked on construction: `preflight`, then what needs diffusers or an optional package
        (the attention backend, wandb), then one ParityConditionWarning per broken condition. Fills the settings
        left to the family."""
        import torch
        from diffusers.models.attention_dispatch import AttentionBackendName

        from .metrics import require_wandb

        self.preflight()
        fam = self.fill_family_defaults()
        if self.wandb:
            require_wandb()
        device = torch.device(self.device).type  # a valid name: `preflight` checked it
        if self.batch_invariant:  # its diffusers backend, registered (and this process's GEMMs in the mode)
            from .batch_invariant import register_backend

            register_backend()
        backends = [b.value for b in AttentionBackendName]
        if self.fsdp_attention_backend not in backends:
            raise ValueError(f"--fsdp-attention-backend {self.fsdp_attention_backend}: not a diffusers attention "
                             f"backend; use {fam.train.parity_backend} (or one of {', '.join(sorted(backends))})")
        if self.fsdp_attention_backend == "_native_cudnn" and device != "cuda":
            raise ValueError(f"--fsdp-attention-backend _native_cudnn needs a CUDA device (cuDNN attention does not "
                             f"exist on {device}); use --device cuda, or {fam.train.parity_backend}")
        for message in self.parity_warnings():
            warnings.warn(message, ParityConditionWarning, stacklevel=2)
        slow = self.oversubscription()
        if slow:
            warnings.warn(slow, RuntimeWarning, stacklevel=2)

    def oversubscription(self, cores: int | None = None, default_threads: int | None = None) -> str | None:
        """The line to warn with when the CPU processes that compute at the same time ask for more intra-op
        threads than the `cores` this process may use (default: its CPU affinity; `default_threads`: torch's count,
        which `--threads` overrides). The threads then contend, and both sides run slower (docs/training.md,
        "Async rollouts"). Busy at once: each rank's engine processes (`--tp` of them) and, with `--async-rollouts`,
        the trainer training beside them; a synchronous trainer waits while its engine rolls out. Only
        `--engine-process` is checked: a `--engine-url` server's threads and Ray's actors are not this run's to
        count."""
        if not self.device.startswith("cpu") or not self.engine_process:
            return None
        import torch

        if cores is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        busy = self.trainer_ranks() * (self.tp + (1 if self.async_rollouts else 0))
        threads = self.threads or default_threads or torch.get_num_threads()
        if busy * threads <= cores:
            return None
        fix = (f"use --threads {cores // busy}" if busy <= cores else
               "even --threads 1 is too many: use fewer --tp ranks or trainer ranks, or drop --async-rollouts")
        return (f"{busy} CPU process{'es compute' if busy > 1 else ' computes'} at once with {threads} intra-op "
                f"threads each on {cores} cores: the threads contend and slow both sides down; "
                f"{fix}")

    def _family_choices(self) -> tuple["ModelFamily", str, str]:
        """(family, rollout patch group, train attention backend), the unset ones at the family's defaults."""
        fam = self.model_family()
        default = _batch_invariant_backend() if self.batch_invariant else fam.train.parity_backend
        return fam, self.rollout_patch_group or next(iter(fam.patch_groups)), self.fsdp_attention_backend or default

    def engine_patch_group(self) -> str:
        """The engine's patch group: a plain family group under another train attention backend than the family's
        parity one becomes `group:BACKEND` where the family has an engine kernel for that backend (the bitwise
        pair)."""
        fam, group, backend = self._family_choices()
        if group in fam.patch_groups and backend != fam.train.parity_backend:
            from ..models import get_group

            paired = f"{group}:{backend}"
            try:
                get_group(paired)
                return paired
            except ValueError:  # no engine kernel reproduces that backend: condition 5 warns
                pass
        return group

    def parity_warnings(self) -> list[str]:
        """One message per broken condition of bitwise parity (docs/patch-group.md; recipes/bitwise-aligned.yaml
        breaks none)."""
        fam, group, backend = self._family_choices()
        out = []
        if group == "none":
            out.append("--patch-group none: the engine runs its fast numerics, so train/rollout parity is not "
                       f"bitwise (use --patch-group {next(iter(fam.patch_groups))})")
        if self.tp > 1 and self.train_tp_match != self.tp:
            out.append(f"condition 6: --tp {self.tp} without --train-tp-match {self.tp}: the engine's tensor-parallel "
                       "forward sums each row-parallel layer's shards, which the stock train side does not "
                       "(docs/tensor-parallel.md)")
        if self.disable_patch:
            out.append(f"--disable-patch {', '.join(self.disable_patch)}: parity is not bitwise without it")
        # Later steps train on moved weights by design; what condition 1 guards is the measured mismatch. With
        # --parity-on-every-step each later step re-scores with the rolled-out LoRA, exactly 0.0 again (the policy's
        # own change shows in policy_*), so nothing of parity is lost; without it those steps go unmeasured.
        if self.num_steps_per_rollout > 1 and not self.parity_on_every_step:
            out.append(f"condition 1: --num-steps-per-rollout {self.num_steps_per_rollout}: only the first "
                       "optimizer step of a rollout runs on the rolled-out weights; the later ones' train/rollout "
                       "mismatch is not measured (null) unless --parity-on-every-step (policy_* shows the change)")
        # The batch-invariant mode lifts conditions 2, 3 and 4: no row depends on the batch, its padding or mask.
        if self.pad_text_to is not None and not self.batch_invariant:
            out.append(f"condition 3: --pad-text-to {self.pad_text_to} pads the train batch to a whole window, "
                       "not to the rollout request's width (--batch-invariant lifts it)")
        if not self.batch_invariant and (self.micro_batch_size_sample != self.rollout_microgroup_size
                                         or self.micro_batch_size_tstep != 1):
            out.append(f"condition 4: a train micro-batch ({self.micro_batch_size_sample} samples x "
                       f"{self.micro_batch_size_tstep} steps) is not a rollout microgroup "
                       f"({self.rollout_microgroup_size} samples x 1 step): batch shapes differ (--batch-invariant "
                       "lifts it)")
        if self.train_dp_split_mode != "contiguous" and not self.batch_invariant:
            out.append("condition 4: --train-dp-split-mode stride mixes prompts (and text lengths) in one "
                       "micro-batch; use contiguous (or --batch-invariant)")
        engine_group = self.engine_patch_group()
        if backend != (engine_group.partition(":")[2] or fam.train.parity_backend):
            plain = next(iter(fam.patch_groups))
            paired = [b for b in fam.patch_groups[plain].train_backends if b != fam.train.parity_backend]
            out.append(f"condition 5: --fsdp-attention-backend {backend}: the train side runs another attention "
                       f"kernel than the engine under patch group {engine_group} (use {fam.train.parity_backend}"
                       + "".join(f" or {b}" for b in paired)
                       + f", which plain {plain} pairs with the engine's kernel)")
        if self.lora_merge_mode == "merged":
            out.append("--lora-merge-mode merged: W + scale·B·A in bf16 rounds differently from PEFT's "
                       "unmerged forward")
        kept = () if self.use_lora else getattr(fam.train.model_class(), "_keep_in_fp32_modules", None) or ()
        if kept:  # a LoRA run leaves them frozen in fp32 (train.policy.kept_in_fp32); FSDP2 casts trained masters
            out.append(f"--no-use-lora on {fam.name}: diffusers keeps {', '.join(kept)} in fp32 "
                       f"({fam.train.transformer_class}._keep_in_fp32_modules) and the pipeline computes them so; a "
                       "full fine-tune's bf16 compute copies (and the weights it syncs) round them to bf16: train a "
                       "LoRA")
        return out

    # -- the sectioned form ---------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Flat, JSON-able (what a checkpoint records)."""
        return self.model_dump(mode="json")

    def to_nested(self) -> dict:
        """The sectioned form, as YAML and flags name it; `from_nested(cfg.to_nested()) == cfg`."""
        out: dict[str, Any] = {s: {} for s in SECTIONS}
        for name, value in self.to_dict().items():
            section, key = LOCATIONS[name]
            (out[section] if section else out)[key] = value
        return {**{k: v for k, v in out.items() if k not in SECTIONS}, **{s: out[s] for s in SECTIONS}}

    @classmethod
    def from_nested(cls, data: dict, source: str = "settings") -> "TrainConfig":
        return cls(**_flatten(data, source))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_nested(), sort_keys=False, allow_unicode=True)


# What a resumed run may change: where it writes, how long it runs, what it logs, where its parts run (placement
# changes no metric, tests/test_train.py). Any other setting changes the math of the run, so a resume refuses it.
RESUME_MAY_CHANGE = frozenset({"output_dir", "resume", "num_rollouts", "save_every", "keep_checkpoints",
                               "sample_every", "tensorboard",
                               "wandb", "wandb_project", "wandb_name", "debug", "engine_process", "engine_url",
                               "reward_placement", "gradient_checkpointing", "gpu_memory_gib", "share_base_weights",
                               "ray", "world_size",
                               "ray_address",
                               "rollout_gpus", "train_gpus"})
RESUME_WARNS = frozenset({"device"})  # allowed, but the numerics of another device differ in the last bits
# None: the family's
FAMILY_DEFAULTS = ("lora_target_modules", "fsdp_attention_backend", "rollout_patch_group", "negative_prompt")


def resume_changes(saved: dict, cfg: TrainConfig) -> tuple[list[str], list[str]]:
    """(refused, warned) descriptions of the settings `cfg` changes from a checkpoint's recorded ones. A setting
    the checkpoint does not record (it predates it) counts as its default; one left to the model family, as the
    family's value."""
    family_defaults = TrainConfig(checkpoint=cfg.checkpoint, family=cfg.family)
    family_defaults.fill_family_defaults()
    before, now = {**TrainConfig().to_dict(), **saved}, cfg.to_dict()
    for name in FAMILY_DEFAULTS:
        for values in (before, now):
            if values[name] is None:
                values[name] = getattr(family_defaults, name)
    refused: list[str] = []
    warned: list[str] = []
    for name, value in now.items():
        # A decaying lr schedule spans the run's optimizer steps: a longer run would change every lr from here on.
        fixed = name == "num_rollouts" and cfg.lr_schedule != "constant"
        if (name not in RESUME_MAY_CHANGE or fixed) and before[name] != value:
            line = f"{_flag(*LOCATIONS[name])} {_show(value)} (the run has {_show(before[name])})"
            (warned if name in RESUME_WARNS else refused).append(line)
    return refused, warned


def _show(v: Any) -> str:
    return ",".join(map(str, v)) if isinstance(v, list) else "null" if v is None else str(v)


def _location(name: str, f: FieldInfo) -> tuple[str | None, str]:
    extra = f.json_schema_extra or {}
    assert isinstance(extra, dict)  # `_f` sets {"section": str | None, "key": str | None}
    return cast("str | None", extra["section"]), cast("str | None", extra["key"]) or name


LOCATIONS: dict[str, tuple[str | None, str]] = {n: _location(n, f) for n, f in TrainConfig.model_fields.items()}
_FLAT_NAME = {loc: name for name, loc in LOCATIONS.items()}


def _flatten(data: dict, source: str) -> dict:
    """Sectioned settings -> TrainConfig's keyword arguments. `-` and `_` are the same in names."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a mapping of settings (section: {{name: value}}), "
                         f"got a {type(data).__name__}")
    out, unknown = {}, []
    for top, value in data.items():
        top = str(top).replace("-", "_")
        if top in SECTIONS:
            if not isinstance(value, dict):
                raise ValueError(f"{source}: {top} must be a section (a mapping of settings), "
                                 f"got {value!r}")
            for key, v in value.items():
                name = _FLAT_NAME.get((top, str(key).replace("-", "_")))
                if name is None:
                    unknown.append(f"{top}.{key}")
                else:
                    out[name] = v
        elif (None, top) in _FLAT_NAME:
            out[top] = value
        else:
            unknown.append(top)
    if unknown:
        raise ValueError(f"{source}: unknown setting(s) {', '.join(unknown)} "
                         f"(`trueflow train --print-config` lists every setting in its section)")
    return out


def _unflatten_flat_yaml(data: dict, source: str) -> dict:
    """A flat file (`steps: 3`, `reward: pickscore`) in sections, with a warning naming the new places."""
    nested: dict[str, Any] = {}
    moved = []
    for top, value in data.items():
        name = str(top).replace("-", "_")
        if name in SECTIONS and isinstance(value, dict):
            nested.setdefault(name, {}).update(value)
        elif name in LOCATIONS and LOCATIONS[name][0] is not None:  # a setting of a section, written flat
            section, key = LOCATIONS[name]
            assert section is not None  # the condition above
            nested.setdefault(section, {})[key] = value
            moved.append(f"{top} -> {section}.{key}")
        else:  # a top-level setting (or an unknown one, which `_flatten` reports)
            nested[name] = value
    if moved:
        warnings.warn(f"{source} is a flat settings file; read as {', '.join(moved)}. Write settings in their "
                      "sections (`trueflow train --print-config` prints the layout)", FlatConfigWarning, stacklevel=3)
    return nested


def load_yaml(path: str) -> dict:
    """A YAML settings file as sections (a flat file is converted, with a FlatConfigWarning)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--config {path}: no such file" + (" (it is a folder)" if p.is_dir() else ""))
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ValueError(f"--config {path}: not valid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of settings (section: {{name: value}}), got a "
                         f"{type(data).__name__}")
    return _unflatten_flat_yaml(data, f"--config {path}")


# -- the command line --------------------------------------------------------------------------------------------
_DESTS = {f"{section}.{key}" if section else key for section, key in LOCATIONS.values()}
_MORE_ALIASES = {"rollout_patch_group": ("patch-group",)}  # the name the other verbs give it


def _flag(section: str | None, key: str) -> str:
    return "--" + (f"{section}." if section else "") + key.replace("_", "-")


def _flat_aliases(name: str) -> list[str]:
    """A setting's flat flags, without the leading -- (none where its sectioned flag is already flat)."""
    nested = _flag(*LOCATIONS[name])[2:]
    return [a for a in (name.replace("_", "-"), *_MORE_ALIASES.get(name, ())) if a != nested]


def _default_text(f: FieldInfo) -> str:
    default = f.default
    return repr(default) if isinstance(default, str) and default.strip() != default else _show(default)


def settings_table() -> str:
    """docs/training.md's settings table, one row per setting from this schema (tests/test_docs.py keeps the doc
    equal to it; `python scripts/docs.py --table` rewrites it)."""
    lines = ["| setting (YAML) | flags | default | what it sets |", "|---|---|---|---|"]
    for name, f in TrainConfig.model_fields.items():
        section, key = LOCATIONS[name]
        flags = [_flag(section, key), *(f"--{a}" for a in _flat_aliases(name))]
        args = [a for a in typing.get_args(f.annotation) if a is not type(None)]
        choices = f" ({' or '.join(f'`{c}`' for c in typing.get_args(args[0] if args else f.annotation))})" \
            if typing.get_origin(args[0] if args else f.annotation) is Literal else ""
        what = (f.description or "").replace("|", "\\|")
        lines.append(f"| `{f'{section}.' if section else ''}{key}` | {', '.join(f'`{x}`' for x in flags)} | "
                     f"`{_default_text(f)}` | {what}{choices} |")
    return "\n".join(lines) + "\n"


def _settings_class() -> type:
    """TrainConfig in sections, for pydantic-settings to build flags from (the checks stay in TrainConfig)."""
    from pydantic_settings import BaseSettings

    sections: dict[str, dict] = {s: {} for s in SECTIONS}
    top: dict[str, Any] = {}
    for name, f in TrainConfig.model_fields.items():
        section, key = LOCATIONS[name]
        field = (f.annotation, Field(f.default, description=f.description))
        (sections[section] if section else top)[key] = field
    for s, fields in sections.items():
        model = create_model(s.capitalize(), __config__=ConfigDict(extra="forbid"), **fields)
        top[s] = (model, Field(default_factory=model, description=f"{s} settings"))
    return create_model("TrainSettings", __base__=BaseSettings, **top)


def add_arguments(p: argparse.ArgumentParser) -> Any:
    """Adds `--config`, `--print-config` and every setting (`--section.key`, with its flat alias) to `p`; returns
    the pydantic-settings source that reads them back (`config_from_args`)."""
    from pydantic_settings import CliSettingsSource

    p.add_argument("--config", metavar="YAML", help="settings file (sections as --print-config writes them; flags "
                   "override it)")
    p.add_argument("--print-config", action="store_true", help="print the settings as YAML and exit (`--config` "
                   "loads that back)")
    shortcuts = {}  # sectioned flag -> its flat aliases, without the leading --
    for name, (section, key) in LOCATIONS.items():
        nested, flat = _flag(section, key)[2:], _flat_aliases(name)
        if name in SECTIONS:  # --checkpoint, --reward: pydantic-settings would take these names for the sections
            p.add_argument(*(f"--{a}" for a in flat), dest=f"{section}.{key}", default=argparse.SUPPRESS,
                           metavar="VALUE", help=f"{TrainConfig.model_fields[name].description} (alias of --{nested})")
        elif flat:
            shortcuts[nested] = flat
    return CliSettingsSource(_settings_class(), root_parser=p, cli_kebab_case=True, cli_implicit_flags=True,
                             cli_avoid_json=True, cli_shortcuts=shortcuts, cli_parse_none_str="null",
                             add_argument_method=_add_setting_argument)


_SWITCH_OR_AUTO = ("checkpoint.resume", "model.gradient_checkpointing", "parallel.share_base_weights")


def _add_setting_argument(parser: Any, *names: str, **kwargs: Any) -> None:
    """pydantic-settings' add_argument, less its `--SECTION JSON` flags (--checkpoint and --reward are the flat
    aliases of model.checkpoint and reward.name, and every setting of a section has its own flag), with a metavar
    that says what to write and one default in the help."""
    dest = kwargs.get("dest")
    if dest in SECTIONS:
        return
    name = _FLAT_NAME.get(tuple(dest.split(".", 1)) if "." in dest else (None, dest)) if dest else None
    if name is not None:
        f = TrainConfig.model_fields[name]
        if "metavar" in kwargs:
            kwargs["metavar"] = _metavar(f.annotation)
        kwargs["help"] = _help(f)
    if dest in _SWITCH_OR_AUTO:  # a switch that also takes `auto`: --resume, --resume auto, --no-resume
        parser.add_argument(*names, **{**kwargs, "nargs": "?", "const": "true", "metavar": "auto"})
        parser.add_argument(*(f"--no-{n[2:]}" for n in names), dest=dest, action="store_const", const="false",
                            default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        return
    parser.add_argument(*names, **kwargs)


def _metavar(annotation: Any) -> str:
    """What a value looks like: `{a,b}` for a choice, N, X, TEXT, `A,B` for a list, `LO,HI` for a pair."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return _metavar(args[0])
    if typing.get_origin(annotation) is Literal:
        return "{" + ",".join(map(str, args)) + "}"
    if typing.get_origin(annotation) is list:
        return "A,B"
    if typing.get_origin(annotation) is tuple:
        return "LO,HI"
    return {int: "N", float: "X", str: "TEXT"}.get(annotation, "VALUE")


def _help(f: FieldInfo) -> str:
    """The description, with its default (once: a description that says its default keeps its own words), and how
    to unset an optional setting."""
    text = f.description or ""
    if "(default" not in text:
        text += f" (default: {_default_text(f)})"
    if type(None) in typing.get_args(f.annotation):
        text += "; null unsets it"
    return text.replace("%", "%%")


def config_from_args(args: argparse.Namespace, source: Any) -> TrainConfig:
    """defaults < --config file < flags."""
    nested = load_yaml(args.config) if getattr(args, "config", None) else {}
    flags = source(parsed_args={k: v for k, v in vars(args).items() if k in _DESTS})()
    for key, value in flags.items():
        if isinstance(value, dict) and isinstance(nested.get(key), dict):
            nested[key] = {**nested[key], **value}
        else:
            nested[key] = value
    return TrainConfig.from_nested(nested)


def config_from_argv(argv: list[str]) -> TrainConfig:
    """`trueflow train ARGV`'s settings (for scripts and tests)."""
    from ..options import Parser

    p = Parser(prog="trueflow train")
    source = add_arguments(p)
    return config_from_args(p.parse_args(argv), source)


def format_error(e: ValidationError) -> str:
    """A pydantic error as one line naming each bad setting as YAML and flags spell it."""
    parts = []
    for err in e.errors():
        loc = err["loc"]
        name = str(loc[0]) if loc else ""
        msg = err["msg"].removeprefix("Value error, ")
        if name in LOCATIONS:
            section, key = LOCATIONS[name]
            where = (f"{section}." if section else "") + key + "".join(f"[{i}]" for i in loc[1:])
            value = repr(err["input"])
            value = value if len(value) <= 80 else value[:77] + "..."  # a 10 MB string is not echoed back
            parts.append(f"{where} = {value}: {msg} (set {_flag(section, key)} or `{where}` in --config)")
        else:
            parts.append(msg)
    return "invalid settings: " + "; ".join(parts)
