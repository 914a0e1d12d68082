"""DaemonThreadPool: reused threads, a bound, and an abandoned call that starves nothing (and blocks no exit:
tests/component/test_fresh_interpreter.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from asyncgrpo.threads import DaemonThreadPool, PoolClosed

pytestmark = pytest.mark.timeout(30)
LIVENESS_S = 10.0  # a guard against hanging the suite, never a speed assertion


async def call_on(pool: DaemonThreadPool, fn):
    async with pool.worker() as thread:
        return await thread.call(fn)


def test_calls_reuse_one_thread_and_errors_keep_it():
    async def main():
        pool = DaemonThreadPool(2, name="t")
        first = await call_on(pool, threading.get_ident)
        with pytest.raises(ValueError, match="bad input"):
            await call_on(pool, lambda: (_ for _ in ()).throw(ValueError("bad input")))
        second = await call_on(pool, threading.get_ident)
        assert first == second != threading.get_ident() and pool.owned == 1
        pool.close()

    asyncio.run(main())


def test_at_most_size_calls_run_at_once_and_the_others_wait():
    lock, running, most = threading.Lock(), [0], [0]
    gate = threading.Event()

    def work():
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        gate.wait(LIVENESS_S)
        with lock:
            running[0] -= 1
        return threading.get_ident()

    async def main():
        pool = DaemonThreadPool(2, name="t")
        calls = [asyncio.create_task(call_on(pool, work)) for _ in range(5)]
        await asyncio.sleep(0.05)
        assert pool.owned == 2 and sum(t.done() for t in calls) == 0
        gate.set()
        async with asyncio.timeout(LIVENESS_S):
            idents = await asyncio.gather(*calls)
        assert len(set(idents)) == 2 and most[0] == 2
        pool.close()

    asyncio.run(main())


def test_an_abandoned_call_writes_off_its_thread_and_a_later_call_still_runs():
    release = threading.Event()
    stuck_on: list[threading.Thread] = []

    def stuck():
        stuck_on.append(threading.current_thread())
        release.wait(60)

    async def main():
        pool = DaemonThreadPool(1, name="t")  # one thread: the stuck call would starve every later one
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await call_on(pool, stuck)
        assert pool.owned == 0
        async with asyncio.timeout(LIVENESS_S):
            later = await call_on(pool, threading.get_ident)
        assert later != stuck_on[0].ident and pool.owned == 1
        pool.close()

    try:
        asyncio.run(main())
    finally:
        release.set()
    stuck_on[0].join(LIVENESS_S)
    assert not stuck_on[0].is_alive()  # a written-off thread exits once its call returns


def test_close_ends_idle_threads_and_refuses_later_calls():
    async def main():
        pool = DaemonThreadPool(1, name="t")
        thread = await call_on(pool, threading.current_thread)
        pool.close()
        assert not thread.is_alive() and pool.owned == 0  # gone when close returns: no thread outlives its owner
        with pytest.raises(PoolClosed, match="closed"):
            await call_on(pool, threading.get_ident)

    asyncio.run(main())
