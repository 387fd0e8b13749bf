"""`trueflow train` settings: one dataclass (config as data) that YAML files and flags fill, validated in one
place. Invalid combinations raise with the fix; combinations that break a condition of bitwise parity
(DESIGN 3) are allowed but warned about loudly, naming the condition."""

from __future__ import annotations

import argparse
import dataclasses
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

DEFAULT_LORA_TARGETS = (
    "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
    "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
)
PARITY_BACKEND = "_native_flash"  # the flash kernel, also what the engine pins under the qwen_image group
MASKED_BACKEND = "native"  # diffusers' `_native_flash` raises on any mask; this is where a masked batch goes


class ParityConditionWarning(UserWarning):
    """A setting breaks one of the conditions for bitwise train/rollout parity."""


def _f(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class TrainConfig:
    output_dir: str = _f("runs/train", "run folder: metrics.jsonl, checkpoints/, samples/, summary.md")
    checkpoint: str | None = _f(None, "diffusers Qwen-Image pipeline folder (default: a tiny one made under "
                                      "runs/tiny-checkpoint on first use)")
    prompts: str | None = _f(None, "text file, one prompt per line (default: the embedded demo prompts)")
    # rollout
    num_rollouts: int = _f(3, "rollouts (each followed by num_steps_per_rollout optimizer steps)")
    num_steps_per_rollout: int = _f(1, "optimizer steps per rollout; only the first is on-policy")
    rollout_batch_size: int = _f(2, "prompts per rollout")
    n_samples_per_prompt: int = _f(4, "samples per prompt (the GRPO group)")
    rollout_microgroup_size: int = _f(4, "samples of one prompt the engine runs as one batch")
    steps: int = _f(6, "denoising steps")
    sampler: str = _f("sde", "sde or cps (ode has no log-probs to train on)", choices=("sde", "cps"))
    noise_level: float = _f(0.7, "SDE/CPS noise level a")
    num_sde_steps: int = _f(2, "stochastic (and trained) steps per trajectory, in one window")
    sde_window: tuple[int, int] | None = _f(None, "half-open step range the SDE window lies in (default: all)", nargs=2)
    cfg_scale: float = _f(4.0, "true-CFG scale")
    negative_prompt: str = _f(" ", "negative prompt of the CFG branch")
    resolution: int = _f(64, "image side in pixels (multiple of 16)")
    rollout_patch_group: str = _f("qwen_image", "the engine's patch group (alias --patch-group)")
    disable_patch: list[str] = _f((), "switch one patch of the group off (repeatable)", action="append")
    lora_merge_mode: str = _f("unmerged", "how the engine takes LoRA updates", choices=("unmerged", "merged"))
    # training
    micro_batch_size_sample: int = _f(4, "samples per train micro-batch")
    micro_batch_size_tstep: int = _f(1, "denoising steps per train micro-batch")
    train_dp_split_mode: str = _f("contiguous", "how train pairs go to DP ranks", choices=("contiguous", "stride"))
    fsdp_attention_backend: str = _f(PARITY_BACKEND, "diffusers attention backend of the train forward")
    pad_text_to: int | None = _f(None, "pad train text to this many tokens (a whole-window pad; breaks parity)")
    use_lora: bool = _f(True, "train a LoRA (full fine-tuning is not implemented)")
    lora_rank: int = _f(8, "LoRA rank")
    lora_alpha: float | None = _f(None, "LoRA alpha (default: the rank)")
    lora_target_modules: list[str] = _f(DEFAULT_LORA_TARGETS, "LoRA target modules", nargs="+")
    gradient_checkpointing: bool = _f(False, "recompute block activations in backward (memory for time; the "
                                             "forward's values, hence parity, are unchanged)")
    lr: float = _f(3e-3, "AdamW learning rate")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    max_grad_norm: float = _f(1.0, "gradient clipping norm")
    clip_range: float = _f(1e-4, "PPO clip range")
    adv_clip_max: float = _f(5.0, "advantages are clipped to ±this")
    global_std: bool = _f(False, "normalise advantages by the std of all rewards instead of each group's")
    kl_beta: float = _f(0.0, "weight of the KL to the LoRA-disabled base")
    reward: str = _f("redness", "reward spec: name, name:w,name2:w2, or module:function")
    reward_model: str | None = _f(None, "local model folder of the reward (e.g. PickScore)")
    reward_placement: str = _f("trainer", "where the reward runs: the trainer's rank 0, or the engine process "
                                          "(with --engine-process; an HTTP reward server is --reward http://HOST:PORT)",
                               choices=("trainer", "engine"))
    reward_on_error: str = _f("raise", "a failing reward: stop cleanly, or skip that prompt's group",
                              choices=("raise", "skip"))
    # run
    seed: int = _f(0, "random seed")
    dtype: str = _f("bf16", "compute dtype", choices=("bf16", "fp32"))
    device: str = _f("cpu", "torch device")
    engine_process: bool = _f(False, "run the engine in its own process; LoRA synced by IPC handles")
    debug: bool = _f(False, "write snapshots of every rollout step")
    debug_skip_optimizer_step: bool = _f(False, "compute everything but do not step the optimizer")
    save_every: int = _f(0, "checkpoint every K optimizer steps, at the next rollout boundary (and at the end; "
                            "0: at the end only)")
    sample_every: int = _f(1, "write a sample grid every K rollouts")
    resume: bool = _f(False, "continue from the latest checkpoint in output_dir")
    tensorboard: bool = _f(False, "also write TensorBoard events")

    # -- loading ------------------------------------------------------------------------------------------------
    @classmethod
    def add_arguments(cls, p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", help="YAML file of settings (flags override it)")
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            names = [flag] + (["--patch-group"] if f.name == "rollout_patch_group" else [])
            kw = {"help": f.metadata["help"], "default": argparse.SUPPRESS, "dest": f.name}
            for k in ("choices", "nargs", "action"):
                if k in f.metadata:
                    kw[k] = f.metadata[k]
            if f.type in ("bool", bool):
                kw["action"] = argparse.BooleanOptionalAction
            elif "action" not in kw:
                kw["type"] = _scalar_type(f)
            p.add_argument(*names, **kw)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TrainConfig":
        values = {}
        if getattr(args, "config", None):
            data = yaml.safe_load(Path(args.config).read_text()) or {}
            data = {k.replace("-", "_"): v for k, v in data.items()}
            unknown = sorted(set(data) - {f.name for f in fields(cls)})
            if unknown:
                raise ValueError(f"{args.config}: unknown setting(s) {', '.join(unknown)}")
            values.update(data)
        values.update({f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})
        return cls(**values)

    def __post_init__(self) -> None:
        self.disable_patch = list(self.disable_patch or [])
        self.lora_target_modules = list(self.lora_target_modules)
        if self.sde_window is not None:
            self.sde_window = tuple(self.sde_window)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    # -- checks ---------------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Invalid combinations raise; parity-breaking ones warn (ParityConditionWarning)."""
        errors = []
        if self.n_samples_per_prompt % self.rollout_microgroup_size:
            errors.append(f"--n-samples-per-prompt {self.n_samples_per_prompt} must be a multiple of "
                          f"--rollout-microgroup-size {self.rollout_microgroup_size}")
        if not 1 <= self.num_sde_steps <= self.steps:
            errors.append(f"--num-sde-steps must be in 1..--steps ({self.steps})")
        if self.n_samples_per_prompt < 2:
            errors.append("--n-samples-per-prompt must be >= 2: GRPO normalises rewards within a group")
        if not self.use_lora:
            errors.append("--no-use-lora: full fine-tuning is not implemented; train a LoRA")
        if self.kl_beta and not self.use_lora:
            errors.append("--kl-beta needs a LoRA: the reference policy is the LoRA-disabled base")
        if self.reward_placement == "engine" and not self.engine_process:
            errors.append("--reward-placement engine needs --engine-process (without it the engine runs in the "
                          "trainer's process, which is --reward-placement trainer)")
        if self.resolution % 16:
            errors.append(f"--resolution {self.resolution} must be a multiple of 16")
        if self.micro_batch_size_sample < 1 or self.micro_batch_size_tstep < 1:
            errors.append("micro-batch sizes must be >= 1")
        if self.num_steps_per_rollout < 1 or self.num_rollouts < 1:
            errors.append("--num-rollouts and --num-steps-per-rollout must be >= 1")
        if errors:
            raise ValueError("invalid settings:\n  " + "\n  ".join(errors))
        for message in self.parity_warnings():
            warnings.warn(message, ParityConditionWarning, stacklevel=2)

    def parity_warnings(self) -> list[str]:
        """One message per broken condition of DESIGN 3 (the recipe recipes/bitwise-aligned.yaml breaks none)."""
        out = []
        if self.rollout_patch_group == "none":
            out.append("--patch-group none: the engine runs its fast numerics, so train/rollout parity is not "
                       "bitwise (use --patch-group qwen_image)")
        if self.disable_patch:
            out.append(f"--disable-patch {', '.join(self.disable_patch)}: parity is not bitwise without it")
        if self.num_steps_per_rollout > 1:
            out.append(f"condition 1: --num-steps-per-rollout {self.num_steps_per_rollout}: only the first "
                       "optimizer step of a rollout is on-policy; later ones train on updated weights")
        if self.pad_text_to is not None:
            out.append(f"condition 3: --pad-text-to {self.pad_text_to} pads the train batch to a whole window, "
                       "not to the rollout request's width")
        if self.micro_batch_size_sample != self.rollout_microgroup_size or self.micro_batch_size_tstep != 1:
            out.append(f"condition 4: a train micro-batch ({self.micro_batch_size_sample} samples x "
                       f"{self.micro_batch_size_tstep} steps) is not a rollout microgroup "
                       f"({self.rollout_microgroup_size} samples x 1 step): batch shapes differ")
        if self.train_dp_split_mode != "contiguous":
            out.append("condition 4: --train-dp-split-mode stride mixes prompts (and text lengths) in one "
                       "micro-batch; use contiguous")
        if self.fsdp_attention_backend != PARITY_BACKEND:
            out.append(f"condition 5: --fsdp-attention-backend {self.fsdp_attention_backend}: the train side "
                       f"runs another attention kernel than the engine's flash kernel (use {PARITY_BACKEND})")
        if self.lora_merge_mode == "merged":
            out.append("--lora-merge-mode merged: W + scale·B·A in bf16 rounds differently from PEFT's "
                       "unmerged forward")
        return out


_SCALAR_TYPES = {"int": int, "float": float, "tuple[int, int]": int}  # annotation (before "| None") -> flag type


def _scalar_type(f: dataclasses.Field):
    return _SCALAR_TYPES.get(str(f.type).split(" |")[0], str)
