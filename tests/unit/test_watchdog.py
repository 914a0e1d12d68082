"""LoopWatchdog: a blocked loop is reported once, naming what its thread is doing; a turning loop is not."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from asyncgrpo.commands.watchdog import LoopWatchdog

pytestmark = pytest.mark.timeout(30)


def test_an_async_function_calling_time_sleep_is_reported_once_with_its_function_and_file(caplog):
    async def reward_that_sleeps():
        time.sleep(1.5)  # blocks the loop: nothing else on it runs for 1.5 s

    # Reported at 1 s; the next report would be due at 2 s. Half a second of slack on each side, so neither a late
    # watchdog thread nor a loop slow to turn after the block (a loaded machine) changes the count.
    async def main():
        with LoopWatchdog(asyncio.get_running_loop(), threshold_s=1.0):
            await reward_that_sleeps()

    with caplog.at_level(logging.WARNING, logger="asyncgrpo"):
        asyncio.run(main())
    warnings = [r.getMessage() for r in caplog.records if "event loop has not turned" in r.getMessage()]
    assert len(warnings) == 1
    assert "test_watchdog.py" in warnings[0] and "reward_that_sleeps" in warnings[0] and "threshold 1 s" in warnings[0]


def test_a_block_that_lasts_is_reported_again_at_doubling_intervals_then_a_new_block_afresh():
    reports = []
    enough = threading.Event()

    def on_blocked(report):
        reports.append(report)
        if len(reports) in (3, 4):
            enough.set()

    def blocker():
        enough.wait(20)  # the loop is blocked until the watchdog has reported (no timing in the test)
        enough.clear()

    async def main():
        with LoopWatchdog(asyncio.get_running_loop(), threshold_s=0.1, on_blocked=on_blocked):
            blocker()  # three reports
            await asyncio.sleep(0.05)  # the loop turns
            blocker()  # a new block: reported from the threshold again

    asyncio.run(main())
    assert len(reports) == 4
    assert reports[1].blocked_s >= 2 * reports[0].blocked_s and reports[2].blocked_s >= 4 * reports[0].blocked_s
    assert 0.1 <= reports[3].blocked_s < reports[2].blocked_s
    assert all(r.frames and any("blocker" in f for f in r.frames) for r in reports)


def test_a_turning_loop_is_not_reported_and_the_thread_ends_with_the_block():
    reports = []

    async def main():
        with LoopWatchdog(asyncio.get_running_loop(), threshold_s=2.0, on_blocked=reports.append):
            for _ in range(30):
                await asyncio.sleep(0.01)
            assert any(t.name == "asyncgrpo-loop-watchdog" for t in threading.enumerate())

    asyncio.run(main())
    assert reports == []
    assert not any(t.name == "asyncgrpo-loop-watchdog" for t in threading.enumerate())


def test_threshold_must_be_positive():
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(ValueError, match="threshold_s must be positive"):
            LoopWatchdog(loop, threshold_s=0)
    finally:
        loop.close()
