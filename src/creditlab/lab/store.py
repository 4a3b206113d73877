"""Results store for sweeps: every finished cell is persisted at once, atomically.

Layout: ``<path>/cells/<digest>.parquet``, one file per cell, holding that cell's rows plus a
``cell_key`` column. A file is written to a temporary name and renamed, so an interrupted run
(crash, Ctrl-C) never leaves a half-written cell; a rerun skips every key already present.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pandas as pd

from creditlab.errors import InputError

__all__ = ["ResultStore"]


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:24]


class ResultStore:
    """A directory of finished cells. Keys are arbitrary strings (e.g. ``"c_sweep/C=4/arm=uniform"``)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.cells_dir = self.path / "cells"
        self.cells_dir.mkdir(parents=True, exist_ok=True)

    def _file(self, key: str) -> Path:
        return self.cells_dir / f"{_digest(key)}.parquet"

    def __contains__(self, key: str) -> bool:
        return self._file(key).exists()

    def done(self) -> set[str]:
        """Keys of every persisted cell."""
        keys: set[str] = set()
        for f in self.cells_dir.glob("*.parquet"):
            keys.update(pd.read_parquet(f, columns=["cell_key"])["cell_key"].unique().tolist())
        return keys

    def put(self, key: str, rows: list[dict]) -> None:
        """Persist the rows of one finished cell (atomic: temp file then rename)."""
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise InputError(f"rows of cell {key!r}: expected a list of dicts")
        df = pd.DataFrame(rows)
        df["cell_key"] = key
        target = self._file(key)
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        df.to_parquet(tmp, index=False)
        os.replace(tmp, target)

    def get(self, key: str) -> pd.DataFrame:
        return pd.read_parquet(self._file(key))

    def frame(self, keys: set[str] | None = None) -> pd.DataFrame:
        """All rows (of ``keys`` if given) as one frame, in a stable order (sorted by cell key)."""
        frames = []
        for f in sorted(self.cells_dir.glob("*.parquet")):
            df = pd.read_parquet(f)
            if keys is None or df["cell_key"].iloc[0] in keys:
                frames.append(df)
        if not frames:
            return pd.DataFrame()
        out = pd.concat(frames, ignore_index=True)
        return out.sort_values("cell_key", kind="stable").reset_index(drop=True)
