"""Read rollout dumps (parquet, JSONL, directories of them, verl's ``rollout_data_dir``) into a :class:`Dump`.

A :class:`Dump` is columnar: one entry per trajectory for the trajectory columns, and the ragged
token columns concatenated into flat arrays with row offsets (:class:`TokenData`), so every
token-level check is a few vectorised passes whatever the number of rows.

Every malformed value raises :class:`creditlab.errors.InputError` naming the file, the row (the
line number in JSONL, the row number counted from 1 in parquet) and the column. Missing optional
columns are not errors: the checks that need them are skipped.

verl's own dumps (``trainer.rollout_data_dir``: one ``{step}.jsonl`` per step with ``input``,
``output``, ``score``, ``step`` and the reward function's extra fields) are recognised by their
columns and mapped onto the schema: ``group`` is the prompt text (``input``), ``reward`` the
``score``, ``response`` the ``output`` and ``response_length`` its length in characters (that
format has no tokens); ``precision`` and ``recall`` come along when the reward function returned
them (creditlab's FORK reward for verl does).
"""

from __future__ import annotations

import gzip
import itertools
import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from creditlab.diagnose.schema import COLUMNS, TOKEN_COLUMNS, is_number
from creditlab.errors import InputError

__all__ = ["Dump", "TokenData", "read_dump", "dump_files"]

Progress = Callable[[str, int, int], None]
"""``progress(what, done, total)``: called as files are read."""

FORMAT_CREDITLAB = "creditlab"
FORMAT_VERL = "verl rollout_data_dir"
_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
_SCALAR_FLOATS = ("response_length", "process_reward", "precision", "recall", "truncated")
_TEXT = ("response", "instruction")
DERIVE_TURN = -2
"""``TokenData.turn_ids`` of rows whose file had no ``turn_ids``: their turns are their policy runs."""


@dataclass
class TokenData:
    """The token columns of every row, flat: row ``i`` owns ``[offsets[i], offsets[i + 1])``.

    Rows without token columns (a file that has none) own an empty range and ``has_tokens`` False.
    """

    offsets: np.ndarray           # (N + 1,) int64
    logprobs: np.ndarray          # (M,) float64, NaN where a value was null
    rollout_logprobs: np.ndarray  # (M,) float64
    policy_mask: np.ndarray       # (M,) bool
    turn_ids: np.ndarray | None   # (M,) int64, or None when no file has turn_ids
    has_tokens: np.ndarray        # (N,) bool

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


@dataclass
class Dump:
    """Rows of one or more dump files. ``N`` trajectories, ``M`` tokens in all."""

    files: list[str]
    formats: list[str]               # per file: "creditlab" or "verl rollout_data_dir"
    row_file: np.ndarray             # (N,) index into files
    row_number: np.ndarray           # (N,) line (JSONL) or row (parquet, from 1) in its file
    step: np.ndarray                 # (N,) int64
    group: np.ndarray                # (N,) int64 codes of the group labels
    group_labels: list[Any]          # label of each code
    reward: np.ndarray               # (N,) float64
    tokens: TokenData | None         # None when no file has token columns
    scalars: dict[str, np.ndarray] = field(default_factory=dict)  # (N,) float64, NaN = missing
    texts: dict[str, list[str | None]] = field(default_factory=dict)
    turns: list[list[dict] | None] | None = None

    def __len__(self) -> int:
        return int(self.step.shape[0])

    @property
    def n_tokens(self) -> int:
        return 0 if self.tokens is None else int(self.tokens.offsets[-1])

    def has(self, column: str) -> bool:
        """Whether ``column`` holds a value in at least one row."""
        if column in ("step", "group", "reward"):
            return len(self) > 0
        if column in TOKEN_COLUMNS:
            return self.tokens is not None and bool(self.tokens.has_tokens.any())
        if column == "turn_ids":
            return self.tokens is not None and self.tokens.turn_ids is not None
        if column in self.scalars:
            return bool(np.isfinite(self.scalars[column]).any())
        if column in self.texts:
            return any(v is not None for v in self.texts[column])
        if column == "turns":
            return self.turns is not None and any(t is not None for t in self.turns)
        return False

    def where(self, i: int) -> str:
        """``file: line N`` (or ``row N``) of trajectory ``i``."""
        f = int(self.row_file[i])
        unit = "row" if self.files[f].endswith(".parquet") else "line"
        return f"{self.files[f]}: {unit} {int(self.row_number[i])}"


# ------------------------------------------------------------------------------------------------
# files
# ------------------------------------------------------------------------------------------------


def _natural(p: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]


def dump_files(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """The dump files behind ``paths``: files as given, directories expanded to their ``*.jsonl``,
    ``*.jsonl.gz`` and ``*.parquet`` files (not recursive, in natural order: ``2.jsonl`` before
    ``10.jsonl``)."""
    if not paths:
        raise InputError("no dump given")
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted((q for q in p.iterdir() if q.is_file() and q.name.endswith(_SUFFIXES)), key=_natural)
            if not found:
                raise InputError(f"{p}: directory holds no .jsonl, .jsonl.gz or .parquet file")
            out += found
        elif p.is_file():
            if not p.name.endswith(_SUFFIXES):
                raise InputError(f"{p}: not a dump (expected .jsonl, .jsonl.gz, .parquet or a directory of them)")
            out.append(p)
        else:
            raise InputError(f"{p}: no such file or directory")
    return out


def read_dump(paths: str | os.PathLike | Sequence[str | os.PathLike], *,
              progress: Progress | None = None) -> Dump:
    """Read and validate one or more dumps (files or directories) into one :class:`Dump`."""
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    files = dump_files(paths)
    total = sum(f.stat().st_size for f in files)
    done = 0
    parts = []
    for f in files:
        size = f.stat().st_size
        tick = None
        if progress is not None:
            def tick(n: int, f=f, base=done, size=size) -> None:  # within a file, by bytes read
                progress(f"read {f.name}", base + min(n, size), total)
        parts.append(_read_file(f, tick))
        done += size
        if progress is not None:
            progress(f"read {f.name}", done, total)
    return _concat([str(f) for f in files], parts)


# ------------------------------------------------------------------------------------------------
# one file -> a part
# ------------------------------------------------------------------------------------------------


@dataclass
class _Part:
    fmt: str
    n: int
    row_number: np.ndarray
    step: np.ndarray
    group: list[Any]
    reward: np.ndarray
    tokens: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None] | None
    scalars: dict[str, np.ndarray]
    texts: dict[str, list[str | None]]
    turns: list[list[dict] | None] | None


class _Where:
    """Names a row of a file in error messages."""

    def __init__(self, path: Path, unit: str, numbers: np.ndarray):
        self.path, self.unit, self.numbers = path, unit, numbers

    def __call__(self, i: int, column: str) -> str:
        return f"{self.path}: {self.unit} {int(self.numbers[i])}: column '{column}'"


def _read_file(path: Path, tick: Callable[[int], None] | None) -> _Part:
    if path.name.endswith(".parquet"):
        return _read_parquet(path)
    return _read_jsonl(path, tick)


def _open_text(path: Path):
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _read_jsonl(path: Path, tick: Callable[[int], None] | None = None) -> _Part:
    rows: list[dict] = []
    numbers: list[int] = []
    read = 0  # characters, about the bytes of the (uncompressed) file
    try:
        with _open_text(path) as fh:
            for n, line in enumerate(fh, 1):
                read += len(line)
                if tick is not None and n % 2000 == 0:
                    tick(read)
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as err:
                    raise InputError(f"{path}: line {n}: not valid JSON ({err.msg} at column {err.colno})") from None
                if not isinstance(obj, dict):
                    raise InputError(f"{path}: line {n}: expected a JSON object (one trajectory), "
                                     f"got {type(obj).__name__}")
                rows.append(obj)
                numbers.append(n)
    except (OSError, UnicodeDecodeError, EOFError) as err:
        raise InputError(f"{path}: cannot be read ({err})") from None
    if not rows:
        raise InputError(f"{path}: holds no rows")
    where = _Where(path, "line", np.asarray(numbers))
    names: set[str] = set()
    for r in rows:
        names.update(r)
    if _is_verl(names):
        return _from_verl(rows, where)

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

    return _build(FORMAT_CREDITLAB, len(rows), where, names.__contains__, values, flat)


def _is_verl(names: set[str]) -> bool:
    return {"input", "output", "score", "step"} <= names and not ({"reward", "group"} & names)


def _from_verl(rows: list[dict], where: _Where) -> _Part:
    n = len(rows)
    step = _int_column([r.get("step") for r in rows], "step", where)
    group = []
    for i, r in enumerate(rows):
        v = r.get("input")
        if not isinstance(v, str):
            raise InputError(f"{where(i, 'input')}: expected the prompt text, got {type(v).__name__}")
        group.append(v)
    reward = _float_column([r.get("score") for r in rows], "score", where, required=True)
    response = []
    for i, r in enumerate(rows):
        v = r.get("output")
        if not isinstance(v, str):
            raise InputError(f"{where(i, 'output')}: expected the response text, got {type(v).__name__}")
        response.append(v)
    scalars = {"response_length": np.asarray([len(v) for v in response], dtype=np.float64)}
    for name in ("precision", "recall"):
        if any(name in r for r in rows):
            scalars[name] = _float_column([r.get(name) for r in rows], name, where, required=False)
    return _Part(FORMAT_VERL, n, where.numbers, step, group, reward, None, scalars, {"response": response}, None)


def _read_parquet(path: Path) -> _Part:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as err:
        raise InputError(f"{path}: not a readable parquet file ({err})") from None
    n = table.num_rows
    if n == 0:
        raise InputError(f"{path}: holds no rows")
    where = _Where(path, "row", np.arange(1, n + 1))
    names = set(table.column_names)
    if _is_verl(names):
        return _from_verl(table.to_pylist(), where)

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

    return _build(FORMAT_CREDITLAB, n, where, names.__contains__, values, flat)


# ------------------------------------------------------------------------------------------------
# validation
# ------------------------------------------------------------------------------------------------


def _first_row(lengths: list[int], k: int) -> tuple[int, int]:
    """(row, index within row) of flat element ``k``."""
    ends = np.cumsum(lengths)
    i = int(np.searchsorted(ends, k, side="right"))
    return i, k - int(ends[i] - lengths[i])


def _flat_floats(vals: Any, lengths: list[int], name: str, where: _Where) -> np.ndarray:
    a = vals if isinstance(vals, np.ndarray) else np.asarray(vals) if vals else np.zeros(0)
    if a.ndim == 1 and a.dtype.kind in "fiu":
        return a.astype(np.float64)
    # slow path: null elements become NaN, anything else that is not a number is an error
    out = np.empty(len(vals), dtype=np.float64)
    for k, v in enumerate(vals):
        if v is None:
            out[k] = math.nan
        elif is_number(v):
            out[k] = float(v)
        else:
            i, j = _first_row(lengths, k)
            raise InputError(f"{where(i, name)}: element {j} is {v!r}, expected a number")
    return out


def _flat_bools(vals: Any, lengths: list[int], name: str, where: _Where) -> np.ndarray:
    a = vals if isinstance(vals, np.ndarray) else np.asarray(vals) if vals else np.zeros(0, dtype=bool)
    if a.ndim == 1 and a.dtype == np.bool_:
        return a
    if a.ndim == 1 and a.dtype.kind in "iu" and bool(((a == 0) | (a == 1)).all()):
        return a.astype(bool)
    for k, v in enumerate(vals):
        if not (isinstance(v, bool | np.bool_) or (is_number(v) and v in (0, 1))):
            i, j = _first_row(lengths, k)
            raise InputError(f"{where(i, name)}: element {j} is {v!r}, expected true/false")
    return np.asarray([bool(v) for v in vals], dtype=bool)


def _flat_ints(vals: Any, lengths: list[int], name: str, where: _Where) -> np.ndarray:
    a = vals if isinstance(vals, np.ndarray) else np.asarray(vals) if vals else np.zeros(0, dtype=np.int64)
    if a.ndim == 1 and a.dtype.kind in "iu":
        return a.astype(np.int64)
    for k, v in enumerate(vals):
        if not (is_number(v) and float(v) == int(v)):
            i, j = _first_row(lengths, k)
            raise InputError(f"{where(i, name)}: element {j} is {v!r}, expected an integer")
    return np.asarray([int(v) for v in vals], dtype=np.int64)


def _bulk(vals: Any) -> np.ndarray | None:
    """``vals`` as a numeric numpy array when every value is a plain number (no bool, None or text)."""
    if not isinstance(vals, np.ndarray) and (not len(vals) or any(type(v) is bool for v in vals)):
        return None  # numpy would read True as 1
    a = vals if isinstance(vals, np.ndarray) else np.asarray(vals)
    return a if a.ndim == 1 and a.dtype.kind in "fiu" else None


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
    a = vals if isinstance(vals, np.ndarray) else np.asarray(vals) if len(vals) else None
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
            turns.append({"tool": d["tool"], "args": dict(d["args"] or {}), "returned": d["returned"],
                          "is_write": d["is_write"], "process_score": None if ps is None else float(ps)})
        out.append(turns)
    return out


def _build(fmt: str, n: int, where: _Where, has: Callable[[str], bool], values, flat) -> _Part:
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
        for name, lens in (("rollout_logprobs", rl_n), ("policy_mask", pm_n)):
            if lens != lp_n:
                i = next(k for k in range(n) if lens[k] != lp_n[k])
                raise InputError(f"{where(i, name)}: {lens[i]} values, but 'logprobs' has {lp_n[i]}")
        rlp = _flat_floats(rl_v, rl_n, "rollout_logprobs", where)
        pm = _flat_bools(pm_v, pm_n, "policy_mask", where)
        tid = None
        got = flat("turn_ids") if has("turn_ids") else None
        if got is not None:
            t_v, t_n = got
            if t_n != lp_n:
                i = next(k for k in range(n) if t_n[k] != lp_n[k])
                raise InputError(f"{where(i, 'turn_ids')}: {t_n[i]} values, but 'logprobs' has {lp_n[i]}")
            tid = _flat_ints(t_v, t_n, "turn_ids", where)
            if tid.size and int(tid.min()) < -1:
                k = int(np.argmin(tid))
                i, j = _first_row(t_n, k)
                raise InputError(f"{where(i, 'turn_ids')}: element {j} is {int(tid[k])}, expected a turn >= 0 "
                                 "or -1 outside turns")
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.asarray(lp_n, dtype=np.int64), out=offsets[1:])
        tokens = (offsets, lp, rlp, pm, tid)
    elif has("turn_ids"):
        raise InputError(f"{where.path}: column 'turn_ids' without the token columns {', '.join(TOKEN_COLUMNS)}")

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
    texts = {name: _text_column(values(name), name, where) for name in _TEXT if has(name)}
    turns = _turns_column(values("turns"), where) if has("turns") else None
    return _Part(fmt, n, where.numbers, step, group, reward, tokens, scalars, texts, turns)


def _concat(files: list[str], parts: list[_Part]) -> Dump:
    N = sum(p.n for p in parts)
    labels: dict[Any, int] = {}
    codes = np.empty(N, dtype=np.int64)
    k = 0
    for p in parts:
        for g in p.group:
            key = (type(g).__name__, g)
            codes[k] = labels.setdefault(key, len(labels))
            k += 1
    group_labels = [g for (_, g) in labels]
    tokens = None
    if any(p.tokens is not None for p in parts):
        lengths, lps, rlps, pms, tids, has = [], [], [], [], [], []
        any_tid = any(p.tokens is not None and p.tokens[4] is not None for p in parts)
        for p in parts:
            if p.tokens is None:
                lengths.append(np.zeros(p.n, dtype=np.int64))
                has.append(np.zeros(p.n, dtype=bool))
                continue
            off, lp, rlp, pm, tid = p.tokens
            lengths.append(np.diff(off))
            has.append(np.ones(p.n, dtype=bool))
            lps.append(lp)
            rlps.append(rlp)
            pms.append(pm)
            if any_tid:
                # a file without turn_ids: every run of policy tokens is a turn (derived by the checks)
                tids.append(tid if tid is not None else np.full(lp.shape[0], DERIVE_TURN, dtype=np.int64))
        offsets = np.zeros(N + 1, dtype=np.int64)
        np.cumsum(np.concatenate(lengths), out=offsets[1:])
        tokens = TokenData(offsets, np.concatenate(lps), np.concatenate(rlps), np.concatenate(pms),
                           np.concatenate(tids) if any_tid else None, np.concatenate(has))

    def cat_scalar(name: str) -> np.ndarray:
        return np.concatenate([p.scalars.get(name, np.full(p.n, np.nan)) for p in parts])

    scalars = {name: cat_scalar(name) for name in _SCALAR_FLOATS if any(name in p.scalars for p in parts)}
    texts = {name: list(itertools.chain.from_iterable(p.texts.get(name, [None] * p.n) for p in parts))
             for name in _TEXT if any(name in p.texts for p in parts)}
    turns = None
    if any(p.turns is not None for p in parts):
        turns = list(itertools.chain.from_iterable(p.turns if p.turns is not None else [None] * p.n for p in parts))
    return Dump(
        files=files, formats=[p.fmt for p in parts],
        row_file=np.concatenate([np.full(p.n, i, dtype=np.int64) for i, p in enumerate(parts)]),
        row_number=np.concatenate([p.row_number for p in parts]),
        step=np.concatenate([p.step for p in parts]), group=codes, group_labels=group_labels,
        reward=np.concatenate([p.reward for p in parts]), tokens=tokens, scalars=scalars, texts=texts,
        turns=turns,
    )

