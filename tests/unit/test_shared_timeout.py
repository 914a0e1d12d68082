"""SharedTimeout: asyncio.timeout's semantics for many timeouts of one duration, on one loop timer, in bounded memory."""

from __future__ import annotations

import asyncio
import random

import pytest

from asyncgrpo.commands.vtime import run_virtual
from asyncgrpo.config import GenerationConfig
from asyncgrpo.errors import RolloutDeadlineError
from asyncgrpo.rollout.retry import generate_with_retries
from asyncgrpo.sync import COMPACT_AT, SharedTimeout
from asyncgrpo.types import Completion, GenerationRequest, SamplingParams


def test_a_block_past_its_duration_raises_timeout_error_after_the_deadline() -> None:
    async def main() -> None:
        shared = SharedTimeout(0.01)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(TimeoutError):
            async with shared.timeout() as timeout:
                await loop.create_future()
        assert timeout.expired()
        assert loop.time() >= started + 0.01
        assert shared.queued == 0 and shared._timer is None

    asyncio.run(main())


def test_a_block_left_in_time_is_not_cancelled_and_disarms_the_timer() -> None:
    async def main() -> None:
        shared = SharedTimeout(60.0)
        async with shared.timeout() as timeout:
            await asyncio.sleep(0)
        assert not timeout.expired()
        assert shared.queued == 0 and shared._timer is None
        await asyncio.sleep(0)  # the task is not cancelled later either

    asyncio.run(main())


def test_a_cancellation_from_elsewhere_stays_a_cancellation() -> None:
    async def main() -> None:
        shared = SharedTimeout(60.0)

        async def body() -> None:
            async with shared.timeout():
                await asyncio.get_running_loop().create_future()

        task = asyncio.create_task(body())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert shared.queued == 0

    asyncio.run(main())


def test_timeouts_expire_in_entry_order_each_at_its_own_deadline() -> None:
    async def main() -> None:
        shared = SharedTimeout(0.05)
        loop = asyncio.get_running_loop()
        ended: dict[str, float] = {}

        async def body(name: str) -> None:
            entered = loop.time()
            try:
                async with shared.timeout():
                    await loop.create_future()
            except TimeoutError:
                ended[name] = loop.time() - entered

        first = asyncio.create_task(body("first"))
        await asyncio.sleep(0.02)
        second = asyncio.create_task(body("second"))
        await asyncio.gather(first, second)
        assert list(ended) == ["first", "second"]
        assert all(waited >= 0.05 for waited in ended.values())

    asyncio.run(main())


def test_the_queue_stays_bounded_while_one_timeout_stays_open() -> None:
    async def main() -> None:
        shared = SharedTimeout(60.0)
        opened = asyncio.Event()
        release = asyncio.Event()

        async def long() -> None:
            async with shared.timeout():
                opened.set()
                await release.wait()

        holder = asyncio.create_task(long())
        await opened.wait()
        most = 0
        for _ in range(10 * COMPACT_AT):
            async with shared.timeout():
                most = max(most, shared.queued)
        assert most <= 2 * 2 + COMPACT_AT + 1
        release.set()
        await holder
        assert shared.queued == 0 and shared._timer is None

    asyncio.run(main())


def test_a_duration_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^SharedTimeout needs a duration > 0 s, got 0$"):
        SharedTimeout(0)


class _Hung:
    name = "hung"

    def __init__(self) -> None:
        self.calls = 0

    async def generate(self, request: GenerationRequest) -> Completion:
        self.calls += 1
        await asyncio.get_running_loop().create_future()
        raise AssertionError("unreachable")


def test_retried_attempts_use_the_shared_timeouts_until_the_rollout_deadline_is_near() -> None:
    """Every attempt whose limit is the full request timeout waits on the shared timer; the last, cut short by
    the rollout deadline, gets its own, and the rollout still ends by its deadline."""
    g = GenerationConfig(request_timeout_s=2.0, rollout_deadline_s=5.0, retry_backoff_s=0.1, retry_backoff_max_s=0.1)
    request = GenerationRequest(request_id="r-0", prompt_id=0, prompt_token_ids=(1,), sampling=SamplingParams(max_new_tokens=4),
                                seed=1)

    async def main() -> None:
        shared = SharedTimeout(g.request_timeout_s)
        generator = _Hung()
        task = asyncio.create_task(generate_with_retries(generator, request, g, jitter=random.Random(0), timeouts=shared))
        await asyncio.sleep(0)
        assert shared.queued == 1  # the first attempt waits on the shared timer, not a timer of its own
        with pytest.raises(RolloutDeadlineError):
            await task
        assert generator.calls == 3 and shared.queued == 0  # at 0, ~2.1 (shared timer) and ~4.2 s (cut to the deadline)
        assert asyncio.get_running_loop().time() < 5.0 + 1e-6

    run_virtual(main())  # virtual time: the attempts' count does not depend on this machine's load
