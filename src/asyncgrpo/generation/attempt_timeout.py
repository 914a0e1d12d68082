"""How long one request attempt may go unanswered, from the latencies the run observes.

Job: a pure policy (no I/O, no clock of its own) that `HttpGenerator` asks before each attempt.
A server that silently never answers a few requests would otherwise hold request slots for the
whole `generation.request_timeout_s` (60 s by default) while every other answer takes
milliseconds to seconds; once every slot holds such a request, generation stops.

Rule (`LatencyTracker.timeout_s`, the attempt's *budget*):

- Until `MIN_SAMPLES` attempts have succeeded, an attempt may take `cap_s`
  (= `generation.request_timeout_s`): nothing is known about the server yet.
- Then: ``clamp(factor x max(q99(L), q99(L / N) x n), floor_s, cap_s)``, over the last `WINDOW`
  successful attempts, where ``L`` is an answer's latency, ``N`` the tokens it asked for
  (``max_tokens``) and ``n`` the tokens this attempt asks for; `factor` is
  `generation.http.attempt_timeout_factor` and `floor_s` `generation.http.attempt_timeout_min_s`.
  A request asking for more tokens than the answers seen so far gets proportionally longer (a
  long completion is not cut at the latency of short ones); one asking for fewer never gets less
  than the plain latency quantile (prefill and queueing do not shrink with it).
- A request whose earlier attempts already timed out gets twice the budget per such attempt
  (``base x 2**timeouts``, still capped): a server that became uniformly slower is waited for
  within a few attempts, and its answers then move the quantile.

What the budget means (enforced by generation/attempt_clock.py): running past it makes an attempt
*overdue*, not abandoned. An overdue attempt is abandoned once a request dispatched after it became
overdue has been answered (by any server: the client is alive and servers answer newer work while
this one sits), or when it has run `OVERDUE_FACTOR` times its budget (nothing newer was sent to
compare with). So a pause of the client's own event loop, or a server slowed down as a whole (load,
longer completions), does not throw work away: newer requests are then no faster. The clock of an
attempt stands still while our weight install pauses its server, and latencies are kept across
installs (forgetting them put every attempt after an install at the cap, so hung requests were held
for the whole request timeout).

`silence_s` is how long a server holding open requests may answer none of them before it is
reported as looking hung: ``max(floor_s, the base timeout)``.

Invariants: latencies are recorded only for answered attempts (an abandoned attempt's latency
is unknown, not its timeout); `timeout_s` is always in ``[min(floor_s, cap_s), cap_s]`` and
`overdue_limit_s(b)` in ``[b, cap_s]`` for a budget ``b <= cap_s``.
"""

from __future__ import annotations

import bisect
import collections
import math

WINDOW = 256  # successful attempts the quantile is taken over
MIN_SAMPLES = 32  # successes needed before the timeout follows the latencies
QUANTILE = 0.99
OVERDUE_FACTOR = 4.0  # an overdue attempt that nothing newer overtook is abandoned at this many budgets


class _Window:
    """The last WINDOW values, also kept sorted: a quantile is one lookup, not a sort per answer."""

    def __init__(self) -> None:
        self._values: collections.deque[float] = collections.deque()
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._values)

    def add(self, value: float) -> None:
        if len(self._values) == WINDOW:
            del self._sorted[bisect.bisect_left(self._sorted, self._values.popleft())]
        self._values.append(value)
        bisect.insort(self._sorted, value)

    def quantile(self) -> float:
        """The QUANTILE (nearest rank); the window is not empty."""
        n = len(self._sorted)
        return self._sorted[min(n - 1, math.ceil(QUANTILE * n) - 1)]


class LatencyTracker:
    """Recent successful attempt latencies and the attempt timeout they imply (see the module docstring)."""

    def __init__(self, *, cap_s: float, factor: float, floor_s: float) -> None:
        if not (cap_s > 0 and factor >= 1 and floor_s > 0):
            raise ValueError(f"LatencyTracker needs cap_s > 0, factor >= 1 and floor_s > 0; got {cap_s}, {factor}, {floor_s}")
        self.cap_s = cap_s
        self.factor = factor
        self.floor_s = floor_s
        self._latencies = _Window()
        self._per_token = _Window()  # latency / tokens asked, of the same answers

    @property
    def samples(self) -> int:
        return len(self._latencies)

    def record(self, latency_s: float, tokens: int) -> None:
        """An attempt asking for `tokens` tokens was answered after `latency_s` seconds (of its own clock)."""
        if not math.isfinite(latency_s) or latency_s < 0:
            raise ValueError(f"latency must be a finite number >= 0, got {latency_s!r}")
        if tokens < 1:
            raise ValueError(f"tokens asked for must be >= 1, got {tokens!r}")
        self._latencies.add(latency_s)
        self._per_token.add(latency_s / tokens)

    def quantile_s(self) -> float | None:
        """The QUANTILE of the recent latencies (nearest rank), None before MIN_SAMPLES."""
        return self._latencies.quantile() if len(self._latencies) >= MIN_SAMPLES else None

    def base_s(self, tokens: int | None = None) -> float:
        """The budget of a request's first attempt asking for `tokens` tokens (None: the plain quantile)."""
        q = self.quantile_s()
        if q is None:
            return self.cap_s
        if tokens is not None:
            q = max(q, self._per_token.quantile() * tokens)
        return min(self.cap_s, max(self.floor_s, self.factor * q))

    def timeout_s(self, timeouts_so_far: int = 0, tokens: int | None = None) -> float:
        """The budget of an attempt asking for `tokens` tokens, of a request whose earlier attempts timed out
        `timeouts_so_far` times."""
        if timeouts_so_far < 0:
            raise ValueError(f"timeouts_so_far must be >= 0, got {timeouts_so_far}")
        return min(self.cap_s, self.base_s(tokens) * 2.0 ** min(timeouts_so_far, 60))

    def overdue_limit_s(self, budget_s: float) -> float:
        """When an overdue attempt that no newer answer overtook is abandoned anyway."""
        return min(self.cap_s, OVERDUE_FACTOR * budget_s)

    def silence_s(self) -> float:
        """How long a server with open requests may answer none before it looks hung."""
        return max(self.floor_s, self.base_s())

    def describe(self) -> str:
        q = self.quantile_s()
        if q is None:
            return (f"fewer than {MIN_SAMPLES} answers seen so far, so generation.request_timeout_s = {self.cap_s:g} s "
                    f"applies")
        return (f"{self.factor:g} x the {QUANTILE:.0%} latency {q:.3g} s of the last {len(self._latencies)} answers, "
                f"scaled up for requests asking for more tokens (generation.http.attempt_timeout_factor; at least "
                f"generation.http.attempt_timeout_min_s = {self.floor_s:g} s, at most generation.request_timeout_s = "
                f"{self.cap_s:g} s), doubled per earlier timeout of the same request; abandoned once a newer request was "
                f"answered meanwhile, or at {OVERDUE_FACTOR:g} x that")
