"""Every verb runs the checkpoint family's parity group unless told otherwise (`none` is asked for by name), and
refuses another family's group in one line naming the right one, before any model loads."""

from __future__ import annotations

import json

import pytest

from trueflow.cli import main
from trueflow.models import get_family, get_group


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("family, fixture", [("qwen_image", "tiny_checkpoint"), ("ltx2", "ltx2_checkpoint")])
def test_parity_defaults_to_the_family_group_and_is_bitwise(family, fixture, request, capsys):
    checkpoint = request.getfixturevalue(fixture)
    rc, out, err = run(capsys, "parity", "--checkpoint", str(checkpoint), "--batch", "2", "--json")
    assert rc == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    group = next(iter(get_family(family).patch_groups))
    assert result["patch_group"] == group and result["bitwise_equal"] is True, result
    assert result["patches_applied"] == list(get_group(group).patch_names)


def verb_argv(verb: str, checkpoint, tmp_path) -> list[str]:
    return {"parity": ["parity", "--checkpoint", str(checkpoint)],
            "generate": ["generate", "--checkpoint", str(checkpoint), "--prompt", "p", "--output-dir",
                         str(tmp_path / "g")],
            "serve": ["serve", "--checkpoint", str(checkpoint)],
            "train": ["train", "--checkpoint", str(checkpoint), "--output-dir", str(tmp_path / "t")]}[verb]


@pytest.mark.parametrize("verb", ["parity", "generate", "serve", "train"])
@pytest.mark.parametrize("family, fixture, other", [("qwen_image", "tiny_checkpoint", "ltx"),
                                                    ("ltx2", "ltx2_checkpoint", "qwen_image")])
def test_another_familys_group_is_refused_naming_the_right_one(verb, family, fixture, other, request, tmp_path,
                                                               capsys):
    checkpoint = request.getfixturevalue(fixture)
    right = next(iter(get_family(family).patch_groups))
    rc, out, err = run(capsys, *verb_argv(verb, checkpoint, tmp_path), "--patch-group", other)
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert f"--patch-group {other}" in err and f"use --patch-group {right}" in err, err
    assert not (tmp_path / "g").exists() and not (tmp_path / "t").exists()


def test_patches_lists_a_familys_group_and_refuses_another(capsys):
    rc, out, _ = run(capsys, "patches", "--family", "ltx2")
    assert rc == 0 and [line.split()[0] for line in out.splitlines()] == list(get_group("ltx").patch_names)
    rc, out, _ = run(capsys, "patches")  # the default family's
    assert rc == 0 and [line.split()[0] for line in out.splitlines()] == list(get_group("qwen_image").patch_names)
    rc, _, err = run(capsys, "patches", "--family", "ltx2", "--patch-group", "qwen_image")
    assert rc == 2 and "use --patch-group ltx" in err and err.count("\n") == 1
