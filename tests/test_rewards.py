"""The reward interface: registry, spec parsing, weighted sums, custom rewards, the error policy, weight-free
rewards, and `trueflow reward`."""

from __future__ import annotations

import io
import math
import time

import numpy as np
import pytest
import torch
from PIL import Image

from trueflow.cli import main
from trueflow.rewards import REWARDS, Reward, RewardError, RewardTimeout, WeightedSum, build_reward, score


def images(n: int, seed: int = 0, size: int = 16) -> torch.Tensor:
    return torch.randint(0, 256, (n, size, size, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def solid(rgb: tuple[int, int, int], n: int = 1, size: int = 16) -> torch.Tensor:
    return torch.tensor(rgb, dtype=torch.uint8).expand(n, size, size, 3).clone()


# custom rewards, reached by the spec "test_rewards:NAME" (pytest puts tests/ on sys.path)
def green(images: torch.Tensor, prompts: list[str]) -> list[float]:
    return images[..., 1].float().mean(dim=(1, 2)).div(255).tolist()


def make_scaled(model_path: str | None = None, device: str = "cpu"):
    def scaled(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return torch.full((len(prompts),), 2.0 if model_path is None else 3.0)
    return scaled


class Flaky:
    """Fails on prompts containing 'bad': raises, or returns NaN, depending on `mode`."""

    name = "flaky"

    def __init__(self, mode: str = "raise", sleep: float = 0.0):
        self.mode, self.sleep, self.calls = mode, sleep, 0

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        self.calls += 1
        time.sleep(self.sleep)
        if self.mode == "raise" and any("bad" in p for p in prompts):
            raise KeyError("boom")
        return torch.tensor([math.nan if self.mode == "nan" and "bad" in p else float(i)
                             for i, p in enumerate(prompts)])


# -- weight-free rewards ---------------------------------------------------------------------------------------
def test_redness_range_and_values() -> None:
    red = build_reward("redness")
    assert isinstance(red, Reward) and red.name == "redness"
    out = red(torch.cat([solid((255, 0, 0)), solid((0, 255, 255)), solid((90, 90, 90)), solid((255, 0, 255))]),
              ["p"] * 4)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([1.0, -1.0, 0.0, 0.5]))


def test_redness_is_smooth_in_pixels() -> None:
    # one pixel value step moves the score by a fixed, tiny amount: a policy gets signal from any change
    base = solid((100, 100, 100))
    nudged = base.clone()
    nudged[0, 0, 0, 0] += 1
    delta = (build_reward("redness")(nudged, ["p"]) - build_reward("redness")(base, ["p"])).item()
    assert delta == pytest.approx(1 / (255 * 16 * 16), rel=1e-3)


def test_jpeg_sizes_match_pil_at_quality_95() -> None:
    x = torch.cat([solid((30, 60, 90), size=64), images(1, size=64)])
    buffers = []
    for a in x.numpy():
        buffers.append(io.BytesIO())
        Image.fromarray(a).save(buffers[-1], format="JPEG", quality=95)
    kb = torch.tensor([b.tell() / 1000 for b in buffers])
    torch.testing.assert_close(build_reward("jpeg_incompressibility")(x, ["p", "p"]), kb)
    torch.testing.assert_close(build_reward("jpeg_compressibility")(x, ["p", "p"]), -kb)
    assert kb[1] > 5 * kb[0]  # noise is far less compressible than a flat colour


# -- specs -----------------------------------------------------------------------------------------------------
def test_registry_names_and_unknown_name() -> None:
    assert {"redness", "jpeg_compressibility", "jpeg_incompressibility", "pickscore", "pickscore_flowgrpo",
            "ocr"} <= set(REWARDS)
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        build_reward("nope")
    with pytest.raises(ValueError, match="empty term"):
        build_reward("redness,")
    with pytest.raises(ValueError, match="no reward of 'redness' takes a model"):
        build_reward("redness", model_path="/tmp")


def test_weighted_sum() -> None:
    x = images(3)
    reward = build_reward("redness:2.0, jpeg_incompressibility:0.5")
    assert isinstance(reward, WeightedSum) and reward.name == "redness:2,jpeg_incompressibility:0.5"
    expected = 2 * REWARDS["redness"]()(x, ["p"] * 3) + 0.5 * REWARDS["jpeg_incompressibility"]()(x, ["p"] * 3)
    torch.testing.assert_close(reward(x, ["p"] * 3), expected)
    assert isinstance(build_reward("redness:0.5"), WeightedSum)
    with pytest.raises(ValueError, match="cannot import module"):
        build_reward("redness:x")  # not a weight: read as a custom 'module:function'
    for weight in ("nan", "inf", "-1e999"):
        with pytest.raises(ValueError, match=f"weight '{weight}' must be a finite number"):
            build_reward(f"redness:{weight}")


def test_custom_function_and_factory() -> None:
    x = solid((0, 51, 0), n=2)
    fn = build_reward("test_rewards:green")
    assert fn.name == "test_rewards:green"
    torch.testing.assert_close(score(fn, x, ["a", "b"])[0], torch.tensor([0.2, 0.2]))
    # a factory gets the arguments it names; then a custom reward takes the model path
    torch.testing.assert_close(build_reward("test_rewards:make_scaled")(x, ["a", "b"]), torch.tensor([2.0, 2.0]))
    torch.testing.assert_close(build_reward("test_rewards:make_scaled", model_path="m")(x, ["a", "b"]),
                               torch.tensor([3.0, 3.0]))
    weighted = build_reward("test_rewards:green:10,redness")
    torch.testing.assert_close(weighted(x, ["a", "b"]), torch.tensor([2.0 - 0.1, 2.0 - 0.1]))
    assert build_reward("test_rewards:Flaky").name == "flaky"  # a class is a factory
    with pytest.raises(ValueError, match="has no attribute"):
        build_reward("test_rewards:missing")


# -- score and the error policy ------------------------------------------------------------------------------
PROMPTS = ["ok one", "bad two", "ok one", "bad two", "ok three"]


def test_score_raise_names_reward_and_prompt() -> None:
    with pytest.raises(RewardError, match=r"reward 'flaky' failed on prompt 'bad two': KeyError") as e:
        score(Flaky("raise"), images(5), PROMPTS)
    assert e.value.prompts == ["bad two"] and isinstance(e.value.__cause__, KeyError)
    with pytest.raises(RewardError, match=r"reward 'flaky' failed on prompt 'bad two': returned nan for image 1"):
        score(Flaky("nan"), images(5), PROMPTS)


@pytest.mark.parametrize("mode", ["raise", "nan"])
def test_score_skip_drops_the_failing_group(mode: str, caplog: pytest.LogCaptureFixture) -> None:
    reward = Flaky(mode)
    scores, dropped = score(reward, images(5), PROMPTS, on_error="skip")
    assert dropped == [1, 3]
    assert torch.isnan(scores[dropped]).all() and torch.isfinite(scores[[0, 2, 4]]).all()
    assert "dropped 1 prompt group(s) (2 samples)" in caplog.text and "'bad two'" in caplog.text
    if mode == "raise":  # the batch failed, so each group was re-scored alone: the values are the groups' own
        assert reward.calls == 1 + 3
        torch.testing.assert_close(scores[[0, 2, 4]], torch.tensor([0.0, 1.0, 0.0]))
    else:  # NaN names its prompt directly: one call, the other scores kept
        assert reward.calls == 1
        torch.testing.assert_close(scores[[0, 2, 4]], torch.tensor([0.0, 2.0, 4.0]))


def test_score_keeps_groups_that_pass_alone(caplog: pytest.LogCaptureFixture) -> None:
    def at_most_two(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        if len(prompts) > 2:
            raise MemoryError("batch too large")
        return torch.ones(len(prompts))

    scores, dropped = score(at_most_two, images(4), ["a", "a", "b", "b"])
    assert dropped == [] and scores.tolist() == [1.0] * 4
    assert "failed on the whole batch (batch too large) but on no prompt alone" in caplog.text


def test_score_checks_shape_inputs_and_policy() -> None:
    with pytest.raises(RewardError, match=r"returned shape \(2,\), expected \(3,\)"):
        score(lambda i, p: torch.zeros(2), images(3), ["a"] * 3)
    with pytest.raises(RewardError, match="returned str, not scores"):
        score(lambda i, p: "high", images(1), ["a"])
    with pytest.raises(ValueError, match="expected uint8 images"):
        score(build_reward("redness"), images(3).float(), ["a"] * 3)
    with pytest.raises(ValueError, match="on_error"):
        score(build_reward("redness"), images(1), ["a"], on_error="ignore")


def test_score_timeout() -> None:
    slow = Flaky("none", sleep=0.5)
    with pytest.raises(RewardTimeout, match=r"reward 'flaky' failed on prompt 'a', 'b': no result within 0.05 s"):
        score(slow, images(2), ["a", "b"], timeout=0.05)
    scores, dropped = score(slow, images(2), ["a", "b"], on_error="skip", timeout=0.05)
    assert dropped == [0, 1] and torch.isnan(scores).all()
    assert score(Flaky("none"), images(2), ["a", "b"], timeout=5)[1] == []


def test_weighted_sum_error_names_the_term() -> None:
    reward = WeightedSum([(build_reward("redness"), 1.0), (Flaky("nan"), 1.0)])
    with pytest.raises(RewardError, match=r"reward 'flaky' failed on prompt 'bad two'"):
        score(reward, images(5), PROMPTS)


# -- trueflow reward -------------------------------------------------------------------------------------------
def test_cli_reward_prints_the_score(tmp_path, capsys: pytest.CaptureFixture) -> None:
    png = tmp_path / "red.png"
    Image.fromarray(np.full((8, 8, 3), (255, 0, 0), dtype=np.uint8)).save(png)
    assert main(["reward", "--name", "redness", "--image", str(png), "--prompt", "anything"]) == 0
    assert float(capsys.readouterr().out) == 1.0
    assert main(["reward", "--name", "nope", "--image", str(png), "--prompt", "x"]) == 2
    assert "unknown reward 'nope'" in capsys.readouterr().err
    assert main(["reward", "--name", "test_rewards:Flaky", "--image", str(png), "--prompt", "bad"]) == 1
    assert "reward 'flaky' failed on prompt 'bad': KeyError" in capsys.readouterr().err
