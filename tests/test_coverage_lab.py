"""The coverage lab end to end: tables, plots, resumability, determinism, the CLI."""

import subprocess
import sys
from dataclasses import replace

import pandas as pd
import pytest

from creditlab.lab.protocol import run_lab
from creditlab.lab.runner import Cell, make_executor, run_cells
from creditlab.lab.store import ResultStore
from creditlab.labs.coverage import LAB, CoverageConfig
from creditlab.train.chain import ChainTrainConfig

TINY = CoverageConfig(train=ChainTrainConfig(T=6, K=3, hidden=8, group=4, updates=8, eval_points=2), seeds=2,
                      Cs=(1, 4), vd_C=4, vds=(0.0, 1.0), shuffle_Cs=(4,), shuffle_vds=(1.0,), dose_C=2, dose_ks=(1, 6),
                      experiments=("c_sweep", "vd_sweep", "shuffle", "dose"))


def test_lab_writes_tables_plots_report(tmp_path):
    res = run_lab(LAB, TINY, tmp_path, progress=False)
    for name in ("c_sweep", "vd_sweep", "shuffle", "dose"):
        df = pd.read_parquet(tmp_path / f"{name}_runs.parquet")
        assert {"arm", "seed", "C", "k", "vd", "final_score", "aulc", "cfg_updates", "curve"} <= set(df.columns)
        assert (tmp_path / f"{name}.md").read_text().startswith("|")
        assert (tmp_path / f"{name}.png").stat().st_size > 5000
        assert len(df) == len(res.tables[f"{name}_runs"].frame)
    runs = pd.read_parquet(tmp_path / "c_sweep_runs.parquet")
    assert set(runs["arm"]) == {"uniform", "concentrated"}
    assert len(runs) == 2 * 2 * 2  # C x arms x seeds
    report = (tmp_path / "report.md").read_text()
    assert "paired difference uniform - concentrated" in report
    assert "uniform - concentrated over 2 paired seeds" in report  # the written interpretation


def test_rerun_computes_only_missing_cells_and_is_identical(tmp_path):
    first = LAB.cells(TINY)
    store = ResultStore(tmp_path / "store")
    # an interrupted run: only half of the cells finished
    run_cells(first[: len(first) // 2], store, progress=False)
    assert len(store.done()) == len(first) // 2
    calls = []

    class CountingExecutor:
        def submit_all(self, todo):
            calls.extend(c.key for c in todo)
            for c in todo:
                yield c, c.run()

    full = run_cells(first, store, executor=CountingExecutor(), progress=False)
    assert len(calls) == len(first) - len(first) // 2
    fresh = run_cells(first, ResultStore(tmp_path / "fresh"), progress=False)
    cols = ["cell_key", "arm", "seed", "C", "final_score"]
    pd.testing.assert_frame_equal(full[cols].reset_index(drop=True), fresh[cols].reset_index(drop=True))
    calls.clear()
    run_cells(first, store, executor=CountingExecutor(), progress=False)
    assert calls == []


def _boom():
    raise RuntimeError("cell failed")


def test_a_failing_cell_keeps_the_finished_ones(tmp_path):
    store = ResultStore(tmp_path)
    cells = [Cell("g", "ok", _rows, {"x": 1}), Cell("g", "bad", _boom, {})]
    with pytest.raises(RuntimeError, match="cell failed"):
        run_cells(cells, store, progress=False)
    assert store.done() == {cells[0].key}


def _rows(x):
    return [{"x": x}]


def test_process_pool_gives_the_same_numbers(tmp_path):
    cfg = replace(TINY, experiments=("c_sweep",))
    serial = run_lab(LAB, cfg, tmp_path / "a", make_executor(1), progress=False).tables["c_sweep_runs"].frame
    pooled = run_lab(LAB, cfg, tmp_path / "b", make_executor(2), progress=False).tables["c_sweep_runs"].frame
    pd.testing.assert_series_equal(serial["final_score"], pooled["final_score"])


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "creditlab.cli.main", *args], capture_output=True, text=True)


def test_cli_bad_input_exits_nonzero_without_traceback(tmp_path):
    r = _cli("lab", "coverage", "--out", str(tmp_path), "--seeds", "0")
    assert r.returncode == 2
    assert "--seeds" in r.stderr and "Traceback" not in r.stderr


def test_cli_runs_and_resumes(tmp_path):
    args = ("lab", "coverage", "--quick", "--out", str(tmp_path), "--updates", "3", "--seeds", "1", "--workers", "1",
            "-e", "vd_sweep", "-e", "dose")
    r = _cli(*args)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "report.md").exists() and (tmp_path / "vd_sweep.png").exists()
    assert not (tmp_path / "c_sweep.png").exists()
    n_cells = len(list((tmp_path / "store" / "cells").glob("*.parquet")))
    r2 = _cli(*args)
    assert r2.returncode == 0
    assert len(list((tmp_path / "store" / "cells").glob("*.parquet"))) == n_cells


def test_last_crossing_golden():
    import math

    import numpy as np

    from creditlab.labs.coverage.crossing import _last_crossing

    v = np.array([0.6, 0.8, 1.0])
    assert _last_crossing(v, np.array([-0.2, 0.2, 0.4])) == pytest.approx(0.7)
    assert _last_crossing(v, np.array([-0.1, -0.1, 0.1])) == pytest.approx(0.9)
    assert _last_crossing(v, np.array([0.1, 0.2, 0.3])) == 0.6  # never below: at or before the grid start
    assert math.isnan(_last_crossing(v, np.array([-0.3, 0.1, -0.1])))  # ends below: no crossing on the grid
    # a dip after a first crossing: the crossing is where the difference stays >= 0
    v4 = np.array([0.6, 0.7, 0.8, 0.9])
    assert _last_crossing(v4, np.array([-0.2, 0.1, -0.1, 0.3])) == pytest.approx(0.825)


def test_single_update_shares_base_and_rollouts():
    import torch

    from creditlab.train.chain import ModelSpec, single_update

    cfg = ChainTrainConfig(T=6, K=3, hidden=8, group=4)
    specs = [ModelSpec(seed=s, C=4, arm=a) for a in ("uniform", "per_turn", "uniform") for s in range(3)]
    out = single_update(specs, cfg, base_updates=5, step=1.0, clip=0.05, rollouts=16)
    before, after = out["before"].view(3, 3), out["after"].view(3, 3)
    assert torch.equal(before[0], before[1]) and torch.equal(before[0], before[2])  # one base per seed
    assert torch.equal(after[0], after[2])  # same arm, same rollouts: the same update
    moved = out["grad_norm"] > 0
    assert ((after - before).abs().view(-1)[moved] > 0).all()
    with pytest.raises(Exception, match="state_dependent"):
        single_update(specs, ChainTrainConfig(state_dependent=True), base_updates=1, step=1.0, clip=1.0)


def test_new_experiments_write_their_tables(tmp_path):
    cfg = replace(TINY, experiments=("real_agent", "crossing", "single_update"), real_agent_Cs=(3,),
                  crossing_vds=(0.5, 1.0), crossing_bootstrap=50, single_seeds=4, single_settings=(("final", 3),),
                  single_rollouts=8, single_base_updates=3)
    res = run_lab(LAB, cfg, tmp_path, progress=False)
    assert set(res.tables["crossing"].frame["chain"]) == {"independent_step", "state_dependent"}
    su = res.tables["single_update"].frame
    assert set(su["arm"]) == {"binary", "uniform", "per_turn", "shuffled", "discretized", "reward_to_go"}
    assert (su["V_d"] == 1 / 3).all()
    for png in ("real_agent.png", "crossing.png", "single_update.png"):
        assert (tmp_path / png).stat().st_size > 5000
    assert "Crossing point" in (tmp_path / "report.md").read_text()
