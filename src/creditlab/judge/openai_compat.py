"""``OpenAIJudge``: the five FORK judge stages over OpenAI-compatible chat-completions endpoints.

Works with vLLM, SGLang, Ollama and hosted APIs (``POST {base_url}/chat/completions``), through
httpx or a minimal asyncio HTTP/1.1 client. Temperature 0. The API key is passed in (``api_key``;
the caller, e.g. the CLI, reads it from the environment) and only ever placed in the
``Authorization`` header; it is never logged nor put in an error message.

Reliability, per request:

* transport failures (HTTP 429 and 5xx, timeouts, dropped connections) are retried at most
  ``max_retries`` times with exponential backoff and full jitter (``Retry-After`` is honoured,
  capped at ``backoff_max``);
* a reply that is not valid (not JSON, wrong schema, ids that are not those asked about) is
  re-asked at most ``max_reasks`` times, telling the model what was wrong;
* then a typed :class:`~creditlab.judge.base.JudgeError`. Other HTTP errors (401, 404...) fail at
  once.

Several endpoints (``base_url`` a list of URLs serving the same model): each request goes to the
endpoint with the least outstanding load (requests in flight over its limit) that has a free slot;
each endpoint has its own concurrency limit and health. An endpoint whose requests keep failing
(timeouts, refused connections) is taken out of rotation, and tried again with one request after
``retry_endpoint_after`` seconds (doubling after each failed try, up to 8 times that) while the
others keep scoring; a retry goes to another endpoint than the one that just failed when one has a
free slot. Before a streak of timeouts takes an endpoint out, it is asked one tiny request: one that
answers is only slow on those requests (they fail as timeouts on their own items) and stays in
rotation. The judge is down, and every later request fails at once, only when every endpoint is
out of rotation at the same moment. :meth:`OpenAIJudge.endpoint_stats` reports requests, errors and
latency per endpoint.

Throughput: one concurrency limit per endpoint (judges of the same URL in one event loop share it),
held only while a request is on the wire (not while backing off); identical requests in flight share
one call; an optional :class:`~creditlab.judge.cache.JudgeCache` serves validated replies without a
request: a reply given by one of this judge's endpoints (they serve the same model), or by any endpoint
with ``cache_any_endpoint=True``. Stage requests with more than ``max_rubrics_per_request`` rubrics
are split into chunks.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import weakref
from collections import deque
from collections.abc import Sequence
from json.encoder import encode_basestring_ascii as _enc_ascii  # what json.dumps writes for a str
from typing import Any

import httpx

from creditlab.errors import ConfigError
from creditlab.judge._http import HTTPError, LeanClient
from creditlab.judge.base import JudgeError, check_stage_text, current_usage
from creditlab.judge.cache import JudgeCache, cache_key, endpoint_id
from creditlab.judge.prompts import (
    PROMPT_VERSION,
    ReplyInvalid,
    StageRequest,
    extract_json,
    parse_stage_reply,
    reply_schema,
    stage_request,
)

__all__ = ["OpenAIJudge", "base_url_problem"]

_RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
_SHARD = 8  # connections per httpx client (see OpenAIJudge._bind)
_LATENCIES = 4096  # latencies kept per endpoint for the quantiles of endpoint_stats
_SCHEMAS: dict[str, dict[str, Any]] = {}  # reply schema per stage (built once, never mutated)
_SYSTEM_JSON: dict[str, str] = {}  # JSON of the system messages (a few fixed strings)


class _Slots:
    """The concurrency limit of one endpoint in one event loop, shared by the judges of that URL.

    Unlike an ``asyncio.Semaphore`` a waiter can wait on several endpoints at once: it registers one
    future with each, and the first endpoint to free a slot hands it over (``set_result(self)``).
    """

    __slots__ = ("limit", "used", "waiters")

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self.waiters: deque[asyncio.Future] = deque()

    def release(self) -> None:
        waiters = self.waiters
        while waiters:
            fut = waiters.popleft()
            if not fut.done():  # skip waiters served by another endpoint, or cancelled
                fut.set_result(self)  # the slot passes to the waiter: ``used`` is unchanged
                return
        self.used -= 1


_ENDPOINT_SLOTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, _Slots]] = \
    weakref.WeakKeyDictionary()


class _Endpoint:
    """One base URL of a judge: its transport, its slot pool, its health and its counters."""

    def __init__(self, base_url: str, cooldown: float):
        self.base_url = base_url
        self.url = base_url + "/chat/completions"
        #: why it was taken out of rotation (None while in rotation)
        self.down: str | None = None
        self.retry_at = 0.0
        self.cooldown = cooldown
        self.probing = False
        #: the liveness check in progress before taking it out of rotation (see OpenAIJudge._confirm_down)
        self.check: asyncio.Future | None = None
        self.streak = 0
        self.streak_start = 0.0
        self.last_reply = -1.0  # monotonic time of the last HTTP reply (of any status)
        self.requests = 0
        self.errors = 0
        self.replies = 0
        self.latency_sum = 0.0
        self.latencies: deque[float] = deque(maxlen=_LATENCIES)
        self.slots = _Slots(1)
        self.lean: LeanClient | None = None
        self.clients: list[httpx.AsyncClient] = []
        self.busy: list[int] = []


class _Transient(Exception):
    def __init__(self, kind: str, message: str, retry_after: float | None = None):
        self.kind = kind
        self.retry_after = retry_after
        super().__init__(message)


class OpenAIJudge:
    """FORK judge over one or several OpenAI-compatible endpoints serving the same model.

    Args:
        base_url: endpoint root, e.g. ``http://localhost:8000/v1`` (``/chat/completions`` is appended),
            or a list of them (see the module docstring).
        model: model name sent with every request.
        api_key: the API key (None or empty: no auth header); the same key is sent to every
            endpoint. The judge reads no environment variable: callers pass the key they read.
        concurrency: most requests on the wire at once, per endpoint.
        timeout: seconds per request (connect + read).
        max_retries: retries of a transient failure (429, 5xx, timeout) per request.
        max_reasks: re-asks after an invalid reply per stage call.
        backoff_base, backoff_max: backoff ``min(max, base * 2**attempt)`` scaled by a uniform
            jitter in [0.5, 1].
        structured: send ``response_format = json_schema`` (vLLM / SGLang / OpenAI); otherwise the
            JSON object is extracted from plain text.
        cache: optional cache of validated replies. A reply is stored with the endpoint that gave it
            and served only to a judge with that endpoint among its own.
        cache_any_endpoint: serve cached replies whichever endpoint gave them (also those of a cache
            written before endpoints were recorded): for a cache known to come from the same model
            served elsewhere.
        max_rubrics_per_request: chunk size for very large rubric sets.
        seed: seed of the jitter generator (deterministic backoff in tests).
        max_consecutive_failures, down_after: an endpoint is taken out of rotation after this many
            consecutive failed attempts (timeouts, refused connections) with no reply from it since
            they were sent, or once such a streak of at least two has lasted ``down_after`` seconds,
            and (for timeouts) it does not answer one tiny check request either; any success ends the
            streak. With one endpoint
            (or once every endpoint is out) the judge is down: every later request fails at once
            with ``endpoint_down`` and nothing more is sent.
        retry_endpoint_after: seconds before an endpoint taken out of rotation gets one request
            again (doubled after each failed try, up to 8 times this), while others answer.
        transport: ``httpx`` (default; proxies, redirects, HTTP/2-capable stack) or ``asyncio``, the
            minimal keep-alive HTTP/1.1 client of :mod:`creditlab.judge._http`, several times cheaper
            in CPU per request when thousands of requests per second go to local servers.
    """

    can_judge_correctness = True
    #: What this judge's verdicts are worth (shown in every result row and summary).
    quality = "llm judge"

    def __init__(self, base_url: str | Sequence[str], model: str, *, api_key: str | None = None,
                 concurrency: int = 16, timeout: float = 60.0, max_retries: int = 4, max_reasks: int = 2,
                 backoff_base: float = 0.5, backoff_max: float = 8.0, structured: bool = True,
                 cache: JudgeCache | None = None, max_rubrics_per_request: int = 64, seed: int | None = None,
                 transport: str = "httpx", max_consecutive_failures: int = 8, down_after: float = 60.0,
                 retry_endpoint_after: float = 30.0, cache_any_endpoint: bool = False):
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls:
            raise ConfigError("base_url", "give at least one endpoint URL")
        seen: set[str] = set()
        for u in urls:
            if not isinstance(u, str) or not u.startswith(("http://", "https://")):
                raise ConfigError("base_url", f"must start with http:// or https://, got {u!r}")
            problem = base_url_problem(u)
            if problem:
                raise ConfigError("base_url", problem)
            if u.rstrip("/") in seen:
                raise ConfigError("base_url", f"{u} is given twice")
            seen.add(u.rstrip("/"))
        if concurrency < 1:
            raise ConfigError("concurrency", f"must be >= 1, got {concurrency}")
        if max_retries < 0 or max_reasks < 0:
            raise ConfigError("max_retries", "max_retries and max_reasks must be >= 0")
        if timeout <= 0:
            raise ConfigError("timeout", f"must be > 0, got {timeout}")
        if max_rubrics_per_request < 1:
            raise ConfigError("max_rubrics_per_request", "must be >= 1")
        if transport not in ("httpx", "asyncio"):
            raise ConfigError("transport", f"unknown {transport!r}; valid: httpx, asyncio")
        if max_consecutive_failures < 1 or not down_after > 0:
            raise ConfigError("max_consecutive_failures", "max_consecutive_failures must be >= 1, down_after > 0")
        if not retry_endpoint_after > 0:
            raise ConfigError("retry_endpoint_after", f"must be > 0, got {retry_endpoint_after}")
        self.transport = transport
        self.name = f"openai:{model}"
        self._endpoints = [_Endpoint(u.rstrip("/"), retry_endpoint_after) for u in urls]
        #: the endpoint roots, in the order given
        self.base_urls = tuple(ep.base_url for ep in self._endpoints)
        self.base_url = self.base_urls[0]
        self.url = self._endpoints[0].url
        self.model = model
        self.concurrency = concurrency
        self.timeout = timeout
        self.max_retries = max_retries
        self.max_reasks = max_reasks
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.structured = structured
        self.cache = cache
        self.cache_any_endpoint = bool(cache_any_endpoint)
        #: :func:`~creditlab.judge.cache.endpoint_id` of each endpoint: whose cached replies this judge takes
        self.endpoint_ids = tuple(dict.fromkeys(endpoint_id(u) for u in self.base_urls))
        self.max_rubrics_per_request = max_rubrics_per_request
        self.max_consecutive_failures = max_consecutive_failures
        self.down_after = down_after
        self.retry_endpoint_after = retry_endpoint_after
        #: why the judge was taken as down: every endpoint out of rotation (None while one answers)
        self.down: str | None = None
        self.params: dict[str, Any] = {"temperature": 0}
        self._key = api_key or None
        self._rng = random.Random(seed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inflight: dict[tuple[str, ...], asyncio.Future] = {}
        self._heads: dict[tuple[str, bool], tuple[Any, str]] = {}

    def __repr__(self) -> str:  # never shows the key
        where = f"url={self.url!r}" if len(self._endpoints) == 1 else f"urls={[e.url for e in self._endpoints]!r}"
        return f"OpenAIJudge({where}, model={self.model!r}, auth={'yes' if self._key else 'no'})"

    # -- per-event-loop resources (the TRL-style callable runs one loop per call) -------------------
    def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        headers = {"Content-Type": "application/json"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        shared = _ENDPOINT_SLOTS.setdefault(loop, {})
        for ep in self._endpoints:
            if self.transport == "asyncio":
                ep.lean = LeanClient(ep.url, headers, self.timeout, self.concurrency)
                ep.clients, ep.busy = [], []
            else:
                # httpx's connection pool scans all its connections for every queued request, which costs
                # O(concurrency^2) CPU per request at high concurrency; shards of <= 8 connections, each
                # request going to the least busy shard, keep it cheaper at concurrency 64+.
                n = -(-self.concurrency // _SHARD)
                per = -(-self.concurrency // n)
                limits = httpx.Limits(max_connections=per, max_keepalive_connections=per)
                ep.clients = [httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(self.timeout), limits=limits)
                              for _ in range(n)]
                ep.busy = [0] * n
                ep.lean = None
            # One limit per endpoint: judges of the same URL in the same event loop share it (the first
            # judge's ``concurrency`` sets it).
            ep.slots = shared.setdefault(ep.url, _Slots(self.concurrency))
            ep.check = None
        self._inflight = {}
        self._loop = loop

    async def aclose(self) -> None:
        """Close the HTTP connections of the current event loop."""
        if self._loop is asyncio.get_running_loop():
            for ep in self._endpoints:
                for c in ep.clients:
                    await c.aclose()
                if ep.lean is not None:
                    await ep.lean.aclose()
        for ep in self._endpoints:
            ep.clients, ep.lean = [], None
        self._loop = None

    async def preflight(self, timeout: float = 10.0) -> list[str]:
        """One cheap request per endpoint (``GET <base_url>/models``) to check that they answer at all.

        Any HTTP reply counts as alive (servers without a ``/models`` route answer 404). When no
        endpoint answers (a refused connection or no reply within ``timeout`` seconds) this raises
        :class:`JudgeError` naming the URLs; a 401/403 raises naming the API key; a root missing its
        ``/v1`` (``/models`` not found there, ``<root>/v1/models`` answers: ``bad_base_url``) or a model
        list without ``model`` (``unknown_model``) raises naming the likely fix. Endpoints that do
        not answer while others do are taken out of rotation (tried again later) and described in
        the returned list (empty when every endpoint answers).
        """
        headers = {"Authorization": f"Bearer {self._key}"} if self._key else {}
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout)) as client:
            found = await asyncio.gather(*(self._preflight_one(client, ep, headers, timeout)
                                           for ep in self._endpoints))
        problems = [(ep, f) for ep, f in zip(self._endpoints, found, strict=True) if f is not None]
        for _, (kind, message) in problems:
            if kind in ("http_401", "http_403", "bad_base_url", "unknown_model"):  # configuration, not health
                raise JudgeError("preflight", kind, message)
        if len(problems) == len(self._endpoints):
            if len(problems) == 1:
                raise JudgeError("preflight", *problems[0][1])
            raise JudgeError("preflight", problems[0][1][0], "no endpoint answers: " +
                             "; ".join(message for _, (_, message) in problems))
        for ep, (_, message) in problems:
            self._take_out(ep, f"preflight: {message}")
        return [f"{message}: taken out of rotation, tried again in {self.retry_endpoint_after:g}s"
                for _, (_, message) in problems]

    async def _preflight_one(self, client: httpx.AsyncClient, ep: _Endpoint, headers: dict[str, str],
                             timeout: float) -> tuple[str, str] | None:
        """``(kind, message)`` of what is wrong with ``ep`` (None: it answers and serves the model).

        Besides "does it answer": a root whose ``/models`` is not found while ``<root>/v1/models``
        answers is a base URL missing its ``/v1`` (``bad_base_url``); a model list that does not hold
        ``model`` names the model the endpoint serves (``unknown_model``).
        """
        try:
            resp = await client.get(ep.base_url + "/models", headers=headers)
        except httpx.TimeoutException:
            return "timeout", f"{ep.base_url} did not answer within {timeout:g}s"
        except httpx.TransportError as err:
            return "connection", f"cannot connect to {ep.base_url} ({type(err).__name__})"
        if resp.status_code in (401, 403):
            return f"http_{resp.status_code}", (f"{ep.base_url} refused the request: check the API key "
                                                "(--api-key-env)")
        if resp.status_code == 404 and not ep.base_url.endswith("/v1"):
            try:
                alt = await client.get(ep.base_url + "/v1/models", headers=headers)
            except httpx.HTTPError:
                alt = None
            if alt is not None and alt.status_code == 200 and _model_ids(alt) is not None:
                return "bad_base_url", (f"{ep.base_url}/models is not found but {ep.base_url}/v1/models answers: "
                                        f"the API root is probably {ep.base_url}/v1 (--base-url {ep.base_url}/v1)")
        if resp.status_code == 200:
            ids = _model_ids(resp)
            if ids and self.model not in ids and f"{self.model}:latest" not in ids:
                shown = ", ".join(repr(i) for i in ids[:5]) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")
                return "unknown_model", (f"{ep.base_url} does not serve model {self.model!r} (GET /models lists "
                                         f"{shown}): pass a listed name, e.g. --model {ids[0]} (or --no-preflight "
                                         "if this server accepts names it does not list)")
        return None

    # -- health and counters per endpoint ----------------------------------------------------------
    def endpoint_stats(self) -> list[dict[str, Any]]:
        """Per endpoint, in the order given: ``base_url``, ``state`` (``up``, ``out of rotation`` or
        ``down``), ``requests`` (attempts sent), ``errors`` (attempts that failed), ``latency_mean_s``,
        ``latency_p50_s`` and ``latency_p95_s`` of the answered requests (over the last 4096), and
        ``reason`` (why it is out, or None)."""
        out = []
        now = time.monotonic()
        for ep in self._endpoints:
            lat = sorted(ep.latencies)
            if ep.down is None:
                state = "up"
            elif self.down is not None:
                state = "down"
            else:
                state = f"out of rotation (tried again in {max(0.0, ep.retry_at - now):.0f}s)"
            out.append({"base_url": ep.base_url, "state": state, "requests": ep.requests, "errors": ep.errors,
                        "latency_mean_s": ep.latency_sum / ep.replies if ep.replies else None,
                        "latency_p50_s": lat[len(lat) // 2] if lat else None,
                        "latency_p95_s": lat[min(len(lat) - 1, int(0.95 * len(lat)))] if lat else None,
                        "reason": ep.down})
        return out

    def _take_out(self, ep: _Endpoint, reason: str) -> None:
        """Take ``ep`` out of rotation; the judge is down once every endpoint is out."""
        ep.down = reason
        ep.retry_at = time.monotonic() + ep.cooldown
        ep.cooldown = min(2 * ep.cooldown, 8 * self.retry_endpoint_after)
        if all(e.down is not None for e in self._endpoints):
            eps = self._endpoints
            self.down = eps[0].down if len(eps) == 1 else "every endpoint is down: " + "; ".join(
                f"{e.down}" for e in eps)

    def _failed(self, ep: _Endpoint, t0: float, err: Exception, probe: bool) -> str | None:
        """Count a failed attempt (no reply) towards taking ``ep`` out of rotation. Once the streak is
        long enough: a refused or dropped connection takes it out; a timeout returns the reason, and the
        caller first checks that ``ep`` answers nothing at all (:meth:`_confirm_down`: a server that is
        only slow on some requests is not down). An endpoint out of rotation that fails its one try is
        taken out again.

        A request sent before the endpoint's last reply is no evidence that it is dead: it answered
        another request meanwhile (at high concurrency the timeouts of a few hung requests fire
        together, after the replies that arrived around them). Only failures with no reply since
        they were sent make the streak.
        """
        now = time.monotonic()
        if t0 < ep.last_reply and not probe:
            return None
        if ep.streak == 0:
            ep.streak_start = t0
        ep.streak += 1
        age = now - ep.streak_start
        reason = f"{ep.streak} consecutive failed requests to {ep.base_url} over {age:.0f}s (last: {err})"
        if probe:
            self._take_out(ep, reason)
        elif ep.down is None and (ep.streak >= self.max_consecutive_failures
                                  or (ep.streak >= 2 and age >= self.down_after)):
            if getattr(err, "kind", None) == "timeout":
                return reason
            self._take_out(ep, reason)
        return None

    async def _confirm_down(self, ep: _Endpoint, reason: str) -> None:
        """Take ``ep`` out of rotation for ``reason`` unless it answers one small request (a two-word
        ``unitize``, on a connection of its own, within ``timeout``). An endpoint that answers it is
        alive and only slow on the requests that failed: they fail as timeouts on their own items, the
        streak ends and nothing else stops. Concurrent callers share one check."""
        task = ep.check
        if task is None:
            task = ep.check = asyncio.ensure_future(self._alive(ep))

            def done(t: asyncio.Future, ep: _Endpoint = ep) -> None:
                if ep.check is t:
                    ep.check = None

            task.add_done_callback(done)
        alive = await asyncio.shield(task)
        if alive:
            ep.streak = 0
            self._answered(ep)
        elif ep.down is None:
            self._take_out(ep, f"{reason}; a small check request got no reply either")

    async def _alive(self, ep: _Endpoint) -> bool:
        """Whether ``ep`` sends any HTTP reply to a tiny stage request within ``timeout``."""
        messages = stage_request("unitize", prompt="Liveness check.", response="OK.").messages
        body = self._body("unitize", messages, _schema("unitize") if self.structured else None)
        headers = {"Content-Type": "application/json"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(self.timeout),
                                         trust_env=self.transport == "httpx") as client:
                await client.post(ep.url, content=body, headers=headers)
        except httpx.HTTPError:
            return False
        return True

    def _answered(self, ep: _Endpoint) -> None:
        """``ep`` sent an HTTP reply (of any status): an endpoint out of rotation is back in it."""
        ep.last_reply = time.monotonic()
        if ep.down is not None and self.down is None:
            ep.down = None
            ep.cooldown = self.retry_endpoint_after

    # -- stages ------------------------------------------------------------------------------------
    # A lone surrogate can be neither sent (no encoding writes it) nor cached: each stage refuses it
    # with a JudgeError of kind ``input`` naming the field (FORKReward refuses such items before any stage).
    async def unitize(self, prompt: str, response: str) -> list[str]:
        check_stage_text("unitize", prompt, response)
        return await self._ask(stage_request("unitize", prompt=prompt, response=response))

    async def coverage(self, prompt: str, response: str, rubrics: Sequence[str]) -> list[bool]:
        check_stage_text("coverage", prompt, response, rubrics)
        chunks = self._chunks(rubrics)
        if len(chunks) == 1:  # the usual case: one request, no task to gather
            return await self._ask(stage_request("coverage", prompt=prompt, response=response, rubrics=chunks[0]))
        parts = await asyncio.gather(*(
            self._ask(stage_request("coverage", prompt=prompt, response=response, rubrics=chunk))
            for chunk in chunks))
        return [flag for part in parts for flag in part]

    async def match(self, prompt: str, rubrics: Sequence[str], units: Sequence[str]) -> list[list[bool]]:
        check_stage_text("match", prompt, rubrics=rubrics, units=units)
        if not units:
            return [[] for _ in rubrics]
        chunks = self._chunks(rubrics)
        if len(chunks) == 1:
            return await self._ask(stage_request("match", prompt=prompt, rubrics=chunks[0], units=units))
        parts = await asyncio.gather(*(
            self._ask(stage_request("match", prompt=prompt, rubrics=chunk, units=units)) for chunk in chunks))
        return [row for part in parts for row in part]

    async def correctness(self, prompt: str, units: Sequence[str]) -> list[bool]:
        check_stage_text("correctness", prompt, units=units)
        if not units:
            return []
        return await self._ask(stage_request("correctness", prompt=prompt, units=units))

    async def threshold(self, prompt: str, units: Sequence[str], credits: Sequence[float]) -> float:
        check_stage_text("threshold", prompt, units=units)
        return await self._ask(stage_request("threshold", prompt=prompt, units=units, credits=credits))

    def _chunks(self, rubrics: Sequence[str]) -> list[Sequence[str]]:
        """Rubric chunks of at most ``max_rubrics_per_request`` (sent concurrently); none if no rubric."""
        k = self.max_rubrics_per_request
        return [rubrics[i:i + k] for i in range(0, len(rubrics), k)]

    # -- one stage call: cache, in-flight sharing, re-asks -------------------------------------------
    async def _ask(self, req: StageRequest) -> Any:
        self._bind()
        stage, messages = req.stage, req.messages
        schema = _schema(stage) if self.structured else None
        usage = current_usage()
        key = None
        if self.cache is not None:
            key = cache_key(model=self.model, params=self.params, messages=messages, schema=schema,
                            prompt_version=PROMPT_VERSION)
            data = self.cache.get(key, endpoints=None if self.cache_any_endpoint else self.endpoint_ids)
            if data is not None:
                try:
                    result = parse_stage_reply(req, data)
                except ReplyInvalid:
                    pass  # e.g. a cache written by an older validator: ask again
                else:
                    if usage is not None:
                        usage.cache_hits += 1
                    return result
        # Model, parameters and schema are the judge's own: the messages identify a request (no hash
        # of the whole request when there is no cache).
        share = (stage, *[m["content"] for m in messages])
        pending = self._inflight.get(share)
        if pending is not None:
            if usage is not None:
                usage.shared += 1
            data = await asyncio.shield(pending)
            return parse_stage_reply(req, data)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._inflight[share] = fut
        try:
            data, result, ep = await self._ask_fresh(req, schema)
        except BaseException as err:
            if isinstance(err, asyncio.CancelledError):
                fut.cancel()
            else:
                fut.set_exception(err)
                fut.exception()  # mark retrieved: nobody may be waiting
            raise
        else:
            fut.set_result(data)
            if self.cache is not None:
                self.cache.put(key, data, endpoint=endpoint_id(ep.base_url))
            return result
        finally:
            self._inflight.pop(share, None)

    async def _ask_fresh(self, req: StageRequest, schema: dict[str, Any] | None) -> tuple[Any, Any, _Endpoint]:
        """``(reply data, parsed result, the endpoint that gave the valid reply)``."""
        stage, messages = req.stage, req.messages
        convo = list(messages)
        usage = current_usage()
        last = ""
        for reask in range(self.max_reasks + 1):
            if reask and usage is not None:
                usage.reasks += 1
            text, ep = await self._post(stage, convo, schema)
            try:
                data = extract_json(text)
                return data, parse_stage_reply(req, data), ep
            except ReplyInvalid as err:
                last = str(err)
                convo = [*messages, {"role": "assistant", "content": text[:4000]},
                         {"role": "user", "content": f"Your reply was invalid: {last}. Reply again with only "
                                                     "the corrected JSON object."}]
        raise JudgeError(stage, "invalid_reply", f"{last} (after {self.max_reasks + 1} replies)")

    def _body(self, stage: str, messages: list[dict[str, str]], schema: dict[str, Any] | None) -> bytes:
        """The request body: the per-stage part (model, parameters, reply schema) is encoded once."""
        params = tuple(self.params.items())
        cached = self._heads.get((stage, schema is not None))
        if cached is None or cached[0] != (self.model, params):
            fields: dict[str, Any] = {"model": self.model, **self.params}
            if schema is not None:
                fields["response_format"] = {"type": "json_schema",
                                             "json_schema": {"name": f"fork_{stage}", "schema": schema, "strict": True}}
            cached = ((self.model, params), json.dumps(fields)[:-1] + ', "messages": [')
            self._heads[(stage, schema is not None)] = cached
        return (cached[1] + ", ".join(_message_json(m) for m in messages) + "]}").encode()

    # -- one HTTP request with bounded retries, on the least loaded endpoint ------------------------------
    def _take(self, avoid: _Endpoint | None) -> tuple[_Endpoint, bool] | None:
        """A free slot on the endpoint with the least load (``avoid`` last), or on one out of rotation
        whose retry time has come (a probe, only when no endpoint in rotation has a free slot)."""
        best, best_load, now = None, 4.0, 0.0
        for ep in self._endpoints:
            s = ep.slots
            if s.used >= s.limit:
                continue
            load = s.used / s.limit
            if ep.down is not None:
                if ep.probing:
                    continue
                now = now or time.monotonic()
                if now < ep.retry_at:
                    continue
                load += 2.0
            if ep is avoid:
                load += 1.0
            if load < best_load:
                best, best_load = ep, load
        if best is None:
            return None
        best.slots.used += 1
        probe = best.down is not None
        if probe:
            best.probing = True
        return best, probe

    async def _acquire(self, stage: str, avoid: _Endpoint | None) -> tuple[_Endpoint, bool]:
        while True:
            if self.down is not None:
                raise JudgeError(stage, "endpoint_down", f"not sent: the endpoint is down ({self.down})")
            taken = self._take(avoid)
            if taken is not None:
                return taken
            assert self._loop is not None
            fut = self._loop.create_future()
            for ep in self._endpoints:
                if ep.down is None:
                    ep.slots.waiters.append(fut)
            if not any(ep.down is None for ep in self._endpoints):  # every one waits for its retry time
                await asyncio.sleep(max(0.0, min(ep.retry_at for ep in self._endpoints) - time.monotonic()))
                continue
            try:
                slots = await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    fut.result().release()
                raise
            for ep in self._endpoints:
                if ep.slots is slots and ep.down is None:
                    return ep, False
            slots.release()  # handed a slot of an endpoint taken out meanwhile: choose again

    async def _post(self, stage: str, messages: list[dict[str, str]], schema: dict[str, Any] | None
                    ) -> tuple[str, _Endpoint]:
        body = self._body(stage, messages, schema)
        usage = current_usage()
        avoid: _Endpoint | None = None
        for attempt in range(self.max_retries + 1):
            if attempt and usage is not None:
                usage.retries += 1
            taken = self._take(avoid) if self.down is None else None  # a free slot: no coroutine to wait in
            ep, probe = taken if taken is not None else await self._acquire(stage, avoid)
            t0 = time.monotonic()
            suspect: str | None = None
            try:
                if usage is not None:
                    usage.requests += 1
                ep.requests += 1
                text = await self._post_once(ep, stage, body)
            except _Transient as err:
                ep.errors += 1
                if err.kind in ("timeout", "connection"):
                    suspect = self._failed(ep, t0, err, probe)
                else:
                    self._answered(ep)
                failure = err
            except JudgeError:
                ep.errors += 1
                self._answered(ep)
                raise
            else:
                dt = time.monotonic() - t0
                ep.streak = 0
                ep.replies += 1
                ep.latency_sum += dt
                ep.latencies.append(dt)
                self._answered(ep)
                return text, ep
            finally:
                if probe:
                    ep.probing = False
                ep.slots.release()
            if suspect is not None:
                await self._confirm_down(ep, suspect)
            if self.down is not None:
                raise JudgeError(stage, "endpoint_down", self.down) from None
            if attempt == self.max_retries:
                raise JudgeError(stage, failure.kind, f"{failure} (after {attempt + 1} attempts)") from None
            avoid = ep
            delay = min(self.backoff_max, self.backoff_base * 2 ** attempt) * self._rng.uniform(0.5, 1.0)
            if failure.retry_after is not None:
                delay = max(delay, min(failure.retry_after, self.backoff_max))
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _post_once(self, ep: _Endpoint, stage: str, body: bytes) -> str:
        if ep.lean is not None:
            try:
                resp: Any = await ep.lean.post(body)
            except HTTPError as err:
                if err.timeout:
                    raise _Transient("timeout", str(err)) from None
                raise _Transient("connection", str(err)) from None
            return self._content(stage, resp)
        busy = ep.busy
        shard = min(range(len(busy)), key=busy.__getitem__)
        busy[shard] += 1
        try:
            resp = await ep.clients[shard].post(ep.url, content=body)
        except httpx.TimeoutException:
            raise _Transient("timeout", f"no reply within {self.timeout}s") from None
        except httpx.TransportError as err:
            raise _Transient("connection", type(err).__name__) from None
        finally:
            busy[shard] -= 1
        return self._content(stage, resp)

    def _content(self, stage: str, resp: Any) -> str:
        if resp.status_code in _RETRY_STATUS:
            raise _Transient(f"http_{resp.status_code}", _short(resp.text), _retry_after(resp))
        if resp.status_code >= 400:
            raise JudgeError(stage, f"http_{resp.status_code}", _short(resp.text))
        try:
            data = resp.json()
            content = data["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            # A garbled envelope (e.g. a truncated body) is a transport fault: retry.
            raise _Transient("bad_envelope", f"not a chat completion: {_short(resp.text)}") from None
        if not isinstance(content, str):
            raise _Transient("bad_envelope", "message content is not a string")
        return content


def _message_json(m: dict[str, str]) -> str:
    """``json.dumps(m)`` of a chat message; a ``{"role", "content"}`` pair of strings is written directly
    (the system messages, the same few strings every time, are encoded once)."""
    if type(m) is dict and len(m) == 2:
        role, content = m.get("role"), m.get("content")
        if type(role) is str and type(content) is str and next(iter(m)) == "role":
            if role == "system":
                enc = _SYSTEM_JSON.get(content)
                if enc is None:
                    if len(_SYSTEM_JSON) > 64:
                        _SYSTEM_JSON.clear()
                    enc = _SYSTEM_JSON[content] = _enc_ascii(content)
            else:
                enc = _enc_ascii(content)
            return '{"role": ' + _enc_ascii(role) + ', "content": ' + enc + "}"
    return json.dumps(m)


def _schema(stage: str) -> dict[str, Any]:
    schema = _SCHEMAS.get(stage)
    if schema is None:
        schema = _SCHEMAS[stage] = reply_schema(stage)
    return schema


_ROUTES = ("/chat/completions", "/completions", "/models")


def _model_ids(resp: Any) -> list[str] | None:
    """The model ids of a ``GET /models`` reply (``{"data": [{"id"}, ...]}``); None when it is not one."""
    try:
        data = resp.json()["data"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(data, list):
        return None
    return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]


def base_url_problem(url: str) -> str | None:
    """What is wrong with ``url`` as an endpoint root, with the likely fix (None: nothing seen).

    The root is where ``/chat/completions`` and ``/models`` are appended (``http://host:8000/v1``); a
    URL that already ends with one of these routes would be requested twice over.
    """
    from urllib.parse import urlsplit

    path = urlsplit(url).path.rstrip("/")
    for route in _ROUTES:
        if path.endswith(route):
            root = url.rstrip("/")[: -len(route)]
            return (f"{url} ends with {route}: give the API root instead, e.g. {root} (/chat/completions and "
                    "/models are appended to it)")
    return None


def _short(text: str, n: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n] + "..."


def _retry_after(resp: Any) -> float | None:
    value = resp.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None
