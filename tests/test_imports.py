"""The engine stands alone: its code imports nothing from diffusers' models, and its model files do no file I/O
(models stay free of I/O; `trueflow.loading` reads the files). Model families are values: no module outside a
family's folder imports it (generic code takes a `ModelFamily` from the registry). The packages are layered (`LAYERS`,
docs/architecture.md) and import each other in no cycle."""

from __future__ import annotations

import ast
import io
import json
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import diffusers
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trueflow"
ENGINE_DIRS = ("trueflow/models", "trueflow/layers", "trueflow/engine")
FAMILIES = sorted(p.parent.name for p in (PACKAGE / "models").glob("*/family.py"))
# Engine files allowed to import diffusers: the VAE, for decoding images after the trajectory is recorded, and the
# schedule, computed by diffusers' own calls — both off the parity-critical path (the transformer, samplers and
# CFG are the engine's own).
DIFFUSERS_SIDE_FILES = {"trueflow/models/qwen_image/vae.py", "trueflow/models/qwen_image/schedule.py",
                        "trueflow/models/ltx2/vae.py", "trueflow/models/ltx2/schedule.py",
                        "trueflow/models/sd3/vae.py", "trueflow/models/sd3/schedule.py",
                        "trueflow/models/flux/vae.py", "trueflow/models/flux/schedule.py",
                        "trueflow/models/wan/vae.py"}
# A family's train side in its folder: diffusers' reference model built from a preset, the checkpoint writer, and
# Qwen-Image's train kernels (installed under diffusers' model). The engine never imports them (the closure test),
# only the family spec's functions do, when called.
TRAIN_SIDE_FILES = {"trueflow/models/qwen_image/presets.py", "trueflow/models/qwen_image/checkpoint.py",
                    "trueflow/models/qwen_image/train_kernels.py",
                    "trueflow/models/ltx2/presets.py", "trueflow/models/ltx2/checkpoint.py",
                    "trueflow/models/sd3/presets.py", "trueflow/models/sd3/checkpoint.py",
                    "trueflow/models/flux/presets.py", "trueflow/models/flux/checkpoint.py",
                    "trueflow/models/wan/presets.py", "trueflow/models/wan/checkpoint.py"}
NO_IO_FILES = ["trueflow/models/qwen_image/transformer.py", "trueflow/models/qwen_image/weights.py",
               "trueflow/models/qwen_image/patches.py", "trueflow/models/qwen_image/latents.py",
               "trueflow/models/qwen_image/train.py", "trueflow/models/weight_map.py",
               *(f"trueflow/models/{family}/{f}.py" for family in ("sd3", "flux")
                 for f in ("transformer", "weights", "patches", "latents", "train", "pipeline")),
               *(f"trueflow/models/wan/{f}.py" for f in ("transformer", "weights", "patches", "latents", "train",
                                                         "pipeline", "family")), *sorted(
                   str(p.relative_to(ROOT)) for p in (PACKAGE / "layers").glob("*.py"))]
# Runtime check: these engine modules, imported alone, must not load diffusers' models.
ENGINE_MODULES = ["trueflow.models.qwen_image.transformer", "trueflow.models.qwen_image.weights",
                  "trueflow.models.qwen_image.patches", "trueflow.models.qwen_image.family", "trueflow.models",
                  "trueflow.models.sd3.transformer", "trueflow.models.sd3.weights", "trueflow.models.sd3.patches",
                  "trueflow.models.sd3.family",
                  "trueflow.models.flux.transformer", "trueflow.models.flux.weights", "trueflow.models.flux.patches",
                  "trueflow.models.flux.family",
                  "trueflow.models.wan.transformer", "trueflow.models.wan.patches", "trueflow.models.wan.family",
                  "trueflow.models.weight_map",
                  "trueflow.engine.weights", "trueflow.models.lora", "trueflow.engine.sampling_params",
                  "trueflow.engine.model_runner",
                  "trueflow.patches",
                  *sorted(f"trueflow.layers.{p.stem}" for p in (PACKAGE / "layers").glob("*.py")
                          if p.stem != "__init__")]


def _py_files(*dirs: str) -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for d in dirs for p in (ROOT / d).rglob("*.py"))


def _is_model_class(name: str) -> bool:
    obj = getattr(diffusers, name, None)
    return isinstance(obj, type) and (issubclass(obj, torch.nn.Module) or obj.__module__.startswith("diffusers.models"))


def _module_of(rel: str) -> str:
    parts = Path(rel).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(rel: str, lazy: bool = True) -> list[tuple[str, list[str], int]]:
    """(absolute module, imported names, line) for every import statement of a file, relative ones resolved;
    `lazy=False` leaves out those inside functions."""
    tree = ast.parse((ROOT / rel).read_text(), rel)
    package = _module_of(rel) if rel.endswith("__init__.py") else _module_of(rel).rpartition(".")[0]
    out = []
    for node in _walk(tree, lazy):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([mod] if mod else []))
            out.append((mod, [a.name for a in node.names], node.lineno))
    return out


def _walk(tree: ast.AST, into_functions: bool):
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if into_functions or not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                todo.append(child)


def _diffusers_model_imports(rel: str) -> list[str]:
    bad = []
    for mod, names, line in _imports(rel):
        if mod == "diffusers.models" or mod.startswith("diffusers.models."):
            bad.append(f"{rel}:{line}: import of {mod}")
        elif mod == "diffusers":
            bad += [f"{rel}:{line}: from diffusers import {n}" for n in names if n == "models" or _is_model_class(n)]
    tree = ast.parse((ROOT / rel).read_text(), rel)
    for node in ast.walk(tree):  # `import diffusers` then `diffusers.models...` / `diffusers.SomeModel`
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "diffusers":
            if node.attr == "models" or _is_model_class(node.attr):
                bad.append(f"{rel}:{node.lineno}: diffusers.{node.attr}")
    return bad


def test_engine_code_imports_no_diffusers_models():
    files = _py_files(*ENGINE_DIRS)
    assert "trueflow/models/qwen_image/transformer.py" in files and "trueflow/engine/weights.py" in files
    allowed = DIFFUSERS_SIDE_FILES | TRAIN_SIDE_FILES
    assert allowed <= set(files)
    bad = [b for rel in files if rel not in allowed for b in _diffusers_model_imports(rel)]
    assert not bad, "\n".join(bad)
    # the named exceptions really are diffusers-side (if one stops being so, shrink the list); the schedule imports
    # a diffusers pipeline module, which loads diffusers' models when imported
    for rel in allowed:
        assert _diffusers_model_imports(rel) or any(m.startswith("diffusers.pipelines.")
                                                    for m, _, _ in _imports(rel)), rel


def _trueflow_closure(roots: list[str]) -> set[str]:
    """Files of every trueflow module the given files import, transitively (packages' __init__ included). A family
    spec (`family.py`) reaches its heavy pieces only through imports inside its functions, run when called: those
    are not followed (the runtime test below checks importing the spec loads none of them)."""
    by_module = {_module_of(rel): rel for rel in _py_files("trueflow")}
    seen, todo = set(), list(roots)
    while todo:
        rel = todo.pop()
        if rel in seen:
            continue
        seen.add(rel)
        for mod, names, _ in _imports(rel, lazy=not rel.endswith("/family.py")):
            candidates = [mod] + [f"{mod}.{n}" for n in names]
            parts = mod.split(".")
            candidates += [".".join(parts[:i]) for i in range(1, len(parts))]  # parent packages run too
            todo += [by_module[c] for c in candidates if c in by_module]
    return seen


def test_engine_closure_imports_no_diffusers_models():
    """No engine file reaches, through trueflow imports, a diffusers model import other than the decode-only VAE;
    the transformer, its layers and the patch group do not reach even that."""
    bad = []
    for root in _py_files(*ENGINE_DIRS):
        if root in TRAIN_SIDE_FILES:
            continue
        closure = _trueflow_closure([root])
        bad += [f"{root} imports (through trueflow) {b}" for rel in sorted(closure - {root} - DIFFUSERS_SIDE_FILES)
                for b in _diffusers_model_imports(rel)]
        if root.startswith(("trueflow/models", "trueflow/layers")) and root not in DIFFUSERS_SIDE_FILES:
            bad += [f"{root} imports (through trueflow) {rel}" for rel in sorted(closure & DIFFUSERS_SIDE_FILES)]
    assert not bad, "\n".join(bad)


# -- families are values: no generic module imports one ------------------------------------------------------
def _family_imports(rel: str) -> list[str]:
    """A file's imports of a family module: static ones, and importlib/__import__ calls whose string names one."""
    bad = []
    for mod, names, line in _imports(rel):
        hits = [m for m in [mod, *(f"{mod}.{n}" for n in names)]
                if any(m == f"trueflow.models.{f}" or m.startswith(f"trueflow.models.{f}.") for f in FAMILIES)]
        bad += [f"{rel}:{line}: imports {h}" for h in hits[:1]]
    for node in ast.walk(ast.parse((ROOT / rel).read_text(), rel)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("import_module", "__import__", "find_spec"):
                text = " ".join(c.value for a in node.args for c in ast.walk(a)
                                if isinstance(c, ast.Constant) and isinstance(c.value, str))
                bad += [f"{rel}:{node.lineno}: {name}(...) names the family {f}" for f in FAMILIES
                        if f in text.replace("/", ".").split(".")]
    return bad


def _family_of(rel: str) -> str | None:
    parts = Path(rel).parts
    return parts[2] if parts[:2] == ("trueflow", "models") and len(parts) > 3 and parts[2] in FAMILIES else None


def test_no_module_outside_a_family_imports_it():
    assert FAMILIES and "qwen_image" in FAMILIES
    bad = [b for rel in _py_files("trueflow") for b in _family_imports(rel)
           if _family_of(rel) is None or f"trueflow.models.{_family_of(rel)}" not in b]
    assert not bad, "\n".join(bad)


def test_family_import_check_sees_every_form(tmp_path, monkeypatch):
    """The check itself: a static import, a relative one, and importlib with the family's name are all caught."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "trueflow" / "engine").mkdir(parents=True)
    forms = ["from ..models.qwen_image import weights", "import trueflow.models.qwen_image.transformer",
             "from trueflow.models import qwen_image", "importlib.import_module('trueflow.models.qwen_image.vae')",
             "__import__(f'trueflow.models.qwen_image.{x}')"]
    for i, form in enumerate(forms):
        (tmp_path / "trueflow" / "engine" / f"m{i}.py").write_text(f"import importlib\n{form}\n")
        assert _family_imports(f"trueflow/engine/m{i}.py"), form
    (tmp_path / "trueflow" / "engine" / "ok.py").write_text("import importlib\nimportlib.import_module(f'x.{name}')\n")
    assert not _family_imports("trueflow/engine/ok.py")


def test_engine_modules_load_no_diffusers_models_at_runtime():
    code = ("import importlib, json, sys\n"
            f"for m in {ENGINE_MODULES!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('diffusers'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    loaded = json.loads(out.strip().splitlines()[-1])
    assert not [m for m in loaded if m == "diffusers.models" or m.startswith("diffusers.models.")], loaded


# -- layering: which package imports which -------------------------------------------------------------------
# (a, b): package a imports b, and b never imports a, directly or through other packages. No exceptions.
LAYERS = (("models", "layers"), ("engine", "models"), ("engine", "sync"), ("placement", "engine"),
          ("placement", "rewards"), ("server", "placement"), ("train", "placement"), ("ray", "train"))
_MODULE_NAME = re.compile(r"trueflow(\.\w+)+(:[\w.]+)?")  # "trueflow.placement.local:local_engine"


def package_graph() -> dict[str, dict[str, list[str]]]:
    """package -> package it imports -> "file:line" of each such import, over every module of trueflow.

    A package is a top-level unit of trueflow: `trueflow/engine/...` is `engine`, `trueflow/patches.py` is
    `patches`. What counts as an import: every `import` / `from ... import` statement of a module, wherever it
    stands (module level, inside a function or a class, under `if TYPE_CHECKING:`), relative ones resolved and
    `from trueflow import kernels` read as an import of `kernels`; and a string constant that is a trueflow module
    name (`"trueflow.placement.local:local_engine"`, how a registry names what it imports lazily). Not counted:
    `import trueflow` itself (the root holds only the version), and names built at run time (the family registry's
    `importlib` calls, which stay inside their own package)."""
    units = {p.stem if p.suffix == ".py" else p.name for p in (ROOT / "trueflow").iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    graph: dict[str, dict[str, list[str]]] = {u: {} for u in units}
    for rel in _py_files("trueflow"):
        unit = Path(Path(rel).parts[1]).stem
        targets = [(t, line) for mod, names, line in _imports(rel) for t in [mod, *(f"{mod}.{n}" for n in names)]]
        tree = ast.parse((ROOT / rel).read_text())
        targets += [(node.value.partition(":")[0], node.lineno) for node in ast.walk(tree)
                    if isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and _MODULE_NAME.fullmatch(node.value)]
        for target, line in targets:
            tparts = target.split(".")
            if tparts[0] == "trueflow" and len(tparts) > 1 and tparts[1] in units and tparts[1] != unit:
                graph[unit].setdefault(tparts[1], []).append(f"{rel}:{line}")
    return graph


def _path(graph: dict[str, dict[str, list[str]]], start: str, goal: str) -> list[str] | None:
    """The packages of one import chain start -> ... -> goal, or None."""
    seen, todo = {start}, [[start]]
    while todo:
        chain = todo.pop(0)
        for nxt in sorted(graph.get(chain[-1], {})):
            if nxt == goal:
                return chain + [nxt]
            if nxt not in seen:
                seen.add(nxt)
                todo.append(chain + [nxt])
    return None


def _chain(graph: dict[str, dict[str, list[str]]], chain: list[str]) -> str:
    where = "; ".join(f"{a} -> {b} at {graph[a][b][0]}" for a, b in zip(chain, chain[1:]))
    return f"{' -> '.join(chain)} ({where})"


def layering_problems(graph: dict[str, dict[str, list[str]]]) -> list[str]:
    """Every import against `LAYERS` (b reaching a), and every cycle between packages, each with its import lines."""
    bad = []
    for a, b in LAYERS:
        chain = _path(graph, b, a)
        if chain:
            bad.append(f"{b} imports {a}, against the layering {a} -> {b}: {_chain(graph, chain)}")
    cycles = set()
    for a in sorted(graph):
        for b in sorted(graph[a]):
            back = _path(graph, b, a)
            if back and frozenset(back) not in cycles:
                cycles.add(frozenset(back))
                bad.append(f"import cycle: {_chain(graph, [a, *back])}")
    return bad


@pytest.fixture(scope="module")
def real_graph() -> dict[str, dict[str, list[str]]]:
    return package_graph()


def test_packages_are_layered_and_import_no_cycle(real_graph):
    graph = real_graph
    missing = [f"{a} -> {b}" for a, b in LAYERS if b not in graph[a]]
    assert not missing, f"a rule names no real import (drop or fix it): {missing}"
    bad = layering_problems(graph)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("planted", [*((b, a) for a, b in LAYERS), ("files", "net", "files")], ids="->".join)
def test_layering_check_catches_a_planted_import(real_graph, planted):
    """The check itself: each reversed rule, and a cycle between two packages no rule names, planted into the real
    graph, is reported."""
    graph = {a: {b: list(lines) for b, lines in edges.items()} for a, edges in real_graph.items()}
    for a, b in zip(planted, planted[1:]):
        graph[a].setdefault(b, []).append("planted.py:1")
    bad = layering_problems(graph)
    assert any("planted.py:1" in line for line in bad), bad


def test_layering_graph_sees_every_import_form(tmp_path, monkeypatch):
    """A function-level import, one under TYPE_CHECKING, a relative one, `from trueflow import x` and a registry's
    module-name string all make an edge."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    for pkg in ("layers", "models", "engine", "sync", "kernels", "net", "files"):
        (tmp_path / "trueflow" / pkg).mkdir(parents=True)
        (tmp_path / "trueflow" / pkg / "__init__.py").write_text("")
    forms = {"models": "def f():\n    from ..engine import x\n",
             "sync": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trueflow.engine.y import Z\n",
             "layers": "from .. import models\n", "kernels": "from trueflow import net\n",
             "net": "REGISTRY = {'a': 'trueflow.files.io:read'}\n"}
    for pkg, text in forms.items():
        (tmp_path / "trueflow" / pkg / "m.py").write_text(text)
    graph = package_graph()
    assert {(a, b) for a in graph for b in graph[a]} == {("models", "engine"), ("sync", "engine"),
                                                         ("layers", "models"), ("kernels", "net"), ("net", "files")}
    assert {line.split(",")[0] for line in layering_problems(graph)} == {  # each one's reversed rule
        "layers imports models", "models imports engine", "sync imports engine"}


# -- no file I/O in the engine's model files -----------------------------------------------------------------
IO_MODULES = {"safetensors", "pathlib", "os", "io", "json", "pickle", "shutil", "tempfile", "glob", "trueflow.loading"}


def _code_tokens(rel: str) -> list[tokenize.TokenInfo]:
    """The file's tokens without comments and string literals (docstrings may talk about files)."""
    skip = {tokenize.COMMENT, tokenize.STRING, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    skip |= {getattr(tokenize, n) for n in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END") if hasattr(tokenize, n)}
    toks = tokenize.generate_tokens(io.StringIO((ROOT / rel).read_text()).readline)
    return [t for t in toks if t.type not in skip]


@pytest.mark.parametrize("rel", NO_IO_FILES)
def test_model_files_do_no_file_io(rel):
    toks = _code_tokens(rel)
    bad = []
    for a, b in zip(toks, toks[1:] + [None]):
        followed_by_call = b is not None and b.string == "("
        if a.type == tokenize.NAME and ((a.string in ("open", "Path") and followed_by_call)
                                        or "safetensors" in a.string):
            bad.append(f"{rel}:{a.start[0]}: {a.line.strip()}")
        if a.type == tokenize.NAME and a.string in ("load", "save") and followed_by_call:  # torch.load / torch.save
            bad.append(f"{rel}:{a.start[0]}: {a.line.strip()}")
    for mod, _, line in _imports(rel):
        if mod.split(".")[0] in IO_MODULES or mod in IO_MODULES:
            bad.append(f"{rel}:{line}: import {mod}")
    assert not bad, "\n".join(bad)
    assert "open(" not in "".join(t.string for t in toks)  # the literal rule, on the code itself
