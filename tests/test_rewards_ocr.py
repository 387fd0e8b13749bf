"""The OCR reward: flow-GRPO's formula, on text rendered with PIL, read by the OCR model shipped in the wheel."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from trueflow.rewards import RewardError, build_reward, score
from trueflow.rewards.ocr import levenshtein, quoted_text, text_reward

pytest.importorskip("rapidocr_onnxruntime")


def render(text: str, size: tuple[int, int] = (256, 96), font_size: int = 48) -> torch.Tensor:
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text((16, 16), text, fill="black", font=ImageFont.load_default(size=font_size))
    return torch.from_numpy(np.array(image))


def test_formula() -> None:
    assert levenshtein("kitten", "sitting") == 3 and levenshtein("", "abc") == 3 and levenshtein("abc", "abc") == 0
    assert quoted_text('a sign that says "Hello World" at night') == "Hello World"
    assert text_reward("HELLO world", 'says "hello world"') == 1.0  # spaces and case do not count
    assert text_reward("xx hello world yy", 'says "hello world"') == 1.0  # contained: distance 0
    assert text_reward("hella", 'says "hello"') == pytest.approx(0.8)  # one substitution in five
    assert text_reward("", 'says "hello"') == 0.0
    assert text_reward("a very long unrelated line of text", 'says "hello"') == 0.0  # distance capped at len
    with pytest.raises(ValueError, match="double quotes"):
        quoted_text("no quotes here")


@pytest.fixture(scope="module")
def ocr():
    return build_reward("ocr")


def test_ocr_reads_rendered_text_offline(ocr, monkeypatch: pytest.MonkeyPatch) -> None:
    import rapidocr_onnxruntime
    from rapidocr_onnxruntime.utils import read_yaml, update_model_path

    # the models come from the installed wheel: the config resolves every one inside the package folder
    package = Path(rapidocr_onnxruntime.__file__).parent
    config = update_model_path(read_yaml(package / "config.yaml"))
    for stage in ("Det", "Rec"):
        model = Path(config[stage]["model_path"])
        assert model.is_file() and model.suffix == ".onnx" and package in model.parents

    def no_network(*args, **kwargs):
        raise AssertionError("the OCR reward touched the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    offline = build_reward("ocr")  # loads the models again, with the network cut
    blank = torch.full((1, 96, 256, 3), 255, dtype=torch.uint8)
    images = torch.cat([render("hello")[None], blank, render("help")[None]])
    prompts = ['a sign that says "hello"'] * 3
    scores, dropped = score(offline, images, prompts)
    assert dropped == []
    assert scores[0] > 0.95 and scores[1] < 0.05
    assert 0.3 < scores[2] < 0.95  # 'help' against 'hello': partly right


def test_ocr_prompt_without_quotes_is_named(ocr) -> None:
    images = torch.cat([render("hi")[None]] * 2)
    with pytest.raises(RewardError, match=r"reward 'ocr' failed on prompt 'no quotes': ValueError"):
        score(ocr, images, ['says "hi"', "no quotes"])
    scores, dropped = score(ocr, images, ['says "hi"', "no quotes"], on_error="skip")
    assert dropped == [1] and scores[0] > 0.95
