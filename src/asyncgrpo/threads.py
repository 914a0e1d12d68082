"""Blocking calls awaited from the event loop, on a daemon thread started for the call.

For work that may never return (a user's sync reward function stuck in a regex, a blocking
judge): a thread cannot be killed, so the caller's deadline abandons it, and because it is a
daemon thread and belongs to no executor, an abandoned call can neither starve later calls
of workers nor keep the process from exiting (the loop's default executor would do both:
asyncio.run joins it at exit, without a timeout on Python 3.11).

The result comes back with `call_soon_threadsafe`; a result for a caller that gave up, or
for a loop that is already closed, is dropped.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


async def run_in_daemon_thread(call: Callable[[], T], *, name: str) -> T:
    """Run `call()` on a new daemon thread named `name` and await its result or exception."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def target() -> None:
        try:
            result, error = call(), None
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task, which re-raises it
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(_settle, future, result, error)
        except RuntimeError:  # the loop is closed: nobody waits for this any more
            pass

    threading.Thread(target=target, name=name, daemon=True).start()
    return await future
