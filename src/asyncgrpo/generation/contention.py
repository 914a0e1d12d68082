"""The simulator's model of generation and training sharing hardware (`simulate.contention`).

Job: `SharedHardware` runs the scripted backend's decoding and the stub trainer's steps as *work*: seconds
at full speed, done at full speed while the other side is idle and `slowdown` times slower while it is busy
(the local engine and the trainer on the same CPU cores, or one GPU for both). Generation is busy while at
least one request decodes; training while a step trains. A side's progress is a fluid: when the other side
starts or stops, the rate changes at that instant (`perform` waits on a `StateSignal` for that change, with
the time its remaining work would take as the deadline).

Invariants: with both slowdowns 1.0 nothing is built (commands/simulate.py passes None, and the scripted
backend and the stub trainer sleep as before, so every simulation without contention is unchanged); a
`Work` finishes after exactly its seconds when the other side stays idle, and after `slowdown` times them
when it stays busy; `Work.done_s` is the work done so far, also when the wait is cancelled.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Literal

from asyncgrpo.sync import StateSignal

Side = Literal["decode", "train"]
OTHER: dict[Side, Side] = {"decode": "train", "train": "decode"}


class Work:
    """`seconds` of work at full speed; `done_s` of it done so far."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.done_s = 0.0

    @property
    def share_done(self) -> float:
        return 1.0 if self.seconds <= 0 else min(1.0, self.done_s / self.seconds)


class SharedHardware:
    def __init__(self, *, decode_slowdown: float, train_slowdown: float) -> None:
        if decode_slowdown < 1 or train_slowdown < 1:
            raise ValueError(f"slowdowns must be >= 1, got decode {decode_slowdown}, train {train_slowdown}")
        self.slowdown: dict[Side, float] = {"decode": decode_slowdown, "train": train_slowdown}
        self._busy: dict[Side, int] = {"decode": 0, "train": 0}
        self._changed = StateSignal()

    def busy(self, side: Side) -> bool:
        return self._busy[side] > 0

    async def perform(self, side: Side, work: Work) -> None:
        """Do `work` on `side`: marked busy meanwhile, slowed while the other side is busy."""
        loop = asyncio.get_running_loop()
        self._mark(side, +1)
        try:
            while work.done_s < work.seconds:
                contended = self.busy(OTHER[side])
                rate = 1 / self.slowdown[side] if contended else 1.0
                started = loop.time()
                try:
                    async with asyncio.timeout((work.seconds - work.done_s) / rate):
                        await self._changed.wait_for(functools.partial(self._turned, OTHER[side], contended))
                except TimeoutError:
                    work.done_s = work.seconds
                finally:
                    work.done_s = min(work.seconds, work.done_s + (loop.time() - started) * rate)
        finally:
            self._mark(side, -1)

    def _turned(self, side: Side, was_busy: bool) -> bool:
        return self.busy(side) != was_busy

    def _mark(self, side: Side, change: int) -> None:
        was = self.busy(side)
        self._busy[side] += change
        if self.busy(side) != was:
            self._changed.notify()
