"""The Ray executor on a local Ray instance (started and stopped here, one for the whole module).

What it must guarantee is the runner's: every finished cell is stored by the driver as it arrives,
so a killed worker or an interrupted driver loses no finished cell, a rerun computes only the
missing ones, and the stored rows are exactly those of the serial executor.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from creditlab.errors import ConfigError
from creditlab.lab.protocol import run_lab
from creditlab.lab.runner import Cell, CellLost, RayExecutor, SerialExecutor, local_cpus, make_executor, run_cells
from creditlab.lab.store import ResultStore
from creditlab.labs.coverage import LAB, CoverageConfig
from creditlab.train.chain import ChainTrainConfig

try:
    import ray
except ImportError:  # the dev extra installs ray; only a platform without its wheels gets here
    pytest.skip("ray is not installed for this Python/platform (pip install 'creditlab[ray]')",
                allow_module_level=True)

TINY = CoverageConfig(train=ChainTrainConfig(T=8, K=3, hidden=8, group=4, updates=4, eval_points=2), seeds=2,
                      Cs=(1, 4), vd_C=4, vds=(0.0, 1.0), shuffle_Cs=(4,), shuffle_vds=(1.0,), dose_C=2, dose_ks=(1, 6),
                      experiments=("c_sweep", "dose"))
TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def cluster():
    """One local Ray instance of 2 CPUs bound to the loopback interface, for every test here."""
    with pytest.MonkeyPatch.context() as mp:
        # Ray binds a local instance to the machine's outward address by default; keep it on loopback
        # (the environment variable reaches Ray's own processes, the constant this already-imported module).
        mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        mp.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False, raising=False)
        if ray.is_initialized():  # left connected by another module: start clean
            ray.shutdown()
        ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", object_store_memory=200 * 2**20)
        # the cell functions of this module travel by value: Ray's workers do not see tests/ on their path
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        try:
            yield ray.get_runtime_context().gcs_address
        finally:
            ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
            ray.shutdown()


@pytest.fixture(scope="module")
def serial_rows(tmp_path_factory):
    """The rows of the tiny sweep computed in process: what every Ray run must reproduce exactly."""
    store = ResultStore(tmp_path_factory.mktemp("serial"))
    return run_cells(LAB.cells(TINY), store, executor=SerialExecutor(), progress=False)


class CountingStore(ResultStore):
    """A results store that counts how often each cell is stored (computed cells)."""

    def __init__(self, path):
        super().__init__(path)
        self.puts: dict[str, int] = {}

    def put(self, key, rows):
        super().put(key, rows)
        self.puts[key] = self.puts.get(key, 0) + 1


def tracked(*, fn, log: str, delay: float, **kwargs):
    """Run ``fn(**kwargs)`` after ``delay`` s, leaving ``start-<pid>-<n>`` in ``log`` (the pid to kill)."""
    Path(log, f"start-{os.getpid()}-{time.time_ns()}").touch()
    time.sleep(delay)
    return fn(**kwargs)


def slow_cells(log: Path, delay: float) -> list[Cell]:
    """The tiny sweep's cells with the same keys (``fn``, ``log``, ``delay`` are context), each slowed."""
    log.mkdir(parents=True, exist_ok=True)
    return [Cell(c.group, c.name, tracked, c.kwargs, {"fn": c.fn, "log": str(log), "delay": delay})
            for c in LAB.cells(TINY)]


def kill_first_worker(log: Path, killed: list[int], timeout: float = 60.0) -> threading.Thread:
    """Kill (SIGKILL) the first worker process that starts a cell, from a background thread."""

    def run() -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            starts = sorted(log.glob("start-*"))
            if starts:
                pid = int(starts[0].name.split("-")[1])
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.02)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def same_rows(frame: pd.DataFrame, expected: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(frame.reset_index(drop=True), expected.reset_index(drop=True))


def test_ray_sweep_stores_exactly_the_serial_rows(cluster, tmp_path, serial_rows):
    res = run_lab(LAB, TINY, tmp_path, RayExecutor(), progress=False)
    assert res.computed == len(LAB.cells(TINY))
    same_rows(ResultStore(tmp_path / "store").frame(), serial_rows)


def test_killed_worker_is_retried_and_every_cell_stored_once(cluster, tmp_path, serial_rows):
    cells = slow_cells(tmp_path / "log", delay=0.5)
    store = CountingStore(tmp_path / "store")
    killed: list[int] = []
    killer = kill_first_worker(tmp_path / "log", killed)
    frame = run_cells(cells, store, executor=RayExecutor(max_retries=2), progress=False)
    killer.join()
    assert killed, "no worker was killed"
    assert store.puts == {c.key: 1 for c in cells}
    same_rows(frame, serial_rows)


def test_killed_worker_without_retries_loses_only_its_cell_and_a_rerun_completes(cluster, tmp_path, serial_rows):
    cells = slow_cells(tmp_path / "log", delay=0.5)
    store = CountingStore(tmp_path / "store")
    killed: list[int] = []
    killer = kill_first_worker(tmp_path / "log", killed)
    with pytest.raises(CellLost, match="rerun to compute the rest") as info:
        run_cells(cells, store, executor=RayExecutor(max_retries=0), progress=False)
    killer.join()
    lost = next(c.key for c in cells if c.key in str(info.value))
    first = dict(store.puts)
    assert lost not in first and all(n == 1 for n in first.values())
    frame = run_cells(cells, store, executor=RayExecutor(), progress=False)
    assert store.puts == {c.key: 1 for c in cells}  # the rerun computed only the missing cells
    same_rows(frame, serial_rows)


DRIVER = """
import sys
sys.path.insert(0, {tests!r})
from pathlib import Path
import ray
import test_ray_executor
from test_ray_executor import slow_cells
ray.cloudpickle.register_pickle_by_value(test_ray_executor)
from creditlab.lab.runner import RayExecutor, run_cells
from creditlab.lab.store import ResultStore
try:
    # one task at a time: the driver's job starts one worker, and is interrupted between cells
    run_cells(slow_cells(Path({log!r}), 0.5), ResultStore({store!r}), executor=RayExecutor({address!r}, max_pending=1),
              progress=False)
except KeyboardInterrupt:
    sys.exit(130)
"""


def test_interrupted_driver_keeps_finished_cells_and_a_rerun_computes_the_rest(cluster, tmp_path, serial_rows):
    store_dir, log = tmp_path / "store", tmp_path / "log"
    code = DRIVER.format(tests=str(TESTS), log=str(log), store=str(store_dir), address=cluster)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=TESTS.parent, stdout=subprocess.DEVNULL)
    cells_dir = store_dir / "cells"
    try:
        t0 = time.monotonic()
        while not (cells_dir.exists() and list(cells_dir.glob("*.parquet"))):
            assert proc.poll() is None, "the driver ended before storing a cell"
            assert time.monotonic() - t0 < 120, "no cell stored within 120 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    before = {f.name: f.stat().st_mtime_ns for f in cells_dir.glob("*.parquet")}
    cells = LAB.cells(TINY)
    assert 1 <= len(before) < len(cells)
    store = CountingStore(store_dir)
    frame = run_cells(cells, store, executor=RayExecutor(), progress=False)
    assert len(store.puts) == len(cells) - len(before) and set(store.puts.values()) == {1}
    assert {f.name: f.stat().st_mtime_ns for f in cells_dir.glob("*.parquet") if f.name in before} == before
    same_rows(frame, serial_rows)


def test_a_cell_error_comes_back_as_itself(cluster, tmp_path):
    cell = Cell("g", "bad", _bad_cell, {"x": 1})
    with pytest.raises(ValueError, match="bad cell x=1"):
        run_cells([cell], ResultStore(tmp_path), executor=RayExecutor(), progress=False)


def _bad_cell(x):
    raise ValueError(f"bad cell x={x}")


def test_make_executor_ray_and_its_mistakes(monkeypatch):
    assert isinstance(make_executor(1, "ray", "auto"), RayExecutor)
    cpus = local_cpus()  # a local instance gets at most this machine's CPUs (capped with a warning)
    if cpus > 1:
        assert make_executor(cpus, "ray").num_cpus == cpus
    with pytest.warns(UserWarning, match="more than the"):
        assert make_executor(cpus + 1, "ray").num_cpus == (cpus if cpus > 1 else None)
    assert make_executor(cpus + 1, "ray", "auto", warn=pytest.fail).num_cpus is None  # a cluster decides
    assert make_executor(1, "ray").num_cpus is None
    with pytest.raises(ConfigError, match="--ray-address: needs --executor ray"):
        make_executor(2, "process", "auto")
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(ConfigError) as info:
        make_executor(1, "ray")
    assert str(info.value) == '--executor: ray is not installed: pip install "creditlab[ray]"'


def test_every_lab_command_takes_executor_ray(cluster, tmp_path, capsys):
    from creditlab.cli.main import main

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        main(["lab", "coverage", "--quick", "-e", "shuffle", "--seeds", "1", "--updates", "2", "--executor", "ray",
              "--ray-address", cluster, "--out", str(out)])
    assert info.value.code == 0
    assert "2 cell(s) computed" in capsys.readouterr().out
    assert len(list((out / "store" / "cells").glob("*.parquet"))) == 2
    with pytest.raises(SystemExit) as info:
        main(["lab", "fork", "--quick", "--executor", "process", "--ray-address", cluster,
              "--out", str(tmp_path / "x")])
    assert info.value.code == 2
    assert "--ray-address: needs --executor ray" in capsys.readouterr().err
