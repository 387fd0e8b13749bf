"""One copy of the frozen base weights (`--share-base-weights`, docs/training.md): an engine in the trainer's
process reads the train side's base tensors — the very storage — instead of loading a copy of its own.

What is asserted: every weight the engine reads is the storage of a train-side tensor, in every family, under its
parity patch group (none copied) and without it (exactly the packed q/k/v GEMMs' tensors copied, named); the run's
path builds it so and the engine refuses what would write into the base; the cases where the base can change are
decided (shared, or a one-line note, or a one-line refusal); and the peak RSS of building the trainer and its
engine drops by at least 80% of one copy of the weights (benchmarks/shared_base.py, each mode in its own process).
That a shared run trains bit for bit as an unshared one is the golden runs' assertion: tests/test_train.py's and
tests/test_ltx2_family.py's train with the default (`auto`, which shares there: checked below) and equal runs
recorded before sharing existed, metrics and LoRA tensor by tensor."""

from __future__ import annotations

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
from trueflow.models import families, parity_group
from trueflow.train import shared_base
from trueflow.train.config import TrainConfig
from trueflow.train.dist import init_distributed
from trueflow.train.model import LoraSpec
from trueflow.train.policy import build_policy

ROOT = Path(__file__).resolve().parents[1]
BF16 = torch.bfloat16


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.fixture(scope="module")
def process_group():
    """The one-rank process group FSDP2 shards the policy in (as `trueflow train` makes it)."""
    made = not dist.is_initialized()
    init_distributed("cpu")
    yield
    if made and dist.is_initialized():
        dist.destroy_process_group()


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


@pytest.fixture(scope="module")
def trainer(tiny_checkpoint, tmp_path_factory, process_group):
    """The run's path to its first rollout (`run.start_trainer`) under the aligned defaults: `auto` shares."""
    from trueflow.train import run
    from trueflow.train.lock import holding_run_lock

    cfg = TrainConfig(checkpoint=str(tiny_checkpoint), output_dir=str(tmp_path_factory.mktemp("shared") / "run"),
                      steps=2, num_sde_steps=1, rollout_batch_size=1, sample_every=0)

    @holding_run_lock
    def start():
        return run.start_trainer(cfg, init_distributed("cpu"), run._check_before_loading(cfg))

    t = start()
    yield t
    t.engine.shutdown()


def test_the_run_shares_and_the_engine_refuses_to_write_into_the_base(trainer):
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
