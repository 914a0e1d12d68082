"""Request slots (rollout/slots.py): acquire and release stay in step, whatever ends the holder."""

from __future__ import annotations

import asyncio

import pytest

from asyncgrpo.rollout.slots import RequestSlots
from asyncgrpo.sync import StateSignal


def test_a_slot_is_given_back_once_however_often_it_is_released():
    async def main():
        slots = RequestSlots(2, StateSignal())
        slot = await slots.acquire()
        with slot:
            assert slots.open == 1 and slots.free == 1
        slot.release()
        assert slots.open == 0 and not slot.held

    asyncio.run(main())


def test_acquire_waits_for_a_release():
    async def main():
        slots = RequestSlots(1, StateSignal())
        first = await slots.acquire()
        waiter = asyncio.create_task(slots.acquire())
        await asyncio.sleep(0)
        assert not waiter.done()
        first.release()
        second = await waiter
        assert slots.open == 1 and second.held

    asyncio.run(main())


def test_each_acquire_holds_one_more_slot_up_to_the_limit():
    async def main():
        slots = RequestSlots(3, StateSignal())
        held = [await slots.acquire() for _ in range(3)]
        assert slots.open == 3 and slots.free == 0
        held[0].release()
        assert slots.open == 2

    asyncio.run(main())


def test_waiting_to_retry_needs_a_held_slot():
    async def main():
        slots = RequestSlots(1, StateSignal())
        slot = await slots.acquire()
        slot.release()
        with pytest.raises(AssertionError, match=r"^released_for\(\) on a slot that is not held$"):
            await slot.released_for(0.0)

    asyncio.run(main())


def test_a_task_cancelled_before_it_ran_gives_its_slot_back():
    async def main():
        slots = RequestSlots(1, StateSignal())
        slot = await slots.acquire()

        async def rollout():
            with slot:
                await asyncio.sleep(1)

        task = asyncio.create_task(rollout())
        slot.release_with(task)
        task.cancel()  # before its first step: its `with` never runs
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)  # done callbacks run on the next loop iteration
        assert slots.open == 0

    asyncio.run(main())


def test_waiting_to_retry_holds_no_slot_and_takes_one_again():
    async def main():
        slots = RequestSlots(1, StateSignal())
        slot = await slots.acquire()
        retrying = asyncio.create_task(slot.released_for(0.01))
        other = await slots.acquire()  # the slot serves another rollout meanwhile
        assert slots.open == 1 and not slot.held
        await asyncio.sleep(0.02)
        assert not retrying.done()  # its wait is over, but no slot is free
        other.release()
        await retrying
        assert slot.held and slots.open == 1

    asyncio.run(main())


def test_cancelled_while_waiting_to_retry_it_holds_nothing_to_give_back():
    async def main():
        slots = RequestSlots(1, StateSignal())
        slot = await slots.acquire()
        with slot:
            retrying = asyncio.create_task(slot.released_for(10))
            await asyncio.sleep(0)
            retrying.cancel()
            await asyncio.gather(retrying, return_exceptions=True)
        assert slots.open == 0 and not slot.held

    asyncio.run(main())


def test_a_slot_given_back_before_its_task_ends_leaves_that_end_no_callback():
    # Every rollout leaves its `with slot:` before its task ends: the release callback would be one loop callback per
    # rollout that finds nothing to give back.
    async def main():
        slots = RequestSlots(1, StateSignal())
        slot = await slots.acquire()
        left: list[int] = []

        async def rollout():
            with slot:
                await asyncio.sleep(0)
            task = asyncio.current_task()
            assert task is not None
            left.append(task.remove_done_callback(slot._release_when_done))

        task = asyncio.create_task(rollout())
        slot.release_with(task)
        await task
        assert left == [0] and slots.open == 0

    asyncio.run(main())
