"""The package's layers: each imports only from layers below it (imports inside functions included),
and no module imports itself back through others.

Bottom up: ``core``; ``envs`` and ``models``; ``judge``; ``rewards``; ``diagnose``; ``train``; ``lab``;
``labs``; ``integrations``; ``cli``. ``creditlab.errors``, ``creditlab._outlock`` (the lock of an output)
and the package root (``__version__``) sit under every layer and are importable from all of them; they
import only each other. Stated in docs/design.md.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "creditlab"
LAYERS = [("core",), ("envs", "models"), ("judge",), ("rewards",), ("diagnose",), ("train",), ("lab",), ("labs",),
          ("integrations",), ("cli",)]
RANK = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}
#: the modules under every layer (not in a package of a layer), importable from every layer
ANYWHERE = {"creditlab", "creditlab.errors", "creditlab._outlock"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every creditlab module ``path`` imports, at module level or inside functions."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("creditlab")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base.startswith("creditlab"):
                out.add(base)
                out |= {f"{base}.{a.name}" for a in node.names if _is_module(f"{base}.{a.name}")}
    return out


def _is_module(dotted: str) -> bool:
    path = SRC.parent / dotted.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


MODULES = {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANK else None


def test_every_package_is_in_a_layer():
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(RANK), sorted(packages ^ set(RANK))


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_imports_only_from_lower_layers(module):
    own = _layer(module)
    if own is None:  # creditlab, creditlab.errors
        return
    upward = sorted(m for m in _imports(MODULES[module]) - ANYWHERE
                    if _layer(m) is not None and RANK[_layer(m)] > RANK[own])
    assert not upward, f"{module} ({own}) imports from a higher layer: {upward}"


def test_the_modules_under_every_layer_are_listed_and_import_only_each_other():
    top = {m for m in MODULES if _layer(m) is None}
    assert top == ANYWHERE, sorted(top ^ ANYWHERE)
    for module in sorted(top):
        others = sorted(_imports(MODULES[module]) - ANYWHERE)
        assert not others, f"{module} sits under every layer but imports {others}"


def test_the_layer_check_finds_an_upward_import(tmp_path, monkeypatch):
    """The check reads imports inside functions too (so it can fail)."""
    bad = SRC / "core" / "__init__.py"
    fake = tmp_path / "creditlab" / "core" / "__init__.py"
    fake.parent.mkdir(parents=True)
    fake.write_text(bad.read_text() + "\n\ndef f():\n    from creditlab.labs import get_lab\n")
    monkeypatch.setattr(__import__(__name__), "SRC", tmp_path / "creditlab")
    assert "creditlab.labs" in _imports(fake)


def test_no_import_circles():
    graph = {m: {i for i in _imports(p) if i in MODULES and i != m} for m, p in MODULES.items()}
    # a package's __init__ importing its own submodules is not a circle of layers: drop parent -> child edges
    graph = {m: {i for i in deps if not i.startswith(m + ".")} for m, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


MAX_FUNCTION_LINES = 80


def test_no_function_in_train_is_longer_than_80_lines():
    """Every function of ``creditlab.train`` (methods and nested functions included) fits in
    :data:`MAX_FUNCTION_LINES` lines, its docstring included: the trainers stay readable."""
    offenders = []
    for path in sorted((SRC / "train").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    offenders.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({n} lines)")
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines: {offenders}"
