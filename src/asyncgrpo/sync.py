"""`StateSignal`: wait until a predicate over shared state holds, without losing a wake-up.

The pipeline's state (buffer, in-flight groups, versions, health) lives on one event loop
and is only ever changed by synchronous code between awaits. Waiters therefore need no
lock: `wait_for` checks the predicate and registers its waiter with no await in between,
so a `notify()` cannot slip through the gap (the lost wake-up of an Event that is checked
and then cleared). Unlike `asyncio.Condition`, `notify()` may be called from any
synchronous code on the loop, including `finally` blocks of cancelled tasks, which is
where slots and groups are released.

Every wait has a predicate; deadlines are the caller's (`asyncio.timeout`), or the
lifetime of the owning task group.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class StateSignal:
    def __init__(self) -> None:
        self._waiters: list[asyncio.Future[None]] = []

    def notify(self) -> None:
        """Wake every waiter so it re-checks its predicate."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

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
