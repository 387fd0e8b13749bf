"""The GRPO loop: rollout -> rewards -> advantages -> train pairs -> micro-batches -> PPO-clip (or DiffusionNFT's
loss) -> optimizer step -> LoRA sync -> next rollout.

Every data-parallel rank has its own engine (any `engine.interface.RolloutEngine`, scored: its rollouts arrive
with rewards), rolls out its contiguous share of the rollout's prompts, and trains on that rollout alone; only the
rewards cross ranks (all-gathered before the group advantages), so no rollout is sent anywhere.

Beside it: the train/rollout parity and the policy's change (`parity_monitor`), checkpoints (`checkpoint`), the
metrics line of each optimizer step (`metrics`), and with `--async-rollouts` the rollouts made ahead of training
(`async_rollouts`)."""

from __future__ import annotations

import math
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from tqdm import tqdm

from ..dtypes import torch_dtype
from ..engine.guidance import check_guidance, expert_scale, guide
from ..engine.samplers import cps_log_prob, sde_log_prob
from ..engine.interface import RolloutRequest
from ..models import checkpoint_experts
from ..rewards.base import RewardError
from ..rl.advantages import group_advantages
from ..rl.decoupled import decoupled_surrogate, proximal_ratio, truncated_is_weight
from ..rl.grpo_guard import normalized_ratio, step_weight
from ..rl.loss import clipped_surrogate, kl_penalty
from ..rl.nft import nft_loss, optimality
from ..sync.checksum import tensors_checksum
from . import checkpoint as ckpt
from . import full, full_checkpoint, memory
from .async_rollouts import CHECKPOINT_KEY, AsyncRollouts, Behaviour, ImportanceWeights
from .batch import TrainBatch, assemble, split_by_expert
from .config import TrainConfig
from .dist import DistContext, all_gather_object, all_reduce
from .metrics import MetricsWriter, WandbSettings, step_record
from .model import LoraSpec, train_forward
from .optim import make_optimizer
from .pairs import micro_batches, train_order
from .parity_monitor import ParityMonitor, keep_rolled_out
from .policy import build_policy, lora_full_state, lora_parameters
from .prompts import load_prompts
from .shared_base import EngineOnBase

if TYPE_CHECKING:
    from ..engine.interface import RolloutEngine
from .report import write_sample_grid, write_summary
from .schedule import WeightsEMA, lr_scheduler


@dataclass
class StepState:
    step: int = 0  # optimizer steps done
    rollout: int = 0  # rollouts done


class Trainer:
    def __init__(self, cfg: TrainConfig, ctx: DistContext, engine: RolloutEngine | EngineOnBase,
                 resumed: tuple | None = None):
        """`engine`: this rank's engine, whose rollouts come back scored (`placement.scored.ScoredEngine`, or an
        engine process that scores), or an in-process one to build on the policy's frozen base once it is loaded
        (`shared_base`); `resumed`: with `cfg.resume`, what `checkpoint.load_latest` read (None: start over)."""
        if cfg.rollout_batch_size % ctx.world:
            raise ValueError(f"--rollout-batch-size {cfg.rollout_batch_size} must be a multiple of the {ctx.world} "
                             f"ranks: each rank rolls out an equal share of whole prompts")
        self.cfg, self.ctx = cfg, ctx
        self.out = Path(cfg.output_dir)
        self.dtype = torch_dtype(cfg.dtype)
        self.prompts = load_prompts(cfg.prompts)
        self.family = cfg.fill_family_defaults()
        # set by `run._check_before_loading` (the default checkpoint) and `fill_family_defaults` (the LoRA targets)
        assert cfg.checkpoint is not None and cfg.lora_target_modules is not None
        # One policy per expert of the checkpoint (in the pipeline's order); those the settings name get a LoRA.
        self.experts = [e.name for e in checkpoint_experts(cfg.checkpoint, self.family)]
        check_guidance(self.family.name, self.family.guidance, cfg.cfg_scale, cfg.cfg_scale_2,
                       cfg.distilled_guidance_scale, len(self.experts))
        unknown = sorted(set(cfg.lora_experts or ()) - set(self.experts))
        if unknown:
            raise ValueError(f"--lora-experts {', '.join(unknown)}: not an expert of {cfg.checkpoint} (its experts: "
                             f"{', '.join(self.experts)})")
        self.trained = set(cfg.lora_experts or self.experts)
        self.lora_spec = LoraSpec(rank=cfg.lora_rank, alpha=cfg.lora_alpha,
                                  target_modules=tuple(cfg.lora_target_modules))
        every = cfg.gradient_checkpointing is True
        chosen = 0
        if cfg.gradient_checkpointing == "auto":  # the fewest first blocks the memory plan needs recomputed
            chosen, line = memory.auto_checkpointing(cfg, ctx.world)
            if ctx.is_main:
                print(line, flush=True)
        if cfg.use_lora:
            self.models = {e: build_policy(self.family, cfg.checkpoint, self.lora_spec if e in self.trained else None,
                                           self.dtype, ctx.device, cfg.seed + k, every, subfolder=e,
                                           checkpointed_blocks=chosen) for k, e in enumerate(self.experts)}
        else:  # every weight of the trained experts (`full`)
            self.models = {e: full.build_full_policy(self.family, cfg.checkpoint, e in self.trained, self.dtype,
                                                     ctx.device, every, subfolder=e, checkpointed_blocks=chosen)
                           for e in self.experts}
        if cfg.train_kernels == "fused":  # before TP matching, which wraps the fused attention processors
            from .fused import use_fused_kernels

            use_fused_kernels(self.family, self.models.values(), ctx.device)
        if cfg.train_tp_match:  # each sharded layer as the engine's tensor-parallel ranks compute it
            from ..parallel.engine import tp_plan
            from ..parallel.train_match import match_tp

            for model in self.models.values():
                match_tp(model, tp_plan(self.family, cfg.train_tp_match), cfg.train_tp_match)
        self.engine = engine.build(self.models, self.family) if isinstance(engine, EngineOnBase) else engine
        self.named_params = lora_parameters(self.models) if cfg.use_lora else full.full_parameters(self.models)
        self.params = list(self.named_params.values())
        self.optimizer = make_optimizer(self.params, cfg.optimizer, cfg.lr, cfg.weight_decay)
        self.scheduler = lr_scheduler(self.optimizer, cfg.num_rollouts * cfg.num_steps_per_rollout,
                                      cfg.lr_warmup_steps, cfg.lr_schedule)
        self.ema = WeightsEMA(self.named_params, cfg.ema_decay, cfg.ema_offload) if cfg.ema_decay else None
        self.state = StepState()
        self.saved_step: int | None = None
        keep = None
        if cfg.resume:  # nothing saved yet: start over, dropping any metrics of the killed run
            keep = 0
            if resumed is not None:
                restore = ckpt.restore_training if cfg.use_lora else full_checkpoint.restore
                saved = restore(resumed, self.models, self.named_params, self.optimizer, self.scheduler, self.ema)
                self.state = StepState(step=saved["step"], rollout=saved["rollout"])
                self.saved_step = saved["step"]
                keep = saved["metrics_lines"]
        # With --async-rollouts, the rollouts in flight and the weight versions that make them (a resumed run's from
        # its checkpoint); the first rollouts start with `run`.
        self.ahead = AsyncRollouts(self, resumed[2].get(CHECKPOINT_KEY) if resumed else None) \
            if cfg.async_rollouts else None
        wandb = WandbSettings(cfg.wandb_project, cfg.wandb_name, self.out, cfg.to_dict()) if cfg.wandb else None
        self.metrics = MetricsWriter(self.out / "metrics.jsonl",
                                     self.out / "tensorboard" if cfg.tensorboard else None,
                                     keep_lines=keep, wandb=wandb) if ctx.is_main else None
        self._sync()  # the engine starts from the trainer's weights (after a resume: the checkpoint's)

    # -- weight sync ---------------------------------------------------------------------------------------------
    def _sync(self) -> dict:
        """Send the LoRA compute copies to every rank's engine (one checksum each, its answer to the update); return
        the trainer's checksum, rank 0's engine's, whether every engine holds the trainer's LoRA, and the time
        taken (the slowest rank's)."""
        t0 = time.perf_counter()
        state = self._engine_state()  # a collective: every rank takes part
        engine_sum = self.engine.update_weights(state, *self._update_args())
        trainer_sum = tensors_checksum(state) if self.cfg.use_lora else full.state_checksum(state)
        sums = all_gather_object(engine_sum)
        took = all_reduce({"time_sync": time.perf_counter() - t0}, dist.ReduceOp.MAX)
        return {"trainer_checksum": trainer_sum, "engine_checksum": sums[0],
                "checksums_equal": all(s == trainer_sum for s in sums), **took}

    def _engine_state(self, ema: WeightsEMA | None = None) -> dict[str, torch.Tensor]:
        """What the engine runs: the LoRA's compute copies, or every weight's (`full.compute_state`); `ema`: its
        averages in place of the trained masters."""
        if self.cfg.use_lora:
            return lora_full_state(self.models, self.dtype) if ema is None else ema.full_state(self.dtype)
        return full.compute_state(self.models, self.family, self.dtype, ema)

    def _update_args(self) -> tuple:
        """(lora_scale, merge_mode) of an update: a full-weight update has no scale."""
        return (self.lora_spec.scale, self.cfg.lora_merge_mode) if self.cfg.use_lora else (None, None)

    # -- one rollout and its optimizer steps ---------------------------------------------------------------------
    def _share(self) -> tuple[int, int]:
        """This rank's prompts of a rollout: (first, count), a contiguous block of whole prompt groups."""
        count = self.cfg.rollout_batch_size // self.ctx.world
        return self.ctx.rank * count, count

    def _request(self, index: int) -> RolloutRequest:
        """This rank's share of rollout `index`."""
        cfg = self.cfg
        prompts = [self.prompts[(index * cfg.rollout_batch_size + i) % len(self.prompts)]
                   for i in range(cfg.rollout_batch_size)]
        first, count = self._share()
        return RolloutRequest(prompts[first:first + count], cfg.n_samples_per_prompt, self.sampling_params(),
                              cfg.seed * 1_000_003 + index, first, record_snapshot=cfg.debug)

    def _rollout(self, index: int):
        """This rank's share of rollout `index`, scored by its engine; the whole rollout's rewards (all ranks',
        prompt-major), its dropped samples (global indices) and its times (the slowest rank's)."""
        rollout = failure = None
        try:
            rollout = self.engine.rollout(self._request(index))
        except RewardError as e:  # every rank stops, not only the one whose reward failed
            failure = (e.reward, e.prompts, e.reason)
        return self._gathered(index, rollout, failure)

    def _gathered(self, index: int, rollout, failure: tuple | None):
        """`_rollout`'s answer from this rank's rollout (or its reward's failure): a collective, every rank in step."""
        cfg = self.cfg
        _, count = self._share()
        shares = all_gather_object(failure if failure else (rollout.rewards.cpu(), rollout.dropped))
        failed = next((s for s in shares if isinstance(s[0], str)), None)
        if failed:
            raise RewardError(*failed)
        n = cfg.n_samples_per_prompt
        rewards = torch.cat([r for r, _ in shares])
        dropped = [(rank * count) * n + i for rank, (_, ds) in enumerate(shares) for i in ds]
        times = all_reduce({"time_rollout": rollout.times["rollout"], "time_reward": rollout.times["reward"]},
                           dist.ReduceOp.MAX)
        if cfg.debug:
            from ..engine.snapshot import save_snapshot

            rank = f"-rank{self.ctx.rank}" if self.ctx.world > 1 else ""
            save_snapshot(rollout, self.out / "snapshots" / f"rollout-{index:05d}{rank}.safetensors")
        return rollout, rewards, dropped, times

    def sampling_params(self):
        from ..engine.engine import SamplingParams

        c = self.cfg
        height, width = c.frame_size()
        return SamplingParams(steps=c.steps, sampler=c.sampler, noise_level=c.noise_level, cfg_scale=c.cfg_scale,
                              cfg_scale_2=c.cfg_scale_2, distilled_guidance_scale=c.distilled_guidance_scale,
                              negative_prompt=c.negative_prompt, num_sde_steps=c.num_sde_steps,
                              sde_window=c.sde_window, height=height, width=width, num_frames=c.num_frames,
                              fps=c.fps, max_sequence_length=c.max_sequence_length,
                              rollout_microgroup_size=c.rollout_microgroup_size)

    def _log_prob(self, b: TrainBatch, guided: torch.Tensor):
        c = self.cfg
        if c.sampler == "sde":
            return sde_log_prob(b.next_latents, b.latents, guided, b.sigma, b.sigma_next, b.sigma_1, c.noise_level)
        return cps_log_prob(b.next_latents, b.latents, guided, b.sigma, b.sigma_next, c.noise_level)

    def _guided(self, b: TrainBatch) -> torch.Tensor:
        """The guided output on the recorded inputs, by the expert that ran the rows' step, guided as the engine
        guides (`engine.guidance.guide`: the family's branches and formula, the expert's scale), then
        post-processed as the engine does (the family's `model_output`)."""
        model, cfg = self.models[b.expert], self.cfg

        def branch(hidden_states: torch.Tensor, timestep: torch.Tensor, cond) -> torch.Tensor:
            return train_forward(self.family, model, hidden_states, timestep, b.grid, cond,
                                 backend=cfg.fsdp_attention_backend, **b.static)

        # The model reads the latents in the compute dtype, as the engine's runner casts them (a no-op where the
        # pipeline keeps its latents in that dtype; LTX-2.3 keeps them in fp32).
        scale = expert_scale(self.experts.index(b.expert), cfg.cfg_scale, cfg.cfg_scale_2)
        v = guide(self.family.guidance, branch, b.latents.to(self.dtype), b.timestep, b.cond, b.negative_cond, scale,
                  self.family.pipeline.text_streams).output
        post = self.family.pipeline.model_output
        return v if post is None else post(v, b.latents, b.sigma.reshape(-1, *([1] * (b.latents.ndim - 1))))

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
        if cfg.async_rollouts:  # the decoupled objective (`rl.decoupled`): the trust region around the policy
            # before the step (π_prox, the current forward held fixed), the engine's log-prob (μ) in the weight
            weight = step_weight(b.sigma_next - b.sigma) if cfg.ratio_norm == "grpo_guard" else None
            ratio = normalized_ratio(log_prob, log_prob.detach(), mean, mean.detach(), std) if weight is not None \
                else proximal_ratio(log_prob)
            loss, stats = decoupled_surrogate(ratio, b.advantages, cfg.clip_range,
                                              truncated_is_weight(log_prob, b.old_log_prob, cfg.async_is_cap), weight)
        elif cfg.ratio_norm == "grpo_guard":  # the rollout policy's mean, from its recorded guided output
            with torch.no_grad():
                _, old_mean, _ = self._log_prob(b, b.engine_guided)
            ratio = normalized_ratio(log_prob, b.old_log_prob, mean, old_mean, std)
            loss, stats = clipped_surrogate(ratio, b.advantages, cfg.clip_range, step_weight(b.sigma_next - b.sigma))
        else:
            loss, stats = clipped_surrogate(torch.exp(log_prob - b.old_log_prob), b.advantages, cfg.clip_range)
        return loss, stats.clip_frac

    def _train_step(self, rollout, advantages: torch.Tensor, step_in_rollout: int,
                    kept: dict[str, torch.Tensor] | None, behaviour: Behaviour | None = None) -> dict:
        """One optimizer step on the rollout. `kept`: the LoRA masters the engine rolled out with, to measure the
        mismatch on a later step (`parity_on_every_step`) or on a stale rollout; `behaviour`: what made an
        `--async-rollouts` rollout."""
        cfg, ctx = self.cfg, self.ctx
        sizes = [len(mg.sample_indices) for mg in rollout.microgroups]
        samples = train_order(sizes, cfg.train_dp_split_mode)
        assert cfg.num_sde_steps is not None  # a valid config has it (`TrainConfig._default_sde_steps`)
        batches = split_by_expert(rollout, micro_batches(samples, cfg.num_sde_steps, cfg.micro_batch_size_sample,
                                                         cfg.micro_batch_size_tstep), cfg.rollout_patch_group != "none")

        def batch(rows) -> TrainBatch:
            return assemble(rollout, rows, advantages, ctx.device, self.family, cfg.pad_text_to,
                            cfg.rollout_patch_group != "none" and not cfg.batch_invariant)  # the mode takes masks

        def rolled_out_forward(rows) -> tuple[TrainBatch, torch.Tensor, torch.Tensor]:
            b = batch(rows)
            guided = self._guided(b)
            return b, guided, self._log_prob(b, guided)[0]

        parity = ParityMonitor(step_in_rollout == 0 if behaviour is None else behaviour.kept is None, kept)
        parity.measure_rolled_out(self.named_params, batches, rolled_out_forward)
        weights = ImportanceWeights(cfg.async_is_cap, cfg.clip_range) \
            if behaviour is not None and cfg.algorithm == "grpo" else None
        sums = {"clipped": 0.0, "loss_sum": 0.0, "kl_sum": 0.0}
        for rows in batches:
            b = batch(rows)
            # Rows of an expert the settings do not train are scored (parity, the loss) but give no gradient.
            trains = b.expert in self.trained
            with nullcontext() if trains else torch.no_grad():
                guided = self._guided(b)
                log_prob, mean, std = self._log_prob(b, guided)
                loss, clip_frac = self._policy_loss(b, guided, log_prob, mean, std)
            kl = torch.zeros(())
            if cfg.kl_beta and trains:  # an untrained expert is its own LoRA-disabled base: KL 0
                with torch.no_grad(), _adapters_disabled(self.models[b.expert]):
                    _, ref_mean, _ = self._log_prob(b, self._guided(b))
                kl = kl_penalty(mean, ref_mean, std, b.sigma_next - b.sigma, cfg.sampler).mean()
                loss = loss + cfg.kl_beta * kl
            if trains:
                (loss / len(batches)).backward()
            with torch.no_grad():
                parity.add(b, guided, log_prob)
                if weights is not None:
                    weights.add(log_prob, b.old_log_prob)
                sums["clipped"] += (clip_frac or 0.0) * len(rows)
                sums["loss_sum"] += loss.item()
                sums["kl_sum"] += kl.item()
        parity_metrics, rows_measured = parity.reduce()
        sums = all_reduce(sums, dist.ReduceOp.SUM)
        lr = self.optimizer.param_groups[0]["lr"]
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm)
        before = lora_full_state(self.models) if cfg.use_lora else full.UpdateNorm(self.named_params)
        if not cfg.debug_skip_optimizer_step:
            self.optimizer.step()
            self.scheduler.step()
            if self.ema is not None:
                self.ema.update(self.named_params)
        self.optimizer.zero_grad(set_to_none=True)
        if isinstance(before, dict):  # cfg.use_lora
            after = lora_full_state(self.models)
            update = math.sqrt(sum(float(((after[k] - before[k]).double() ** 2).sum().item()) for k in after))
        else:
            update = before()
        n_batches = len(batches) * ctx.world
        return {
            **parity_metrics,
            "clip_frac": None if cfg.algorithm == "nft" else sums["clipped"] / max(rows_measured, 1),
            "loss": sums["loss_sum"] / n_batches,
            "kl": sums["kl_sum"] / n_batches,
            "lr": lr,
            "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm),
            "lora_update_norm": update,
            **(weights.reduce() if weights is not None else {}),
        }

    # -- the run -------------------------------------------------------------------------------------------------
    def run(self) -> None:
        if self.ahead is None:
            return self._loop()
        try:
            self.ahead.start()
            self._loop()
        finally:  # also when the run stops on an error: the rollout in flight stops, the thread ends
            self.ahead.close()

    def _loop(self) -> None:
        cfg = self.cfg
        # `with`: an error closes the bar first, so its one-line message is not drawn over by the bar
        with tqdm(total=cfg.num_rollouts, initial=self.state.rollout, unit="rollout", disable=not self.ctx.is_main,
                  desc="train") as bar:
            while self.state.rollout < cfg.num_rollouts:
                index = self.state.rollout
                if self.ahead is None:
                    (rollout, rewards, dropped, times), behaviour = self._rollout(index), None
                else:
                    rollout, rewards, dropped, times, behaviour = self.ahead.next(index)
                # Samples of a group the reward skipped are NaN: advantage 0 (no gradient), out of the statistics.
                scored = rewards[~torch.isnan(rewards)]
                first, count = self._share()
                n = cfg.n_samples_per_prompt
                advantages = group_advantages(rewards, n, cfg.adv_clip_max, cfg.global_std)
                advantages = advantages[first * n:(first + count) * n]  # this rank's share
                kept = keep_rolled_out(self.named_params, cfg.parity_on_every_step, cfg.num_steps_per_rollout) \
                    if behaviour is None else behaviour.kept
                for k in range(cfg.num_steps_per_rollout):
                    t0 = time.perf_counter()
                    m = self._train_step(rollout, advantages, k, kept, behaviour)
                    t1 = time.perf_counter()
                    # Async: the sync that matters is the one that installed the rollout's weights; the next ones go
                    # with the rollouts they make.
                    sync = self._sync() if behaviour is None else behaviour.sync
                    self.state.step += 1
                    if self.ctx.is_main:
                        assert self.metrics is not None  # rank 0's
                        record = step_record(self.state.step, index, k, scored, len(dropped), m, sync, times, t1 - t0)
                        if behaviour is not None:
                            record |= behaviour.record()
                        self.metrics.write(record)
                        bar.set_postfix(reward=_show(record["reward_mean"], ".3f"), loss=_show(record["loss"], ".3g"),
                                        kl=_show(record["kl"], ".2g"), lr=_show(record["lr"], ".2g"),
                                        diff=_show(record["model_output_max_abs_diff"], ".1e"),
                                        ratio=_show(record["policy_ratio_mean"], ".6f"))
                self.state.rollout += 1
                if self.ahead is not None:
                    self.ahead.done(index)
                if cfg.sample_every and index % cfg.sample_every == 0:
                    # The EMA's grid takes the engine: async, once the rollouts queued so far are made.
                    with self.ahead.idle() if self.ahead is not None and self.ema is not None else nullcontext():
                        self._write_samples(rollout, index)
                # Checkpoints fall on rollout boundaries (a resumed run never needs a rollout it did not save), the
                # first boundary at or after every `save_every` optimizer steps.
                steps_before = self.state.step - cfg.num_steps_per_rollout
                if cfg.save_every and self.state.step // cfg.save_every > steps_before // cfg.save_every:
                    self.save()
                bar.update()
        if self.saved_step != self.state.step:
            self.save()
        if self.ctx.is_main:
            write_summary(self.out, cfg)
            assert self.metrics is not None  # rank 0's
            self.metrics.close()  # finishes W&B and TensorBoard now, not in an exit handler

    def _write_samples(self, rollout, index: int) -> None:
        """The rollout's grid; with an EMA also the EMA weights' grid (same prompts, seed and sampling), which the
        engine draws with the EMA swapped in, then the live weights back (the next rollout and parity need them)."""
        if self.ctx.is_main:
            write_sample_grid(rollout, self.out / "samples" / f"rollout-{index:05d}.png", self.cfg.reward)
        if self.ema is None:
            return
        state = self._engine_state(self.ema)  # a collective: every rank takes part
        if self.ctx.is_main:
            self.engine.update_weights(state, *self._update_args())
            ema_rollout = self.engine.rollout(RolloutRequest(rollout.prompts, rollout.n_per_prompt, rollout.params,
                                                             rollout.seed, rollout.first_prompt))
            write_sample_grid(ema_rollout, self.out / "samples" / f"rollout-{index:05d}-ema.png", self.cfg.reward)
        self._sync()

    # -- checkpoints -----------------------------------------------------------------------------------------------
    def save(self) -> None:
        lines = self.metrics.lines if self.metrics is not None else None
        if self.cfg.use_lora:
            ckpt.save_training(self.family, self.out, self.ctx, self.models, self.optimizer, self.scheduler, self.ema,
                               self.lora_spec, self.state.step, self.state.rollout, lines, self.cfg.to_dict(),
                               self.ahead.checkpoint_state() if self.ahead is not None else None)
        else:  # async rollouts refuse full-parameter runs (config), so no in-flight versions to keep
            full_checkpoint.save(self.family, self.out, self.ctx, self.models, self.optimizer, self.scheduler,
                                 self.ema, self.dtype, self.state.step, self.state.rollout, lines, self.cfg.to_dict())
        self.saved_step = self.state.step


@contextmanager
def _adapters_disabled(model):
    """The LoRA-disabled base (the KL reference), through diffusers' PEFT integration."""
    model.disable_adapters()
    try:
        yield
    finally:
        model.enable_adapters()


def _show(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)
