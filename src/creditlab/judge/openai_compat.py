"""``OpenAIJudge``: the five FORK judge stages over any OpenAI-compatible chat-completions endpoint.

Works with vLLM, SGLang, Ollama and hosted APIs (``POST {base_url}/chat/completions``), through
httpx. Temperature 0. The API key is read from an environment variable at construction and only
ever placed in the ``Authorization`` header; it is never logged nor put in an error message.

Reliability, per request:

* transport failures (HTTP 429 and 5xx, timeouts, dropped connections) are retried at most
  ``max_retries`` times with exponential backoff and full jitter (``Retry-After`` is honoured,
  capped at ``backoff_max``);
* a reply that is not valid (not JSON, wrong schema, ids that are not those asked about) is
  re-asked at most ``max_reasks`` times, telling the model what was wrong;
* then a typed :class:`~creditlab.judge.base.JudgeError`. Other HTTP errors (401, 404...) fail at
  once.

Throughput: one ``asyncio`` concurrency limit per endpoint (judges of the same URL share it), held
only while a request is on the wire (not while backing off); identical requests in flight share one call;
an optional :class:`~creditlab.judge.cache.JudgeCache` serves validated replies without a request.
Stage requests with more than ``max_rubrics_per_request`` rubrics are split into chunks.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import weakref
from collections.abc import Sequence
from typing import Any

import httpx

from creditlab.errors import ConfigError
from creditlab.judge._http import HTTPError, LeanClient
from creditlab.judge.base import JudgeError, current_usage
from creditlab.judge.cache import JudgeCache, cache_key
from creditlab.judge.prompts import (
    PROMPT_VERSION,
    ReplyInvalid,
    build_messages,
    extract_json,
    parse_reply,
    payload_for,
    reply_schema,
)

__all__ = ["OpenAIJudge"]

_RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
_SHARD = 8  # connections per httpx client (see OpenAIJudge._bind)
_ENDPOINT_LIMITS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Semaphore]] = \
    weakref.WeakKeyDictionary()


class _Transient(Exception):
    def __init__(self, kind: str, message: str, retry_after: float | None = None):
        self.kind = kind
        self.retry_after = retry_after
        super().__init__(message)


class OpenAIJudge:
    """FORK judge over an OpenAI-compatible endpoint.

    Args:
        base_url: endpoint root, e.g. ``http://localhost:8000/v1`` (``/chat/completions`` is appended).
        model: model name sent with every request.
        api_key_env: name of the environment variable holding the API key (unset: no auth header).
        concurrency: most requests on the wire at once.
        timeout: seconds per request (connect + read).
        max_retries: retries of a transient failure (429, 5xx, timeout) per request.
        max_reasks: re-asks after an invalid reply per stage call.
        backoff_base, backoff_max: backoff ``min(max, base * 2**attempt)`` scaled by a uniform
            jitter in [0.5, 1].
        structured: send ``response_format = json_schema`` (vLLM / SGLang / OpenAI); otherwise the
            JSON object is extracted from plain text.
        cache: optional cache of validated replies.
        max_rubrics_per_request: chunk size for very large rubric sets.
        seed: seed of the jitter generator (deterministic backoff in tests).
        max_consecutive_failures, down_after: the endpoint is taken as down (every later request
            fails at once with ``endpoint_down``, nothing more is sent) after this many consecutive
            failed attempts (timeouts, refused connections), or once a streak of at least two has
            lasted ``down_after`` seconds; any success ends the streak.
        transport: ``httpx`` (default; proxies, redirects, HTTP/2-capable stack) or ``asyncio``, the
            minimal keep-alive HTTP/1.1 client of :mod:`creditlab.judge._http`, several times cheaper
            in CPU per request when thousands of requests per second go to a local server.
    """

    can_judge_correctness = True
    #: What this judge's verdicts are worth (shown in every result row and summary).
    quality = "llm judge"

    def __init__(self, base_url: str, model: str, *, api_key_env: str = "OPENAI_API_KEY",
                 concurrency: int = 16, timeout: float = 60.0, max_retries: int = 4, max_reasks: int = 2,
                 backoff_base: float = 0.5, backoff_max: float = 8.0, structured: bool = True,
                 cache: JudgeCache | None = None, max_rubrics_per_request: int = 64, seed: int | None = None,
                 transport: str = "httpx", max_consecutive_failures: int = 8, down_after: float = 60.0):
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError("base_url", f"must start with http:// or https://, got {base_url!r}")
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
        self.transport = transport
        self.name = f"openai:{model}"
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.concurrency = concurrency
        self.timeout = timeout
        self.max_retries = max_retries
        self.max_reasks = max_reasks
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.structured = structured
        self.cache = cache
        self.max_rubrics_per_request = max_rubrics_per_request
        self.base_url = base_url.rstrip("/")
        self.max_consecutive_failures = max_consecutive_failures
        self.down_after = down_after
        #: why the endpoint was taken as down (None while it answers)
        self.down: str | None = None
        self._streak = 0
        self._streak_start = 0.0
        self.params: dict[str, Any] = {"temperature": 0}
        self._key = os.environ.get(api_key_env) or None
        self._rng = random.Random(seed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._clients: list[httpx.AsyncClient] = []
        self._lean: LeanClient | None = None
        self._busy: list[int] = []
        self._sem: asyncio.Semaphore | None = None
        self._inflight: dict[str, asyncio.Future] = {}

    def __repr__(self) -> str:  # never shows the key
        return f"OpenAIJudge(url={self.url!r}, model={self.model!r}, auth={'yes' if self._key else 'no'})"

    # -- per-event-loop resources (the TRL-style callable runs one loop per call) -------------------
    def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        headers = {"Content-Type": "application/json"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        if self.transport == "asyncio":
            self._lean = LeanClient(self.url, headers, self.timeout, self.concurrency)
            self._clients, self._busy = [], []
        else:
            # httpx's connection pool scans all its connections for every queued request, which costs
            # O(concurrency^2) CPU per request at high concurrency; shards of <= 8 connections, each
            # request going to the least busy shard, keep it cheaper at concurrency 64+.
            n = -(-self.concurrency // _SHARD)
            per = -(-self.concurrency // n)
            limits = httpx.Limits(max_connections=per, max_keepalive_connections=per)
            self._clients = [httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(self.timeout), limits=limits)
                             for _ in range(n)]
            self._busy = [0] * n
            self._lean = None
        # One limit per endpoint: judges of the same URL in the same event loop share it (the first
        # judge's ``concurrency`` sets it).
        limits = _ENDPOINT_LIMITS.setdefault(loop, {})
        self._sem = limits.setdefault(self.url, asyncio.Semaphore(self.concurrency))
        self._inflight = {}
        self._loop = loop

    async def aclose(self) -> None:
        """Close the HTTP connections of the current event loop."""
        if self._loop is asyncio.get_running_loop():
            for c in self._clients:
                await c.aclose()
            if self._lean is not None:
                await self._lean.aclose()
        self._clients, self._lean = [], None
        self._loop = None

    async def preflight(self, timeout: float = 10.0) -> None:
        """One cheap request (``GET <base_url>/models``) to check the endpoint answers at all.

        Any HTTP reply counts as alive (servers without a ``/models`` route answer 404); a refused
        connection or no reply within ``timeout`` seconds raises :class:`JudgeError` naming the URL,
        and 401/403 raises naming the API key.
        """
        headers = {"Authorization": f"Bearer {self._key}"} if self._key else {}
        url = self.base_url + "/models"
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(timeout)) as client:
                resp = await client.get(url, headers=headers)
        except httpx.TimeoutException:
            raise JudgeError("preflight", "timeout", f"{self.base_url} did not answer within {timeout:g}s") from None
        except httpx.TransportError as err:
            raise JudgeError("preflight", "connection", f"cannot connect to {self.base_url} "
                                                        f"({type(err).__name__})") from None
        if resp.status_code in (401, 403):
            raise JudgeError("preflight", f"http_{resp.status_code}", f"{self.base_url} refused the request: check "
                                                                      "the API key (--api-key-env)")

    def _failed(self, t0: float, err: Exception) -> None:
        """Count a failed attempt towards taking the endpoint as down."""
        now = time.monotonic()
        if self._streak == 0:
            self._streak_start = t0
        self._streak += 1
        age = now - self._streak_start
        if self._streak >= self.max_consecutive_failures or (self._streak >= 2 and age >= self.down_after):
            self.down = (f"{self._streak} consecutive failed requests to {self.base_url} over {age:.0f}s "
                         f"(last: {err})")

    # -- stages ------------------------------------------------------------------------------------
    async def unitize(self, prompt: str, response: str) -> list[str]:
        return await self._ask("unitize", payload_for("unitize", prompt=prompt, response=response))

    async def coverage(self, prompt: str, response: str, rubrics: Sequence[str]) -> list[bool]:
        parts = await asyncio.gather(*(
            self._ask("coverage", payload_for("coverage", prompt=prompt, response=response, rubrics=chunk))
            for chunk in self._chunks(rubrics)))
        return [flag for part in parts for flag in part]

    async def match(self, prompt: str, rubrics: Sequence[str], units: Sequence[str]) -> list[list[bool]]:
        if not units:
            return [[] for _ in rubrics]
        parts = await asyncio.gather(*(
            self._ask("match", payload_for("match", prompt=prompt, rubrics=chunk, units=units))
            for chunk in self._chunks(rubrics)))
        return [row for part in parts for row in part]

    async def correctness(self, prompt: str, units: Sequence[str]) -> list[bool]:
        if not units:
            return []
        return await self._ask("correctness", payload_for("correctness", prompt=prompt, units=units))

    async def threshold(self, prompt: str, units: Sequence[str], credits: Sequence[float]) -> float:
        return await self._ask("threshold", payload_for("threshold", prompt=prompt, units=units,
                                                        credits=credits))

    def _chunks(self, rubrics: Sequence[str]) -> list[Sequence[str]]:
        """Rubric chunks of at most ``max_rubrics_per_request`` (sent concurrently); none if no rubric."""
        k = self.max_rubrics_per_request
        return [rubrics[i:i + k] for i in range(0, len(rubrics), k)]

    # -- one stage call: cache, in-flight sharing, re-asks -------------------------------------------
    async def _ask(self, stage: str, payload: dict[str, Any]) -> Any:
        self._bind()
        messages = build_messages(stage, payload)
        schema = reply_schema(stage) if self.structured else None
        key = cache_key(model=self.model, params=self.params, messages=messages, schema=schema,
                        prompt_version=PROMPT_VERSION)
        usage = current_usage()
        if self.cache is not None:
            data = self.cache.get(key)
            if data is not None:
                try:
                    result = parse_reply(stage, data, payload)
                except ReplyInvalid:
                    pass  # e.g. a cache written by an older validator: ask again
                else:
                    if usage is not None:
                        usage.cache_hits += 1
                    return result
        pending = self._inflight.get(key)
        if pending is not None:
            if usage is not None:
                usage.shared += 1
            data = await asyncio.shield(pending)
            return parse_reply(stage, data, payload)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        try:
            data, result = await self._ask_fresh(stage, messages, schema, payload)
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
                self.cache.put(key, data)
            return result
        finally:
            self._inflight.pop(key, None)

    async def _ask_fresh(self, stage: str, messages: list[dict[str, str]], schema: dict[str, Any] | None,
                         payload: dict[str, Any]) -> tuple[Any, Any]:
        convo = list(messages)
        usage = current_usage()
        last = ""
        for reask in range(self.max_reasks + 1):
            if reask and usage is not None:
                usage.reasks += 1
            text = await self._post(stage, convo, schema)
            try:
                data = extract_json(text)
                return data, parse_reply(stage, data, payload)
            except ReplyInvalid as err:
                last = str(err)
                convo = [*messages, {"role": "assistant", "content": text[:4000]},
                         {"role": "user", "content": f"Your reply was invalid: {last}. Reply again with only "
                                                     "the corrected JSON object."}]
        raise JudgeError(stage, "invalid_reply", f"{last} (after {self.max_reasks + 1} replies)")

    # -- one HTTP request with bounded retries ---------------------------------------------------------
    async def _post(self, stage: str, messages: list[dict[str, str]], schema: dict[str, Any] | None) -> str:
        body: dict[str, Any] = {"model": self.model, "messages": messages, **self.params}
        if schema is not None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": f"fork_{stage}", "schema": schema, "strict": True}}
        usage = current_usage()
        assert self._sem is not None
        for attempt in range(self.max_retries + 1):
            if attempt and usage is not None:
                usage.retries += 1
            try:
                async with self._sem:
                    if self.down is not None:
                        raise JudgeError(stage, "endpoint_down", f"not sent: the endpoint is down ({self.down})")
                    if usage is not None:
                        usage.requests += 1
                    t0 = time.monotonic()
                    text = await self._post_once(stage, body)
                    self._streak = 0
                    return text
            except _Transient as err:
                if err.kind in ("timeout", "connection"):
                    self._failed(t0, err)
                if self.down is not None:
                    raise JudgeError(stage, "endpoint_down", self.down) from None
                if attempt == self.max_retries:
                    raise JudgeError(stage, err.kind, f"{err} (after {attempt + 1} attempts)") from None
                delay = min(self.backoff_max, self.backoff_base * 2 ** attempt) * self._rng.uniform(0.5, 1.0)
                if err.retry_after is not None:
                    delay = max(delay, min(err.retry_after, self.backoff_max))
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _post_once(self, stage: str, body: dict[str, Any]) -> str:
        if self._lean is not None:
            try:
                resp: Any = await self._lean.post(json.dumps(body).encode())
            except HTTPError as err:
                if err.timeout:
                    raise _Transient("timeout", f"no reply within {self.timeout}s") from None
                raise _Transient("connection", str(err)) from None
            return self._content(stage, resp)
        shard = min(range(len(self._busy)), key=self._busy.__getitem__)
        self._busy[shard] += 1
        try:
            resp = await self._clients[shard].post(self.url, json=body)
        except httpx.TimeoutException:
            raise _Transient("timeout", f"no reply within {self.timeout}s") from None
        except httpx.TransportError as err:
            raise _Transient("connection", type(err).__name__) from None
        finally:
            self._busy[shard] -= 1
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
