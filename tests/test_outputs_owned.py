"""creditlab writes over nothing it did not write: ``creditlab diagnose`` refuses a report.md, diagnose.json or
plot in ``--out`` that it did not mark as its own (a lab's report, a user's notes), also when the input is
unreadable; every output directory is locked while a run writes it (a lab's ``--out``, ``--fresh`` or not;
diagnose's); ``write_dump`` adds to a dump and never truncates one, and refuses a name that is not a dump;
and an ``--out`` in a read-only directory is refused naming the directory and its lock file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from creditlab._outlock import OutLock
from creditlab.cli.main import main
from creditlab.diagnose import read_dump, write_dump
from creditlab.diagnose.report import REPORT_MARK
from creditlab.errors import ConfigError
from creditlab.lab.protocol import run_lab
from creditlab.labs.coverage import LAB, CoverageConfig
from creditlab.train.chain import ChainTrainConfig
from diagnose_synth import clean_rows

TINY = CoverageConfig(train=ChainTrainConfig(T=6, K=3, hidden=8, group=4, updates=4, eval_points=2), seeds=1,
                      Cs=(1, 4), vd_C=4, vds=(0.0, 1.0), shuffle_Cs=(4,), shuffle_vds=(1.0,), dose_C=2, dose_ks=(1, 6),
                      experiments=("dose",))


def _cli(argv, capsys) -> tuple[int, str]:
    """Exit code and stderr of ``creditlab ARGV`` run in process."""
    with pytest.raises(SystemExit) as ex:
        main([str(a) for a in argv])
    return ex.value.code, capsys.readouterr().err


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}


def _one_line(err: str) -> str:
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return " ".join(err.split())


def test_diagnose_never_replaces_a_report_it_did_not_write(tmp_path, capsys):
    lab = tmp_path / "lab"
    run_lab(LAB, TINY, lab, progress=False)  # a lab's --out: its report.md is the lab's
    before = _snapshot(lab)
    dump = write_dump(clean_rows(steps=2, groups=2), tmp_path / "d.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"step": 0, "group": 0, "reward": "x"}) + "\n")
    for inp in (dump, bad):  # readable input or not: refused before it is read, nothing written
        code, err = _cli(["diagnose", inp, "--out", lab, "--quiet"], capsys)
        line = _one_line(err)
        assert code == 2, err
        assert (f"--out: {lab / 'report.md'} was not written by creditlab diagnose (it belongs to the creditlab lab "
                f"run in that directory), and this run would replace it; nothing was written: choose another --out "
                f"(e.g. {lab / 'diagnose'}), or move report.md out of {lab}") in line, line
        assert "an earlier report" not in line and "earlier run" not in line
        assert _snapshot(lab) == before
    # a user's notes, and a plot of diagnose's names that diagnose did not write
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "report.md").write_text("# my notes\n")
    (notes / "k3_over_steps.png").write_bytes(b"my plot")
    code, err = _cli(["diagnose", dump, "--out", notes, "--quiet"], capsys)
    assert code == 2 and f"{notes / 'report.md'} (and k3_over_steps.png) was not written by creditlab" in _one_line(err)
    (notes / "report.md").unlink()
    code, err = _cli(["diagnose", dump, "--out", notes, "--quiet"], capsys)
    assert code == 2 and f"{notes / 'k3_over_steps.png'} was not written by creditlab diagnose" in _one_line(err)
    assert _snapshot(notes) == {"k3_over_steps.png": b"my plot"}
    # its own report it replaces (and says so); the files it writes carry its mark
    out = tmp_path / "o"
    one = ["--check", "mismatch.k3", "--quiet"]  # one check and its plot: quick
    assert _cli(["diagnose", dump, "--out", out, *one], capsys)[0] == 0
    assert (out / "report.md").read_text().splitlines()[0] == REPORT_MARK
    js = json.loads((out / "diagnose.json").read_text())
    assert js["written_by"] == "creditlab diagnose" and js["files"] == ["k3_over_steps.png", "report.md",
                                                                        "diagnose.json"]
    code, err = _cli(["diagnose", dump, "--out", out, *one], capsys)
    assert code == 0 and f"note: {out} held the report of an earlier run (exit code 0, on d.jsonl)" in err


def test_a_second_run_into_an_output_directory_being_written_is_refused(tmp_path, capsys):
    out = tmp_path / "lab"
    run_lab(LAB, TINY, out, progress=False)
    before = _snapshot(out)
    lock = OutLock(out, what="creditlab lab coverage")
    assert lock.acquire() is None  # the first run, still writing
    try:
        for extra in (["--fresh"], []):
            code, err = _cli(["lab", "coverage", "--quick", *extra, "--out", out], capsys)
            line = _one_line(err)
            assert code == 2 and f"--out: {out} is being written by another run (pid {os.getpid()}," in line, line
            assert f"creditlab lab coverage; lock {out}.lock); wait for it to end or choose another --out (--fresh " \
                   "does not override the lock of a running run)" in line
            assert _snapshot(out) == before  # the store, the manifest and the report are untouched
        with pytest.raises(ConfigError, match="is being written by another run"):  # the API takes the same lock
            run_lab(LAB, TINY, out, fresh=True, progress=False)
        dump = write_dump(clean_rows(steps=1), tmp_path / "d.jsonl")  # diagnose locks its --out too
        code, err = _cli(["diagnose", dump, "--out", out, "--quiet"], capsys)
        assert code == 2 and "is being written by another run" in err
    finally:
        lock.release()
    assert _snapshot(out) == before and not Path(f"{out}.lock").exists()
    run_lab(LAB, TINY, out, fresh=True, progress=False)  # once the first run ended
    assert not Path(f"{out}.lock").exists()


def test_write_dump_adds_to_a_dump_and_never_truncates_one(tmp_path):
    steps = [[dict(r, step=s) for r in clean_rows(seed=s, steps=1, groups=2)] for s in range(3)]
    for name in ("dump.jsonl", "dump.jsonl.gz", "dump.parquet", "dir"):
        for rows in steps:  # once per training step, as a trainer calls it
            write_dump(rows, tmp_path / name)
        assert sorted(set(read_dump(tmp_path / name).step.tolist())) == [0, 1, 2], name
    assert len(list((tmp_path / "dir").glob("part-*.parquet"))) == 3
    # append=False refuses a dump that holds rows, and leaves it as it is
    before = (tmp_path / "dump.parquet").read_bytes()
    with pytest.raises(ConfigError, match="dump.parquet already holds a dump and append=False never replaces one"):
        write_dump(steps[0], tmp_path / "dump.parquet", append=False)
    assert (tmp_path / "dump.parquet").read_bytes() == before
    # a name that is not a dump is an error naming the argument, and nothing is created
    with pytest.raises(ConfigError, match=r"path: .*dump.json names neither a dump file .* did you mean .*dump.jsonl"):
        write_dump(steps[0], tmp_path / "dump.json")
    assert not (tmp_path / "dump.json").exists()
    notes = tmp_path / "notes.jsonl"
    notes.write_text('{"note": "mine"}\n')
    with pytest.raises(ConfigError, match="notes.jsonl exists and is not a rollout dump"):
        write_dump(steps[0], notes)
    assert notes.read_text() == '{"note": "mine"}\n'
    # a last line cut off by a killed writer stays one bad line: the rows appended after it are whole
    torn = tmp_path / "torn.jsonl"
    write_dump(steps[0], torn)
    with torn.open("a") as fh:
        fh.write('{"step": 0, "gro')
    write_dump(steps[1], torn)
    lines = torn.read_text().splitlines()
    assert lines[len(steps[0])] == '{"step": 0, "gro' and json.loads(lines[-1])["step"] == 1


def test_fork_score_into_a_read_only_directory_names_the_directory_and_its_lock_file(tmp_path, capsys, monkeypatch):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": 1, "response": "x", "rubrics": [{"criterion": "x", "points": 1}]}) + "\n")
    ro = tmp_path / "ro"
    ro.mkdir()
    out = ro / "out.jsonl"
    out.write_text("")  # the file is writable: its directory is not
    ro.chmod(0o555)
    try:
        if os.access(ro, os.W_OK):  # root writes anywhere: have the check see what another user would
            real = os.access
            monkeypatch.setattr(os, "access", lambda p, m, **kw: False if Path(p) == ro and m & os.W_OK
                                else real(p, m, **kw))
        code, err = _cli(["fork", "score", "--in", inp, "--out", out, "--judge", "offline"], capsys)
    finally:
        ro.chmod(0o755)
    line = _one_line(err)
    assert code == 2 and "is not writable" in line
    assert (f"--out: the directory {ro} is not writable: fork score needs it for the lock file {out.resolve()}.lock"
            in line) and f"make {ro} writable, or choose an --out in a writable directory" in line
    assert f"{out} is not writable" not in line


def test_a_lab_replaces_only_the_outputs_its_runs_wrote(tmp_path):
    from dataclasses import replace

    out = tmp_path / "lab"
    run_lab(LAB, TINY, out, progress=False)
    (out / "shuffle.md").write_text("my notes on the shuffle control\n")  # a name the next selection writes
    with pytest.raises(ConfigError, match=r"--out: .*shuffle.md was not written by this lab's runs.*the cells are "
                                          r"stored, no table or report was written: move shuffle.md out of"):
        run_lab(LAB, replace(TINY, experiments=("shuffle",)), out, progress=False)
    assert (out / "shuffle.md").read_text() == "my notes on the shuffle control\n"
    assert not (out / "shuffle.parquet").exists() and not list(out.glob(".plots-*"))
    (out / "shuffle.md").rename(tmp_path / "notes.md")
    res = run_lab(LAB, replace(TINY, experiments=("shuffle",)), out, progress=False)
    assert res.computed == 0 and (out / "shuffle.md").read_text() != "my notes on the shuffle control\n"
