"""`TurnSignal` (sync.py): one notify wakes one waiter, in arrival order, and no wake-up is lost."""

from __future__ import annotations

import asyncio

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
