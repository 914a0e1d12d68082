"""`abandonable(fn)`: run a blocking call on a daemon thread of its own and await its result; give up on it at will.

Job: a collective (a process-group rendezvous, a broadcast) blocks its thread until every rank took part.
When a peer hangs or dies, the caller must be able to stop waiting at its deadline, which neither
`asyncio.to_thread` (its executor's threads are joined at interpreter exit, and a few blocked calls exhaust
the pool) nor a cancelled future of it allow. Here cancelling the awaiting task (its `asyncio.timeout`)
returns at once; the thread is left to finish on its own (the transport's own timeout ends it,
collective_group.py), its result is discarded, and it never keeps the interpreter from exiting.

Invariant: the result (or exception) reaches the loop only through `call_soon_threadsafe`, and only while
the loop runs and the awaiting future is not done; a thread that finishes after being abandoned, or after
the loop closed, changes nothing.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def _settle(future: asyncio.Future[T], result: T | None, error: BaseException | None) -> None:
    if future.done():  # abandoned (cancelled) meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)  # type: ignore[arg-type]


async def abandonable(fn: Callable[[], T], *, name: str) -> T:
    """`fn()` on a new daemon thread called `name`; cancelling this await abandons the thread (see module docstring)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def target() -> None:
        result: T | None = None
        error: BaseException | None = None
        try:
            result = fn()
        except BaseException as exc:  # handed to the awaiting task, which decides
            error = exc
        try:
            loop.call_soon_threadsafe(_settle, future, result, error)
        except RuntimeError:  # the loop closed: nobody waits for this result any more
            pass

    threading.Thread(target=target, name=name, daemon=True).start()
    return await future
