"""Lab CLI mistakes: more workers than CPUs, workers for the serial executor, a Ray address nobody answers at,
a resume after the code changed."""

import json
import socket
import time
from dataclasses import replace

import pytest

from cli_inproc import run_inproc
from creditlab.errors import ConfigError
from creditlab.lab import protocol
from creditlab.lab.protocol import run_lab
from creditlab.lab.runner import ProcessPoolExecutorBackend, check_ray_address, local_cpus, make_executor
from creditlab.labs.coverage import LAB, CoverageConfig
from creditlab.train.chain import ChainTrainConfig

TINY = CoverageConfig(train=ChainTrainConfig(T=6, K=3, hidden=8, group=4, updates=4, eval_points=2), seeds=1,
                      Cs=(1, 4), vd_C=4, vds=(0.0, 1.0), shuffle_Cs=(4,), shuffle_vds=(1.0,), dose_C=2, dose_ks=(1, 6),
                      experiments=("dose",))


def test_workers_above_the_cpu_count_are_capped_with_a_warning():
    said = []
    ex = make_executor(local_cpus() + 3, warn=said.append)
    assert isinstance(ex, ProcessPoolExecutorBackend) and ex.workers == local_cpus()
    assert len(said) == 1 and f"--workers {local_cpus() + 3}" in said[0] and f"using {local_cpus()}" in said[0]
    with pytest.warns(UserWarning, match="more than the"):
        make_executor(local_cpus() + 1, "process")
    said.clear()
    make_executor(local_cpus(), "process", warn=said.append)
    assert said == []


def test_the_cli_caps_workers_and_says_so(tmp_path, capsys):
    from creditlab.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["lab", "coverage", "--quick", "-e", "dose", "--seeds", "1", "--updates", "4", "--workers", "64",
              "--out", str(tmp_path / "o")])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"--workers 64 is more than the {local_cpus()} CPUs of this machine" in " ".join(out.split())



def test_workers_with_the_serial_executor_are_refused_naming_both_flags(tmp_path, capsys):
    """``--workers 2 --executor serial`` used to run one cell at a time without a word."""
    from creditlab.cli.main import main

    with pytest.raises(ConfigError, match=r"--workers: --workers 2 with --executor serial: .*one cell at a time"):
        make_executor(2, "serial")
    assert type(make_executor(1, "serial")).__name__ == "SerialExecutor"  # one worker: what serial is
    out = tmp_path / "o"
    with pytest.raises(SystemExit) as e:
        main(["lab", "coverage", "--quick", "-e", "dose", "--seeds", "1", "--updates", "4", "--workers", "2",
              "--executor", "serial", "--out", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    line = " ".join(err.split())
    assert "--workers 2 with --executor serial" in line and "--executor process" in line
    assert not out.exists()  # refused before anything was written

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_ray_address_nobody_answers_at_fails_in_seconds(capsys):
    from creditlab.cli.main import main

    port = _free_port()
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=rf"--ray-address: nothing answers at 127.0.0.1:{port}"):
        check_ray_address(f"ray://127.0.0.1:{port}")
    with pytest.raises(SystemExit) as e:
        main(["lab", "coverage", "--quick", "--executor", "ray", "--ray-address", f"127.0.0.1:{port}"])
    assert e.value.code == 2 and time.perf_counter() - t0 < 10
    err = capsys.readouterr().err
    assert "--ray-address" in err and "nothing answers" in err and "Traceback" not in err
    with pytest.raises(ConfigError, match="expected auto, HOST:PORT"):
        check_ray_address("localhost")


def test_a_resume_after_the_code_changed_is_refused_naming_the_modules(tmp_path, monkeypatch):
    run_lab(LAB, TINY, tmp_path, progress=False)
    real = protocol.code_fingerprint()
    changed = dict(real, **{"train/chain.py": "0" * 16})
    monkeypatch.setattr(protocol, "code_fingerprint", lambda scope=None: changed)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match=r"--out: .*other code \(changed since: train/chain.py\).*--keep-cells"):
        run_lab(LAB, TINY, tmp_path, progress=False)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before  # nothing touched
    res = run_lab(LAB, TINY, tmp_path, keep_cells=True, progress=False)
    assert res.computed == 0
    report = res.report.read_text()
    assert "This run's cells were computed by other code" in report and "train/chain.py" in report
    assert "This run mixes code" not in report  # every cell it reads is of one code
    manifest = json.loads((tmp_path / "lab.json").read_text())
    assert manifest["mixed_code"] == ["train/chain.py"]
    # the reuse accepted with --keep-cells holds for later renders of the same code
    res = run_lab(LAB, TINY, tmp_path, progress=False)
    assert "This run's cells were computed by other code" in res.report.read_text()
    # cells of this code beside the stored ones: the tables read two codes
    both = replace(TINY, experiments=("dose", "shuffle"))
    res = run_lab(LAB, both, tmp_path, progress=False)
    assert res.computed > 0 and "This run mixes code" in res.report.read_text()
    assert json.loads((tmp_path / "lab.json").read_text())["mixed_code"] == ["train/chain.py"]
    res = run_lab(LAB, TINY, tmp_path, fresh=True, progress=False)
    assert "mixes code" not in res.report.read_text() and json.loads((tmp_path / "lab.json").read_text())[
        "mixed_code"] == []


def test_the_manifest_keeps_the_code_of_every_stored_cell_across_renders(tmp_path, monkeypatch):
    """A --keep-cells render by other code used to overwrite the manifest's one fingerprint: the code that had
    computed every stored cell was refused afterwards, and the run stayed marked as mixing code."""
    cmd = ("lab", "coverage", "--quick", "-e", "dose", "--seeds", "1", "--updates", "4", "--out", tmp_path)
    assert run_inproc(*cmd).returncode == 0
    real = protocol.code_fingerprint(getattr(LAB, "compute_code", None))
    first = json.loads((tmp_path / "lab.json").read_text())
    assert first["cell_code"] and set(first["cell_code"].values()) == {protocol.code_id(real)}
    assert first["codes"][protocol.code_id(real)] == real
    other = dict(real, **{"train/chain.py": "0" * 16})
    monkeypatch.setattr(protocol, "code_fingerprint", lambda scope=None: other)
    r = run_inproc(*cmd)
    assert r.returncode == 2 and "other code (changed since: train/chain.py)" in " ".join(r.stderr.split())
    assert run_inproc(*cmd, "--keep-cells").returncode == 0
    m = json.loads((tmp_path / "lab.json").read_text())
    assert m["code"] == other and m["cell_code"] == first["cell_code"]  # each cell keeps the code that computed it
    assert m["codes"][protocol.code_id(real)] == real
    monkeypatch.undo()  # the code of the cells again: reused without --keep-cells, and no mix
    r = run_inproc(*cmd)
    assert r.returncode == 0, r.stderr
    assert "0 cell(s) computed" in " ".join(r.stdout.split())
    report = (tmp_path / "report.md").read_text()
    assert "mixes code" not in report and "other code" not in report
    assert json.loads((tmp_path / "lab.json").read_text())["mixed_code"] == []


def test_a_manifest_of_the_older_format_is_read(tmp_path, monkeypatch):
    """Before the manifest kept each cell's code it kept one ``code``: every stored cell's, unless the run mixed
    code (then which cell was computed by which code is not known, and the run stays marked)."""
    run_lab(LAB, TINY, tmp_path, progress=False)
    real = protocol.code_fingerprint()
    m = json.loads((tmp_path / "lab.json").read_text())
    for k in ("codes", "cell_code", "carried", "outputs_rendered_at"):
        m.pop(k, None)
    (tmp_path / "lab.json").write_text(json.dumps(m))
    assert run_lab(LAB, TINY, tmp_path, progress=False).computed == 0  # its cells: the recorded code's
    now = json.loads((tmp_path / "lab.json").read_text())
    assert set(now["cell_code"].values()) == {protocol.code_id(real)} and now["mixed_code"] == []
    # an older manifest of a run that mixed code: the cells' code is unknown
    now.update(mixed_code=["train/chain.py"])
    for k in ("codes", "cell_code"):
        now.pop(k)
    (tmp_path / "lab.json").write_text(json.dumps(now))
    res = run_lab(LAB, TINY, tmp_path, progress=False)  # the code its last render ran: accepted then
    assert "(not recorded)" in res.report.read_text()
    other = dict(real, **{"train/chain.py": "0" * 16})
    monkeypatch.setattr(protocol, "code_fingerprint", lambda scope=None: other)
    with pytest.raises(ConfigError, match=r"--out: .*holds cells whose code was not recorded.*--keep-cells"):
        run_lab(LAB, TINY, tmp_path, progress=False)


def test_a_run_of_unrecorded_code_is_refused_and_an_empty_store_is_not(tmp_path):
    run_lab(LAB, TINY, tmp_path, progress=False)
    manifest = json.loads((tmp_path / "lab.json").read_text())
    for key in ("code", "codes", "cell_code"):  # a manifest from before creditlab recorded a run's code
        del manifest[key]
    (tmp_path / "lab.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match="made before creditlab recorded the code"):
        run_lab(LAB, TINY, tmp_path, progress=False)
    # no stored cell yet (interrupted before the first finished): other code is no mix
    other = tmp_path / "other"
    run_lab(LAB, replace(TINY, experiments=("dose",)), other, progress=False)
    for f in (other / "store" / "cells").glob("*"):
        f.unlink()
    manifest = json.loads((other / "lab.json").read_text())
    manifest["code"] = {"train/chain.py": "0" * 16}
    (other / "lab.json").write_text(json.dumps(manifest))
    assert run_lab(LAB, TINY, other, progress=False).computed > 0


def test_the_fingerprint_covers_the_code_that_computes_cells_not_the_edges():
    fp = protocol.code_fingerprint()
    assert {"train/chain.py", "labs/coverage/__init__.py", "core/correction.py", "envs/toolshop.py"} <= set(fp)
    assert not any(k.startswith(("cli/", "integrations/")) for k in fp)
