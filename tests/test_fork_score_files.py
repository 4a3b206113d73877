"""``creditlab fork score`` never loses or damages a row of its --out: one writer at a time (a lock),
cut-off lines set aside on resume, files that are not results files refused untouched, and an
interrupted run that keeps what it finished. Through the real CLI, against the loopback judge."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_inproc import run_inproc
from creditlab.judge.testing import ChatServer
from test_cli_mistakes import GOOD, _cli, _one_line_error, _write

REQUESTS = 5  # a GOOD item costs one request per stage: unitize, coverage, match, correctness, threshold


@pytest.fixture(scope="module")
def server():
    with ChatServer() as srv:
        yield srv


def _items(n: int, tag: str = "x") -> list[dict]:
    """Distinct items (identical requests in flight would be shared)."""
    return [{**GOOD, "id": f"{tag}{k}", "prompt": f"Aspirin, case {k} ({tag})?"} for k in range(n)]


def _args(url, inp, out, *extra):
    return ["fork", "score", "--in", inp, "--out", out, "--base-url", url, "--timeout", "10", "--max-retries", "0",
            *extra]


def _popen(*args):
    return subprocess.Popen([sys.executable, "-m", "creditlab.cli.main", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _whole_rows(path: Path) -> list[bytes]:
    """The newline-terminated lines of ``path`` (a cut-off last line is not one)."""
    data = path.read_bytes() if path.exists() else b""
    return data.split(b"\n")[:-1]


def _wait_rows(path: Path, n: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while len(_whole_rows(path)) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, "the run wrote no rows in time"
        time.sleep(0.02)


def _flat(text: str) -> str:
    return " ".join(text.split())  # rich wraps long lines


def _ids(path: Path) -> list[str]:
    return [json.loads(x)["id"] for x in path.read_text().splitlines()]


# -- one writer at a time ------------------------------------------------------------------------------


def test_a_second_writer_is_refused_and_a_killed_runs_lock_is_taken_over(tmp_path):
    inp, shard2, out = tmp_path / "shard1.jsonl", tmp_path / "shard2.jsonl", tmp_path / "out.jsonl"
    _write(inp, _items(40, "a"))
    _write(shard2, _items(4, "b"))
    lock = tmp_path / "out.jsonl.lock"
    (tmp_path / "x").mkdir()
    import creditlab.cli.main  # noqa: F401  (imported before the clock starts below)

    with ChatServer(latency=0.05) as srv:
        first = _popen(*_args(srv.url, inp, out, "--concurrency", "2"))
        try:
            _wait_rows(out, 1, first)
            # a second shard into the same --out (also spelled another way, also with --force): refused at once,
            # naming the run; the dead URL shows that it never got as far as the judge's preflight
            for other, extra in ((out, ()), (tmp_path / "x" / ".." / "out.jsonl", ("--force",))):
                t0 = time.monotonic()
                r = run_inproc(*_args("http://127.0.0.1:9/v1", shard2, other, *extra))
                _one_line_error(r, "--out", "is being written by another run", f"pid {first.pid}", "shard1.jsonl",
                                "--force does not override")
                assert time.monotonic() - t0 < 10  # at once: no waiting for the lock
            assert json.loads(lock.read_text())["pid"] == first.pid
        finally:
            first.kill()
            first.communicate()
        # killed mid-run: its lock file stays behind (the kernel released the lock itself), and maybe a cut line
        assert lock.exists()
        before = _whole_rows(out)
        assert 1 <= len(before) < 40
        srv.reset(latency=0.0)
        r = run_inproc(*_args(srv.url, inp, out, "--concurrency", "2"))
        assert r.returncode == 0, r.stderr
        err = _flat(r.stderr)
        assert f"taking over the lock left by pid {first.pid}" in err and "no longer holds it" in err
        assert srv.stats["requests"] == REQUESTS * (40 - len(before))  # only what the killed run had not finished
    after = out.read_bytes()
    assert all(line + b"\n" in after for line in before)  # every finished row kept, byte for byte
    assert sorted(_ids(out)) == sorted(f"a{k}" for k in range(40))  # each once, no shard-2 row
    assert not lock.exists()  # a run that ends removes its lock


# -- a line cut off by a killed run ------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["cut", "garbled", "no_newline"])
def test_a_cut_off_last_line_is_set_aside_and_its_item_rescored(server, tmp_path, damage):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, _items(3))
    server.reset()
    assert run_inproc(*_args(server.url, inp, out)).returncode == 0
    lines = out.read_bytes().splitlines(keepends=True)
    half = lines[2][: len(lines[2]) // 2]
    damaged = b"".join(lines[:2]) + {"cut": half, "garbled": half + b"\n", "no_newline": lines[2][:-1]}[damage]
    out.write_bytes(damaged)
    server.reset()
    r = run_inproc(*_args(server.url, inp, out))
    assert r.returncode == 0, r.stderr
    err = _flat(r.stderr)
    torn = tmp_path / "out.jsonl.torn"
    if damage == "no_newline":  # a whole row without its newline is a row: it gets the newline, nothing is rescored
        assert out.read_bytes() == damaged + b"\n" and server.stats["requests"] == 0 and not torn.exists()
        return
    why = "cut off (no newline at the end)" if damage == "cut" else "not valid JSON"
    assert f"1 damaged line(s) (line 3: {why}" in err and f"moved to {torn}" in err
    assert torn.read_bytes() == half + b"\n"  # set aside, not lost
    assert out.read_bytes().startswith(b"".join(lines[:2]))  # the whole rows are untouched
    assert server.stats["requests"] == REQUESTS  # only the cut-off item is scored again
    assert sorted(_ids(out)) == ["x0", "x1", "x2"]


# -- an --out that is not a results file, a bad --cache -----------------------------------------------------------

NOT_RESULTS = {
    "csv": (b"id,prompt,response,reward\n1,q,r,0.5\n", "line 1 is not JSON"),
    "parquet": (b"PAR1\x15\x04\x15\x10\x15\x14L\x15\x02\x15\x00\x12\x00\x00\n\x00\x00\x00PAR1", "not text"),
    "responses": ("".join(json.dumps(r) + "\n" for r in _items(2)).encode(), "line 1 is a JSON object without"),
    "json_array": (b"[1, 2, 3]\n", "line 1 is a JSON list"),
    "text": (b"my notes", "line 1 is not JSON"),
}


@pytest.mark.parametrize("kind", sorted(NOT_RESULTS))
def test_an_out_that_is_not_a_results_file_is_refused_and_left_untouched(server, tmp_path, kind):
    inp, out = tmp_path / "in.jsonl", tmp_path / f"out.{kind}"
    _write(inp, _items(2))
    content, why = NOT_RESULTS[kind]
    out.write_bytes(content)
    server.reset()
    for extra in ((), ("--force",)):
        run = _cli if (kind, extra) == ("parquet", ()) else run_inproc  # one real process: no traceback
        r = run(*_args(server.url, inp, out, *extra))
        _one_line_error(r, "--out", "is not a fork-score results file", why, "--force never overwrites")
        assert out.read_bytes() == content
    assert server.stats["requests"] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["in.jsonl", out.name])  # no lock, no .torn


def test_an_out_that_is_a_device_is_refused(server, tmp_path):
    inp = tmp_path / "in.jsonl"
    _write(inp, _items(1))
    server.reset()
    _one_line_error(run_inproc(*_args(server.url, inp, "/dev/null")), "--out", "is not a regular file")
    assert server.stats["requests"] == 0


def test_a_bad_cache_path_is_a_one_line_error_before_anything_is_written(server, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, _items(1))
    (tmp_path / "notes.txt").write_text("not a database\n")
    (tmp_path / "fake.sqlite").write_bytes(b"SQLite format 3\x00" + b"\x07" * 200)
    (tmp_path / "cachedir").mkdir()
    server.reset()
    cases = [(out, "is also --out"), (inp, "is also --in"), (tmp_path / "notes.txt", "is not a SQLite database"),
             (tmp_path / "cachedir", "is a directory"), (tmp_path / "fake.sqlite", "cannot be opened as a SQLite")]
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    for k, (cache, needle) in enumerate(cases):
        _one_line_error((_cli if k == 2 else run_inproc)(*_args(server.url, inp, out, "--cache", cache)),
                        "--cache", needle)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before
    assert not out.exists() and server.stats["requests"] == 0
    # --cache == --out is refused also when --out holds rows (and the rows stay)
    assert run_inproc(*_args(server.url, inp, out)).returncode == 0
    rows = out.read_bytes()
    _one_line_error(run_inproc(*_args(server.url, inp, out, "--cache", out)), "--cache", "is also --out")
    assert out.read_bytes() == rows


# -- interrupted runs keep what they finished ------------------------------------------------------------------


def test_items_stream_through_a_bounded_pipeline():
    """At most ``max_in_flight`` items are in progress; each runs its stages to the end and is yielded as it
    finishes, so the first results come before most items have started."""
    from creditlab.rewards import ForkItem, FORKReward, Rubric

    started, running, peak = [], set(), [0]

    class Slow:
        name, can_judge_correctness = "slow", True

        async def unitize(self, prompt, response):
            started.append(prompt)
            running.add(prompt)
            peak[0] = max(peak[0], len(running))
            await asyncio.sleep(0.001 * (len(started) % 3))
            return [response]

        async def coverage(self, prompt, response, rubrics):
            return [True]

        async def match(self, prompt, rubrics, units):
            return [[True]]

        async def correctness(self, prompt, units):
            return [True]

        async def threshold(self, prompt, units, credits):
            running.discard(prompt)
            return 0.5

    items = [ForkItem(str(k), f"q{k}", "answer", (Rubric("c", 1.0),)) for k in range(40)]

    async def run():
        seen_at_first = None
        out = []
        async for res in FORKReward(Slow()).score_iter(items, max_in_flight=4):
            if seen_at_first is None:
                seen_at_first = len(started)
            out.append(res.id)
        return seen_at_first, out

    first, ids = asyncio.run(run())
    assert sorted(ids, key=int) == [str(k) for k in range(40)] and peak[0] <= 4 and first <= 5
    from creditlab.judge import OpenAIJudge

    judge = OpenAIJudge(["http://a:1/v1", "http://b:1/v1"], "m", concurrency=8)
    assert FORKReward(judge).default_in_flight() == 2 * 8 * 2


def test_ctrl_c_keeps_finished_rows_and_a_rerun_sends_only_what_is_missing(tmp_path):
    n, concurrency = 24, 2
    inp, out, ref = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "ref.jsonl"
    _write(inp, _items(n))
    with ChatServer(latency=0.04) as srv:
        args = _args(srv.url, inp, out, "--concurrency", concurrency)
        assert run_inproc(*_args(srv.url, inp, ref, "--concurrency", concurrency)).returncode == 0
        uninterrupted = srv.stats["requests"]
        assert uninterrupted == REQUESTS * n
        srv.reset()
        run = _popen(*args)
        _wait_rows(out, n // 2, run)
        run.send_signal(signal.SIGINT)
        _, err = run.communicate(timeout=60)
        assert run.returncode == 130 and "Traceback" not in err, err
        kept = _whole_rows(out)
        assert out.read_bytes().endswith(b"\n") and all(json.loads(x)["error"] is None for x in kept)
        assert n // 2 <= len(kept) < n
        err = _flat(err)
        assert f"interrupted (SIGINT): {len(kept)} row(s) written to {out}" in err
        assert f"{len(kept)} of {n} items have a row" in err and "rerun the same command" in err
        interrupted = srv.stats["requests"]
        r = run_inproc(*args)
        assert r.returncode == 0, r.stderr
        resumed = srv.stats["requests"] - interrupted
    assert resumed == REQUESTS * (n - len(kept))
    # repeated work is bounded by the items in flight when the run stopped (2 x concurrency), never the whole run
    assert interrupted + resumed - uninterrupted <= REQUESTS * 2 * concurrency
    assert out.read_bytes().startswith(b"".join(x + b"\n" for x in kept))
    got = {r["id"]: r["reward"] for r in map(json.loads, out.read_text().splitlines())}
    assert got == {r["id"]: r["reward"] for r in map(json.loads, ref.read_text().splitlines())}


def test_force_says_what_it_overrides_and_what_it_never_does():
    r = run_inproc("fork", "score", "--help")
    text = _flat(r.stdout.replace("│", " "))  # rich draws the options in a box
    assert "--force" in text and "other settings" in text
    assert "never overrides the lock of a run still writing --out" in text
    assert "never erases a file that is not a fork-score results file" in text
