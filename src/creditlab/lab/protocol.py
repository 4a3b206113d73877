"""The lab protocol: what every lab implements, and :func:`run_lab`, which does the rest.

A lab is one module with one object implementing :class:`Lab`:

* ``config_type``: a frozen dataclass deriving from :class:`LabConfig` (a docstring per field,
  ``quick()``, ``validate()`` whose errors name the CLI flag, ``seeds`` as a count);
* ``cells(config)``: the independent units of work (:class:`~creditlab.lab.runner.Cell`), each
  seeding itself from its arguments, so a cell's rows do not depend on where or when it runs;
* ``tables(rows, config)``: the tables derived from the stored rows (``rows`` maps each cell group
  to the concatenated rows of its cells);
* ``plots(tables, config, out)``: PNG files;
* ``interpret(tables, config)``: a few sentences per report table: what it shows, and whether the
  run is too small to tell;
* optionally ``prepare(config, progress)``: one-off work in the driver before the cells run (e.g.
  building a cached base policy that every cell loads), with its own progress display;
* optionally ``predictions(config)``: the predictions written before a full run, as the lab states
  them (section, e.g. an experiment's name -> its texts); :func:`run_lab` records them at the start
  of a run (:func:`predictions_record`).

:func:`run_lab` owns everything else: the output directory, its lock and its manifest (a rerun into an
``--out`` made with another configuration refuses, or starts clean with ``fresh=True``; a second run
into an ``--out`` that a run is writing is refused), the results store (every finished cell persisted at
once, a rerun computes only the missing cells), the executor, progress, the parquet + markdown tables,
the plots and ``report.md``, and the record of when the run started and of the predictions it was
started with (their text, its sha256 and the git commit of the lab's source), which a resume keeps.

Adding a lab is one module and one line of the table in :mod:`creditlab.labs` (see ``docs/contributing.md``);
the CLI gives it a sub-command with the options every lab has, plus the lab's own :class:`LabOption` s.
This module imports no lab.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import pandas as pd

from creditlab._outlock import OutLock
from creditlab.errors import ConfigError, CreditlabError
from creditlab.lab.report import to_markdown
from creditlab.lab.runner import Cell, Executor, run_cells
from creditlab.lab.store import ResultStore

__all__ = ["Lab", "LabConfig", "LabOption", "LabResult", "Table", "check_count", "diff_paths", "lab_predictions",
           "predictions_record", "run_lab", "source_commit"]

MANIFEST = "lab.json"
#: Version of the manifest layout (bump when the store or manifest format changes).
MANIFEST_VERSION = 1


# --------------------------------------------------------------------------------------------
# configs


class LabConfig:
    """Mixin of every lab's frozen config dataclass.

    Class attributes a lab sets:

    * ``OPTIONS``: CLI option name -> dotted field path, for the options shared by every lab
      (``seeds``, ``updates``) when the field is nested (e.g. ``{"updates": "train.updates"}``);
      a missing entry means a top-level field of that name.
    * ``EXPERIMENTS``: the experiments ``-e`` can select (empty: the lab has one experiment).
    * ``SELECTION``: fields that select which part of the lab runs (``experiments``) or where
      things live (a cache directory), and never change a stored number. They are not part of the
      run's identity: rerunning another selection into the same ``--out`` reuses the finished
      cells and rewrites the tables, plots and report for the new selection.
    * ``FLAGS``: field path -> CLI flag for errors raised by ``validate`` (``ConfigError`` names
      the flag a user typed, not the internal field).
    """

    OPTIONS: ClassVar[dict[str, str]] = {}
    EXPERIMENTS: ClassVar[tuple[str, ...]] = ()
    SELECTION: ClassVar[tuple[str, ...]] = ("experiments",)
    PROTOCOLS: ClassVar[dict[str, str]] = {}
    """Registered protocols other than the default and ``--quick``: ``--protocol NAME`` -> the name of the
    classmethod that returns that config (e.g. a protocol sized for a smaller machine)."""

    @classmethod
    def quick(cls):  # pragma: no cover - every lab overrides it
        raise NotImplementedError

    def validate(self) -> None:  # pragma: no cover - every lab overrides it
        raise NotImplementedError

    # -- the one override mechanism ----------------------------------------------------------
    def with_options(self, **values: Any):
        """A copy with the given options set (``None`` values are skipped). Keys are CLI option
        names (mapped through ``OPTIONS``) or dotted field paths (``"grpo.correction"``)."""
        cfg = self
        for name, value in values.items():
            if value is None:
                continue
            cfg = _replace_path(cfg, self.OPTIONS.get(name, name), value)
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (tuples become lists). A field added after runs were stored declares the
        value those runs had (``field(metadata={"absent": value})``): at that value it is left out, so a
        stored run's cell keys do not change, and :meth:`from_dict` reads its absence as that value."""
        return json.loads(json.dumps(_without_absent(self)))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]):
        """Inverse of :meth:`to_dict` (nested dataclasses and tuples rebuilt from their types)."""
        return _from_dict(cls, data)

    def identity(self) -> dict[str, Any]:
        """The config without its selection fields: what a rerun into the same ``--out`` must match."""
        d = self.to_dict()
        for f in self.SELECTION:
            d.pop(f, None)
        return d


def check_count(value: Any, flag: str) -> None:
    """For a config's ``validate``: ``value`` must be an integer >= 1 (a bool is not), e.g.
    ``check_count(self.seeds, "--seeds")``; the :class:`ConfigError` names ``flag``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(flag, f"must be an integer >= 1, got {value!r}")


def _replace_path(cfg: Any, path: str, value: Any) -> Any:
    head, _, rest = path.partition(".")
    if not dataclasses.is_dataclass(cfg) or head not in {f.name for f in dataclasses.fields(cfg)}:
        raise ConfigError(path, f"not a field of {type(cfg).__name__}")
    if rest:
        return dataclasses.replace(cfg, **{head: _replace_path(getattr(cfg, head), rest, value)})
    return dataclasses.replace(cfg, **{head: value})


#: The metadata key of a dataclass field added after runs were stored: the value those runs had (see
#: :meth:`LabConfig.to_dict`).
ABSENT = "absent"


def _without_absent(obj: Any) -> Any:
    """``dataclasses.asdict`` of ``obj``, leaving out every field (at any depth) whose value is its ``absent``."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _without_absent(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if not (ABSENT in f.metadata and getattr(obj, f.name) == f.metadata[ABSENT])}
    if isinstance(obj, list | tuple):
        return [_without_absent(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _without_absent(v) for k, v in obj.items()}
    return obj


def _from_dict(cls: type, data: Mapping[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            if ABSENT in f.metadata:
                kwargs[f.name] = f.metadata[ABSENT]
            continue
        kwargs[f.name] = _coerce(hints.get(f.name, Any), data[f.name])
    unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ConfigError(cls.__name__, f"unknown field(s) {unknown}")
    return cls(**kwargs)


def _coerce(tp: Any, value: Any) -> Any:
    if isinstance(tp, type) and dataclasses.is_dataclass(tp) and isinstance(value, Mapping):
        return _from_dict(tp, value)
    origin = typing.get_origin(tp)
    if origin is tuple and isinstance(value, list | tuple):
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(args[0], v) for v in value)
        return tuple(_coerce(a, v) for a, v in zip(args, value, strict=False)) if args else tuple(value)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if arg is not type(None) and typing.get_origin(arg) is tuple and isinstance(value, list):
                return _coerce(arg, value)
    return value


# --------------------------------------------------------------------------------------------
# tables and the protocol


@dataclass(frozen=True)
class Table:
    """A derived table: written as ``<name>.parquet`` and ``<name>.md``; shown in ``report.md``
    (with its interpretation) when ``report`` is True, printed by the CLI when ``console``."""

    frame: pd.DataFrame
    title: str
    floatfmt: str = ".3f"
    report: bool = True
    console: bool = False
    carry: str = ""
    """Non-empty: this render lacks inputs the table needs (the text says which, and why: e.g. files a cell
    writes only when it is computed). :func:`run_lab` then keeps the table the previous render of the run
    wrote, its files as they were, and says so in the report; ``frame`` (what could be computed here, maybe
    empty) is used only when no earlier render wrote the table, and left out when empty."""


@dataclass(frozen=True)
class LabOption:
    """A CLI option of one lab (beyond the options every lab has): ``--<name>`` (underscores as
    dashes) sets the config field ``name`` maps to (through the config's ``OPTIONS``, e.g.
    ``"grpo.correction"``). ``type`` is ``str``, ``int``, ``float`` or ``bool`` (a flag that sets the
    field to True); unset, the config keeps its value. A ``ConfigError`` that ``validate`` raises
    about the field names this flag."""

    name: str
    help: str
    type: type = str
    metavar: str | None = None


@runtime_checkable
class Lab(Protocol):
    """What a lab module provides (see the module docstring)."""

    name: str
    """CLI name (``creditlab lab <name>``) and default output directory ``runs/<name>``."""
    summary: str
    """One line for ``creditlab lab --help``."""
    config_type: type
    """The lab's :class:`LabConfig` dataclass.

    Preconditions: a lab with ``gate_groups`` (cell groups) and ``gate(rows, config) -> Table``
    has :func:`run_lab` run those cells first and show the gate table (through ``status``) before
    any other cell runs; the gate table is also one of ``tables``.

    Predictions: a lab with ``predictions(config) -> {section: (text, ...)}`` (an :class:`ExperimentLab
    <creditlab.lab.experiment.ExperimentLab>` has it: each experiment's ``predictions_text``) has
    :func:`run_lab` record their text, its sha256 and the git commit of the lab's source in the manifest
    when a run starts, before any cell runs; ``report.md`` cites that record and says so if the text was
    edited after the run started.

    Optional attributes the CLI reads: ``help`` (the sub-command's help text; default ``summary``),
    ``quick_help`` (the help of ``--quick``: what it runs and how long it takes, cold and warm),
    ``options`` (a tuple of :class:`LabOption`, the lab's own flags) and ``threads`` (torch intra-op
    threads of the CLI process, e.g. 1 for labs of many tiny tensors, as each process worker gets).
    :func:`run_lab` reads ``build_note(config) -> str | None``: one line said (through ``status``) before
    ``prepare`` when it is about to do a long one-off build (what, about how long, where it is cached, how
    to use a stored one instead); None when nothing is built.
    A config with a ``cache_dir`` field gets the ``CREDITLAB_CACHE`` directory from the CLI."""

    def describe(self, config: Any) -> str:
        """The opening paragraph of ``report.md``: the world, the arms, the protocol."""
        ...

    def cells(self, config: Any) -> list[Cell]: ...

    def tables(self, rows: dict[str, pd.DataFrame], config: Any) -> dict[str, Table]: ...

    def plots(self, tables: dict[str, Table], config: Any, out: Path) -> list[Path]: ...

    def interpret(self, tables: dict[str, Table], config: Any) -> dict[str, str]: ...


# --------------------------------------------------------------------------------------------
# run_lab


@dataclass
class LabResult:
    """What :func:`run_lab` produced: the tables (by name), the plot files and the report path."""

    tables: dict[str, Table]
    plots: list[Path]
    report: Path
    computed: int
    """Cells computed by this run (the others were read back from the store)."""


#: Packages whose code cannot change a stored cell (the edges): left out of :func:`code_fingerprint`.
EDGES = ("cli", "integrations")


def code_fingerprint(scope: Sequence[str] | None = None) -> dict[str, str]:
    """``{module path: content hash}`` of the creditlab modules that can compute a cell. A lab run
    records it, so a resume after the code changed is refused instead of mixing cells computed by two
    versions of the code.

    ``scope``: the module paths (``"core/"``, a folder; ``"labs/mismatch/cells.py"``, a file) whose code
    computes the lab's cells, its ``compute_code``: the fingerprint covers those and nothing else, so
    that a change to the lab's tables, report, plots or docs does not void a stored run. A lab that
    declares none gets every module but the edges (:data:`EDGES`). A test holds each declared scope to
    the modules its cells import.
    """
    root = Path(__file__).resolve().parents[1]
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.split("/", 1)[0] in EDGES or "__pycache__" in rel:
            continue
        if scope is not None and not any(rel == s or (s.endswith("/") and rel.startswith(s)) for s in scope):
            continue
        out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return out


def _changed(old: Mapping[str, str], new: Mapping[str, str]) -> list[str]:
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


#: What a cell's code is when the manifest did not keep it (an older manifest of a run that mixed code).
NOT_RECORDED = "(not recorded)"


def code_id(code: Mapping[str, str]) -> str:
    """A short name of one code fingerprint: the keys of the manifest's ``codes``."""
    return _sha256(dict(code))[:12]


def cell_codes(manifest: Mapping[str, Any], keys: Iterable[str]) -> dict[str, dict[str, str] | None]:
    """The code fingerprint that computed each stored cell of ``keys``, from a run's manifest: its ``cell_code``
    record (an id of ``codes``); a cell stored after the manifest was written at a run's start (a run that
    was interrupted) was computed by that run's ``code``. A manifest of the older format (no ``cell_code``) kept
    one ``code``, which every render overwrote: every cell was computed by it unless that run mixed code, when
    which code computed which cell was not kept (None: unknown)."""
    per, codes, run = manifest.get("cell_code"), manifest.get("codes") or {}, manifest.get("code")
    out: dict[str, dict[str, str] | None] = {}
    for k in keys:
        if per is not None:
            out[k] = (codes.get(per[k]) if per[k] is not None else None) if k in per else run
        else:
            out[k] = None if manifest.get("mixed_code") else run
    return out


def _check_code(out: Path, old: Mapping[str, Any], code: dict[str, str], keep_cells: bool,
                reused: Mapping[str, dict[str, str] | None]) -> list[str]:
    """The modules in which the code of the stored cells this render reads (``reused``: key -> the code that
    computed it, :func:`cell_codes`) differs from ``code``, this render's ([] when none; :data:`NOT_RECORDED`
    for a cell whose code is unknown). Refuses unless ``keep_cells``, or unless the previous render ran this
    same code (its user reused the cells with --keep-cells then)."""
    changed = sorted({m for c in reused.values() if c is not None for m in _changed(c, code)}
                     | ({NOT_RECORDED} if any(c is None for c in reused.values()) else set()))
    if not changed or keep_cells or old.get("code") == code:
        return changed
    if old.get("code") is None and "cell_code" not in old:
        what = "was made before creditlab recorded the code of a run"
    elif changed == [NOT_RECORDED]:
        what = ("holds cells whose code was not recorded (reused with --keep-cells before creditlab kept the code "
                "of each cell)")
    else:
        what = (f"holds cells computed by other code (changed since: {', '.join(changed[:4])}"
                f"{f', +{len(changed) - 4} more' if len(changed) > 4 else ''})")
    raise ConfigError("--out", f"{out} {what}; pass --fresh to compute every cell again, or --keep-cells to "
                               "reuse the stored cells (the report then names the modules that differ)")


def _code_record(cells: Mapping[str, Mapping[str, str] | None], code: Mapping[str, str]) -> dict[str, Any]:
    """The manifest's ``codes`` (id -> fingerprint) and ``cell_code`` (stored cell -> the id of the code that
    computed it; null: unknown), kept across renders."""
    codes = {code_id(code): dict(code)}
    per: dict[str, str | None] = {}
    for key in sorted(cells):
        fp = cells[key]
        if fp is None:
            per[key] = None
            continue
        per[key] = code_id(fp)
        codes.setdefault(per[key], dict(fp))
    return {"codes": codes, "cell_code": per}


# --------------------------------------------------------------------------------------------
# the record of a run's start and of its predictions

#: Seconds one ``git`` call of :func:`source_commit` may take.
GIT_TIMEOUT = 10.0


def _now() -> str:
    """The UTC time, ISO 8601 to the second (``2026-12-03T04:05:06Z``)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def _sha256(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, ensure_ascii=False, sort_keys=True).encode()).hexdigest()


def _git(cwd: Path, *args: str) -> str:
    """The stdout of ``git args`` run in ``cwd``; :class:`OSError` / :class:`subprocess.SubprocessError` on failure."""
    done = subprocess.run(["git", "--no-optional-locks", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=GIT_TIMEOUT, check=True, env={**os.environ, "LC_ALL": "C"})
    return done.stdout.rstrip("\n")


def source_commit(file: str | Path | None, tree: str | Path | None = None) -> dict[str, Any]:
    """The git commit ``file`` (a lab's module) was run from, if it is a file tracked by a git checkout:
    ``{"commit", "commit_time", "dirty", "changed", "why"}``. ``dirty`` says whether ``tree`` (the
    package the file belongs to; default: its folder) differs from that commit (changed or untracked
    files, the first 20 of them in ``changed``): then the commit alone does not hold the text that ran.
    Without a commit (an installed copy, no git, a file that git does not track), ``commit`` is None
    and ``why`` says why."""
    rec: dict[str, Any] = {"commit": None, "commit_time": None, "dirty": None, "changed": [], "why": None}
    if file is None or not Path(file).is_file():
        rec["why"] = "the lab's module has no source file"
        return rec
    file = Path(file).resolve()
    tree = Path(tree).resolve() if tree is not None else file.parent
    try:
        try:
            top = Path(_git(file.parent, "rev-parse", "--show-toplevel"))
        except subprocess.CalledProcessError:
            rec["why"] = "the lab's source is not in a git checkout (an installed copy)"
            return rec
        try:
            _git(top, "ls-files", "--error-unmatch", "--", str(file))
        except subprocess.CalledProcessError:
            rec["why"] = "the lab's source file is not tracked by the git checkout it lies in (an installed copy)"
            return rec
        try:
            rec["commit"] = _git(top, "rev-parse", "HEAD")
        except subprocess.CalledProcessError:
            rec["why"] = "the git checkout of the lab's source has no commit yet"
            return rec
        rec["commit_time"] = _git(top, "show", "-s", "--format=%cI", "HEAD")
        lines = [ln for ln in _git(top, "status", "--porcelain=v1", "--untracked-files=normal", "--", str(tree))
                 .splitlines() if ln.strip()]
    except FileNotFoundError:
        rec["why"] = "git is not installed"
        return rec
    except subprocess.TimeoutExpired:
        rec.update(commit=None, commit_time=None, why=f"git did not answer within {GIT_TIMEOUT:g} s")
        return rec
    except (OSError, subprocess.SubprocessError) as err:
        rec.update(commit=None, commit_time=None, why=f"git failed ({type(err).__name__}: {err})")
        return rec
    rec["dirty"] = bool(lines)
    rec["changed"] = [ln[3:] for ln in lines[:20]]
    return rec


def _lab_source(lab: Lab) -> tuple[str | None, str | None]:
    """The file of the module defining ``lab``'s class, and the folder of its top-level package (what a
    dirty tree is looked for in)."""
    module = sys.modules.get(type(lab).__module__)
    file = getattr(module, "__file__", None)
    top = sys.modules.get(type(lab).__module__.split(".", 1)[0])
    paths = list(getattr(top, "__path__", None) or [])
    tree = paths[0] if paths else (str(Path(file).parent) if file else None)
    return file, tree


def lab_predictions(lab: Lab, config: Any) -> dict[str, list[str]]:
    """``lab.predictions(config)`` checked: section name -> its prediction texts ({} for a lab without
    ``predictions``)."""
    get = getattr(lab, "predictions", None)
    if get is None:
        return {}
    raw = get(config)
    if not isinstance(raw, Mapping):
        raise CreditlabError(f"lab {lab.name!r}: predictions(config) must map a section to its texts, got "
                             f"{type(raw).__name__}")
    out: dict[str, list[str]] = {}
    for name, texts in raw.items():
        if isinstance(texts, str) or not all(isinstance(t, str) and t.strip() for t in texts):
            raise CreditlabError(f"lab {lab.name!r}: the predictions of {name!r} must be a sequence of non-empty "
                                 "texts")
        out[str(name)] = list(texts)
    return out


def predictions_record(lab: Lab, config: Any, stored_cells: int = 0) -> dict[str, Any]:
    """What a run records of its predictions when it starts: their texts by section, the sha256 of all of
    them and of each section, the time (UTC), how many cells were already stored then (0 when a run
    starts: the record comes before any cell), and the git commit of the lab's source
    (:func:`source_commit`)."""
    sections = lab_predictions(lab, config)
    file, tree = _lab_source(lab)
    return {"sha256": _sha256(sections), "recorded_at": _now(), "stored_cells": stored_cells,
            "sections": {name: {"sha256": _sha256(texts), "texts": texts} for name, texts in sections.items()},
            "source": {"module": type(lab).__module__, **source_commit(file, tree)}}


def _edited(recorded: Mapping[str, Any], now: Mapping[str, list[str]]) -> list[str]:
    """The sections whose text differs from the recorded one (added and removed ones included)."""
    old = {name: sec.get("sha256") for name, sec in (recorded.get("sections") or {}).items()}
    new = {name: _sha256(texts) for name, texts in now.items()}
    return _changed(old, new)


def _stored_cells(out: Path) -> int:
    cells = out / "store" / "cells"
    return sum(1 for _ in cells.glob("*.parquet")) if cells.is_dir() else 0


def _start_record(lab: Lab, config: Any, out: Path, old: dict | None,
                  status: Callable[[str], None] | None) -> dict[str, Any]:
    """The manifest's record of the run's start: ``started_at`` and ``predictions`` (a resume keeps the
    first start's), and ``predictions_edited`` when the predictions now differ from the recorded ones."""
    if old is not None and old.get("predictions") is not None:
        rec = {"started_at": old.get("started_at"), "predictions": old["predictions"]}
    else:  # a new run, or one whose manifest predates the record (its stored cells came first)
        stored = _stored_cells(out) if old is not None else 0
        rec = {"started_at": old.get("started_at") if stored else _now(),  # cells stored before: not a start
               "predictions": predictions_record(lab, config, stored)}
    return _check_predictions(rec, lab, config, status)


def _check_predictions(rec: dict[str, Any], lab: Lab, config: Any,
                       status: Callable[[str], None] | None) -> dict[str, Any]:
    """``rec`` with ``predictions_edited`` set to the sections whose text differs now from the recorded one
    (absent when none)."""
    now = lab_predictions(lab, config)
    edited = _edited(rec["predictions"], now)
    rec = {k: v for k, v in rec.items() if k != "predictions_edited"}
    if edited:
        rec["predictions_edited"] = {"sections": edited, "sha256": _sha256(now), "seen_at": _now()}
        if status is not None:
            status(f"{lab.name} lab: the predictions of {', '.join(edited)} were edited after this run started "
                   f"({rec['predictions']['recorded_at']}); the manifest keeps the recorded text, and the report "
                   "says so")
    return rec


def _check_out(out: Path, lab: Lab, config: LabConfig, fresh: bool) -> dict | None:
    """Refuse an ``--out`` that holds another lab or another configuration; returns the old manifest
    (``out`` is a directory or absent: :func:`run_lab` checked it before taking its lock)."""
    manifest = out / MANIFEST
    if not manifest.exists():
        if out.exists() and any(out.iterdir()):
            raise ConfigError("--out", f"{out} is not empty and holds no creditlab lab run; choose another --out")
        return None
    try:
        old = json.loads(manifest.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError("--out", f"{manifest} is unreadable ({err}); choose another --out") from None
    if fresh:
        return old
    if old.get("lab") != lab.name:
        raise ConfigError("--out", f"{out} holds a run of the {old.get('lab')!r} lab; choose another --out")
    from creditlab import __version__

    if old.get("creditlab_version") != __version__:
        raise ConfigError("--out", f"{out} holds a run made by creditlab {old.get('creditlab_version')} (this is "
                                   f"{__version__}), whose code may compute other numbers; choose another --out, or "
                                   "pass --fresh to discard it")
    if old.get("manifest_version") != MANIFEST_VERSION or old.get("identity") != config.identity():
        diff = diff_paths(old.get("identity") or {}, config.identity())
        raise ConfigError("--out", f"{out} holds a {lab.name} run with another configuration "
                                   f"(differs in: {', '.join(diff) or 'store format'}); rerun with the same options, "
                                   "choose another --out, or pass --fresh to discard it")
    return old


def diff_paths(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The dotted paths of the leaves where two nested mappings differ (``grpo.lr``), sorted by key."""
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, Mapping) and isinstance(vb, Mapping):
            out += diff_paths(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}")
    return out


def _clean(out: Path, old: dict | None) -> None:
    """``--fresh``: remove the outputs the previous run listed in its manifest, its store and its manifest."""
    if old is None:
        return
    _remove(out, old.get("outputs", []))
    shutil.rmtree(out / "store", ignore_errors=True)
    (out / MANIFEST).unlink(missing_ok=True)


def _remove(out: Path, names: Iterable[str]) -> None:
    for name in names:
        p = out / name
        if p.is_file() and p.parent == out:
            p.unlink()


def _check_free(out: Path, names: list[str], ours: Iterable[str] = ()) -> None:
    """Refuse to write an output over a file of ``out`` that no run of the lab wrote: ``ours`` are the files of
    the previous render (its manifest's ``outputs``), which this one replaces; any other that exists is
    someone else's (a user's notes, a ``creditlab diagnose`` report written into the lab's ``--out``)."""
    mine = set(ours)
    taken = [n for n in dict.fromkeys(names) if n not in mine and (out / n).exists()]
    if taken:
        raise ConfigError("--out", f"{out / taken[0]}{f' (and {len(taken) - 1} more)' if len(taken) > 1 else ''} "
                                   "was not written by this lab's runs, and this run would replace it; the cells are "
                                   f"stored, no table or report was written: move {taken[0]} out of {out} and rerun "
                                   "the same command (it reads the cells back), or choose another --out")


def _carry(out: Path, prior: Mapping[str, Any] | None, tables: dict[str, Table]) -> tuple[dict[str, Table],
                                                                                          dict[str, dict[str, Any]]]:
    """The tables of this render, a table that it cannot compute (``carry`` set) replaced by the one the
    previous render of this run wrote (its files are kept as they are), and the record of each one carried
    (``why``, ``rendered_at``: when the render that computed it finished). A table that cannot be computed and
    was never written is left out when its ``frame`` is empty, else written as it is (the lab's reading says
    what it covers)."""
    ours = set((prior or {}).get("outputs", []))
    before = (prior or {}).get("carried") or {}
    kept: dict[str, Table] = {}
    carried: dict[str, dict[str, Any]] = {}
    for name, t in tables.items():
        if not t.carry:
            kept[name] = t
        elif prior is not None and f"{name}.parquet" in ours and (out / f"{name}.parquet").is_file():
            carried[name] = {"why": t.carry, "rendered_at": (before.get(name) or {}).get("rendered_at")
                             or prior.get("finished_at") or prior.get("outputs_rendered_at")}
            kept[name] = dataclasses.replace(t, frame=pd.read_parquet(out / f"{name}.parquet"))
        elif len(t.frame):
            kept[name] = dataclasses.replace(t, carry="")
    return kept, carried


def _write_manifest(out: Path, lab: Lab, config: LabConfig, outputs: list[str], code: dict[str, str],
                    mixed: list[str], record: Mapping[str, Any], cells: Mapping[str, Mapping[str, str] | None],
                    extra: Mapping[str, Any] | None = None) -> None:
    """``lab.json``: what a resume must match (``identity``, the versions, ``code``: this render's), the code
    that computed each stored cell (``codes``, ``cell_code``: :func:`_code_record`), the files the run wrote
    (``outputs``; ``carried``: those kept from an earlier render), and ``record`` (:func:`_start_record`: the
    start and the predictions; not part of the identity)."""
    from creditlab import __version__

    data = {"lab": lab.name, "manifest_version": MANIFEST_VERSION, "creditlab_version": __version__,
            "identity": config.identity(), "config": config.to_dict(), "outputs": sorted(outputs),
            "code": code, "mixed_code": mixed, **_code_record(cells, code), **(extra or {}), **record}
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    tmp.replace(out / MANIFEST)


def _markdown(t: Table) -> str:
    df = t.frame
    listy = [c for c in df.columns if len(df) and df[c].map(lambda v: isinstance(v, list | tuple)).any()]
    listy += [c for c in df.columns if len(df) and hasattr(df[c].iloc[0], "__len__")
              and not isinstance(df[c].iloc[0], str) and c not in listy]
    return to_markdown(df.drop(columns=listy), t.floatfmt)


def run_lab(lab: Lab, config: LabConfig, out: str | Path, executor: Executor | None = None, *,
            fresh: bool = False, keep_cells: bool = False, progress: bool = True,
            status: Callable[[str], None] | None = None) -> LabResult:
    """Run (or resume) ``lab`` with ``config`` into ``out``.

    Writes ``out/lab.json`` (the lab, the configuration and the files this run wrote),
    ``out/store/`` (one file per finished cell), ``<table>.parquet`` and ``<table>.md`` for every
    table, the lab's PNG plots and ``report.md``. The run holds the lock ``<out>.lock`` (and
    ``<dump_dir>.lock`` when the config has a ``dump_dir``) from its start to its end: a second run into
    the same ``--out``, ``fresh`` or not, is refused naming the first before it reads or removes
    anything. It replaces only the files its manifest lists: a table, plot or report whose file
    exists in ``out`` and was not written by a run of this lab is refused (nothing of the outputs is
    written; the cells stay stored). A rerun with the same configuration computes
    only the cells missing from the store; a rerun with another one raises
    :class:`~creditlab.errors.ConfigError` naming ``--out``, unless ``fresh`` (discard the old
    run first). Selecting other experiments (``-e``) is the same run: finished cells are reused
    and the tables, plots and report are rewritten for the new selection (the report says when the
    store holds cells that the selection leaves out). The previous render's files stay until this one
    has replaced them; a table the lab cannot compute in this render (:attr:`Table.carry`) is kept as
    the previous render wrote it, and the report says so. The manifest records the code
    (:func:`code_fingerprint`) of this render (``code``) and of every stored cell (``codes``,
    ``cell_code``, kept across renders): a resume whose stored cells were computed by other code is
    refused, naming the modules, unless ``keep_cells`` (reuse them anyway; ``report.md`` and the
    manifest's ``mixed_code`` then list what differs) or the previous render ran this same code.

    Args:
        executor: where cells run (:func:`~creditlab.lab.runner.make_executor`); None: in process.
        status: called with one-line progress messages (e.g. ``rich.console.Console.print``).
    """
    if not isinstance(config, lab.config_type):
        raise ConfigError("config", f"the {lab.name} lab needs a {lab.config_type.__name__}, "
                                    f"got {type(config).__name__}")
    config.validate()
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError("--out", f"{out} exists and is not a directory")
    locks = [OutLock(out, what=f"creditlab lab {lab.name}", overrides="--fresh")]
    dump_dir = getattr(config, "dump_dir", None)
    if dump_dir and Path(dump_dir).resolve() != out.resolve():
        locks.append(OutLock(Path(dump_dir), what=f"creditlab lab {lab.name} (its --dump)", flag="--dump",
                             overrides="--fresh"))
    held: list[OutLock] = []
    try:
        for lock in locks:
            note = lock.acquire()
            held.append(lock)
            if note and status is not None:
                status(note)
        return _run_locked(lab, config, out, executor, fresh=fresh, keep_cells=keep_cells, progress=progress,
                           status=status)
    finally:
        for lock in reversed(held):
            lock.release()


def _run_locked(lab: Lab, config: LabConfig, out: Path, executor: Executor | None, *, fresh: bool, keep_cells: bool,
                progress: bool, status: Callable[[str], None] | None) -> LabResult:
    """:func:`run_lab` once it holds the lock of ``out``."""
    old = _check_out(out, lab, config, fresh)
    prior = None if fresh else old  # the previous render, which this one continues
    code = code_fingerprint(getattr(lab, "compute_code", None))  # once, at the start: the code that computes its cells
    cells = lab.cells(config)
    keys = {c.key for c in cells}
    stored = ResultStore(out / "store").done() if prior is not None and (out / "store").is_dir() else set()
    cell_code = cell_codes(prior, stored) if prior is not None else {}
    mixed = (_check_code(out, prior, code, keep_cells, {k: cell_code[k] for k in stored & keys})
             if prior is not None else [])
    record = _start_record(lab, config, out, prior, status)  # before prepare and any cell
    if fresh:
        _clean(out, old)
    # the previous render's outputs stay, listed in the manifest as this run's, until this render replaces them
    ours = list(prior.get("outputs", [])) if prior is not None else []
    extra = {"outputs_rendered_at": prior.get("finished_at") or prior.get("outputs_rendered_at"),
             "carried": prior.get("carried") or {}} if prior is not None else {}
    note = getattr(lab, "build_note", None)
    if note is not None and status is not None and (line := note(config)):
        status(line)  # before a long one-off build: what it builds, how long, where, and how to avoid it
    prepare = getattr(lab, "prepare", None)
    if prepare is not None:
        prepare(config, progress)
    out.mkdir(parents=True, exist_ok=True)
    store = ResultStore(out / "store")
    # an interrupted run is resumable from here on
    _write_manifest(out, lab, config, ours, code, mixed, record, cell_code, extra)
    before = store.done()
    gate_groups = tuple(getattr(lab, "gate_groups", ()))
    first = [c for c in cells if c.group in gate_groups]
    if first:  # the preconditions: measured and shown before any other cell runs
        gate_frame = run_cells(first, store, executor=executor, desc=f"{lab.name} lab: gate", progress=progress)
        gate = lab.gate(_rows_by_group(gate_frame, first), config)
        if status is not None and gate is not None:
            status(f"{gate.title}\n\n{_markdown(gate)}")
    frame = run_cells(cells, store, executor=executor, desc=f"{lab.name} lab", progress=progress)
    new = keys - before
    computed = len(new)
    cell_code.update({k: code for k in new})
    several = len({code_id(cell_code[k]) if cell_code[k] is not None else None for k in keys}) > 1
    rows = _rows_by_group(frame, cells)
    tables, carried = _carry(out, prior, lab.tables(rows, config))
    texts = lab.interpret(tables, config)
    missing = [n for n, t in tables.items() if t.report and not texts.get(n)]
    if missing:
        raise CreditlabError(f"lab {lab.name!r}: no interpretation for report table(s) {missing}")
    # the plots are drawn into a folder of their own, so that no file is written before all are known to be ours
    staging = out / f".plots-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        drawn = [Path(p) for p in lab.plots(tables, config, staging)]
        fresh_tables = [name for name in tables if name not in carried]
        names = [n for name in fresh_tables for n in (f"{name}.parquet", f"{name}.md")] + [p.name for p in drawn]
        _check_free(out, names + ["report.md"], ours)
        written: list[str] = []
        for name, t in tables.items():
            if name in carried:  # the earlier render's files, as they are
                if not (out / f"{name}.md").is_file():
                    (out / f"{name}.md").write_text(_markdown(t))
            else:
                t.frame.to_parquet(out / f"{name}.parquet", index=False)
                (out / f"{name}.md").write_text(_markdown(t))
            written += [f"{name}.parquet", f"{name}.md"]
        plots = []
        for p in drawn:
            os.replace(p, out / p.name)
            plots.append(out / p.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    written += [p.name for p in plots]
    record = _check_predictions(record, lab, config, None)  # again at the end: a lab may read them from a file
    report = out / "report.md"
    unread = _unread(lab, config, before - keys)
    report.write_text(_report(lab, config, tables, texts, plots, mixed, record, several=several, carried=carried,
                              unread=unread))
    written.append(report.name)
    _remove(out, set(ours) - set(written))  # the previous render's files that this one does not replace
    _write_manifest(out, lab, config, written, code, mixed, {**record, "finished_at": _now()}, cell_code,
                    {"carried": carried})
    if status is not None:
        status(f"{lab.name} lab: {computed} cell(s) computed, {len(cells) - computed} read back from {out}/store")
    return LabResult(tables=tables, plots=plots, report=report, computed=computed)


def _unread(lab: Lab, config: LabConfig, others: set[str]) -> str:
    """The report's sentence on the stored cells of this run that this render does not read (its tables are of
    a subset of the run), "" when there are none: how many, and which experiments they are of."""
    if not others:
        return ""
    chosen = tuple(getattr(config, "experiments", ()) or ())
    names = []
    for e in type(config).EXPERIMENTS:
        if e in chosen:
            continue
        try:
            theirs = {c.key for c in lab.cells(config.with_options(experiments=(e,)))}
        except Exception:  # only to name them: an experiment that cannot run alone is not named
            continue
        if theirs & others:
            names.append(e)
    which = f" (of {', '.join(names)}: -e {' -e '.join(names)})" if names else f" (e.g. {sorted(others)[0]})"
    selects = f"it selects {', '.join(chosen)}, and " if chosen else ""
    return (f"**This render reads a subset of the run**: {selects}every table below is computed from the cells it "
            f"selects only; the store holds {len(others)} more cell(s) of this run{which} that no table here reads."
            + (" Select them too for tables of the whole run." if names else ""))


def _rows_by_group(frame: pd.DataFrame, cells: list[Cell]) -> dict[str, pd.DataFrame]:
    """The stored rows of ``cells``, split by their cell's group (the input of ``Lab.tables``)."""
    rows: dict[str, pd.DataFrame] = {}
    if len(frame):
        group_of = {c.key: c.group for c in cells}
        frame = frame.assign(_group=frame["cell_key"].map(group_of))
        for group, df in frame.groupby("_group", sort=True):
            rows[str(group)] = df.drop(columns=["_group", "cell_key"]).dropna(axis=1, how="all").reset_index(drop=True)
    return rows


def _cited(names: Iterable[str], config: LabConfig) -> list[str]:
    """The sections of predictions a report judges: an experiment's when the run selects it, any other always."""
    chosen = set(getattr(config, "experiments", ()) or ())
    return [n for n in names if n not in type(config).EXPERIMENTS or n in chosen]


def _predictions_note(record: Mapping[str, Any], config: LabConfig, lab: Lab | None = None) -> list[str]:
    """The report's paragraph citing the manifest's record of the predictions ([] when it judges none)."""
    pred = record["predictions"]
    cited = _cited(pred.get("sections") or {}, config)
    ed = record.get("predictions_edited") or {}
    edited = _cited(ed.get("sections", []), config)
    if not cited and not edited:
        return []
    src = pred.get("source") or {}
    if src.get("commit"):
        changed = list(src.get("changed") or [])
        more = f", +{len(changed) - 5} more" if len(changed) > 5 else ""
        at = (f"the lab's source at git commit `{src['commit'][:12]}` (committed {src.get('commit_time')}; "
              + (f"with uncommitted changes ({', '.join(changed[:5])}{more}), so the recorded text, not the "
                 "commit, is what was fixed)" if src.get("dirty") else "no uncommitted changes)"))
    else:
        at = f"no git commit recorded: {src.get('why') or 'unknown why'}"
    when = pred["recorded_at"]
    if pred.get("stored_cells"):
        timing = (f"at {when}, on a resume: {pred['stored_cells']} cell(s) of this run were stored by then "
                  "(it began before creditlab recorded a run's predictions), so this record does not show that "
                  "the predictions came before them")
    else:
        timing = f"when this run started, at {when}, before any of its cells ran"
    which = "; ".join(f"{n}: {len(pred['sections'][n]['texts'])}" for n in cited) or "none judged here"
    text = (f"**Predictions, recorded at the start**: this run recorded the text of its predictions ({which}) in "
            f"`lab.json` (`predictions`) {timing}: sha256 `{pred['sha256'][:12]}`, {at}.")
    if edited:
        text += (f" **The predictions were edited after this run started**: the text of {', '.join(edited)} "
                 f"differs from the recorded one (sha256 now `{ed['sha256'][:12]}`, seen {ed['seen_at']}). The "
                 "verdicts below do not read either text: they come from the lab's rules, fixed functions of the "
                 f"tables registered in its code ({_rules_at(src, lab)}); the edit changes no verdict, and the "
                 "edited text is not what is judged. The recorded text, fixed when the run started, is in "
                 "`lab.json`.")
    else:
        text += " The text has not been edited since."
    return [text, ""]


def _rules_at(src: Mapping[str, Any], lab: Lab | None) -> str:
    """Where the code of a lab's rules is: the commit recorded with its predictions, and this render's."""
    rec = (f"as registered at the recorded commit `{src['commit'][:12]}`" if src.get("commit") else
           "no commit was recorded with the text")
    now = source_commit(*_lab_source(lab)) if lab is not None else {}
    if not now.get("commit"):
        return rec + f"; whether they changed since is not known here ({now.get('why') or 'no git commit'})"
    if now["commit"] == src.get("commit") and not now.get("dirty"):
        return rec + ", the code this render ran"
    return (rec + f"; this render ran them as they are at commit `{now['commit'][:12]}`"
            + (" with uncommitted changes" if now.get("dirty") else "")
            + (f": `git diff {src['commit'][:12]}` on the lab's module shows whether they changed" if src.get("commit")
               else ""))


def _report(lab: Lab, config: LabConfig, tables: dict[str, Table], texts: dict[str, str], plots: list[Path],
            mixed: list[str], record: Mapping[str, Any], *, several: bool = True,
            carried: Mapping[str, Mapping[str, Any]] | None = None, unread: str = "") -> str:
    lines = [f"# {lab.name} lab", "", lab.describe(config).strip(), ""]
    if mixed and (several or NOT_RECORDED in mixed):
        lines += [f"**This run mixes code**: the cells its tables read were computed by more than one version of the "
                  f"code{' (or by code that was not recorded)' if NOT_RECORDED in mixed else ''}, which differ in: "
                  f"{', '.join(mixed)} (stored cells reused with --keep-cells; lab.json's `cell_code` names the code "
                  "of each cell). Rerun with --fresh for numbers of one code.", ""]
    elif mixed:
        lines += [f"**This run's cells were computed by other code**: every cell its tables read was computed by one "
                  f"version of the code, which differs from this render's in: {', '.join(mixed)} (reused with "
                  "--keep-cells; lab.json's `cell_code` and `codes`). The tables and this report are this render's; "
                  "rerun with --fresh for cells of this code.", ""]
    if unread:
        lines += [unread, ""]
    lines += _predictions_note(record, config, lab)
    carried = carried or {}
    for name, t in tables.items():
        if not t.report:
            continue
        text = texts[name].strip()
        if name in carried:
            when = carried[name].get("rendered_at")
            text = (f"**Carried over unchanged from an earlier render of this run**"
                    f"{f' (finished {when})' if when else ''}: {carried[name]['why']}. This render cannot compute "
                    f"it, so `{name}.parquet` and `{name}.md` are that render's, as they were.\n\n{text}")
        lines += [f"## {t.title}", "", text, "", _markdown(t), f"(`{name}.parquet`, `{name}.md`)", ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    lines += ["## Configuration", "", "```json", json.dumps(config.to_dict(), indent=1, sort_keys=True), "```", ""]
    return "\n".join(lines)
