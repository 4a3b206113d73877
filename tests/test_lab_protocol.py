"""The lab protocol: one run_lab for every lab (manifest, refusal, fresh, selections), configs and CLI."""

import subprocess
import sys
from dataclasses import replace

import pytest

from creditlab.errors import ConfigError
from creditlab.lab.chain_trainer import ChainTrainConfig
from creditlab.lab.coverage import LAB, CoverageConfig
from creditlab.lab.protocol import LABS, Lab, get_lab, run_lab

TINY = CoverageConfig(train=ChainTrainConfig(T=6, K=3, hidden=8, group=4, updates=4, eval_points=2), seeds=2,
                      Cs=(1, 4), vd_C=4, vds=(0.0, 1.0), shuffle_Cs=(4,), shuffle_vds=(1.0,), dose_C=2, dose_ks=(1, 6),
                      experiments=("c_sweep", "dose"))


def _files(path):
    return {p.relative_to(path): p.stat().st_mtime_ns for p in path.rglob("*") if p.is_file()}


def test_rerun_with_another_configuration_refuses_and_changes_nothing(tmp_path):
    run_lab(LAB, TINY, tmp_path, progress=False)
    before = _files(tmp_path)
    with pytest.raises(ConfigError, match=r"--out: .*another configuration \(differs in: seeds, train.updates\)"):
        run_lab(LAB, replace(TINY, seeds=3, train=replace(TINY.train, updates=5)), tmp_path, progress=False)
    assert _files(tmp_path) == before
    with pytest.raises(ConfigError, match="--out: .*'coverage' lab"):
        run_lab(get_lab("fork"), get_lab("fork").config_type.quick(), tmp_path, progress=False)
    assert _files(tmp_path) == before


def test_fresh_discards_the_old_run(tmp_path):
    run_lab(LAB, TINY, tmp_path, progress=False)
    other = replace(TINY, seeds=1, experiments=("dose",))
    res = run_lab(LAB, other, tmp_path, fresh=True, progress=False)
    assert res.computed == len(LAB.cells(other))
    assert len(list((tmp_path / "store" / "cells").glob("*.parquet"))) == len(LAB.cells(other))
    assert not (tmp_path / "c_sweep.md").exists() and (tmp_path / "dose.md").exists()


def test_another_selection_reuses_cells_and_rewrites_outputs(tmp_path):
    run_lab(LAB, TINY, tmp_path, progress=False)
    assert (tmp_path / "c_sweep.png").exists()
    only_dose = replace(TINY, experiments=("dose",))
    res = run_lab(LAB, only_dose, tmp_path, progress=False)
    assert res.computed == 0  # every dose cell was stored by the first run
    assert not (tmp_path / "c_sweep.png").exists() and not (tmp_path / "c_sweep.md").exists()
    assert "C sweep" not in (tmp_path / "report.md").read_text()
    assert run_lab(LAB, TINY, tmp_path, progress=False).computed == 0


def test_out_that_is_not_a_lab_run_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="--out: .*not empty"):
        run_lab(LAB, TINY, tmp_path, progress=False)
    with pytest.raises(ConfigError, match="--out: .*not a directory"):
        run_lab(LAB, TINY, tmp_path / "notes.txt", progress=False)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_every_lab_implements_the_protocol():
    get_lab("coverage")  # imports every built-in lab
    assert {"coverage", "fork"} <= set(LABS)
    for name, lab in LABS.items():
        assert isinstance(lab, Lab) and lab.name == name and "\n" not in lab.summary
        for cfg in (lab.config_type(), lab.config_type.quick()):
            cfg.validate()
            assert lab.config_type.from_dict(cfg.to_dict()) == cfg
            assert cfg.with_options(seeds=3).seeds == 3
    with pytest.raises(ConfigError, match="unknown lab 'nope'; valid: .*coverage"):
        get_lab("nope")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "creditlab.cli.main", *args], capture_output=True, text=True)


def test_cli_lists_every_lab_and_gives_each_the_same_options():
    get_lab("coverage")
    r = _cli("lab", "--help")
    assert r.returncode == 0
    from typer.testing import CliRunner

    from creditlab.cli.main import app

    runner = CliRunner()
    for name in LABS:
        assert name in r.stdout
        h = runner.invoke(app, ["lab", name, "--help"], terminal_width=200)  # in process: one import, not five
        assert h.exit_code == 0, h.output
        for opt in ("--quick", "--out", "--seeds", "--updates", "--workers", "--executor", "--experiment", "--fresh",
                    "--dump"):
            assert opt in h.output, (name, opt)


def test_cli_errors_name_the_flag(tmp_path):
    r = _cli("lab", "coverage", "--out", str(tmp_path / "o"), "-e", "nope")
    assert r.returncode == 2 and "--experiment" in r.stderr and "Traceback" not in r.stderr
    r = _cli("lab", "fork", "--out", str(tmp_path / "o"), "--executor", "cluster")
    assert r.returncode == 2 and "--executor" in r.stderr and "serial, process" in r.stderr
    assert not (tmp_path / "o").exists()  # nothing is created when validation fails


def test_reports_a_reader_can_trust(tmp_path):
    import pandas as pd

    from creditlab.lab.report import mean_ci, to_markdown

    run_lab(LAB, replace(TINY, seeds=1), tmp_path, progress=False)
    report = (tmp_path / "report.md").read_text()
    assert "One seed: no interval" in report
    assert "nan" not in report and "-0.000" not in report
    assert mean_ci([1.0, 1.0, 0.8], bounds=(0.0, 1.0))[2] == 1.0  # a score's interval stops at a perfect score
    md = to_markdown(pd.DataFrame({"label": ["a|b"], "x": [-0.0001], "lo": [float("nan")]}))
    assert "a\\|b" in md and "| 0.000 |" in md and "| - |" in md
