"""The two memory savings of a LoRA run (docs/training.md): one copy of the frozen base weights
(`--share-base-weights`: an engine in the trainer's process reads the train side's base tensors, the very storage,
instead of loading a copy of its own) and selective activation checkpointing (`--gradient-checkpointing auto`: the
first k blocks recompute in the backward, k the fewest the memory plan needs).

One copy of the base: every weight the engine reads is the storage of a train-side tensor, in every family, under
its parity patch group (none copied) and without it (exactly the packed q/k/v GEMMs' tensors copied, named); the run
builds it so and it stays so through a rollout and an optimizer step at parity 0.0; the engine refuses what would
write into the base; the cases where the base can change are decided (shared, a one-line note, or a one-line
refusal); and the peak RSS of building the trainer and its engine drops by at least 80% of one copy of the weights
(benchmarks/shared_base.py, each mode in its own process). That a shared run trains bit for bit as an unshared one
is the golden runs' assertion: tests/test_train.py's and tests/test_ltx2_family.py's train with the default (`auto`,
which shares there: checked below) and equal runs recorded before sharing existed, metrics and LoRA tensor by
tensor.

Selective checkpointing: the bytes autograd saves (counted by `torch.autograd.graph.saved_tensors_hooks`) fall with
every block checkpointed, by one block's worth for each block alike; gradients and an optimizer step are bitwise
those without checkpointing, through the run's policy (PEFT LoRA, FSDP2); the chosen k is the smallest whose plan
fits, against the plan's formula worked by hand from the model's own parameter counts (diffusers' model, PEFT's
adapter), for a budget that needs none and one that needs some; the run applies it; and a budget that nothing fits is
refused in one line before anything loads (exit 2)."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from trueflow.cli import main
from trueflow.engine import weights
from trueflow.models import families, get_family, parity_group
from trueflow.models.qwen_image.presets import build_transformer, transformer_config
from trueflow.models.qwen_image.train import model_timestep
from trueflow.parity.probe import make_inputs
from trueflow.train import memory, shared_base
from trueflow.train.activations import checkpoint_blocks
from trueflow.train.config import TrainConfig
from trueflow.train.dist import init_distributed
from trueflow.train.model import LoraSpec, add_lora, train_forward
from trueflow.train.optim import make_optimizer
from trueflow.train.policy import build_policy

ROOT = Path(__file__).resolve().parents[1]
QWEN = get_family("qwen_image")
BF16 = torch.bfloat16
BLOCKS = 4
CONFIG = {**transformer_config("tiny"), "num_layers": BLOCKS}
SPEC = LoraSpec(TrainConfig().lora_rank, tuple(QWEN.train.lora_targets))  # the run's default LoRA
INPUTS = make_inputs(CONFIG, 1, 7, 64, BF16, 0, "cpu")
TOKENS = 16 + QWEN.pipeline.max_text_tokens  # 64² pixels: 4 x 4 latent tokens, and the text window
ROWS = 2 * 4  # a micro-batch of 4 samples, twice: true CFG's branches both keep their activations


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def forward(model: torch.nn.Module) -> torch.Tensor:
    return train_forward(QWEN, model, INPUTS["hidden_states"], model_timestep(INPUTS["timestep"], BF16),
                         INPUTS["grid"], INPUTS["cond"])


@pytest.fixture(scope="module")
def process_group():
    """The one-rank process group FSDP2 shards the policy in (as `trueflow train` makes it)."""
    made = not dist.is_initialized()
    init_distributed("cpu")
    yield
    if made and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny pipeline with a transformer of 4 blocks."""
    out = tmp_path_factory.mktemp("four_blocks") / "ckpt"
    shutil.copytree(tiny_checkpoint, out, ignore=shutil.ignore_patterns("transformer"))
    build_transformer(CONFIG, seed=0, dtype=BF16).save_pretrained(out / "transformer", safe_serialization=True)
    return out


@functools.cache
def counts() -> tuple[int, int, int]:
    """(P, one block's weights, P_l) of the model as diffusers builds it and PEFT adapts it."""
    model = build_transformer(CONFIG, seed=0, dtype=BF16)
    base = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.transformer_blocks[0].parameters())
    add_lora(model, SPEC, seed=0)
    return base, block, sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)


def by_hand(k: int, engine: int = 0) -> int:
    """The plan of a LoRA run on one GPU with the first k of the 4 blocks checkpointed (docs/training.md's Memory
    plan), from the model's own counts: the bf16 base 2·P, the adapter's fp32 master, gradient and AdamW moments
    (4 + 4 + 8)·P_l, two gathered blocks 2·2·P_block, and the activations of the micro-batch, 34·d per token of each
    block kept whole and 2·d of each checkpointed one (every block: 2·d each and one recompute, 34·d)."""
    base, block, adapter = counts()
    d = CONFIG["num_attention_heads"] * CONFIG["attention_head_dim"]
    per_token = 34 * (BLOCKS - k) + 2 * k + (34 if k == BLOCKS else 0)
    return 2 * base + 16 * adapter + 4 * block + ROWS * TOKENS * d * per_token + engine


def gib(budget: int) -> float:
    """--gpu-memory-gib whose usable part (`memory.USABLE` of it) is `budget` bytes and half a byte, so that float
    rounding cannot turn a plan of exactly `budget` bytes away."""
    return (budget + 0.5) / memory.USABLE / memory.GIB


@pytest.fixture(scope="module")
def trainer(checkpoint, tmp_path_factory, process_group):
    """The run's path to its first rollout (`run.start_trainer`) under the aligned defaults (`auto` shares the
    base), with `--gradient-checkpointing auto` against a budget that leaves room for 2 of the 4 blocks'
    activations less; and what it printed."""
    from trueflow.train import run
    from trueflow.train.lock import holding_run_lock

    cfg = TrainConfig(checkpoint=str(checkpoint), output_dir=str(tmp_path_factory.mktemp("run") / "run"),
                      steps=2, num_sde_steps=1, rollout_batch_size=1, sample_every=0,
                      gradient_checkpointing="auto", gpu_memory_gib=gib(by_hand(2)))

    @holding_run_lock
    def start():
        return run.start_trainer(cfg, init_distributed("cpu"), run._check_before_loading(cfg))

    with contextlib.redirect_stdout(io.StringIO()) as said:
        t = start()
    yield t, said.getvalue()
    t.engine.shutdown()


# -- one copy of the base ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(families()))
def test_the_engine_reads_the_train_sides_storage(name, tmp_path, process_group):
    """Every engine weight of each family is the storage of the train-side tensor of its name (a one-rank FSDP2
    shard is the whole weight); under the parity group none is copied. Without it (`none`) the packed q/k/v GEMMs
    need their splits in one buffer: exactly those tensors are copied, each named with why, and the rest shared."""
    fam = families()[name]
    fam.presets.build_transformer(fam.presets.transformer_config("tiny"), seed=0).save_pretrained(
        tmp_path / "transformer", safe_serialization=True)
    policy = build_policy(fam, str(tmp_path), LoraSpec(4, tuple(fam.train.lora_targets)), BF16, torch.device("cpu"), 0)
    base = shared_base.base_tensors(policy, fam)
    train = {n: (p.to_local() if hasattr(p, "to_local") else p) for n, p in policy.named_parameters()}
    assert all(storage(base[n.replace(".base_layer", "")]) == storage(p) for n, p in train.items()
               if not p.requires_grad and n.replace(".base_layer", "") in base)
    for group in (parity_group(fam), "none"):
        model, own = weights.share_engine_transformer(tmp_path, base, patch_group=group, family=name)
        held = weights.full_state(model)
        shared = {n for n, t in held.items() if storage(t) == storage(base[n])}
        packed = {n for n, (_, rows) in weights.weight_map.expected_tensors(
            weights.load_engine_transformer(tmp_path, patch_group=group, family=name),
            weights.weight_map.Names(fam.engine.map_module_name, fam.engine.diffusers_module_name)).items()
            if rows is not None}
        assert packed, "every family packs some projections"
        expected_own = set() if group != "none" else packed
        assert set(own) == expected_own and shared == set(held) - expected_own, (group, sorted(own))
        assert all(why.startswith("packed") for why in own.values())
        for n in expected_own:  # a copy of the same values
            assert torch.equal(held[n], base[n]) and storage(held[n]) != storage(base[n])


def test_the_run_shares_and_the_engine_refuses_to_write_into_the_base(trainer):
    """Through a rollout and an optimizer step (FSDP2's lazy init, a gathered forward, and a backward that recomputes
    2 blocks included) the engine still reads the train side's storage, at parity 0.0; it refuses the two updates
    that would write into the base, and the base is unchanged by them."""
    from trueflow.rl.advantages import group_advantages

    trainer, said = trainer
    assert "engine: reads the train side's base weights" in said and "it holds no copy of its own" in said

    rollout, rewards, _, _ = trainer._rollout(0)
    metrics = trainer._train_step(rollout, group_advantages(rewards, 4, 5.0, False), 0, None)
    assert metrics["model_output_max_abs_diff"] == 0.0 and metrics["lora_update_norm"] > 0
    assert trainer._sync()["checksums_equal"]
    engine = trainer.engine.engine  # under the caller's reward (`ScoredEngine`)
    train = {n.replace(".base_layer", ""): p.to_local() for n, p in trainer.models["transformer"].named_parameters()
             if not p.requires_grad}
    held = weights.full_state(engine.transformer)
    assert set(held) == set(train) and all(storage(held[n]) == storage(train[n]) for n in held)
    before = {n: t.clone() for n, t in held.items()}
    lora = trainer._engine_state()
    with pytest.raises(ValueError, match="merged LoRA would write into the base weights"), \
            pytest.warns(UserWarning, match="LoRA merge requested under a parity patch group"):
        engine.update_weights(lora, 1.0, "merged")
    with pytest.raises(ValueError, match="train side's base weights would write into them"):
        engine.update_weights({n: t.clone() for n, t in held.items()})
    assert all(torch.equal(train[n], before[n]) for n in train), "the base is unchanged"
    assert engine.update_weights(lora, 1.0, "unmerged") == trainer._sync()["trainer_checksum"]


def test_where_the_base_can_change_the_engine_keeps_its_own(tiny_checkpoint, tmp_path, capsys):
    """The aligned defaults (the golden runs' settings) share on one rank; each case where the base can change,
    or cannot be read, keeps the engine's own copy: `auto` says why in one line where the engine is in this process,
    `true` refuses the run in one line before anything loads (exit 2)."""
    aligned = dict(checkpoint=str(tiny_checkpoint), micro_batch_size_sample=4, rollout_microgroup_size=4)
    assert shared_base.decide(TrainConfig(**aligned), 1) and shared_base.note(TrainConfig(**aligned), 1) is None
    assert shared_base.decide(TrainConfig(**aligned, ema_decay=0.9), 1), "a LoRA's EMA leaves the base frozen"
    cases = {  # settings -> (world, why not)
        "full": (dict(use_lora=False), 1, "a full fine-tune (--no-use-lora) updates the base"),
        "merged": (dict(lora_merge_mode="merged"), 1, "--lora-merge-mode merged writes the LoRA into"),
        "fsdp": ({}, 2, "FSDP2 over 2 ranks leaves each rank 1/2 of every base weight"),
        "process": (dict(engine_process=True, tp=2, train_tp_match=2), 1, "the engine runs in a process of its own"),
        "http": (dict(engine_url=["http://127.0.0.1:1"]), 1, "the engine runs in a process of its own"),
    }
    for what, (settings, world, why) in cases.items():
        cfg = TrainConfig(**aligned, **settings)
        assert not shared_base.decide(cfg, world) and why in shared_base.why_not(cfg, world), what
        line = shared_base.note(cfg, world)
        assert (line is None) == (what in ("process", "http")), what  # another process: nothing to say
        assert line is None or why in line
        assert not shared_base.decide(TrainConfig(**aligned, **settings, share_base_weights=False), world)
        with pytest.raises(ValueError, match=re.escape(f"--share-base-weights: {why}")):
            shared_base.decide(TrainConfig(**aligned, **settings, share_base_weights=True), world)
    assert not shared_base.decide(TrainConfig(**aligned, share_base_weights=False), 1)
    out = tmp_path / "run"
    assert main(["train", "--checkpoint", str(tiny_checkpoint), "--output-dir", str(out), "--no-use-lora",
                 "--share-base-weights"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--share-base-weights: a full fine-tune" in err and not out.exists(), err


def test_sharing_drops_the_peak_rss_by_one_copy_of_the_weights(tiny_checkpoint, tmp_path):
    """benchmarks/shared_base.py on a checkpoint whose transformer is one real-width-like block (width 1024; the
    tiny text encoder and VAE): the peak RSS (ru_maxrss) of building the trainer and its engine, each mode in a
    fresh process, shared against own. The own mode holds the engine's bf16 copy of every weight, W bytes; the
    shared one holds none, so its peak is lower by W, less noise (~1 MiB between runs here, W = 76 MiB) and less
    any transient copy the own mode's load makes on top: the drop must be at least 0.8 W."""
    from trueflow.models.qwen_image.presets import build_transformer, transformer_config

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt, ignore=shutil.ignore_patterns("transformer"))
    config = {**transformer_config("tiny"), "num_attention_heads": 8, "attention_head_dim": 128, "num_layers": 1,
              "axes_dims_rope": (16, 56, 56)}
    build_transformer(config, seed=0, dtype=BF16).save_pretrained(ckpt / "transformer", safe_serialization=True)
    out = tmp_path / "shared_base.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "shared_base.py"), "--checkpoint", str(ckpt),
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    w = sum(p.numel() * 2 for p in build_transformer(config, seed=0, dtype=BF16).parameters())
    assert result["weights_bytes"] == w
    rows = {r["mode"]: r for r in result["rows"]}
    drop = rows["own"]["peak_rss_bytes"] - rows["shared"]["peak_rss_bytes"]
    assert drop >= 0.8 * w, (drop / 2**20, w / 2**20)
    assert result["summary"]["drop_bytes"] == drop and "drop of the peak rss" in proc.stdout


# -- selective activation checkpointing ----------------------------------------------------------------------------
def test_saved_activation_bytes_fall_with_every_block_checkpointed():
    """The bytes of every tensor autograd saves in the forward (each storage once, the weights left out), with the
    first k of the 4 blocks checkpointed: they fall with every k, by the same amount for each inner block (the
    blocks are alike; the first and last also share tensors with the model around them)."""
    model = build_transformer(CONFIG, seed=0, dtype=BF16)
    add_lora(model, SPEC, seed=0)
    saved = []
    for k in range(BLOCKS + 1):
        model.disable_gradient_checkpointing()  # none checkpointed, then the first k
        checkpoint_blocks(model, QWEN.train.shard_units, k)
        saved.append(memory.saved_activation_bytes(model, lambda: forward(model)))
    drops = [a - b for a, b in zip(saved, saved[1:])]
    assert all(d > 0 for d in drops), saved
    assert len(set(drops[1:-1])) == 1, drops  # each inner block holds the same
    assert saved[-1] < drops[1], "with every block checkpointed almost nothing is held"


def test_gradients_and_a_step_are_bitwise_with_and_without(checkpoint, process_group):
    """The run's policy (diffusers + PEFT LoRA with B drawn non-zero, FSDP2 on one rank): LoRA gradients and the
    masters after one AdamW step are bitwise equal with none and 2 of the 4 blocks checkpointed (selectively: the
    recompute reads the weights FSDP2 gathered for the block's backward). The last block's text-stream adapters get
    no gradient: its text output is not the model's."""
    def step(k: int) -> tuple[dict, dict]:
        model = build_policy(QWEN, str(checkpoint), SPEC, BF16, torch.device("cpu"), 0, checkpointed_blocks=k)
        lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
        with torch.no_grad():  # B = 0 would leave A without gradient
            g = torch.Generator().manual_seed(1)
            for n, p in lora.items():
                if ".lora_B." in n:
                    p.to_local().copy_(torch.randn(p.shape, generator=g) * 0.02)
        forward(model).float().square().mean().backward()
        grads = {n: p.grad.full_tensor().clone() for n, p in lora.items() if p.grad is not None}
        make_optimizer(list(lora.values()), "adamw", 1e-3, 0.0).step()
        return grads, {n: p.full_tensor().clone() for n, p in lora.items()}

    reference, (grads, masters) = step(0), step(2)
    assert sum(bool(g.abs().sum() > 0) for g in reference[0].values()) > 0.8 * len(reference[1])
    assert set(grads) == set(reference[0])
    for n in reference[0]:
        assert torch.equal(grads[n], reference[0][n]), n
    for n in reference[1]:
        assert torch.equal(masters[n], reference[1][n]), n


def test_auto_picks_the_fewest_blocks_that_fit(checkpoint, tmp_path, capsys):
    """The chosen k against `by_hand`'s plan, the engine reading the shared base unless said otherwise."""
    cfg = TrainConfig(checkpoint=str(checkpoint), output_dir=str(tmp_path / "run"), gradient_checkpointing="auto",
                      micro_batch_size_sample=4, rollout_microgroup_size=4)
    cfg.fill_family_defaults()
    # Room for everything: nothing recomputed. Room for 2 blocks' activations less: 2 (1 would be over); a byte
    # less: 3.
    for budget, expected in ((by_hand(2) - 1, 3), (by_hand(0), 0), (by_hand(2), 2)):
        cfg.gpu_memory_gib = gib(budget)
        k, line = memory.auto_checkpointing(cfg, 1)
        assert k == expected, (budget, k)
        assert line.startswith(f"gradient checkpointing auto: {k} of {BLOCKS} blocks recomputed"), line
    # An engine with a copy of its own (--no-share-base-weights) counts it, 2·P: the budget that fitted 2 blocks
    # recomputed then needs one more (the copy is less than one block's activations here), and 2 fit again with
    # room for the copy.
    copy = 2 * counts()[0]
    assert copy < by_hand(2) - by_hand(3)
    cfg.share_base_weights = False
    assert memory.auto_checkpointing(cfg, 1)[0] == 3
    cfg.gpu_memory_gib = gib(by_hand(2, copy))
    assert memory.auto_checkpointing(cfg, 1)[0] == 2
    # No plan without a GPU size on CPU: nothing recomputed, and said so.
    cfg.gpu_memory_gib = None
    assert memory.auto_checkpointing(cfg, 1) == (0, "gradient checkpointing auto: no memory plan on cpu without "
                                                    "--gpu-memory-gib; no block recomputed")
    # A budget below the least any k needs (3 blocks: the last one's recompute holds what it frees) is refused
    # before anything loads: one line, exit 2, no run folder.
    least = min(by_hand(k) for k in range(BLOCKS + 1))
    assert least == by_hand(BLOCKS - 1)
    out = tmp_path / "refused"
    argv = ["train", "--checkpoint", str(checkpoint), "--output-dir", str(out), "--gradient-checkpointing", "auto",
            "--gpu-memory-gib", repr(gib(least - 1))]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and not out.exists(), err
    assert "--gradient-checkpointing auto, every block recomputed" in err and "a smaller --micro-batch-size" in err


def test_the_run_recomputes_the_chosen_blocks(trainer):
    """`trueflow train`'s Trainer builds its policy with the first k blocks recomputed, k the plan's, and says so:
    through a forward and a backward the first 2 blocks run twice (the recompute calls the block again), the others
    once."""
    trainer, said = trainer
    assert "gradient checkpointing auto: 2 of 4 blocks recomputed in the backward" in said
    policy = trainer.models["transformer"]
    calls = [0] * BLOCKS
    # a pre-hook: the recompute stops once it has made what the backward needs, before the block's call returns
    hooks = [b.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
             for i, b in enumerate(policy.transformer_blocks)]
    try:
        forward(policy).float().square().mean().backward()
    finally:
        for h in hooks:
            h.remove()
        trainer.optimizer.zero_grad(set_to_none=True)
    assert calls == [2, 2] + [1] * (BLOCKS - 2)
