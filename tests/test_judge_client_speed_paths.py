"""The judge client's fast paths against the reference paths they replace, on random inputs.

Each fast path (request building, request body, reply validation, JSON extraction, the FORK
driver's type checks, staggered item start, one address lookup per client) must give exactly what
the reference gives: the same strings byte for byte, the same results, the same error messages.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from creditlab.errors import ConfigError
from creditlab.judge import JudgeError, OpenAIJudge, _http
from creditlab.judge.openai_compat import _message_json, _schema
from creditlab.judge.prompts import (
    ReplyInvalid,
    build_messages,
    extract_json,
    parse_reply,
    parse_stage_reply,
    payload_for,
    stage_request,
)
from creditlab.judge.testing import ChatServer, answer_stage
from creditlab.rewards import ForkItem, FORKReward, Rubric
from creditlab.rewards import fork as fork_mod

STAGES = ("unitize", "coverage", "match", "correctness", "threshold")

# Text with what JSON must escape or keep: quotes, backslashes, control characters, non-ASCII,
# astral characters, lone surrogates.
text = st.text(alphabet=st.one_of(st.characters(), st.sampled_from('"\\\n\t\r\x00\x1f\u2028é中😀\ud800/')),
               max_size=40)
credit = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**6, 10**6),
                   st.sampled_from([0.1, 1 / 3, 1e-7, 2.5e-7, -0.0, 1e300]))


# -- request building ----------------------------------------------------------------------------

@given(stage=st.sampled_from(STAGES), prompt=text, response=st.one_of(st.none(), text),
       rubrics=st.lists(text, max_size=6), units_credits=st.lists(st.tuples(text, credit), max_size=6))
def test_stage_request_writes_the_reference_messages_byte_for_byte(stage, prompt, response, rubrics, units_credits):
    units = [u for u, _ in units_credits]
    credits = [c for _, c in units_credits]
    ref = build_messages(stage, payload_for(stage, prompt=prompt, response=response, rubrics=rubrics, units=units,
                                            credits=credits))
    req = stage_request(stage, prompt=prompt, response=response, rubrics=rubrics, units=units, credits=credits)
    assert req.messages == ref
    assert req.stage == stage
    payload = payload_for(stage, prompt=prompt, response=response, rubrics=rubrics, units=units, credits=credits)
    assert list(req.rubric_ids) == [r["id"] for r in payload.get("rubrics", [])]
    assert list(req.unit_ids) == [u["id"] for u in payload.get("units", [])]


def test_stage_request_takes_the_reference_path_for_arguments_that_are_not_strings():
    class Text(str):
        pass

    for kwargs in (dict(prompt=Text("q"), units=["a"]), dict(prompt="q", units=[Text("a"), "b"]),
                   dict(prompt="q", units=["a", "b"], credits=[1])):
        stage = "threshold" if "credits" in kwargs else "correctness"
        if "credits" in kwargs:  # mismatched credits: the reference's own error
            with pytest.raises(ValueError):
                payload_for(stage, **kwargs)
            with pytest.raises(ValueError):
                stage_request(stage, **kwargs)
            continue
        assert stage_request(stage, **kwargs).messages == build_messages(stage, payload_for(stage, **kwargs))
    with pytest.raises(KeyError):
        stage_request("nonsense", prompt="q")


def _reference_body(judge: OpenAIJudge, stage: str, messages, schema) -> bytes:
    fields = {"model": judge.model, **judge.params}
    if schema is not None:
        fields["response_format"] = {"type": "json_schema",
                                     "json_schema": {"name": f"fork_{stage}", "schema": schema, "strict": True}}
    return (json.dumps(fields)[:-1] + ', "messages": [' + ", ".join(json.dumps(m) for m in messages) + "]}").encode()


message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": text}),
    st.dictionaries(st.sampled_from(["content", "role", "name"]), st.one_of(text, st.integers(), st.none()),
                    max_size=3),
)


@given(messages=st.lists(message, max_size=4), stage=st.sampled_from(STAGES), structured=st.booleans())
def test_request_body_is_the_reference_encoding(messages, stage, structured):
    judge = OpenAIJudge("http://127.0.0.1:9/v1", "m\u00e9\"x", structured=structured)
    schema = _schema(stage) if structured else None
    assert judge._body(stage, messages, schema) == _reference_body(judge, stage, messages, schema)
    for m in messages:
        assert _message_json(m) == json.dumps(m)


def test_request_body_of_real_stage_requests_and_reordered_messages():
    judge = OpenAIJudge("http://127.0.0.1:9/v1", "bench")
    for stage in STAGES:
        req = stage_request(stage, prompt="Q \"x\" é", response="A.\nB.", rubrics=["r1", "r\\2"], units=["u1", "u2"],
                            credits=[0.5, 1 / 3])
        assert judge._body(stage, req.messages, _schema(stage)) == \
            _reference_body(judge, stage, req.messages, _schema(stage))
    flipped = {"content": "c", "role": "user"}  # key order is kept, as json.dumps keeps it
    assert _message_json(flipped) == json.dumps(flipped) == '{"content": "c", "role": "user"}'


# -- reply validation ----------------------------------------------------------------------------

def _valid_reply(stage: str, rng: random.Random, nr: int, nu: int):
    rid = [f"R{k + 1}" for k in range(nr)]
    uid = [f"U{k + 1}" for k in range(nu)]
    if stage == "unitize":
        return {"units": [{"id": f"U{k + 1}", "text": rng.choice(["a", " b ", "c.\n", "é"])} for k in range(nu)]}
    if stage == "coverage":
        return {"rubrics": [{"id": i, "met": rng.random() < 0.5} for i in rid]}
    if stage == "match":
        return {"rubrics": [{"id": i, "units": rng.sample(uid, rng.randint(0, nu))} for i in rid]}
    if stage == "correctness":
        return {"units": [{"id": i, "correct": rng.random() < 0.5} for i in uid]}
    return {"tau": rng.choice([0.5, 0.75, 1e-9, 3.0])}


_ODD = [None, "true", "yes", 1, 0, 1.0, True, False, [], {}, "U1", "R1", "", "  ", "x", float("nan"),
        float("inf"), -1.0, 0.0, 10**400, ["U1"], [1], ("U1",)]


def _mutate(data, rng: random.Random):
    """One random change of a reply: a value replaced, a key dropped or added, items reordered,
    duplicated or dropped, or the whole reply replaced."""
    data = json.loads(json.dumps(data))
    op = rng.randrange(8)
    if op == 0:
        return rng.choice(_ODD + [[data], "text"])
    key = next(iter(data))
    rows = data[key]
    if op == 1 or not isinstance(rows, list) or not rows:
        data[key] = rng.choice(_ODD)
        return data
    k = rng.randrange(len(rows))
    if op in (5, 6) and (not isinstance(rows[k], dict) or not rows[k]):
        op = 7
    if op == 2:
        rng.shuffle(rows)
    elif op == 3:
        rows.append(json.loads(json.dumps(rows[k])))
    elif op == 4:
        del rows[k]
    elif op == 5:
        field = rng.choice(list(rows[k]))
        if rng.random() < 0.3:
            del rows[k][field]
        else:
            rows[k][field] = rng.choice(_ODD)
    elif op == 6:
        rows[k]["extra"] = rng.choice(_ODD)
    else:
        rows[k] = rng.choice(_ODD)
    return data


def _outcome(fn):
    try:
        return "ok", fn()
    except ReplyInvalid as err:
        return "invalid", str(err)


@pytest.mark.parametrize("stage", STAGES)
def test_fast_reply_validation_agrees_with_the_reference_on_random_replies(stage):
    rng = random.Random(stage)
    for trial in range(600):
        nr, nu = rng.randint(0, 6), rng.randint(0, 6)
        req = stage_request(stage, prompt="q", response="a", rubrics=[f"r{k}" for k in range(nr)],
                            units=[f"u{k}" for k in range(nu)], credits=[0.5] * nu)
        payload = payload_for(stage, prompt="q", response="a", rubrics=[f"r{k}" for k in range(nr)],
                              units=[f"u{k}" for k in range(nu)], credits=[0.5] * nu)
        data = _valid_reply(stage, rng, nr, nu)
        if trial % 3:
            for _ in range(rng.randint(1, 2)):
                data = _mutate(data, rng) if isinstance(data, dict) and data else data
        ref = _outcome(lambda d=data, p=payload: parse_reply(stage, d, p))
        got = _outcome(lambda d=data, r=req: parse_stage_reply(r, d))
        assert got == ref, (data, got, ref)
        if ref[0] == "ok" and stage == "threshold":
            assert type(got[1]) is float


def test_fast_reply_validation_on_the_loopback_servers_answers():
    """The answers the benchmark's server gives (ids in order, exact JSON types) take the fast path."""
    from creditlab.judge.prompts import _fast_reply

    rng = random.Random(0)
    for _ in range(50):
        units = [f"Unit {k} about topic{rng.randrange(5)}." for k in range(rng.randint(1, 9))]
        rubrics = [f"Mentions topic{k}" for k in range(rng.randint(1, 9))]
        for stage in STAGES:
            req = stage_request(stage, prompt="q", response=" ".join(units), rubrics=rubrics, units=units,
                                credits=[0.5] * len(units))
            data = answer_stage(json.loads(req.messages[1]["content"]))
            payload = json.loads(req.messages[1]["content"])
            assert _fast_reply(req, data) is not None
            assert parse_stage_reply(req, data) == parse_reply(stage, data, payload)


# -- JSON extraction ---------------------------------------------------------------------------------

_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)


def _extract_json_reference(text: str):
    """extract_json as it was written before the whole-text-first fast path."""
    text = text.strip()
    candidates = [text]
    candidates += [m.group(1) for m in _FENCE.finditer(text)]
    start, end = text.find("{"), text.rfind("}")
    if 0 <= start < end:
        candidates.append(text[start:end + 1])
    for c in candidates:
        try:
            return json.loads(c)
        except json.JSONDecodeError:
            continue
    raise ReplyInvalid(f"no JSON object in the reply (first 80 chars: {text[:80]!r})")


piece = st.sampled_from(['{"a": 1}', '{"tau": 0.5}', "```json\n", "```", "{", "}", "[1, 2]", "Here:", " ", "\n",
                         '"x"', "null", "{bad}", '{"b": [true]}', "42", "é"])


@given(st.lists(piece, max_size=8).map("".join))
def test_extract_json_agrees_with_the_reference(text):
    assert _outcome(lambda: extract_json(text)) == _outcome(lambda: _extract_json_reference(text))


# -- the FORK driver's type checks -----------------------------------------------------------------

def _expect_reference(stage, what, value, n, typ):
    if not isinstance(value, list) or (n is not None and len(value) != n) or \
            not all(isinstance(v, typ) for v in value):
        raise JudgeError(stage, "invalid_reply", "x")


class _Str(str):
    pass


class _List(list):
    pass


@given(value=st.one_of(st.lists(st.sampled_from([True, False, 1, 0, "a", _Str("b"), None, [], _List(), 1.0]),
                                max_size=5),
                       st.sampled_from([None, "ab", (True,), {"a": 1}, _List([True]), _List([1])])),
       n=st.one_of(st.none(), st.integers(0, 5)), typ=st.sampled_from([bool, str, list]))
def test_driver_type_check_agrees_with_the_reference(value, n, typ):
    def outcome(fn):
        try:
            fn("match", "rows", value, n, typ)
        except JudgeError:
            return False
        return True

    assert outcome(fork_mod._expect) == outcome(_expect_reference)


# -- staggered start of FORKReward.score -----------------------------------------------------------

class _CountingJudge:
    """Answers from the response text after a short sleep; records the order in which items start."""

    name, can_judge_correctness, quality = "counting", True, "toy"

    def __init__(self):
        self.started: list[str] = []
        self.in_flight = 0

    async def unitize(self, prompt, response):
        self.started.append(prompt)
        await asyncio.sleep(0.001)
        return [s for s in response.split(". ") if s]

    async def coverage(self, prompt, response, rubrics):
        await asyncio.sleep(0.001)
        return [r.split()[-1] in response for r in rubrics]

    async def match(self, prompt, rubrics, units):
        return [[r.split()[-1] in u for u in units] for r in rubrics]

    async def correctness(self, prompt, units):
        return ["WRONG" not in u for u in units]

    async def threshold(self, prompt, units, credits):
        return 0.4


def _items(n: int, seed: int = 0) -> list[ForkItem]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [f"w{rng.randrange(6)}" for _ in range(rng.randint(1, 6))]
        response = ". ".join(f"Unit {w}" + (" WRONG" if rng.random() < 0.2 else "") for w in words)
        out.append(ForkItem(f"i{i}", f"q{i}", response,
                            tuple(Rubric(f"has w{j}", rng.choice([1.0, 2.0, -1.0])) for j in range(rng.randint(1, 4)))))
    return out


@pytest.mark.parametrize("n", [0, 1, fork_mod.START_BATCH, 3 * fork_mod.START_BATCH + 5])
def test_staggered_score_gives_score_one_results_in_input_order(n):
    items = _items(n, seed=n)
    judge = _CountingJudge()
    reward = FORKReward(judge)
    got = asyncio.run(reward.score(items))
    started = list(judge.started)
    want = [asyncio.run(reward.score_one(it)) for it in items]
    assert [r.to_row() for r in got] == [r.to_row() for r in want]
    assert started == [it.prompt for it in items if reward.unscorable(it) is None]  # in input order


class _WindowReward(FORKReward):
    """Counts the items in progress (inside ``score_one``) and their peak."""

    in_flight = peak = 0

    async def score_one(self, item):
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            return await super().score_one(item)
        finally:
            self.in_flight -= 1


@pytest.mark.parametrize("window", [1, 3, 40])
def test_score_keeps_at_most_max_in_flight_items_in_progress(window):
    items = _items(120, seed=window)
    reward = _WindowReward(_CountingJudge())
    got = asyncio.run(reward.score(items, max_in_flight=window))
    assert reward.peak == window and reward.in_flight == 0
    assert [r.to_row() for r in got] == [asyncio.run(FORKReward(_CountingJudge()).score_one(it)).to_row()
                                          for it in items]


def test_score_default_window_is_twice_the_judges_slots_and_a_bad_window_is_named():
    judge = _CountingJudge()
    judge.concurrency = 4
    reward = _WindowReward(judge)
    asyncio.run(reward.score(_items(60, seed=1)))
    assert reward.peak == 8
    with pytest.raises(ConfigError, match="max_in_flight"):
        asyncio.run(reward.score(_items(3), max_in_flight=0))


def test_cancelling_score_while_items_start_cancels_every_started_item():
    items = _items(5 * fork_mod.START_BATCH)

    async def main():
        judge = _CountingJudge()
        task = asyncio.ensure_future(FORKReward(judge).score(items))
        for _ in range(10):  # a few loop passes: some items started, not all
            await asyncio.sleep(0)
            if judge.started:
                break
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(5):  # the cancelled items unwind (their own gathers) in a few passes
            await asyncio.sleep(0)
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
        return left, len(judge.started)

    left, started = asyncio.run(main())
    assert left == [] and 0 < started < len(items)


# -- one address lookup per client --------------------------------------------------------------------

def test_numeric_host_is_not_looked_up_and_a_name_is_looked_up_once(monkeypatch):
    calls = []
    real = asyncio.BaseEventLoop.getaddrinfo

    async def counting(self, host, port, **kw):
        calls.append(host)
        return await real(self, host, port, **kw)

    monkeypatch.setattr(asyncio.BaseEventLoop, "getaddrinfo", counting)
    with ChatServer(latency=0.02) as srv:
        port = srv.port

        async def burst(host: str) -> list[int]:
            client = _http.LeanClient(f"http://{host}:{port}/v1/chat/completions",
                                      {"Content-Type": "application/json"}, 5.0, 16)
            body = json.dumps({"model": "m", "messages": stage_request("threshold", prompt="q", units=["u"],
                                                                        credits=[1.0]).messages}).encode()
            try:
                return [r.status_code for r in await asyncio.gather(*(client.post(body) for _ in range(16)))]
            finally:
                await client.aclose()

        assert asyncio.run(burst("127.0.0.1")) == [200] * 16
        assert calls == []
        assert asyncio.run(burst("localhost")) == [200] * 16
        assert calls == ["localhost"]  # 16 connections opened together, one lookup


def test_numeric_host_detection():
    assert _http._numeric_host("127.0.0.1") and _http._numeric_host("::1") and _http._numeric_host("10.0.0.255")
    assert not _http._numeric_host("localhost") and not _http._numeric_host("example.com")
    assert not _http._numeric_host("999.1.1.1") and not _http._numeric_host("")


def test_a_failed_lookup_is_a_connection_error_and_is_tried_again(monkeypatch):
    calls = []

    async def failing(self, host, port, **kw):
        calls.append(host)
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(asyncio.BaseEventLoop, "getaddrinfo", failing)

    async def main():
        client = _http.LeanClient("http://no-such-host.invalid:80/v1", {}, 1.0, 4)
        out = []
        for _ in range(2):
            with pytest.raises(_http.HTTPError, match="cannot connect"):
                await client.post(b"{}")
            out.append(len(calls))
        return out

    assert asyncio.run(main()) == [1, 2]


def test_float_text_is_what_json_writes():
    from creditlab.judge.prompts import _num

    for x in (0.1, 1 / 3, -0.0, 1e300, 5e-324, float("nan"), float("inf"), -float("inf"), 2.0, 1e16):
        assert _num(x) == json.dumps(x)
    assert math.isnan(json.loads(_num(float("nan"))))


class _MatchJudge(_CountingJudge):
    """Answers ``match`` with a given matrix (well formed or not)."""

    def __init__(self, matrix):
        super().__init__()
        self.matrix = matrix

    async def match(self, prompt, rubrics, units):
        return self.matrix


def test_driver_match_check_agrees_with_the_row_by_row_reference():
    rng = random.Random(7)
    item = ForkItem("m", "q", "Unit w1. Unit w2. Unit w3", (Rubric("has w1", 1.0), Rubric("has w2", 2.0)))
    n, J = 3, 2
    for _ in range(300):
        matrix = [[rng.random() < 0.5 for _ in range(n)] for _ in range(J)]
        k = rng.randrange(J)
        change = rng.randrange(5)
        if change == 1:
            matrix[k] = matrix[k][:rng.randrange(n)]
        elif change == 2:
            matrix[k][rng.randrange(n)] = rng.choice([1, 0, None, "x", 1.0])
        elif change == 3:
            matrix[k] = matrix[k] + [True]
        elif change == 4:
            matrix[k] = _List(matrix[k])
        want = None
        try:
            for row in matrix:
                _expect_reference("match", "match entries in a row", row, n, bool)
        except JudgeError:
            want = "invalid_reply"
        res = asyncio.run(FORKReward(_MatchJudge(matrix)).score_one(item))
        assert res.error_kind == want, (matrix, res.error)
        if want is not None:
            assert "match entries in a row" in res.error
