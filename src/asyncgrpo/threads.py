"""Blocking calls awaited from the event loop, on daemon threads: one started per call, or a reusable pool.

For work that may never return (a user's sync reward function stuck in a regex, a blocking
judge): a thread cannot be killed, so the caller's deadline abandons it, and because it is a
daemon thread and belongs to no executor, an abandoned call can neither starve later calls
of workers nor keep the process from exiting (the loop's default executor would do both:
asyncio.run joins it at exit, without a timeout on Python 3.11).

`run_in_daemon_thread` starts a thread per call (for rare calls). `DaemonThreadPool` keeps up
to `size` daemon threads and reuses them (for calls on every group: starting a thread per call
cost about a tenth of the event loop's CPU), with the same two guarantees:
- At most `size` threads are owned by the pool. A call takes an idle one, or starts one while
  fewer than `size` exist, or waits (`StateSignal.wait_for`) until one is handed back; that wait
  is bounded by the calls ahead of it, each bounded by its caller's deadline, and is not part
  of the caller's deadline.
- A thread goes back to the pool only after a call it finished. A thread whose call the caller
  abandoned (cancelled, timed out) is written off at once: the pool forgets it, so a later call
  gets a new thread, and the abandoned one exits by itself if its call ever returns. Pool
  threads are daemons: none, idle or stuck, keeps the process from exiting.
- `close` ends the idle threads and waits for them to exit (bounded by `CLOSE_JOIN_S` each:
  an idle thread exits at once), writes off the busy ones, and later calls raise `PoolClosed`.
  A pool that is never closed ends its idle threads when it is garbage-collected.

The result comes back with `call_soon_threadsafe`; a result for a caller that gave up, or
for a loop that is already closed, is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from asyncgrpo.sync import StateSignal

T = TypeVar("T")
CLOSE_JOIN_S = 1.0
_Job = tuple[Callable[[], Any], asyncio.AbstractEventLoop, "asyncio.Future[Any]"]


class PoolClosed(RuntimeError):
    """A call on a `DaemonThreadPool` that was closed (the run is ending)."""


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _run_and_report(call: Callable[[], Any], loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any]) -> None:
    """Run `call` on this thread and hand its result or exception to `future` on `loop`."""
    try:
        result, error = call(), None
    except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task, which re-raises it
        result, error = None, exc
    try:
        loop.call_soon_threadsafe(_settle, future, result, error)
    except RuntimeError:  # the loop is closed: nobody waits for this any more
        pass


async def run_in_daemon_thread(call: Callable[[], T], *, name: str) -> T:
    """Run `call()` on a new daemon thread named `name` and await its result or exception."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    threading.Thread(target=_run_and_report, args=(call, loop, future), name=name, daemon=True).start()
    return await future


def _serve(jobs: queue.SimpleQueue[_Job | None]) -> None:
    """A pool thread's life: run the jobs it is handed, one at a time, until it is handed None."""
    while (job := jobs.get()) is not None:
        _run_and_report(*job)
        del job  # drop the call's references while idle


class _PoolThread:
    def __init__(self, name: str) -> None:
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.reusable = True  # false from a call's start until that call's result is back
        self.thread = threading.Thread(target=_serve, args=(self.jobs,), name=name, daemon=True)
        self.thread.start()

    async def call(self, call: Callable[[], T]) -> T:
        """Run `call()` on this thread and await its result or exception."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self.reusable = False
        self.jobs.put((call, loop, future))
        try:
            return await future
        finally:
            self.reusable = future.done() and not future.cancelled()  # cancelled: the caller gave up on a running call

    def end(self) -> None:
        """Exit once the current call, if any, returns (at once when idle)."""
        self.jobs.put(None)


def _end_all(threads: list[_PoolThread]) -> None:
    for thread in threads:
        thread.end()
    threads.clear()


class DaemonThreadPool:
    """Up to `size` reusable daemon threads named `name`-N, each running one blocking call at a time."""

    def __init__(self, size: int, *, name: str) -> None:
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        self.size = size
        self.name = name
        self._idle: list[_PoolThread] = []
        self._count = 0  # threads owned: idle or running a call nobody abandoned
        self._started = 0
        self._signal = StateSignal()
        self._closed = False
        self._finalizer = weakref.finalize(self, _end_all, self._idle)

    @property
    def owned(self) -> int:
        """Threads the pool owns (idle or busy); written-off ones are not counted."""
        return self._count

    @contextlib.asynccontextmanager
    async def worker(self) -> AsyncIterator[_PoolThread]:
        """A thread for one call; on exit it goes back to the pool, or is written off if its call did not finish."""
        await self._signal.wait_for(lambda: self._closed or bool(self._idle) or self._count < self.size)
        if self._closed:
            raise PoolClosed(f"the thread pool {self.name!r} is closed (the run is ending)")
        if self._idle:
            thread = self._idle.pop()
        else:
            self._started += 1
            thread = _PoolThread(f"{self.name}-{self._started}")
            self._count += 1
        try:
            yield thread
        finally:
            if thread.reusable and not self._closed:
                self._idle.append(thread)
            else:
                self._count -= 1
                thread.end()
            self._signal.notify()

    def close(self) -> None:
        """End the idle threads (they are gone on return); busy ones end when their call returns. Later calls raise `PoolClosed`."""
        self._closed = True
        self._count -= len(self._idle)
        idle = [t.thread for t in self._idle]
        _end_all(self._idle)
        for thread in idle:
            thread.join(CLOSE_JOIN_S)  # idle: it exits as soon as it reads the end
        self._signal.notify()
