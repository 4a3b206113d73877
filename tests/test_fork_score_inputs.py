"""``creditlab fork score`` scores the response, the whole response and the current response: which
field is the response, chat-message responses, changed inputs on resume, out-of-range numbers, files
that are not JSON Lines, HealthBench ids, a slow judge and endpoint mistakes named by the preflight.
Through the real CLI (exit code, one-line message naming the line or field, no traceback, file bytes)
or the API, against loopback judges."""

from __future__ import annotations

import asyncio
import gzip
import json
import math
import socket
import time

import pytest

from cli_inproc import run_inproc
from creditlab.errors import ConfigError, InputError
from creditlab.judge import OpenAIJudge
from creditlab.judge.testing import ChatServer
from creditlab.rewards import ForkItem, FORKReward, Rubric, iter_jsonl_items, parse_item
from test_cli_mistakes import GOOD, _cli, _one_line_error, _write

REQUESTS = 5  # a GOOD item costs one request per stage


@pytest.fixture(scope="module")
def server():
    with ChatServer() as srv:
        yield srv


def _score(url, inp, out, *extra, run=run_inproc):
    return run("fork", "score", "--in", inp, "--out", out, "--base-url", url, "--timeout", "5", "--max-retries", "0",
               *extra)


def _rows(path):
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def _flat(text: str) -> str:
    return " ".join(text.split())  # rich wraps long lines


def _no_traceback(r):
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr


# -- 1. which field is the response -----------------------------------------------------------------


def test_reference_fields_are_never_scored_as_the_response(server, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ref = GOOD["response"]  # a reference answer that meets every rubric: scored, it would get 1.0
    base = {k: GOOD[k] for k in ("prompt", "rubrics")}
    _write(inp, [
        {**base, "id": "answer-only", "answer": ref},
        {**base, "id": "output-only", "output": ref},
        {**base, "id": "gold-only", "gold": ref},
        {**base, "id": "both", "response": "Get some rest.", "answer": ref, "reference": ref},
        {**base, "id": "two-responses", "response": "Get some rest.", "completion": ref},
        {**base, "id": "same-twice", "response": ref, "completion": ref},
    ])
    r = _score(server.url, inp, out)
    assert r.returncode == 1
    _no_traceback(r)
    err = _flat(r.stderr)
    assert "in.jsonl:1: field 'response': missing" in err and "'answer', read as a reference answer" in err
    assert "--response-field answer" in err
    assert "in.jsonl:2: field 'response': missing" in err and "--response-field output" in err
    assert "in.jsonl:3: field 'response': missing" in err
    assert "in.jsonl:5: fields 'response' and 'completion' both hold a response and they differ" in err
    rows = _rows(out)
    assert set(rows) == {"both", "same-twice"}
    assert rows["both"]["recall"] == pytest.approx(1 / 3)  # the response, not the reference, was scored
    assert "scored 'response'; not scored: 'answer', 'reference'" in rows["both"]["note"]
    assert rows["same-twice"]["reward"] == 1.0
    summary = _flat(r.stdout)
    assert "response field" in summary and "'response'" in summary and "'answer' (1 rows)" in summary
    # the user says the reference field holds the response: then it is scored
    out2 = tmp_path / "out2.jsonl"
    _write(inp, [{**base, "id": "answer-only", "answer": ref}])
    r = _score(server.url, inp, out2, "--response-field", "answer")
    assert r.returncode == 0, r.stderr
    assert _rows(out2)["answer-only"]["reward"] == 1.0 and _rows(out2)["answer-only"]["note"] is None
    r = _score(server.url, inp, tmp_path / "out3.jsonl", "--response-field", "response")
    assert r.returncode == 1 and "in.jsonl:1: field 'response': missing (named by --response-field)" in _flat(r.stderr)


# -- 2. same ids, new responses -----------------------------------------------------------------------


def test_a_resume_whose_inputs_changed_refuses_naming_the_ids(server, tmp_path):
    inp, out = tmp_path / "ckpt1.jsonl", tmp_path / "out.jsonl"
    ckpt1 = [{**GOOD, "id": k, "prompt": f"Aspirin, case {k}?"} for k in ("a", "b", "c")]
    _write(inp, ckpt1)
    assert _score(server.url, inp, out).returncode == 0
    rows = _rows(out)
    hashes = {it.id: it.input_hash for _, it in iter_jsonl_items(inp)}
    assert {k: r["input_hash"] for k, r in rows.items()} == hashes and all(len(h) == 16 for h in hashes.values())
    before, requests = out.read_bytes(), server.stats["requests"]
    # checkpoint 2 into checkpoint 1's --out: same ids, two new responses
    ckpt2 = [{**ckpt1[0], "response": "Get some rest."}, ckpt1[1],
             {**ckpt1[2], "rubrics": [{"criterion": "rest", "points": 1}]}]
    inp2 = tmp_path / "ckpt2.jsonl"
    _write(inp2, ckpt2)
    r = _score(server.url, inp2, out)
    _one_line_error(r, "--out", "2 id(s) whose prompt, response or rubrics changed", "('a', 'c')", "another --out",
                    "--rescore-changed", "--force")
    assert out.read_bytes() == before and server.stats["requests"] == requests  # untouched, nothing sent
    # the rerun of the unchanged file still resumes, sending nothing
    assert _score(server.url, inp, out).returncode == 0 and server.stats["requests"] == requests
    # --rescore-changed rescores exactly the changed ids
    r = _score(server.url, inp2, out, "--rescore-changed")
    assert r.returncode == 0, r.stderr
    assert server.stats["requests"] - requests == 2 * REQUESTS
    rows = _rows(out)
    assert set(rows) == {"a", "b", "c"} and rows["a"]["recall"] == pytest.approx(1 / 3)
    assert rows["b"]["input_hash"] == hashes["b"] and rows["a"]["input_hash"] != hashes["a"]
    assert _score(server.url, inp2, out).returncode == 0  # now consistent: resumes


# -- 3. chat-message responses ----------------------------------------------------------------------


def test_a_message_list_response_scores_every_assistant_turn_and_says_so(server, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    turns = [{"role": "assistant", "content": "Take aspirin with water."},
             {"role": "user", "content": "Anything else?"},
             {"role": "assistant", "content": [{"type": "text", "text": "Get some rest."}]}]
    _write(inp, [{**GOOD, "id": "turns", "response": turns},
                 {**GOOD, "id": "one", "response": [{"role": "assistant", "content": GOOD["response"]}]},
                 {**GOOD, "id": "none", "response": [{"role": "user", "content": "Take aspirin with water."}]}])
    r = _score(server.url, inp, out)
    assert r.returncode == 1
    assert "in.jsonl:3: field 'response': the message list holds no assistant message" in _flat(r.stderr)
    rows = _rows(out)
    assert rows["turns"]["reward"] == 1.0 and rows["turns"]["units"] == ["Take aspirin with water.", "Get some rest."]
    assert rows["turns"]["note"] == ("response: 2 assistant message(s) of 'response' scored, concatenated in order; "
                                     "not scored: 1 user message(s)")
    assert rows["one"]["reward"] == 1.0 and rows["one"]["note"] is None
    # the TRL-style reward function reads completions the same way
    reward = FORKReward(OpenAIJudge(server.url, "judge", max_retries=0, timeout=5), tau=0.5)
    got = reward(["Aspirin?"], [turns], rubrics=[GOOD["rubrics"]])
    assert got == [1.0] and "2 assistant message(s) of 'completion'" in reward.last_results[0].note


# -- 4. out-of-range numbers ------------------------------------------------------------------------


@pytest.mark.parametrize(("flag", "value", "needle"), [
    ("--beta", "inf", "--beta: must be between 0.001 and 1000, got inf"),
    ("--beta", "1e200", "--beta: must be between"), ("--beta", "nan", "--beta"), ("--beta", "0", "--beta"),
    ("--tau", "inf", "--tau: must be a finite number"), ("--tau", "nan", "--tau"),
    ("--timeout", "nan", "--timeout"), ("--timeout", "inf", "--timeout"), ("--concurrency", "0", "--concurrency"),
    ("--max-retries", "-1", "--max-retries"),
])
def test_out_of_range_options_are_refused_up_front(server, tmp_path, flag, value, needle):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [GOOD])
    requests = server.stats["requests"]
    r = _score(server.url, inp, out, flag, value, run=_cli if value == "inf" and flag == "--beta" else run_inproc)
    _one_line_error(r, needle)
    assert not out.exists() and server.stats["requests"] == requests


def test_out_of_range_points_name_their_line_and_the_others_are_scored(server, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    bad_points = [1e200, 1e308, -1e308, 1e-300, 10**30]
    rows = [GOOD] + [{**GOOD, "id": f"p{k}", "rubrics": [{"criterion": "rest", "points": v}]}
                     for k, v in enumerate(bad_points)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    big = "1" + "0" * 5000  # an integer too long for Python's int parsing
    text += '{"id": "big", "prompt": "q", "response": "r", "rubrics": [{"criterion": "c", "points": ' + big + "}]}\n"
    text += "[" * 100000 + "]" * 100000 + "\n"  # nesting too deep for the JSON decoder
    text += '{"id": "inf", "prompt": "q", "response": "r", "rubrics": [{"criterion": "c", "points": Infinity}]}\n'
    inp.write_text(text)
    r = _score(server.url, inp, out, run=_cli)
    assert r.returncode == 1
    _no_traceback(r)
    err = _flat(r.stderr)
    for line in range(2, 7):
        assert f"in.jsonl:{line}: field 'rubrics[0].points'" in err and "out of range" in err
    assert "in.jsonl:7: not valid JSON" in err and "in.jsonl:8: not valid JSON" in err
    assert "in.jsonl:9: field 'rubrics[0].points': expected a finite number, got inf" in err
    assert "8 bad line(s) skipped" in err
    assert b"NaN" not in out.read_bytes() and b"Infinity" not in out.read_bytes()
    assert list(_rows(out)) == ["good"] and _rows(out)["good"]["reward"] == 1.0


def test_the_api_refuses_the_same_numbers(server):
    judge = OpenAIJudge(server.url, "judge", max_retries=0, timeout=5)
    for beta in (math.inf, 1e200, math.nan, 0.0, True):
        with pytest.raises(ConfigError, match="beta"):
            FORKReward(judge, beta=beta)
    items = [ForkItem("huge", "q", "Get some rest.", (Rubric("rest", 1e200),)),
             ForkItem("tiny", "q", "Get some rest.", (Rubric("rest", 1e-300),)),
             ForkItem("ok", "q", "Get some rest.", (Rubric("rest", 1.0),))]
    requests = server.stats["requests"]
    res = asyncio.run(FORKReward(judge, tau=0.5).score(items))
    assert [r.error_kind for r in res] == ["input", "input", None] and "out of range" in res[0].error
    assert res[2].reward == 1.0 and server.stats["requests"] - requests == 4  # only "ok" was judged (fixed tau)
    with pytest.raises(InputError, match="line 3: field 'rubrics\\[0\\].points': 1e\\+200 is out of range"):
        parse_item({"prompt": "q", "response": "r", "rubrics": [{"criterion": "c", "points": 1e200}]}, "line 3")


# -- 5. files that are not JSON Lines, the BOM, HealthBench ids ------------------------------------------


def test_files_that_are_not_json_lines_get_one_message(server, tmp_path):
    rows = [GOOD, {**GOOD, "id": "two"}]
    cases = {
        "array.json": (json.dumps(rows, indent=2), ("is a JSON array, not JSON Lines", "jq -c '.[]'")),
        "array1.json": (json.dumps(rows), ("is a JSON array",)),
        "pretty.json": (json.dumps(GOOD, indent=2), ("JSON spread over several lines", "jq -c .")),
        "rows.csv": ("id,prompt,response\ngood,Aspirin?,Take aspirin\n", ("looks like CSV", "'id,prompt,response'")),
        "rows.tsv": ("id\tprompt\tresponse\ngood\tAspirin?\tTake aspirin\n", ("looks like TSV",)),
    }
    requests = server.stats["requests"]
    for name, (text, needles) in cases.items():
        inp = tmp_path / name
        inp.write_text(text)
        r = _score(server.url, inp, tmp_path / "out.jsonl")
        _one_line_error(r, "--in", *needles, "expected JSON Lines: one JSON object per line")
        assert len(r.stderr.strip().splitlines()) <= 2  # one message (rich may wrap it), not one per line
    gz = tmp_path / "rows.jsonl.gz"
    gz.write_bytes(gzip.compress(json.dumps(GOOD).encode()))
    _one_line_error(_score(server.url, gz, tmp_path / "out.jsonl"), "--in", "gzip-compressed")
    assert not (tmp_path / "out.jsonl").exists() and server.stats["requests"] == requests
    # a JSON Lines file with one bad first line is still JSON Lines: that line is named, the rest scored
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("id,prompt\n" + json.dumps(GOOD) + "\n")
    r = _score(server.url, mixed, tmp_path / "out.jsonl")
    assert r.returncode == 1 and "mixed.jsonl:1: not valid JSON" in _flat(r.stderr)
    assert _rows(tmp_path / "out.jsonl")["good"]["reward"] == 1.0


def test_a_byte_order_mark_is_accepted(server, tmp_path):
    inp, out = tmp_path / "bom.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(b"\xef\xbb\xbf" + (json.dumps(GOOD) + "\n" + json.dumps({**GOOD, "id": "two"}) + "\n").encode())
    r = _score(server.url, inp, out)
    assert r.returncode == 0, r.stderr
    assert set(_rows(out)) == {"good", "two"}


def test_healthbench_rows_sharing_a_prompt_id_get_one_id_each(server, tmp_path):
    inp, out = tmp_path / "hb.jsonl", tmp_path / "out.jsonl"
    prompt = [{"role": "user", "content": "Aspirin?"}]
    rubrics = [{"criterion": "aspirin water", "points": 2, "tags": ["axis:accuracy"]},
               {"criterion": "rest", "points": 1, "tags": ["axis:completeness"]}]
    _write(inp, [{"prompt_id": "p1", "prompt": prompt, "completion": GOOD["response"], "rubrics": rubrics},
                 {"prompt_id": "p2", "prompt": prompt, "completion": "Get some rest.", "rubrics": rubrics},
                 {"prompt_id": "p1", "prompt": prompt, "completion": "Get some rest.", "rubrics": rubrics},
                 {"prompt_id": "p1", "prompt": prompt, "rubrics": rubrics}])  # bad: no completion, still numbered
    r = _score(server.url, inp, out)
    assert r.returncode == 1 and "hb.jsonl:4: field 'response': missing" in _flat(r.stderr)
    rows = _rows(out)
    assert set(rows) == {"p1#1", "p2", "p1#2"}
    assert rows["p1#1"]["reward"] == 1.0 and rows["p1#2"]["recall"] == pytest.approx(1 / 3)
    requests = server.stats["requests"]
    assert _score(server.url, inp, out).returncode == 1 and server.stats["requests"] == requests  # resumed
    assert [it.id for _, it in iter_jsonl_items(inp) if isinstance(it, ForkItem)] == ["p1#1", "p2", "p1#2"]


# -- 6. a slow judge; endpoint mistakes named by the preflight --------------------------------------------


class _SlowOnSome(ChatServer):
    """Answers at once, except requests about a prompt with SLOW in it: those take ``slow`` seconds."""

    slow = 5.0

    async def _answer(self, req, payload, body, fault):
        if "SLOW" in json.dumps(payload):
            await asyncio.sleep(self.slow)
        return await super()._answer(req, payload, body, fault)


def test_a_slow_judge_fails_the_slow_items_as_timeouts_and_is_not_taken_as_down(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    fast = [{**GOOD, "id": f"fast{k}", "prompt": f"Aspirin, case {k}?"} for k in range(3)]
    slow = [{**GOOD, "id": f"slow{k}", "prompt": f"SLOW aspirin, case {k}?"} for k in range(10)]
    _write(inp, fast + slow)
    with _SlowOnSome() as srv:
        t0 = time.monotonic()
        r = run_inproc("fork", "score", "--in", inp, "--out", out, "--base-url", srv.url, "--timeout", "1",
                       "--max-retries", "1")
        took = time.monotonic() - t0
    assert r.returncode == 1
    _no_traceback(r)
    err, summary = _flat(r.stderr), _flat(r.stdout)
    assert "stopped submitting" not in err and "10 item(s) failed" in err
    rows = _rows(out)
    assert len(rows) == 13 and all(rows[f"fast{k}"]["reward"] == 1.0 for k in range(3))
    assert all(rows[f"slow{k}"]["error_kind"] == "timeout" and "no reply within 1.0s" in rows[f"slow{k}"]["error"]
               for k in range(10))
    assert f"{srv.url}: up" in summary and took < 15


class _VLLMLike(ChatServer):
    """Serves only under /v1, like vLLM, and lists one model."""

    async def _route(self, method, path, headers, body):
        if method == "GET" and path.rstrip("/") == "/v1/models":
            return 200, json.dumps({"object": "list", "data": [{"id": "served-model", "object": "model"}]}).encode(), {}
        if not path.startswith("/v1/"):
            return 404, b'{"error": {"message": "not found"}}', {}
        return await super()._route(method, path, headers, body)


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/v1"


def test_base_url_and_model_mistakes_are_named_with_the_fix(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [GOOD])
    dead = _dead_url()  # a URL with a route is refused before any connection
    for route in ("/chat/completions", "/models"):
        r = run_inproc("fork", "score", "--in", inp, "--out", out, "--base-url", dead + route)
        _one_line_error(r, "--base-url", f"ends with {route}", f"e.g. {dead} ")
    with pytest.raises(ConfigError, match="ends with /chat/completions"):
        OpenAIJudge(dead + "/chat/completions", "m")
    with _VLLMLike() as srv:
        root = srv.url[: -len("/v1")]
        r = _cli("fork", "score", "--in", inp, "--out", out, "--base-url", root, "--model", "served-model")
        _one_line_error(r, "--base-url", f"{root}/v1/models answers", f"--base-url {root}/v1")
        r = run_inproc("fork", "score", "--in", inp, "--out", out, "--base-url", srv.url, "--model", "judge")
        _one_line_error(r, "--model", "does not serve model 'judge'", "lists 'served-model'", "--model served-model",
                        "--no-preflight")
        assert srv.stats["requests"] == 0 and not out.exists()  # nothing was scored
        r = run_inproc("fork", "score", "--in", inp, "--out", out, "--base-url", srv.url, "--model", "served-model")
        assert r.returncode == 0, r.stderr
        assert _rows(out)["good"]["reward"] == 1.0
