"""Sweep runner: an executor interface over cells, with a results store.

A *cell* is one independent unit of a sweep (e.g. one configuration with all its seeds and arms
batched in one tensor program). ``run_cells`` runs only the cells missing from the store, persists
each one the moment it finishes, and shows a progress bar. Results depend only on the cell's
arguments (each cell seeds itself), so a rerun after a crash gives identical numbers.

Executors: :class:`SerialExecutor` (in process) and :class:`ProcessPoolExecutorBackend` (local
process pool, the default when ``workers > 1``). A distributed backend (e.g. Ray) plugs in by
implementing :class:`Executor` — ``submit_all`` yielding ``(cell, rows)`` as cells finish.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import multiprocessing as mp
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import pandas as pd
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from creditlab.errors import InputError
from creditlab.lab.store import ResultStore

__all__ = ["EXECUTORS", "Cell", "Executor", "ProcessPoolExecutorBackend", "SerialExecutor", "digest", "make_executor",
           "run_cells"]


def digest(value: Any) -> str:
    """Short content hash of a JSON-able value (the one way cell keys are built)."""
    try:
        text = json.dumps(value, sort_keys=True, allow_nan=True)
    except TypeError as err:
        raise InputError(f"cell arguments must be JSON values (numbers, strings, lists, dicts): {err}") from None
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Cell:
    """One unit of work: ``fn(**kwargs)`` returns a list of row dicts.

    ``kwargs`` are plain JSON values (the cell rebuilds its config from them), so the key
    ``<group>/<name>/<digest of kwargs>`` changes whenever anything that could change the rows
    does, and a store never hands back rows computed with other arguments. ``fn`` must be a
    module-level function (picklable for process-pool execution). ``group`` names the table
    family the rows belong to (e.g. an experiment); ``name`` is for people (``"C=4"``).
    ``context`` holds arguments that cannot change the rows (e.g. where a cached model lives):
    passed to ``fn`` too, but not part of the key.
    """

    group: str
    name: str
    fn: Callable[..., list[dict]]
    kwargs: dict[str, Any] = field(default_factory=dict)
    context: dict[str, Any] = field(default_factory=dict)
    key: str = field(init=False)

    def __post_init__(self) -> None:
        clash = set(self.kwargs) & set(self.context)
        if clash:
            raise InputError(f"cell {self.name!r}: {sorted(clash)} given both as kwargs and as context")
        object.__setattr__(self, "key", f"{self.group}/{self.name}/{digest(self.kwargs)}")

    def run(self) -> list[dict]:
        return self.fn(**self.kwargs, **self.context)


class Executor(Protocol):
    def submit_all(self, cells: Sequence[Cell]) -> Iterator[tuple[Cell, list[dict]]]:
        """Run the cells, yielding each with its rows as soon as it finishes (any order)."""
        ...


def _run_cell(cell: Cell) -> list[dict]:
    import torch

    torch.set_num_threads(1)  # one process per core; avoid oversubscription
    return cell.run()


class SerialExecutor:
    def submit_all(self, cells: Sequence[Cell]) -> Iterator[tuple[Cell, list[dict]]]:
        for cell in cells:
            yield cell, cell.run()


class ProcessPoolExecutorBackend:
    def __init__(self, workers: int):
        self.workers = workers

    def submit_all(self, cells: Sequence[Cell]) -> Iterator[tuple[Cell, list[dict]]]:
        if not cells:
            return
        ctx = mp.get_context("spawn")
        with cf.ProcessPoolExecutor(max_workers=min(self.workers, len(cells)), mp_context=ctx) as pool:
            futures = {pool.submit(_run_cell, c): c for c in cells}
            try:
                for fut in cf.as_completed(futures):
                    yield futures[fut], fut.result()
            except BaseException:
                for f in futures:
                    f.cancel()
                raise


#: Executor names of ``--executor``.
EXECUTORS = ("serial", "process")


def make_executor(workers: int = 1, kind: str | None = None) -> Executor:
    """``serial`` (in process) or ``process`` (a local pool of ``workers`` processes); ``kind=None``
    picks ``process`` when ``workers > 1``."""
    from creditlab.errors import ConfigError

    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError("--workers", f"must be an integer >= 1, got {workers!r}")
    kind = kind or ("process" if workers > 1 else "serial")
    if kind not in EXECUTORS:
        raise ConfigError("--executor", f"unknown executor {kind!r}; valid: {', '.join(EXECUTORS)}")
    return SerialExecutor() if kind == "serial" else ProcessPoolExecutorBackend(workers)


def run_cells(
    cells: Iterable[Cell],
    store: ResultStore,
    *,
    workers: int = 1,
    executor: Executor | None = None,
    desc: str = "cells",
    progress: bool = True,
) -> pd.DataFrame:
    """Run the cells missing from ``store`` and return the rows of all ``cells`` (stored + new)."""
    cells = list(cells)
    keys = [c.key for c in cells]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise InputError(f"cells: duplicate key {dup!r}")
    done = store.done()
    todo = [c for c in cells if c.key not in done]
    executor = executor or make_executor(workers)
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        disable=not progress,
        transient=False,
    ) as bar:
        task = bar.add_task(desc, total=len(cells), completed=len(cells) - len(todo))
        if todo:
            for cell, rows in executor.submit_all(todo):
                store.put(cell.key, rows)
                bar.advance(task)
    return store.frame(set(keys))
