"""A lab that declares the code computing its cells (``compute_code``) declares all of it.

The run's code fingerprint (:func:`creditlab.lab.protocol.code_fingerprint`) covers only a lab's
``compute_code``, so that fixing a table or the docs does not void a stored run. That is safe only if
every module the cells' code imports is in it: this test follows the ``import`` statements (at any depth
of a module, lazy imports in functions included) from the module of each cell function and checks
that every module reached is declared, or is one of the modules below that compute no number of a
cell (each with the reason).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from creditlab.lab import protocol
from creditlab.labs.granularity import LAB as GRANULARITY
from creditlab.labs.granularity import GranularityConfig
from creditlab.labs.mismatch import LAB as MISMATCH
from creditlab.labs.mismatch import MismatchConfig

ROOT = Path(protocol.__file__).resolve().parents[1]

#: Modules a cell's code imports that compute none of its numbers.
NOT_COMPUTING = {
    "__init__.py": "the package's version and re-exports",
    "lab/__init__.py": "re-exports",
    "lab/protocol.py": "the lab protocol: LabConfig (to_dict / from_dict of the config, whose values are the "
                       "cell's key), run_lab, reports",
    "lab/report.py": "tables and their markdown",
    "lab/plotting.py": "plots",
    "lab/experiment.py": "the experiment table of a lab",
    "labs/__init__.py": "the lab registry",
    "_outlock.py": "the lock of an output directory while a run writes it",
    "diagnose/": "the rollout dump schema: a cell with --dump writes its rollouts; the rows it returns do not "
                 "depend on it (tested: a dump never changes a number)",
}


def _file(module: str) -> Path | None:
    p = ROOT.joinpath(*module.split(".")[1:])
    if (p / "__init__.py").is_file():
        return p / "__init__.py"
    return p.with_suffix(".py") if p.with_suffix(".py").is_file() else None


def _imports(path: Path) -> set[Path]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("creditlab"):
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("creditlab")]
        found |= {f for n in names if (f := _file(n)) is not None}
    return found


def _closure(starts: set[Path]) -> set[str]:
    seen: set[Path] = set()
    todo = list(starts)
    while todo:
        p = todo.pop()
        if p not in seen:
            seen.add(p)
            todo += _imports(p)
    return {p.relative_to(ROOT).as_posix() for p in seen}


def _in(rel: str, scope) -> bool:
    return any(rel == s or (s.endswith("/") and rel.startswith(s)) for s in scope)


@pytest.mark.parametrize(("lab", "config", "tables_apart"), [(MISMATCH, MismatchConfig.quick(), True),
                                                              (GRANULARITY, GranularityConfig.quick(), False)])
def test_a_labs_compute_code_holds_every_module_its_cells_import(lab, config, tables_apart):
    """``tables_apart``: the lab keeps its tables out of its cells' modules (the mismatch lab); the
    granularity lab's experiment modules hold both, so its package is in its compute code whole."""
    import sys

    starts = {Path(sys.modules[c.fn.__module__].__file__) for c in lab.cells(config)}
    reached = _closure(starts)
    undeclared = sorted(r for r in reached if not _in(r, lab.compute_code) and not _in(r, NOT_COMPUTING))
    assert not undeclared, f"{lab.name}: cells import {undeclared}, not in its compute_code"
    fp = protocol.code_fingerprint(lab.compute_code)
    assert all(_in(k, lab.compute_code) for k in fp)
    if tables_apart:
        assert not any(k.startswith(f"labs/{lab.name}/__init__") for k in fp)  # the tables are not in it


def test_a_scoped_fingerprint_ignores_a_change_outside_its_scope(tmp_path, monkeypatch):
    full, scoped = protocol.code_fingerprint(), protocol.code_fingerprint(MISMATCH.compute_code)
    assert "labs/mismatch/__init__.py" in full and "labs/mismatch/__init__.py" not in scoped
    assert "models/quant.py" in scoped and "labs/mismatch/cells.py" in scoped
    assert {k: full[k] for k in scoped} == scoped


def test_a_training_cell_reports_its_updates_and_the_time_left():
    import io

    from creditlab.labs.mismatch.cells import UpdateProgress

    t = [0.0]
    out = io.StringIO()
    p = UpdateProgress("mismatch mxfp4 seed=0", 10, every_s=60, stream=out, clock=lambda: t[0])
    for k in range(10):
        t[0] += 20.0
        p(k, [])
    lines = out.getvalue().splitlines()
    # after the first update, then once a minute (every 3 updates of 20 s), and at the end
    assert lines[0] == "mismatch mxfp4 seed=0: update 1/10, 20 s so far, about 3 min 0 s left"
    assert lines[1] == "mismatch mxfp4 seed=0: update 4/10, 1 min 20 s so far, about 2 min 0 s left"
    assert lines[-1] == "mismatch mxfp4 seed=0: update 10/10, 3 min 20 s so far"
    assert len(lines) == 4
    # a resumed cell (from update 6) counts its rate from there
    out2 = io.StringIO()
    t[0] = 0.0
    p = UpdateProgress("x", 10, stream=out2, clock=lambda: t[0])
    t[0] = 30.0
    p(6, [])
    assert out2.getvalue() == "x: update 7/10, 30 s so far, about 1 min 30 s left\n"
