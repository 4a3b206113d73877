"""Read rollout dumps (parquet, JSONL, directories of them, verl's ``rollout_data_dir``) into a :class:`Dump`.

A dump is read in bounded memory: each file a batch of rows at a time (about ``CHUNK_BYTES`` of JSONL
text, or of parquet data), each batch validated and its token columns reduced at once to per-row sums
(:func:`creditlab.diagnose._tokens.reduce_tokens`), so that what stays in memory is a few hundred bytes
per row whatever the number of tokens and steps. A :class:`Dump` is columnar: one entry per trajectory
for the trajectory columns and those sums (:class:`~creditlab.diagnose._tokens.RowStats`); with
``tokens=True`` it also keeps the ragged token columns concatenated into flat arrays with row offsets
(:class:`TokenData`), the texts and the turns, as a library caller may want them. ``steps`` reads a
subset of the steps (:mod:`creditlab.diagnose.steps`); ``executor`` reads the files in parallel with
the labs' executors (``creditlab.lab.runner.make_executor``: a process pool, or Ray).

Every malformed value raises :class:`creditlab.errors.InputError` naming the file, the row (the
line number in JSONL, the row number counted from 1 in parquet) and the column. Missing optional
columns are not errors: the checks that need them are skipped. A file is validated a batch of rows at a
time: in a file with several errors, the one named is the first of the first batch that has one.

verl's own dumps (``trainer.rollout_data_dir`` and ``trainer.validation_data_dir``: one
``{step}.jsonl`` per step with ``input``, ``output``, ``gts``, ``score``, ``step`` and the reward
function's extra fields, whatever their names: ``reward`` included) are recognised by verl's own keys
and mapped onto the schema: ``group`` is the prompt text (``input``; the prompt's uid when the v1
trainer's ``uid`` field ``{uid}_{session}_{output}`` is there), ``reward`` the ``score``,
``response`` the ``output`` and ``response_length`` its length in characters (that format has no
tokens); ``precision`` and ``recall`` come along when the reward function returned them (creditlab's
FORK reward for verl does).

A file is read in the format its bytes are in, whatever its name: gzip (a ``.jsonl`` that is gzip
too), parquet, or JSONL text; another compression (zstd, bzip2, xz, zip) is an input error naming it.

Runs stay apart: the input is one training run. Two files, or two directories given, that start at the
same step and hold the same group at two or more steps are two runs (a lab's ``--dump`` directory holds
one file per arm and seed; one run writes a step's groups once, and a run resumed from a checkpoint
starts later than the rows it rewrites): an input error naming them and how to diagnose each alone.
Files whose names differ only in ``rank-<i>`` are one run's processes.

Besides malformed values, these are input errors: a file given twice; a file whose every row is also
in another file, step for step (the same dump twice), naming both; several runs (above); a log-prob above
``LOGPROB_TOL`` on a policy token (probabilities where log-probs belong); a nested list in a token
column; a ``precision`` or ``recall`` outside [0, 1]; a ``process_score`` outside [-1, 1]; verl's
column names in a creditlab-format file; a line that is not JSON and not a row cut off by its writer.
These are warnings (:attr:`Dump.warnings`, shown in the report): what a writer leaves unfinished,
skipped: an empty file, an incomplete last line of the newest file of a directory or of the files
given (a job still writing), a row cut off by its writer at the end of an older file or before rows
appended later (a crashed trainer, resumed: a whole row appended on the cut-off line is read), a gzip
stream that stops early, a gzip member cut off before a later one (every complete row of every member is
read, each cut named with its byte and line), bytes between gzip members that are no gzip data (named,
not read); rows repeating identical rows of the same step written elsewhere (left out); response lengths
in characters in some files and in tokens in others. A gzip file with nothing readable is an input error.
"""

from __future__ import annotations

import bisect
import codecs
import gzip
import hashlib
import io
import itertools
import json
import math
import os
import re
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from creditlab.core.diagnostics import chain_length
from creditlab.diagnose._tokens import (
    DERIVE_TURN,
    MismatchRows,
    RowStats,
    TokenData,
    TurnStats,
    engine_rows,
    mismatch_rows,
    reduce_tokens,
)
from creditlab.diagnose._trl_logs import FORMAT_TRL, from_trl, is_trl
from creditlab.diagnose._trl_logs import not_a_dump as trl_tables
from creditlab.diagnose.schema import (
    COLUMNS,
    ENGINE_SOURCE,
    LEARNER,
    LOGPROB_TOL,
    PROCESS_SCORE_RANGE,
    SHARE_COLUMNS,
    TOKEN_COLUMNS,
    VERL_BYPASS,
    VERL_NAMES,
    is_number,
)
from creditlab.diagnose.steps import StepSelection, describe_steps, parse_steps
from creditlab.errors import ConfigError, CreditlabError, InputError

__all__ = ["CHUNK_BYTES", "DERIVE_TURN", "Dump", "TokenData", "TurnRows", "read_dump", "dump_files"]

Progress = Callable[[str, int, int], None]
"""``progress(what, done, total)``: called as files are read."""

FORMAT_CREDITLAB = "creditlab"
FORMAT_VERL = "verl rollout_data_dir"
_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
_SCALAR_FLOATS = ("response_length", "process_reward", "precision", "recall", "truncated")
_TEXT = ("response", "instruction", "logprobs_source")
CHUNK_BYTES = 1 << 23
"""JSONL text parsed, validated and reduced at a time (8 MiB; a longer line is read whole): what bounds the
reader's memory, with the parquet batches of about ``4 * CHUNK_BYTES`` of column data."""

try:  # parsed about 5x faster when installed; the same values (both parse numbers exactly), and a line it
    # refuses (NaN, Infinity, huge integers, lone surrogates) goes to json, which reads or names it as before
    import orjson as _orjson
except ImportError:  # pragma: no cover - orjson is optional
    _orjson = None


def _loads(line: str) -> Any:
    if _orjson is not None:
        try:
            obj = _orjson.loads(line)
        except _orjson.JSONDecodeError:
            return json.loads(line)
        # orjson reads integers beyond 64 bits as floats, json as integers: a step or group that large is read
        # by json, so that it keeps its value
        if not (isinstance(obj, dict) and any(isinstance(obj.get(k), float) and abs(obj[k]) >= 2.0 ** 63
                                              for k in ("step", "group"))):
            return obj
    return json.loads(line)


@dataclass
class TurnRows:
    """The ``turns`` column of ``N`` rows reduced to what ``credit.coverage``, ``credit.mixing`` and
    ``reward.process_hacking`` read."""

    present: np.ndarray      # bool: the row has turns (not null)
    calls: np.ndarray        # float: number of turns, NaN where null
    chain: np.ndarray        # int64: chain length C by dataflow (core.diagnostics.chain_length), -1 without turns
    writes: np.ndarray       # int64: turns that write
    scored: np.ndarray       # int64: turns with a process_score
    pos_half: np.ndarray     # int64: process scores > 0.5
    neg_half: np.ndarray     # int64: ... <= 0.5
    pos_zero: np.ndarray     # int64: ... > 0
    neg_zero: np.ndarray     # int64: ... <= 0
    score_min: np.ndarray    # float: smallest process score (inf: none)
    score_max: np.ndarray    # float: largest (-inf: none)
    errors: dict[int, str] = field(default_factory=dict)  # row -> why chain_length could not read its turns

    def take(self, keep: np.ndarray) -> TurnRows:
        new = np.cumsum(keep) - 1
        return TurnRows(**{f.name: getattr(self, f.name)[keep] for f in fields(self) if f.name != "errors"},
                        errors={int(new[i]): e for i, e in self.errors.items() if keep[i]})

    @staticmethod
    def concat(parts: list[TurnRows | None], sizes: list[int]) -> TurnRows:
        parts = [p if p is not None else TurnRows.none(n) for p, n in zip(parts, sizes, strict=True)]
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int)
        return TurnRows(**{f.name: np.concatenate([getattr(p, f.name) for p in parts])
                           for f in fields(TurnRows) if f.name != "errors"},
                        errors={int(s) + i: e for p, s in zip(parts, starts, strict=True) for i, e in p.errors.items()})

    @staticmethod
    def none(n: int) -> TurnRows:
        """``n`` rows without turns."""
        def z() -> np.ndarray:
            return np.zeros(n, dtype=np.int64)

        return TurnRows(np.zeros(n, dtype=bool), np.full(n, np.nan), np.full(n, -1, dtype=np.int64), z(), z(), z(),
                        z(), z(), z(), np.full(n, np.inf), np.full(n, -np.inf))


def _calls(turns: list[dict]) -> list[dict]:
    return [{"name": t["tool"], "arguments": t["args"], "returned": t["returned"], "is_write": t["is_write"]}
            for t in turns]


def _turn_rows(turns: list[list[dict] | None], instructions: list[str | None] | None) -> TurnRows:
    """The :class:`TurnRows` of validated ``turns`` (the chain lengths with each row's instruction)."""
    n = len(turns)
    out = TurnRows.none(n)
    for i, ts in enumerate(turns):
        if ts is None:
            continue
        out.present[i] = True
        out.calls[i] = len(ts)
        if not ts:
            continue
        try:
            out.chain[i] = chain_length(_calls(ts), (instructions[i] or "") if instructions else "")
        except InputError as err:
            out.errors[i] = str(err)
        out.writes[i] = sum(t["is_write"] for t in ts)
        scores = [t["process_score"] for t in ts if t.get("process_score") is not None]
        out.scored[i] = len(scores)
        if scores:
            out.pos_half[i] = sum(s > 0.5 for s in scores)
            out.neg_half[i] = sum(s <= 0.5 for s in scores)
            out.pos_zero[i] = sum(s > 0 for s in scores)
            out.neg_zero[i] = sum(s <= 0 for s in scores)
            out.score_min[i], out.score_max[i] = min(scores), max(scores)
    return out


@dataclass
class Dump:
    """Rows of one or more dump files. ``N`` trajectories; their tokens reduced per row (``rows``), and kept
    whole only when read with ``tokens=True`` (``tokens``, ``texts``, ``turns``)."""

    files: list[str]
    formats: list[str]               # per file: "creditlab" or "verl rollout_data_dir"
    row_file: np.ndarray             # (N,) index into files
    row_number: np.ndarray           # (N,) line (JSONL) or row (parquet, from 1) in its file
    step: np.ndarray                 # (N,) int64
    group: np.ndarray                # (N,) int64 codes of the group labels
    group_labels: list[Any]          # label of each code
    reward: np.ndarray               # (N,) float64
    rows: RowStats | None = None     # (N,) the token columns reduced per row; None when no file has them
    turn_stats: TurnStats | None = None  # per (row, turn) sums over usable policy tokens
    scalars: dict[str, np.ndarray] = field(default_factory=dict)  # (N,) float64, NaN = missing
    response_chars: np.ndarray | None = None  # (N,) characters of response (NaN: null); None: no file has it
    sources: list[str | None] | None = None   # (N,) logprobs_source; None: no file has the column
    instruction: np.ndarray | None = None     # (N,) bool: the row has an instruction; None: no file has the column
    turn_rows: TurnRows | None = None         # (N,) the turns reduced per row; None: no file has turns
    token_columns: frozenset[str] = frozenset()  # the optional token columns a file has: turn_ids, rejected
    tokens: TokenData | None = None  # with tokens=True: the token columns (None when no file has them)
    texts: dict[str, list[str | None]] = field(default_factory=dict)  # with tokens=True
    turns: list[list[dict] | None] | None = None  # with tokens=True
    warnings: list[str] = field(default_factory=list)  # about the input, one sentence each (report, json)
    length_units: list[str | None] = field(default_factory=list)  # per file: unit of response_length
    reward_sources: list[str] = field(default_factory=list)  # per file: the column(s) the reward is
    steps_selection: str | None = None  # --steps, as given (None: every step was read)
    steps_not_read: list[int] = field(default_factory=list)  # steps of the input left out by the selection

    def __len__(self) -> int:
        return int(self.step.shape[0])

    @property
    def n_tokens(self) -> int:
        return 0 if self.rows is None else int(self.rows.tokens.sum())

    @property
    def n_policy_tokens(self) -> int:
        return 0 if self.rows is None else int(self.rows.policy.sum())

    def has(self, column: str) -> bool:
        """Whether ``column`` holds a value in at least one row."""
        if column in ("step", "group", "reward"):
            return len(self) > 0
        if column in TOKEN_COLUMNS:
            return self.rows is not None and bool(self.rows.has_tokens.any())
        if column in ("turn_ids", "rejected"):
            return self.rows is not None and column in self.token_columns
        if column in self.scalars:
            return bool(np.isfinite(self.scalars[column]).any())
        if column == "response":
            return self.response_chars is not None and bool(np.isfinite(self.response_chars).any())
        if column == "instruction":
            return self.instruction is not None and bool(self.instruction.any())
        if column == "logprobs_source":
            return self.sources is not None and any(v is not None for v in self.sources)
        if column == "turns":
            return self.turn_rows is not None and bool(self.turn_rows.present.any())
        return False

    def where(self, i: int) -> str:
        """``file: line N`` (or ``row N``) of trajectory ``i``."""
        f = int(self.row_file[i])
        unit = "row" if self.files[f].endswith(".parquet") else "line"
        return f"{self.files[f]}: {unit} {int(self.row_number[i])}"

    def mismatch(self) -> MismatchRows:
        """The rows' token sums with copied files left out (:func:`~creditlab.diagnose._tokens.mismatch_rows`);
        the dump must have token columns."""
        assert self.rows is not None and self.turn_stats is not None
        return mismatch_rows(self.rows, self.turn_stats, self.row_file, len(self.files),
                             "rejected" in self.token_columns)


# ------------------------------------------------------------------------------------------------
# files
# ------------------------------------------------------------------------------------------------


def _natural(p: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]


def _dump_files(paths: Sequence[str | os.PathLike]) -> list[tuple[Path, int]]:
    """The dump files behind ``paths`` with their group: the index of the directory argument they
    came from, or -1 for files given directly. A file reached twice is an error."""
    if not paths:
        raise InputError("no dump given")
    out: list[tuple[Path, int]] = []
    seen: dict[Path, str] = {}

    def add(q: Path, group: int, arg: str) -> None:
        key = q.resolve()
        if key in seen:
            how = f" (as '{seen[key]}' and '{arg}')" if seen[key] != arg else ""
            raise InputError(f"{q}: given twice{how}: its rows would count twice; pass each dump once")
        seen[key] = arg
        out.append((q, group))

    for g, p in enumerate(map(Path, paths)):
        if p.is_dir():
            found = sorted((q for q in p.iterdir() if q.is_file() and q.name.endswith(_SUFFIXES)), key=_natural)
            if not found:
                raise InputError(trl_tables(p) or f"{p}: directory holds no .jsonl, .jsonl.gz or .parquet file")
            for q in found:
                add(q, g, str(p))
        elif p.is_file():
            if not p.name.endswith(_SUFFIXES):
                raise InputError(trl_tables(p) or
                                 f"{p}: not a dump (expected .jsonl, .jsonl.gz, .parquet or a directory of them)")
            add(p, -1, str(p))
        else:
            raise InputError(f"{p}: no such file or directory")
    return out


def dump_files(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """The dump files behind ``paths``: files as given, directories expanded to their ``*.jsonl``,
    ``*.jsonl.gz`` and ``*.parquet`` files (not recursive, in natural order: ``2.jsonl`` before
    ``10.jsonl``). A file reached twice (given twice, or given and inside a directory given) is an
    error."""
    return [f for f, _ in _dump_files(paths)]


def _newest(files: list[tuple[Path, int]]) -> set[int]:
    """Indices of the files that a job may still be writing: the most recently modified file of each
    directory given, and of the files given directly."""
    best: dict[int, tuple[int, int]] = {}
    for i, (f, g) in enumerate(files):
        t = f.stat().st_mtime_ns
        if g not in best or t >= best[g][0]:
            best[g] = (t, i)
    return {i for _, i in best.values()}


def _step_file(path: Path) -> int | None:
    """The step of a verl ``rollout_data_dir`` file (``{step}.jsonl``, one step per file) whose first row is
    verl's and of that step, else None: such a file need not be read to leave it out of a step selection."""
    m = re.fullmatch(r"(\d+)\.jsonl", path.name)
    if m is None:
        return None
    try:
        with open(path, "rb") as fh:
            head = fh.readline(1 << 20)
        first = json.loads(head)
    except (OSError, ValueError, RecursionError):
        return None
    if isinstance(first, dict) and _is_verl(set(first)) and first.get("step") == int(m[1]) \
            and type(first.get("step")) is int:
        return int(m[1])
    return None


@dataclass(frozen=True)
class _FileCell:
    """One file to read, as a cell of the labs' executors (:mod:`creditlab.lab.runner`: ``key``, ``name`` and
    ``run()``, which returns one row: the file's part, or what it raised)."""

    group: str
    name: str
    key: str
    kwargs: dict

    def run(self) -> list[dict]:
        return [_read_file_task(**self.kwargs)]


def _read_file_task(path: str, live: bool, reward_columns: Sequence[str] | None, keep: bool,
                    steps: StepSelection | None) -> dict:
    """:func:`_read_file` in a worker: its part, or the error it raised as plain values (an exception with its
    own arguments does not always survive pickling), raised again by the driver in file order."""
    try:
        return {"part": _read_file(Path(path), None, live=live, reward_columns=reward_columns, keep=keep,
                                   steps=steps)}
    except _Skipped as skip:
        return {"skipped": (str(skip), skip.error)}
    except ConfigError as err:
        return {"error": ("config", err.parameter, err.message)}
    except CreditlabError as err:
        return {"error": (type(err).__name__, str(err), "")}


def _raise_again(out: dict) -> _Part:
    """The part of a task's row, or its error raised again."""
    if "part" in out:
        return out["part"]
    if "skipped" in out:
        raise _Skipped(*out["skipped"])
    kind, a, b = out["error"]
    if kind == "config":
        raise ConfigError(a, b)
    raise InputError(a)


def read_dump(paths: str | os.PathLike | Sequence[str | os.PathLike], *,
              progress: Progress | None = None, reward_columns: Sequence[str] | None = None, tokens: bool = True,
              steps: str | StepSelection | None = None, executor: Any = None) -> Dump:
    """Read and validate one or more dumps (files or directories) into one :class:`Dump`.
    ``reward_columns``: the reward-function columns of TRL's completion tables (``NAME`` or
    ``NAME=WEIGHT``), when TRL's layout and advantage cannot tell them (``--reward-column``).

    ``tokens``: keep every row's token columns, texts and turns (:attr:`Dump.tokens`, ``texts``, ``turns``);
    False reads in bounded memory, keeping only their per-row reductions, all the checks use (what
    ``creditlab diagnose`` does). ``steps``: read only these steps (``"0:100:10"``, ``"every:10"``:
    :mod:`creditlab.diagnose.steps`). ``executor``: read the files in parallel on one of the labs'
    executors (``creditlab.lab.runner.make_executor(workers)``; a process pool or Ray); the dump is the
    same as read serially.

    Input errors raise :class:`creditlab.errors.InputError`; what the checks should know about the
    input but can work around lands in :attr:`Dump.warnings`.
    """
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    selection = parse_steps(steps) if isinstance(steps, str) else steps
    grouped = _dump_files(paths)
    files = [f for f, _ in grouped]
    live = _newest(grouped)
    sizes = [f.stat().st_size for f in files]
    total = sum(sizes)
    not_read: set[int] = set()
    todo = []
    for k, f in enumerate(files):
        s = _step_file(f) if selection is not None else None
        if s is not None and s not in selection:
            not_read.add(s)  # a verl file of a step not selected: not read
        else:
            todo.append(k)
    results: dict[int, Callable[[], _Part]] = {}
    if executor is not None and len(todo) > 1:
        cells = [_FileCell("diagnose", files[k].name, f"diagnose/{k}/{files[k]}",
                           {"path": str(files[k]), "live": k in live, "reward_columns": reward_columns, "keep": tokens,
                            "steps": selection}) for k in todo]
        index = {c.key: k for c, k in zip(cells, todo, strict=True)}
        done = 0
        for cell, out in executor.submit_all(cells):
            k = index[cell.key]
            results[k] = (lambda o=out[0]: _raise_again(o))
            done += sizes[k]
            if progress is not None:
                progress(f"read {files[k].name}", done, total)
    parts, kept, skipped = [], [], []
    kept_groups: list[int] = []
    done = 0
    for k, f in enumerate(files):
        size = sizes[k]
        if k not in todo:
            done += size
            continue
        tick = None
        if progress is not None and k not in results:
            def tick(n: int, f=f, base=done, size=size) -> None:  # within a file, by bytes read
                progress(f"read {f.name}", base + min(n, size), total)
        try:
            part = results[k]() if k in results else _read_file(f, tick, live=k in live, reward_columns=reward_columns,
                                                                keep=tokens, steps=selection)
        except _Skipped as skip:  # empty, or nothing but a cut-off line: what a writer left unfinished
            if len(files) == 1:
                raise InputError(skip.error) from None
            skipped.append(str(skip))
            part = None
        done += size
        if progress is not None and k not in results:
            progress(f"read {f.name}", done, total)
        if part is None:
            continue
        not_read |= part.steps_not_read
        if part.n == 0:  # every row of the file is at a step not selected
            continue
        parts.append(part)
        kept.append(f)
        kept_groups.append(grouped[k][1])
    if not parts:
        if selection is not None and not_read:
            raise ConfigError("--steps", f"{selection.text!r} selects none of the steps in the input "
                                         f"({describe_steps(not_read)})")
        raise InputError(f"no complete row in the input: {' '.join(skipped)}")
    keys = list(itertools.chain.from_iterable(p.keys for p in parts))
    dump = _concat([str(f) for f in kept], parts)
    dump.warnings[:0] = skipped
    if selection is not None:
        dump.steps_selection = selection.text
        dump.steps_not_read = sorted(not_read - set(np.unique(dump.step).tolist()))
    _same_dump_twice(dump, keys)
    _separate_runs(dump, kept_groups, [str(p) for p in paths])
    dump = _drop_repeated_rows(dump, keys)
    _check_length_units(dump)
    return dump


# ------------------------------------------------------------------------------------------------
# one file -> a part
# ------------------------------------------------------------------------------------------------


class _PartTokens(NamedTuple):
    """Token columns flattened over rows (``offsets`` ``(n + 1,)`` into the rest)."""

    offsets: np.ndarray
    logprobs: np.ndarray
    rollout_logprobs: np.ndarray
    policy_mask: np.ndarray
    turn_ids: np.ndarray | None
    rejected: np.ndarray | None


@dataclass
class _Rows:
    """A batch of validated rows of one file."""

    fmt: str
    n: int
    row_number: np.ndarray
    step: np.ndarray
    group: list[Any]
    reward: np.ndarray
    tokens: _PartTokens | None
    scalars: dict[str, np.ndarray]
    texts: dict[str, list[str | None]]
    turns: list[list[dict] | None] | None
    warnings: list[str] = field(default_factory=list)
    length_unit: str | None = None  # of response_length: "tokens", "characters", None without the column
    reward_source: str = "column reward"  # the column(s) the reward is


@dataclass
class _Part:
    """One file, read: its rows' trajectory columns and token reductions (and, kept, their tokens)."""

    fmt: str
    n: int
    row_number: np.ndarray
    step: np.ndarray
    group: list[Any]
    reward: np.ndarray
    rows: RowStats | None                # None: the file has no token columns
    turn_stats: TurnStats | None
    scalars: dict[str, np.ndarray]
    response_chars: np.ndarray | None
    sources: list[str | None] | None
    instruction: np.ndarray | None
    turn_rows: TurnRows | None
    token_columns: set[str]
    keys: list[bytes]                    # a digest of each row's values but its step (repeated rows)
    tokens: _PartTokens | None = None    # kept
    texts: dict[str, list[str | None]] = field(default_factory=dict)  # kept
    turns: list[list[dict] | None] | None = None  # kept
    warnings: list[str] = field(default_factory=list)
    length_unit: str | None = None
    reward_source: str = "column reward"
    steps_not_read: set[int] = field(default_factory=set)


class _Where:
    """Names a row of a file in error messages."""

    def __init__(self, path: Path, unit: str, numbers: np.ndarray):
        self.path, self.unit, self.numbers = path, unit, numbers

    def __call__(self, i: int, column: str) -> str:
        return f"{self.path}: {self.unit} {int(self.numbers[i])}: column '{column}'"


_MAGIC = ((b"\x1f\x8b", "gzip"), (b"PAR1", "parquet"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"BZh", "bzip2"),
          (b"\xfd7zXZ\x00", "xz"), (b"PK\x03\x04", "zip"))
"""Leading bytes of the formats a dump file may really be in, whatever its name says."""
_DECOMPRESS = {"zstd": "zstd -d", "bzip2": "bunzip2", "xz": "unxz", "zip": "unzip"}


def _sniff(path: Path) -> str | None:
    """What ``path`` holds by its first bytes: "gzip", "parquet", another compression, "empty" (nothing
    but white space), or None (text)."""
    with open(path, "rb") as fh:
        head = fh.read(512)
    for magic, kind in _MAGIC:
        if head.startswith(magic):
            return kind
    return "empty" if not head.strip() and len(head) < 512 else None


class _Skipped(InputError):
    """A file that holds no row but what a writer left unfinished: nothing (empty), or only a cut-off
    first line. Skipped with a warning when the input has other files, an error when it is the input."""

    def __init__(self, warning: str, error: str):
        super().__init__(warning)
        self.error = error


def _read_file(path: Path, tick: Callable[[int], None] | None, *, live: bool = False,
               reward_columns: Sequence[str] | None = None, keep: bool = False,
               steps: StepSelection | None = None) -> _Part:
    """One file, read in the format its bytes are in (a gzip file named ``.jsonl`` is read as gzip, a
    plain one named ``.jsonl.gz`` as text, a parquet file under a JSONL name as parquet). ``keep``: keep the
    token columns, texts and turns; ``steps``: the rows of other steps are left out (the part's
    ``steps_not_read``)."""
    try:
        kind = _sniff(path)
    except OSError as err:
        raise InputError(f"{path}: cannot be read ({err.strerror or err})") from None
    if kind == "empty":
        why = ("the newest file of the input, probably just created by a job that has not written its first row"
               if live else "its writer wrote no row (e.g. it stopped before the first)")
        raise _Skipped(f"{path} is empty and was skipped: {why}.",
                       f"{path}: holds no rows (the file is empty): nothing to diagnose; pass a dump with rows")
    if kind in _DECOMPRESS:
        raise InputError(f"{path}: is {kind}-compressed, which diagnose does not read: decompress it "
                         f"({_DECOMPRESS[kind]} {path.name}), or compress it with gzip as a .jsonl.gz file")
    if kind == "parquet" or (path.name.endswith(".parquet") and kind is None and not _starts_like_json(path)):
        # (not parquet, not JSONL: the parquet reader's error names it)
        return _read_parquet(path, reward_columns, keep=keep, steps=steps)
    return _read_jsonl(path, tick, live=live, gz=kind == "gzip", keep=keep, steps=steps)


_TOKEN_ORDER = (*TOKEN_COLUMNS, "turn_ids", "rejected")
"""The token columns in the order a batch validates them."""


class _BadLogprob(Exception):
    """A log-prob above ``LOGPROB_TOL`` on a policy token: the file is counted to its end before the error."""


@dataclass
class _LogprobCount:
    bad: int = 0
    policy: int = 0
    unit: bool = True  # every policy value in [0, 1]
    first: tuple[str, int, float] | None = None  # where, element, value of the first bad one


class _LogprobCheck:
    """Log-probs are <= 0: a value above ``LOGPROB_TOL`` on a policy token is an error naming the first, with
    the counts of its whole file (the batches after the first bad one are only counted)."""

    def __init__(self) -> None:
        self.counts = {name: _LogprobCount() for name in ("logprobs", "rollout_logprobs")}
        self.failed = False

    def check(self, a: np.ndarray, policy: np.ndarray, lengths: Sequence[int], name: str, where: _Where | None,
              *, stop: bool = True) -> None:
        c = self.counts[name]
        with np.errstate(invalid="ignore"):
            bad = policy & (a > LOGPROB_TOL)
        on = a[policy & ~np.isnan(a)]
        c.policy += int(on.size)
        c.unit &= bool(((on >= 0) & (on <= 1)).all())
        if not bad.any():
            return
        c.bad += int(bad.sum())
        if c.first is None and where is not None:
            k = int(np.flatnonzero(bad)[0])
            i, j = _first_row(list(lengths), k)
            c.first = (where(i, name), j, float(a[k]))
        self.failed = True
        if stop:
            raise _BadLogprob

    def count(self, batch: Iterable[tuple[Any, Any, Any]]) -> None:
        """Count the rows ``(logprobs, rollout_logprobs, policy_mask)`` of a batch after the first bad value
        (only the counts of the error message; a row that cannot be read is passed over)."""
        lp, rlp, pm = [], [], []
        for a, b, m in batch:
            try:
                a, b, m = (np.asarray(a, dtype=np.float64).reshape(-1), np.asarray(b, dtype=np.float64).reshape(-1),
                           np.asarray(m, dtype=bool).reshape(-1))
            except (TypeError, ValueError):
                continue
            if a.shape == b.shape == m.shape:
                lp.append(a)
                rlp.append(b)
                pm.append(m)
        if lp:
            policy = np.concatenate(pm)
            for name, x in (("logprobs", lp), ("rollout_logprobs", rlp)):
                self.check(np.concatenate(x), policy, [], name, None, stop=False)

    def error(self) -> InputError:
        for c in self.counts.values():
            if c.first is not None:
                where, j, value = c.first
                what = ("the column looks like probabilities (every policy value in [0, 1]): write their log"
                        if c.unit else "log-probs are <= 0")
                return InputError(f"{where}: element {j} is {value!r} on a policy token, above {LOGPROB_TOL:g} "
                                  f"({c.bad:,} of {c.policy:,} policy tokens of this file are): {what}")
        raise AssertionError("no bad log-prob recorded")  # pragma: no cover


_NAN = np.float64(np.nan).tobytes()


def _keys(b: _Rows) -> list[bytes]:
    """A digest of every value of each row of ``b`` but its step: equal for rows equal in every column (a
    column a file lacks counts as null, an absent ``rejected`` as all false, as the readers fill them)."""
    t = b.tokens
    scalars = [b.scalars.get(name) for name in sorted(_SCALAR_FLOATS)]
    texts = [b.texts.get(name) for name in sorted(_TEXT)]
    out = []
    for i in range(b.n):
        h = hashlib.blake2b(digest_size=16)
        g = b.group[i]
        h.update(repr((type(g).__name__, g, float(b.reward[i]))).encode())
        if t is not None:
            a, e = int(t.offsets[i]), int(t.offsets[i + 1])
            for arr in (t.logprobs, t.rollout_logprobs, t.policy_mask):
                h.update(arr[a:e].tobytes())
            if t.turn_ids is not None:
                h.update(t.turn_ids[a:e].tobytes())
            if t.rejected is not None and t.rejected[a:e].any():
                h.update(t.rejected[a:e].tobytes())
        for s in scalars:
            h.update(_NAN if s is None else s[i].tobytes())
        for v in texts:
            h.update(repr(None if v is None else v[i]).encode())
        h.update(json.dumps(None if b.turns is None else b.turns[i], sort_keys=True, default=str).encode())
        out.append(h.digest())
    return out


class _FileRows:
    """The rows of one file, one validated batch at a time: each reduced at once (:func:`reduce_tokens`), its
    token columns, texts and turns kept only with ``keep``."""

    def __init__(self, path: Path, keep: bool, steps: StepSelection | None):
        self.path, self.keep, self.steps = path, keep, steps
        self.batches: list[dict[str, Any]] = []
        self.fmt: str | None = None
        self.names: set[str] = set()
        self.token_columns: set[str] | None = None
        self.first_line = 0
        self.logprobs = _LogprobCheck()
        self.steps_not_read: set[int] = set()
        self.optional: set[str] = set()  # turn_ids, rejected: the optional token columns the file has
        self.n = 0

    # -- JSONL ----------------------------------------------------------------------------------------

    def add_lines(self, rows: list[dict], numbers: list[int]) -> None:
        """A batch of JSONL rows (``numbers``: their lines)."""
        if self.steps is not None:
            sel = [i for i, r in enumerate(rows) if self._selected(r.get("step"))]
            if len(sel) < len(rows):
                rows, numbers = [rows[i] for i in sel], [numbers[i] for i in sel]
        if not rows:
            return
        if self.logprobs.failed:
            self.logprobs.count((r.get("logprobs"), r.get("rollout_logprobs"), r.get("policy_mask")) for r in rows)
            return
        where = _Where(self.path, "line", np.asarray(numbers))
        names: set[str] = set()
        for r in rows:
            names.update(r)
        self._same_layout(names, where, numbers[0])

        def values(name: str) -> list[Any] | None:
            return [r.get(name) for r in rows] if name in names else None

        def flat(name: str) -> tuple[list[Any], list[int]] | None:
            if name not in names:
                return None
            vals = []
            for i, r in enumerate(rows):
                v = r.get(name)
                if not isinstance(v, list):
                    if name not in r:
                        raise InputError(f"{where(i, name)}: missing here, present in other rows (a file has a token "
                                         "column in every row or in none)")
                    got = "nothing" if v is None else type(v).__name__
                    raise InputError(f"{where(i, name)}: expected a list, got {got}")
                vals.append(v)
            return list(itertools.chain.from_iterable(vals)), [len(v) for v in vals]

        if self.fmt == FORMAT_VERL:
            self.add(_from_verl(rows, where))
            return
        try:
            self.add(_build(FORMAT_CREDITLAB, len(rows), where, names.__contains__, values, flat, self.logprobs))
        except _BadLogprob:
            pass  # counted to the end of the file, then raised (finish)

    def _selected(self, step: Any) -> bool:
        """Whether a row at ``step`` is read (a step that is not an integer is, so that it is named as an error)."""
        if is_number(step) and math.isfinite(float(step)) and float(step) == int(step):
            if int(step) in self.steps:
                return True
            self.steps_not_read.add(int(step))
            return False
        return True

    def _same_layout(self, names: set[str], where: _Where, first: int) -> None:
        """The first batch sets the file's format and token columns; a later batch must agree (a file is
        validated as one: a token column is in every row or in none)."""
        tokens = {c for c in _TOKEN_ORDER if c in names}
        if self.fmt is None:
            self.fmt = FORMAT_VERL if _is_verl(names) else FORMAT_CREDITLAB
            self.token_columns, self.first_line = tokens, first
            self.names = set(names)
            return
        self.names |= names
        if _is_verl(self.names) != (self.fmt == FORMAT_VERL):
            other = FORMAT_VERL if self.fmt != FORMAT_VERL else FORMAT_CREDITLAB
            raise InputError(f"{self.path}: line {first}: the rows from here on read as {other} and the rows before "
                             f"as {self.fmt}: a file holds rows of one format; split it")
        if self.fmt == FORMAT_VERL or tokens == self.token_columns:
            return
        name = next(c for c in _TOKEN_ORDER if c in tokens ^ self.token_columns)
        line = first if name in self.token_columns else self.first_line  # the first row without it
        raise InputError(f"{self.path}: line {line}: column '{name}': missing here, present in other rows (a file "
                         "has a token column in every row or in none)")

    # -- every format ---------------------------------------------------------------------------------

    def add(self, b: _Rows) -> None:
        """A batch of validated rows: reduced, and kept with ``keep``."""
        if self.steps is not None and self.fmt != FORMAT_CREDITLAB:  # verl, TRL: selected after validation
            sel = self.steps.mask(b.step)
            self.steps_not_read.update(np.unique(b.step[~sel]).tolist())
            if not sel.all():
                b = _take_rows(b, sel)
        if b.n == 0:
            return
        sources = b.texts.get("logprobs_source")
        rows = turn_stats = None
        if b.tokens is not None:
            t = b.tokens
            self.optional |= {c for c, a in (("turn_ids", t.turn_ids), ("rejected", t.rejected)) if a is not None}
            td = TokenData(t.offsets, t.logprobs, t.rollout_logprobs, t.policy_mask, t.turn_ids,
                           np.ones(b.n, dtype=bool), t.rejected)
            rows, turn_stats = reduce_tokens(td, engine_rows(sources, td.has_tokens))
        resp = b.texts.get("response")
        instr = b.texts.get("instruction")
        self.batches.append({
            "rows": b, "stats": rows, "turn_stats": turn_stats, "keys": _keys(b),
            "response_chars": None if resp is None else
            np.asarray([np.nan if r is None else len(r) for r in resp], dtype=np.float64),
            "instruction": None if instr is None else np.asarray([v is not None for v in instr], dtype=bool),
            "turn_rows": None if b.turns is None else _turn_rows(b.turns, instr),
        })
        self.n += b.n
        if not self.keep:  # what the checks need is reduced: the batch's columns can go
            b.tokens, b.texts, b.turns = None, {k: v for k, v in b.texts.items() if k == "logprobs_source"}, None

    def finish(self, warnings: list[str]) -> _Part:
        """The file's part (a file whose every row was left out by the step selection has ``n`` 0)."""
        if self.logprobs.failed:
            raise self.logprobs.error()
        bs = self.batches
        first: _Rows | None = bs[0]["rows"] if bs else None
        sizes = [x["rows"].n for x in bs]

        def cat(key: str, fill: Callable[[int], Any]) -> Any:
            got = [x[key] for x in bs]
            if all(g is None for g in got):
                return None
            return np.concatenate([g if g is not None else fill(n) for g, n in zip(got, sizes, strict=True)])

        scalars: dict[str, np.ndarray] = {}
        for name in _SCALAR_FLOATS:
            if any(name in x["rows"].scalars for x in bs):
                scalars[name] = np.concatenate([x["rows"].scalars.get(name, np.full(x["rows"].n, np.nan)) for x in bs])
        sources = None
        if any("logprobs_source" in x["rows"].texts for x in bs):
            sources = list(itertools.chain.from_iterable(x["rows"].texts.get("logprobs_source", [None] * x["rows"].n)
                                                         for x in bs))
        has_tokens = first is not None and bs[0]["stats"] is not None
        rows = RowStats.concat([x["stats"] for x in bs]) if has_tokens else None
        turn_stats = TurnStats.concat([x["turn_stats"] for x in bs], list(np.cumsum([0] + sizes[:-1]))) \
            if has_tokens else None
        response_chars = cat("response_chars", lambda n: np.full(n, np.nan))
        part = _Part(
            fmt=first.fmt if first is not None else (self.fmt or FORMAT_CREDITLAB), n=self.n,
            row_number=np.concatenate([x["rows"].row_number for x in bs]) if bs else np.zeros(0, dtype=np.int64),
            step=np.concatenate([x["rows"].step for x in bs]) if bs else np.zeros(0, dtype=np.int64),
            group=list(itertools.chain.from_iterable(x["rows"].group for x in bs)),
            reward=np.concatenate([x["rows"].reward for x in bs]) if bs else np.zeros(0),
            rows=rows, turn_stats=turn_stats, scalars=scalars, response_chars=response_chars, sources=sources,
            instruction=cat("instruction", lambda n: np.zeros(n, dtype=bool)),
            turn_rows=TurnRows.concat([x["turn_rows"] for x in bs], sizes)
            if any(x["turn_rows"] is not None for x in bs) else None,
            token_columns=set(self.optional), keys=list(itertools.chain.from_iterable(x["keys"] for x in bs)),
            warnings=list(warnings), steps_not_read=self.steps_not_read,
            length_unit=first.length_unit if first is not None else None,
            reward_source=first.reward_source if first is not None else "column reward")
        if self.keep and bs:
            part.tokens = _cat_tokens([x["rows"].tokens for x in bs]) if has_tokens else None
            part.texts = {name: list(itertools.chain.from_iterable(x["rows"].texts.get(name, [None] * x["rows"].n)
                                                                   for x in bs))
                          for name in _TEXT if any(name in x["rows"].texts for x in bs)}
            if any(x["rows"].turns is not None for x in bs):
                part.turns = list(itertools.chain.from_iterable(
                    x["rows"].turns if x["rows"].turns is not None else [None] * x["rows"].n for x in bs))
        if part.fmt == FORMAT_CREDITLAB and "response_length" in scalars:
            part.length_unit = _length_unit(scalars["response_length"], None if rows is None else rows.tokens,
                                            response_chars)
        return part


def _cat_tokens(ts: list[_PartTokens]) -> _PartTokens:
    if len(ts) == 1:
        return ts[0]
    lengths = np.concatenate([np.diff(t.offsets) for t in ts])
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])

    def cat(name: str) -> np.ndarray | None:
        got = [getattr(t, name) for t in ts]
        return None if got[0] is None else np.concatenate(got)

    return _PartTokens(offsets, cat("logprobs"), cat("rollout_logprobs"), cat("policy_mask"), cat("turn_ids"),
                       cat("rejected"))


def _take_rows(b: _Rows, keep: np.ndarray) -> _Rows:
    """The rows of a batch where ``keep`` is True (a batch without token columns: verl's and TRL's)."""
    assert b.tokens is None
    idx = np.flatnonzero(keep)
    return _Rows(b.fmt, int(idx.size), b.row_number[keep], b.step[keep], [b.group[i] for i in idx], b.reward[keep],
                 None, {k: v[keep] for k, v in b.scalars.items()}, {k: [v[i] for i in idx] for k, v in b.texts.items()},
                 None if b.turns is None else [b.turns[i] for i in idx], list(b.warnings), b.length_unit,
                 b.reward_source)


def _starts_like_json(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(64).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"{")


_ROW_START = re.compile(r'\{\s*"')


def _scan(text: str) -> tuple[bool, int]:
    """``(open, start)``: whether ``text`` reads as the start of a JSON object that stops before its end
    (brackets and strings well nested so far, the outer object still open), and where its last token
    (a string, number or literal) starts."""
    stack: list[str] = []
    in_str = esc = False
    start, prev = 0, " "
    for k, c in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
            continue
        if c == '"':
            in_str, start = True, k
        elif c in "{[":
            stack.append("}" if c == "{" else "]")
        elif c in "}]":
            if not stack or stack.pop() != c or (not stack and k < len(text) - 1):
                return False, start
        elif not c.isspace() and c not in ",:" and (prev.isspace() or prev in ",:{["):
            start = k
        prev = c
    return bool(stack) or in_str, start


def _unclosed(text: str) -> bool:
    return _scan(text)[0]


def _cut_off(text: str, err: json.JSONDecodeError) -> bool:
    """A row its writer did not finish: a JSON object whose text ends before the object closes, the
    decoder failing in its last token (a value or key the text stops in)."""
    text = text.rstrip()
    if not text.startswith("{"):
        return False
    unclosed, start = _scan(text)
    return unclosed and err.pos >= start


def _after_cut(text: str) -> tuple[int, dict] | None:
    """``(column, row)`` when ``text`` is a cut-off row followed by a whole one on the same line (a writer
    that stopped mid-row, then rows appended to the file: the first lands after the cut-off text)."""
    text = text.rstrip()
    if not text.startswith("{"):
        return None
    dec = json.JSONDecoder()
    for m in _ROW_START.finditer(text, 1):
        try:
            obj, end = dec.raw_decode(text, m.start())
        except (json.JSONDecodeError, RecursionError):
            continue
        if end == len(text) and isinstance(obj, dict) and _unclosed(text[:m.start()]):
            return m.start(), obj
    return None


_GZ_MAGIC = b"\x1f\x8b\x08"
_GZ_CHUNK = 1 << 16
_GZ_OUT = 1 << 22  # at most this much output per decompress call


def _gz_feed(d: Any, data: bytes) -> Iterator[bytes]:
    """Decompress ``data`` with ``d`` in bounded pieces (until the member ends)."""
    while data and not d.eof:
        out = d.decompress(data, _GZ_OUT)
        data = d.unconsumed_tail
        if out:
            yield out


class _GzLayout(NamedTuple):
    segments: list[tuple[int, int, bool]]  # (start, stop, complete) of each member read; stop: its end or cut
    junk: list[tuple[int, int, str]]        # (start, stop, why) of bytes that are no readable gzip data


def _gzip_layout(buf: bytes) -> _GzLayout:
    """The members of gzip data that may have been cut and appended to (a writer killed mid-member, then
    another appending a new member): each member that decompresses to its end, each one cut off (read up
    to where the next member starts, or to the end of the data), and the bytes between that are none.

    A member is cut off when decompressing it fails or runs out of data before its end: its bytes stop at
    the first later gzip header from which decompressing runs without error to a member's end, to the end
    of the data, or to a later such header (the decompressor of the cut member would read on into the
    next member's bytes as if they were its own, giving garbage, hence the search)."""
    n = len(buf)
    cands = []
    k = buf.find(_GZ_MAGIC)
    while k >= 0:
        cands.append(k)
        k = buf.find(_GZ_MAGIC, k + 1)
    probes: dict[int, tuple[str, int, str]] = {}
    accepted: dict[int, bool] = {}

    def probe(q: int) -> tuple[str, int, str]:
        """("complete", end, ""), ("open", n, "") (ran out of data) or ("error", chunk start, message) of
        decompressing from ``q``, fed in pieces that end at every candidate header."""
        if q in probes:
            return probes[q]
        d = zlib.decompressobj(31)
        i = bisect.bisect_right(cands, q)
        pos, res = q, ("open", n, "")
        while pos < n:
            stop = min(n, pos + _GZ_CHUNK)
            if i < len(cands) and cands[i] < stop:
                stop = cands[i]
                i += 1
            try:
                for _ in _gz_feed(d, buf[pos:stop]):
                    pass
            except zlib.error as err:
                res = ("error", pos, str(err))
                break
            if d.eof:
                res = ("complete", stop - len(d.unused_data), "")
                break
            pos = stop
        probes[q] = res
        return res

    def good(q: int) -> bool:
        """A header at ``q`` starts a member: it decompresses without error to a member's end, to the end
        of the data, or into the bytes of a later member that does."""
        if q not in accepted:
            st, at, _ = probe(q)
            accepted[q] = st != "error" or any(
                good(c) for c in cands[bisect.bisect_right(cands, q):bisect.bisect_right(cands, at)])
        return accepted[q]

    def next_member(after: int, limit: int) -> int | None:
        return next((c for c in cands[bisect.bisect_right(cands, after):bisect.bisect_right(cands, limit)]
                     if good(c)), None)

    segments: list[tuple[int, int, bool]] = []
    junk: list[tuple[int, int, str]] = []
    pos = 0
    while pos < n:
        if buf[pos:pos + 3] == _GZ_MAGIC:
            st, at, msg = probe(pos)
            if st == "complete":
                segments.append((pos, at, True))
                pos = at
                continue
            nxt = next_member(pos, n if st == "open" else at)
            if nxt is not None:
                segments.append((pos, nxt, False))
                pos = nxt
                continue
            if st == "open":
                segments.append((pos, n, False))
                break
            segments.append((pos, at, False))
            junk.append((at, n, f"decompressing member {len(segments)} fails there: {msg}"))
            break
        nxt = next_member(pos, n)
        stop = n if nxt is None else nxt
        if buf[pos:stop].count(0) != stop - pos:  # zero padding after the last member is allowed
            junk.append((pos, stop, "no gzip header there"))
        if nxt is None:
            break
        pos = nxt
    return _GzLayout(segments, junk)


class _ChunkReader(io.RawIOBase):
    """A binary stream over an iterator of bytes."""

    def __init__(self, chunks: Iterator[bytes]):
        self._it, self._buf = chunks, b""

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self._buf:
            nxt = next(self._it, None)
            if nxt is None:
                return 0
            self._buf = nxt
        k = min(len(b), len(self._buf))
        b[:k] = self._buf[:k]
        self._buf = self._buf[k:]
        return k


class _GzRecovered:
    """The rows a gzip file holds around cuts: every member's text, each cut-off member's up to its cut
    (the line it cut off left out as an empty line, so line numbers stay those of the text), in order.
    After a read, ``lines`` holds the line range ``(first, last)`` of each member and ``cut_lines`` the
    line each cut-off member (but the last) left unfinished (0: it ends at a line end)."""

    def __init__(self, path: Path, buf: bytes, layout: _GzLayout):
        self.path, self.buf, self.layout = path, buf, layout
        self.lines: list[tuple[int, int]] = []
        self.cut_lines: dict[int, int] = {}

    def _chunks(self) -> Iterator[bytes]:
        self.lines, self.cut_lines = [], {}
        done = 0  # lines emitted
        segs = self.layout.segments
        for k, (s, e, complete) in enumerate(segs):
            first = done + 1
            d = zlib.decompressobj(31)
            hold = not complete and not self.open_tail(k)  # its unfinished last line is left out
            tail = b""

            def flushed(d=d) -> Iterator[bytes]:  # what a cut member's decompressor still holds
                try:
                    yield d.flush()
                except zlib.error:
                    return

            pieces = _gz_feed(d, self.buf[s:e])
            if not complete:
                pieces = itertools.chain(pieces, flushed())
            for out in pieces:
                if hold:
                    out = tail + out
                    cut = out.rfind(b"\n") + 1
                    out, tail = out[:cut], out[cut:]
                done += out.count(b"\n")
                if out:
                    yield out
            if hold:
                self.cut_lines[k] = done + 1 if tail.strip() else 0
                if tail.strip():
                    done += 1
                    yield b"\n"
            self.lines.append((first, done))

    def open_tail(self, k: int) -> bool:
        """Whether member ``k`` is the last and runs out of data before its end (a writer still writing,
        or one that stopped): the readers' warning for a cut-off gzip stream says so."""
        segs = self.layout.segments
        return k == len(segs) - 1 and not segs[k][2] and segs[k][1] == len(self.buf)

    def open_bytes(self) -> io.BufferedReader:
        return io.BufferedReader(_ChunkReader(self._chunks()), buffer_size=1 << 16)

    def open_text(self) -> io.TextIOWrapper:
        return io.TextIOWrapper(self.open_bytes(), encoding="utf-8")

    def notes(self, numbers: list[int]) -> list[str]:
        """The warnings: each member cut off before a later one, and the bytes no member holds."""
        segs = self.layout.segments
        out = []
        nums = np.asarray(numbers, dtype=np.int64)

        def rows_in(k: int) -> int:
            a, b = self.lines[k] if k < len(self.lines) else (1, 0)
            return int(((nums >= a) & (nums <= b)).sum())

        M = len(segs)
        for k, (s, e, complete) in enumerate(segs):
            if complete or self.open_tail(k):
                continue
            line = self.cut_lines.get(k, 0)
            lost = (f"line {line}, the row the cut falls in, was skipped" if line else
                    "the cut falls at a line end, so no row was cut in two" if self.lines[k][1] >= self.lines[k][0]
                    else "none of its text is in the file")
            if k < M - 1:
                later = sum(rows_in(j) for j in range(k + 1, M))
                out.append(f"{self.path}: gzip member {k + 1} of {M} (bytes {s:,}-{e:,}) is cut off at byte {e:,} "
                           "and followed by a new member (a writer killed mid-write, then another one appending "
                           f"to the file; what the first had not written is not in the file): {lost}; the "
                           f"{rows_in(k):,} rows before the cut and the {later:,} rows after it were read.")
            else:
                out.append(f"{self.path}: gzip member {k + 1} of {M} (bytes {s:,}-{e:,}) cannot be decompressed "
                           f"past byte {e:,}: {lost}; the {rows_in(k):,} rows before it were read.")
        for a, b, why in self.layout.junk:
            out.append(f"{self.path}: bytes {a:,}-{b:,} ({b - a:,} bytes) are not readable gzip data ({why}) and "
                       "were not read: any rows in them are lost (a file damaged on disk, or written into by "
                       "something else).")
        return out


def _gzip_recovered(path: Path) -> _GzRecovered | None:
    """The rows of a gzip file that Python's gzip module cannot read to its end (a cut member, another
    after it, bytes that are no gzip data), or None when every member is whole (what failed was not the
    compression). An input error when no member holds anything readable."""
    buf = path.read_bytes()
    layout = _gzip_layout(buf)
    if not layout.junk and all(c for _, _, c in layout.segments):
        return None
    if not any(e > s for s, e, _ in layout.segments):
        a, b, why = layout.junk[0] if layout.junk else (0, len(buf), "")
        raise InputError(f"{path}: cannot be read: not a readable gzip stream (bytes {a:,}-{b:,}: {why}); "
                         "recompress the rows with gzip, or pass them uncompressed as .jsonl")
    return _GzRecovered(path, buf, layout)


def _bad_utf8(open_bytes: Callable[[], Any]) -> tuple[int, int] | None:
    """``(line, byte)`` of the first byte of a binary stream that is not UTF-8 (None if none is found)."""
    with open_bytes() as fh:
        for n, raw in enumerate(fh, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as err:
                return n, raw[err.start]
    return None


def _lines(numbers: list[int]) -> str:
    head = ", ".join(map(str, numbers[:5]))
    more = f" and {len(numbers) - 5} more" if len(numbers) > 5 else ""
    return f"line {head}" if len(numbers) == 1 else f"lines {head}{more}"

@dataclass
class _Lines:
    """What reading a JSONL text gave besides its rows: how many, and what its writer left unfinished."""

    rows: int = 0  # complete rows, selected or not
    torn: tuple[int, str] | None = None  # an incomplete line, until the next line tells whether it was the last
    cut_mid: list[int] = field(default_factory=list)  # cut-off lines followed by rows written later
    joined: list[int] = field(default_factory=list)   # ... with the first later row on the same line


_STEP_HEAD = re.compile(r'\{"step": (-?\d+)[,}]')
"""How creditlab's writers start a row: a row of a step not selected is passed over without parsing it."""


class _LineParser:
    """The lines of a JSONL text to rows, a batch of lines at a time, with what its writer left unfinished
    (:class:`_Lines`): a line that is not a JSON object is an error naming it, unless it is a row cut off by
    its writer (see :func:`_read_jsonl`)."""

    def __init__(self, path: Path, tick: Callable[[int], None] | None, live: bool, steps: StepSelection | None):
        self.path, self.tick, self.live, self.steps = path, tick, live, steps
        self.got = _Lines()
        self.n = 0
        self.read = 0  # characters, about the bytes of the (uncompressed) file
        self.steps_not_read: set[int] = set()

    def feed(self, lines: Iterable[str]) -> tuple[list[dict], list[int]]:
        got, path, live = self.got, self.path, self.live
        rows: list[dict] = []
        numbers: list[int] = []
        for line in lines:
            self.n += 1
            n = self.n
            self.read += len(line)
            if self.tick is not None and n % 2000 == 0:
                self.tick(self.read)
            if not line.strip():
                continue
            if got.torn is not None:  # the incomplete line was not the last: rows were appended after it
                got.cut_mid.append(got.torn[0])
                got.torn = None
            if n == 1:
                line = line.lstrip("\ufeff")
            if self.steps is not None and line.endswith("\n") and (m := _STEP_HEAD.match(line)) is not None \
                    and int(m[1]) not in self.steps:
                got.rows += 1
                self.steps_not_read.add(int(m[1]))
                continue
            try:
                obj = _loads(line)
            except json.JSONDecodeError as err:
                after = None if live and not line.endswith("\n") else _after_cut(line)
                if after is None:
                    if (live and not line.endswith("\n")) or _cut_off(line, err):
                        got.torn = (n, line)
                        continue
                    raise InputError(f"{path}: line {n}: not valid JSON ({err.msg} at column {err.colno}): each "
                                     "line must be one JSON object (one trajectory); fix or remove that line") from None
                got.joined.append(n)
                obj = after[1]
            except RecursionError:
                raise InputError(f"{path}: line {n}: not valid JSON (nested too deep)") from None
            if not isinstance(obj, dict):
                raise InputError(f"{path}: line {n}: expected a JSON object (one trajectory), got {type(obj).__name__}")
            got.rows += 1
            rows.append(obj)
            numbers.append(n)
        return rows, numbers


def _split_lines(text: str) -> list[str]:
    """``text`` as the lines Python's text mode reads (universal newlines: ``\\r\\n`` and ``\\r`` end a line
    as ``\\n`` does), each with its ``\\n`` but a last one without."""
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    lines = text.split("\n")
    last = lines.pop()
    out = [s + "\n" for s in lines]
    if last:
        out.append(last)
    return out


def _line_batches(fh: Any, size: int | None = None) -> Iterator[list[str]]:
    """The lines of a binary stream of UTF-8 text, about ``size`` bytes at a time (whole lines; a line
    longer than that comes whole). Each block is decoded before any of its lines is given, as Python's text
    mode does: bytes that are not UTF-8 raise ``UnicodeDecodeError`` before the lines around them are read."""
    size = size or CHUNK_BYTES
    dec = codecs.getincrementaldecoder("utf-8")()
    pending = ""
    while True:
        block = fh.read(size)
        if not block:
            break
        text = pending + dec.decode(block)
        cut = text.rfind("\n") + 1
        if cut == 0:
            pending = text
            continue
        pending = text[cut:]
        yield _split_lines(text[:cut])
    tail = pending + dec.decode(b"", final=True)
    if tail:
        yield _split_lines(tail)


def _read_jsonl(path: Path, tick: Callable[[int], None] | None = None, *, live: bool = False,
                gz: bool = False, keep: bool = False, steps: StepSelection | None = None) -> _Part:
    """Rows of a JSONL file (``gz``: gzip-compressed), read and validated a batch of lines at a time. A line
    its writer did not finish (an incomplete JSON object) is skipped with a warning saying why it is there:
    the last line of the newest file (``live``: a job still writing; any incomplete last line there), the
    last line of an older file (a writer that stopped mid-row), or a line followed by rows appended later (a
    crashed writer, then a resumed one; a whole row appended on the cut-off line is read). Any other line
    that is not a JSON object is an error naming it.

    A gzip file whose compressed stream is cut off is read up to the cut; one cut and then appended to
    (a new gzip member after the cut-off one), or holding bytes that are no gzip data, is read member by
    member (:func:`_gzip_layout`): every complete row of every member, with a warning naming each cut,
    the line it cut off and the bytes that could not be read."""
    warnings: list[str] = []
    stream_cut = False
    rec: _GzRecovered | None = None

    def open_bytes():
        if rec is not None:
            return rec.open_bytes()
        return gzip.open(path, "rb") if gz else open(path, "rb")

    def read(fh: Any) -> tuple[_LineParser, _FileRows]:
        parser = _LineParser(path, tick, live, steps)
        acc = _FileRows(path, keep, steps)
        for lines in _line_batches(fh):
            rows, numbers = parser.feed(lines)
            acc.add_lines(rows, numbers)
        acc.steps_not_read |= parser.steps_not_read
        return parser, acc

    try:
        if not gz:
            with open(path, "rb") as fh:
                parser, acc = read(fh)
        else:
            try:
                with gzip.open(path, "rb") as fh:
                    parser, acc = read(fh)
            except (EOFError, zlib.error, OSError, UnicodeDecodeError, InputError):
                # a stream cut off, or one that fails: read it member by member. A cut member followed by
                # another decompresses into garbage (or runs to the end), so what the first read gave is
                # not trusted; a file whose members are all whole failed for another reason: raise that
                rec = _gzip_recovered(path)
                if rec is None:
                    raise
                with rec.open_bytes() as fh:
                    parser, acc = read(fh)
                stream_cut = rec.open_tail(len(rec.layout.segments) - 1)
    except UnicodeDecodeError as err:
        at, byte = _bad_utf8(open_bytes) or (None, err.object[err.start])
        raise InputError(f"{path}: {f'line {at}: ' if at else ''}not UTF-8 text (byte 0x{byte:02x}"
                         f"{' in the decompressed text' if gz else ''}): not a JSONL dump (one JSON object per "
                         "line), nor gzip or parquet; pass the dump in one of those formats") from None
    except (OSError, EOFError, zlib.error) as err:
        raise InputError(f"{path}: cannot be read ({err})") from None
    got = parser.got
    torn, cut_mid, joined = got.torn, got.cut_mid, got.joined
    if rec is not None:
        warnings += rec.notes([int(x) for b in acc.batches for x in b["rows"].row_number])
    if cut_mid or joined:
        both = sorted(cut_mid + joined)
        same = (f"; the row written after it on the same line ({_lines(joined)}) was read"
                if joined else "")
        warnings.append(f"{path}: {_lines(both)} {'is a row' if len(both) == 1 else 'are rows'} cut off by "
                        f"{'its writer' if len(both) == 1 else 'their writer'}, followed by rows appended later "
                        "(a trainer that crashed mid-row, then resumed into the same file): the cut-off "
                        f"row{'s were' if len(both) > 1 else ' was'} skipped{same}. To silence this, delete the "
                        "cut-off text from the file.")
    if torn is not None:
        n, line = torn
        if live and not line.endswith("\n"):
            warnings.append(f"{path}: line {n} is incomplete (no end of line, not valid JSON) and was skipped: "
                            "the newest file of the input, probably still being written.")
        else:
            warnings.append(f"{path}: line {n}, the last, is a row cut off by its writer (an unfinished JSON "
                            "object: a writer that stopped mid-row, e.g. crashed) and was skipped. To silence "
                            "this, delete that line.")
    if stream_cut:
        why = ("the newest file of the input, probably still being written" if live else
               "its writer stopped before closing it (e.g. crashed)")
        last = rec.layout.segments[-1][0] if rec is not None else 0
        at = f" at byte {len(rec.buf):,}" if rec is not None else ""
        member = f" (in its last member, from byte {last:,})" if rec is not None and last else ""
        warnings.append(f"{path}: the gzip stream is cut off{at}{member} ({why}): the rows before the cut "
                        f"({acc.n:,}) were read.")
    if not got.rows:
        if rec is not None and rec.layout.junk:
            raise InputError(f"{path}: cannot be read: holds no complete row ({warnings[0]})")
        if warnings:
            why = ("a job still writing it?" if live else "its writer stopped mid-row, e.g. crashed")
            raise _Skipped(warnings[0], f"{path}: holds no complete row: its only row is cut off ({why}); "
                                        "diagnose it once a row is complete")
        raise InputError(f"{path}: holds no rows")
    return acc.finish(warnings)


VERL_KEYS = ("input", "output", "score", "step")
"""The keys verl's ``_write_generations`` writes in every row (with ``gts``), before the reward function's extra
fields; a file with them is read as verl's ``rollout_data_dir`` / ``validation_data_dir``."""
_VERL_UID = re.compile(r"^(.+)_(\d+)_(\d+)$")
"""verl's v1 trainer adds a ``uid`` field ``{prompt uid}_{session}_{output}``."""


def _is_verl(names: set[str]) -> bool:
    """verl's format, recognised by verl's own keys: ``input``, ``output``, ``score``, ``step`` and ``gts`` (verl
    writes it in every row), or the first four without ``group`` (a creditlab file needs it). The extra fields
    are the reward function's and may be anything, ``reward`` included (a dict reward with a ``reward`` key, and
    every ``validation_data_dir``, where verl adds the score as ``reward``)."""
    return set(VERL_KEYS) <= names and ("gts" in names or "group" not in names)


def _required_text(rows: list[dict], name: str, what: str, where: _Where) -> list[str]:
    """The string field ``name`` of every row; an :class:`InputError` naming the row and field otherwise."""
    out = []
    for i, r in enumerate(rows):
        v = r.get(name)
        if not isinstance(v, str):
            raise InputError(f"{where(i, name)}: expected {what}, got {type(v).__name__}")
        out.append(v)
    return out


def _from_verl(rows: list[dict], where: _Where) -> _Rows:
    n = len(rows)
    step = _int_column([r.get("step") for r in rows], "step", where)
    group = _required_text(rows, "input", "the prompt text", where)
    uids = [r.get("uid") for r in rows]
    found = [_VERL_UID.match(u) if isinstance(u, str) else None for u in uids]
    if all(found):  # the v1 trainer: the group is the prompt's uid (the outputs of a session differ in input)
        group = [m.group(1) for m in found]
    reward = _float_column([r.get("score") for r in rows], "score", where, required=True)
    response = _required_text(rows, "output", "the response text", where)
    scalars = {"response_length": np.asarray([len(v) for v in response], dtype=np.float64)}
    for name in ("precision", "recall"):
        if any(name in r for r in rows):
            scalars[name] = _share_column(_float_column([r.get(name) for r in rows], name, where, required=False),
                                          name, where)
    return _Rows(FORMAT_VERL, n, where.numbers, step, group, reward, None, scalars, {"response": response}, None,
                 length_unit="characters", reward_source="verl's column score")


def _read_parquet(path: Path, reward_columns: Sequence[str] | None = None, *, keep: bool = False,
                  steps: StepSelection | None = None) -> _Part:
    """Rows of a parquet file, a batch of rows at a time (about ``4 * CHUNK_BYTES`` of column data; verl's
    and TRL's tables, which hold no tokens, at once)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        n = pf.metadata.num_rows
        names = set(pf.schema_arrow.names)
        if n and (_is_verl(names) or is_trl(names)):
            table = pf.read()
    except (OSError, pa.ArrowException) as err:
        raise InputError(f"{path}: not a readable parquet file ({err})") from None
    if n == 0:
        raise InputError(f"{path}: holds no rows")
    acc = _FileRows(path, keep, steps)
    if _is_verl(names):
        acc.fmt = FORMAT_VERL
        acc.add(_from_verl(table.to_pylist(), _Where(path, "row", np.arange(1, n + 1))))
        return acc.finish([])
    if is_trl(names):  # TRL's log_completions files
        where = _Where(path, "row", np.arange(1, n + 1))
        t = from_trl(table.to_pylist(), table.column_names, where, reward_columns_given=reward_columns)
        acc.fmt = FORMAT_TRL
        acc.add(_Rows(FORMAT_TRL, int(t.rows.size), where.numbers[t.rows], t.step, t.group, t.reward, None,
                      {"response_length": t.length}, {"response": t.response}, None, length_unit="characters",
                      reward_source=t.source))
        return acc.finish([])
    acc.fmt = FORMAT_CREDITLAB
    size = sum(pf.metadata.row_group(g).total_byte_size for g in range(pf.metadata.num_row_groups))
    batch = max(1, int(4 * CHUNK_BYTES * n / max(size, 1)))
    start = 0
    try:
        for rb in pf.iter_batches(batch_size=batch):
            table = pa.Table.from_batches([rb])
            numbers = np.arange(start + 1, start + table.num_rows + 1)
            start += table.num_rows
            if steps is not None and "step" in names:
                table, numbers = _select_steps(table, numbers, acc)
            if table.num_rows == 0:
                continue
            if acc.logprobs.failed:
                acc.logprobs.count(zip(*(table.column(c).to_pylist() if c in names else [None] * table.num_rows
                                         for c in TOKEN_COLUMNS), strict=True))
                continue
            try:
                acc.add(_parquet_rows(table, _Where(path, "row", numbers), acc.logprobs))
            except _BadLogprob:
                pass
    except (OSError, pa.ArrowException) as err:
        raise InputError(f"{path}: not a readable parquet file ({err})") from None
    return acc.finish([])


def _select_steps(table: Any, numbers: np.ndarray, acc: _FileRows) -> tuple[Any, np.ndarray]:
    """The rows of a parquet batch at a selected step (and those whose step is not an integer, so that they
    are named as errors)."""
    import pyarrow as pa

    col = table.column("step")
    if not pa.types.is_integer(col.type) or col.null_count:
        return table, numbers
    steps = col.to_numpy()
    sel = acc.steps.mask(steps)
    acc.steps_not_read.update(np.unique(steps[~sel]).tolist())
    return table.filter(pa.array(sel)), numbers[sel]


def _parquet_rows(table: Any, where: _Where, check: _LogprobCheck) -> _Rows:
    """A batch of rows of a creditlab-format parquet file, validated."""
    import pyarrow as pa
    import pyarrow.compute as pc

    names = set(table.column_names)
    n = table.num_rows

    def values(name: str) -> list[Any] | np.ndarray | None:
        if name not in names:
            return None
        col = table.column(name)
        if col.null_count == 0 and (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)
                                    or pa.types.is_boolean(col.type)):
            return col.to_numpy()  # validated in bulk
        return col.to_pylist()

    def flat(name: str):
        if name not in names:
            return None
        col = table.column(name)
        if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
            raise InputError(f"{where(0, name)}: expected a list column, got {col.type}")
        arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
        if arr.null_count:
            i = int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
            raise InputError(f"{where(i, name)}: expected a list, got nothing")
        lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)
        values_ = arr.flatten()
        vt = values_.type
        if pa.types.is_floating(vt) or pa.types.is_integer(vt) or pa.types.is_boolean(vt):
            if values_.null_count and not pa.types.is_floating(vt):
                k = int(np.flatnonzero(values_.is_null().to_numpy(zero_copy_only=False))[0])
                i, j = _first_row(lengths.tolist(), k)
                raise InputError(f"{where(i, name)}: element {j} is null")
            a = values_.to_numpy(zero_copy_only=False)
            return a, lengths.tolist()
        # anything else (strings, structs, nulls): validate row by row to name the bad element
        return list(itertools.chain.from_iterable(arr.to_pylist())), lengths.tolist()

    return _build(FORMAT_CREDITLAB, n, where, names.__contains__, values, flat, check)


# ------------------------------------------------------------------------------------------------
# validation
# ------------------------------------------------------------------------------------------------


def _first_row(lengths: list[int], k: int) -> tuple[int, int]:
    """(row, index within row) of flat element ``k``."""
    ends = np.cumsum(lengths)
    i = int(np.searchsorted(ends, k, side="right"))
    return i, k - int(ends[i] - lengths[i])


def _array(vals: Any, empty_dtype: Any = np.float64) -> np.ndarray | None:
    """``vals`` as a numpy array, or None when numpy cannot make one (ragged nested lists)."""
    if isinstance(vals, np.ndarray):
        return vals
    if not len(vals):
        return np.zeros(0, dtype=empty_dtype)
    try:
        return np.asarray(vals)
    except (ValueError, TypeError):
        return None


def _nested(v: Any, lengths: list[int], k: int, name: str, where: _Where) -> None:
    """Raise the error for a list (or object) where a token column holds one value per token."""
    if isinstance(v, list | tuple | dict | np.ndarray):
        i, j = _first_row(lengths, k)
        what = "an object" if isinstance(v, dict) else "a list"
        raise InputError(f"{where(i, name)}: element {j} is {what}, not one value: a token column is a flat "
                         "list with one value per token (not one list per turn); concatenate the turns and give "
                         "each token's turn in 'turn_ids'")


def _flat_floats(vals: Any, lengths: list[int], name: str, where: _Where) -> np.ndarray:
    a = _array(vals)
    if a is not None and a.ndim == 1 and a.dtype.kind in "fiu":
        return a.astype(np.float64)
    # slow path: null elements become NaN, anything else that is not a number is an error
    out = np.empty(len(vals), dtype=np.float64)
    for k, v in enumerate(vals):
        if v is None:
            out[k] = math.nan
        elif is_number(v):
            out[k] = float(v)
        else:
            _nested(v, lengths, k, name, where)
            i, j = _first_row(lengths, k)
            raise InputError(f"{where(i, name)}: element {j} is {v!r}, expected a number")
    return out


def _flat_bools(vals: Any, lengths: list[int], name: str, where: _Where) -> np.ndarray:
    a = _array(vals, bool)
    if a is not None and a.ndim == 1 and a.dtype == np.bool_:
        return a
    if a is not None and a.ndim == 1 and a.dtype.kind in "iu" and bool(((a == 0) | (a == 1)).all()):
        return a.astype(bool)
    for k, v in enumerate(vals):
        if not (isinstance(v, bool | np.bool_) or (is_number(v) and v in (0, 1))):
            _nested(v, lengths, k, name, where)
            i, j = _first_row(lengths, k)
            raise InputError(f"{where(i, name)}: element {j} is {v!r}, expected true/false")
    return np.asarray([bool(v) for v in vals], dtype=bool)


def _flat_ints(vals: Any, lengths: list[int], name: str, where: _Where) -> np.ndarray:
    a = _array(vals, np.int64)
    if a is not None and a.ndim == 1 and a.dtype.kind in "iu":
        return a.astype(np.int64)
    for k, v in enumerate(vals):
        if not (is_number(v) and float(v) == int(v)):
            _nested(v, lengths, k, name, where)
            i, j = _first_row(lengths, k)
            raise InputError(f"{where(i, name)}: element {j} is {v!r}, expected an integer")
    return np.asarray([int(v) for v in vals], dtype=np.int64)


def _bulk(vals: Any) -> np.ndarray | None:
    """``vals`` as a numeric numpy array when every value is a plain number (no bool, None or text)."""
    if not isinstance(vals, np.ndarray) and (not len(vals) or any(type(v) is bool for v in vals)):
        return None  # numpy would read True as 1
    a = _array(vals)
    return a if a is not None and a.ndim == 1 and a.dtype.kind in "fiu" else None


def _int_column(vals: list[Any] | np.ndarray, name: str, where: _Where) -> np.ndarray:
    a = _bulk(vals)
    if a is not None and (a.dtype.kind in "iu" or bool((np.isfinite(a) & (a == np.round(a))).all())):
        return a.astype(np.int64)
    out = np.empty(len(vals), dtype=np.int64)
    for i, v in enumerate(vals):
        if not is_number(v) or not math.isfinite(float(v)) or float(v) != int(v):
            got = "nothing" if v is None else repr(v)
            raise InputError(f"{where(i, name)}: expected an integer, got {got}")
        out[i] = int(v)
    return out


def _float_column(vals: list[Any] | np.ndarray, name: str, where: _Where, *, required: bool) -> np.ndarray:
    a = _bulk(vals)
    if a is not None and (not required or bool(np.isfinite(a).all())):
        return a.astype(np.float64)
    out = np.empty(len(vals), dtype=np.float64)
    for i, v in enumerate(vals):
        if v is None and not required:
            out[i] = math.nan
        elif is_number(v) and (math.isfinite(float(v)) or not required):
            out[i] = float(v)
        else:
            got = "nothing" if v is None else repr(v)
            raise InputError(f"{where(i, name)}: expected a {'finite ' if required else ''}number, got {got}")
    return out


def _bool_column(vals: list[Any] | np.ndarray, name: str, where: _Where) -> np.ndarray:
    a = _array(vals, bool) if len(vals) else None
    if a is not None and a.ndim == 1 and a.dtype == np.bool_:
        return a.astype(np.float64)
    out = np.empty(len(vals), dtype=np.float64)
    for i, v in enumerate(vals):
        if v is None:
            out[i] = math.nan
        elif isinstance(v, bool | np.bool_) or (is_number(v) and v in (0, 1)):
            out[i] = float(bool(v))
        else:
            raise InputError(f"{where(i, name)}: expected true/false, got {v!r}")
    return out


def _share_column(a: np.ndarray, name: str, where: _Where) -> np.ndarray:
    """``a`` (a share column, NaN = missing), or the error naming the first value outside [0, 1]."""
    with np.errstate(invalid="ignore"):
        bad = (a < -1e-9) | (a > 1 + 1e-9)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        hint = " (a percentage? divide by 100)" if float(np.nanmax(a)) <= 100 and float(np.nanmin(a)) >= 0 else ""
        raise InputError(f"{where(i, name)}: {a[i]:g} is outside [0, 1]: {name} is a share{hint}")
    return a


def _source_column(vals: list[str | None], where: _Where) -> None:
    """``logprobs_source`` is ``learner`` or starts with ``rollout`` (the engine's own log-probs)."""
    for i, v in enumerate(vals):
        if v is not None and v != LEARNER and not v.startswith(ENGINE_SOURCE):
            raise InputError(f"{where(i, 'logprobs_source')}: {v!r}: expected {LEARNER!r} (the learner's log-probs) "
                             f"or a value starting with {ENGINE_SOURCE!r} (the engine's, e.g. {VERL_BYPASS!r})")


def _text_column(vals: list[Any], name: str, where: _Where) -> list[str | None]:
    for i, v in enumerate(vals):
        if v is not None and not isinstance(v, str):
            raise InputError(f"{where(i, name)}: expected text, got {type(v).__name__}")
    return vals


def _group_column(vals: list[Any] | np.ndarray, where: _Where) -> list[Any]:
    a = _bulk(vals)
    if a is not None and a.dtype.kind in "iu":
        return a.astype(np.int64).tolist()
    out = []
    for i, v in enumerate(vals):
        if isinstance(v, str):
            out.append(v)
        elif is_number(v) and math.isfinite(float(v)) and float(v) == int(v):
            out.append(int(v))
        else:
            got = "nothing" if v is None else repr(v)
            raise InputError(f"{where(i, 'group')}: expected an int or a string, got {got}")
    return out


def _turns_column(vals: list[Any], where: _Where) -> list[list[dict] | None]:
    out: list[list[dict] | None] = []
    for i, v in enumerate(vals):
        if isinstance(v, str):  # parquet files written by write_dump store turns as JSON text
            try:
                v = json.loads(v)
            except json.JSONDecodeError:
                raise InputError(f"{where(i, 'turns')}: not valid JSON text") from None
        if v is None:
            out.append(None)
            continue
        if not isinstance(v, list):
            raise InputError(f"{where(i, 'turns')}: expected a list of turns, got {type(v).__name__}")
        turns = []
        for t, d in enumerate(v):
            if not isinstance(d, Mapping):
                raise InputError(f"{where(i, 'turns')}: turn {t} is {type(d).__name__}, expected an object")
            for f in ("tool", "args", "returned", "is_write"):
                if f not in d:
                    raise InputError(f"{where(i, 'turns')}: turn {t} has no field '{f}'")
            if not isinstance(d["tool"], str):
                raise InputError(f"{where(i, 'turns')}: turn {t}: 'tool' must be a string, got {d['tool']!r}")
            if d["args"] is not None and not isinstance(d["args"], Mapping):
                raise InputError(f"{where(i, 'turns')}: turn {t}: 'args' must be an object, got {d['args']!r}")
            if not isinstance(d["is_write"], bool):
                raise InputError(f"{where(i, 'turns')}: turn {t}: 'is_write' must be true/false, got {d['is_write']!r}")
            ps = d.get("process_score")
            if ps is not None and not (is_number(ps) and math.isfinite(float(ps))):
                raise InputError(f"{where(i, 'turns')}: turn {t}: 'process_score' must be a number or null, "
                                 f"got {ps!r}")
            lo, hi = PROCESS_SCORE_RANGE
            if ps is not None and not lo - 1e-9 <= float(ps) <= hi + 1e-9:
                raise InputError(f"{where(i, 'turns')}: turn {t}: 'process_score' is {ps!r}, outside [{lo:g}, {hi:g}] "
                                 "(scores are in [0, 1], or signed in [-1, 1]): rescale them, e.g. a 0-10 judge "
                                 "score divided by 10")
            turns.append({"tool": d["tool"], "args": dict(d["args"] or {}), "returned": d["returned"],
                          "is_write": d["is_write"], "process_score": None if ps is None else float(ps)})
        out.append(turns)
    return out


def _build(fmt: str, n: int, where: _Where, has: Callable[[str], bool], values, flat, check: _LogprobCheck) -> _Rows:
    """A batch of ``n`` rows validated (``values(name)``: a column's values, ``flat(name)``: a token column's
    values and the rows' lengths); a log-prob above ``LOGPROB_TOL`` is recorded in ``check``, which raises
    :class:`_BadLogprob`."""
    renames = [(v, c) for v, c in VERL_NAMES.items() if has(v) and not has(c)]
    if renames:
        s = "s" if len(renames) > 1 else ""
        raise InputError(f"{where.path}: column{s} {', '.join(repr(v) for v, _ in renames)} {'are' if s else 'is'} "
                         f"verl's name{s}; this file is read in the creditlab schema: rename "
                         f"{', '.join(f'{v!r} to {c!r}' for v, c in renames)} (creditlab.integrations.verl's "
                         "dump_batch writes the schema)")
    for c in COLUMNS:
        if c.required and not has(c.name):
            raise InputError(f"{where.path}: column '{c.name}' is missing (required: "
                             f"{', '.join(x.name for x in COLUMNS if x.required)})")
    step = _int_column(values("step"), "step", where)
    group = _group_column(values("group"), where)
    reward = _float_column(values("reward"), "reward", where, required=True)

    present = [c for c in TOKEN_COLUMNS if has(c)]
    tokens = None
    if present:
        if len(present) != len(TOKEN_COLUMNS):
            missing = [c for c in TOKEN_COLUMNS if c not in present]
            raise InputError(f"{where.path}: column '{missing[0]}' is missing: the token columns "
                             f"{', '.join(TOKEN_COLUMNS)} come together (this file has {', '.join(present)})")
        lp_v, lp_n = flat("logprobs")
        lp = _flat_floats(lp_v, lp_n, "logprobs", where)
        rl_v, rl_n = flat("rollout_logprobs")
        pm_v, pm_n = flat("policy_mask")

        def same_lengths(name: str, lens) -> None:
            if lens != lp_n:
                i = next(k for k in range(n) if lens[k] != lp_n[k])
                raise InputError(f"{where(i, name)}: {lens[i]} values, but 'logprobs' has {lp_n[i]}")

        same_lengths("rollout_logprobs", rl_n)
        same_lengths("policy_mask", pm_n)
        rlp = _flat_floats(rl_v, rl_n, "rollout_logprobs", where)
        pm = _flat_bools(pm_v, pm_n, "policy_mask", where)
        for name, a in (("logprobs", lp), ("rollout_logprobs", rlp)):
            check.check(a, pm, lp_n, name, where)
        def optional(name, convert):
            """The optional token column ``name`` flattened by ``convert`` (None when the dump has none)."""
            got = flat(name) if has(name) else None
            if got is None:
                return None
            values, counts = got
            same_lengths(name, counts)
            return convert(values, counts, name, where), counts

        tid = rej = None
        if (got := optional("turn_ids", _flat_ints)) is not None:
            tid, t_n = got
            if tid.size and int(tid.min()) < -1:
                k = int(np.argmin(tid))
                i, j = _first_row(t_n, k)
                raise InputError(f"{where(i, 'turn_ids')}: element {j} is {int(tid[k])}, expected a turn >= 0 "
                                 "or -1 outside turns")
        if (got := optional("rejected", _flat_bools)) is not None:
            rej, _ = got
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.asarray(lp_n, dtype=np.int64), out=offsets[1:])
        tokens = _PartTokens(offsets, lp, rlp, pm, tid, rej)
    else:
        for name in ("turn_ids", "rejected"):
            if has(name):
                raise InputError(f"{where.path}: column '{name}' without the token columns "
                                 f"{', '.join(TOKEN_COLUMNS)}")

    scalars: dict[str, np.ndarray] = {}
    for name in _SCALAR_FLOATS:
        if not has(name):
            continue
        v = values(name)
        scalars[name] = _bool_column(v, name, where) if name == "truncated" else \
            _float_column(v, name, where, required=False)
    if "response_length" in scalars and bool((scalars["response_length"] < 0).any()):
        i = int(np.flatnonzero(scalars["response_length"] < 0)[0])
        raise InputError(f"{where(i, 'response_length')}: must be >= 0, got {scalars['response_length'][i]}")
    for name in SHARE_COLUMNS:
        if name in scalars:
            _share_column(scalars[name], name, where)
    texts = {name: _text_column(values(name), name, where) for name in _TEXT if has(name)}
    if "logprobs_source" in texts:
        _source_column(texts["logprobs_source"], where)
    turns = _turns_column(values("turns"), where) if has("turns") else None
    return _Rows(fmt, n, where.numbers, step, group, reward, tokens, scalars, texts, turns)


CHARACTERS = "characters"
TOKENS = "tokens"


def _length_unit(length: np.ndarray, n_tokens: np.ndarray | None, chars: np.ndarray | None) -> str:
    """The unit of a creditlab file's ``response_length``: "tokens" (the schema's), or "characters" when
    it exceeds the row's token count (prompt and tool tokens included) by half on the median row, or
    equals the length of the ``response`` text on 90% of 4+ rows (a tokenizer would give fewer)."""
    ok = np.isfinite(length)
    if n_tokens is not None:
        sel = ok & (n_tokens > 0)
        if sel.any() and float(np.median(length[sel] / n_tokens[sel])) > 1.5:
            return CHARACTERS
    if chars is not None:
        sel = ok & np.isfinite(chars) & (chars > 1)
        if sel.sum() >= 4 and float(np.mean(length[sel] == chars[sel])) >= 0.9:
            return CHARACTERS
    return TOKENS


def _concat(files: list[str], parts: list[_Part]) -> Dump:
    N = sum(p.n for p in parts)
    sizes = [p.n for p in parts]
    labels: dict[Any, int] = {}
    codes = np.empty(N, dtype=np.int64)
    k = 0
    for p in parts:
        for g in p.group:
            key = (type(g).__name__, g)
            codes[k] = labels.setdefault(key, len(labels))
            k += 1
    group_labels = [g for (_, g) in labels]
    rows = turn_stats = None
    if any(p.rows is not None for p in parts):
        rows = RowStats.concat([p.rows if p.rows is not None else RowStats.empty(p.n) for p in parts])
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int).tolist()
        have = [(p.turn_stats, s) for p, s in zip(parts, starts, strict=True) if p.turn_stats is not None]
        turn_stats = TurnStats.concat([t for t, _ in have], [s for _, s in have])

    def cat_scalar(name: str) -> np.ndarray:
        return np.concatenate([p.scalars.get(name, np.full(p.n, np.nan)) for p in parts])

    scalars = {name: cat_scalar(name) for name in _SCALAR_FLOATS if any(name in p.scalars for p in parts)}
    response_chars = instruction = sources = turn_rows = None
    if any(p.response_chars is not None for p in parts):
        response_chars = np.concatenate([p.response_chars if p.response_chars is not None else np.full(p.n, np.nan)
                                         for p in parts])
    if any(p.instruction is not None for p in parts):
        instruction = np.concatenate([p.instruction if p.instruction is not None else np.zeros(p.n, dtype=bool)
                                      for p in parts])
    if any(p.sources is not None for p in parts):
        sources = list(itertools.chain.from_iterable(p.sources if p.sources is not None else [None] * p.n
                                                     for p in parts))
    if any(p.turn_rows is not None for p in parts):
        turn_rows = TurnRows.concat([p.turn_rows for p in parts], sizes)
    dump = Dump(
        files=files, formats=[p.fmt for p in parts],
        row_file=np.concatenate([np.full(p.n, i, dtype=np.int64) for i, p in enumerate(parts)]),
        row_number=np.concatenate([p.row_number for p in parts]),
        step=np.concatenate([p.step for p in parts]), group=codes, group_labels=group_labels,
        reward=np.concatenate([p.reward for p in parts]), rows=rows, turn_stats=turn_stats, scalars=scalars,
        response_chars=response_chars, sources=sources, instruction=instruction, turn_rows=turn_rows,
        token_columns=frozenset().union(*(p.token_columns for p in parts)),
        warnings=[w for p in parts for w in p.warnings], length_units=[p.length_unit for p in parts],
        reward_sources=[p.reward_source for p in parts],
    )
    _concat_kept(dump, parts)
    return dump


def _concat_kept(dump: Dump, parts: list[_Part]) -> None:
    """The token columns, texts and turns the parts kept (``tokens=True``), joined as the dump's."""
    if any(p.tokens is not None for p in parts):
        lengths, lps, rlps, pms, tids, rejs, has = [], [], [], [], [], [], []
        any_tid = any(p.tokens is not None and p.tokens.turn_ids is not None for p in parts)
        any_rej = any(p.tokens is not None and p.tokens.rejected is not None for p in parts)
        for p in parts:
            if p.tokens is None:
                lengths.append(np.zeros(p.n, dtype=np.int64))
                has.append(np.zeros(p.n, dtype=bool))
                continue
            off, lp, rlp, pm, tid, rej = p.tokens
            lengths.append(np.diff(off))
            has.append(np.ones(p.n, dtype=bool))
            lps.append(lp)
            rlps.append(rlp)
            pms.append(pm)
            if any_tid:
                # a file without turn_ids: every run of policy tokens is a turn (derived by the checks)
                tids.append(tid if tid is not None else np.full(lp.shape[0], DERIVE_TURN, dtype=np.int64))
            if any_rej:  # a file without the column rejected nothing
                rejs.append(rej if rej is not None else np.zeros(lp.shape[0], dtype=bool))
        offsets = np.zeros(len(dump) + 1, dtype=np.int64)
        np.cumsum(np.concatenate(lengths), out=offsets[1:])
        dump.tokens = TokenData(offsets, np.concatenate(lps), np.concatenate(rlps), np.concatenate(pms),
                                np.concatenate(tids) if any_tid else None, np.concatenate(has),
                                np.concatenate(rejs) if any_rej else None)
    dump.texts = {name: list(itertools.chain.from_iterable(p.texts.get(name, [None] * p.n) for p in parts))
                  for name in _TEXT if any(name in p.texts for p in parts)}
    if any(p.turns is not None for p in parts):
        dump.turns = list(itertools.chain.from_iterable(p.turns if p.turns is not None else [None] * p.n
                                                        for p in parts))


def _take(d: Dump, keep: np.ndarray) -> Dump:
    """The rows of ``d`` where ``keep`` is True (files, warnings and units unchanged)."""
    tokens = None
    if d.tokens is not None:
        t = d.tokens
        lengths = t.lengths[keep]
        offsets = np.zeros(int(keep.sum()) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        kt = np.repeat(keep, t.lengths)
        tokens = TokenData(offsets, t.logprobs[kt], t.rollout_logprobs[kt], t.policy_mask[kt],
                           None if t.turn_ids is None else t.turn_ids[kt], t.has_tokens[keep],
                           None if t.rejected is None else t.rejected[kt])
    idx = np.flatnonzero(keep)
    return Dump(files=d.files, formats=d.formats, row_file=d.row_file[keep], row_number=d.row_number[keep],
                step=d.step[keep], group=d.group[keep], group_labels=d.group_labels, reward=d.reward[keep],
                rows=None if d.rows is None else d.rows.take(keep),
                turn_stats=None if d.turn_stats is None else d.turn_stats.take_rows(keep),
                scalars={k: v[keep] for k, v in d.scalars.items()},
                response_chars=None if d.response_chars is None else d.response_chars[keep],
                sources=None if d.sources is None else [d.sources[i] for i in idx],
                instruction=None if d.instruction is None else d.instruction[keep],
                turn_rows=None if d.turn_rows is None else d.turn_rows.take(keep), token_columns=d.token_columns,
                tokens=tokens, texts={k: [v[i] for i in idx] for k, v in d.texts.items()},
                turns=None if d.turns is None else [d.turns[i] for i in idx], warnings=list(d.warnings),
                length_units=list(d.length_units), reward_sources=list(d.reward_sources),
                steps_selection=d.steps_selection, steps_not_read=list(d.steps_not_read))


def _rewritten(keys: list[bytes], groups: np.ndarray) -> tuple[int, int] | None:
    """``(m, n)`` when rows ``m .. m + n - 1`` of one step's run of rows repeat its first ``n`` rows in
    order (the step written again right after itself, whole or after a torn first write) and the
    repeat spans 2+ groups (within a group, identical rollouts can follow each other); else None."""
    L = len(keys)
    for m in range(1, L):
        if keys[m] != keys[0]:
            continue
        n = min(m, L - m)
        if keys[m:m + n] == keys[:n] and np.unique(groups[:n]).size >= 2:
            return m, n
    return None


def _names(items: Sequence[str], k: int = 4) -> str:
    return ", ".join(items[:k]) + (f" and {len(items) - k} more" if len(items) > k else "")


def _same_dump_twice(d: Dump, keys: list[bytes]) -> None:
    """A file whose every row repeats an identical row (same step) of one other file is the same dump
    twice (e.g. in two formats, or a copied file): an error naming both files."""
    if len(d.files) < 2:
        return
    by_file: list[dict[int, set[bytes]]] = [{} for _ in d.files]
    for i, k in enumerate(keys):
        by_file[int(d.row_file[i])].setdefault(int(d.step[i]), set()).add(k)
    counts = np.bincount(d.row_file, minlength=len(d.files))
    for f in range(len(d.files)):
        mine = by_file[f]
        holders = [g for g in range(len(d.files)) if g != f and counts[g] >= counts[f]
                   and all(s in by_file[g] and ks <= by_file[g][s] for s, ks in mine.items())]
        same = [g for g in holders if counts[g] == counts[f]]
        if same and min(same) < f:
            raise InputError(f"{d.files[f]} holds the same rows as {d.files[min(same)]} (every row, step for step: "
                             "the same dump twice, e.g. in two formats or a copied file): pass one of them")
        if holders and not same:
            raise InputError(f"every row of {d.files[f]} is also in {d.files[min(holders)]} (step for step: the "
                             "same rollouts twice, e.g. part of a dump copied into another file): pass one of them")


def _file_steps(d: Dump, rows: np.ndarray) -> tuple[int, dict[int, set[Any]]]:
    """The first step of ``rows`` and, per step, the group labels they hold."""
    out: dict[int, set[Any]] = {}
    for s, g in zip(d.step[rows].tolist(), d.group[rows].tolist(), strict=True):
        out.setdefault(s, set()).add(g)
    return min(out), out


def _apart(a: tuple[int, dict[int, set[Any]]], b: tuple[int, dict[int, set[Any]]]) -> list[int] | None:
    """The steps two sources share with a common group, when they read as two training runs: both start at
    the same step and share two or more steps holding the same group (one run writes a step's groups
    once; a run resumed from a checkpoint starts later than the rows it rewrites). Else None."""
    if a[0] != b[0]:
        return None
    shared = sorted(s for s, gs in a[1].items() if s in b[1] and not gs.isdisjoint(b[1][s]))
    return shared if len(shared) >= 2 else None


_RANK = re.compile(r"(?<![A-Za-z0-9])rank-\d+(?![0-9])")
"""The part of a name that tells one process's dump from the others' of the same run."""


def _separate_runs(d: Dump, groups: list[int], args: list[str]) -> None:
    """Refuse to diagnose several training runs as one. Each file is a source (a lab's ``--dump``
    directory holds one file per arm and seed), and so is each directory given (verl writes a run's
    ``rollout_data_dir`` a file per step); two sources are two runs when :func:`_apart` says so, unless
    their names differ only in ``rank-<i>`` (one run's processes, each writing its own file). Mixed,
    their groups would merge and rollouts they share (a seed's first step, from one base policy) would
    read as rows written twice."""
    files = np.arange(len(d.files))
    sources: list[tuple[str, np.ndarray]] = [(d.files[f], d.row_file == f) for f in files]
    dirs = sorted({g for g in groups if g >= 0})
    if len(dirs) + (-1 in groups) >= 2:
        in_dir = np.asarray(groups)[d.row_file]
        sources += [(args[g], in_dir == g) for g in dirs]
    for level in ("file", "directory"):
        cand = [(name, rows) for k, (name, rows) in enumerate(sources)
                if (k < len(files)) == (level == "file") and rows.any()]
        info = [_file_steps(d, rows) for _, rows in cand]
        runs: list[int] = []
        shared: list[int] | None = None
        shard = [_RANK.sub("rank-*", name) for name, _ in cand]
        for i in range(len(cand)):
            for j in range(i):
                if shard[i] == shard[j] and shard[i] != cand[i][0]:
                    continue  # one run's processes, a file each (creditlab's TRL callback: rank-<i>)
                got = _apart(info[i], info[j])
                if got is not None:
                    shared = shared or got
                    runs += [k for k in (j, i) if k not in runs]
        if not runs:
            continue
        names = [cand[k][0] for k in runs]
        parent = {str(Path(n).parent) for n in names} if level == "file" else set()
        short = [Path(n).name for n in names] if len(parent) == 1 else names
        where = f" in {next(iter(parent))}" if len(parent) == 1 else ""
        steps = f"{len(shared)} steps ({shared[0]} to {shared[-1]})" if len(shared) > 2 else \
            f"steps {shared[0]} and {shared[1]}"
        loop = ""
        if where:
            suffix = next((x for x in _SUFFIXES if all(n.endswith(x) for n in names)), "")
            loop = (f"; all of them: for f in \"{where[4:]}\"/*{suffix}; do creditlab diagnose \"$f\" --out "
                    "\"diagnose-$(basename \"$f\")\"; done")
        kind = "directories" if level == "directory" else "files"
        raise InputError(
            f"the input holds {len(runs)} separate training runs: the {kind} {_names(short)}{where} start at the same "
            f"step ({info[runs[0]][0]}) and hold the same groups at {steps}, as runs do that are not one (a lab's "
            "arms or seeds, or two trainers); one run writes a step's groups once. Diagnosed together, each group "
            "would merge across runs and the rollouts they share would read as rows written twice. Diagnose each "
            f"run on its own: creditlab diagnose {names[0]} --out DIR{loop}")


def _drop_repeated_rows(d: Dump, keys: list[bytes]) -> Dump:
    """Leave out rows that repeat an identical row of the same step written before: in another file, in
    another run of that step's rows in the same file, or as the step's rows written again right after
    themselves (a resumed trainer). Other identical rows within a run are kept: a group's rollouts can
    be identical. (A file that repeats another whole is refused before: :func:`_same_dump_twice`.)"""
    N = len(d)
    if N < 2:
        return d
    change = np.ones(N, dtype=bool)
    change[1:] = (d.row_file[1:] != d.row_file[:-1]) | (d.step[1:] != d.step[:-1])
    starts = np.flatnonzero(change)
    ends = np.append(starts[1:], N)
    repeat = np.zeros(N, dtype=bool)
    first_of: dict[int, int] = {}  # repeated row -> the row it repeats
    seen: dict[int, dict[bytes, int]] = {}  # step -> key -> first row, over the runs before
    for a, e in zip(starts.tolist(), ends.tolist(), strict=True):
        before = seen.setdefault(int(d.step[a]), {})
        mine: dict[bytes, int] = {}
        for i in range(a, e):
            if keys[i] in before:
                repeat[i] = True
                first_of[i] = before[keys[i]]
            else:
                mine.setdefault(keys[i], i)
        again = _rewritten(keys[a:e], d.group[a:e])
        if again is not None:
            m, n = again
            for i in range(a + m, a + m + n):
                if not repeat[i]:
                    repeat[i] = True
                    first_of[i] = i - m
        for k, i in mine.items():
            before.setdefault(k, i)
    if not repeat.any():
        return d
    i = int(np.flatnonzero(repeat)[0])
    n = int(repeat.sum())
    out = _take(d, ~repeat)
    out.warnings.append(f"{n:,} row{'s' if n > 1 else ''} repeat{'' if n > 1 else 's'} identical rows of the same "
                        f"step written before and {'were' if n > 1 else 'was'} left out (first: {d.where(i)} repeats "
                        f"{d.where(first_of[i])}): the same trajectories written twice, e.g. by a resumed trainer "
                        "or by overlapping dumps.")
    return out


def _check_length_units(d: Dump) -> None:
    """Warn when ``response_length`` is in characters in some files and in tokens in others."""
    by_unit: dict[str, list[str]] = {}
    for f, u in zip(d.files, d.length_units, strict=True):
        if u is not None:
            by_unit.setdefault(u, []).append(Path(f).name)
    if len(by_unit) < 2:
        return

    def names(fs: list[str]) -> str:
        return ", ".join(fs[:3]) + (f" and {len(fs) - 3} more" if len(fs) > 3 else "")

    ch, tok = by_unit[CHARACTERS], by_unit[TOKENS]
    d.warnings.append(f"response_length is in characters in {len(ch)} file{'s' if len(ch) > 1 else ''} ({names(ch)}) "
                      f"and in tokens in {len(tok)} ({names(tok)}): lengths in two units cannot be averaged, so "
                      "reward.length_hacking is skipped; diagnose them separately.")

