"""A virtual-time asyncio event loop: the simulator's clock.

The loop's `time()` is a virtual clock that starts at 0. Whenever no callback is ready,
instead of sleeping until the next timer the loop jumps its clock to that timer, so a run
that spans hours of `asyncio.sleep`, `asyncio.timeout` and `call_later` takes milliseconds
of wall time. Real file descriptors are still polled (without blocking), so signals and
`call_soon_threadsafe` keep working.

Invariants:
- Deterministic: with no threads and no real I/O, the same program runs the same way.
- A program in which every task waits with no timer pending can never wake up; the loop
  raises `VirtualDeadlock` at once instead of hanging, naming that state. In the pipeline
  that is always a bug (every wait has a deadline).
- A timer that is due always fires, however large the clock: asyncio runs the timers due
  before `time() + _clock_resolution`, and beyond 2**24 s (194 days) adding the monotonic
  clock's 1 ns to a float clock changes nothing, so a timer due exactly now would never fire
  and the loop would spin without advancing (`simulate` with `simulate.step_time_s=1e6`). The
  virtual clock's resolution is therefore at least one unit in the last place of its value.
"""

from __future__ import annotations

import asyncio
import math
import selectors
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class VirtualDeadlock(RuntimeError):
    """Every task is blocked and no timer is pending: nothing can ever happen again."""


class _JumpingSelector(selectors.DefaultSelector):
    """A selector that never blocks: it polls, and advances the loop's clock by the timeout instead of sleeping."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None):
        events = super().select(0)
        if events or timeout == 0:
            return events
        if timeout is None:
            raise VirtualDeadlock(
                "virtual-time deadlock: every task is waiting and no timer is pending, so nothing can wake them "
                "(a wait without a deadline)"
            )
        self._loop.advance(timeout)
        return events


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._now = 0.0
        super().__init__(selector=_JumpingSelector(self))

    def time(self) -> float:
        return self._now

    @property
    def _clock_resolution(self) -> float:
        """How close a timer must be to now to run now: 1 ns, or the clock's own step once 1 ns is below it."""
        return max(1e-9, math.ulp(self._now))

    @_clock_resolution.setter
    def _clock_resolution(self, value: float) -> None:
        """asyncio sets the wall clock's resolution at start-up; the virtual clock's follows its value instead."""

    def advance(self, seconds: float) -> None:
        self._now += max(seconds, 0.0)


def run_virtual(main: Awaitable[T]) -> T:
    """Run a coroutine to completion on a fresh virtual-time loop and close the loop."""
    loop = VirtualTimeLoop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        try:
            _cancel_leftovers(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _cancel_leftovers(loop: asyncio.AbstractEventLoop) -> None:
    leftovers = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in leftovers:
        task.cancel()
    if leftovers:
        loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
