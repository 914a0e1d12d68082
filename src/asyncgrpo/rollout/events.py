"""The collector's rollout lifecycle, reported to an observer (the run's timeline, telemetry/timeline.py).

The collector calls these hooks synchronously, on its event loop, at the moment a thing happens,
with the loop's time (virtual time in a simulation). An observer does no I/O that can block and
raises nothing; the collector itself never writes a record.

Identities: a *take* (one admission of a prompt) is numbered 1, 2, ... in admission order, and
each of its rollouts by `member`; a take that reached the buffer is known afterwards by its
group's `seq`. Every take ends exactly once (`take_ended`), and a buffered one ends once more
as trained or dropped stale (`buffered_ended`), mirroring rollout/accounting.py.
"""

from __future__ import annotations

from typing import Literal, Protocol

RolloutOutcome = Literal["finished", "failed", "cancelled"]
# How a take left the in-flight set: buffered, requeued (stale), or a drop reason (types.DROP_REASONS).
BufferedOutcome = Literal["trained", "stale"]


class RolloutObserver(Protocol):
    def rollout_started(self, take: int, prompt_id: int, member: int, t: float) -> None: ...

    def rollout_ended(self, take: int, member: int, outcome: RolloutOutcome, version: int | None, tokens: int, t: float) -> None: ...

    def take_ended(self, take: int, prompt_id: int, ending: str, seq: int | None, t: float) -> None: ...

    def buffered_ended(self, seqs: list[int], outcome: BufferedOutcome, step: int, t: float) -> None: ...


class NoObserver:
    """The observer of a collector nobody watches."""

    def rollout_started(self, take: int, prompt_id: int, member: int, t: float) -> None:
        pass

    def rollout_ended(self, take: int, member: int, outcome: RolloutOutcome, version: int | None, tokens: int, t: float) -> None:
        pass

    def take_ended(self, take: int, prompt_id: int, ending: str, seq: int | None, t: float) -> None:
        pass

    def buffered_ended(self, seqs: list[int], outcome: BufferedOutcome, step: int, t: float) -> None:
        pass
