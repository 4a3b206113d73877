"""Real mistakes through the real CLI (subprocess): every class gives a clear one-line error or an
explicit per-item error, a non-zero exit code, no traceback, and never loses or changes a finished row."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cli_inproc import run_inproc
from creditlab.judge.testing import FAULTS, ChatServer

GOOD = {"id": "good", "prompt": "Aspirin?", "response": "Take aspirin with water. Get some rest.",
        "rubrics": [{"criterion": "aspirin water", "points": 2}, {"criterion": "rest", "points": 1}]}


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "creditlab.cli.main", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


def _one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    err = r.stderr.strip()
    assert err.startswith("error:"), err
    flat = " ".join(err.split())  # rich wraps long lines
    for n in needles:
        assert n in flat, (n, flat)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def server():
    with ChatServer() as srv:
        yield srv


def _score(server, inp, out, *extra, run=run_inproc):
    return run("fork", "score", "--in", inp, "--out", out, "--base-url", server.url, "--timeout", "5",
               "--max-retries", "0", *extra)


# -- resume never mixes settings --------------------------------------------------------------


@pytest.mark.parametrize(("flag", "value", "key", "run"), [
    ("--beta", "2", "beta", _cli), ("--mode", "recall", "mode", run_inproc), ("--tau", "0.5", "tau", run_inproc),
    ("--model", "other", "model", run_inproc),
])
def test_rerun_with_other_settings_refuses_before_any_request(server, tmp_path, flag, value, key, run):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [GOOD])
    assert _score(server, inp, out).returncode == 0
    before, requests = out.read_bytes(), server.stats["requests"]
    r = _score(server, inp, out, flag, value, run=run)
    _one_line_error(r, "--out", "differs in: " + ("beta, mode" if key == "mode" else key), "--force")  # recall: no beta
    assert out.read_bytes() == before and server.stats["requests"] == requests
    forced = _score(server, inp, out, flag, value, "--force")
    assert forced.returncode == 0, forced.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["settings"][key] == (float(value) if key in ("beta", "tau") else value)


def test_rows_record_their_settings_and_a_same_settings_rerun_reuses_them(server, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [GOOD])
    assert _score(server, inp, out).returncode == 0
    row = json.loads(out.read_text())
    assert {"judge", "model", "base_url", "mode", "beta", "tau", "prompt_version", "creditlab_version"} <= set(
        row["settings"])
    requests = server.stats["requests"]
    assert _score(server, inp, out).returncode == 0
    assert server.stats["requests"] == requests  # nothing rescored


def test_an_output_written_without_settings_is_not_resumed(server, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [GOOD])
    out.write_text(json.dumps({"id": "good", "reward": 1.0, "error": None}) + "\n")
    _one_line_error(_score(server, inp, out), "--out", "other settings")


# -- items that cannot be scored are errors, not rewards --------------------------------------


def test_unscorable_items_are_errors_and_empty_responses_score_zero(server, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [GOOD,
            {**GOOD, "id": "none", "rubrics": []},
            {**GOOD, "id": "zero", "rubrics": [{"criterion": "rest", "points": 0}]},
            {**GOOD, "id": "pitfall", "rubrics": [{"criterion": "recommends opioids", "points": -5}]},
            {**GOOD, "id": "empty", "response": "   "}]
    _write(inp, rows)
    r = _score(server, inp, out, run=_cli)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    got = {x["id"]: x for x in map(json.loads, out.read_text().splitlines())}
    assert got["good"]["reward"] == 1.0
    for ident, reason in (("none", "no rubric"), ("zero", "0 points"), ("pitfall", "only negative")):
        assert got[ident]["reward"] is None and f"item '{ident}' cannot be scored" in got[ident]["error"]
        assert reason in got[ident]["error"]
    assert got["empty"]["reward"] == 0.0 and got["empty"]["error"] is None and "empty response" in got["empty"]["note"]
    assert "cannot be scored" in " ".join(r.stderr.split())
    # the absence convention is opt-in: pitfall-only items then get 1 when no pitfall is violated
    out2 = tmp_path / "out2.jsonl"
    r = _score(server, inp, out2, "--pitfall-only", "absence")
    got2 = {x["id"]: x for x in map(json.loads, out2.read_text().splitlines())}
    assert got2["pitfall"]["reward"] == 1.0 and got2["pitfall"]["precision"] is None
    assert got2["none"]["reward"] is None  # still no denominator


def test_duplicate_ids_name_both_lines_and_1_equals_the_string_1(server, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [{**GOOD, "id": 1}, {**GOOD, "id": "2"}, {**GOOD, "id": "1"}])
    r = _score(server, inp, out, run=_cli)
    assert r.returncode == 1
    err = " ".join(r.stderr.split())
    assert "in.jsonl:3: duplicate id '1' (first at line 1" in err
    assert sorted(json.loads(x)["id"] for x in out.read_text().splitlines()) == ["1", "2"]


# -- files and paths ---------------------------------------------------------------------------


def test_bad_paths_are_one_line_errors_before_any_work(tmp_path):
    good = tmp_path / "in.jsonl"
    _write(good, [GOOD])
    (tmp_path / "latin1.jsonl").write_bytes(json.dumps(GOOD).replace("Aspirin?", "Asp\xedrin?").encode("latin-1"))
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    dead = "http://127.0.0.1:9/v1"  # nothing listens: a path error must come before any connection
    cases = [
        (["--in", tmp_path / "missing.jsonl", "--out", tmp_path / "o.jsonl"], ("--in", "no such file")),
        (["--in", tmp_path, "--out", tmp_path / "o.jsonl"], ("--in", "is a directory")),
        (["--in", tmp_path / "latin1.jsonl", "--out", tmp_path / "o.jsonl"], ("--in", "not UTF-8", "line 1")),
        (["--in", tmp_path / "empty.jsonl", "--out", tmp_path / "o.jsonl"], ("--in", "is empty")),
        (["--in", good, "--out", tmp_path / "nodir" / "o.jsonl"], ("--out", "does not exist")),
        (["--in", good, "--out", tmp_path], ("--out", "is a directory")),
        (["--in", good, "--out", good], ("--out", "is the input file")),
    ]
    for k, (args, needles) in enumerate(cases):
        r = (_cli if k == 0 else run_inproc)("fork", "score", *args, "--base-url", dead)
        _one_line_error(r, *needles)
    assert not (tmp_path / "nodir").exists() and not (tmp_path / "o.jsonl").exists()
    # the offline judge fails on a bad path before loading its embedding model
    r = _cli("fork", "score", "--in", tmp_path / "empty.jsonl", "--out", tmp_path / "o.jsonl", "--judge", "offline",
             "--assume-correct")
    _one_line_error(r, "--in", "is empty")


def test_a_lab_rerun_with_another_configuration_refuses(tmp_path):
    out = tmp_path / "fork"
    args = ["lab", "fork", "--quick", "--out", out, "--seeds", "1", "-e", "oracle"]
    assert run_inproc(*args).returncode == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    _one_line_error(_cli(*args[:-2], "-e", "oracle", "--updates", "7"), "--out", "another configuration",
                    "differs in: updates")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    _one_line_error(run_inproc("lab", "fork", "--quick", "--out", tmp_path / "never", "--seeds", "0"), "--seeds")
    assert not (tmp_path / "never").exists()


# -- a dead or hung judge is found at once -----------------------------------------------------


class _Silent:
    """A TCP server that accepts connections and never answers (a hung endpoint)."""

    def __enter__(self):
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.conns = []
        self.stop = False

        def accept():
            while not self.stop:
                try:
                    self.conns.append(self.sock.accept()[0])
                except OSError:
                    return

        threading.Thread(target=accept, daemon=True).start()
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"

    def __exit__(self, *exc):
        self.stop = True
        self.sock.close()
        for c in self.conns:
            c.close()


def test_dead_and_hung_endpoints_are_named_before_scoring(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [GOOD])
    r = _cli("fork", "score", "--in", inp, "--out", out, "--base-url", "http://127.0.0.1:9/v1")
    _one_line_error(r, "--base-url", "cannot connect to http://127.0.0.1:9/v1", "--no-preflight")
    with _Silent() as url:
        r = run_inproc("fork", "score", "--in", inp, "--out", out, "--base-url", url, "--timeout", "2")
        _one_line_error(r, "--base-url", f"{url} did not answer within 2s")  # not after 2 s x 3 attempts
    assert not out.exists()


def test_a_judge_that_dies_mid_run_stops_submitting_and_keeps_finished_rows(server, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [GOOD])
    assert _score(server, inp, out).returncode == 0
    first = out.read_text()
    # distinct items (identical requests in flight are shared, so they would hang together as one)
    _write(inp, [GOOD] + [{**GOOD, "id": f"more{k}", "prompt": f"Aspirin, case {k}?"} for k in range(12)])
    server.reset(fault_rate=1.0, fault_kinds=("timeout",), hang=1.5)  # from now on every request hangs
    try:
        r = _cli("fork", "score", "--in", inp, "--out", out, "--base-url", server.url, "--timeout", "0.5",
                 "--max-retries", "1")
    finally:  # the endpoint is back (reset keeps settings it is not given: restore them all)
        server.reset(fault_rate=0.0, fault_kinds=FAULTS, hang=5.0)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    err = " ".join(r.stderr.split())
    assert "stopped submitting" in err and f"consecutive failed requests to {server.url}" in err
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert out.read_text().startswith(first) and rows[0]["reward"] == 1.0  # the finished row is untouched
    assert all(r["error_kind"] == "timeout" for r in rows[1:])  # attempted before the endpoint was taken as down
    assert len(rows) < 13  # the rest were never sent
    # the endpoint is back: a rerun scores what is missing
    assert _score(server, inp, out).returncode == 0
    assert {json.loads(x)["id"] for x in out.read_text().splitlines()} == {"good"} | {f"more{k}" for k in range(12)}


def test_a_rows_request_count_agrees_with_its_attempts(server, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [GOOD])
    server.reset()
    server.push_faults(["500", "500"])  # two attempts fail and are retried
    r = run_inproc("fork", "score", "--in", inp, "--out", out, "--base-url", server.url, "--max-retries", "2",
                   "--no-preflight")
    assert r.returncode == 0, r.stderr
    row = json.loads(out.read_text())
    assert row["requests"] == server.stats["requests"] == 5 + 2
