"""The trainer's side of the collector: each step's batch out of the replay buffer. No tasks of its own.

`Batches` holds the replay buffer, the index of the step whose batch is taken next (`next_step`),
the batch in training and the run's progress clock. The collector (rollout/collector.py) buffers
the groups it finishes here and owns the groups in flight, which `Batches` only reads; when a
take moves the steps on, it asks the collector to cancel the in-flight groups no remaining step
can train (`on_advance`). It shares the collector's `StateSignal` and first failure, and changes
state only in synchronous code, each change followed by `notify()`.

Invariants (DESIGN.md §2):
- No stale group (staleness > K) reaches the trainer: `next_batch` drops stale buffered groups
  right before taking a batch and checks the batch it takes; the take then drops those stale at
  the next step. Under `rollout.on_stale: resume` a buffered group stale at a step is first masked
  at that step (its tokens older than the bound out of the loss, rollout/resume.py) and kept if
  that brings it within the bound.
- A ready batch waits only as the staleness policy says (rollout/stale_policy.py): for stragglers,
  then for stragglers finishing early; every wait has a predicate and a deadline.
- No progress (a rollout, an episode turn or a group's scoring ended, a step trained) for the
  stall bound fails the run with the collector's stall diagnostic.
- Every buffered group that is dropped stale or trained reaches the books (rollout/books.py) once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from asyncgrpo.config import Config
from asyncgrpo.errors import Diagnostic
from asyncgrpo.rollout.admission import is_stale
from asyncgrpo.rollout.books import Books
from asyncgrpo.rollout.buffer import ReplayBuffer
from asyncgrpo.rollout.first_failure import FirstFailure
from asyncgrpo.rollout.in_flight import InFlightGroup
from asyncgrpo.rollout.resume import version_span
from asyncgrpo.rollout.stale_policy import Exhaustible, StalePolicy, is_straggler, may_finish_early
from asyncgrpo.sync import StateSignal
from asyncgrpo.types import Group


class Batches:
    def __init__(
        self,
        cfg: Config,
        *,
        books: Books,
        stale: StalePolicy,
        signal: StateSignal,
        first_failure: FirstFailure,
        in_flight: Mapping[int, InFlightGroup],
        source: Exhaustible,
        start_step: int,
        on_advance: Callable[[], None],
        stalled: Callable[[int, float], Diagnostic],
    ) -> None:
        """`on_advance`: cancel the in-flight groups stale at the new `next_step`; `stalled(step, bound)`: the diagnostic
        of a stall while step `step` waited."""
        self.cfg = cfg
        self.groups_per_step = cfg.rollout.groups_per_step
        self.max_staleness = cfg.rollout.max_staleness
        self.buffer = ReplayBuffer(cfg.rollout.max_staleness)
        self.next_step = start_step  # the index of the step whose batch is taken next
        self.in_training: list[Group] = []
        self.version_span = 0  # the widest version span of a rollout's trained tokens in the last batch taken
        self._books = books
        self._stale = stale
        self._signal = signal
        self._first_failure = first_failure
        self._in_flight = in_flight
        self._source = source
        self._on_advance = on_advance
        self._stalled = stalled
        self._last_progress: float | None = None  # loop time of the last finished rollout, episode turn or trained step
        self._step_started: float | None = None  # loop time the batch in training was taken
        self._last_step_s: float | None = None  # how long the last step trained (the unit of rollout.patience_share)

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

    def mark_start(self) -> None:
        """The run started: the stall bound counts from now (if nothing counted yet)."""
        if self._last_progress is None:
            self._last_progress = self._now()

    def progressed(self) -> None:
        """A rollout, an episode turn or a group's scoring ended: the stall bound counts from now."""
        self._last_progress = self._now()

    @property
    def steps_trained(self) -> int:
        """Steps completed: every step whose batch was taken, less the one training now (TRL's trainer_state.global_step)."""
        return self.next_step - (1 if self.in_training else 0)

    def data_done(self) -> bool:
        """No group will ever reach the buffer again: the source is exhausted and nothing is in flight."""
        return self._source.exhausted and not self._in_flight

    async def next_batch(self, step: int, stall_timeout_s: float) -> list[Group] | None:
        """Wait for step `step`'s batch: `groups_per_step` trainable groups, oldest first.

        Returns a smaller final batch at end of data (unless `data.drop_last`), None when no
        group is left to train, raises the run's diagnostic if it failed, and `StallError` if
        no rollout (or episode turn) finished and no step trained for `stall_timeout_s`.
        """
        if step != self.next_step:
            raise AssertionError(f"next_batch({step}) but the next step is {self.next_step}")
        self.mark_start()
        while True:
            self._first_failure.check()
            self._drop_stale_buffered(step)
            if self._ready(step):
                await self._hold_ready_batch(step)
                return self._take(step, self.groups_per_step)
            if self.data_done():
                if len(self.buffer) and not self.cfg.data.drop_last:
                    return self._take(step, len(self.buffer))
                return None
            assert self._last_progress is not None
            deadline = self._last_progress + stall_timeout_s
            if self._now() >= deadline:
                self._first_failure.fail(self._stalled(step, stall_timeout_s))
                self._signal.notify()
                continue
            try:
                async with asyncio.timeout_at(deadline):
                    await self._signal.wait_for(lambda: self._ready(step) or self.data_done() or self._first_failure.failed)
            except TimeoutError:
                pass  # the loop re-checks: progress may have moved the deadline

    def _ready(self, step: int) -> bool:
        return self._stale.ready(step, self.buffer, self._source)

    async def _hold_ready_batch(self, step: int) -> None:
        """What a ready batch waits for, as the staleness policy says: stragglers, up to its deadline; then, with
        `rollout.partial_groups`, stragglers with enough finished members end early with them, scored in time for this step."""
        k = self.max_staleness
        deadline = self._stale.wait_until(self._now(), self._last_step_s)
        if deadline is not None:
            await self._wait_until(deadline, lambda: not any(
                is_straggler(version_floor=g.version_floor(), step=step, max_staleness=k) for g in self._in_flight.values()))
        if self._stale.finish_early:
            early = [g for g in self._in_flight.values() if may_finish_early(
                version_floor=g.version_floor(), step=step, max_staleness=k, dispatched=g.dispatched == g.size,
                finished=sum(c is not None for c in g.completions), min_survivors=self.cfg.rollout.min_group_survivors)]
            for group in early:
                group.finish_early()
            # Their scoring ends within the reward time limits; those still scoring are cancelled as stale later.
            await self._wait_until(self._now() + self.cfg.stall_timeout_s, lambda: all(g.key not in self._in_flight for g in early))

    async def _wait_until(self, deadline: float, done: Callable[[], bool]) -> None:
        """Wait until `done()`, the run fails, or the loop time `deadline`; then raise the run's diagnostic if it failed."""
        try:
            async with asyncio.timeout_at(deadline):
                await self._signal.wait_for(lambda: self._first_failure.failed or done())
        except TimeoutError:
            pass  # what is left is cancelled as stale when the steps move past it
        self._first_failure.check()

    def _take(self, step: int, n: int) -> list[Group]:
        batch = self.buffer.take(n, prefer_target=self._stale.prefer_target(step))
        for group in batch:
            self._stale.release(group.target_step)
            if is_stale(generation_version=group.generation_version, step=step, max_staleness=group.bound(self.max_staleness)):
                raise AssertionError(f"group of version {group.generation_version} taken for step {step} with K={group.bound(self.max_staleness)}")
        self.in_training = batch
        self.version_span = version_span(batch)
        self._step_started = self._now()
        self.next_step = step + 1
        self._on_advance()
        self._drop_stale_buffered(self.next_step)
        self._signal.notify()
        return batch

    def _drop_stale_buffered(self, step: int) -> None:
        for group in self.buffer.remove_stale(step):
            masked = self._stale.mask(group, step)  # resume: masked at this step, it may be within the bound again
            if masked is not None and masked[1] and not is_stale(generation_version=masked[0].generation_version, step=step,
                                                                 max_staleness=group.bound(self.max_staleness)):
                self._books.masked(masked[1])
                self.buffer.put(masked[0])
                continue
            self._stale.release(group.target_step)
            self._books.stale_buffered(group, step, self._now())

    def step_trained(self) -> None:
        """The step that took `in_training` has completed and its weights are published."""
        self._books.trained(self.in_training, self.next_step - 1, self._now())
        self.in_training = []
        self._last_progress = self._now()
        if self._step_started is not None:
            self._last_step_s = self._last_progress - self._step_started
        self._signal.notify()
