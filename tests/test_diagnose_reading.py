"""How ``creditlab diagnose`` reads what trainers and labs really leave on disk, through the real CLI (in
process): the runs of a lab's ``--dump`` directory (refused together, each read alone), a file the same as
another, files a writer left empty or unfinished, compressed files under any name, and ``fork score``
rows without ids. Each case is read with a warning naming the file and line, or refused with one line
that names the cause and the fix."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import zlib
from dataclasses import replace
from pathlib import Path

import pytest

from creditlab.cli.main import main
from creditlab.diagnose import write_dump
from diagnose_synth import clean_rows

ONE = ("--check", "baseline.degenerate_groups")


def _diag(paths, out, capsys, *extra) -> tuple[int, dict | None, str]:
    """Exit code, diagnose.json (None if absent) and stderr (one line per message) of ``creditlab diagnose``
    (one cheap check: these tests are about what is read)."""
    paths = [paths] if isinstance(paths, str | Path) else paths
    with pytest.raises(SystemExit) as ex:
        main(["diagnose", *map(str, paths), "--out", str(out), "--quiet", *ONE, *extra])
    js = Path(out) / "diagnose.json"
    err = " ".join(capsys.readouterr().err.split())
    return ex.value.code, json.loads(js.read_text()) if js.exists() else None, err


def _arm(path: Path, seed: int, steps: int = 4) -> Path:
    """One arm of a lab's ``--dump``: its first step's rollouts are the base policy's (every arm with this
    seed writes the same ones), the later ones its own."""
    first = [r for r in clean_rows(seed=0, steps=1, tokens=False)]
    later = [r for r in clean_rows(seed=seed, steps=steps, tokens=False) if r["step"] > 0]
    return write_dump(first + later, path)


def _age(*paths: Path) -> None:
    """Make ``paths`` older than anything written later, oldest first."""
    for k, p in enumerate(paths):
        os.utime(p, ns=(1_000_000_000 * (k + 1),) * 2)


# ------------------------------------------------------------------------------------------------
# runs and arms stay apart
# ------------------------------------------------------------------------------------------------


def test_the_runs_of_a_lab_dump_directory_are_refused_together_and_read_alone(tmp_path, capsys):
    d = tmp_path / "dump"
    grpo = _arm(d / "granularity-grpo-seed=0.jsonl", seed=1)
    fixed = _arm(d / "granularity-prm_fixed-seed=0.jsonl", seed=2)
    _arm(d / "granularity-prm_decay-seed=0.jsonl", seed=3)
    code, js, err = _diag(d, tmp_path / "o", capsys)
    assert code == 2 and js is None and "Traceback" not in err
    assert err == (f"error: the input holds 3 separate training runs: the files granularity-grpo-seed=0.jsonl, "
                   f"granularity-prm_decay-seed=0.jsonl, granularity-prm_fixed-seed=0.jsonl in {d} start at the same "
                   "step (0) and hold the same groups at 4 steps (0 to 3), as runs do that are not one (a lab's arms "
                   "or seeds, or two trainers); one run writes a step's groups once. Diagnosed together, each group "
                   "would merge across runs and the rollouts they share would read as rows written twice. Diagnose "
                   f'each run on its own: creditlab diagnose {grpo} --out DIR; all of them: for f in "{d}"/*.jsonl; '
                   'do creditlab diagnose "$f" --out "diagnose-$(basename "$f")"; done')
    # the same two files given by name are refused too; each alone is one run, its shared first step kept
    assert _diag([grpo, fixed], tmp_path / "o", capsys)[0] == 2
    for f in (grpo, fixed):
        code, js, err = _diag(f, tmp_path / f.stem, capsys)
        assert code in (0, 1) and js["input"]["trajectories"] == 4 * 32 and js["warnings"] == []
    # not runs: a trainer resumed into a new file (it starts after the first file's start) ...
    resumed = tmp_path / "resumed"
    write_dump(clean_rows(seed=4, steps=6, tokens=False), resumed / "a.jsonl")
    write_dump([r for r in clean_rows(seed=5, steps=9, tokens=False) if r["step"] >= 4], resumed / "b.jsonl")
    code, js, _ = _diag(resumed, tmp_path / "o2", capsys)
    assert code in (0, 1) and js["input"]["trajectories"] == (6 + 5) * 32
    # ... and verl's rollout_data_dir, a file per step
    verl = tmp_path / "verl"
    for s in range(1, 4):
        write_dump([dict(r, step=s) for r in clean_rows(seed=s, steps=1, tokens=False)], verl / f"{s}.jsonl")
    assert _diag(verl, tmp_path / "o3", capsys)[1]["input"]["trajectories"] == 3 * 32
    # two such directories of two runs are two runs
    other = tmp_path / "verl-b"
    for s in range(1, 4):
        write_dump([dict(r, step=s) for r in clean_rows(seed=10 + s, steps=1, tokens=False)], other / f"{s}.jsonl")
    code, js, err = _diag([verl, other], tmp_path / "o4", capsys)
    assert code == 2 and (f"the input holds 2 separate training runs: the directories {verl}, {other} start at "
                          "the same step (1) and hold the same groups at 3 steps (1 to 3)") in err
    # one run's processes, a file each (creditlab's TRL callback), share the groups at their boundary
    ranks = tmp_path / "ranks"
    rows = clean_rows(seed=6, steps=3, tokens=False)  # 32 rows a step: rank 0 writes 18, group 4 split
    write_dump([r for k, r in enumerate(rows) if k % 32 < 18], ranks / "dump.rank-0.jsonl")
    write_dump([r for k, r in enumerate(rows) if k % 32 >= 18], ranks / "dump.rank-1.jsonl")
    assert _diag(ranks, tmp_path / "o5", capsys)[1]["input"]["trajectories"] == 3 * 32


def test_a_lab_dump_names_the_file_that_is_really_the_same(tmp_path, capsys):
    from creditlab.labs.granularity import LAB, GranularityConfig, dump_name

    # what the lab wrote before: the repeat sweep at the lab's own repeat was a byte copy of the arm's run
    d = tmp_path / "dump"
    _arm(d / "granularity-grpo-seed=0.jsonl", seed=1)
    fixed = _arm(d / "granularity-prm_fixed-seed=0.jsonl", seed=2)
    copy = d / "granularity-sweep-prm_fixed-repeat=0.25-seed=0.jsonl"
    shutil.copy(fixed, copy)
    code, _, err = _diag(d, tmp_path / "o", capsys)
    assert code == 2 and err == (f"error: {copy} holds the same rows as {fixed} (every row, step for step: the same "
                                 "dump twice, e.g. in two formats or a copied file): pass one of them")
    # the lab now dumps each training run once: that sweep cell writes no file of its own
    cfg = replace(GranularityConfig.quick(), dump_dir=str(tmp_path / "lab"), cache_dir=str(tmp_path / "cache"))
    from creditlab.labs.granularity.budget import BUDGETS

    def setting(c):  # a budget cell runs in its budget's setting
        return BUDGETS[c.kwargs["budget"]] if "budget" in c.kwargs else c.kwargs.get("setting", "default")

    names = [dump_name(c.kwargs["arm"], c.kwargs["seed"], setting(c), c.kwargs.get("repeat", cfg.repeat))
             for c in LAB.cells(cfg) if "dump_dir" in c.context]
    assert len(names) == len(set(names)) and "granularity-prm_fixed-seed=0.jsonl" in names
    assert "granularity-sweep-prm_fixed-repeat=0.25-seed=0.jsonl" not in names
    assert "granularity-sweep-prm_fixed-repeat=0.5-seed=0.jsonl" in names


# ------------------------------------------------------------------------------------------------
# what a writer leaves unfinished: skipped with a warning, whatever it is
# ------------------------------------------------------------------------------------------------


def _verl_file(path: Path, step: int, n: int = 16) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"input": f"question {i // 4}", "output": "word " * (10 + i),
                                        "score": float(i % 2), "step": step}) + "\n" for i in range(n)))
    return path


def test_an_empty_or_partial_newest_file_of_a_verl_directory_is_skipped_alike(tmp_path, capsys):
    d = tmp_path / "rollouts"
    old = [_verl_file(d / f"{s}.jsonl", s) for s in (1, 2)]
    _age(*old)
    new = d / "3.jsonl"
    new.write_text("")  # verl opened the step's file and has not written its first row
    code, js, err = _diag(d, tmp_path / "o", capsys)
    assert code == 0 and js["input"]["trajectories"] == 32
    assert js["warnings"] == [f"{new} is empty and was skipped: the newest file of the input, probably just created "
                              "by a job that has not written its first row."]
    new.write_text('{"input": "question 0", "outp')  # ... or is writing it
    code, js, err = _diag(d, tmp_path / "o2", capsys)
    assert code == 0 and js["input"]["trajectories"] == 32
    assert js["warnings"] == [f"{new}: line 1 is incomplete (no end of line, not valid JSON) and was skipped: the "
                              "newest file of the input, probably still being written."]
    # an empty older file is what a writer that stopped before its first row leaves: skipped, said so
    new.unlink()
    old[0].write_text("")
    _age(*old)
    code, js, _ = _diag(d, tmp_path / "o3", capsys)
    assert code == 0 and js["warnings"] == [f"{old[0]} is empty and was skipped: its writer wrote no row (e.g. it "
                                            "stopped before the first)."]
    # alone, an empty file is an error: there is nothing to diagnose
    code, js, err = _diag(old[0], tmp_path / "o4", capsys)
    assert code == 2 and f"{old[0]}: holds no rows (the file is empty): nothing to diagnose" in err


def test_an_appended_dump_with_a_row_cut_off_by_a_crash_reads_the_resumed_rows(tmp_path, capsys):
    p = tmp_path / "d.jsonl"
    write_dump(clean_rows(steps=2, tokens=False), p)  # lines 1-64
    text = json.dumps(clean_rows(seed=3, steps=3, tokens=False)[70])
    with p.open("a") as fh:  # the trainer crashed mid-row; resumed, it appended its rows (a plain append)
        fh.write(text[:len(text) // 2])
        fh.writelines(json.dumps(r) + "\n" for r in clean_rows(seed=3, steps=3, tokens=False) if r["step"] == 2)
    code, js, err = _diag(p, tmp_path / "o", capsys)
    assert code == 0 and js["input"]["trajectories"] == 96  # the appended row on the cut-off line is read
    assert js["warnings"] == [f"{p}: line 65 is a row cut off by its writer, followed by rows appended later (a "
                              "trainer that crashed mid-row, then resumed into the same file): the cut-off row was "
                              "skipped; the row written after it on the same line (line 65) was read. To silence "
                              "this, delete the cut-off text from the file."]
    # write_dump starts its rows on a new line: the cut-off row is alone on its line
    lines = p.read_text().splitlines(keepends=True)
    p.write_text("".join(lines[:64]) + text[:len(text) // 2])
    write_dump([r for r in clean_rows(seed=3, steps=3, tokens=False) if r["step"] == 2], p, append=True)
    code, js, _ = _diag(p, tmp_path / "o2", capsys)
    assert code == 0 and js["input"]["trajectories"] == 96
    assert js["warnings"][0].startswith(f"{p}: line 65 is a row cut off by its writer, followed by rows appended "
                                        "later (a trainer that crashed mid-row, then resumed into the same file): "
                                        "the cut-off row was skipped.")
    # a line that is not an unfinished row is still an error naming it and the fix
    p.write_text("".join(lines[:64]) + '{"step": 1,, "group": 0}\n' + "".join(lines[65:]))
    code, js, err = _diag(p, tmp_path / "o3", capsys)
    assert code == 2 and (f"{p}: line 65: not valid JSON (Expecting property name enclosed in double quotes at "
                          "column 12): each line must be one JSON object (one trajectory); fix or remove that "
                          "line") in err


# ------------------------------------------------------------------------------------------------
# compressed files: read by what they hold, not by their name
# ------------------------------------------------------------------------------------------------


def test_a_gzip_file_is_read_whatever_its_name_and_other_compressions_are_named(tmp_path, capsys):
    rows = clean_rows(steps=2, tokens=False)
    plain = write_dump(rows, tmp_path / "plain.jsonl")
    named = tmp_path / "gz" / "rollouts.jsonl"  # gzip under a .jsonl name
    named.parent.mkdir()
    named.write_bytes(gzip.compress(plain.read_bytes()))
    _, want, _ = _diag(plain, tmp_path / "o0", capsys)
    code, js, err = _diag(named, tmp_path / "o1", capsys)
    assert code == want["exit_code"] and js["input"]["trajectories"] == 64 and js["warnings"] == []
    assert [c["value"] for c in js["checks"]] == [c["value"] for c in want["checks"]]
    text = tmp_path / "t" / "rollouts.jsonl.gz"  # plain text under a .gz name
    text.parent.mkdir()
    shutil.copy(plain, text)
    assert _diag(text, tmp_path / "o2", capsys)[1]["input"]["trajectories"] == 64
    zst = tmp_path / "z" / "rollouts.jsonl"
    zst.parent.mkdir()
    zst.write_bytes(b"\x28\xb5\x2f\xfd" + os.urandom(64))
    code, js, err = _diag(zst, tmp_path / "o3", capsys)
    assert code == 2 and err == (f"error: {zst}: is zstd-compressed, which diagnose does not read: decompress it "
                                 "(zstd -d rollouts.jsonl), or compress it with gzip as a .jsonl.gz file")
    binary = tmp_path / "b" / "rollouts.jsonl"
    binary.parent.mkdir()
    binary.write_bytes(b'{"step": 0}\n\xff\xfe\x00')
    code, js, err = _diag(binary, tmp_path / "o4", capsys)
    assert code == 2 and f"{binary}: line 2: not UTF-8 text (byte 0xff): not a JSONL dump" in err


def _members(rows: list[dict], *cuts: int) -> tuple[list[bytes], list[list[str]]]:
    """The rows' JSONL lines in gzip members, the first ``cuts[0]`` lines in the first member, ..."""
    lines = [json.dumps(r) + "\n" for r in rows]
    edges = [0, *cuts, len(lines)]
    parts = [lines[a:b] for a, b in zip(edges[:-1], edges[1:], strict=True)]
    return [gzip.compress("".join(p).encode(), mtime=0) for p in parts], parts


def _whole_lines(data: bytes) -> int:
    """Complete lines in the text a cut-off gzip member gives up to its cut."""
    d = zlib.decompressobj(31)
    return (d.decompress(data) + d.flush()).count(b"\n")


def _cut_row(data: bytes) -> bool:
    """Whether the text a cut-off gzip member gives up to its cut ends in a row cut in two."""
    d = zlib.decompressobj(31)
    text = d.decompress(data) + d.flush()
    return bool(text) and not text.endswith(b"\n")


def test_a_gzip_file_cut_off_and_appended_to_reads_every_row_of_every_member(tmp_path, capsys):
    """A writer killed mid-member, then another appending a new member: every complete row of every
    member is read, and a warning says where each cut is and what was read, wherever the cut falls (in
    the header, the compressed rows, the trailer)."""
    rows = clean_rows(steps=4, tokens=False)  # 128 rows
    (m1, m2, m3), parts = _members(rows, 40, 90)
    older = tmp_path / "older.jsonl"  # the newest file of the input is the gzip one
    write_dump(clean_rows(seed=5, steps=2, tokens=False), older)
    _age(older)
    for k, cut in enumerate([5, len(m1) // 7, len(m1) // 3, len(m1) // 2, len(m1) - 30, len(m1) - 4]):
        f = tmp_path / f"cut{k}" / "rollouts.jsonl.gz"
        f.parent.mkdir()
        f.write_bytes(m1[:cut] + m2 + m3)
        code, js, err = _diag(f, tmp_path / f"o{k}", capsys)
        before = _whole_lines(m1[:cut])
        assert code == 0 and js["input"]["trajectories"] == before + len(parts[1]) + len(parts[2]), (cut, err)
        assert len(js["warnings"]) == 1 and err.count("warning:") == 1, (cut, err)
        w = js["warnings"][0]
        assert (f"gzip member 1 of 3 (bytes 0-{cut:,}) is cut off at byte {cut:,} and followed by a new member" in w
                and f"the {before} rows before the cut and the {len(parts[1]) + len(parts[2])} rows after it "
                    "were read" in w), (cut, w)
        assert (f"line {before + 1}, the row the cut falls in, was skipped" in w) == _cut_row(m1[:cut]), (cut, w)
        assert ("none of its text is in the file" in w) == (cut == 5), (cut, w)
    # two cuts, then a member still being written: each cut named, the last member's rows up to its cut read
    f = tmp_path / "twice" / "rollouts.jsonl.gz"
    f.parent.mkdir()
    a, b, c = len(m1) // 2, len(m2) // 3, len(m3) // 2
    f.write_bytes(m1[:a] + m2[:b] + m3[:c])
    code, js, err = _diag(f, tmp_path / "o-twice", capsys)
    n1, n2, n3 = _whole_lines(m1[:a]), _whole_lines(m2[:b]), _whole_lines(m3[:c])
    assert code == 0 and js["input"]["trajectories"] == n1 + n2 + n3, err
    w = js["warnings"]
    assert f"gzip member 1 of 3 (bytes 0-{a:,}) is cut off" in w[0] and f"line {n1 + 1}, the row" in w[0]
    assert f"gzip member 2 of 3 (bytes {a:,}-{a + b:,}) is cut off" in w[1]
    assert f"line {n1 + n2 + n3 + 3} is incomplete" in w[2]  # the two cut-off rows before it keep their lines
    assert f"the gzip stream is cut off at byte {a + b + c:,} (in its last member, from byte {a + b:,})" in w[3]
    assert "probably still being written" in w[3] and f"({n1 + n2 + n3}) were read" in w[3]
    # bytes that are no gzip data between members: named, the rows around them read
    f = tmp_path / "junk" / "rollouts.jsonl.gz"
    f.parent.mkdir()
    f.write_bytes(m1 + b"not gzip " * 8 + m2 + m3 + b"\0" * 64)  # zero padding at the end is gzip's own
    code, js, err = _diag(f, tmp_path / "o-junk", capsys)
    assert code == 0 and js["input"]["trajectories"] == len(rows)
    assert js["warnings"] == [f"{f}: bytes {len(m1):,}-{len(m1) + 72:,} (72 bytes) are not readable gzip data (no "
                              "gzip header there) and were not read: any rows in them are lost (a file damaged on "
                              "disk, or written into by something else)."]
    # nothing readable: one line, exit 2
    f = tmp_path / "bad" / "rollouts.jsonl.gz"
    f.parent.mkdir()
    f.write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(256)) * 8)
    code, js, err = _diag(f, tmp_path / "o-bad", capsys)
    assert code == 2 and js is None and err.startswith(f"error: {f}: cannot be read: not a readable gzip stream")
    assert "Traceback" not in err and err.count("error:") == 1


# ------------------------------------------------------------------------------------------------
# fork score: rows without ids
# ------------------------------------------------------------------------------------------------


def test_fork_rows_without_ids_differ_by_rubrics_and_a_real_duplicate_says_where_its_id_came_from(tmp_path):
    import contextlib
    import io

    from creditlab.judge.testing import ChatServer

    base = {"prompt": "Aspirin?", "response": "Take aspirin with water. Get some rest."}
    rows = [{**base, "rubrics": [{"criterion": "aspirin water", "points": 2}]},
            {**base, "rubrics": [{"criterion": "rest", "points": 1}]},  # same prompt and response, another rubric
            {**base, "rubrics": [{"criterion": "rest", "points": 1}]},  # the same item again
            {"prompt_id": "p", "id": "p#1", **base, "rubrics": [{"criterion": "rest", "points": 1}]},
            {"prompt_id": "p", **base, "rubrics": [{"criterion": "rest", "points": 1}]}]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    err = io.StringIO()
    with ChatServer() as srv, contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        with pytest.raises(SystemExit) as ex:
            main(["fork", "score", "--in", str(inp), "--out", str(out), "--base-url", srv.url, "--timeout", "5",
                  "--max-retries", "0"])
    assert ex.value.code == 1
    text = " ".join(err.getvalue().split())
    skipped = [ln for ln in err.getvalue().splitlines() if ln.startswith("skipped")]
    assert len(skipped) == 1, skipped
    assert ("skipped in.jsonl:3: the same item as line 2 (the same prompt, response and rubrics; neither row has an "
            "'id', 'prompt_id' or 'uid', so each is named by a hash of those): remove one, or give each its own "
            "'id'") in text
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(got) == 4 and len({r["id"] for r in got}) == 4
    # a row named by its prompt_id colliding with an explicit id says which field named it
    rows[3]["id"], rows[4]["prompt_id"] = "p", "p"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows[3:]))
    err = io.StringIO()
    with ChatServer() as srv, contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        with pytest.raises(SystemExit):
            main(["fork", "score", "--in", str(inp), "--out", str(tmp_path / "o2.jsonl"), "--base-url", srv.url,
                  "--timeout", "5", "--max-retries", "0"])
    assert ("skipped in.jsonl:2: duplicate id 'p', taken from its field 'prompt_id' as the row has no 'id' (first "
            "at line 1): give each row its own 'id'") in " ".join(err.getvalue().split())
