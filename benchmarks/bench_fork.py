"""FORK scoring throughput and fault tolerance against loopback chat-completions servers.

Each server runs in its own process (so it does not compete with the client for the GIL) and
answers every request a fixed latency (default 50 ms) after reading it, its own work included, like a
remote model. Measured:

1. ``clients``: the same items through creditlab's client (``OpenAIJudge``, both transports) and
   through the official ``openai`` SDK (``AsyncOpenAI``, driven the way a user would write a judge
   with it: one ``chat.completions.create`` per stage under a semaphore of the same concurrency),
   against the same server: wall time, requests per response (the budget is <= 5), throughput as a
   fraction of the ideal ``concurrency / latency``, client CPU per request, and the ratio of the
   SDK's wall time to creditlab's (> 1: creditlab is faster). The runs alternate, ``--repeat``
   times each, so a change in the machine's load hits both. ``transport-only`` sends the request
   bodies of the first creditlab run again through the transport alone (no prompt building, reply
   parsing or FORK work): the most the server and the machine allow any client;
2. ``endpoints``: one endpoint against three (three server processes, ``--endpoint-concurrency``
   each), then three with one of them killed (SIGKILL) when half the items are done: every item is
   still scored, and the per-endpoint summary shows where the requests went;
3. ``cache``: a rerun from the cache makes no request and gives identical rewards;
4. ``faults``: injected faults (500, 429, timeouts, malformed / truncated JSON, wrong ids) on a share
   of requests: every item ends with a score or an explicit error, nothing crashes, and reruns of
   the failed items complete them.

    python benchmarks/bench_fork.py                       # 1000 responses x 20 rubrics x ~15 units
    python benchmarks/bench_fork.py --items 200 -s clients
    python benchmarks/bench_fork.py --profile             # where creditlab's client time goes (cProfile)
    python benchmarks/bench_fork.py --smoke               # every section on 8 responses x 3 rubrics, seconds

``--smoke`` runs every section (and its ratio lines) on 8 responses x 3 rubrics x ~4 units, one run per
client, 10 ms latency, concurrency 4 (2 per endpoint), short fault timeouts: the code paths, not the
speed. A size given on the command line wins over the smoke's.

Figures move with the machine's load (printed with them): read them side by side within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import os
import pstats
import random
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple

from _common import integer, line_buffered, number
from _common import parser as bench_parser

from creditlab.judge import JudgeCache, OpenAIJudge, current_usage
from creditlab.judge.prompts import build_messages, extract_json, parse_reply, payload_for, reply_schema
from creditlab.judge.testing import serve_in_subprocess
from creditlab.rewards import ForkItem, FORKReward, Rubric


def make_items(n: int, rubrics: int, units: int, seed: int = 0) -> list[ForkItem]:
    """Synthetic rubric-graded responses; every item is distinct (no cache or in-flight sharing)."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        rub = tuple(Rubric(f"Mentions topic{j} detail{j}x{i}", float(rng.choice([1, 2, 3, -2])))
                    for j in range(rubrics))
        sents = []
        for _ in range(units + rng.randint(-3, 3)):
            kind = rng.random()
            j = rng.randrange(rubrics)
            if kind < 0.6:
                sents.append(f"The topic{j} has detail{j}x{i} as its main feature.")
            elif kind < 0.75:
                sents.append(f"Indeed topic{j} comes with detail{j}x{i} once more.")
            elif kind < 0.9:
                sents.append(f"The topic{j} WRONG claim about item{i} number{rng.randrange(1000)}.")
            else:
                sents.append(f"Filler sentence number{rng.randrange(1000)} for item{i}.")
        items.append(ForkItem(f"item{i}", f"Question {i} about topics?", " ".join(sents), rub))
    return items


class SDKJudge:
    """The five FORK stages through ``openai.AsyncOpenAI``: the judge a user would write with the SDK.

    Same prompts, reply schemas and validation as :class:`OpenAIJudge`; one ``chat.completions.create``
    per stage under a semaphore of ``concurrency`` (the SDK's own retries left at their default).
    """

    can_judge_correctness = True
    quality = "llm judge"

    def __init__(self, base_url: str, model: str, *, concurrency: int, timeout: float):
        from openai import AsyncOpenAI

        self.name = f"openai-sdk:{model}"
        self.model = model
        self.client = AsyncOpenAI(base_url=base_url, api_key="unused", timeout=timeout)
        self.sem = asyncio.Semaphore(concurrency)
        self.formats = {s: {"type": "json_schema", "json_schema": {"name": f"fork_{s}", "schema": reply_schema(s),
                                                                   "strict": True}}
                        for s in ("unitize", "coverage", "match", "correctness", "threshold")}

    async def _ask(self, stage: str, payload: dict):
        messages = build_messages(stage, payload)
        usage = current_usage()
        if usage is not None:
            usage.requests += 1
        async with self.sem:
            resp = await self.client.chat.completions.create(model=self.model, messages=messages, temperature=0,
                                                             response_format=self.formats[stage])
        return parse_reply(stage, extract_json(resp.choices[0].message.content), payload)

    async def unitize(self, prompt, response):
        return await self._ask("unitize", payload_for("unitize", prompt=prompt, response=response))

    async def coverage(self, prompt, response, rubrics):
        return await self._ask("coverage", payload_for("coverage", prompt=prompt, response=response, rubrics=rubrics))

    async def match(self, prompt, rubrics, units):
        if not units:
            return [[] for _ in rubrics]
        return await self._ask("match", payload_for("match", prompt=prompt, rubrics=rubrics, units=units))

    async def correctness(self, prompt, units):
        if not units:
            return []
        return await self._ask("correctness", payload_for("correctness", prompt=prompt, units=units))

    async def threshold(self, prompt, units, credits):
        return await self._ask("threshold", payload_for("threshold", prompt=prompt, units=units, credits=credits))

    async def aclose(self):
        await self.client.close()


def server_stats(url: str) -> dict:
    with urllib.request.urlopen(url.rsplit("/v1", 1)[0] + "/stats") as r:
        return json.loads(r.read())


def server_requests(url: str) -> int:
    return int(server_stats(url).get("requests", 0))


async def score_all(reward: FORKReward, items: list[ForkItem]):
    results = await reward.score(items)
    await reward.judge.aclose()
    return results


def load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def print_endpoints(judge: OpenAIJudge, tag: str) -> None:
    for s in judge.endpoint_stats():
        lat = f"{s['latency_mean_s'] * 1000:.0f} ms mean, {s['latency_p95_s'] * 1000:.0f} ms p95" \
            if s["latency_mean_s"] is not None else "no reply"
        print(f"{tag}  {s['base_url']}: {s['state']}, {s['requests']} requests, {s['errors']} errors, {lat}")


# -- 1. creditlab's client against the openai SDK ------------------------------------------------------

@contextlib.contextmanager
def tensor_fork_math():
    """The client's per-item FORK math on tiny torch tensors (``core.precision.fork_scores``, the
    reference), as the client ran it before it moved to plain floats: the "before" of that change."""
    import torch

    from creditlab.core import precision
    from creditlab.rewards import fork as fork_mod

    def credits(match, positive):
        J, n = len(positive), len(match[0]) if match else 0
        m = torch.tensor(match, dtype=torch.bool).reshape(1, J, n)
        return precision.unit_credit(m, torch.tensor([positive], dtype=torch.bool).reshape(1, J),
                                     torch.ones(1, n, dtype=torch.bool))[0].tolist()

    def scores(match, coverage, weights, correct, tau, beta=1.0, mode="fork"):
        J, n = len(weights), len(correct)
        out = precision.fork_scores(
            torch.tensor(match, dtype=torch.bool).reshape(1, J, n),
            torch.tensor([coverage], dtype=torch.bool).reshape(1, J),
            torch.tensor([weights], dtype=torch.float32).reshape(1, J),
            torch.tensor([correct], dtype=torch.bool).reshape(1, n),
            torch.ones(1, J, dtype=torch.bool), torch.ones(1, n, dtype=torch.bool), tau=tau, beta=beta, mode=mode)
        return precision.ForkOne(float(out.reward[0]), float(out.precision[0]), float(out.recall[0]),
                                 out.credits[0].tolist(), out.necessary[0].tolist())

    saved = fork_mod.unit_credit_one, fork_mod.fork_scores_one
    fork_mod.unit_credit_one, fork_mod.fork_scores_one = credits, scores
    try:
        yield
    finally:
        fork_mod.unit_credit_one, fork_mod.fork_scores_one = saved


@contextlib.contextmanager
def recording_bodies(bodies: list[bytes]):
    """Record the request bodies the asyncio transport sends (for the transport-only replay)."""
    from creditlab.judge import _http

    post = _http.LeanClient.post

    async def recorded(self, body: bytes):
        bodies.append(body)
        return await post(self, body)

    _http.LeanClient.post = recorded
    try:
        yield
    finally:
        _http.LeanClient.post = post


async def replay(url: str, bodies: list[bytes], concurrency: int) -> None:
    """The transport alone: the recorded bodies sent again, ``concurrency`` at a time, no FORK work."""
    from creditlab.judge._http import LeanClient

    client = LeanClient(url + "/chat/completions", {"Content-Type": "application/json"}, 10.0, concurrency)
    todo = iter(bodies)

    async def worker() -> None:
        for body in todo:
            resp = await client.post(body)
            assert resp.status_code == 200, resp.status_code

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await client.aclose()



class Run(NamedTuple):
    """One timed run against the loopback server."""

    wall: float
    cpu: float
    requests: int
    server_cpu: float


def timed(url: str, fn):
    """``fn()``'s result and its :class:`Run`: wall and client CPU seconds, the requests the server
    saw and the CPU seconds it spent on them."""
    before, server_cpu = server_requests(url), server_stats(url)["cpu_seconds"]
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return out, Run(wall, cpu, server_requests(url) - before, server_stats(url)["cpu_seconds"] - server_cpu)


def bench_clients(args, items: list[ForkItem]) -> None:
    # "+tensor-math": the same asyncio client with the per-item FORK math on torch tensors (the reference);
    # "transport-only": the request bodies of the first creditlab/asyncio run sent again through the
    # transport alone (no prompt building, parsing or FORK work): what this server and machine allow
    clients = ["creditlab/asyncio", "creditlab/asyncio+tensor-math", "creditlab/httpx", "openai-sdk",
               "transport-only"]
    walls: dict[str, list[float]] = {c: [] for c in clients}
    fractions: dict[str, list[float]] = {c: [] for c in clients}
    cpus: dict[str, list[float]] = {c: [] for c in clients}
    bodies: list[bytes] = []
    print(f"\n== clients: {len(items)} items, concurrency {args.concurrency}, latency {args.latency * 1000:.0f} ms, "
          f"one server process")
    def record(client: str, run: Run) -> float:
        """Store one run's wall, fraction of ideal and CPU per request; returns the ideal wall."""
        ideal = run.requests * args.latency / args.concurrency
        walls[client].append(run.wall)
        fractions[client].append(ideal / run.wall)
        cpus[client].append(run.cpu / run.requests * 1000)
        return ideal

    with serve_in_subprocess(latency=args.latency) as url:
        for rep in range(args.repeat):
            for client in clients:
                if client == "transport-only":
                    _, run = timed(url, lambda: asyncio.run(replay(url, bodies, args.concurrency)))
                    ideal = record(client, run)
                    print(f"[{client}] run {rep + 1}: {run.requests} requests, wall {run.wall:.2f} s, ideal "
                          f"{ideal:.2f} s -> fraction of ideal {ideal / run.wall:.2f} ({run.requests / run.wall:.0f} "
                          f"req/s vs ideal {args.concurrency / args.latency:.0f}); client CPU "
                          f"{run.cpu / run.requests * 1000:.2f} ms/request, server CPU "
                          f"{run.server_cpu / run.requests * 1000:.2f} ms/request; {load()}")
                    continue
                if client == "openai-sdk":
                    judge = SDKJudge(url, "bench", concurrency=args.concurrency, timeout=10)
                else:
                    judge = OpenAIJudge(url, "bench", concurrency=args.concurrency, timeout=10,
                                        transport=client.split("/")[1].split("+")[0])
                math = tensor_fork_math() if client.endswith("+tensor-math") else contextlib.nullcontext()
                if client == "creditlab/asyncio" and rep == 0:
                    math = recording_bodies(bodies)
                with math:
                    results, run = timed(url, lambda judge=judge: asyncio.run(score_all(FORKReward(judge), items)))
                errors = sum(r.error is not None for r in results)
                ideal = record(client, run)
                print(f"[{client}] run {rep + 1}: requests/response {run.requests / len(items):.2f}, errors {errors}, "
                      f"wall {run.wall:.2f} s, ideal {ideal:.2f} s -> fraction of ideal {ideal / run.wall:.2f} "
                      f"({run.requests / run.wall:.0f} req/s vs ideal {args.concurrency / args.latency:.0f}); client "
                      f"CPU {run.cpu / run.requests * 1000:.2f} ms/request, server CPU "
                      f"{run.server_cpu / run.requests * 1000:.2f} ms/request; {load()}")
    best = {c: min(w) for c, w in walls.items()}
    for c in clients[:3]:
        print(f"[ratio] openai-sdk wall / {c} wall: {best['openai-sdk'] / best[c]:.2f} (best of {args.repeat}; "
              f"> 1: creditlab faster)")
    print(f"\n[summary] {args.repeat} run(s) each, alternating; {load()}")
    print("| client | fraction of ideal (runs) | client CPU / request (runs) | SDK wall / its wall (best) |")
    print("|---|---|---|---|")
    for c in clients:
        print(f"| {c} | {', '.join(f'{f:.2f}' for f in fractions[c])} | "
              f"{', '.join(f'{x:.2f}' for x in cpus[c])} ms | "
              f"{best['openai-sdk'] / best[c]:.2f} |")


def profile_client(args, items: list[ForkItem]) -> None:
    """Where creditlab's client spends its CPU, by layer (cProfile's own time per function, grouped)."""
    with serve_in_subprocess(latency=args.latency) as url:
        judge = OpenAIJudge(url, "bench", concurrency=args.concurrency, timeout=10, transport=args.transport)
        prof = cProfile.Profile()
        prof.enable()
        asyncio.run(score_all(FORKReward(judge), items))
        prof.disable()
    layers: Counter[str] = Counter()
    torch_names = ("tensor", "sum", "isfinite", "any", "where", "clamp", "reshape", "zeros", "ones", "all")
    for (path, _, name), (_, _, own, _, _) in pstats.Stats(prof).stats.items():
        base = os.path.basename(path)
        if "torch" in path or "creditlab/core" in path or (path == "~" and "torch" in name) or \
                (path == "~" and any(f"'{t}" in name for t in torch_names)):
            layer = "FORK math (torch, creditlab.core)"
        elif "creditlab/rewards" in path:
            layer = "FORK driver (creditlab.rewards)"
        elif "json" in path or "json" in name:
            layer = "json encode/decode"
        elif "pydantic" in path or base == "prompts.py" or "validate_python" in name:
            layer = "prompts + reply validation (pydantic)"
        elif "epoll" in name or "select" in name:
            layer = "waiting (epoll)"
        elif name in ("<method 'send' of '_socket.socket' objects>",) or "socket" in name:
            layer = "socket syscalls"
        elif "asyncio" in path or "_contextvars" in name:
            layer = "asyncio event loop"
        elif base in ("openai_compat.py", "_http.py", "cache.py", "base.py"):
            layer = "creditlab.judge client"
        elif any(k in path for k in ("httpx", "httpcore", "anyio", "h11")):
            layer = "httpx stack"
        else:
            layer = "other"
        layers[layer] += own
    total = sum(layers.values())
    print(f"\n== profile of creditlab's client ({args.transport}), {len(items)} items, own time by layer; {load()}")
    for layer, t in layers.most_common():
        print(f"  {t:6.2f} s  {t / total:5.1%}  {layer}")


# -- 2. several endpoints --------------------------------------------------------------------------

async def score_and_kill(judge: OpenAIJudge, items: list[ForkItem], kill_at: int | None, victim) -> tuple:
    reward = FORKReward(judge)
    results, killed_at, sent_before = [], None, 0
    async for res in reward.score_iter(items):
        results.append(res)
        if kill_at is not None and len(results) == kill_at:
            victim.proc.kill()
            killed_at = time.perf_counter()
            sent_before = sum(s["requests"] for s in judge.endpoint_stats())
    await judge.aclose()
    return results, killed_at, sent_before


def bench_endpoints(args, items: list[ForkItem]) -> None:
    c = args.endpoint_concurrency
    print(f"\n== endpoints: {len(items)} items, {c} requests in flight per endpoint, latency "
          f"{args.latency * 1000:.0f} ms, one server process per endpoint")
    with ExitStack() as stack:
        servers = [serve_in_subprocess(latency=args.latency) for _ in range(3)]
        urls = [stack.enter_context(s) for s in servers]
        for name, use, kill in [("one endpoint", urls[:1], False), ("three endpoints", urls, False),
                                ("three, one killed halfway", urls, True)]:
            judge = OpenAIJudge(use, "bench", concurrency=c, timeout=5, max_retries=2, transport=args.transport,
                                seed=0)
            t0 = time.perf_counter()
            results, killed_at, sent_before = asyncio.run(
                score_and_kill(judge, items, len(items) // 2 if kill else None, servers[-1]))
            wall = time.perf_counter() - t0
            n_req = sum(s["requests"] for s in judge.endpoint_stats())
            ok = sum(r.error is None for r in results)
            if kill:  # the ideal with three endpoints until the kill, two after it
                ideal = sent_before * args.latency / (3 * c) + (n_req - sent_before) * args.latency / (2 * c)
            else:
                ideal = n_req * args.latency / (len(use) * c)
            tag = f"[{name}]"
            print(f"{tag} {ok}/{len(items)} scored, {n_req} requests sent (retries included), wall {wall:.2f} s, "
                  f"ideal {ideal:.2f} s -> fraction of ideal {ideal / wall:.2f} ({n_req / wall:.0f} req/s); {load()}")
            print_endpoints(judge, tag)


# -- 3. cache, 4. faults ---------------------------------------------------------------------------

def bench_cache(args, items: list[ForkItem], tmp: Path) -> None:
    print("\n== cache")
    with serve_in_subprocess(latency=args.latency) as url:
        cache = JudgeCache(tmp / "cache.sqlite")
        first = asyncio.run(score_all(FORKReward(OpenAIJudge(url, "bench", concurrency=args.concurrency, cache=cache,
                                                             transport=args.transport)), items))
        t0, before = time.perf_counter(), server_requests(url)
        again = asyncio.run(score_all(FORKReward(OpenAIJudge(url, "bench", concurrency=args.concurrency, cache=cache,
                                                             transport=args.transport)), items))
        print(f"[cache] rerun: {server_requests(url) - before} requests, {time.perf_counter() - t0:.2f} s, "
              f"identical rewards: {[r.reward for r in again] == [r.reward for r in first]}")


def bench_faults(args, items: list[ForkItem], tmp: Path) -> None:
    print(f"\n== faults: {args.fault_rate:.0%} of requests faulted")
    with serve_in_subprocess(latency=args.latency, fault_rate=args.fault_rate, seed=1, hang=args.hang) as url:
        cache = JudgeCache(tmp / "faults.sqlite")

        def faulty_reward() -> FORKReward:
            return FORKReward(OpenAIJudge(url, "bench", concurrency=args.concurrency, timeout=args.hang / 4,
                                          max_retries=2, max_reasks=1, backoff_base=0.05, backoff_max=0.5, cache=cache,
                                          seed=0, transport=args.transport))

        t0 = time.perf_counter()
        results = asyncio.run(score_all(faulty_reward(), items))
        ok = {r.id for r in results if r.error is None}
        failed = [r for r in results if r.error is not None]
        assert all(r.reward is None and r.error for r in failed) and len(results) == len(items)
        kinds = Counter(r.error.split(":")[1].strip() for r in failed)
        print(f"[faults] ({args.transport}) {len(ok)} scored, {len(failed)} explicit errors {dict(kinds)}, "
              f"{time.perf_counter() - t0:.2f} s, requests/response {server_requests(url) / len(items):.2f}")
        for rerun in range(1, 6):
            todo = [it for it in items if it.id not in ok]
            if not todo:
                break
            res = asyncio.run(score_all(faulty_reward(), todo))
            ok |= {r.id for r in res if r.error is None}
            print(f"[faults] rerun {rerun}: {len(todo)} retried, {sum(r.error is None for r in res)} completed, "
                  f"{len(items) - len(ok)} still failing")
        print(f"[faults] final: {len(ok)}/{len(items)} scored")


SECTIONS = ("clients", "endpoints", "cache", "faults")
#: the sizes of a full run and of --smoke (a flag given on the command line wins over both)
FULL = {"items": 1000, "rubrics": 20, "units": 15, "latency": 0.05, "concurrency": 64, "endpoint_concurrency": 16,
        "repeat": 2, "hang": 2.0}
SMOKE = {"items": 8, "rubrics": 3, "units": 4, "latency": 0.01, "concurrency": 4, "endpoint_concurrency": 2,
         "repeat": 1, "hang": 0.4}


def parser() -> argparse.ArgumentParser:
    ap = bench_parser(__doc__)
    ap.add_argument("--items", type=integer(1), help=f"responses (default {FULL['items']})")
    ap.add_argument("--rubrics", type=integer(1), help=f"rubrics per response (default {FULL['rubrics']})")
    ap.add_argument("--units", type=integer(1), help=f"units per response, about (default {FULL['units']})")
    ap.add_argument("--latency", type=number(0.0, above=True),
                    help=f"seconds the server takes per request (default {FULL['latency']})")
    ap.add_argument("--concurrency", type=integer(1), help=f"requests in flight (default {FULL['concurrency']})")
    ap.add_argument("--endpoint-concurrency", type=integer(1),
                    help=f"requests in flight per endpoint (default {FULL['endpoint_concurrency']})")
    ap.add_argument("--repeat", type=integer(1), help=f"runs of each client (default {FULL['repeat']})")
    ap.add_argument("--hang", type=number(0.0, above=True),
                    help=f"seconds a hanging fault holds a request; the faults section's timeout is a quarter of "
                         f"it (default {FULL['hang']})")
    ap.add_argument("--fault-rate", type=number(0.0, 1.0), default=0.2, help="share of requests faulted (0 to 1)")
    ap.add_argument("--transport", default="asyncio", choices=["httpx", "asyncio"],
                    help="creditlab transport of the endpoints, cache, faults and profile sections")
    ap.add_argument("-s", "--section", action="append", choices=SECTIONS, help="run only these sections")
    ap.add_argument("--profile", action="store_true", help="profile creditlab's client instead")
    return ap


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    line_buffered()
    for k, v in (SMOKE if args.smoke else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    items = make_items(args.items, args.rubrics, args.units)
    if args.smoke:
        print("--smoke: tiny sizes, the figures below say nothing about speed")
    print(f"{args.items} responses x {args.rubrics} rubrics x ~{args.units} units; {os.cpu_count()} CPUs; {load()}")
    if args.profile:
        profile_client(args, items)
        return
    sections = args.section or SECTIONS
    if "clients" in sections:
        bench_clients(args, items)
    if "endpoints" in sections:
        bench_endpoints(args, items)
    with tempfile.TemporaryDirectory(prefix="bench_fork_") as tmp:  # the judge caches of 3. and 4.
        if "cache" in sections:
            bench_cache(args, items, Path(tmp))
        if "faults" in sections:
            bench_faults(args, items, Path(tmp))


if __name__ == "__main__":
    main()
