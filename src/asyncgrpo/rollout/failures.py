"""The failure policy: when do dropped groups become a fatal error? Pure; no tasks, no I/O.

Rules (DESIGN.md §3 "Failures"):
- Consecutive budget: a group whose rollouts all failed (not all by prompt rejection) is a
  *generation failure*. More than `max_generation_failures` in a row fail the run. A group
  that succeeds resets the streak; `too_few_survivors`, `invalid_prompt`, `filtered` and
  `reward_error` drops leave it unchanged.
- Trickle rule: once `drop_window` groups have finished, if more than `max_drop_fraction` of
  the last window were dropped as failed/too_few_survivors/invalid_prompt/reward_error, or
  more than `max_filtered_fraction` were filtered, the run fails. A fraction of 1.0 turns a
  rule off.
- Cancellation (stale, shutdown, end of data) is never recorded here and never counts.

`record` returns a `Verdict` the first time a rule is broken and keeps returning it (the
caller keeps the first one; the policy does not need to know). Examples of errors come only
from the groups in the current window, so a long-gone error never stands for a new outage.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from asyncgrpo.config import RolloutConfig

# How a judged group ended: buffered for training ("success") or dropped with a reason.
GroupEnding = Literal["success", "failed", "too_few_survivors", "invalid_prompt", "filtered", "reward_error"]
WINDOW_DROP_REASONS: tuple[GroupEnding, ...] = ("failed", "too_few_survivors", "invalid_prompt", "reward_error")


@dataclass(frozen=True)
class Verdict:
    """A broken rule: which, the count against its threshold, the error that stands for it (`original`:
    the breaking group's for the consecutive budget, else the first of the most frequent reason in the
    window), and the first error of each drop reason in the window."""

    kind: Literal["generation_failures", "drop_fraction", "filtered_fraction"]
    message: str
    count: int
    threshold: float
    original: BaseException | None = None
    examples: dict[str, BaseException] = field(default_factory=dict)
    by_reason: dict[str, int] = field(default_factory=dict)


class FailurePolicy:
    def __init__(
        self,
        *,
        max_generation_failures: int,
        drop_window: int,
        max_drop_fraction: float,
        max_filtered_fraction: float,
    ) -> None:
        self.max_generation_failures = max_generation_failures
        self.drop_window = drop_window
        self.max_drop_fraction = max_drop_fraction
        self.max_filtered_fraction = max_filtered_fraction
        self.streak = 0
        self._window: deque[tuple[GroupEnding, BaseException | None]] = deque(maxlen=drop_window)
        self._counts: Counter[GroupEnding] = Counter()  # endings in the window, kept as it slides (not recounted per group)
        self._finished = 0

    @classmethod
    def from_rollout(cls, r: RolloutConfig) -> FailurePolicy:
        """The policy of a recipe's `rollout:` section."""
        return cls(max_generation_failures=r.max_generation_failures, drop_window=r.drop_window,
                   max_drop_fraction=r.max_drop_fraction, max_filtered_fraction=r.max_filtered_fraction)

    @property
    def judged(self) -> int:
        """Groups recorded so far (every judged group, buffered or dropped)."""
        return self._finished

    def record(self, ending: GroupEnding, error: BaseException | None = None) -> Verdict | None:
        """Account one finished group; return a Verdict if a rule is now broken."""
        if ending == "success":
            self.streak = 0
        elif ending == "failed":
            self.streak += 1
        if len(self._window) == self._window.maxlen:
            self._counts[self._window[0][0]] -= 1  # the oldest ending leaves the window
        self._window.append((ending, error))
        self._counts[ending] += 1
        self._finished += 1

        if self.streak > self.max_generation_failures:
            return Verdict(
                kind="generation_failures",
                message=(
                    f"{self.streak} consecutive groups had every rollout fail, more than "
                    f"rollout.max_generation_failures = {self.max_generation_failures}. Generation is not working: "
                    f"check the backend (the error of the last failed group is below). Raise "
                    f"rollout.max_generation_failures only if such failures are expected and transient."
                ),
                count=self.streak,
                threshold=self.max_generation_failures,
                original=error,
                examples=self._examples(),
            )
        if self._finished < self.drop_window:
            return None
        counts = self._counts
        dropped = sum(counts[r] for r in WINDOW_DROP_REASONS)
        if dropped > self.max_drop_fraction * self.drop_window:
            by_reason: dict[str, int] = {r: counts[r] for r in WINDOW_DROP_REASONS if counts[r]}
            examples: dict[str, BaseException] = {r: e for r, e in self._examples().items() if r in by_reason}
            top = max(by_reason, key=lambda r: by_reason[r])
            return Verdict(
                kind="drop_fraction",
                message=(
                    f"{dropped} of the last {self.drop_window} groups were dropped ({_format(by_reason)}), more than "
                    f"rollout.max_drop_fraction = {self.max_drop_fraction:g}. Too little data reaches training: fix the "
                    f"cause below, or set rollout.max_drop_fraction: 1.0 to turn this rule off."
                ),
                count=dropped,
                threshold=self.max_drop_fraction,
                original=examples.get(top, next(iter(examples.values()), None)),
                examples=examples,
                by_reason=by_reason,
            )
        if counts["filtered"] > self.max_filtered_fraction * self.drop_window:
            return Verdict(
                kind="filtered_fraction",
                message=(
                    f"{counts['filtered']} of the last {self.drop_window} groups had rewards that were all equal and "
                    f"were filtered, more than rollout.max_filtered_fraction = {self.max_filtered_fraction:g}: the rewards "
                    f"carry no signal. Check the reward function or the task difficulty."
                ),
                count=counts["filtered"],
                threshold=self.max_filtered_fraction,
                by_reason={"filtered": counts["filtered"]},
            )
        return None

    def _examples(self) -> dict[str, BaseException]:
        """The first error of each ending among the groups in the window."""
        examples: dict[str, BaseException] = {}
        for ending, error in self._window:
            if error is not None:
                examples.setdefault(ending, error)
        return examples


def _format(by_reason: dict[str, int]) -> str:
    return ", ".join(f"{reason}: {n}" for reason, n in by_reason.items())
