"""Sweep runner: an executor interface over cells, with a results store.

A *cell* is one independent unit of a sweep (e.g. one configuration with all its seeds and arms
batched in one tensor program). ``run_cells`` runs only the cells missing from the store, persists
each one the moment it finishes, and shows a progress bar. Results depend only on the cell's
arguments (each cell seeds itself), so a rerun after a crash gives identical numbers.

Executors: :class:`SerialExecutor` (in process), :class:`ProcessPoolExecutorBackend` (local
process pool, the default when ``workers > 1``) and :class:`RayExecutor` (cells as Ray tasks, on a
local Ray instance or a cluster; ``pip install "creditlab[ray]"``). Any other backend plugs in by
implementing :class:`Executor` — ``submit_all`` yielding ``(cell, rows)`` as cells finish; the
driver (``run_cells``) stores each cell the moment it is yielded, so whatever the backend, a lost
worker or an interrupted driver loses no finished cell.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import multiprocessing as mp
import os
import socket
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import pandas as pd
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from creditlab.errors import ConfigError, CreditlabError, InputError
from creditlab.lab.store import ResultStore

__all__ = ["EXECUTORS", "Cell", "CellLost", "Executor", "ProcessPoolExecutorBackend", "RayExecutor", "SerialExecutor",
           "check_ray_address", "digest", "local_cpus", "make_executor", "run_cells"]


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


class CellLost(CreditlabError):
    """A cell could not be computed because the machinery running it failed (a worker process or node
    died and the backend's retries were spent). Cells finished before it are stored: rerun to compute
    the missing ones."""


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("--executor", 'ray is not installed: pip install "creditlab[ray]"') from None
    return ray


class RayExecutor:
    """Cells as Ray tasks (one CPU each), on the Ray cluster at ``address`` or on a local instance.

    Each cell is a task running :meth:`Cell.run`; finished cells come back to the driver (any order)
    as soon as Ray reports them, and the driver stores them, so a killed worker or driver loses no
    finished cell. A task whose worker process dies is retried ``max_retries`` times by Ray (the cell
    seeds itself, so a retry gives the same rows); past that :class:`CellLost` names the cell. At most
    ``max_pending`` tasks are submitted at once (default: twice the cluster's CPUs), so an interrupted
    driver has little to cancel and a sweep of thousands of cells does not flood the scheduler.

    Args:
        address: ``None`` starts a local Ray instance for the sweep (stopped at its end) unless this
            process is already connected to one, which is then used as it is; otherwise a Ray
            address (``auto``, ``HOST:PORT``, ``ray://HOST:PORT``). creditlab (and every module a cell
            function lives in) must be importable on the cluster's workers.
        num_cpus: CPUs of a local instance (default: all); ignored when connecting to a cluster.
        max_retries: retries of a task whose worker died (Ray's ``max_retries``).
        max_pending: most tasks submitted and not yet collected.
        runtime_env: Ray runtime environment of the tasks (e.g. ``{"pip": [...]}``), passed through.
    """

    def __init__(self, address: str | None = None, *, num_cpus: int | None = None, max_retries: int = 2,
                 max_pending: int | None = None, runtime_env: dict[str, Any] | None = None):
        if num_cpus is not None and (isinstance(num_cpus, bool) or not isinstance(num_cpus, int) or num_cpus < 1):
            raise ConfigError("--workers", f"must be an integer >= 1, got {num_cpus!r}")
        if max_retries < 0:
            raise ConfigError("max_retries", f"must be >= 0, got {max_retries}")
        if max_pending is not None and max_pending < 1:
            raise ConfigError("max_pending", f"must be >= 1, got {max_pending}")
        self.ray = _import_ray()
        self.address = address
        self.num_cpus = num_cpus
        self.max_retries = max_retries
        self.max_pending = max_pending
        self.runtime_env = runtime_env

    def _connect(self) -> bool:
        """Connect (or start a local instance); True when this call started the connection."""
        ray = self.ray
        if ray.is_initialized():
            return False
        opts: dict[str, Any] = {"include_dashboard": False, "logging_level": "WARNING"}
        if self.address is None:
            opts["num_cpus"] = self.num_cpus
        try:
            ray.init(address=self.address, **opts)
        except (ConnectionError, ValueError, RuntimeError) as err:
            where = self.address or "a local instance"
            raise ConfigError("--ray-address", f"cannot connect to Ray at {where}: {err}") from None
        return True

    def submit_all(self, cells: Sequence[Cell]) -> Iterator[tuple[Cell, list[dict]]]:
        if not cells:
            return
        ray = self.ray
        started = self._connect()
        try:
            task = ray.remote(num_cpus=1, max_retries=self.max_retries)(_run_cell)
            if self.runtime_env:
                task = task.options(runtime_env=self.runtime_env)
            window = self.max_pending or max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))
            queue = list(reversed(cells))
            pending: dict[Any, Cell] = {}
            try:
                while queue or pending:
                    while queue and len(pending) < window:
                        cell = queue.pop()
                        pending[task.remote(cell)] = cell
                    # a bounded wait returns to Python regularly, so Ctrl-C is seen at once
                    ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
                    for ref in ready:
                        cell = pending.pop(ref)
                        try:
                            rows = ray.get(ref)
                        except ray.exceptions.RayTaskError:
                            raise  # the cell's own exception (an instance of its type as well)
                        except ray.exceptions.RayError as err:
                            raise CellLost(f"cell {cell.key!r} was lost ({type(err).__name__}: "
                                           f"{str(err).splitlines()[0] if str(err) else ''}); the cells finished "
                                           "before it are stored: rerun to compute the rest") from None
                        yield cell, rows
            finally:
                # Cancel what is left (a Ctrl-C, or a lost cell): queued tasks are dropped, running ones are
                # interrupted in their worker, which stays alive for the next sweep.
                for ref in pending:
                    ray.cancel(ref)
        finally:
            if started:
                ray.shutdown()


#: Executor names of ``--executor``.
EXECUTORS = ("serial", "process", "ray")


def local_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one, else the CPU count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


def check_ray_address(address: str, timeout: float = 3.0) -> None:
    """Fail fast when nothing listens at a ``HOST:PORT`` or ``ray://HOST:PORT`` Ray address (Ray itself
    retries for minutes); ``auto`` is left to Ray."""
    if address == "auto":
        return
    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError("--ray-address", f"expected auto, HOST:PORT or ray://HOST:PORT, got {address!r}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as err:
        raise ConfigError("--ray-address", f"nothing answers at {hostport} ({err.strerror or err}); start the "
                                           "cluster there (ray start --head), or drop --ray-address to run on a "
                                           "local Ray instance") from None


def make_executor(workers: int = 1, kind: str | None = None, address: str | None = None, *,
                  warn: Callable[[str], None] | None = None) -> Executor:
    """``serial`` (in process), ``process`` (a local pool of ``workers`` processes) or ``ray`` (Ray tasks
    on the cluster at ``address``, or on a local instance of ``workers`` CPUs when ``workers > 1``, of all
    CPUs otherwise); ``kind=None`` picks ``process`` when ``workers > 1``. ``serial`` with ``workers > 1`` is a
    :class:`ConfigError` naming both flags (it would run one cell at a time).

    A local executor (``process``, or ``ray`` without ``address``) gets at most :func:`local_cpus`
    workers: more only oversubscribe the cores; the cap is reported through ``warn`` (default
    :func:`warnings.warn`). On a cluster its resources decide. A ``HOST:PORT`` address that nothing
    answers at is an error at once (:func:`check_ray_address`)."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError("--workers", f"must be an integer >= 1, got {workers!r}")
    kind = kind or ("process" if workers > 1 else "serial")
    if kind not in EXECUTORS:
        raise ConfigError("--executor", f"unknown executor {kind!r}; valid: {', '.join(EXECUTORS)}")
    if address is not None and kind != "ray":
        raise ConfigError("--ray-address", f"needs --executor ray (got --executor {kind})")
    if kind == "serial" and workers > 1:  # the serial executor has no workers: --workers would do nothing
        raise ConfigError("--workers", f"--workers {workers} with --executor serial: the serial executor runs one cell "
                                       f"at a time in this process; drop --workers, or use --executor process (or "
                                       f"ray) to run {workers} cells at a time")
    cpus = local_cpus()
    if workers > cpus and address is None and kind != "serial":
        (warn or (lambda m: warnings.warn(m, stacklevel=3)))(
            f"--workers {workers} is more than the {cpus} CPUs of this machine: using {cpus}")
        workers = cpus
    if kind == "ray":
        if address is not None:
            check_ray_address(address)
        return RayExecutor(address, num_cpus=workers if workers > 1 and address is None else None)
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
