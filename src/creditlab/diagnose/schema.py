"""The rollout-dump schema: one row per trajectory, the same columns in parquet and JSONL.

:data:`COLUMNS` is the one table of the schema (docs/diagnose.md renders the same table);
:func:`rows_from_arrays` turns a padded ``(B, L)`` batch in the vocabulary of ``creditlab.core``
into rows, and :func:`write_dump` adds rows to a dump (JSONL, parquet or a directory of parts), never
truncating one.

In a dump, ``logprobs`` are the learner's log-probs at the sampling checkpoint (what ``core`` calls
``old_logprobs``): a dump is written before the update that uses it. A trainer that put the engine's
there instead (verl's bypass mode) says so in ``logprobs_source``; the policy tokens a rejection
sampler dropped from the loss stay in ``policy_mask`` and are marked in ``rejected``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from creditlab.errors import ConfigError, InputError

__all__ = [
    "COLUMNS",
    "Column",
    "TOKEN_COLUMNS",
    "TURN_FIELDS",
    "check_dump_path",
    "rows_from_arrays",
    "write_dump",
]


@dataclass(frozen=True)
class Column:
    """One column of the schema."""

    name: str
    level: str      # "trajectory" or "token"
    kind: str       # int, group, float, bool, str, float_list, bool_list, int_list, turns
    required: bool
    meaning: str


COLUMNS: tuple[Column, ...] = (
    Column("step", "trajectory", "int", True, "training step (update index) the rollout belongs to"),
    Column("group", "trajectory", "group", True, "prompt group (GRPO group / prompt id), int or str"),
    Column("reward", "trajectory", "float", True, "outcome reward the advantage used"),
    Column("logprobs", "token", "float_list", False,
           "learner log-probs of each token at the sampling checkpoint"),
    Column("rollout_logprobs", "token", "float_list", False, "log-probs the rollout engine reported"),
    Column("policy_mask", "token", "bool_list", False, "True on tokens the policy generated"),
    Column("turn_ids", "token", "int_list", False,
           "turn of each token, -1 outside turns (default: each run of policy tokens is a turn)"),
    Column("rejected", "token", "bool_list", False,
           "True on policy tokens the trainer's rejection sampling dropped from the loss (verl rollout_rs)"),
    Column("logprobs_source", "trajectory", "str", False,
           "where logprobs came from: 'learner' (default), or 'rollout ...' when they are the engine's "
           "(verl bypass mode)"),
    Column("response", "trajectory", "str", False, "response text"),
    Column("response_length", "trajectory", "float", False,
           "response length in tokens (the exporters write the policy tokens)"),
    Column("truncated", "trajectory", "bool", False, "ended by the length or action budget"),
    Column("process_reward", "trajectory", "float", False, "process reward of the trajectory"),
    Column("precision", "trajectory", "float", False, "FORK precision"),
    Column("recall", "trajectory", "float", False, "FORK (rubric) recall"),
    Column("instruction", "trajectory", "str", False, "the task instruction (values it gives need no read)"),
    Column("turns", "trajectory", "turns", False,
           "list of {tool, args, returned, is_write, process_score}, one per turn"),
)
COLUMN_BY_NAME: dict[str, Column] = {c.name: c for c in COLUMNS}
TOKEN_COLUMNS = ("logprobs", "rollout_logprobs", "policy_mask")
"""The token columns that come together: a dump has all three or none."""
LEARNER = "learner"
"""``logprobs_source`` of a row whose ``logprobs`` are the learner's (also what a row without the column means)."""
ENGINE_SOURCE = "rollout"
"""``logprobs_source`` values starting with this say ``logprobs`` are the rollout engine's own (verl's bypass mode
sets ``old_log_probs := rollout_log_probs``): the learner's were never computed, so no mismatch can be measured."""
VERL_BYPASS = "rollout (verl bypass mode)"
"""The ``logprobs_source`` creditlab's verl exporter writes in bypass mode."""
TURN_FIELDS = ("tool", "args", "returned", "is_write", "process_score")
"""Fields of one entry of ``turns`` (``process_score`` may be null or absent)."""
LOGPROB_TOL = 1e-4
"""A log-prob above this on a policy token is an input error (float rounding of ``log_softmax``
stays far below it): the column holds probabilities or other positive numbers."""
PROCESS_SCORE_RANGE = (-1.0, 1.0)
"""``turns[].process_score`` is in [0, 1], or signed in [-1, 1]; anything outside is an input error."""
SHARE_COLUMNS = ("precision", "recall")
"""Trajectory columns that are shares in [0, 1]; anything outside is an input error."""
VERL_NAMES = {"old_log_probs": "logprobs", "rollout_log_probs": "rollout_logprobs", "response_mask": "policy_mask",
              "uid": "group"}
"""verl's names of the schema's columns: a creditlab-format dump that uses them is an input error naming
the column to rename each to."""


def _to_numpy(name: str, x: Any, B: int | None = None) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        x = x.double().numpy() if x.is_floating_point() else x.numpy()
    a = np.asarray(x)
    if B is not None and (a.ndim < 1 or a.shape[0] != B):
        raise InputError(f"{name}: expected {B} rows (one per trajectory), got shape {a.shape}")
    return a


def rows_from_arrays(
    *,
    step: int | Sequence[int] | torch.Tensor,
    group_ids: Sequence[Any] | torch.Tensor,
    rewards: Sequence[float] | torch.Tensor,
    logprobs: torch.Tensor | np.ndarray | None = None,
    rollout_logprobs: torch.Tensor | np.ndarray | None = None,
    policy_mask: torch.Tensor | np.ndarray | None = None,
    valid_mask: torch.Tensor | np.ndarray | None = None,
    turn_ids: torch.Tensor | np.ndarray | None = None,
    rejected: torch.Tensor | np.ndarray | None = None,
    **columns: Sequence[Any] | torch.Tensor | None,
) -> list[dict[str, Any]]:
    """Rows of the dump schema from a padded batch of ``B`` trajectories.

    ``logprobs`` (the learner's, at the sampling checkpoint), ``rollout_logprobs``,
    ``policy_mask``, ``valid_mask``, ``turn_ids`` and ``rejected`` (bool: policy tokens rejection
    sampling dropped from the loss) are ``(B, L)``; each row keeps only its
    ``valid_mask`` tokens (all ``L`` without one), so padding never reaches the dump. ``step`` is
    one int or ``B`` of them; ``group_ids`` and ``rewards`` have ``B`` entries. Further
    ``columns`` (``response_length=``, ``truncated=``, ``turns=``, ...) are per-row sequences of
    ``B`` values (``None`` skips a column) and must be columns of :data:`COLUMNS`.

    >>> rows = rows_from_arrays(step=3, group_ids=[7], rewards=[1.0],
    ...                         logprobs=torch.tensor([[-1.0, -0.5, 0.0]]),
    ...                         rollout_logprobs=torch.tensor([[-1.1, -0.5, 0.0]]),
    ...                         policy_mask=torch.tensor([[True, True, False]]),
    ...                         valid_mask=torch.tensor([[True, True, False]]))
    >>> rows[0]["policy_mask"], rows[0]["step"], rows[0]["group"]
    ([True, True], 3, 7)
    """
    reward = _to_numpy("rewards", rewards).astype(np.float64).reshape(-1)
    B = reward.shape[0]
    groups = group_ids.tolist() if isinstance(group_ids, torch.Tensor | np.ndarray) else list(group_ids)
    if len(groups) != B:
        raise InputError(f"group_ids: expected {B} entries (one per reward), got {len(groups)}")
    steps = _to_numpy("step", step)
    steps = np.full(B, int(steps)) if steps.ndim == 0 else _to_numpy("step", steps, B).reshape(-1)
    token = {"logprobs": logprobs, "rollout_logprobs": rollout_logprobs, "policy_mask": policy_mask}
    given = [k for k, v in token.items() if v is not None]
    if given and len(given) != len(token):
        missing = [k for k in token if token[k] is None]
        raise InputError(f"{', '.join(missing)}: the token columns come together; got only {', '.join(given)}")
    if rejected is not None and not given:
        raise InputError(f"rejected: needs the token columns {', '.join(token)}")
    for name in columns:
        if name not in COLUMN_BY_NAME or COLUMN_BY_NAME[name].level != "trajectory" or COLUMN_BY_NAME[name].required:
            valid = [c.name for c in COLUMNS if c.level == "trajectory" and not c.required]
            raise ConfigError(name, f"not an optional trajectory column of the dump schema; valid: {', '.join(valid)}")
    extra = {k: (v.tolist() if isinstance(v, torch.Tensor | np.ndarray) else list(v))
             for k, v in columns.items() if v is not None}
    for k, v in extra.items():
        if len(v) != B:
            raise InputError(f"{k}: expected {B} entries (one per trajectory), got {len(v)}")

    rows: list[dict[str, Any]] = []
    for b in range(B):
        g = groups[b]
        rows.append({"step": int(steps[b]), "group": g if isinstance(g, str) else int(g), "reward": float(reward[b])})
    if given:
        lp = _to_numpy("logprobs", logprobs, B)
        rlp = _to_numpy("rollout_logprobs", rollout_logprobs, B)
        pm = _to_numpy("policy_mask", policy_mask, B)
        shape = lp.shape
        if lp.ndim != 2 or rlp.shape != shape or pm.shape != shape:
            raise InputError(f"logprobs {lp.shape}, rollout_logprobs {rlp.shape} and policy_mask {pm.shape} "
                             "must be the same (B, L)")
        if pm.dtype != np.bool_:
            raise InputError(f"policy_mask: must be boolean, got {pm.dtype}")
        vm = np.ones(shape, dtype=bool) if valid_mask is None else _to_numpy("valid_mask", valid_mask, B)
        if vm.shape != shape or vm.dtype != np.bool_:
            raise InputError(f"valid_mask: must be a boolean {shape}, got {vm.dtype} {vm.shape}")
        tid = None if turn_ids is None else _to_numpy("turn_ids", turn_ids, B)
        if tid is not None and tid.shape != shape:
            raise InputError(f"turn_ids: must be {shape}, got {tid.shape}")
        rej = None if rejected is None else _to_numpy("rejected", rejected, B)
        if rej is not None and (rej.shape != shape or rej.dtype != np.bool_):
            raise InputError(f"rejected: must be a boolean {shape}, got {rej.dtype} {rej.shape}")
        for b, row in enumerate(rows):
            keep = vm[b]
            row["logprobs"] = lp[b][keep].astype(np.float64).tolist()
            row["rollout_logprobs"] = rlp[b][keep].astype(np.float64).tolist()
            row["policy_mask"] = pm[b][keep].tolist()
            if tid is not None:
                row["turn_ids"] = tid[b][keep].astype(np.int64).tolist()
            if rej is not None:
                row["rejected"] = rej[b][keep].tolist()
    for k, v in extra.items():
        for row, x in zip(rows, v, strict=True):
            row[k] = x
    return rows


def _json_default(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, torch.Tensor | np.ndarray):
        return x.tolist()
    if isinstance(x, tuple | set | frozenset):
        return list(x)
    return str(x)


#: File names :func:`write_dump` writes as one file; any other name is a directory of parts (or an error, see
#: :func:`check_dump_path`).
DUMP_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")


def _dump_kind(path: Path) -> str | None:
    """``"jsonl"`` or ``"parquet"`` for a dump file name, None otherwise."""
    name = path.name
    if name.endswith((".jsonl", ".jsonl.gz")):
        return "jsonl"
    return "parquet" if name.endswith(".parquet") else None


def _parts(path: Path) -> list[Path]:
    return sorted(path.glob("part-*.parquet"))


def _first_line(path: Path) -> bytes:
    if path.name.endswith(".gz"):
        import gzip

        with gzip.open(path, "rb") as fh:
            return fh.readline()
    with open(path, "rb") as fh:
        return fh.readline()


def check_dump_path(path: str | os.PathLike, *, append: bool = True, name: str = "path") -> str:
    """Where :func:`write_dump` can write, checked before anything is written: ``"jsonl"``, ``"parquet"`` or
    ``"dir"``. Raises a :class:`ConfigError` naming ``name`` (the argument or flag the path came from) for:

    * a name that is neither a dump file (``*.jsonl``, ``*.jsonl.gz``, ``*.parquet``) nor a directory: an
      existing file of another kind, or a new path with another suffix (``dump.json``, ``dump.csv``); a
      new directory is a name without a suffix (or a directory created first);
    * a dump file name that is an existing directory, or a directory name that is an existing file;
    * an existing file that is not a dump (a ``*.jsonl`` whose first line is not a JSON object with
      ``step``, ``group`` and ``reward``; a ``*.parquet`` that is not a parquet file): a dump is appended
      to, and nothing else is ever replaced;
    * ``append=False`` and a dump that already holds rows (a non-empty file, a directory with parts).
    """
    p = Path(path)
    kind = _dump_kind(p)
    if kind is None:
        if p.is_dir():
            kind = "dir"
        elif p.exists():
            raise ConfigError(name, f"{p} is a file but not a dump file (*.jsonl, *.jsonl.gz, *.parquet); a dump is "
                                    "one of those or a directory: pass another path")
        elif p.suffix:
            raise ConfigError(name, f"{p} names neither a dump file (*.jsonl, *.jsonl.gz, *.parquet) nor a directory "
                                    f"(a name without a suffix, or an existing directory); did you mean "
                                    f"{p.with_suffix('.jsonl')}?")
        else:
            kind = "dir"
    elif p.is_dir():
        raise ConfigError(name, f"{p} is a directory, not a {kind} file: pass the directory without the suffix to "
                                "write parts into it, or another file name")
    if kind == "dir":
        if p.exists() and not p.is_dir():  # pragma: no cover - a race with another process
            raise ConfigError(name, f"{p} is a file, not a directory")
        if not append and p.is_dir() and _parts(p):
            raise ConfigError(name, f"{p} already holds a dump ({len(_parts(p))} part(s)) and append=False never adds "
                                    "to one: remove it first, or pass another path")
        return kind
    if p.exists() and not p.is_file():
        raise ConfigError(name, f"{p} is not a regular file (a device or a pipe): pass another path")
    if not p.is_file() or p.stat().st_size == 0:
        return kind
    if not append:
        raise ConfigError(name, f"{p} already holds a dump and append=False never replaces one: remove it first, or "
                                "pass another path (the default append=True adds the rows to it)")
    if kind == "jsonl":
        try:
            first = json.loads(_first_line(p))
        except (OSError, EOFError, ValueError) as err:
            first = err
        if not (isinstance(first, dict) and all(c.name in first for c in COLUMNS if c.required)):
            raise ConfigError(name, f"{p} exists and is not a rollout dump (its first line is not a JSON object with "
                                    "step, group and reward); write_dump appends to a dump and never replaces a "
                                    "file: pass another path")
    else:
        import pyarrow.parquet as pq

        try:
            pq.read_schema(p)
        except Exception as err:  # pyarrow raises ArrowInvalid, OSError...
            raise ConfigError(name, f"{p} exists and is not a parquet file ({type(err).__name__}); write_dump appends "
                                    "to a dump and never replaces a file: pass another path") from None
    return kind


def write_dump(rows: Iterable[Mapping[str, Any]], path: str | os.PathLike, *, append: bool = True) -> Path:
    """Add ``rows`` to the dump at ``path`` and return the file written. A dump is never truncated: called
    once per training step, every step is kept.

    * ``*.jsonl`` (or ``*.jsonl.gz``): one JSON object per line, appended to the file (a last line
      without its newline, cut off by a killed writer, is ended first so that it stays one bad line).
    * ``*.parquet``: one parquet file; an existing one is read and rewritten with the new rows after its
      own (a temporary file renamed over it, so a kill leaves the old or the new file). Each call reads
      the whole file: for a long run written a step at a time, use a directory.
    * a directory (an existing one, or a name without a suffix): each call writes the next
      ``part-NNNNN.parquet`` in it; ``creditlab diagnose DIR`` reads them all.
    * any other name (``dump.json``, an existing file that is not a dump) is a :class:`ConfigError`
      naming ``path`` (:func:`check_dump_path`), with nothing written.

    ``append=False``: refuse (:class:`ConfigError`) a dump that already holds rows instead of adding to it.
    No rows (an empty list, an iterator already used up) is an :class:`InputError` with nothing written: an
    empty file or part would make the whole dump unreadable.
    Values may be torch tensors and numpy arrays or scalars (as lists and numbers) in every format;
    ``turns`` entries are stored as JSON text in parquet (their values are of any type); the readers
    decode them.
    """
    path = Path(path)
    kind = check_dump_path(path, append=append)
    rows = [dict(r) for r in rows]
    if not rows:
        raise InputError(f"write_dump: no rows to write to {path} (an empty list, or an iterator already used up); "
                         "nothing was written")
    if kind == "jsonl":
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.name.endswith(".gz"):
            import gzip

            fh = gzip.open(path, "at", encoding="utf-8")
        else:
            if path.is_file() and path.stat().st_size:
                with open(path, "rb") as old:
                    old.seek(-1, os.SEEK_END)
                    torn = old.read(1) != b"\n"
            else:
                torn = False
            fh = open(path, "a", encoding="utf-8")
            if torn:
                fh.write("\n")
        with fh:
            for r in rows:
                fh.write(json.dumps(r, ensure_ascii=False, default=_json_default) + "\n")
        return path
    if kind == "parquet":
        path.parent.mkdir(parents=True, exist_ok=True)
        table = _parquet_table(rows)
        if path.is_file() and path.stat().st_size:
            import pyarrow as pa
            import pyarrow.parquet as pq

            old = pq.read_table(path)
            try:
                table = pa.concat_tables([old, table], promote_options="permissive")
            except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
                raise InputError(f"{path}: the new rows do not fit the rows already in the file ({err}); write them "
                                 "to another path") from None
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            _write_table(table, tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path
    path.mkdir(parents=True, exist_ok=True)
    taken = _parts(path)
    n = 1 + max((int(p.stem.split("-")[1]) for p in taken if p.stem.split("-")[1].isdigit()), default=-1)
    out = path / f"part-{n:05d}.parquet"
    tmp = path / f".part-{n:05d}.parquet.tmp"
    _write_parquet(rows, tmp)
    os.replace(tmp, out)
    return out


def _write_parquet(rows: list[dict[str, Any]], path: Path) -> None:
    _write_table(_parquet_table(rows), path)


def _write_table(table: Any, path: Path) -> None:
    import pyarrow.parquet as pq

    pq.write_table(table, path)


def _plain(v: Any) -> Any:
    """A column value as pyarrow takes it: a torch tensor or numpy array as a list (a 0-dim one as a
    number), a numpy scalar as a number, as the JSONL writer does (:func:`_json_default`)."""
    if isinstance(v, torch.Tensor | np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    return v


def _parquet_table(rows: list[dict[str, Any]]) -> Any:
    """The rows as one pyarrow table (the column types of the schema)."""
    import pyarrow as pa

    names: list[str] = []
    for r in rows:
        for k in r:
            if k not in names:
                names.append(k)
    cols: dict[str, pa.Array] = {}
    for k in names:
        vals = [_plain(r.get(k)) for r in rows]
        kind = COLUMN_BY_NAME[k].kind if k in COLUMN_BY_NAME else None
        if kind == "turns" or (kind is None and any(isinstance(v, Mapping | list) for v in vals)):
            cols[k] = pa.array([None if v is None else json.dumps(v, ensure_ascii=False, default=_json_default)
                                for v in vals], type=pa.string())
        elif kind == "float_list":
            cols[k] = pa.array(vals, type=pa.list_(pa.float64()), from_pandas=False)
        elif kind == "bool_list":
            cols[k] = pa.array(vals, type=pa.list_(pa.bool_()))
        elif kind == "int_list":
            cols[k] = pa.array(vals, type=pa.list_(pa.int64()))
        elif kind in ("float",):
            cols[k] = pa.array([None if v is None else float(v) for v in vals], type=pa.float64())
        else:
            cols[k] = pa.array(vals)
    return pa.table(cols)


def is_number(v: Any) -> bool:
    """A real number that is not a bool."""
    return isinstance(v, int | float | np.integer | np.floating) and not isinstance(v, bool | np.bool_)


def finite_or_none(v: Any) -> float | None:
    return float(v) if is_number(v) and math.isfinite(float(v)) else None
