"""`TurnSignal` (sync.py): one notify wakes one waiter, in arrival order, and no wake-up is lost. `StateSignal`: a notify
whose predicate is still false never steps the waiting task, and everything happens in the order a plain wake-up gives."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any

from asyncgrpo.rollout.slots import RequestSlots
from asyncgrpo.sync import StateSignal, TurnSignal


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_notify_one_makes_one_waiter_recheck_not_all():
    async def main():
        signal, free, checks = TurnSignal(), [0], [0]

        def take() -> bool:
            checks[0] += 1
            if free[0]:
                free[0] -= 1
                return True
            return False

        waiters = [asyncio.create_task(signal.wait_for(take)) for _ in range(10)]
        await settle()
        assert checks[0] == 10  # each checked once on arrival
        free[0] = 1
        signal.notify_one()
        await settle()
        assert checks[0] == 11 and [w.done() for w in waiters] == [True] + [False] * 9  # the first to arrive, alone
        for w in waiters:
            w.cancel()
        await settle()

    asyncio.run(main())


def test_a_waiter_woken_then_cancelled_hands_its_wake_up_on():
    async def main():
        slots = RequestSlots(1, StateSignal())
        held = await slots.acquire()
        first = asyncio.create_task(slots.acquire())
        second = asyncio.create_task(slots.acquire())
        await settle()
        held.release()  # wakes `first` ...
        first.cancel()  # ... which is cancelled before it runs: `second` must get the slot
        await settle()
        assert first.cancelled() and second.done() and slots.open == 1

    asyncio.run(main())


def test_a_woken_waiter_that_finds_the_slot_taken_keeps_its_place():
    async def main():
        slots = RequestSlots(1, StateSignal())
        held = await slots.acquire()
        first = asyncio.create_task(slots.acquire())
        second = asyncio.create_task(slots.acquire())
        await settle()
        held.release()  # wakes `first`, but a caller that does not wait takes the slot before it runs
        barger = await slots.acquire()
        await settle()
        assert not first.done() and not second.done()
        barger.release()
        await settle()
        assert first.done() and not second.done()
        (await first).release()
        await settle()
        assert second.done()

    asyncio.run(main())


class CountedSteps(Coroutine[Any, Any, None]):
    """A coroutine that counts the steps its task runs (each `send` or `throw` is one step of the task)."""

    def __init__(self, coro: Coroutine[Any, Any, None]) -> None:
        self.coro, self.steps = coro, 0

    def send(self, value: Any) -> Any:
        self.steps += 1
        return self.coro.send(value)

    def throw(self, *exc: Any) -> Any:
        self.steps += 1
        return self.coro.throw(*exc)

    def close(self) -> None:
        self.coro.close()

    def __await__(self) -> Generator[Any, None, None]:
        return self.coro.__await__()


def test_a_notify_whose_predicate_is_false_does_not_step_the_waiting_task():
    async def main():
        signal, state, checks = StateSignal(), {"ready": False}, [0]

        def ready() -> bool:
            checks[0] += 1
            return state["ready"]

        counted = CountedSteps(signal.wait_for(ready))
        waiter = asyncio.ensure_future(counted)
        await settle()
        for _ in range(100):
            signal.notify()
            await settle()
        assert checks[0] == 101 and counted.steps == 1  # re-checked at every notify; the task ran once, to start waiting
        state["ready"] = True
        signal.notify()
        await settle()
        assert waiter.done() and counted.steps == 2

    asyncio.run(main())


def test_a_predicate_made_true_before_its_check_runs_proceeds_there_as_a_woken_task_would():
    # A plain wake-up runs the task where notify() queued it, and the task sees the state as it is then: here a change
    # queued before the notify. The waiter must proceed at that point, before a callback queued after the notify.
    async def main():
        signal, state, order = StateSignal(), {"ready": False}, []

        async def waiter() -> None:
            await signal.wait_for(lambda: state["ready"])
            order.append("waiter")

        task = asyncio.create_task(waiter())
        await settle()
        loop = asyncio.get_running_loop()
        loop.call_soon(state.update, {"ready": True})
        signal.notify()
        loop.call_soon(order.append, "after")
        await settle()
        assert task.done() and order == ["waiter", "after"]

    asyncio.run(main())


def test_a_waiter_cancelled_while_registered_or_while_its_check_is_queued_ends_cancelled_and_leaves():
    async def main():
        signal = StateSignal()
        registered = asyncio.create_task(signal.wait_for(lambda: False))
        checking = asyncio.create_task(signal.wait_for(lambda: False))
        await settle()
        registered.cancel()
        signal.notify()  # queues a check for each
        checking.cancel()  # before its check runs: the check delivers the cancellation
        await settle()
        assert registered.cancelled() and checking.cancelled()
        signal.notify()
        await settle()
        assert signal._waiters == []

    asyncio.run(main())


def test_a_predicate_that_raises_when_rechecked_raises_out_of_wait_for():
    """The check runs outside the task: its error must still reach the waiter (not the loop's exception handler)."""
    signal = StateSignal()
    state = {"calls": 0}

    def predicate() -> bool:
        state["calls"] += 1
        if state["calls"] == 2:
            raise LookupError("the generator's version is gone")
        return False

    async def main() -> BaseException | None:
        waiter = asyncio.create_task(signal.wait_for(predicate))
        await asyncio.sleep(0)
        signal.notify()
        try:
            async with asyncio.timeout(5):
                await waiter
        except LookupError as error:
            return error
        return None

    error = asyncio.run(main())
    assert isinstance(error, LookupError) and "version is gone" in str(error)
