"""Selective activation checkpointing (`--gradient-checkpointing auto`, docs/training.md): the first k blocks
recompute in the backward, k the fewest the memory plan needs.

What is asserted: the bytes autograd saves (counted by `torch.autograd.graph.saved_tensors_hooks`) fall with every
block checkpointed, by one block's worth for each block alike; gradients and an optimizer step are bitwise those
without checkpointing, through the run's policy (PEFT LoRA, FSDP2);
the chosen k is the smallest whose plan fits, against the plan's formula worked by hand from the model's own
parameter counts (diffusers' model, PEFT's adapter), for a budget that needs none and one that needs some; the run
applies it; and a budget that nothing fits is refused in one line before anything loads (exit 2)."""

from __future__ import annotations

import functools
import shutil

import pytest
import torch
import torch.distributed as dist

from trueflow.cli import main
from trueflow.models import get_family
from trueflow.models.qwen_image.presets import build_transformer, transformer_config
from trueflow.models.qwen_image.train import model_timestep
from trueflow.parity.probe import make_inputs
from trueflow.train import memory
from trueflow.train.activations import checkpoint_blocks
from trueflow.train.config import TrainConfig
from trueflow.train.dist import init_distributed
from trueflow.train.model import LoraSpec, add_lora, train_forward
from trueflow.train.optim import make_optimizer
from trueflow.train.policy import build_policy

QWEN = get_family("qwen_image")
BF16 = torch.bfloat16
BLOCKS = 4
CONFIG = {**transformer_config("tiny"), "num_layers": BLOCKS}
SPEC = LoraSpec(TrainConfig().lora_rank, tuple(QWEN.train.lora_targets))  # the run's default LoRA
INPUTS = make_inputs(CONFIG, 1, 7, 64, BF16, 0, "cpu")


def forward(model: torch.nn.Module) -> torch.Tensor:
    return train_forward(QWEN, model, INPUTS["hidden_states"], model_timestep(INPUTS["timestep"], BF16),
                         INPUTS["grid"], INPUTS["cond"])


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny pipeline with a transformer of 4 blocks."""
    out = tmp_path_factory.mktemp("four_blocks") / "ckpt"
    shutil.copytree(tiny_checkpoint, out, ignore=shutil.ignore_patterns("transformer"))
    build_transformer(CONFIG, seed=0, dtype=BF16).save_pretrained(out / "transformer", safe_serialization=True)
    return out


def test_saved_activation_bytes_fall_with_every_block_checkpointed():
    """The bytes of every tensor autograd saves in the forward (each storage once, the weights left out), with the
    first k of the 4 blocks checkpointed: they fall with every k, by the same amount for each inner block (the
    blocks are alike; the first and last also share tensors with the model around them)."""
    model = build_transformer(CONFIG, seed=0, dtype=BF16)
    add_lora(model, SPEC, seed=0)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = []
    for k in range(BLOCKS + 1):
        for block in model.transformer_blocks:  # back to the class's forward: none checkpointed
            block.__dict__.pop("forward", None)
        checkpoint_blocks(model, QWEN.train.shard_units, k)
        held: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in weights:
                held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward(model)
        saved.append(sum(held.values()))
    drops = [a - b for a, b in zip(saved, saved[1:])]
    assert all(d > 0 for d in drops), saved
    assert len(set(drops[1:-1])) == 1, drops  # each inner block holds the same
    assert saved[-1] < drops[1], "with every block checkpointed almost nothing is held"


@pytest.fixture(scope="module")
def process_group():
    made = not dist.is_initialized()
    init_distributed("cpu")
    yield
    if made and dist.is_initialized():
        dist.destroy_process_group()


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


@functools.cache
def counts() -> tuple[int, int, int]:
    """(P, one block's weights, P_l) of the model as diffusers builds it and PEFT adapts it."""
    model = build_transformer(CONFIG, seed=0, dtype=BF16)
    base = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.transformer_blocks[0].parameters())
    add_lora(model, SPEC, seed=0)
    return base, block, sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)


def by_hand(k: int, rows: int, tokens: int, engine: int = 0) -> int:
    """The plan of a LoRA run on one GPU with the first k of the 4 blocks checkpointed (docs/training.md's Memory
    plan), from the model's own counts: the bf16 base 2·P, the adapter's fp32 master, gradient and AdamW moments
    (4 + 4 + 8)·P_l, two gathered blocks 2·2·P_block, and the activations, 34·d per token of each block kept whole
    and 2·d of each checkpointed one (every block: 2·d each and one recompute, 34·d)."""
    base, block, adapter = counts()
    d = CONFIG["num_attention_heads"] * CONFIG["attention_head_dim"]
    per_token = 34 * (BLOCKS - k) + 2 * k + (34 if k == BLOCKS else 0)
    return 2 * base + 16 * adapter + 4 * block + rows * tokens * d * per_token + engine


def gib(budget: int) -> float:
    """--gpu-memory-gib whose usable part (`memory.USABLE` of it) is `budget` bytes and half a byte, so that float
    rounding cannot turn a plan of exactly `budget` bytes away."""
    return (budget + 0.5) / memory.USABLE / memory.GIB


def test_auto_picks_the_fewest_blocks_that_fit(checkpoint, tmp_path, capsys):
    tokens = 16 + QWEN.pipeline.max_text_tokens  # 64² pixels: 4 x 4 latent tokens, and the text window
    cfg = TrainConfig(checkpoint=str(checkpoint), output_dir=str(tmp_path / "run"), gradient_checkpointing="auto",
                      micro_batch_size_sample=4, rollout_microgroup_size=4)
    cfg.fill_family_defaults()
    rows = 2 * 4  # true CFG: both branches keep their activations
    # Room for everything: nothing recomputed. Room for 2 blocks' activations less: 2 (1 would be over); a byte
    # less: 3.
    for budget, expected in ((by_hand(2, rows, tokens) - 1, 3), (by_hand(0, rows, tokens), 0),
                             (by_hand(2, rows, tokens), 2)):
        cfg.gpu_memory_gib = gib(budget)
        k, line = memory.auto_checkpointing(cfg, 1)
        assert k == expected, (budget, k)
        assert line.startswith(f"gradient checkpointing auto: {k} of {BLOCKS} blocks recomputed"), line
    # An engine with a copy of its own (--no-share-base-weights) counts it, 2·P: the budget that fitted 2 blocks
    # recomputed then needs one more (the copy is less than one block's activations here), and 2 fit again with
    # room for the copy.
    copy = 2 * counts()[0]
    assert copy < by_hand(2, rows, tokens) - by_hand(3, rows, tokens)
    cfg.share_base_weights = False
    assert memory.auto_checkpointing(cfg, 1)[0] == 3
    cfg.gpu_memory_gib = gib(by_hand(2, rows, tokens, copy))
    assert memory.auto_checkpointing(cfg, 1)[0] == 2
    # No plan without a GPU size on CPU: nothing recomputed, and said so.
    cfg.gpu_memory_gib = None
    assert memory.auto_checkpointing(cfg, 1) == (0, "gradient checkpointing auto: no memory plan on cpu without "
                                                    "--gpu-memory-gib; no block recomputed")
    # A budget below the least any k needs (3 blocks: the last one's recompute holds what it frees) is refused
    # before anything loads: one line, exit 2, no run folder.
    least = min(by_hand(k, rows, tokens) for k in range(BLOCKS + 1))
    assert least == by_hand(BLOCKS - 1, rows, tokens)
    out = tmp_path / "refused"
    argv = ["train", "--checkpoint", str(checkpoint), "--output-dir", str(out), "--gradient-checkpointing", "auto",
            "--gpu-memory-gib", repr(gib(least - 1))]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and not out.exists(), err
    assert "--gradient-checkpointing auto, every block recomputed" in err and "a smaller --micro-batch-size" in err


def test_the_run_recomputes_the_chosen_blocks(checkpoint, tmp_path, capsys, process_group):
    """`trueflow train`'s Trainer builds its policy with the first k blocks recomputed, k the plan's, and says so."""
    from trueflow.train import run
    from trueflow.train.lock import holding_run_lock

    tokens = 16 + QWEN.pipeline.max_text_tokens
    cfg = TrainConfig(checkpoint=str(checkpoint), output_dir=str(tmp_path / "run"), gradient_checkpointing="auto",
                      micro_batch_size_sample=4, rollout_microgroup_size=4, steps=2, num_sde_steps=1,
                      rollout_batch_size=1, sample_every=0,
                      gpu_memory_gib=gib(by_hand(2, 8, tokens)))

    @holding_run_lock
    def start():
        return run.start_trainer(cfg, init_distributed("cpu"), run._check_before_loading(cfg))

    trainer = start()
    blocks = trainer.models["transformer"].transformer_blocks
    assert [hasattr(b.forward, "__wrapped__") for b in blocks] == [True, True] + [False] * (BLOCKS - 2)
    assert "gradient checkpointing auto: 2 of 4 blocks recomputed in the backward" in capsys.readouterr().out
    trainer.engine.shutdown()
