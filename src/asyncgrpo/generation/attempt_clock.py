"""The deadline of one HTTP completion attempt: its budget, when it is overdue, when it is abandoned.

Job: carry out attempt_timeout.py's rule on the event loop for `HttpGenerator`. An `AttemptClock`
wraps the `asyncio.Timeout` around one attempt; `AnswerMarks` (one per generator) numbers attempts
in dispatch order and remembers the newest answered one.

- Running past its budget (active time) makes an attempt *overdue* and records the newest dispatch
  mark at that moment. It is abandoned (its timeout expires) when an attempt dispatched after that
  is answered (`AnswerMarks.answered`), or once it has run its overdue limit. Abandoning waits
  `SETTLE_HOPS` turns of the event loop first: after a pause of this process (or of the server),
  answers arrive together, and the overdue attempt's own answer, already in its socket, is read
  meanwhile (that ends the attempt and cancels the abandonment). Loop turns, not seconds: a process
  that is not scheduled takes no turns.
- `freeze()` / `thaw()`: the clock stands still while our weight install pauses the server (requests
  held by our own /pause are not silent); a frozen attempt is never abandoned.
- `close()` (always, when the attempt ends) cancels its timer and forgets it; no handle outlives it.

Invariant: the only thing that cancels an attempt is its `asyncio.Timeout`, and only after its budget
ran (counting active time), so every abandoned attempt was overdue.
"""

from __future__ import annotations

import asyncio

SETTLE_HOPS = 8  # loop turns between "overtaken" and abandoning: an answer already received is read by then


class AnswerMarks:
    """Dispatch order of attempts and the newest one answered (pool-wide); wakes overdue clocks it overtakes."""

    def __init__(self) -> None:
        self.dispatched = 0
        self.newest_answered = 0
        self.overdue: set[AttemptClock] = set()

    def dispatch(self) -> int:
        self.dispatched += 1
        return self.dispatched

    def answered(self, mark: int) -> None:
        """The attempt dispatched as `mark` was answered: abandon the overdue attempts it overtook."""
        if mark <= self.newest_answered:
            return
        self.newest_answered = mark
        for clock in [c for c in self.overdue if c.overdue_mark is not None and c.overdue_mark < mark]:
            clock.abandon()


class AttemptClock:
    """One attempt's deadline (see the module docstring). `budget_s` None: no deadline of its own (the caller's applies)."""

    def __init__(self, timeout: asyncio.Timeout, marks: AnswerMarks, *, budget_s: float | None, limit_s: float,
                 frozen: bool) -> None:
        self._loop = asyncio.get_running_loop()
        self.timeout = timeout
        self.marks = marks
        self.mark = marks.dispatch()
        self.budget_s = budget_s
        self.limit_s = limit_s  # overdue limit, active time
        self.overdue_mark: int | None = None  # the newest dispatch mark when the budget ran out
        self.overtaken = False  # abandoned because a newer attempt was answered (else: the overdue limit)
        self._used = 0.0
        self._since: float | None = None
        self._budget_timer: asyncio.TimerHandle | None = None
        self._settle: asyncio.Handle | None = None  # the pending turn of an abandonment
        if not frozen:
            self.thaw()

    def freeze(self) -> None:
        if self._since is None:
            return
        self._used += self._loop.time() - self._since
        self._since = None
        self._cancel_budget_timer()
        if not self.timeout.expired():
            self.timeout.reschedule(None)

    def thaw(self) -> None:
        if self._since is not None:
            return
        now = self._since = self._loop.time()
        if self.budget_s is None or self.timeout.expired():
            return
        if self.overdue_mark is None:
            self._budget_timer = self._loop.call_at(now + self.budget_s - self._used, self._on_budget)
        self.timeout.reschedule(now + self.limit_s - self._used)

    def active_s(self) -> float:
        return self._used + (self._loop.time() - self._since if self._since is not None else 0.0)

    def abandon(self, hops: int = SETTLE_HOPS) -> None:
        """Expire after `hops` loop turns (overtaken by a newer answer). Not while frozen: it stays overdue, and the
        next newer answer after the thaw abandons it."""
        self._settle = None
        if self.timeout.expired():
            return
        if self._since is None:
            self.marks.overdue.add(self)
            return
        self.marks.overdue.discard(self)
        if hops > 0:
            self._settle = self._loop.call_soon(self.abandon, hops - 1)
            return
        self.overtaken = True
        self.timeout.reschedule(self._loop.time())

    def close(self) -> None:
        self._cancel_budget_timer()
        if self._settle is not None:
            self._settle.cancel()
            self._settle = None
        self.marks.overdue.discard(self)

    def _on_budget(self) -> None:
        self._budget_timer = None
        self.overdue_mark = self.marks.dispatched
        self.marks.overdue.add(self)

    def _cancel_budget_timer(self) -> None:
        if self._budget_timer is not None:
            self._budget_timer.cancel()
            self._budget_timer = None
