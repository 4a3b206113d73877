"""The real OpenAI-compatible client (httpx, HTTP/1.1) against a loopback chat-completions server."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from creditlab.errors import ConfigError
from creditlab.judge import JudgeCache, JudgeError, OpenAIJudge, track_usage
from creditlab.judge.testing import ChatServer
from creditlab.rewards import ForkItem, FORKReward, Rubric

SECRET = "sk-test-DO-NOT-LEAK-1234"


@pytest.fixture(scope="module")
def server():
    with ChatServer(hang=1.0) as srv:
        yield srv


@pytest.fixture
def srv(server):
    server.reset(latency=0.0, fault_rate=0.0, fence=False)
    return server


TRANSPORT = ["httpx"]


@pytest.fixture(params=["httpx", "asyncio"], autouse=True)
def transport(request):
    """Every test runs once per HTTP transport of the client."""
    TRANSPORT[0] = request.param
    yield request.param
    TRANSPORT[0] = "httpx"


def judge(url, **kw):
    opts = dict(timeout=0.3, max_retries=3, max_reasks=2, backoff_base=0.005, backoff_max=0.02, seed=0,
                transport=TRANSPORT[0])
    opts.update(kw)
    return OpenAIJudge(url, "judge-model", **opts)


ITEM = ForkItem(
    "x1", "How do I take aspirin?",
    "Sure! Take aspirin with water. Swallow aspirin with some water. Aspirin WRONG cures cancer. "
    "Paris is lovely in spring.",
    (Rubric("Mentions aspirin with water", 5.0), Rubric("Recommends rest", 2.0),
     Rubric("States that aspirin cures cancer", -3.0)),
)


def run(coro):
    return asyncio.run(coro)


def test_full_item_costs_five_requests_and_matches_hand_computation(srv):
    j = judge(srv.url, api_key=SECRET)
    res = run(FORKReward(j).score([ITEM]))[0]
    assert res.error is None
    assert res.requests == 5 and srv.stats["requests"] == 5
    assert res.units == ["Take aspirin with water.", "Swallow aspirin with some water.",
                         "Aspirin WRONG cures cancer.", "Paris is lovely in spring."]
    # Rubric 1 matched by the two paraphrases (1/2 each); the pitfall rubric is met (-3).
    assert res.coverage == [True, False, True]
    assert res.credits == [0.5, 0.5, 0.0, 0.0]
    assert res.C == [True, True, False, True]
    assert res.tau == 0.75 and res.N == [False, False, False, False]
    assert res.recall == pytest.approx((5 - 3) / 7)
    assert res.precision == 0.0 and res.reward == 0.0
    body = srv.requests[0]["body"]
    assert body["temperature"] == 0 and body["model"] == "judge-model"
    assert body["response_format"]["type"] == "json_schema"
    assert body["response_format"]["json_schema"]["schema"]["additionalProperties"] is False
    assert srv.requests[0]["headers"]["authorization"] == f"Bearer {SECRET}"
    assert SECRET not in repr(j)


def test_transient_faults_are_retried(srv):
    srv.push_faults(["500", "429", "timeout"])
    with track_usage() as usage:
        units = run(judge(srv.url).unitize("q", "One fact here. Another fact."))
    assert units == ["One fact here.", "Another fact."]
    assert usage.requests == 4 and usage.retries == 3


def test_retries_exhausted_give_a_typed_error_and_none_reward(srv):
    srv.push_faults(["500"] * 4)
    j = judge(srv.url, api_key=SECRET)
    with pytest.raises(JudgeError) as info:
        run(j.unitize("q", "A fact."))
    assert info.value.kind == "http_500" and info.value.stage == "unitize"
    assert "after 4 attempts" in str(info.value) and SECRET not in str(info.value)
    # Through the reward: an explicit error, reward None; the TRL callable returns None, not 0.
    srv.reset()
    srv.push_faults(["500"])
    reward = FORKReward(judge(srv.url, max_retries=0), tau=0.5)
    args = (["q"], ["Take aspirin with water."])
    rubrics = [[{"criterion": "aspirin water", "points": 1}]]
    assert reward(*args, rubrics=rubrics) == [None]
    failed = reward.last_results[0]
    assert "http_500" in failed.error and failed.precision is None
    assert reward(*args, rubrics=rubrics) == [1.0]


def test_timeout_then_exhaustion(srv):
    srv.push_faults(["timeout"] * 2)
    t0 = time.perf_counter()
    with pytest.raises(JudgeError, match="timeout"):
        run(judge(srv.url, max_retries=1).unitize("q", "A fact."))
    assert time.perf_counter() - t0 < 1.5


@pytest.mark.parametrize("fault", ["malformed", "wrong_ids"])
def test_invalid_replies_are_reasked(srv, fault):
    srv.push_faults([fault])
    with track_usage() as usage:
        out = run(judge(srv.url).correctness("q", ["Fine fact.", "A WRONG fact."]))
    assert out == [True, False]
    assert usage.reasks == 1 and usage.requests == 2
    # The re-ask carries the bad reply and what was wrong with it.
    reask = srv.requests[-1]["body"]["messages"]
    assert reask[-2]["role"] == "assistant" and "invalid" in reask[-1]["content"]


def test_truncated_body_is_retried(srv):
    srv.push_faults(["truncated"])
    with track_usage() as usage:
        assert run(judge(srv.url).threshold("q", ["a"], [1.0])) == 0.75
    assert usage.retries == 1


def test_reasks_exhausted_and_nothing_invalid_is_cached(srv, tmp_path):
    cache = JudgeCache(tmp_path / "c.sqlite")
    srv.push_faults(["wrong_ids"] * 3)
    with pytest.raises(JudgeError) as info:
        run(judge(srv.url, cache=cache).coverage("q", "answer text", ["crit one", "crit two"]))
    assert info.value.kind == "invalid_reply" and "X999" in str(info.value)
    assert len(cache) == 0


def test_plain_text_json_extraction_without_structured_output(srv):
    srv.reset(fence=True)
    j = judge(srv.url, structured=False)
    assert run(j.coverage("q", "Take aspirin with water.", ["aspirin water", "rest"])) == [True, False]
    assert "response_format" not in srv.requests[-1]["body"]


def test_cache_serves_validated_replies_without_requests(srv, tmp_path):
    cache = JudgeCache(tmp_path / "c.sqlite")
    r1 = run(FORKReward(judge(srv.url, cache=cache)).score([ITEM]))[0]
    assert srv.stats["requests"] == 5 and len(cache) == 5
    srv.reset()
    r2 = run(FORKReward(judge(srv.url, cache=JudgeCache(tmp_path / "c.sqlite"))).score([ITEM]))[0]
    assert srv.stats["requests"] == 0 and r2.requests == 0 and r2.cache_hits == 5
    assert r2.reward == r1.reward and r2.units == r1.units
    # Another model name is another key.
    run(OpenAIJudge(srv.url, "other-model", cache=cache, transport=TRANSPORT[0]).unitize(ITEM.prompt, ITEM.response))
    assert srv.stats["requests"] == 1


def test_identical_inflight_requests_share_one_call(srv):
    srv.reset(latency=0.1)
    j = judge(srv.url, timeout=2.0)

    async def both():
        with track_usage() as usage:
            out = await asyncio.gather(*(j.unitize("q", "Same answer.") for _ in range(4)))
        return out, usage

    out, usage = run(both())
    assert out == [["Same answer."]] * 4
    assert srv.stats["requests"] == 1 and usage.shared == 3


def test_concurrency_limit_per_endpoint():
    with ChatServer(latency=0.05) as srv:
        j = judge(srv.url, concurrency=3, timeout=2.0)

        async def many():
            return await asyncio.gather(*(j.unitize("q", f"Answer number {k}.") for k in range(12)))

        run(many())
        assert srv.stats["requests"] == 12 and srv.stats["max_inflight"] == 3


def test_judges_of_one_endpoint_share_its_concurrency_limit():
    with ChatServer(latency=0.05) as srv:
        a, b = judge(srv.url, concurrency=2, timeout=2.0), judge(srv.url, concurrency=2, timeout=2.0)

        async def many():
            return await asyncio.gather(*(j.unitize("q", f"Answer {k}.") for k in range(4) for j in (a, b)))

        run(many())
        assert srv.stats["requests"] == 8 and srv.stats["max_inflight"] == 2


def test_large_rubric_sets_are_chunked(srv):
    j = judge(srv.url, max_rubrics_per_request=2)
    rubrics = ["aspirin water", "rest", "aspirin", "water", "sleep"]
    cov = run(j.coverage("q", "Take aspirin with water.", rubrics))
    assert cov == [True, False, True, True, False]
    assert srv.stats["requests"] == 3
    m = run(j.match("q", rubrics, ["Take aspirin.", "Drink water."]))
    assert m == [[False, False], [False, False], [True, False], [False, True], [False, False]]


def test_non_retryable_http_error_fails_at_once(srv):
    with track_usage() as usage, pytest.raises(JudgeError, match="http_404"):
        run(judge(srv.url + "/missing").unitize("q", "A."))
    assert usage.requests == 1


def test_configuration_errors():
    with pytest.raises(ConfigError, match="base_url"):
        OpenAIJudge("localhost:8000", "m")
    with pytest.raises(ConfigError, match="concurrency"):
        OpenAIJudge("http://x", "m", concurrency=0)


def test_wire_format_is_chat_completions(srv):
    run(judge(srv.url).unitize("q", "A fact."))
    body = srv.requests[-1]["body"]
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    assert json.loads(body["messages"][1]["content"])["task"] == "unitize"


def test_random_faults_every_item_ends_scored_or_with_an_explicit_error(tmp_path):
    items = [ForkItem(f"i{k}", "q", f"Take aspirin with water number{k}. Rest now{k}.",
                      (Rubric("aspirin water", 1.0), Rubric(f"rest now{k}", 1.0))) for k in range(12)]
    cache = JudgeCache(tmp_path / "c.sqlite")  # a rerun only redoes the stages that failed
    with ChatServer(fault_rate=0.4, seed=3, hang=0.3) as srv:
        reward = FORKReward(judge(srv.url, timeout=0.1, max_retries=1, max_reasks=0, cache=cache))
        first = run(reward.score(items))
        assert all((r.error is None) == (r.reward is not None) for r in first)
        assert any(r.error for r in first) and any(r.reward is not None for r in first)
        assert sum(srv.stats[f"fault_{f}"] for f in ("500", "429", "timeout", "malformed", "truncated",
                                                      "wrong_ids")) > 0
        todo = [it for it, r in zip(items, first, strict=True) if r.error]
        for _ in range(6):  # reruns of the failed items complete them
            res = run(FORKReward(judge(srv.url, timeout=0.1, max_retries=1, max_reasks=0, cache=cache)).score(todo))
            todo = [it for it, r in zip(todo, res, strict=True) if r.error]
            if not todo:
                break
        assert not todo


class _SlowToCompute(ChatServer):
    """Spends ``work`` seconds of (blocking) work on every reply, like a model's own compute."""

    work = 0.3

    def _reply(self, req, payload, body, fault):
        time.sleep(self.work)
        return super()._reply(req, payload, body, fault)


def test_the_test_servers_latency_counts_from_the_request_and_includes_its_own_work():
    # A remote model's latency includes its work: the reply comes ``latency`` after the request, not
    # ``latency`` plus the server's compute (0.4 s, not 0.7 s here), so the benchmark's "ideal" holds.
    with _SlowToCompute(latency=0.4) as srv:
        j = judge(srv.url, timeout=5.0)
        t0 = time.perf_counter()
        assert run(j.unitize("q", "One answer.")) == ["One answer."]
        took = time.perf_counter() - t0
    assert 0.4 <= took < 0.6
