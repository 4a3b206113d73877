"""A loopback chat-completions server for tests and benchmarks: a stand-in for a remote LLM judge.

It speaks the OpenAI chat-completions protocol over real HTTP/1.1 (keep-alive), answers the FORK
judge stages deterministically from the request content with simple lexical rules, and can inject
faults. What it replaces is the remote model, not our client: the client under test is the real
:class:`~creditlab.judge.openai_compat.OpenAIJudge`, HTTP and all.

Answer rules (on lowercase word tokens; "content words" have >= 4 letters and are not in a short
stop list):

* unitize: split the answer into sentences; drop greetings ("Sure", "Hello"...);
* coverage: a rubric is met when all its content words occur in the answer;
* match: unit i contributes to rubric j when all of rubric j's content words occur in unit i;
* correctness: a unit is incorrect when it contains the word ``WRONG``;
* threshold: tau = 0.75 (``ChatServer(tau=...)``: another judge serving a model of the same name that
  answers otherwise).

Faults (``500``, ``429``, ``timeout``, ``malformed``, ``truncated``, ``wrong_ids``) are injected
either from a script (:meth:`ChatServer.push_faults`: the next requests get these faults in order)
or at random with probability ``fault_rate``, deterministically from ``(seed, request body, how
many times this body was seen)`` so a retried request can succeed.

Run one in a separate process (the benchmark does, so that the server does not compete with the
client for the GIL): ``python -m creditlab.judge.testing --latency 0.05`` prints its URL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import hashlib
import json
import re
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable
from typing import Any

from creditlab.errors import ConfigError, CreditlabError, InputError

__all__ = ["FAULTS", "ChatServer", "answer_stage", "serve_in_subprocess"]

FAULTS = ("500", "429", "timeout", "malformed", "truncated", "wrong_ids")

_STOP = {"that", "this", "with", "from", "have", "should", "must", "mentions", "mention", "states", "state",
         "response", "answer", "says", "recommends", "recommend", "explains", "explain", "includes", "include",
         "about", "their", "there", "which", "when", "what", "does", "into", "also", "than", "then", "them"}
_GREETING = re.compile(r"^(sure|hello|hi|hey|great question|of course|certainly)\b[!,.]?\s*$", re.IGNORECASE)
_SENT = re.compile(r"(?<=[.!?])\s+|\n+")
_WORD = re.compile(r"[a-z0-9]+")
# when the request being answered was read (each connection is served by its own task)
_ARRIVED: contextvars.ContextVar[float | None] = contextvars.ContextVar("arrived", default=None)


def _content(text: str) -> set[str]:
    return {w for w in _WORD.findall(text.lower()) if len(w) >= 4 and w not in _STOP}


def _split(answer: str) -> list[str]:
    parts = [p.strip() for p in _SENT.split(answer)]
    return [p for p in parts if p and not _GREETING.match(p)]


def answer_stage(payload: dict[str, Any]) -> dict[str, Any]:
    """The deterministic reply object of one stage request payload (see the module docstring)."""
    task = payload["task"]
    if task == "unitize":
        return {"units": [{"id": f"U{k + 1}", "text": u} for k, u in enumerate(_split(payload["answer"]))]}
    if task == "coverage":
        words = _content(payload["answer"])
        return {"rubrics": [{"id": r["id"], "met": _content(r["criterion"]) <= words} for r in payload["rubrics"]]}
    if task == "match":
        units = [(u["id"], _content(u["text"])) for u in payload["units"]]
        rubrics = [(r["id"], _content(r["criterion"])) for r in payload["rubrics"]]
        return {"rubrics": [{"id": rid, "units": [uid for uid, w in units if need <= w]} for rid, need in rubrics]}
    if task == "correctness":
        return {"units": [{"id": u["id"], "correct": "wrong" not in _WORD.findall(u["text"].lower())}
                          for u in payload["units"]]}
    if task == "threshold":
        return {"tau": 0.75}
    raise InputError(f"task: unknown {task!r}")


def _wrong_ids(reply: dict[str, Any]) -> dict[str, Any]:
    for key in ("rubrics", "units"):
        if reply.get(key):
            items = [dict(x) for x in reply[key]]
            items[0]["id"] = "X999"
            return {**reply, key: items}
    return {"units": [{"id": "X999", "text": "?"}]} if "units" in reply else {"tau": -1.0}


class ChatServer:
    """Loopback chat-completions server in a background thread (its own event loop).

    Args:
        latency: seconds from a request's arrival to its reply (a remote model's latency; the reply is
            computed within it, so the server's own CPU does not add to it).
        fault_rate: probability of a random fault per request (0 disables).
        fault_kinds: which faults random injection draws from.
        seed: seed of the random faults.
        hang: seconds a ``timeout`` fault stalls before answering.
        fence: wrap replies in a markdown code fence with a sentence around it (a model that does
            not honour structured output).
        tau: the threshold stage's answer.

    ``url`` is the ``base_url`` to give a client; ``stats`` counts requests, injected faults and the
    most requests in flight at once; ``requests`` keeps the last 200 request bodies and headers.
    """

    def __init__(self, *, latency: float = 0.0, fault_rate: float = 0.0, fault_kinds: Iterable[str] = FAULTS,
                 seed: int = 0, hang: float = 5.0, fence: bool = False, host: str = "127.0.0.1", port: int = 0,
                 tau: float = 0.75):
        self.latency = latency
        self.fault_rate = fault_rate
        self.fault_kinds = tuple(fault_kinds)
        unknown = set(self.fault_kinds) - set(FAULTS)
        if unknown:
            raise ConfigError("fault_kinds", f"unknown {sorted(unknown)}; valid: {FAULTS}")
        self.seed = seed
        self.hang = hang
        self.fence = fence
        self.tau = tau
        self.host = host
        self.port = port
        self.stats: Counter[str] = Counter()
        self.requests: deque[dict[str, Any]] = deque(maxlen=200)
        self._script: deque[str] = deque()
        self._seen: Counter[str] = Counter()
        self._inflight = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def push_faults(self, faults: Iterable[str]) -> None:
        """The next requests get these faults, in order (then normal answers)."""
        faults = list(faults)
        bad = set(faults) - set(FAULTS)
        if bad:
            raise ConfigError("faults", f"unknown {sorted(bad)}; valid: {FAULTS}")
        with self._lock:
            self._script.extend(faults)

    def reset(self, **settings: Any) -> None:
        """Clear counters, scripted faults and history; optionally change settings (``latency=``...)."""
        with self._lock:
            self.stats.clear()
            self.requests.clear()
            self._script.clear()
            self._seen.clear()
            for k, v in settings.items():
                if not hasattr(self, k):
                    raise ConfigError(k, "unknown setting")
                setattr(self, k, v)

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> ChatServer:
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._handle_conn, self.host, self.port, backlog=1024))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()
            self._server.close()
            pending = asyncio.all_tasks(self._loop)
            for t in pending:
                t.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.close()

        self._thread = threading.Thread(target=run, name="chat-server", daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop = None

    def __enter__(self) -> ChatServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def serve_forever(self) -> None:
        """Run in the calling thread (the ``python -m`` entry point)."""
        asyncio.run(self._serve_main())

    async def _serve_main(self) -> None:
        server = await asyncio.start_server(self._handle_conn, self.host, self.port, backlog=1024)
        self.port = server.sockets[0].getsockname()[1]
        print(self.url, flush=True)
        async with server:
            await server.serve_forever()

    # -- HTTP ------------------------------------------------------------------------------------------
    async def _handle_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError as e:
                    if not e.partial:
                        break
                    raise
                request_line, *lines = head[:-4].decode("latin-1").split("\r\n")
                method, path, _ = request_line.split(" ", 2)
                headers: dict[str, str] = {}
                for h in lines:
                    k, _, v = h.partition(":")
                    headers[k.strip().lower()] = v.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                _ARRIVED.set(loop.time())
                status, payload, extra = await self._route(method, path, headers, body)
                head_out = [f"HTTP/1.1 {status} {'OK' if status == 200 else 'Error'}",
                            "Content-Type: application/json", f"Content-Length: {len(payload)}",
                            "Connection: keep-alive", *[f"{k}: {v}" for k, v in extra.items()]]
                writer.write(("\r\n".join(head_out) + "\r\n\r\n").encode() + payload)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError,
                asyncio.CancelledError):
            pass
        finally:
            try:
                writer.close()
            except RuntimeError:
                pass

    async def _route(self, method: str, path: str, headers: dict[str, str],
                     body: bytes) -> tuple[int, bytes, dict[str, str]]:
        if method == "GET" and path.startswith("/stats"):
            return 200, json.dumps({**self.stats, "cpu_seconds": time.process_time()}).encode(), {}
        if method != "POST" or path.rstrip("/") not in ("/v1/chat/completions", "/chat/completions"):
            return 404, b'{"error": {"message": "not found"}}', {}
        self.stats["requests"] += 1
        try:
            req = json.loads(body)
            messages = req["messages"]
            payload = json.loads(next(m["content"] for m in messages if m["role"] == "user"))
        except (ValueError, KeyError, StopIteration, TypeError):
            return 400, b'{"error": {"message": "bad request"}}', {}
        self.requests.append({"body": req, "headers": dict(headers)})
        fault = self._draw_fault(body)
        self._inflight += 1
        self.stats["max_inflight"] = max(self.stats["max_inflight"], self._inflight)
        try:
            return await self._answer(req, payload, body, fault)
        finally:
            self._inflight -= 1

    async def _answer(self, req: dict[str, Any], payload: dict[str, Any], body: bytes,
                      fault: str | None) -> tuple[int, bytes, dict[str, str]]:
        # The reply is computed first and sent ``latency`` seconds after the request arrived, like a
        # remote model whose latency includes its own work: the server's CPU does not add to it
        # (sleeping first made replies whose sleeps ended together wait for each other).
        try:
            reply: tuple[int, bytes, dict[str, str]] | BaseException = self._reply(req, payload, body, fault)
        except Exception as e:  # noqa: BLE001  (raised after the latency, as a remote server would fail)
            reply = e
        if self.latency:
            arrived = _ARRIVED.get()
            now = asyncio.get_running_loop().time()
            await asyncio.sleep(self.latency if arrived is None else max(0.0, arrived + self.latency - now))
        if fault:
            self.stats[f"fault_{fault}"] += 1
        if fault == "timeout":
            await asyncio.sleep(self.hang)
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def _reply(self, req: dict[str, Any], payload: dict[str, Any], body: bytes,
               fault: str | None) -> tuple[int, bytes, dict[str, str]]:
        if fault == "500":
            return 500, b'{"error": {"message": "internal error"}}', {}
        if fault == "429":
            return 429, b'{"error": {"message": "rate limited"}}', {"Retry-After": "0"}
        reply = answer_stage(payload)
        if payload.get("task") == "threshold":
            reply = {"tau": self.tau}
        if fault == "wrong_ids":
            reply = _wrong_ids(reply)
        content = json.dumps(reply)
        if fault == "malformed":
            content = "I think the answer is: " + content.replace('"', "'")
        elif self.fence:
            content = f"Here is my grading.\n```json\n{content}\n```\nDone."
        envelope = json.dumps({
            "id": "chatcmpl-" + hashlib.sha1(body).hexdigest()[:12], "object": "chat.completion",
            "created": int(time.time()), "model": req.get("model", ""),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": len(body) // 4, "completion_tokens": len(content) // 4,
                      "total_tokens": (len(body) + len(content)) // 4},
        }).encode()
        if fault == "truncated":
            envelope = envelope[: len(envelope) // 2]
        return 200, envelope, {}

    def _draw_fault(self, body: bytes) -> str | None:
        with self._lock:
            if self._script:
                return self._script.popleft()
            if self.fault_rate <= 0:
                return None
            digest = hashlib.sha256(body).hexdigest()
            n = self._seen[digest]
            self._seen[digest] += 1
        h = hashlib.sha256(f"{self.seed}:{digest}:{n}".encode()).digest()
        u = int.from_bytes(h[:8], "big") / 2**64
        if u >= self.fault_rate:
            return None
        return self.fault_kinds[h[8] % len(self.fault_kinds)]


class serve_in_subprocess:  # noqa: N801  (a context manager used like a function)
    """Start ``python -m creditlab.judge.testing`` with these options; ``with ... as url:``."""

    def __init__(self, *, latency: float = 0.0, fault_rate: float = 0.0, seed: int = 0, hang: float = 5.0):
        self.args = [sys.executable, "-m", "creditlab.judge.testing", "--latency", str(latency),
                     "--fault-rate", str(fault_rate), "--seed", str(seed), "--hang", str(hang)]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> str:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        url = self.proc.stdout.readline().strip()
        if not url.startswith("http"):
            self.proc.kill()
            raise CreditlabError("the chat server did not start")
        return url

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Loopback chat-completions server answering FORK judge stages.")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--latency", type=float, default=0.0)
    ap.add_argument("--fault-rate", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hang", type=float, default=5.0)
    a = ap.parse_args(argv)
    ChatServer(host=a.host, port=a.port, latency=a.latency, fault_rate=a.fault_rate, seed=a.seed,
               hang=a.hang).serve_forever()


if __name__ == "__main__":
    main()
