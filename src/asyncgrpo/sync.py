"""`StateSignal` and `TurnSignal`: wait until a predicate over shared state holds, without losing a wake-up.

The pipeline's state (buffer, in-flight groups, versions, health) lives on one event loop
and is only ever changed by synchronous code between awaits. Waiters therefore need no
lock: `wait_for` checks the predicate and registers its waiter with no await in between,
so a `notify()` cannot slip through the gap (the lost wake-up of an Event that is checked
and then cleared). Unlike `asyncio.Condition`, `notify()` may be called from any
synchronous code on the loop, including `finally` blocks of cancelled tasks, which is
where slots and groups are released.

`StateSignal.notify()` wakes every waiter (O(waiters)): for the few waiters of different
predicates (a dispatcher, a trainer). A signal made with `also=` another notifies that one too:
the changes it announces concern the other's waiters as well, while the other's own `notify()`
(a change that concerns only its waiters) leaves this one's asleep. `TurnSignal.notify_one()` wakes one, O(1): for many waiters
of the same predicate over a counted resource (request slots), where one unit freed can satisfy
only one of them. Its rule against lost wake-ups: the notifier calls `notify_one()` once per unit
that became free, so while anyone waits, every free unit has a wake-up on its way to a waiter;
a woken waiter that finds the unit taken (another caller took it without waiting) goes back to
the front of the queue, the taker's own release will wake it; one cancelled after its wake-up
hands that wake-up on to the next waiter.

Every wait has a predicate; deadlines are the caller's (`asyncio.timeout`), or the
lifetime of the owning task group.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable


class StateSignal:
    def __init__(self, also: StateSignal | None = None) -> None:
        """`also`: a signal whose waiters every `notify()` of this one wakes as well."""
        self._waiters: list[asyncio.Future[None]] = []
        self._also = also

    def notify(self) -> None:
        """Wake every waiter (and every waiter of `also`) so it re-checks its predicate."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
        if self._also is not None:
            self._also.notify()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Return once `predicate()` is true (checked now and after every notify)."""
        loop = asyncio.get_running_loop()
        while not predicate():
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if not waiter.done():
                    waiter.cancel()
                    self._waiters.remove(waiter)


class TurnSignal:
    """Waiters of one predicate, woken one at a time in arrival order (see the module docstring)."""

    def __init__(self) -> None:
        self._waiters: deque[asyncio.Future[None]] = deque()  # cancelled ones stay until `notify_one` passes them

    def notify_one(self) -> None:
        """Wake the longest-waiting live waiter, if any: O(1) amortized (each waiter is passed at most once)."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Return once `predicate()` is true: checked now and whenever a `notify_one()` reaches this waiter."""
        loop = asyncio.get_running_loop()
        first = True
        while not predicate():
            waiter: asyncio.Future[None] = loop.create_future()
            if first:
                self._waiters.append(waiter)
            else:  # woken, but the unit was taken meanwhile: keep its place at the front
                self._waiters.appendleft(waiter)
            first = False
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self.notify_one()  # woken, then cancelled before it could act: the wake-up goes on
                raise
