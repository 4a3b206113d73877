"""MicroBatcher: concurrent single-item calls become batched calls (verl's reward loop -> one judge batch)."""

from __future__ import annotations

import asyncio

import pytest

from creditlab.errors import InputError
from creditlab.integrations._common import MicroBatcher


async def _double(items):
    await asyncio.sleep(0.001)
    return [2 * x for x in items]


def test_concurrent_calls_share_batches_and_keep_order():
    async def main():
        b = MicroBatcher(_double, max_batch=4, max_wait_s=0.05)
        out = await asyncio.gather(*(b.submit(i) for i in range(10)))
        return b.batches, out

    batches, out = asyncio.run(main())
    assert out == [2 * i for i in range(10)]
    assert batches == [4, 4, 2]  # full batches go at once, the rest after max_wait_s


def test_a_failing_batch_fails_every_waiter_and_later_calls_work():
    calls = []

    async def flaky(items):
        calls.append(len(items))
        if len(calls) == 1:
            raise InputError("judge down")
        return list(items)

    async def main():
        b = MicroBatcher(flaky, max_batch=8, max_wait_s=0.01)
        first = await asyncio.gather(*(b.submit(i) for i in range(3)), return_exceptions=True)
        second = await asyncio.gather(*(b.submit(i) for i in range(2)))
        return first, second

    first, second = asyncio.run(main())
    assert all(isinstance(e, InputError) for e in first) and second == [0, 1] and calls == [3, 2]


def test_bad_parameters():
    with pytest.raises(InputError, match="max_batch"):
        MicroBatcher(_double, max_batch=0)


def test_batcher_cache_is_per_loop_and_forgets_dead_loops():
    import gc

    from creditlab.integrations._common import BatcherCache

    cache = BatcherCache()

    async def use(key):
        loop = asyncio.get_running_loop()
        a = cache.get(loop, key, lambda: MicroBatcher(_double, max_batch=2))
        assert cache.get(loop, key, lambda: MicroBatcher(_double)) is a  # one batcher per (loop, key)
        return await a.submit(3)

    for _ in range(20):  # asyncio.run makes and closes a new loop each time
        assert asyncio.run(use("k")) == 6
    gc.collect()
    assert len(cache) == 0  # nothing accumulates across loops

    async def live():
        await use("a"), await use("b")
        return len(cache)

    assert asyncio.run(live()) == 2
