"""`AttemptClock` / `AnswerMarks`: when an attempt past its budget is abandoned (on a real event loop).

No assertion is about speed: each test waits until the budget has certainly run (a sleep past it on the
same loop, whose timers fire in deadline order) and then checks which events abandon the attempt.
"""

from __future__ import annotations

import asyncio

from asyncgrpo.generation.attempt_clock import SETTLE_HOPS, AnswerMarks, AttemptClock

LONG_S = 600.0  # an overdue limit no test reaches


async def open_attempt(marks: AnswerMarks, clocks: list[AttemptClock], *, budget_s: float | None,
                       limit_s: float = LONG_S, frozen: bool = False, answer: asyncio.Future | None = None) -> str:
    """An attempt that ends when `answer` resolves (never, by default) or its clock abandons it."""
    try:
        async with asyncio.timeout(None) as timeout:
            clock = AttemptClock(timeout, marks, budget_s=budget_s, limit_s=limit_s, frozen=frozen)
            clocks.append(clock)
            return await (answer if answer is not None else asyncio.get_running_loop().create_future())
    except TimeoutError:
        return "abandoned"
    finally:
        clock.close()


async def started(clocks: list[AttemptClock], n: int) -> None:
    while len(clocks) < n:
        await asyncio.sleep(0)


def test_an_overdue_attempt_is_abandoned_only_once_a_newer_attempt_is_answered():
    async def main():
        marks, clocks = AnswerMarks(), []
        old = asyncio.create_task(open_attempt(marks, clocks, budget_s=0.01))
        await started(clocks, 1)
        earlier = marks.dispatch()  # dispatched before `old` went overdue (its mark is lower)
        await asyncio.sleep(0.05)  # past the budget: overdue
        assert clocks[0].overdue_mark is not None and not old.done()
        marks.answered(earlier)  # answered, but not newer than the moment `old` went overdue
        await asyncio.sleep(0)
        assert not old.done()
        newer = marks.dispatch()
        marks.answered(newer)
        assert await asyncio.wait_for(old, 10) == "abandoned" and clocks[0].overtaken
        assert not marks.overdue

    asyncio.run(main())


def test_an_overdue_attempt_whose_answer_is_read_in_the_same_burst_as_a_newer_one_is_kept():
    """After a pause of the process, answers arrive together: the newer one may be read a turn of the loop before
    the overdue attempt's own. The abandonment waits a few turns, so the answer already received is used."""
    async def main():
        marks, clocks = AnswerMarks(), []
        answer = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(open_attempt(marks, clocks, budget_s=0.01, answer=answer))
        await started(clocks, 1)
        await asyncio.sleep(0.05)  # overdue
        marks.answered(marks.dispatch())  # the newer answer is read first...
        for _ in range(SETTLE_HOPS // 2):
            await asyncio.sleep(0)
        answer.set_result("answered")  # ...and the overdue attempt's own a few turns later
        return await asyncio.wait_for(task, 10), clocks[0]

    result, clock = asyncio.run(main())
    assert result == "answered" and not clock.overtaken


def test_within_its_budget_an_attempt_is_never_abandoned_by_newer_answers():
    async def main():
        marks, clocks = AnswerMarks(), []
        task = asyncio.create_task(open_attempt(marks, clocks, budget_s=LONG_S))
        await started(clocks, 1)
        for _ in range(5):
            marks.answered(marks.dispatch())
        await asyncio.sleep(0.01)
        assert not task.done() and clocks[0].overdue_mark is None
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())


def test_an_overdue_attempt_that_nothing_overtakes_is_abandoned_at_its_limit():
    async def main():
        marks, clocks = AnswerMarks(), []
        result = await asyncio.wait_for(open_attempt(marks, clocks, budget_s=0.01, limit_s=0.04), 10)
        return result, clocks[0]

    result, clock = asyncio.run(main())
    assert result == "abandoned" and not clock.overtaken and clock.active_s() >= 0.04


def test_a_frozen_attempt_is_not_abandoned_and_resumes_its_clock_when_thawed():
    """Our weight install pauses the server: its held requests are not silent."""
    async def main():
        marks, clocks = AnswerMarks(), []
        task = asyncio.create_task(open_attempt(marks, clocks, budget_s=0.01, limit_s=0.05, frozen=True))
        await started(clocks, 1)
        clock = clocks[0]
        await asyncio.sleep(0.1)  # frozen: longer than its limit, yet neither overdue nor abandoned
        marks.answered(marks.dispatch())
        await asyncio.sleep(0)
        assert not task.done() and clock.overdue_mark is None and clock.active_s() == 0.0
        clock.thaw()
        await asyncio.sleep(0.03)  # past its budget now: overdue, and a newer answer abandons it
        assert clock.overdue_mark is not None and not task.done()
        clock.freeze()
        marks.answered(marks.dispatch())
        await asyncio.sleep(0)
        assert not task.done()  # frozen again: not abandoned even though overtaken
        clock.thaw()
        marks.answered(marks.dispatch())
        return await asyncio.wait_for(task, 10), clock

    result, clock = asyncio.run(main())
    assert result == "abandoned" and clock.overtaken


def test_an_attempt_without_a_budget_of_its_own_is_left_to_the_callers_deadline():
    async def main():
        marks, clocks = AnswerMarks(), []
        task = asyncio.create_task(open_attempt(marks, clocks, budget_s=None, limit_s=0.01))
        await started(clocks, 1)
        await asyncio.sleep(0.05)
        marks.answered(marks.dispatch())
        await asyncio.sleep(0)
        assert not task.done()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
