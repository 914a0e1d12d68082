"""Which completion servers answer: the dead-backend clock and the hung-server rule (pure: no I/O, no clock).

Job: the bookkeeping behind two of `HttpGenerator`'s decisions, from the outcomes of its completion
attempts (the caller passes the loop time of each outcome):

- **Dead backend.** `failing_for(now)` is how long attempts have been failing with no attempt
  answered by any server in between: the time since the first failure after the last answer (None
  while nothing failed since). The generator ends the run with `BackendDeadError` once it reaches
  `generation.backend_dead_after_s`, whatever the failures are (HTTP 5xx, reset connections,
  attempt timeouts) and whether they come from training or evaluation. Idle time does not start
  the clock: only a failure does, and only an answer stops it.
- **Hung server.** A server whose last `HUNG_AFTER` attempts all got no answer within their attempt
  timeout, while another server answered since the first of them, looks hung (`failed` returns
  True when it does): the generator takes it out of rotation until it answers a probe completion
  (`reinstated`). Any other outcome of its attempts (an answer, an HTTP error) ends the streak.

Each outcome is booked in O(1), whatever the number of servers: the two latest answers by different
servers tell whether another server answered since a streak began.

Invariant: a server is reported hung only on a timed-out attempt of its own and only if some other
server answered after its streak began, so one slow or hung server alone is never taken out (the
dead-backend clock covers that).
"""

from __future__ import annotations

from dataclasses import dataclass

HUNG_AFTER = 3  # attempt timeouts in a row that take a server out of rotation while others answer


@dataclass
class _Record:
    timeouts_in_a_row: int = 0
    streak_since: float | None = None


class PoolHealth:
    """Outcomes of completion attempts per server (by URL); see the module docstring."""

    def __init__(self, urls: list[str]) -> None:
        self._records = {url: _Record() for url in urls}
        self._failing_since: float | None = None
        self._latest: tuple[str, float] | None = None  # the latest answer: (url, time)
        self._latest_other: float | None = None  # the latest answer by another server than the latest's

    def answered(self, url: str, now: float) -> None:
        record = self._records[url]
        record.timeouts_in_a_row = 0
        record.streak_since = None
        self._failing_since = None
        if self._latest is not None and self._latest[0] != url:
            self._latest_other = self._latest[1]
        self._latest = (url, now)

    def failed(self, url: str, now: float, *, timed_out: bool) -> bool:
        """An attempt on `url` failed (`timed_out`: no answer within its attempt timeout). True when `url` now looks hung."""
        if self._failing_since is None:
            self._failing_since = now
        record = self._records[url]
        if not timed_out:
            record.timeouts_in_a_row = 0
            record.streak_since = None
            return False
        if record.timeouts_in_a_row == 0:
            record.streak_since = now
        record.timeouts_in_a_row += 1
        return record.timeouts_in_a_row >= HUNG_AFTER and self._others_answered_since(url, record.streak_since)

    def replace(self, old: str, new: str) -> None:
        """The server at `old` is now reached at `new` (a new process in its place): its record starts over under `new`;
        an answer `old` gave still counts as another server's for the others' streaks."""
        del self._records[old]
        self._records[new] = _Record()

    def timeouts_in_a_row(self, url: str) -> int:
        return self._records[url].timeouts_in_a_row

    def reinstated(self, url: str) -> None:
        """`url` answered again outside the rotation (a probe, a recovery): its streak starts over."""
        record = self._records[url]
        record.timeouts_in_a_row = 0
        record.streak_since = None

    def failing_for(self, now: float) -> float | None:
        return None if self._failing_since is None else now - self._failing_since

    @property
    def failing_since(self) -> float | None:
        """When the attempts began failing with no answer since (None while nothing failed since an answer)."""
        return self._failing_since

    def _others_answered_since(self, url: str, since: float | None) -> bool:
        if since is None or self._latest is None:
            return False
        latest_url, latest = self._latest
        other = latest if latest_url != url else self._latest_other
        return other is not None and other >= since
