"""`ThreadHost`: one episode's environment in this process, its sync calls on threads the host owns.

Job: run the protocol's calls (environments/protocol.py) for one episode and stop them on `cancel`.
- The factory and every sync method run on a daemon thread started for the call (never on the
  event loop, never on a shared executor, so a call that will not return starves nothing and
  does not keep the process from exiting); async methods are awaited on the loop, so cancelling
  the awaiting task stops them.
- `reset` and `step` receive the episode's `CancelToken` as `token=` when they declare it.
- `cancel(grace_s)` sets the token, calls the environment's `close()` from another thread (while
  `step` may still run: the protocol asks close to interrupt it), and waits up to `grace_s` for
  every call the host started to return. True: nothing of the environment runs any more. False:
  a call is still running; Python cannot stop a thread, so it is abandoned, and the caller counts
  and logs it (`env/abandoned_total`). What that `close()` raises is kept in `close_error` (never
  left in a future nobody reads), for the caller to count and log.
- Processes the environment starts are its own: a thread has no process group to kill, so
  `close()` must end them (env.isolation: process kills the worker's whole group).

Invariants: `close()` reaches the environment at most once; the host knows at every moment which
of its calls still run (`running`), whether or not their caller still waits for them; a result
that arrives for a caller that gave up, or after the loop closed, is dropped.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Mapping
from typing import Any

from asyncgrpo.environments.factories import load_factory
from asyncgrpo.environments.protocol import CancelToken, Message, StepResult, as_messages, as_step_result


class _Call:
    """One sync call on its own thread: `result` for the caller, `finished` for whoever waits for the work to end."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fn: Callable[[], Any], name: str) -> None:
        self.result: asyncio.Future[Any] = loop.create_future()
        self.finished: asyncio.Future[None] = loop.create_future()
        self._loop = loop
        self._fn = fn
        self.thread = threading.Thread(target=self._target, name=name, daemon=True)

    def _target(self) -> None:
        try:
            value, error = self._fn(), None
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task, which re-raises it
            value, error = None, exc
        try:
            self._loop.call_soon_threadsafe(self._settle, value, error)
        except RuntimeError:  # the loop is closed: nobody waits for this any more
            pass

    def _settle(self, value: Any, error: BaseException | None) -> None:
        if not self.finished.done():
            self.finished.set_result(None)
        if self.result.done():  # the caller gave up (cancelled)
            return
        if error is not None:
            self.result.set_exception(error)
        else:
            self.result.set_result(value)


def takes_token(method: Callable[..., Any]) -> bool:
    """Whether `method` declares a parameter named `token`."""
    try:
        parameters = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False
    return "token" in parameters


class ThreadHost:
    """One episode of the environment `factory_spec` makes (see the module docstring)."""

    def __init__(self, factory_spec: str, observation_role: str) -> None:
        self.name = factory_spec
        self._factory = load_factory(factory_spec)
        self._role = observation_role
        self._token = CancelToken()
        self._env: Any = None
        self._closing = False
        self._running: set[_Call] = set()
        self.close_error: BaseException | None = None

    @property
    def running(self) -> int:
        """Calls of this host still running on their threads (whether or not anyone awaits them)."""
        return sum(not call.finished.done() for call in self._running)

    async def reset(self, row: Mapping[str, Any]) -> tuple[Message, ...]:
        env = await self._invoke(self._make, (), "factory", token=False)
        for method in ("reset", "step", "close"):
            if not callable(getattr(env, method, None)):
                raise TypeError(
                    f"env.factory = {self.name!r} made a {type(env).__name__} without a {method}() method; an environment "
                    f"has reset(row), step(action_text) and close() (docs/environments.md)"
                )
        observation = await self._invoke(env.reset, (row,), "reset")
        return as_messages(observation, self._role, source=f"{type(env).__name__}.reset")

    def _make(self) -> Any:
        """Call the factory (on the call's thread) and keep what it made, so a cancel that comes meanwhile can close it."""
        env = self._factory()
        self._env = env
        return env

    async def step(self, action_text: str) -> StepResult:
        value = await self._invoke(self._env.step, (action_text,), "step")
        return as_step_result(value, self._role, source=f"{type(self._env).__name__}.step")

    async def close(self) -> None:
        """Close the environment (once; later calls do nothing)."""
        if self._env is None or self._closing:
            return
        self._closing = True
        await self._invoke(self._env.close, (), "close", token=False)

    async def cancel(self, grace_s: float) -> bool:
        """Stop the episode: token, close() from elsewhere, up to `grace_s` for every call to return (see the module docstring)."""
        self._token.cancel()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        close_started = False
        while True:
            if not close_started and self._env is not None and not self._closing:
                close_started = True
                self._closing = True
                close = getattr(self._env, "close", None)
                if inspect.iscoroutinefunction(close):
                    try:
                        async with asyncio.timeout_at(deadline):
                            await close()
                    except TimeoutError:
                        return False
                    except asyncio.CancelledError:
                        raise
                    except BaseException as exc:  # noqa: BLE001 - user code; the episode is over, the caller reports it
                        self.close_error = exc
                elif callable(close):
                    self._start(loop, close, "close").result.add_done_callback(self._keep_close_error)
            pending = [call.finished for call in self._running if not call.finished.done()]
            if not pending:
                return True
            await asyncio.wait(pending, timeout=max(0.0, deadline - loop.time()))
            if loop.time() >= deadline:
                return not any(not call.finished.done() for call in self._running)
            # A call returned before the deadline: the factory may have made an environment meanwhile; close it too.

    def _keep_close_error(self, result: asyncio.Future[Any]) -> None:
        if not result.cancelled() and (error := result.exception()) is not None:
            self.close_error = error

    async def _invoke(self, method: Callable[..., Any], args: tuple[Any, ...], what: str, *, token: bool = True) -> Any:
        kwargs = {"token": self._token} if token and takes_token(method) else {}
        if inspect.iscoroutinefunction(method):
            return await method(*args, **kwargs)
        call = self._start(asyncio.get_running_loop(), lambda: method(*args, **kwargs), what)
        result = await call.result
        if inspect.isawaitable(result):
            result = await result
        return result

    def _start(self, loop: asyncio.AbstractEventLoop, fn: Callable[[], Any], what: str) -> _Call:
        call = _Call(loop, fn, f"asyncgrpo-env-{what}")
        self._running.add(call)
        call.finished.add_done_callback(lambda _: self._running.discard(call))
        call.thread.start()
        return call
