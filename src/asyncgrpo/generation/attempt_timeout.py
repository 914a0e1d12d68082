"""How long one request attempt may go unanswered, from the latencies the run observes.

Job: a pure policy (no I/O, no clock of its own) that `HttpGenerator` asks before each attempt.
A server that silently never answers a few requests would otherwise hold request slots for the
whole `generation.request_timeout_s` (60 s by default) while every other answer takes
milliseconds to seconds; once every slot holds such a request, generation stops.

Rule (`LatencyTracker.timeout_s`):

- Until `MIN_SAMPLES` attempts have succeeded, an attempt may take `cap_s`
  (= `generation.request_timeout_s`): nothing is known about the server yet.
- Then: ``clamp(factor x q99, floor_s, cap_s)``, where q99 is the 0.99 quantile of the last
  `WINDOW` successful attempts' latencies, `factor` is `generation.http.attempt_timeout_factor`
  and `floor_s` is `generation.http.attempt_timeout_min_s`.
- A request whose earlier attempts already timed out gets twice the budget per such attempt
  (``base x 2**timeouts``, still capped): a server that became uniformly slower (longer
  completions after a weight update, more load) is waited for within a few attempts, and its
  answers then move the quantile, instead of every attempt being cut at the old latency.

`silence_s` is how long a server holding open requests may answer none of them before it is
reported as looking hung: ``max(floor_s, the base timeout)`` — longer than any first attempt
is allowed to take.

Invariants: latencies are recorded only for answered attempts (an abandoned attempt's latency
is unknown, not its timeout); the result is always in ``[min(floor_s, cap_s), cap_s]``.
"""

from __future__ import annotations

import bisect
import collections
import math

WINDOW = 256  # successful attempts the quantile is taken over
MIN_SAMPLES = 32  # successes needed before the timeout follows the latencies
QUANTILE = 0.99


class LatencyTracker:
    """Recent successful attempt latencies and the attempt timeout they imply (see the module docstring)."""

    def __init__(self, *, cap_s: float, factor: float, floor_s: float) -> None:
        if not (cap_s > 0 and factor >= 1 and floor_s > 0):
            raise ValueError(f"LatencyTracker needs cap_s > 0, factor >= 1 and floor_s > 0; got {cap_s}, {factor}, {floor_s}")
        self.cap_s = cap_s
        self.factor = factor
        self.floor_s = floor_s
        self._latencies: collections.deque[float] = collections.deque()  # the window, oldest first
        self._sorted: list[float] = []  # the same values, kept sorted: the quantile is one lookup, not a sort per answer

    @property
    def samples(self) -> int:
        return len(self._latencies)

    def forget(self) -> None:
        """Start over: the server changed (new weights, a cleared cache), so past latencies no longer
        predict new ones; until MIN_SAMPLES new answers, attempts get the cap again."""
        self._latencies.clear()
        self._sorted.clear()

    def record(self, latency_s: float) -> None:
        """An attempt was answered after `latency_s` seconds (of its own clock)."""
        if not math.isfinite(latency_s) or latency_s < 0:
            raise ValueError(f"latency must be a finite number >= 0, got {latency_s!r}")
        if len(self._latencies) == WINDOW:
            del self._sorted[bisect.bisect_left(self._sorted, self._latencies.popleft())]
        self._latencies.append(latency_s)
        bisect.insort(self._sorted, latency_s)

    def quantile_s(self) -> float | None:
        """The QUANTILE of the recent latencies (nearest rank), None before MIN_SAMPLES."""
        n = len(self._sorted)
        if n < MIN_SAMPLES:
            return None
        return self._sorted[min(n - 1, math.ceil(QUANTILE * n) - 1)]

    def base_s(self) -> float:
        """The timeout of a request's first attempt."""
        q = self.quantile_s()
        if q is None:
            return self.cap_s
        return min(self.cap_s, max(self.floor_s, self.factor * q))

    def timeout_s(self, timeouts_so_far: int = 0) -> float:
        """The timeout of an attempt of a request whose earlier attempts timed out `timeouts_so_far` times."""
        if timeouts_so_far < 0:
            raise ValueError(f"timeouts_so_far must be >= 0, got {timeouts_so_far}")
        return min(self.cap_s, self.base_s() * 2.0 ** min(timeouts_so_far, 60))

    def silence_s(self) -> float:
        """How long a server with open requests may answer none before it looks hung."""
        return max(self.floor_s, self.base_s())

    def describe(self) -> str:
        q = self.quantile_s()
        if q is None:
            return (f"fewer than {MIN_SAMPLES} answers seen so far, so generation.request_timeout_s = {self.cap_s:g} s "
                    f"applies")
        return (f"{self.factor:g} x the {QUANTILE:.0%} latency {q:.3g} s of the last {len(self._latencies)} answers "
                f"(generation.http.attempt_timeout_factor; at least generation.http.attempt_timeout_min_s = "
                f"{self.floor_s:g} s, at most generation.request_timeout_s = {self.cap_s:g} s), doubled per earlier "
                f"timeout of the same request")
