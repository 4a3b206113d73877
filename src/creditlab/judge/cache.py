"""A sqlite cache of validated judge replies, keyed by a content hash of the request.

The key is the SHA-256 of (model, sampling parameters, messages, reply schema, prompt version), so
changing any of them misses the cache. Only replies that passed validation are stored: a bad
reply is never served again.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

__all__ = ["JudgeCache", "cache_key"]


def cache_key(*, model: str, params: dict[str, Any], messages: list[dict[str, str]],
              schema: dict[str, Any] | None, prompt_version: str) -> str:
    """Hex SHA-256 of the canonical JSON of everything that determines the reply."""
    blob = json.dumps(
        {"model": model, "params": params, "messages": messages, "schema": schema,
         "prompt_version": prompt_version},
        sort_keys=True, ensure_ascii=False, separators=(",", ":"),
    )
    return hashlib.sha256(blob.encode()).hexdigest()


class JudgeCache:
    """``get(key) -> decoded JSON | None`` and ``put(key, value)``; safe across threads."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS replies (key TEXT PRIMARY KEY, value TEXT NOT NULL)")

    def get(self, key: str) -> Any | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM replies WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def put(self, key: str, value: Any) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO replies (key, value) VALUES (?, ?)",
                             (key, json.dumps(value, ensure_ascii=False)))

    def __len__(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM replies").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()
