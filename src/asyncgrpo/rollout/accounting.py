"""Exactly-once accounting of prompt takes (DESIGN.md §4).

Each time a prompt is taken from the source is one *take*; every take ends in exactly one
outcome, and at every moment

    taken == trained + requeued + sum(dropped.values()) + in_flight + buffered

Transitions are the only way to change the numbers, each moves one take from one bucket
to another, so the identity cannot break unless a transition is called for a take that
is not in its source bucket, which raises (an internal invariant, not a user error).
Groups taken by the step being trained count as `buffered` until the step completes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncgrpo.types import DROP_REASONS, DropReason


@dataclass
class Accounting:
    taken: int = 0
    trained: int = 0
    requeued: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: {reason: 0 for reason in DROP_REASONS})
    in_flight: int = 0
    buffered: int = 0

    @classmethod
    def resumed(cls, saved: dict[str, object]) -> Accounting:
        """Continue a checkpoint's accounting: what was in flight or buffered then is generated again
        after the resume, so those takes ended as requeued."""
        dropped = dict(saved["dropped"])  # type: ignore[call-overload]
        return cls(
            taken=int(saved["taken"]),  # type: ignore[call-overload]
            trained=int(saved["trained"]),  # type: ignore[call-overload]
            requeued=int(saved["requeued"]) + int(saved["in_flight"]) + int(saved["buffered"]),  # type: ignore[call-overload]
            dropped={reason: int(dropped.get(reason, 0)) for reason in DROP_REASONS},
        )

    def take(self) -> None:
        self.taken += 1
        self.in_flight += 1

    def buffer(self) -> None:
        self._leave_in_flight()
        self.buffered += 1

    def drop_in_flight(self, reason: DropReason) -> None:
        self._leave_in_flight()
        self.dropped[reason] += 1

    def requeue_in_flight(self) -> None:
        self._leave_in_flight()
        self.requeued += 1

    def drop_buffered(self, reason: DropReason) -> None:
        self._leave_buffered()
        self.dropped[reason] += 1

    def train_buffered(self, n: int) -> None:
        for _ in range(n):
            self._leave_buffered()
        self.trained += n

    def balanced(self) -> bool:
        return self.taken == self.trained + self.requeued + sum(self.dropped.values()) + self.in_flight + self.buffered

    def to_json(self) -> dict[str, object]:
        return {
            "taken": self.taken,
            "trained": self.trained,
            "requeued": self.requeued,
            "dropped": dict(self.dropped),
            "in_flight": self.in_flight,
            "buffered": self.buffered,
        }

    def _leave_in_flight(self) -> None:
        if self.in_flight <= 0:
            raise AssertionError("accounting: a group left 'in flight' but none was in flight")
        self.in_flight -= 1

    def _leave_buffered(self) -> None:
        if self.buffered <= 0:
            raise AssertionError("accounting: a group left 'buffered' but none was buffered")
        self.buffered -= 1
