"""Request slots: at most `generation.max_inflight` generation requests open at the servers at once.

`acquire()` waits (on its own `TurnSignal`, in arrival order) for a free slot and returns it as a
`Slot`, which its holder gives back exactly once: leaving `with slot:`, or the end of the task
that runs it (`release_with`), whichever comes first; a second release is a no-op. A release
before the task's end takes its done callback off the task again, so a rollout that gave its slot
back costs the loop no callback at its end (one handle fewer per rollout). A rollout
waiting to retry holds no slot (`Slot.released_while`), so the slot serves other rollouts
meanwhile, and takes one again before its next attempt.

Invariants:
- `open` equals the number of slots held: every change is `acquire` or a `Slot`'s own
  release, and a `Slot` counts itself at most once.
- Every release wakes exactly one slot waiter (O(1): one freed slot can serve only one; the
  `TurnSignal` rule loses no wake-up) and notifies the collector's `StateSignal` (admission may
  open, and the rollout's ending may complete what the trainer waits for).
"""

from __future__ import annotations

import asyncio
from types import TracebackType

from asyncgrpo.sync import StateSignal, TurnSignal


class RequestSlots:
    def __init__(self, limit: int, signal: StateSignal) -> None:
        self.limit = limit
        self._signal = signal
        self._turns = TurnSignal()  # the tasks waiting for a slot
        self._open = 0

    @property
    def open(self) -> int:
        """Slots held now (requests open at the servers, or about to be sent)."""
        return self._open

    @property
    def free(self) -> int:
        return self.limit - self._open

    async def acquire(self) -> Slot:
        """Wait for a free slot and take it. The wait ends with a free slot, or the caller's cancellation."""
        await self._take()
        return Slot(self)

    async def _take(self) -> None:
        await self._turns.wait_for(lambda: self._open < self.limit)
        self._open += 1

    def _give_back(self) -> None:
        self._open -= 1
        self._turns.notify_one()
        self._signal.notify()


class Slot:
    """One held request slot (see the module docstring)."""

    def __init__(self, slots: RequestSlots) -> None:
        self._slots = slots
        self._held = True
        self._task: asyncio.Task[object] | None = None  # the task whose end releases it (`release_with`)

    @property
    def held(self) -> bool:
        return self._held

    def release(self) -> None:
        """Give the slot back; a no-op if it is not held."""
        if self._held:
            self._held = False
            self._slots._give_back()
        if self._task is not None:  # released before its task ended: that end has nothing left to give back
            self._task.remove_done_callback(self._release_when_done)
            self._task = None

    def release_with(self, task: asyncio.Task[object]) -> None:
        """Give the slot back when `task` ends, at the latest: also if it is cancelled before it ever ran."""
        self._task = task
        task.add_done_callback(self._release_when_done)  # a bound method: one object per slot, a lambda took two

    def _release_when_done(self, _task: asyncio.Task[object]) -> None:
        self._task = None
        self.release()

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()

    async def released_for(self, delay_s: float) -> None:
        """Wait `delay_s` holding no slot (a rollout waiting to retry), then wait for a slot and take it again.
        Cancelled meanwhile, it holds none: nothing is left to give back."""
        if not self._held:
            raise AssertionError("released_for() on a slot that is not held")
        self.release()
        await asyncio.sleep(delay_s)
        await self._slots._take()
        self._held = True
