"""The results file of ``creditlab fork score``: its rows and what is set aside on resume.

* The lock of ``--out`` (a run owns it while it runs) is :class:`creditlab._outlock.OutLock`,
  the lock of every output creditlab writes.
* :func:`scan_results`: reads ``--out`` and decides from its content whether it is a results file
  (every line a JSON object with the fields a row has). A line cut off by a killed run (no newline
  at the end, or not valid JSON) is not a row: :func:`set_aside` moves it to ``<out>.torn`` and its
  item is scored again. Anything else (a CSV, a parquet file, the responses themselves) is refused
  and left as it is.
* :class:`RowWriter`: one ``write`` of a whole line per row on an append-only descriptor, so a killed
  process leaves whole lines (and at worst one cut-off last line, which the next scan sets aside);
  ``fsync`` at most every ``fsync_every`` seconds and on close.
* :func:`compact`: the last row per id, written to a temporary file and renamed over ``--out``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from creditlab.errors import ConfigError

__all__ = ["ROW_KEYS", "RowWriter", "Scan", "check_cache", "compact", "scan_results", "set_aside",
           "truncate"]

#: Fields every row of a results file has (rows also carry ``settings``; rows of older versions did not,
#: and a resume refuses them as rows made with other settings).
ROW_KEYS = ("id", "reward", "error")
#: How every row starts (``ForkResult.to_row`` puts ``id`` first): a cut-off line that starts so is a
#: row cut off by a killed run, even when no whole row precedes it.
ROW_START = b'{"id": '
_NOT_OURS = "choose another --out (--force never overwrites a file that fork score did not write)"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path.parent if str(path.parent) else ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- reading a results file -------------------------------------------------------------------------


@dataclass
class Scan:
    """What :func:`scan_results` found: the rows (with their raw lines, for a byte-exact rewrite), the
    damaged lines to set aside (line number, raw bytes, why) and whether a final newline is missing
    after a whole row."""

    rows: list[dict] = field(default_factory=list)
    lines: list[bytes] = field(default_factory=list)
    torn: list[tuple[int, bytes, str]] = field(default_factory=list)
    needs_newline: bool = False
    blank: int = 0


def _what(obj: Any) -> str:
    if isinstance(obj, dict):
        missing = [k for k in ROW_KEYS if k not in obj]
        return f"a JSON object without {', '.join(repr(k) for k in missing)} (fields every results row has)"
    return f"a JSON {type(obj).__name__}, not an object"


def scan_results(out: Path) -> Scan:
    """Read ``out`` (missing: no rows). Raises a :class:`ConfigError` naming a line when the file is not
    a fork-score results file: a JSON line that is not a row, or, with no row at all, a line that is
    not JSON and does not start like a row. Lines that are not JSON in a results file are cut off or
    damaged rows: they go to ``Scan.torn``."""
    scan = Scan()
    if not out.exists():
        return scan
    try:
        data = out.read_bytes()
    except OSError as err:
        raise ConfigError("--out", f"cannot read {out}: {err.strerror}") from None
    if not data:
        return scan
    complete = data.endswith(b"\n")
    parts = data.split(b"\n")
    if complete:
        parts.pop()
    bad: list[tuple[int, bytes, str]] = []
    for n, raw in enumerate(parts, 1):
        if not raw.strip():
            scan.blank += 1
            continue
        try:
            obj = json.loads(raw)
        except ValueError:
            last = n == len(parts)
            why = ("cut off (no newline at the end)" if last and not complete
                   else "not valid JSON" + (" (cut off)" if last else ""))
            bad.append((n, raw, why))
            continue
        if not (isinstance(obj, dict) and all(k in obj for k in ROW_KEYS)):
            raise ConfigError("--out", f"{out} is not a fork-score results file (line {n} is {_what(obj)}); "
                                       + _NOT_OURS)
        scan.rows.append(obj)
        scan.lines.append(raw.rstrip(b"\r"))
        if n == len(parts) and not complete:
            scan.needs_newline = True
    if bad and not scan.rows and not all(raw.startswith(ROW_START) for _, raw, _ in bad):
        n = next(n for n, raw, _ in bad if not raw.startswith(ROW_START))
        kind = "not JSON" if _is_text(parts[n - 1]) else "not text (a binary file)"
        raise ConfigError("--out", f"{out} is not a fork-score results file (line {n} is {kind}); " + _NOT_OURS)
    scan.torn = bad
    return scan


def _is_text(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return b"\x00" not in raw


def _rewrite(out: Path, lines: list[bytes]) -> None:
    """Replace ``out`` by these lines at once: a temporary file, fsync, rename (a kill leaves either)."""
    tmp = out.with_name(out.name + ".tmp")
    try:
        with open(tmp, "wb") as fh:
            for raw in lines:
                fh.write(raw + b"\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise ConfigError("--out", f"cannot rewrite {out}: {err.strerror} (the file is as it was)") from None
    _fsync_dir(out)


def set_aside(out: Path, scan: Scan) -> str | None:
    """Move the damaged lines of ``scan`` to ``<out>.torn`` (appended) and rewrite ``out`` without them;
    end a whole last row with its missing newline. Returns a one-line note naming what was moved."""
    if scan.torn:
        torn = out.with_name(out.name + ".torn")
        with open(torn, "ab") as fh:
            for _, raw, _ in scan.torn:
                fh.write(raw + b"\n")
            fh.flush()
            os.fsync(fh.fileno())
        _rewrite(out, scan.lines)
        what = "; ".join(f"line {n}: {why}" for n, _, why in scan.torn[:3])
        more = f" and {len(scan.torn) - 3} more" if len(scan.torn) > 3 else ""
        return (f"{out}: {len(scan.torn)} damaged line(s) ({what}{more}) moved to {torn}; their items are "
                "scored again")
    if scan.needs_newline:
        with open(out, "ab") as fh:
            fh.write(b"\n")
            fh.flush()
            os.fsync(fh.fileno())
    return None


def truncate(out: Path) -> None:
    """Empty ``out`` (``--force``: its old rows are discarded)."""
    if out.exists():
        os.truncate(out, 0)


def compact(out: Path) -> list[dict]:
    """Keep the last row of each id (a rescored item replaces its earlier error row); rewrites ``out``
    only when something changes. Returns the rows kept."""
    scan = scan_results(out)
    if scan.torn:  # not written by this run (it holds the lock), but never dropped silently
        set_aside(out, scan)
    last: dict[str, tuple[dict, bytes]] = {}
    for row, raw in zip(scan.rows, scan.lines, strict=True):
        last[str(row.get("id"))] = (row, raw)
    if len(last) != len(scan.rows) or scan.blank or scan.needs_newline:
        _rewrite(out, [raw for _, raw in last.values()])
    return [row for row, _ in last.values()]


# -- writing rows ------------------------------------------------------------------------------------


class RowWriter:
    """Appends rows to ``path``: each row is one ``write`` of a whole line on an ``O_APPEND`` descriptor
    (what a killed process wrote is whole lines, at worst a cut-off last one), ``fsync`` at most every
    ``fsync_every`` seconds and on :meth:`close` (a power loss costs at most that much)."""

    def __init__(self, path: Path, fsync_every: float = 0.2):
        self.path = path
        self.fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.fsync_every = fsync_every
        self.written = 0
        self._synced = time.monotonic()

    def write(self, row: dict[str, Any]) -> None:
        assert self.fd is not None
        data = memoryview((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
        try:
            while data:
                data = data[os.write(self.fd, data):]
            now = time.monotonic()
            if now - self._synced >= self.fsync_every:
                os.fsync(self.fd)
                self._synced = now
        except OSError as err:  # a full disk: what is written stays; a cut-off last line is set aside next time
            raise ConfigError("--out", f"cannot write to {self.path}: {err.strerror}; {self.written} row(s) written "
                                       "by this run are kept: free some space and rerun the same command") from None
        self.written += 1

    def close(self) -> None:
        if self.fd is None:
            return
        try:
            os.fsync(self.fd)
        except OSError:
            pass  # a full disk, reported by the write that failed; the rows written are in the file
        finally:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> RowWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the judge cache path ------------------------------------------------------------------------------

SQLITE_MAGIC = b"SQLite format 3\x00"


def check_cache(cache: Path | None, inp: Path, out: Path) -> None:
    """``--cache``: not a directory, not ``--in`` or ``--out``, and, when it exists and is not empty, a
    SQLite database (one line naming the path otherwise; nothing is created or written here)."""
    if cache is None:
        return
    if cache.is_dir():
        raise ConfigError("--cache", f"{cache} is a directory; --cache names a SQLite file of judge replies")
    for other, name in ((out, "--out"), (inp, "--in")):
        if cache.resolve() == other.resolve():
            raise ConfigError("--cache", f"{cache} is also {name}; the cache needs a file of its own")
    if not cache.exists():
        return
    try:
        with open(cache, "rb") as fh:
            head = fh.read(len(SQLITE_MAGIC))
    except OSError as err:
        raise ConfigError("--cache", f"cannot read {cache}: {err.strerror}") from None
    if head and head != SQLITE_MAGIC:
        raise ConfigError("--cache", f"{cache} is not a SQLite database (a judge cache); it is left as it is: "
                                     "choose another --cache")
    if head:
        import sqlite3

        try:
            db = sqlite3.connect(f"file:{cache.resolve()}?mode=ro", uri=True)
            try:
                db.execute("PRAGMA schema_version").fetchone()
            finally:
                db.close()
        except sqlite3.Error as err:
            raise ConfigError("--cache", f"{cache} cannot be opened as a SQLite database ({err}); choose "
                                         "another --cache") from None
