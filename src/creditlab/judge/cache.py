"""A sqlite cache of validated judge replies, keyed by the request and the endpoint that answered it.

A reply is determined by what was asked and by who answered: the request key (:func:`cache_key`,
the SHA-256 of model name, sampling parameters, messages, reply schema and prompt version) and the
endpoint (:func:`endpoint_id`, the normalised base URL). Two servers may serve different models
under the same model name, so a reply is served only to a judge one of whose endpoints gave it,
unless the caller opts into any endpoint's replies (``get(..., endpoints=None)``; the CLI's
``--cache-any-endpoint``). Only replies that passed validation are stored: a bad reply is never
served again.

Not in the key: the API key (it says who pays, not what answers, and a cache of paid replies must
outlive a key rotation; nothing derived from it is stored), timeouts, retries and the transport.

Caches written before the endpoint was recorded (table ``replies``) are kept as they are: their
replies cannot be told apart by endpoint, so they are served only to a caller that takes any
endpoint's replies (:meth:`JudgeCache.legacy_count` says how many there are).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

__all__ = ["JudgeCache", "cache_key", "endpoint_id"]

_DEFAULT_PORTS = {"http": 80, "https": 443}


def cache_key(*, model: str, params: dict[str, Any], messages: list[dict[str, str]],
              schema: dict[str, Any] | None, prompt_version: str) -> str:
    """Hex SHA-256 of the canonical JSON of the request (the endpoint is the other half of the key)."""
    blob = json.dumps(
        {"model": model, "params": params, "messages": messages, "schema": schema,
         "prompt_version": prompt_version},
        sort_keys=True, ensure_ascii=False, separators=(",", ":"),
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def endpoint_id(base_url: str) -> str:
    """The identity of an endpoint: its base URL with scheme and host in lower case, the default port
    dropped, no user name or password, no trailing slash (the path is kept as written).

    >>> endpoint_id("HTTP://user:secret@Judge.Example:80/v1/")
    'http://judge.example/v1'
    """
    parts = urlsplit(base_url.strip())
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    netloc = host if port is None or port == _DEFAULT_PORTS.get(scheme) else f"{host}:{port}"
    return urlunsplit((scheme, netloc, parts.path.rstrip("/"), parts.query, ""))


class JudgeCache:
    """``get(key, endpoints=...) -> decoded JSON | None`` and ``put(key, value, endpoint=...)``; safe
    across threads. ``endpoints`` are :func:`endpoint_id` values."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS judge_replies (request TEXT NOT NULL, endpoint TEXT NOT NULL, "
                         "value TEXT NOT NULL, PRIMARY KEY (request, endpoint))")
        self._legacy = self._db.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'replies'").fetchone() is not None

    def get(self, key: str, *, endpoints: Sequence[str] | None) -> Any | None:
        """The reply to request ``key`` given by one of ``endpoints`` (endpoints the caller takes as
        replicas of one model); ``endpoints=None``: by any endpoint, including replies of a cache written
        before endpoints were recorded."""
        with self._lock:
            if endpoints is None:
                row = self._db.execute("SELECT value FROM judge_replies WHERE request = ? LIMIT 1", (key,)).fetchone()
                if row is None and self._legacy:
                    row = self._db.execute("SELECT value FROM replies WHERE key = ?", (key,)).fetchone()
            elif not endpoints:
                row = None
            else:
                marks = ", ".join("?" * len(endpoints))
                row = self._db.execute(f"SELECT value FROM judge_replies WHERE request = ? AND endpoint IN ({marks}) "
                                       "LIMIT 1", (key, *endpoints)).fetchone()
        return None if row is None else json.loads(row[0])

    def put(self, key: str, value: Any, *, endpoint: str) -> None:
        """Store the validated reply ``value`` to request ``key`` given by ``endpoint``."""
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO judge_replies (request, endpoint, value) VALUES (?, ?, ?)",
                             (key, endpoint, json.dumps(value, ensure_ascii=False)))

    def legacy_count(self) -> int:
        """Replies written by a creditlab that did not record the endpoint (served only to any endpoint)."""
        if not self._legacy:
            return 0
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM replies").fetchone()[0])

    def __len__(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM judge_replies").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()
