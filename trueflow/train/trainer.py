"""The GRPO loop: rollout -> rewards -> advantages -> train pairs -> micro-batches -> PPO-clip (or DiffusionNFT's
loss) -> optimizer step -> LoRA sync -> next rollout.

Two kinds of metrics per optimizer step. The train/rollout mismatch (`model_output_*`, `log_prob_max_abs_diff`,
`ratio_mean`, `ratio_max_abs_dev_from_1`) compares the train forward at the weights the engine rolled out with to
the engine's records: on a rollout's first step those are the current weights; on its later steps the policy has
moved, so the mismatch is null there unless `parity_on_every_step` measures it against a kept copy of the
rolled-out LoRA. The policy's own change since the rollout (`policy_*`) is the current policy against the engine's
log-probs, at every step."""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from ..engine.guidance import true_cfg
from ..engine.samplers import cps_log_prob, sde_log_prob
from ..rewards.base import RewardError, score
from ..rl.advantages import group_advantages
from ..rl.grpo_guard import normalized_ratio, step_weight
from ..rl.loss import clipped_surrogate, kl_penalty
from ..rl.nft import nft_loss, optimality
from ..sync.checksum import tensors_checksum
from ..sync.engine_process import to_cpu
from . import checkpoint as ckpt
from .batch import TrainBatch, assemble
from .config import TrainConfig
from .dist import DistContext, all_reduce, broadcast_object
from .metrics import MetricsWriter, WandbSettings
from .model import LoraSpec, train_forward
from .pairs import micro_batches, rank_samples
from .policy import build_policy, lora_full_state, lora_parameters, set_lora_state
from .prompts import load_prompts
from .report import write_sample_grid, write_summary
from .schedule import LoraEMA, lr_scheduler

MISMATCH_KEYS = ("model_output_max_abs_diff", "model_output_mean_abs_diff", "log_prob_max_abs_diff", "ratio_mean",
                 "ratio_max_abs_dev_from_1")


@dataclass
class StepState:
    step: int = 0  # optimizer steps done
    rollout: int = 0  # rollouts done


class Trainer:
    def __init__(self, cfg: TrainConfig, ctx: DistContext, engine, reward, resumed: tuple | None = None):
        """`engine`: an in-process `Engine` or an `EngineClient` (rank 0 only; None elsewhere); `reward`: a reward
        callable (rank 0 only); `resumed`: with `cfg.resume`, what `checkpoint.load_latest` read (None: start
        over)."""
        self.cfg, self.ctx, self.engine, self.reward = cfg, ctx, engine, reward
        self.out = Path(cfg.output_dir)
        self.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[cfg.dtype]
        self.prompts = load_prompts(cfg.prompts)
        self.family = cfg.fill_family_defaults()
        self.lora_spec = LoraSpec(rank=cfg.lora_rank, alpha=cfg.lora_alpha, target_modules=tuple(cfg.lora_target_modules))
        self.model = build_policy(self.family, cfg.checkpoint, self.lora_spec, self.dtype, ctx.device, cfg.seed,
                                  cfg.gradient_checkpointing)
        self.named_params = lora_parameters(self.model)
        self.params = list(self.named_params.values())
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scheduler = lr_scheduler(self.optimizer, cfg.num_rollouts * cfg.num_steps_per_rollout,
                                      cfg.lr_warmup_steps, cfg.lr_schedule)
        self.ema = LoraEMA(self.named_params, cfg.ema_decay) if cfg.ema_decay else None
        self.state = StepState()
        self.saved_step: int | None = None
        keep = None
        if cfg.resume:
            keep = self._resume(resumed)
        wandb = WandbSettings(cfg.wandb_project, cfg.wandb_name, self.out, cfg.to_dict()) if cfg.wandb else None
        self.metrics = MetricsWriter(self.out / "metrics.jsonl",
                                     self.out / "tensorboard" if cfg.tensorboard else None,
                                     keep_lines=keep, wandb=wandb) if ctx.is_main else None
        self._sync()  # the engine starts from the trainer's weights (after a resume: the checkpoint's)

    # -- weight sync ---------------------------------------------------------------------------------------------
    def _sync(self) -> dict:
        """Send the LoRA compute copies to the engine; return both sides' checksums and the time taken."""
        t0 = time.perf_counter()
        state = lora_full_state(self.model, self.dtype)  # a collective: every rank takes part
        if not self.ctx.is_main:
            return {}
        self.engine.update_lora(state, self.lora_spec.scale, self.cfg.lora_merge_mode)
        engine_sum = self.engine.lora_checksum()
        return {"trainer_checksum": tensors_checksum(state), "engine_checksum": engine_sum,
                "time_sync": time.perf_counter() - t0}

    # -- one rollout and its optimizer steps ---------------------------------------------------------------------
    def _rollout(self, index: int):
        cfg = self.cfg
        prompts = [self.prompts[(index * cfg.rollout_batch_size + i) % len(self.prompts)]
                   for i in range(cfg.rollout_batch_size)]
        payload = None
        if self.ctx.is_main:
            try:
                payload = self._rollout_on_main(index, prompts)
            except RewardError as e:  # every rank stops, not only rank 0
                payload = ("reward failed", e.reward, e.prompts, e.reason)
        # Over the wire on the CPU: unpickled on another rank, a CUDA tensor would land on rank 0's GPU.
        payload = broadcast_object(to_cpu(payload)) if self.ctx.world > 1 else payload
        if isinstance(payload[0], str):
            raise RewardError(*payload[1:])
        return payload

    def _rollout_on_main(self, index: int, prompts: list[str]):
        cfg = self.cfg
        t0 = time.perf_counter()
        sample_prompts = [p for p in prompts for _ in range(cfg.n_samples_per_prompt)]
        args = (prompts, cfg.n_samples_per_prompt, self.sampling_params(), cfg.seed * 1_000_003 + index)
        if self.reward is None:  # placed in the engine process: one round trip, times not split
            rollout, rewards, dropped = self.engine.rollout_scored(*args, cfg.debug, sample_prompts,
                                                                   cfg.reward_on_error)
            t1 = time.perf_counter()
        else:
            rollout = self.engine.rollout(*args, record_snapshot=cfg.debug)
            t1 = time.perf_counter()
            rewards, dropped = score(self.reward, rollout.images, sample_prompts, on_error=cfg.reward_on_error)
        t2 = time.perf_counter()
        if cfg.debug:
            from ..engine.snapshot import save_snapshot

            save_snapshot(rollout, self.out / "snapshots" / f"rollout-{index:05d}.safetensors")
        return rollout, rewards, dropped, {"time_rollout": t1 - t0, "time_reward": t2 - t1}

    def sampling_params(self):
        from ..engine.engine import SamplingParams

        c = self.cfg
        return SamplingParams(steps=c.steps, sampler=c.sampler, noise_level=c.noise_level, cfg_scale=c.cfg_scale,
                              negative_prompt=c.negative_prompt, num_sde_steps=c.num_sde_steps,
                              sde_window=c.sde_window, height=c.resolution, width=c.resolution,
                              rollout_microgroup_size=c.rollout_microgroup_size)

    def _log_prob(self, b: TrainBatch, guided: torch.Tensor):
        c = self.cfg
        if c.sampler == "sde":
            return sde_log_prob(b.next_latents, b.latents, guided, b.sigma, b.sigma_next, b.sigma_1, c.noise_level)
        return cps_log_prob(b.next_latents, b.latents, guided, b.sigma, b.sigma_next, c.noise_level)

    def _guided(self, b: TrainBatch) -> torch.Tensor:
        """Both CFG branches as two separate forwards on the recorded inputs, combined as the engine does."""
        def branch(embeds, mask):
            return train_forward(self.family, self.model, b.latents, embeds, b.timestep, b.img_shape, mask,
                                 backend=self.cfg.fsdp_attention_backend)

        pos = branch(b.prompt_embeds, b.prompt_mask)
        if b.negative_prompt_embeds is None:
            return pos
        return true_cfg(pos, branch(b.negative_prompt_embeds, b.negative_prompt_mask), self.cfg.cfg_scale)

    def _policy_loss(self, b: TrainBatch, guided: torch.Tensor, log_prob: torch.Tensor, mean: torch.Tensor,
                     std: torch.Tensor) -> tuple[torch.Tensor, float | None]:
        """(loss of the micro-batch, its PPO clip fraction; None for nft, which clips nothing)."""
        cfg = self.cfg
        if cfg.algorithm == "nft":
            # The noise that puts the forward process x_t = (1 − σ)·x0 + σ·ε at the recorded latent: the model
            # input is the engine's, so the old policy's velocity is the engine's recorded output (CFG off).
            sigma = b.sigma.float().reshape(-1, *([1] * (b.latents.ndim - 1)))
            x0 = b.final_latents.float()
            noise = (b.latents.float() - (1 - sigma) * x0) / sigma
            r = optimality(b.advantages, cfg.adv_clip_max)
            return nft_loss(guided, b.engine_guided, x0, noise, b.sigma, r, cfg.nft_beta,
                            cfg.nft_adaptive_weight).mean(), None
        if cfg.ratio_norm == "grpo_guard":  # the rollout policy's mean, from its recorded guided output
            with torch.no_grad():
                _, old_mean, _ = self._log_prob(b, b.engine_guided)
            ratio = normalized_ratio(log_prob, b.old_log_prob, mean, old_mean, std)
            loss, stats = clipped_surrogate(ratio, b.advantages, cfg.clip_range, step_weight(b.sigma_next - b.sigma))
        else:
            loss, stats = clipped_surrogate(torch.exp(log_prob - b.old_log_prob), b.advantages, cfg.clip_range)
        return loss, stats.clip_frac

    def _train_step(self, rollout, advantages: torch.Tensor, step_in_rollout: int,
                    kept: dict[str, torch.Tensor] | None) -> dict:
        """One optimizer step on the rollout. `kept`: the LoRA masters the engine rolled out with, to measure the
        mismatch on a later step (`parity_on_every_step`)."""
        cfg, ctx = self.cfg, self.ctx
        sizes = [len(mg.sample_indices) for mg in rollout.microgroups]
        samples = rank_samples(sizes, ctx.world, ctx.rank, cfg.train_dp_split_mode)
        batches = micro_batches(samples, cfg.num_sde_steps, cfg.micro_batch_size_sample, cfg.micro_batch_size_tstep)

        def batch(rows) -> TrainBatch:
            return assemble(rollout, rows, advantages, ctx.device, cfg.pad_text_to, cfg.rollout_patch_group != "none",
                            self.family.train.timestep)

        mismatch = _Mismatch() if step_in_rollout == 0 or kept is not None else None
        if step_in_rollout and kept is not None:  # the rolled-out weights swapped in, the guided forward, back
            with torch.no_grad(), _swapped(self.named_params, kept):
                for rows in batches:
                    b = batch(rows)
                    guided = self._guided(b)
                    mismatch.add(b, guided, self._log_prob(b, guided)[0])
        policy = _Mismatch()
        sums = {"clipped": 0.0, "loss_sum": 0.0, "kl_sum": 0.0}
        for rows in batches:
            b = batch(rows)
            guided = self._guided(b)
            log_prob, mean, std = self._log_prob(b, guided)
            loss, clip_frac = self._policy_loss(b, guided, log_prob, mean, std)
            kl = torch.zeros(())
            if cfg.kl_beta:
                with torch.no_grad(), _adapters_disabled(self.model):
                    _, ref_mean, _ = self._log_prob(b, self._guided(b))
                kl = kl_penalty(mean, ref_mean, std, b.sigma_next - b.sigma, cfg.sampler).mean()
                loss = loss + cfg.kl_beta * kl
            (loss / len(batches)).backward()
            with torch.no_grad():
                policy.add(b, guided, log_prob)
                if step_in_rollout == 0:  # the current weights are the rolled-out ones
                    mismatch.add(b, guided, log_prob)
                sums["clipped"] += (clip_frac or 0.0) * len(rows)
                sums["loss_sum"] += loss.item()
                sums["kl_sum"] += kl.item()
        policy_stats = policy.reduce()
        measured = mismatch.reduce() if mismatch is not None else dict.fromkeys(MISMATCH_KEYS)
        sums = all_reduce(sums, dist.ReduceOp.SUM)
        lr = self.optimizer.param_groups[0]["lr"]
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm)
        before = lora_full_state(self.model)
        if not cfg.debug_skip_optimizer_step:
            self.optimizer.step()
            self.scheduler.step()
            if self.ema is not None:
                self.ema.update(self.named_params)
        self.optimizer.zero_grad(set_to_none=True)
        after = lora_full_state(self.model)
        update = math.sqrt(sum(((after[k] - before[k]).double() ** 2).sum().item() for k in after))
        n_batches = len(batches) * ctx.world
        return {
            **{k: measured[k] for k in MISMATCH_KEYS},
            "parity_measured": mismatch is not None,
            "policy_ratio_mean": policy_stats["ratio_mean"],
            "policy_ratio_max_abs_dev_from_1": policy_stats["ratio_max_abs_dev_from_1"],
            "policy_log_prob_max_abs_diff": policy_stats["log_prob_max_abs_diff"],
            "clip_frac": None if cfg.algorithm == "nft" else sums["clipped"] / max(policy_stats["rows"], 1),
            "loss": sums["loss_sum"] / n_batches,
            "kl": sums["kl_sum"] / n_batches,
            "lr": lr,
            "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm),
            "lora_update_norm": update,
        }

    # -- the run -------------------------------------------------------------------------------------------------
    def run(self) -> None:
        cfg = self.cfg
        bar = tqdm(total=cfg.num_rollouts, initial=self.state.rollout, unit="rollout", disable=not self.ctx.is_main,
                   desc="train")
        while self.state.rollout < cfg.num_rollouts:
            index = self.state.rollout
            rollout, rewards, dropped, times = self._rollout(index)
            # Samples of a group the reward skipped are NaN: advantage 0 (no gradient), out of the statistics.
            scored = rewards[~torch.isnan(rewards)]
            advantages = group_advantages(rewards, cfg.n_samples_per_prompt, cfg.adv_clip_max, cfg.global_std)
            # The masters the engine rolled out with (it holds their compute copies), for later steps' mismatch.
            kept = ({n: p.detach().clone() for n, p in self.named_params.items()}
                    if cfg.parity_on_every_step and cfg.num_steps_per_rollout > 1 else None)
            for k in range(cfg.num_steps_per_rollout):
                t0 = time.perf_counter()
                m = self._train_step(rollout, advantages, k, kept)
                t1 = time.perf_counter()
                sync = self._sync()
                self.state.step += 1
                if self.ctx.is_main:
                    record = {"step": self.state.step, "rollout": index, "step_in_rollout": k,
                              "reward_mean": _mean(scored), "reward_std": _std(scored),
                              "dropped_samples": len(dropped), **m,
                              "checksums_equal": sync["trainer_checksum"] == sync["engine_checksum"],
                              "trainer_checksum": sync["trainer_checksum"], "engine_checksum": sync["engine_checksum"],
                              **times, "time_train": t1 - t0, "time_sync": sync["time_sync"]}
                    self.metrics.write(record)
                    bar.set_postfix(reward=_show(record["reward_mean"], ".3f"),
                                    diff=_show(record["model_output_max_abs_diff"], ".1e"),
                                    ratio=_show(record["policy_ratio_mean"], ".6f"))
            self.state.rollout += 1
            if cfg.sample_every and index % cfg.sample_every == 0:
                self._write_samples(rollout, index)
            # Checkpoints fall on rollout boundaries (a resumed run never needs a rollout it did not save), the
            # first boundary at or after every `save_every` optimizer steps.
            steps_before = self.state.step - cfg.num_steps_per_rollout
            if cfg.save_every and self.state.step // cfg.save_every > steps_before // cfg.save_every:
                self.save()
            bar.update()
        bar.close()
        if self.saved_step != self.state.step:
            self.save()
        if self.ctx.is_main:
            write_summary(self.out, cfg)
            self.metrics.close()  # finishes W&B and TensorBoard now, not in an exit handler

    def _write_samples(self, rollout, index: int) -> None:
        """The rollout's grid; with an EMA also the EMA weights' grid (same prompts, seed and sampling), which the
        engine draws with the EMA swapped in, then the live weights back (the next rollout and parity need them)."""
        if self.ctx.is_main:
            write_sample_grid(rollout, self.out / "samples" / f"rollout-{index:05d}.png")
        if self.ema is None:
            return
        state = self.ema.full_state(self.dtype)  # a collective: every rank takes part
        if self.ctx.is_main:
            self.engine.update_lora(state, self.lora_spec.scale, self.cfg.lora_merge_mode)
            ema_rollout = self.engine.rollout(rollout.prompts, rollout.n_per_prompt, rollout.params, rollout.seed)
            write_sample_grid(ema_rollout, self.out / "samples" / f"rollout-{index:05d}-ema.png")
        self._sync()

    # -- checkpoints -----------------------------------------------------------------------------------------------
    def save(self) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        lora = lora_full_state(self.model)
        ema = self.ema.full_state() if self.ema is not None else None
        optim = get_optimizer_state_dict(self.model, self.optimizer,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        self.saved_step = self.state.step
        if self.ctx.is_main:
            ckpt.save_checkpoint(self.family, self.out, self.state.step, lora, self.lora_spec.peft_config().to_dict(), optim,
                                 {"step": self.state.step, "rollout": self.state.rollout,
                                  "metrics_lines": self.metrics.lines, "config": self.cfg.to_dict()},
                                 scheduler=self.scheduler.state_dict(), ema=ema)
        if self.ctx.world > 1:
            dist.barrier()

    def _resume(self, resumed: tuple | None) -> int | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        if resumed is None:
            return 0  # nothing saved yet: start over, dropping any metrics of the killed run
        path, lora, extra, state = resumed
        set_lora_state(self.named_params, lora)
        # strict=False: a LoRA parameter that never got a gradient (the last block's text-stream outputs feed
        # nothing) has no AdamW state to save, exactly as in the run that saved it.
        set_optimizer_state_dict(self.model, self.optimizer, extra["optimizer"],
                                 options=StateDictOptions(full_state_dict=True, strict=False))
        if "scheduler" in extra:  # a checkpoint from before schedules ran the constant lr
            self.scheduler.load_state_dict(extra["scheduler"])
        if self.ema is not None:
            if "ema" not in extra:
                raise ValueError(f"--resume: {path} holds no EMA of the LoRA; resume with the run's --ema-decay "
                                 "(0), or start a new --output-dir")
            set_lora_state(self.ema.shadow, extra["ema"])
        ckpt.set_rng_state(extra["rng"])
        self.state = StepState(step=state["step"], rollout=state["rollout"])
        self.saved_step = state["step"]
        return state["metrics_lines"]


@contextmanager
def _adapters_disabled(model):
    """The LoRA-disabled base (the KL reference), through diffusers' PEFT integration."""
    model.disable_adapters()
    try:
        yield
    finally:
        model.enable_adapters()


@contextmanager
def _swapped(params: dict[str, torch.nn.Parameter], values: dict[str, torch.Tensor]):
    """`values` in place of the parameters' (same sharding), the current ones put back after; under no_grad."""
    current = {name: p.detach().clone() for name, p in params.items()}
    for name, p in params.items():
        p.detach().copy_(values[name])
    try:
        yield
    finally:
        for name, p in params.items():
            p.detach().copy_(current[name])


class _Mismatch:
    """A train forward against the engine's records, over a step's micro-batches (and ranks): model output and
    log-prob differences, the likelihood ratio."""

    def __init__(self):
        self.maxes = {"model_output_max_abs_diff": 0.0, "log_prob_max_abs_diff": 0.0, "ratio_max_abs_dev_from_1": 0.0}
        self.sums = {"abs_diff_sum": 0.0, "numel": 0.0, "ratio_sum": 0.0, "rows": 0.0}

    def add(self, b: TrainBatch, guided: torch.Tensor, log_prob: torch.Tensor) -> None:
        d = (guided.detach().float() - b.engine_guided.float()).abs()
        lp = (log_prob.detach() - b.old_log_prob).abs()
        ratio = torch.exp(log_prob.detach() - b.old_log_prob)
        for key, value in (("model_output_max_abs_diff", d.max()), ("log_prob_max_abs_diff", lp.max()),
                           ("ratio_max_abs_dev_from_1", (ratio - 1).abs().max())):
            self.maxes[key] = max(self.maxes[key], value.item())
        self.sums["abs_diff_sum"] += d.sum().item()
        self.sums["numel"] += d.numel()
        self.sums["ratio_sum"] += ratio.sum().item()
        self.sums["rows"] += ratio.numel()

    def reduce(self) -> dict:
        """Over every rank (a collective)."""
        maxes = all_reduce(self.maxes, dist.ReduceOp.MAX)
        sums = all_reduce(self.sums, dist.ReduceOp.SUM)
        return {**maxes, "model_output_mean_abs_diff": sums["abs_diff_sum"] / max(sums["numel"], 1),
                "ratio_mean": sums["ratio_sum"] / max(sums["rows"], 1), "rows": sums["rows"]}


def _mean(x: torch.Tensor) -> float | None:
    return x.mean().item() if x.numel() else None


def _std(x: torch.Tensor) -> float | None:
    """The population std of the scored rewards; None when the reward skipped every sample (no warning)."""
    return x.std(unbiased=False).item() if x.numel() else None


def _show(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)
