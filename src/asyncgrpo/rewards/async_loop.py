"""`async def` reward functions on an event loop of their own, on a daemon thread.

Job: keep an async reward function off the pipeline's event loop. A coroutine that blocks its
loop (a `time.sleep`, a CPU-bound loop, a sync client inside `async def`) would otherwise stop
generation and training with it, and `reward.timeout_s` could never fire: the deadline's timer
runs on the loop it blocks. Here the caller's deadline runs on the pipeline's loop, which stays
free, and a blocked reward loop holds up only the calls on it.

Invariants:
- One reward loop serves every async call of a scorer, concurrently (as the pipeline's loop
  did), so an object a function binds to its loop (an HTTP client made in a first call) stays
  usable from call to call.
- A call whose caller's deadline expired is cancelled on its loop and that loop is written off:
  later calls get a fresh loop, so a loop blocked for good delays nothing after it. A written-off
  loop stops by itself once its last call has ended; one that never ends is abandoned on its
  daemon thread, which keeps nothing from exiting. A caller cancelled for another reason (its
  group went stale) cancels its call and keeps the loop.
- `close` stops the current loop and waits for its thread (bounded by `CLOSE_JOIN_S`); a call
  after `close` raises `PoolClosed`. The loop is started at the first call, never before.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from collections.abc import Callable
from typing import Any

from asyncgrpo.threads import CLOSE_JOIN_S, PoolClosed


class _Raised(Exception):
    """Carries what a call raised out of the reward loop's task (SystemExit or KeyboardInterrupt raw would stop the loop)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(repr(error))
        self.error = error


class _RewardLoop:
    """One event loop running on its own daemon thread, with a count of the calls it has not finished."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._lock = threading.Lock()
        self._calls = 0
        self._retired = False
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            leftovers = asyncio.all_tasks(self.loop)  # calls still running at close: cancelled, given a moment to unwind
            for task in leftovers:
                task.cancel()
            if leftovers:
                self.loop.run_until_complete(asyncio.wait(leftovers, timeout=CLOSE_JOIN_S))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def submit(self, fn: Callable[..., Any], kwargs: dict[str, Any]) -> concurrent.futures.Future[Any]:
        with self._lock:
            self._calls += 1
        return asyncio.run_coroutine_threadsafe(self._run(fn, kwargs), self.loop)

    async def _run(self, fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
        try:
            result = fn(**kwargs)
            return await result if inspect.isawaitable(result) else result
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, who reports it
            raise _Raised(exc) from None
        finally:
            with self._lock:
                self._calls -= 1
                last = self._retired and self._calls == 0
            if last:  # stop after this call's result has gone to its caller (the next round of callbacks)
                self.loop.call_soon(self.loop.stop)

    def retire(self) -> None:
        """No new calls; the loop stops once its last call has ended (at once if it has none)."""
        with self._lock:
            self._retired = True
            idle = self._calls == 0
        if idle:
            self.stop()

    def stop(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:  # already closed
            pass


class AsyncRewardLoop:
    """The reward loop of one scorer (see the module docstring)."""

    def __init__(self, name: str = "asyncgrpo-reward-loop") -> None:
        self._name = name
        self._current: _RewardLoop | None = None
        self._closed = False

    async def call(self, fn: Callable[..., Any], kwargs: dict[str, Any], deadline: asyncio.Timeout) -> Any:
        """`fn(**kwargs)` awaited on the reward loop; `deadline` is the caller's, around this call (its expiry writes the loop off)."""
        if self._closed:
            raise PoolClosed("the async reward loop is closed (the run is ending)")
        if self._current is None:
            self._current = _RewardLoop(self._name)
        reward_loop = self._current
        future = reward_loop.submit(fn, kwargs)
        try:
            return await asyncio.wrap_future(future)  # cancelling this cancels the call on its loop
        except _Raised as raised:
            raise raised.error from None
        except asyncio.CancelledError:
            if deadline.expired():  # the call outlived its deadline: its loop may be blocked
                if self._current is reward_loop:
                    self._current = None
                reward_loop.retire()
            raise

    def close(self) -> None:
        """Stop the current loop and wait for its thread (bounded); later calls raise `PoolClosed`."""
        self._closed = True
        reward_loop, self._current = self._current, None
        if reward_loop is not None:
            reward_loop.stop()
            reward_loop.thread.join(CLOSE_JOIN_S)
