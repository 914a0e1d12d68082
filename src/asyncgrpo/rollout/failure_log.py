"""What the log says about tolerated failures: the first of each kind in full, then rate-limited counts.

A tolerated failure is one the run survives: an attempt retried after a transient error, a
rollout that failed (its group may still train, or is dropped and counted by the failure
policy), a group dropped for a reward error under `reward.on_error: drop`. Fatal errors are
not recorded here; they become the run's diagnostic.

Pure: no I/O and no clock. `record()` takes the time (loop time, so virtual time in
`asyncgrpo simulate`) and returns the lines the caller logs. Rules:
- The first failure of each (what, error class, source) is returned in full, with its message.
- Every failure is counted; a summary of the counts since the last summary (by what, class and
  source) is returned at most once per `summary_interval_s`, and only when some failure in it
  was not already shown in full. The first period starts at the first failure.
- `flush()` returns the summary of whatever is still unsummarised (at the end of the run).
"""

from __future__ import annotations

from collections import Counter
from typing import Literal

from asyncgrpo.errors import RewardError, TeacherError

Tolerated = Literal["retried", "failed", "reward_error"]

_WHAT = {
    "retried": "attempt retried",
    "failed": "rollout failed",
    "reward_error": "group dropped for a reward error",
}

Key = tuple[Tolerated, str, str]  # (what, error class, source)


def source_of(error: BaseException, backend: str) -> str:
    """Who raised a tolerated `error`: the teacher, the reward functions, or the generation backend (its own
    name for itself, else `backend`)."""
    if isinstance(error, (RewardError, TeacherError)):
        return "the teacher" if isinstance(error, TeacherError) else "the reward functions"
    return getattr(error, "backend", "") or backend


class FailureLog:
    def __init__(self, summary_interval_s: float) -> None:
        if not summary_interval_s > 0:
            raise ValueError(f"summary_interval_s must be > 0, got {summary_interval_s}")
        self.summary_interval_s = summary_interval_s
        self._shown: set[Key] = set()
        self._counts: Counter[Key] = Counter()  # since the last summary
        self._repeats = False  # whether any of those was not shown in full
        self._period_start: float | None = None

    def record(self, what: Tolerated, error_class: str, source: str, message: str, now: float) -> list[str]:
        """Count one tolerated failure at time `now`; return the lines to log (maybe none)."""
        key: Key = (what, error_class, source)
        lines = []
        if self._period_start is None:
            self._period_start = now
        self._counts[key] += 1
        if key in self._shown:
            self._repeats = True
        else:
            self._shown.add(key)
            lines.append(
                f"tolerated failure ({_WHAT[what]}): {error_class} from {source}: {message} "
                f"[first of its kind; later ones are counted every logging.failure_summary_s = {self.summary_interval_s:g} s]"
            )
        if self._repeats and now - self._period_start >= self.summary_interval_s:
            lines.append(self._summary(now))
        return lines

    def flush(self, now: float) -> list[str]:
        """The summary of the failures not yet summarised, if any was not shown in full."""
        return [self._summary(now)] if self._repeats else []

    def _summary(self, now: float) -> str:
        assert self._period_start is not None
        parts = []
        for what in _WHAT:
            counts = {(cls, src): n for (w, cls, src), n in self._counts.items() if w == what}
            if counts:
                listed = ", ".join(f"{cls} from {src}: {n}" for (cls, src), n in sorted(counts.items()))
                parts.append(f"{sum(counts.values())} x {_WHAT[what]} ({listed})")
        line = f"tolerated failures in the last {now - self._period_start:.0f} s: " + "; ".join(parts)
        self._counts.clear()
        self._repeats = False
        self._period_start = now
        return line
