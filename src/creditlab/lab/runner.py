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
import multiprocessing as mp
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import pandas as pd
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from creditlab.errors import InputError
from creditlab.lab.store import ResultStore

__all__ = ["Cell", "Executor", "ProcessPoolExecutorBackend", "SerialExecutor", "make_executor", "run_cells"]


@dataclass(frozen=True)
class Cell:
    """One unit of work: ``fn(**kwargs)`` returns a list of row dicts. ``fn`` must be picklable
    (a module-level function) for process-pool execution."""

    key: str
    fn: Callable[..., list[dict]]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def run(self) -> list[dict]:
        return self.fn(**self.kwargs)


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
        ctx = mp.get_context("spawn")
        with cf.ProcessPoolExecutor(max_workers=self.workers, mp_context=ctx) as pool:
            futures = {pool.submit(_run_cell, c): c for c in cells}
            try:
                for fut in cf.as_completed(futures):
                    yield futures[fut], fut.result()
            except BaseException:
                for f in futures:
                    f.cancel()
                raise


def make_executor(workers: int) -> Executor:
    if workers < 1:
        from creditlab.errors import ConfigError

        raise ConfigError("workers", f"must be >= 1, got {workers}")
    return SerialExecutor() if workers == 1 else ProcessPoolExecutorBackend(workers)


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
    executor = executor or make_executor(min(workers, max(1, len(todo))))
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
