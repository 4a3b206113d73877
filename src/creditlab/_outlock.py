"""The lock every creditlab command takes on what it writes: ``creditlab diagnose``'s ``--out`` directory,
a lab's ``--out`` (and ``--dump``) directory, ``creditlab fork score``'s results file.

:class:`OutLock`: a run owns ``out`` while it runs: an exclusive ``flock`` on ``<out>.lock`` (beside
``out``, in its directory, which must therefore be writable), holding the pid, host, start time and
what the run does. A second writer is refused at once, naming the holder; a lock file left by a
killed run (the kernel released its lock with the process) is taken over and named.

It sits under every layer, beside :mod:`creditlab.errors` (it imports nothing of creditlab but
``errors``), so that ``diagnose``, the lab machinery and the CLI use the same lock without an import
between them.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from creditlab.errors import ConfigError

__all__ = ["OutLock"]


class OutLock:
    """Exclusive ownership of ``out`` for one run: ``flock`` on ``<out>.lock`` (next to the resolved path,
    so two spellings of one file or directory share a lock). :meth:`acquire` raises a :class:`ConfigError`
    naming ``flag`` and the run that holds the lock; :meth:`release` removes the lock file. ``what`` says
    what the run does (``"scoring in.jsonl"``, ``"creditlab lab coverage"``), for the message a second run
    gets; ``overrides``: the command's flag that discards earlier output (``--force``, ``--fresh``), which the
    message says does not override the lock. Where ``fcntl`` is missing (not POSIX) nothing is locked.

    The lock is per open file: a second :class:`OutLock` on the same path is refused even in the same
    process."""

    def __init__(self, out: str | os.PathLike[str], what: str = "", flag: str = "--out", overrides: str | None = None):
        self.out = Path(out)
        self.path = Path(str(self.out.resolve()) + ".lock")
        self.what = what
        self.flag = flag
        self.overrides = overrides
        self.fd: int | None = None

    @staticmethod
    def _read(fd: int, wait: bool = False) -> dict[str, Any]:
        """The record in the lock file (``wait``: give a holder that just locked a moment to write it)."""
        for _ in range(20 if wait else 1):
            try:
                raw = os.pread(fd, 4096, 0)
            except OSError:
                return {}
            if raw.strip():
                try:
                    info = json.loads(raw)
                except ValueError:
                    info = None
                return info if isinstance(info, dict) else {"raw": raw.decode("utf-8", "replace").strip()[:80]}
            if wait:
                time.sleep(0.01)
        return {}

    @staticmethod
    def _describe(info: dict[str, Any]) -> str:
        if "pid" not in info:
            return f"unknown process ({info['raw']!r})" if "raw" in info else "unknown process"
        parts = [f"pid {info['pid']}"]
        if info.get("host") and info["host"] != socket.gethostname():
            parts.append(f"on host {info['host']}")
        if info.get("started"):
            parts.append(f"started {info['started']}")
        if info.get("what"):
            parts.append(str(info["what"]))
        return ", ".join(parts)

    def _unwritable(self, err: OSError, mkdir: bool = False) -> ConfigError:
        where = self.path.parent
        if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return ConfigError(self.flag, f"the directory {where} is not writable ({err.strerror}): creditlab needs "
                                          f"it for the lock file {self.path} that keeps a second run from writing "
                                          f"{self.out} at the same time; make {where} writable, or choose a "
                                          f"{self.flag} in a writable directory")
        if mkdir:
            return ConfigError(self.flag, f"cannot create the directory {where} (of {self.out} and its lock file): "
                                          f"{err.strerror or err}")
        return ConfigError(self.flag, f"cannot create the lock file {self.path} in {where}: {err.strerror or err}")

    def acquire(self) -> str | None:
        """Take the lock; returns a one-line note when a stale lock (a killed run's) was taken over."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX
            return None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise self._unwritable(err, mkdir=True) from None
        for _ in range(10):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as err:
                raise self._unwritable(err) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = self._describe(self._read(fd, wait=True))
                os.close(fd)
                hint = f" ({self.overrides} does not override the lock of a running run)" if self.overrides else ""
                raise ConfigError(self.flag, f"{self.out} is being written by another run ({holder}; lock "
                                             f"{self.path}); wait for it to end or choose another {self.flag}{hint}"
                                  ) from None
            try:  # the file locked must still be the one at the path (a run that just ended removes it)
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            old = self._read(fd)
            me = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S"), "what": self.what}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
            os.fsync(fd)
            self.fd = fd
            if old:
                return (f"{self.out}: taking over the lock left by {self._describe(old)}, which no longer holds "
                        f"it (that run was killed or crashed)")
            return None
        raise ConfigError(self.flag, f"cannot lock {self.path}: another run keeps replacing it")

    def release(self) -> None:
        """Remove the lock file (while still holding it, so no run can lock the old file) and unlock."""
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> OutLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
