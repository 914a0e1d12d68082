"""`StateSignal` and `TurnSignal`: wait until a predicate over shared state holds, without losing a wake-up;
`SharedTimeout`: many timeouts of one duration on one loop timer.

The pipeline's state (buffer, in-flight groups, versions, health) lives on one event loop and is only ever
changed by synchronous code between awaits. Waiters therefore need no lock: `wait_for` checks the predicate
and registers its waiter with no await in between, so a `notify()` cannot slip through the gap (the lost
wake-up of an Event that is checked and then cleared). Unlike `asyncio.Condition`, `notify()` may be called
from any synchronous code on the loop, including `finally` blocks of cancelled tasks, which is where slots and
groups are released.

`StateSignal.notify()` has every waiter re-check its predicate (O(waiters)): for the few waiters of different
predicates (a dispatcher, a trainer). The check runs where the waiting task's wake-up would run and, true, runs
the task's step right there; false, it queues the waiter again without waking the task: the order of everything is
a plain wake-up's (the simulations train the same groups), while a false check, most of them (every
rollout's end notifies), costs one loop callback instead of a task step, a new future and the task's await chain.
`TurnSignal.notify_one()` wakes one, O(1): for many waiters of the same
predicate over a counted resource (request slots), where one unit freed can satisfy only one of them. Its rule
against lost wake-ups: the notifier calls `notify_one()` once per unit that became free, so while anyone
waits, every free unit has a wake-up on its way to a waiter; a woken waiter that finds the unit taken (another
caller took it without waiting) goes back to the front of the queue, the taker's own release will wake it; one
cancelled after its wake-up hands that wake-up on to the next waiter.

Every wait has a predicate; deadlines are the caller's (`asyncio.timeout`), or the lifetime of the owning task
group.

`SharedTimeout`: many timeouts of one fixed duration sharing one timer of the event loop. It bounds each of
many concurrent attempts by the same duration (a rollout's `generation.request_timeout_s`) without an
`asyncio.Timeout`, a timer handle and a heap entry per attempt. Since the duration is fixed and loop time
never goes back, deadlines arrive in the order the timeouts are entered: they queue in a deque, and one loop
timer is armed for the oldest live deadline. At 16,384 rollouts in flight this halves the loop's timer heap
(O(log n) Python-level comparisons per push and pop) and removes three objects per attempt.

Semantics are `asyncio.timeout(duration_s)`'s: `async with shared.timeout():` cancels the task that entered it
once the deadline passes and turns that cancellation into `TimeoutError` on exit; a cancellation from
elsewhere stays a `CancelledError`; leaving the block before the deadline disarms it.

Its invariants:
- Costs O(1) amortized per timeout: entering appends, the timer pops from the front; a timeout left early
  is popped when it reaches the front, and the queue is compacted once more than half of it was left
  early, so it never holds more than twice the timeouts still open (plus a constant).
- At most one loop timer is armed, at the oldest queued deadline, and none while the queue is empty.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import deque
from collections.abc import Callable
from types import TracebackType


class StateSignal:
    def __init__(self) -> None:
        self._waiters: list[_Waiter] = []

    def notify(self) -> None:
        """Have every waiter re-check its predicate, each where its task's wake-up would run (see `_Waiter`)."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.check_soon()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Return once `predicate()` is true (checked now and after every notify)."""
        if predicate():
            return
        waiter = _Waiter(self, predicate)
        self._waiters.append(waiter)
        try:
            await waiter
        finally:
            if not waiter.done():  # the coroutine was closed while it waited
                waiter.cancel()
                if waiter in self._waiters:
                    self._waiters.remove(waiter)


class _Waiter(asyncio.Future[None]):
    """One `StateSignal.wait_for`: a future that re-checks its predicate itself, so a notify whose predicate is still false
    costs one loop callback instead of a wake-up and a step of the waiting task (a new future, the task's await chain run
    again). The order of everything stays that of a plain future whose task re-checks: the check runs where the task's
    wake-up would have run (scheduled by `notify()`, in the task's context), and there a true predicate runs the task's
    step at once, a false one queues the waiter again. A cancellation arriving while a check is on its way is delivered by
    that check, as a cancelled task's pending wake-up would deliver it.

    The awaiting task gives it its wake-up callback (`add_done_callback`, asyncio's protocol for future-like objects) and
    the callback is called from here; any other callback is an ordinary future's. A predicate re-checked here runs
    outside its task (`asyncio.current_task()` is None in it): predicates read shared state only. One that raises
    raises out of `wait_for`, as it did when the task checked it itself."""

    def __init__(self, signal: StateSignal, predicate: Callable[[], bool]) -> None:
        super().__init__(loop=asyncio.get_running_loop())
        self._signal = signal
        self._predicate = predicate
        self._wakeup: Callable[[_Waiter], object] | None = None
        self._context: contextvars.Context | None = None
        self._checking = False  # a check is scheduled: it delivers whatever happens before it runs

    def add_done_callback(self, fn: Callable[[_Waiter], object], *, context: contextvars.Context | None = None) -> None:
        if self._wakeup is not None or self.done():
            super().add_done_callback(fn, context=context)
            return
        self._wakeup, self._context = fn, context if context is not None else contextvars.copy_context()

    def check_soon(self) -> None:
        self._checking = True
        self.get_loop().call_soon(self._check, context=self._context)

    def _check(self) -> None:
        self._checking = False
        if not self.done():
            try:
                ready = self._predicate()
            except BaseException as error:  # raised out of `wait_for`, as when the task itself checked
                self.set_exception(error)
                self._wake()
                if isinstance(error, (KeyboardInterrupt, SystemExit)):
                    raise
                return
            if not ready:
                self._signal._waiters.append(self)
                return
            self.set_result(None)
        self._wake()  # true, or cancelled meanwhile: the task's step runs now, where its wake-up would have run

    def cancel(self, msg: object | None = None) -> bool:
        if not super().cancel(msg=msg):
            return False
        if not self._checking:
            self.get_loop().call_soon(self._wake, context=self._context)
        return True

    def _wake(self) -> None:
        if self._wakeup is not None:
            wakeup, self._wakeup = self._wakeup, None
            wakeup(self)


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


COMPACT_AT = 64  # a queue shorter than this is never compacted (its entries leave from the front soon enough)

_OPEN, _EXPIRING, _EXPIRED, _LEFT = range(4)


class SharedTimeout:
    """Timeouts of `duration_s` seconds each, sharing one loop timer (see the module docstring)."""

    def __init__(self, duration_s: float) -> None:
        if not duration_s > 0:
            raise ValueError(f"SharedTimeout needs a duration > 0 s, got {duration_s!r}")
        self.duration_s = duration_s
        self._queue: deque[_Timeout] = deque()
        self._left = 0  # queued timeouts already left (not yet popped)
        self._timer: asyncio.TimerHandle | None = None

    def timeout(self) -> _Timeout:
        """An async context manager bounding its block by `duration_s` from its entry."""
        return _Timeout(self)

    @property
    def queued(self) -> int:
        """Timeouts queued, open or left early and not yet popped (at most 2 x open + COMPACT_AT)."""
        return len(self._queue)

    def _enter(self, timeout: _Timeout) -> None:
        self._queue.append(timeout)
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_at(timeout.deadline, self._fire)

    def _leave(self) -> None:
        self._left += 1
        queue = self._queue
        while queue and queue[0].state == _LEFT:
            queue.popleft()
            self._left -= 1
        if not queue:
            self._disarm()
        elif self._left > COMPACT_AT and 2 * self._left > len(queue):
            self._queue = deque(t for t in queue if t.state != _LEFT)
            self._left = 0

    def _fire(self) -> None:
        due = self._timer.when() if self._timer is not None else asyncio.get_running_loop().time()
        self._timer = None
        queue = self._queue
        while queue and (queue[0].state == _LEFT or queue[0].deadline <= due):
            timeout = queue.popleft()
            if timeout.state == _LEFT:
                self._left -= 1
            else:
                timeout.expire()
        if queue:
            self._timer = asyncio.get_running_loop().call_at(queue[0].deadline, self._fire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class _Timeout:
    """One block bounded by its `SharedTimeout`'s duration."""

    __slots__ = ("_shared", "_task", "_cancelling", "deadline", "state")

    def __init__(self, shared: SharedTimeout) -> None:
        self._shared = shared
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self.deadline = 0.0
        self.state = _OPEN

    def expired(self) -> bool:
        return self.state in (_EXPIRING, _EXPIRED)

    def expire(self) -> None:
        assert self._task is not None
        self.state = _EXPIRING
        self._task.cancel()

    async def __aenter__(self) -> _Timeout:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("SharedTimeout.timeout() must be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self.deadline = asyncio.get_running_loop().time() + self._shared.duration_s
        self._shared._enter(self)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.state == _OPEN:
            self.state = _LEFT
            self._shared._leave()
            return
        assert self._task is not None
        self.state = _EXPIRED  # popped by `_fire` when it expired
        if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc  # our cancellation, and no other pending: the block timed out
