"""StateSignal (no lost wake-ups), FirstFailure (sticky, fresh exceptions) and the virtual-time loop."""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncgrpo.commands.vtime import VirtualDeadlock, VirtualTimeLoop, run_virtual
from asyncgrpo.errors import Diagnostic, PipelineError, StallError
from asyncgrpo.rollout.first_failure import FirstFailure
from asyncgrpo.sync import StateSignal


def test_wait_for_returns_at_once_when_the_predicate_already_holds():
    async def main():
        signal = StateSignal()
        await asyncio.wait_for(signal.wait_for(lambda: True), timeout=1)

    asyncio.run(main())


def lost_wakeups(make_signal) -> list[tuple[int, int]]:
    """Every interleaving (within a few loop passes) in which a waiter misses a change that was notified.

    Waiter A waits for `a`, waiter B for `b`; `a` changes (and is notified) after `k_a` passes of the loop,
    `b` after `k_b` more. Whatever an implementation does between checking its predicate and going to
    sleep (an Event checked, then cleared after an await), some (k_a, k_b) puts a change into that gap.
    On virtual time, a waiter that is never woken surfaces as a timeout at once, not as a hang.
    """

    async def one(k_a: int, k_b: int) -> bool:
        signal, state = make_signal(), {"a": False, "b": False}
        waiters = [
            asyncio.create_task(signal.wait_for(lambda: state["a"])),
            asyncio.create_task(signal.wait_for(lambda: state["b"])),
        ]
        for key, passes in (("a", k_a), ("b", k_b)):
            for _ in range(passes):
                await asyncio.sleep(0)
            state[key] = True
            signal.notify()
        try:
            async with asyncio.timeout(60):
                await asyncio.gather(*waiters)
        except TimeoutError:
            for waiter in waiters:
                waiter.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)
            return True
        return False

    return [(k_a, k_b) for k_a in range(5) for k_b in range(5) if run_virtual(one(k_a, k_b))]


class EventCheckedThenCleared:
    """The bug class StateSignal exists to prevent: the predicate is checked, the task yields (any await), and
    only then is the event cleared and waited on, so a notify inside that window is erased."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()

    async def wait_for(self, predicate) -> None:
        while not predicate():
            await asyncio.sleep(0)
            self._event.clear()
            await self._event.wait()


def test_a_change_made_before_the_waiter_sleeps_is_seen():
    # The harness finds the lost wake-up of an Event checked then cleared ...
    assert lost_wakeups(EventCheckedThenCleared)
    # ... and StateSignal loses none, whichever pass of the loop the changes land in.
    assert lost_wakeups(StateSignal) == []


def test_notify_wakes_every_waiter_and_cancelled_waiters_are_forgotten():
    async def main():
        signal, state = StateSignal(), {"n": 0}
        waiters = [asyncio.create_task(signal.wait_for(lambda i=i: state["n"] > i)) for i in range(3)]
        doomed = asyncio.create_task(signal.wait_for(lambda: False))
        await asyncio.sleep(0)
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        state["n"] = 3
        signal.notify()
        await asyncio.wait_for(asyncio.gather(*waiters), timeout=1)
        assert signal._waiters == []

    asyncio.run(main())


def test_health_is_sticky_and_raises_a_fresh_chained_exception_each_call():
    first, second = RuntimeError("first"), RuntimeError("second")
    health = FirstFailure()
    health.check()  # healthy: no error
    assert health.fail(Diagnostic(kind="generation_failures", message="m1", original=first))
    assert not health.fail(Diagnostic(kind="drop_fraction", message="m2", original=second))
    raised = []
    for _ in range(2):
        with pytest.raises(PipelineError) as info:
            health.check()
        raised.append(info.value)
    assert raised[0] is not raised[1]
    assert all(e.__cause__ is first and e.diagnostic.message == "m1" for e in raised)


def test_a_stall_diagnostic_raises_stall_error():
    health = FirstFailure()
    health.fail(Diagnostic(kind="stall", message="stalled"))
    with pytest.raises(StallError):
        health.check()


def test_virtual_time_jumps_over_sleeps_and_timeouts():
    async def main():
        loop = asyncio.get_running_loop()
        await asyncio.sleep(3600)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(7200):
                await loop.create_future()
        return loop.time()

    wall = time.perf_counter()
    assert run_virtual(main()) == pytest.approx(3600 + 7200)
    assert time.perf_counter() - wall < 5


def test_a_timer_due_now_fires_however_far_the_virtual_clock_has_run():
    """Past 2**24 s, 1 ns added to the clock is lost to rounding: a timer due now must still fire (issue 20, item 19)."""
    loop = VirtualTimeLoop()
    try:
        loop.advance(2.0**25 + 0.5)
        fired = loop.create_future()
        loop.call_at(loop.time(), fired.set_result, "fired")
        loop.call_soon(loop.stop)
        loop.run_forever()  # one pass: the due timer and the stop run in it
        assert fired.done()
    finally:
        loop.close()


def test_a_wait_with_no_deadline_and_nothing_pending_is_reported_not_hung():
    async def main():
        await asyncio.get_running_loop().create_future()

    with pytest.raises(VirtualDeadlock):
        run_virtual(main())
