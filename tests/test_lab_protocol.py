"""The lab protocol: one run_lab for every lab (manifest, refusal, fresh, selections), configs and CLI."""

import subprocess
import sys
from dataclasses import replace

import pytest

from creditlab.errors import ConfigError
from creditlab.lab.protocol import Lab, run_lab
from creditlab.labs import BUILTIN, get_lab, lab_names, register_lab, unregister_lab
from creditlab.labs.coverage import LAB, CoverageConfig
from creditlab.train.chain import ChainTrainConfig

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
    report = (tmp_path / "report.md").read_text()
    assert "C sweep" not in report
    # its tables are of a part of the run: the report says which part, and what the store holds beside it
    assert "**This render reads a subset of the run**: it selects dose" in report
    assert "(of c_sweep: -e c_sweep) that no table here reads" in report
    assert run_lab(LAB, TINY, tmp_path, progress=False).computed == 0
    assert "subset of the run" not in (tmp_path / "report.md").read_text()


class _External(type(LAB)):
    """The coverage lab with one more table, read from a file that a render may not have (as a dump a cell
    writes only when it is computed)."""

    source = None

    def tables(self, rows, config):
        import pandas as pd

        from creditlab.lab.protocol import Table

        tabs = super().tables(rows, config)
        title = "Rows of a file outside the store"
        if self.source is not None and self.source.exists():
            tabs["external"] = Table(pd.read_csv(self.source), title)
        else:
            tabs["external"] = Table(pd.DataFrame({"x": []}), title, carry="its input file is not in this render")
        return tabs

    def interpret(self, tables, config):
        text = super().interpret(tables, config)
        if "external" in tables:
            text["external"] = f"{len(tables['external'].frame)} rows of the file."
        return text


def test_a_table_a_render_cannot_compute_is_kept_as_it_was(tmp_path):
    """A re-render without a table's inputs (its cells are read back, so the files they write are not made
    again) used to delete the table and its report section, exit 0, and say nothing."""
    import json

    lab = _External()
    lab.source = tmp_path / "input.csv"
    lab.source.write_text("x\n1\n2\n3\n")
    out = tmp_path / "out"
    run_lab(lab, TINY, out, progress=False)
    before = {n: (out / n).read_bytes() for n in ("external.parquet", "external.md")}
    lab.source.unlink()
    res = run_lab(lab, TINY, out, progress=False)
    assert res.computed == 0 and len(res.tables["external"].frame) == 3
    assert {n: (out / n).read_bytes() for n in before} == before  # its files, as they were
    report = (out / "report.md").read_text()
    first = json.loads((out / "lab.json").read_text())
    assert ("**Carried over unchanged from an earlier render of this run** (finished "
            f"{first['carried']['external']['rendered_at']}): its input file is not in this render.") in report
    assert "3 rows of the file." in report and {"external.parquet", "external.md"} <= set(first["outputs"])
    # a later render keeps the time of the render that computed it, and so does the API's result
    res = run_lab(lab, TINY, out, progress=False)
    assert json.loads((out / "lab.json").read_text())["carried"] == first["carried"]
    assert {n: (out / n).read_bytes() for n in before} == before
    # a run that never had it: nothing to keep, and an empty table is left out
    res = run_lab(lab, TINY, tmp_path / "other", progress=False)
    assert "external" not in res.tables and not (tmp_path / "other" / "external.parquet").exists()
    # --fresh discards the earlier render: nothing is carried
    res = run_lab(lab, TINY, out, fresh=True, progress=False)
    assert "external" not in res.tables and not (out / "external.parquet").exists()


def test_out_that_is_not_a_lab_run_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="--out: .*not empty"):
        run_lab(LAB, TINY, tmp_path, progress=False)
    with pytest.raises(ConfigError, match="--out: .*not a directory"):
        run_lab(LAB, TINY, tmp_path / "notes.txt", progress=False)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_every_lab_implements_the_protocol():
    assert set(BUILTIN) <= set(lab_names())
    for name in lab_names():
        lab = get_lab(name)
        assert isinstance(lab, Lab) and lab.name == name and "\n" not in lab.summary
        for cfg in (lab.config_type(), lab.config_type.quick()):
            cfg.validate()
            assert lab.config_type.from_dict(cfg.to_dict()) == cfg
            assert cfg.with_options(seeds=3).seeds == 3
    with pytest.raises(ConfigError, match="unknown lab 'nope'; valid: .*coverage"):
        get_lab("nope")


def test_importing_the_protocol_imports_no_lab():
    code = ("import sys, creditlab.lab.protocol, creditlab.labs; "
            "print(sorted(m for m in sys.modules if m.startswith(('creditlab.labs.', 'creditlab.train'))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]", r.stdout


def test_register_lab_treats_re_registration_as_the_other_registries_do():
    class Coin:
        name, summary, config_type = "coin_test", "A coin.", CoverageConfig
        describe = cells = tables = plots = interpret = staticmethod(lambda *a: None)

    lab = Coin()
    try:
        assert register_lab(lab) is lab and register_lab(lab) is lab  # the same object again: a no-op
        assert get_lab("coin_test") is lab and "coin_test" in lab_names()
        with pytest.raises(ConfigError, match="'coin_test' is already registered"):
            register_lab(Coin())
        with pytest.raises(ConfigError, match="'coverage' is already registered to creditlab.labs.coverage"):
            register_lab(type("Other", (Coin,), {"name": "coverage"})())
    finally:
        unregister_lab("coin_test")
    with pytest.raises(ConfigError, match="missing"):
        register_lab(object())


def test_a_lab_from_another_package_registers_through_an_entry_point(tmp_path):
    """A distribution with a ``creditlab.labs`` entry point: listed, loaded, and given a CLI sub-command."""
    pkg = tmp_path / "site"
    (pkg / "coinlab").mkdir(parents=True)
    (pkg / "coinlab" / "__init__.py").write_text(
        "from creditlab.labs.coverage import CoverageLab\n"
        "class CoinLab(CoverageLab):\n    name = 'coin'\n    summary = 'A coin from another package.'\n"
        "LAB = CoinLab()\n")
    dist = pkg / "coinlab-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: coinlab\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[creditlab.labs]\ncoin = coinlab:LAB\n")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from creditlab.labs import get_lab, lab_names; "
            "print(lab_names()[-1], get_lab('coin').summary); from creditlab.cli.main import main; "
            "main(['lab', '--help'])")
    r = subprocess.run([sys.executable, "-c", code, str(pkg)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "coin A coin from another package." and "coin" in r.stdout.split("\n", 1)[1]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "creditlab.cli.main", *args], capture_output=True, text=True)


def test_cli_lists_every_lab_and_gives_each_the_same_options():
    r = _cli("lab", "--help")
    assert r.returncode == 0
    from typer.testing import CliRunner

    from creditlab.cli.main import app

    runner = CliRunner()
    for name in lab_names():
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


def test_gate_cells_run_first_and_their_table_is_shown_before_the_others(tmp_path):
    """A lab with ``gate_groups`` gets its gate table through ``status`` after those cells and before
    any other cell runs."""
    import pandas as pd

    from creditlab.lab.protocol import Table
    from creditlab.lab.store import ResultStore

    out = tmp_path / "out"
    seen = {}

    class Gated(type(LAB)):
        gate_groups = ("dose",)

        def gate(self, rows, config):
            seen["groups"] = set(rows)
            seen["stored"] = len(ResultStore(out / "store").done())
            return Table(pd.DataFrame({"check": ["dose cells"], "gate": ["pass"]}), "Gate: test")

    lab = Gated()
    n_dose = sum(c.group == "dose" for c in lab.cells(TINY))
    said = []
    run_lab(lab, TINY, out, progress=False, status=said.append)
    assert seen["groups"] == {"dose"} and 0 < n_dose < len(lab.cells(TINY))
    assert seen["stored"] == n_dose  # only the gate's cells had run
    assert said[0].startswith("Gate: test") and "| dose cells | pass |" in said[0]
    assert len(said) == 2 and "cell(s) computed" in said[1]


def test_intervals_use_the_exact_student_t_quantile():
    """Hand-computed: two values 0 and 1 (sd 0.7071, 1 degree of freedom, t = 12.7062) give a half width
    of 12.7062 * 0.7071 / sqrt(2) = 6.3531; three values 0, 1, 2 (sd 1, t = 4.3027) give 4.3027 / sqrt(3)
    = 2.4841; five values 0..4 (sd 1.5811, t = 2.7764) give 1.9632. A normal approximation (1.96) or a
    series in 1/df misses the first two by 40% or more, which flips "interval excludes 0" verdicts."""
    import pytest

    from creditlab.lab.report import mean_ci

    for values, half in (([0.0, 1.0], 6.35310), ([0.0, 1.0, 2.0], 2.48414), ([0.0, 1.0, 2.0, 3.0, 4.0], 1.96324)):
        m, lo, hi = mean_ci(values)
        assert (hi - m, m - lo) == (pytest.approx(half, abs=1e-4), pytest.approx(half, abs=1e-4)), values
