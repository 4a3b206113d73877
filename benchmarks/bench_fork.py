"""FORK scoring throughput and fault tolerance against a loopback chat-completions server.

The server runs in its own process (so it does not compete with the client for the GIL) and
answers every request after a fixed latency (default 50 ms), like a remote model. Measured:

1. requests per response (the budget is <= 5: one per judge stage);
2. throughput as a fraction of the ideal ``concurrency / latency`` requests per second;
3. a rerun from the cache: requests made (should be 0);
4. with injected faults (500, 429, timeouts, malformed / truncated JSON, wrong ids) on a share of
   requests: every item ends with a score or an explicit error, nothing crashes, and reruns of the
   failed items complete them.

    python benchmarks/bench_fork.py                 # 1000 responses x 20 rubrics x ~15 units
    python benchmarks/bench_fork.py --items 200     # smaller
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
import urllib.request
from pathlib import Path

from creditlab.judge import JudgeCache, OpenAIJudge
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


def server_stats(url: str) -> dict:
    with urllib.request.urlopen(url.rsplit("/v1", 1)[0] + "/stats") as r:
        return json.loads(r.read())


def server_requests(url: str) -> int:
    return int(server_stats(url).get("requests", 0))


async def score_all(reward: FORKReward, items: list[ForkItem]):
    results = await reward.score(items)
    await reward.judge.aclose()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=1000)
    ap.add_argument("--rubrics", type=int, default=20)
    ap.add_argument("--units", type=int, default=15)
    ap.add_argument("--latency", type=float, default=0.05)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--fault-rate", type=float, default=0.2)
    ap.add_argument("--transports", nargs="+", default=["httpx", "asyncio"], choices=["httpx", "asyncio"])
    args = ap.parse_args()
    items = make_items(args.items, args.rubrics, args.units)
    tmp = Path(tempfile.mkdtemp(prefix="bench_fork_"))

    print(f"{args.items} responses x {args.rubrics} rubrics x ~{args.units} units; latency "
          f"{args.latency * 1000:.0f} ms; concurrency {args.concurrency}")
    with serve_in_subprocess(latency=args.latency) as url:
        for transport in args.transports:
            cache = JudgeCache(tmp / f"cache-{transport}.sqlite")
            before = server_requests(url)
            server_cpu = server_stats(url)["cpu_seconds"]
            judge = OpenAIJudge(url, "bench", concurrency=args.concurrency, timeout=10, cache=cache,
                                transport=transport)
            reward = FORKReward(judge)
            t0, c0 = time.perf_counter(), time.process_time()
            results = asyncio.run(score_all(reward, items))
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            n_req = server_requests(url) - before
            server_cpu = server_stats(url)["cpu_seconds"] - server_cpu
            errors = sum(r.error is not None for r in results)
            ideal = n_req * args.latency / args.concurrency
            mean_units = sum(r.n_units for r in results) / len(results)
            tag = f"[{transport}]".ljust(10)
            print(f"{tag}requests/response: {n_req / len(items):.2f} (max per item "
                  f"{max(r.requests for r in results)}), units/response {mean_units:.1f}, errors {errors}")
            print(f"{tag}wall {wall:.2f} s, ideal {ideal:.2f} s -> throughput fraction of ideal {ideal / wall:.2f} "
                  f"({n_req / wall:.0f} req/s vs ideal {args.concurrency / args.latency:.0f}); client CPU "
                  f"{cpu / n_req * 1000:.2f} ms/request, server CPU {server_cpu / n_req * 1000:.2f} ms/request")
            t0 = time.perf_counter()
            before = server_requests(url)
            again = asyncio.run(score_all(FORKReward(OpenAIJudge(url, "bench", concurrency=args.concurrency,
                                                                 cache=cache, transport=transport)), items))
            print(f"{tag}cache rerun: {server_requests(url) - before} requests, {time.perf_counter() - t0:.2f} s, "
                  f"identical rewards: {[r.reward for r in again] == [r.reward for r in results]}")

    with serve_in_subprocess(latency=args.latency, fault_rate=args.fault_rate, seed=1, hang=2.0) as url:
        cache = JudgeCache(tmp / "faults.sqlite")

        def faulty_reward() -> FORKReward:
            return FORKReward(OpenAIJudge(url, "bench", concurrency=args.concurrency, timeout=0.5, max_retries=2,
                                          max_reasks=1, backoff_base=0.05, backoff_max=0.5, cache=cache, seed=0,
                                          transport=args.transports[-1]))

        t0 = time.perf_counter()
        results = asyncio.run(score_all(faulty_reward(), items))
        ok = {r.id for r in results if r.error is None}
        failed = [r for r in results if r.error is not None]
        assert all(r.reward is None and r.error for r in failed) and len(results) == len(items)
        kinds: dict[str, int] = {}
        for r in failed:
            k = r.error.split(":")[1].strip()
            kinds[k] = kinds.get(k, 0) + 1
        print(f"[faults]  ({args.transports[-1]}) {args.fault_rate:.0%} of requests faulted: {len(ok)} scored, "
              f"{len(failed)} explicit errors {kinds}, {time.perf_counter() - t0:.2f} s, requests/response "
              f"{server_requests(url) / len(items):.2f}")
        for rerun in range(1, 6):
            todo = [it for it in items if it.id not in ok]
            if not todo:
                break
            res = asyncio.run(score_all(faulty_reward(), todo))
            ok |= {r.id for r in res if r.error is None}
            print(f"[faults]  rerun {rerun}: {len(todo)} retried, {sum(r.error is None for r in res)} completed, "
                  f"{len(items) - len(ok)} still failing")
        print(f"[faults]  final: {len(ok)}/{len(items)} scored")


if __name__ == "__main__":
    main()
