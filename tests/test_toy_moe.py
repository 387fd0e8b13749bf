"""The spec's guidance and experts through the generic code, before a real family needs them: `tests/families/toy_moe`
is the toy DiT as a pipeline of two experts switched at a boundary (WanPipeline's rule, read from its
model_index.json), with SD3's batched CFG and FLUX's distilled guidance input. `parity` is bitwise on each expert
under its patch group (not without it), `train` is 0.0 at every step across the expert boundary with the LoRA of
both experts moving, resumes exactly, and a recorded step equals an oracle written from the SD3 pipeline's lines;
what a family cannot take is refused in one line."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import trueflow.models as registry
from conftest import BF16, assert_bitwise, assert_differs
from trueflow.cli import main
from trueflow.engine.guidance import check_guidance
from trueflow.engine.sampling_params import SamplingParams, check_family_limits
from trueflow.models import checkpoint_experts, families, get_family
from trueflow.models.spec import Expert, boundary_experts, expert_at

FAKE_FAMILIES = Path(__file__).parent / "families"
TRAIN = ["--num-rollouts", "2", "--rollout.batch-size", "1", "--n-samples-per-prompt", "2",
         "--rollout.microgroup-size", "2", "--micro-batch-size-sample", "2", "--steps", "4", "--num-sde-steps", "4",
         "--cfg-scale", "4", "--cfg-scale-2", "3", "--sample-every", "0", "--lr", "0.05", "--resolution", "32",
         "--save-every", "1", "--ema-decay", "0.5"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> tuple:
    """tests/families on the registry's path for this module, and one toy_moe pipeline folder (seed 0)."""
    from trueflow.checkpoints import init_checkpoint

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry, "__path__", [*registry.__path__, str(FAKE_FAMILIES)])
        families.cache_clear()
        yield get_family("toy_moe"), init_checkpoint(tmp_path_factory.mktemp("moe") / "toy_moe", family="toy_moe")
    families.cache_clear()


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line_error(capsys, *argv) -> str:
    rc, _, err = _run(capsys, *argv)
    lines = [line for line in err.splitlines() if "error:" in line]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_experts_are_the_pipelines_components_switched_as_wan_switches_them(moe):
    family, ckpt = moe
    index = json.loads((ckpt / "model_index.json").read_text())
    ratio = index["boundary_ratio"]
    assert checkpoint_experts(ckpt, family) == (Expert("transformer", low=600.0), Expert("transformer_2", high=600.0))
    # WanPipeline.__call__: `t >= boundary_ratio * num_train_timesteps` runs `transformer`, else `transformer_2`
    experts = checkpoint_experts(ckpt, family)
    for t in (1000.0, 600.0, 599.99, 250.0, 0.0):
        assert experts[expert_at(experts, torch.tensor(t))].name == ("transformer" if t >= ratio * 1000 else
                                                                     "transformer_2")
    # Wan2.1 / TI2V-5B save an absent transformer_2 as [null, null]: one expert
    assert boundary_experts({"transformer_2": [None, None], "boundary_ratio": None}, {}) == (Expert("transformer"),)
    with pytest.raises(ValueError, match="names transformer_2 without a boundary_ratio"):
        boundary_experts({"transformer_2": ["diffusers", "WanTransformer3DModel"]}, {})
    with pytest.raises(ValueError, match="has a boundary_ratio but no transformer_2"):
        boundary_experts({"boundary_ratio": 0.875}, {})


@pytest.mark.parametrize("expert", ["transformer", "transformer_2"])
def test_parity_is_bitwise_on_each_expert_with_batched_cfg(moe, capsys, expert):
    _, ckpt = moe

    def parity(group: str) -> dict:
        rc, out, err = _run(capsys, "parity", "--checkpoint", str(ckpt), "--patch-group", group, "--expert", expert,
                            "--cfg-scale", "4", "--batch", "2", "--lora-rank", "4", "--json")
        assert rc == 0, err
        return json.loads(out)

    exact = parity("toy_moe")
    assert exact["expert"] == expert and exact["bitwise_equal"] and exact["model_output_max_abs_diff"] == 0.0
    assert all(r["max_abs_diff"] == 0.0 for r in exact["layers"])
    fast = parity("none")
    assert fast["model_output_max_abs_diff"] > 0 and not fast["bitwise_equal"]


def _sd3_step(model, tensors: dict, m: int, t: int, scale: float) -> torch.Tensor:
    """A recorded step recomputed from StableDiffusion3Pipeline.__call__'s lines: one forward of `torch.cat([latents]
    * 2)` with `torch.cat([negative, positive])` conditioning and `t.expand(2B)`, then `noise_pred.chunk(2)` as
    (uncond, text) and `uncond + guidance_scale · (text − uncond)`."""
    latents = tensors[f"mg{m}/step{t}/latents"]
    timestep = tensors[f"mg{m}/step{t}/timestep"][0].expand(2 * latents.shape[0])
    context = torch.cat([tensors[f"mg{m}/negative/context"], tensors[f"mg{m}/positive/context"]])
    guidance = torch.cat([tensors[f"mg{m}/negative/guidance"], tensors[f"mg{m}/positive/guidance"]])
    with torch.no_grad():
        noise_pred = model(torch.cat([latents] * 2), context, timestep, guidance=guidance)[0]
    noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
    return noise_pred_uncond + scale * (noise_pred_text - noise_pred_uncond)


def _rows(run: Path) -> list[dict]:
    from trueflow.train.metrics import TIMING_KEYS, read_metrics

    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in read_metrics(run / "metrics.jsonl")]


def test_train_is_bitwise_across_the_expert_boundary_and_trains_both_experts(moe, tmp_path, capsys):
    """2 rollouts whose steps cross the boundary: 0.0 at every step, both experts' LoRA moves and is saved in its
    own loadable file; each step ran on the expert the boundary rule gives, recorded, and equals the SD3 oracle on
    that expert (not on the other one); a resumed run equals the uninterrupted one bit for bit."""
    from safetensors import safe_open

    from trueflow.train.checkpoint import EMA_FILE, LORA_FILE, latest_checkpoint

    family, ckpt = moe
    run = tmp_path / "run"
    rc, _, err = _run(capsys, "train", "--checkpoint", str(ckpt), "--output-dir", str(run), "--debug", *TRAIN)
    assert rc == 0, err
    rows = _rows(run)
    assert [r["model_output_max_abs_diff"] for r in rows] == [0.0, 0.0]
    assert all(r["checksums_equal"] and r["lora_update_norm"] > 0 and r["policy_ratio_mean"] == 1.0 for r in rows)
    final = latest_checkpoint(run)
    state = json.loads((final / "trainer_state.json").read_text())
    assert (state["experts"], state["lora_experts"]) == (["transformer", "transformer_2"],) * 2
    assert (final / "pytorch_lora_weights_ema_transformer_2.safetensors").is_file()  # each expert's EMA too
    for name in (LORA_FILE, "pytorch_lora_weights_transformer_2.safetensors"):
        saved = load_file(final / name)  # diffusers' layout: one transformer's LoRA, `transformer.`-prefixed
        assert saved and all(k.startswith("transformer.transformer_blocks.") for k in saved)
        assert any(v.abs().max() > 0 for k, v in saved.items() if ".lora_B." in k), f"{name}: B never moved from 0"

    # The recorded expert of each step is the boundary rule's, and the steps cross the boundary.
    snapshot = run / "snapshots" / "rollout-00000.safetensors"
    with safe_open(str(snapshot), "pt") as f:
        meta = json.loads(f.metadata()["trueflow"])
    tensors = load_file(str(snapshot))
    group = meta["microgroups"][0]
    timesteps = tensors["mg0/timesteps"]
    assert group["experts"] == ["transformer" if t >= 0.6 * 1000 else "transformer_2" for t in timesteps.tolist()]
    assert set(group["experts"]) == {"transformer", "transformer_2"} and group["cfg_scales"] == [4.0, 4.0, 3.0, 3.0]
    assert meta["guidance"] == {"branches": "batched", "formula": "plain_cfg", "distilled_input": "guidance"}
    assert torch.equal(tensors["mg0/positive/guidance"], torch.full((2,), 3.5))  # FLUX's default, both branches
    models = {e: family.train.model_class().from_pretrained(ckpt, subfolder=e, dtype=BF16)
              for e in meta["engine"]["experts"]}
    for t, expert in enumerate(group["experts"]):
        recorded = tensors[f"mg0/step{t}/guided_output"]
        assert_bitwise(_sd3_step(models[expert], tensors, 0, t, group["cfg_scales"][t]), recorded, f"step {t}")
        other = next(e for e in models if e != expert)  # the failure side: the other expert
        assert_differs(_sd3_step(models[other], tensors, 0, t, group["cfg_scales"][t]), recorded,
                       f"step {t} on {other}")
    # and the chunk order matters: [positive, negative] is not the pipeline's
    swapped = {**tensors, "mg0/negative/context": tensors["mg0/positive/context"],
               "mg0/positive/context": tensors["mg0/negative/context"]}
    assert_differs(_sd3_step(models["transformer"], swapped, 0, 0, 4.0), tensors["mg0/step0/guided_output"])

    # Resumed after the first rollout (each expert's LoRA, EMA-less optimizer state, RNGs): the same run.
    resumed = tmp_path / "resumed"
    for n, extra in (("1", ()), ("2", ("--resume",))):
        argv = [*TRAIN[:1], n, *TRAIN[2:]]
        rc, _, err = _run(capsys, "train", "--checkpoint", str(ckpt), "--output-dir", str(resumed), "--debug", *argv,
                          *extra)
        assert rc == 0, err
    assert _rows(resumed) == rows
    for name in (LORA_FILE, "pytorch_lora_weights_transformer_2.safetensors", EMA_FILE,
                 "pytorch_lora_weights_ema_transformer_2.safetensors"):
        expected, got = load_file(final / name), load_file(latest_checkpoint(resumed) / name)
        assert sorted(got) == sorted(expected)
        for k in expected:
            assert_bitwise(got[k], expected[k], k)


def test_lora_experts_trains_only_the_experts_named(moe, tmp_path, capsys):
    """`--lora-experts transformer_2`: only that expert gets a LoRA (its own file); the first expert's steps are still
    re-scored bitwise, without a gradient."""
    from trueflow.train.checkpoint import LORA_FILE, latest_checkpoint

    _, ckpt = moe
    run = tmp_path / "run"
    argv = [*TRAIN[:1], "1", *TRAIN[2:]]
    rc, _, err = _run(capsys, "train", "--checkpoint", str(ckpt), "--output-dir", str(run), "--lora-experts",
                      "transformer_2", *argv)
    assert rc == 0, err
    (row,) = _rows(run)
    assert row["model_output_max_abs_diff"] == 0.0 and row["checksums_equal"] and row["lora_update_norm"] > 0
    final = latest_checkpoint(run)
    assert not (final / LORA_FILE).exists() and (final / "pytorch_lora_weights_transformer_2.safetensors").is_file()
    assert json.loads((final / "trainer_state.json").read_text())["lora_experts"] == ["transformer_2"]


def test_what_a_family_cannot_take_is_refused_in_one_line(moe, tmp_path, capsys, monkeypatch):
    family, ckpt = moe
    ltx2, qwen = get_family("ltx2"), get_family("qwen_image")
    monkeypatch.chdir(tmp_path)
    # CFG on a family without it: LTX-2.3 trains its modality-isolated pass unguided
    assert "ltx2 takes no classifier-free guidance" in _one_line_error(capsys, "train", "--family", "ltx2",
                                                                       "--cfg-scale", "4")
    with pytest.raises(ValueError, match="ltx2 takes no classifier-free guidance.*--cfg-scale"):
        check_family_limits(SamplingParams(cfg_scale=4.0, height=32, width=32), ltx2)
    # a per-expert scale on a family without one, or with one expert; and without CFG at all
    assert "qwen_image takes no per-expert scale" in _one_line_error(capsys, "train", "--cfg-scale-2", "3")
    with pytest.raises(ValueError, match="toy_moe has one expert here"):
        check_family_limits(SamplingParams(cfg_scale=4.0, cfg_scale_2=3.0), family, experts=1)
    with pytest.raises(ValueError, match=r"needs cfg_scale \(--cfg-scale\) > 1"):
        check_guidance(family.name, family.guidance, 1.0, 3.0, None, 2)
    # a distilled scale on a family without that input
    assert "qwen_image has no distilled guidance input" in _one_line_error(
        capsys, "train", "--distilled-guidance-scale", "3.5")
    with pytest.raises(ValueError, match="has no distilled guidance input"):
        check_family_limits(SamplingParams(distilled_guidance_scale=3.5), qwen)
    # an expert the checkpoint does not have
    assert "not an expert of" in _one_line_error(capsys, "parity", "--checkpoint", str(ckpt), "--expert",
                                                 "transformer_3")
    assert "--lora-experts transformer_3: not an expert of" in _one_line_error(
        capsys, "train", "--checkpoint", str(ckpt), "--output-dir", str(tmp_path / "r"), "--lora-experts",
        "transformer_3", *TRAIN)
    # a checkpoint whose pipeline config names a second transformer without a boundary
    broken = tmp_path / "broken"
    broken.mkdir()
    index = json.loads((ckpt / "model_index.json").read_text())
    (broken / "model_index.json").write_text(json.dumps({k: v for k, v in index.items() if k != "boundary_ratio"}))
    assert "names transformer_2 without a boundary_ratio" in _one_line_error(capsys, "parity", "--checkpoint",
                                                                             str(broken))


def test_a_micro_batch_spanning_two_experts_is_split_per_expert(moe):
    """Micro-batches of all four steps (condition 4 broken: `micro_batch_size_tstep` 4) hold rows of both experts:
    each becomes one micro-batch per expert, in row order, with the condition-4 warning; none is assembled whole."""
    from trueflow.engine.engine import Engine
    from trueflow.engine.request import RolloutRequest
    from trueflow.train.batch import assemble, split_by_expert
    from trueflow.train.pairs import micro_batches

    _, ckpt = moe
    rollout = Engine(ckpt, "toy_moe").rollout(RolloutRequest(["a red apple"], 2, SamplingParams(
        steps=4, height=32, width=32), seed=0, decode=False))
    (mixed,) = micro_batches([0, 1], 4, 2, 4)
    advantages = torch.zeros(2)
    with pytest.raises(ValueError, match="several experts"):
        assemble(rollout, mixed, advantages, torch.device("cpu"), get_family("toy_moe"))
    with pytest.warns(UserWarning, match="condition 4: .* experts transformer, transformer_2: it is split"):
        split = split_by_expert(rollout, [mixed])
    assert split == [[r for r in mixed if r.slot < 2], [r for r in mixed if r.slot >= 2]]
    assert [assemble(rollout, rows, advantages, torch.device("cpu"), get_family("toy_moe")).expert
            for rows in split] == ["transformer", "transformer_2"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one expert per micro-batch (the aligned tiling): nothing to split, no warning
        assert split_by_expert(rollout, micro_batches([0, 1], 4, 2, 1)) == micro_batches([0, 1], 4, 2, 1)


def test_a_lora_update_covers_each_expert_all_or_nothing(moe):
    """One state dict for both experts (the second's names prefixed `transformer_2.`): each expert holds its own
    part, the checksum read back covers both, and an update with one bad tensor installs nothing on either."""
    from trueflow.engine.engine import Engine
    from trueflow.sync.checksum import tensors_checksum
    from trueflow.train.model import LoraSpec, add_lora, lora_state_dict

    family, ckpt = moe
    engine = Engine(ckpt, "toy_moe")
    state = {}
    for k, (prefix, seed) in enumerate((("", 1), ("transformer_2.", 2))):
        model = family.train.model_class().from_pretrained(ckpt, subfolder=engine.experts[k].name, dtype=BF16)
        add_lora(model, LoraSpec(rank=2, target_modules=family.train.lora_targets), b_init_std=0.02, seed=seed)
        state |= {prefix + n: v for n, v in lora_state_dict(model).items()}
    held = engine.update_weights(state, 1.0)
    assert held == tensors_checksum(state) == engine.checksum()
    first, second = engine.transformers
    q = "transformer_blocks.0.attn.to_q"
    assert_bitwise(dict(first.named_modules())[q].adapters[0].B, state[f"{q}.lora_B.weight"])
    assert_bitwise(dict(second.named_modules())[q].adapters[0].B, state[f"transformer_2.{q}.lora_B.weight"])
    bad = {**state, f"transformer_2.{q}.lora_B.weight": torch.full_like(state[f"transformer_2.{q}.lora_B.weight"],
                                                                       math.nan)}
    bad |= {f"{q}.lora_B.weight": state[f"{q}.lora_B.weight"] * 2}  # a valid change on the first expert
    with pytest.raises(ValueError, match=f"{q}.lora_B.weight"):
        engine.update_weights(bad, 1.0)
    assert engine.checksum() == held  # neither expert changed
    only_second = {k: v for k, v in state.items() if k.startswith("transformer_2.")}
    assert engine.update_weights(only_second, 1.0) == tensors_checksum(only_second)  # the first's LoRA is cleared
    assert all(a is None for m in first.modules() for a in getattr(m, "adapters", ()))
