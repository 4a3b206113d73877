"""One judge over several OpenAI-compatible endpoints serving the same model (loopback servers).

Requests go to the least loaded endpoint with a free slot, each endpoint keeps its own concurrency
limit and health, an endpoint that keeps failing is taken out of rotation and tried again later
while the others keep scoring, and the run stops only when every endpoint is out.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from pathlib import Path

import pytest

from cli_inproc import run_inproc
from creditlab.errors import ConfigError
from creditlab.judge import JudgeError, OpenAIJudge, track_usage
from creditlab.judge.testing import ChatServer
from creditlab.rewards import ForkItem, FORKReward, Rubric


def run(coro):
    return asyncio.run(coro)


def dead_url() -> str:
    """A loopback URL nobody listens on (a port just released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def items(n: int, tag: str = "") -> list[ForkItem]:
    return [ForkItem(f"i{k}", f"Aspirin {tag}{k}?", f"Take aspirin with water number{k}. Rest now{k}.",
                     (Rubric("aspirin water", 1.0), Rubric(f"rest now{k}", 1.0))) for k in range(n)]


@pytest.fixture(params=["httpx", "asyncio"])
def transport(request):
    return request.param


def judge(urls, transport="asyncio", **kw):
    opts = dict(timeout=1.0, max_retries=3, max_reasks=0, backoff_base=0.005, backoff_max=0.02, seed=0,
                transport=transport, max_consecutive_failures=3)
    opts.update(kw)
    return OpenAIJudge(urls, "judge-model", **opts)


async def score(j, its):
    try:
        return await FORKReward(j).score(its)
    finally:
        await j.aclose()


def test_requests_spread_over_endpoints_each_within_its_limit(transport):
    with ChatServer(latency=0.02) as a, ChatServer(latency=0.02) as b, ChatServer(latency=0.02) as c:
        j = judge([a.url, b.url, c.url], transport, concurrency=3)
        res = run(score(j, items(12)))
        assert all(r.error is None for r in res) and [r.reward for r in res] == [1.0] * 12
        sent = [s.stats["requests"] for s in (a, b, c)]
        assert sum(sent) == 60 and min(sent) >= 12  # 5 requests per item, every endpoint used
        assert all(s.stats["max_inflight"] <= 3 for s in (a, b, c))
        stats = j.endpoint_stats()
        assert [st["requests"] for st in stats] == sent and all(st["state"] == "up" for st in stats)
        assert all(st["errors"] == 0 and 0.02 <= st["latency_mean_s"] < 1.0 for st in stats)


def test_the_faster_endpoint_gets_more_of_the_load():
    with ChatServer(latency=0.005) as fast, ChatServer(latency=0.1) as slow:
        run(score(judge([slow.url, fast.url], concurrency=4), items(16)))
        assert fast.stats["requests"] > 3 * slow.stats["requests"]


def test_a_retry_goes_to_another_endpoint():
    with ChatServer() as a, ChatServer() as b:
        a.push_faults(["500"])
        with track_usage() as usage:
            assert run(judge([a.url, b.url]).unitize("q", "One fact.")) == ["One fact."]
        assert usage.requests == 2 and a.stats["requests"] == 1 and b.stats["requests"] == 1


def test_a_dead_endpoint_is_taken_out_and_the_others_keep_scoring(transport):
    dead = dead_url()
    with ChatServer(latency=0.01) as a, ChatServer(latency=0.01) as b:
        j = judge([dead, a.url, b.url], transport, concurrency=2)
        res = run(score(j, items(10)))
        assert all(r.error is None for r in res)
        d = j.endpoint_stats()[0]
        assert d["state"].startswith("out of rotation") and "consecutive failed requests to " + dead[:-3] in d["reason"]
        assert d["errors"] == d["requests"] and d["requests"] <= 3 + 2  # the streak, plus requests in flight
        assert a.stats["requests"] + b.stats["requests"] == 50 and j.down is None


def test_a_hung_endpoint_is_taken_out_and_the_others_keep_scoring():
    with ChatServer(fault_rate=1.0, fault_kinds=("timeout",), hang=2.0) as hung, ChatServer() as ok:
        j = judge([hung.url, ok.url], concurrency=2, timeout=0.2)
        t0 = time.perf_counter()
        res = run(score(j, items(6)))
        assert all(r.error is None for r in res) and time.perf_counter() - t0 < 5
        assert j.endpoint_stats()[0]["state"].startswith("out of rotation") and ok.stats["requests"] == 30


def test_an_endpoint_out_of_rotation_is_tried_again_and_rejoins():
    dead = dead_url()
    port = int(dead.rsplit(":", 1)[1].split("/")[0])
    with ChatServer() as live:
        j = judge([dead, live.url], concurrency=1, retry_endpoint_after=0.2)

        async def go():
            first = await FORKReward(j).score(items(2, "a"))
            assert j.endpoint_stats()[0]["state"].startswith("out of rotation")
            with ChatServer(port=port) as back:  # the endpoint comes back on its address
                await asyncio.sleep(0.3)
                second = await FORKReward(j).score(items(8, "b"))
                served = back.stats["requests"]
            await j.aclose()
            return first + second, served

        res, served = run(go())
        assert all(r.error is None for r in res)
        assert served > 0 and j.endpoint_stats()[0]["state"] == "up"


def test_the_judge_is_down_only_when_every_endpoint_is():
    j = judge([dead_url(), dead_url()], concurrency=2, max_retries=5)
    res = run(score(j, items(4)))
    assert all(r.reward is None for r in res) and j.down is not None
    assert j.down.startswith("every endpoint is down: ") and j.down.count("consecutive failed requests") == 2
    sent = sum(st["requests"] for st in j.endpoint_stats())
    assert sent <= 2 * (3 + 2) and all(st["state"] == "down" for st in j.endpoint_stats())
    with pytest.raises(JudgeError) as info:  # nothing more is sent
        run(j.unitize("q", "A fact."))
    assert info.value.kind == "endpoint_down"
    assert sum(st["requests"] for st in j.endpoint_stats()) == sent


def test_preflight_takes_out_a_dead_endpoint_and_refuses_when_none_answers():
    dead = dead_url()
    with ChatServer() as live:
        j = judge([dead, live.url])
        problems = run(j.preflight(timeout=1.0))
        assert len(problems) == 1 and f"cannot connect to {dead}" in problems[0]
        assert "taken out of rotation" in problems[0]
        assert j.endpoint_stats()[0]["state"].startswith("out of rotation")
        assert run(j.unitize("q", "A fact.")) == ["A fact."] and live.stats["requests"] == 1
        assert run(judge([live.url]).preflight(timeout=1.0)) == []
    other = dead_url()
    with pytest.raises(JudgeError, match=f"no endpoint answers: cannot connect to {dead}.*; cannot connect to {other}"):
        run(judge([dead, other]).preflight(timeout=1.0))


def test_configuration_mistakes():
    with pytest.raises(ConfigError, match="base_url: give at least one endpoint URL"):
        OpenAIJudge([], "m")
    with pytest.raises(ConfigError, match="base_url: http://a/v1/ is given twice"):
        OpenAIJudge(["http://a/v1", "http://a/v1/"], "m")
    with pytest.raises(ConfigError, match="must start with http"):
        OpenAIJudge(["http://a/v1", "b:8000"], "m")
    assert "urls=" in repr(OpenAIJudge(["http://a/v1", "http://b/v1"], "m"))


# -- the CLI -----------------------------------------------------------------------------------------

GOOD = {"id": "good", "prompt": "Aspirin?", "response": "Take aspirin with water. Get some rest.",
        "rubrics": [{"criterion": "aspirin water", "points": 2}, {"criterion": "rest", "points": 1}]}


def write_items(path: Path, n: int) -> None:
    path.write_text("".join(json.dumps({**GOOD, "id": f"g{k}", "prompt": f"Aspirin {k}?"}) + "\n"
                            for k in range(n)))


def test_cli_scores_over_several_endpoints_and_resumes_with_another_set(tmp_path):
    inp, out, urls_file = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "urls.txt"
    write_items(inp, 6)
    dead = dead_url()
    with ChatServer() as a, ChatServer() as b, ChatServer() as c, ChatServer() as d:
        urls_file.write_text(f"# judge replicas\n{b.url}\n\n{dead}  # not started\n")
        r = run_inproc("fork", "score", "--in", inp, "--out", out, "--base-url", a.url, "--base-urls-file", urls_file,
                       "--model", "judge", "--timeout", "2", "--max-retries", "2", "--transport", "asyncio")
        assert r.returncode == 0, r.stderr
        assert f"endpoint: cannot connect to {dead}" in " ".join(r.stderr.split())  # found by the preflight
        summary = " ".join(r.stdout.split())
        assert "judge endpoints" in summary and a.url in summary and "out of rotation" in summary
        assert a.stats["requests"] > 0 and b.stats["requests"] > 0
        rows = [json.loads(x) for x in out.read_text().splitlines()]
        assert len(rows) == 6 and all(row["error"] is None for row in rows)
        assert rows[0]["settings"]["base_url"] == [a.url, b.url, dead]
        # Resume against another set of URLs sharing one endpoint with the first (a dropped, c added): the
        # endpoints of one run serve one model, so it is the same judge; nothing already scored is redone.
        write_items(inp, 8)
        before = a.stats["requests"], b.stats["requests"] + c.stats["requests"]
        r = run_inproc("fork", "score", "--in", inp, "--out", out, "--base-url", b.url, "--base-url", c.url,
                       "--model", "judge")
        assert r.returncode == 0, r.stderr
        assert a.stats["requests"] == before[0] and b.stats["requests"] + c.stats["requests"] - before[1] == 2 * 5
        rows = [json.loads(x) for x in out.read_text().splitlines()]
        assert len(rows) == 8 and rows[-1]["settings"]["base_url"] == [b.url, c.url]
        # another model is another judge: refused
        r = run_inproc("fork", "score", "--in", inp, "--out", out, "--base-url", c.url, "--model", "other")
        assert r.returncode == 2 and "differs in: model" in " ".join(r.stderr.split())
        # one replica fewer than the last run (c alone): linked to a's rows through b, so the same judge
        r = run_inproc("fork", "score", "--in", inp, "--out", out, "--base-url", c.url, "--model", "judge")
        assert r.returncode == 0, r.stderr
        # endpoints linked to none of those that scored the rows may be another judge: refused
        (tmp_path / "d.txt").write_text(d.url + "\n")
        r = run_inproc("fork", "score", "--in", inp, "--out", out, "--base-urls-file", tmp_path / "d.txt",
                       "--model", "judge")
        flat = " ".join(r.stderr.split())
        assert r.returncode == 2 and "Traceback" not in r.stderr and d.stats["requests"] == 0, r.stderr
        assert flat.startswith("error: --base-urls-file:") and \
            f"scored by the judge at {a.url}, {b.url}, {dead}, {c.url}, and this run's endpoints ({d.url})" in flat


def test_cli_endpoint_list_mistakes_are_one_line_errors(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_items(inp, 1)
    bad = tmp_path / "urls.txt"
    bad.write_text("http://127.0.0.1:1/v1\nlocalhost:8000\n")
    cases = [
        (["--base-urls-file", bad], f"--base-urls-file: {bad}:2: 'localhost:8000' must start with http://"),
        (["--base-urls-file", tmp_path / "none.txt"], "--base-urls-file: no such file"),
        (["--base-url", "http://x/v1", "--base-url", "http://x/v1/"], "--base-url: --base-url http://x/v1/: "
                                                                       "http://x/v1/ is given twice"),
        (["--base-url", dead_url(), "--base-url", dead_url(), "--timeout", "1"], "no endpoint answers"),
    ]
    (tmp_path / "empty.txt").write_text("# nothing\n")
    cases.append((["--base-urls-file", tmp_path / "empty.txt"], "holds no URL"))
    for extra, needle in cases:
        r = run_inproc("fork", "score", "--in", inp, "--out", out, *extra)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (extra, r.stderr)
        assert needle in " ".join(r.stderr.split()), (needle, r.stderr)
    assert not out.exists()


def test_cli_transport_auto_takes_the_minimal_client_only_without_proxies_or_tls(monkeypatch):
    from creditlab.cli.fork_cmd import _transport

    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    local = ["http://127.0.0.1:8000/v1", "http://10.0.0.7:8000/v1"]
    assert _transport("auto", local) == "asyncio"
    assert _transport("auto", [*local, "https://api.example.com/v1"]) == "httpx"
    assert _transport("httpx", local) == "httpx" and _transport("asyncio", local) == "asyncio"
    monkeypatch.setenv("http_proxy", "http://proxy.invalid:3128")
    assert _transport("auto", local) == "httpx"
    monkeypatch.setenv("no_proxy", "127.0.0.1,10.0.0.7")
    assert _transport("auto", local) == "asyncio"
    with pytest.raises(ConfigError, match="--transport: unknown 'h2'"):
        _transport("h2", local)


# -- the minimal HTTP client (transport="asyncio") ----------------------------------------------------

class RawServer:
    """A loopback server answering each request with the next canned reply (bytes), then optionally
    closing the connection: replies no well-behaved test server sends."""

    def __init__(self, replies, close_after=False):
        import threading

        self.replies, self.close_after = list(replies), close_after
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1/chat/completions"
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while self.replies:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                buf = b""
                while self.replies:
                    while b"\r\n\r\n" not in buf:
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        buf += chunk
                    if b"\r\n\r\n" not in buf:
                        break
                    head, _, buf = buf.partition(b"\r\n\r\n")
                    length = int(next(h.split(b":")[1] for h in head.split(b"\r\n")
                                      if h.lower().startswith(b"content-length")))
                    while len(buf) < length:
                        buf += conn.recv(65536)
                    buf = buf[length:]
                    conn.sendall(self.replies.pop(0))
                    if self.close_after:
                        break

    def close(self):
        self.sock.close()


def lean_posts(url, n, timeout=2.0):
    from creditlab.judge._http import LeanClient

    async def go():
        client = LeanClient(url, {"Content-Type": "application/json"}, timeout, 4)
        try:
            return [await client.post(b"{}") for _ in range(n)]
        finally:
            await client.aclose()

    return run(go())


def test_lean_client_reads_chunked_close_delimited_and_stale_connections():
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6;x=1\r\n world\r\n0\r\n\r\n"
    srv = RawServer([chunked, chunked])
    a, b = lean_posts(srv.url, 2)
    assert a.content == b.content == b"hello world" and srv.connections == 1  # kept alive
    srv.close()
    srv = RawServer([b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{\"a\": 1}"], close_after=True)
    assert lean_posts(srv.url, 1)[0].json() == {"a": 1}  # the body ends with the connection
    srv.close()
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    srv = RawServer([ok, ok, ok], close_after=True)  # closes every connection without saying so
    assert [r.content for r in lean_posts(srv.url, 3)] == [b"ok"] * 3 and srv.connections == 3
    srv.close()
    from creditlab.judge._http import HTTPError

    srv = RawServer([b"SMTP ready\r\n\r\n"])
    with pytest.raises(HTTPError, match="not an HTTP/1.x status line"):
        lean_posts(srv.url, 1)
    srv.close()


def test_lean_client_timeout_bounds_the_server_not_a_busy_event_loop():
    """A reply that arrives while the client's loop is blocked (longer than the timeout) still counts."""
    from creditlab.judge._http import LeanClient

    with ChatServer(latency=0.02) as srv:
        async def go():
            client = LeanClient(srv.url + "/chat/completions", {"Content-Type": "application/json"}, 0.2, 4)
            body = json.dumps({"model": "m", "messages": [{"role": "user", "content": json.dumps(
                {"task": "threshold", "question": "q", "units": []})}]}).encode()
            await client.post(body)  # connected
            task = asyncio.ensure_future(client.post(body))
            await asyncio.sleep(0)  # the request is written
            time.sleep(0.5)  # the loop is busy (e.g. preparing thousands of requests): the reply waits
            resp = await task
            await client.aclose()
            return resp

        assert run(go()).status_code == 200


# -- the benchmark compares like with like -------------------------------------------------------------

def test_the_benchmarks_openai_sdk_judge_scores_like_creditlabs_client():
    pytest.importorskip("openai", reason="the dev extra installs the openai SDK (benchmark comparison)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        from bench_fork import SDKJudge, make_items
    finally:
        sys.path.pop(0)
    its = make_items(3, rubrics=5, units=6)
    with ChatServer() as srv:
        ours = run(score(judge(srv.url), its))
        sdk = SDKJudge(srv.url, "judge-model", concurrency=4, timeout=5)
        theirs = run(score(sdk, its))
    assert [r.reward for r in theirs] == [r.reward for r in ours] and all(r.error is None for r in ours)
    assert [r.requests for r in theirs] == [r.requests for r in ours]
