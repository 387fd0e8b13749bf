"""One flag vocabulary: every verb's parser is walked, and a name that means two things (one flag, two settings)
or a setting named two ways (no name shared by the verbs that take it) fails. No prefix matching anywhere; old
names still parse, hidden from the help, with one warning each."""

from __future__ import annotations

import argparse
import re
import warnings

import pytest

from trueflow import options
from trueflow.cli import VERBS, build_parser, main
from trueflow.options import RenamedFlagWarning
from trueflow.train.config import LOCATIONS

# The one train setting whose field name predates its flag: the other verbs' `--patch-group` sets it.
TRAIN_FIELD = {"patch_group": "rollout_patch_group"}
_FIELD_OF_DEST = {f"{s}.{k}" if s else k: name for name, (s, k) in LOCATIONS.items()}


def verb_parsers(parser: argparse.ArgumentParser | None = None) -> dict[str, argparse.ArgumentParser]:
    parser = parser or build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def concept(verb: str, action: argparse.Action) -> str:
    """What an option sets: train's TrainConfig field, or another verb's dest (under train's name where it has one)."""
    if verb == "train":
        return _FIELD_OF_DEST.get(action.dest, action.dest)
    return TRAIN_FIELD.get(action.dest, action.dest)


def options_of(parsers: dict[str, argparse.ArgumentParser]) -> list[tuple[str, str, argparse.Action]]:
    return [(verb, concept(verb, a), a) for verb, p in parsers.items() for a in p._actions
            if a.option_strings and a.dest != "help"]


def conflicts(parsers: dict[str, argparse.ArgumentParser]) -> list[str]:
    """A flag that sets two things, or sets one thing with another type or choices; a setting whose verbs share
    no current name."""
    out = []
    by_flag: dict[str, dict[str, tuple]] = {}
    names: dict[str, dict[str, set[str]]] = {}
    for verb, what, a in options_of(parsers):
        kind = None if verb == "train" else (a.type, tuple(a.choices or ()), a.nargs, type(a).__name__)
        for flag in a.option_strings:
            by_flag.setdefault(flag, {})[verb] = (what, kind)
        current = {f for f in a.option_strings if f not in getattr(a, "old_names", ()) and "." not in f}
        names.setdefault(what, {}).setdefault(verb, set()).update(current)
    for flag, verbs in sorted(by_flag.items()):
        if len({what for what, _ in verbs.values()}) > 1:
            out.append(f"{flag} sets {', '.join(f'{w} in {v}' for v, (w, _) in sorted(verbs.items()))}")
        kinds = {k for _, k in verbs.values() if k is not None}
        if len(kinds) > 1:
            out.append(f"{flag} parses differently across {', '.join(sorted(verbs))}: {kinds}")
    for what, verbs in sorted(names.items()):
        if len(verbs) > 1 and not set.intersection(*verbs.values()):
            out.append(f"{what} is named {', '.join(f'{sorted(n)} in {v}' for v, n in sorted(verbs.items()))}")
    return out


def test_every_name_means_one_thing_across_every_verb():
    parsers = verb_parsers()
    assert set(parsers) == set(VERBS)
    assert conflicts(parsers) == []
    # the names the issue found split are now one (the old ones below still parse)
    shared = {what: {v for v, w, _ in options_of(parsers) if w == what} for what in
              ("output_dir", "n_samples_per_prompt", "reward", "reward_model", "reward_url", "threads", "resolution")}
    assert shared["output_dir"] >= {"train", "generate", "parity", "init-checkpoint"}
    assert shared["n_samples_per_prompt"] >= {"train", "generate"}
    assert shared["reward"] == shared["reward_model"] == shared["reward_url"] == {"train", "reward", "reward-serve"}
    assert shared["threads"] >= {"train", "generate", "parity", "serve", "reward", "reward-serve"}
    assert shared["resolution"] >= {"train", "generate", "parity"}


def test_the_walk_catches_a_name_with_two_meanings():
    """The check itself, on parsers built to break it: serve's old `--max-batch` (samples per request) beside
    reward-serve's (images per merged call), and one setting named two ways."""
    root = options.Parser(prog="x")
    sub = root.add_subparsers()
    serve, reward_serve, gen, train = (sub.add_parser(n) for n in ("serve", "reward-serve", "generate", "other"))
    serve.add_argument("--max-samples", "--max-batch", dest="max_samples", type=int)
    reward_serve.add_argument("--max-batch", dest="max_batch", type=int)
    gen.add_argument("--num-images", dest="n_samples_per_prompt", type=int)
    train.add_argument("--n-samples-per-prompt", dest="n_samples_per_prompt", type=int)
    found = conflicts(verb_parsers(root))
    assert any(c.startswith("--max-batch sets max_batch in reward-serve, max_samples in serve") for c in found), found
    assert any(c.startswith("n_samples_per_prompt is named") for c in found), found


@pytest.mark.parametrize("argv", [["train", "--num-rollout", "2"], ["generate", "--check", "x", "--prompt", "p"],
                                  ["serve", "--checkpoint", "x", "--max-sample", "4"],
                                  ["reward-serve", "--reward", "redness", "--max-b", "4"]])
def test_no_prefix_matching(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert "unrecognized arguments" in err or "the following arguments are required" in err, err
    assert all(not p.allow_abbrev for p in verb_parsers().values())


@pytest.mark.parametrize("verb, old, new", [("init-checkpoint", "--out", "--output-dir"),
                                            ("generate", "--out", "--output-dir"),
                                            ("generate", "--num-images", "--n-samples-per-prompt"),
                                            ("parity", "--save", "--output-dir"),
                                            ("reward", "--name", "--reward"), ("reward", "--model", "--reward-model"),
                                            ("reward", "--url", "--reward-url"),
                                            ("reward-serve", "--model", "--reward-model")])
def test_an_old_name_still_parses_hidden_and_warns_once(verb, old, new, monkeypatch):
    monkeypatch.setattr(options, "_WARNED", set())
    required = {"init-checkpoint": [], "generate": ["--checkpoint", "c", "--prompt", "p", "--output-dir", "o"],
                "parity": ["--checkpoint", "c"], "reward": ["--reward", "r", "--image", "i", "--prompt", "p"],
                "reward-serve": ["--reward", "r"]}[verb]
    p = verb_parsers(build_parser(verb))[verb]
    action = next(a for a in p._actions if new in a.option_strings)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        a = p.parse_args([*required, old, "3"])
        p.parse_args([*required, old, "4"])
    assert getattr(a, action.dest) in ("3", 3)
    renamed = [w for w in seen if issubclass(w.category, RenamedFlagWarning)]
    assert len(renamed) == 1 and f"{old} is the old name of {new}" in str(renamed[0].message)
    shown = set(re.findall(r"--[\w-]+", p.format_help()))
    assert old not in shown and new in shown


def test_serve_seed_is_one_meaning_random_seed():
    """serve's --seed fixes the seed of requests that name none; unset, each draws its own (as `seed` says)."""
    p = verb_parsers(build_parser("serve"))["serve"]
    assert p.parse_args(["--checkpoint", "x"]).seed is None
    assert p.parse_args(["--checkpoint", "x", "--seed", "3"]).seed == 3
