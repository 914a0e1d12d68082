"""The collector: takes prompts, generates their groups, scores them, and hands batches to the trainer.

One `Collector` owns, for one run: the admission decisions, a task per in-flight group
(and under it a task per rollout), the replay buffer, the accounting, the failure policy
and the run's first fatal error. All of its state lives on one event loop and changes only in
synchronous code; every change calls `StateSignal.notify()`.

Invariants (DESIGN.md §2):
- Every take of a prompt ends in exactly one way (`Accounting` checks the identity);
  whoever ends a group first (finish, stale cancellation) removes it from `_in_flight`,
  and only a group still there can be ended.
- No stale group (staleness > K) reaches the trainer: `next_batch` drops stale buffered
  groups right before taking a batch, and in-flight groups that are stale at the next step are
  cancelled (requests aborted, slots freed) as soon as the steps move past them.
- Errors are never swallowed: a rollout error is retried (transient), or fails the rollout
  (counted); group endings feed the failure policy; a broken budget, a misconfigured
  backend or a fatal reward error becomes the run's sticky diagnostic, which the trainer
  raises through `raise_if_failed()`.
- Cancellation (stale, shutdown, end of data) is never counted as a failure.
- Tasks: `run()` owns a TaskGroup with one task per in-flight group; each group task owns
  a TaskGroup with one task per dispatched rollout. `stop()` cancels them all; work
  unfinished at exit stays reported as in flight or buffered.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any, Protocol

from asyncgrpo.config import Config
from asyncgrpo.errors import Diagnostic, FatalBackendError, GenerationError, RewardError, TransientGenerationError
from asyncgrpo.generation.base import Generator
from asyncgrpo.rollout.accounting import Accounting
from asyncgrpo.rollout.admission import is_stale, may_admit_group
from asyncgrpo.rollout.buffer import ReplayBuffer
from asyncgrpo.rollout.diagnostics import backend_fatal, policy_broken, reward_failed, stalled
from asyncgrpo.rollout.events import NoObserver, RolloutObserver, RolloutOutcome
from asyncgrpo.rollout.failure_log import FailureLog, Tolerated
from asyncgrpo.rollout.failures import FailurePolicy, GroupEnding
from asyncgrpo.rollout.first_failure import FirstFailure
from asyncgrpo.rollout.in_flight import InFlightGroup, rollout_request
from asyncgrpo.rollout.judge import Drop, scored_rollouts, survivors
from asyncgrpo.rollout.ledger import PromptLedger
from asyncgrpo.rollout.no_signal import NoSignalWatch
from asyncgrpo.rollout.retry import generate_with_retries
from asyncgrpo.rollout.slots import RequestSlots, Slot
from asyncgrpo.sync import StateSignal
from asyncgrpo.telemetry.keys import COUNTER_NAMES
from asyncgrpo.types import Completion, DropReason, GenerationRequest, Group, Prompt, SamplingParams

log = logging.getLogger("asyncgrpo")

class _Stale:
    """The ending of a group that no remaining step can train (`STALE`)."""


STALE = _Stale()


class PromptSourceLike(Protocol):
    @property
    def exhausted(self) -> bool: ...

    def take(self) -> Prompt | None: ...

    def requeue(self, prompt: Prompt) -> Prompt: ...


class ScorerLike(Protocol):
    async def score(self, prompt: Prompt, completions: list[str]) -> list[Any]: ...


class Collector:
    def __init__(
        self,
        cfg: Config,
        *,
        source: PromptSourceLike,
        generator: Generator,
        scorer: ScorerLike,
        sampling: SamplingParams,
        start_step: int = 0,
        ledger: PromptLedger | None = None,
        observer: RolloutObserver | None = None,
    ) -> None:
        self.cfg = cfg
        self.observer: RolloutObserver = observer if observer is not None else NoObserver()  # rollout/events.py
        self.source = source
        self.generator = generator
        self.scorer = scorer
        self.sampling = sampling
        r = cfg.rollout
        self.group_size = r.group_size
        self.groups_per_step = r.groups_per_step
        self.max_staleness = r.max_staleness
        self.buffer = ReplayBuffer(r.max_staleness)
        self.accounting = Accounting()
        self.policy = FailurePolicy(
            max_generation_failures=r.max_generation_failures,
            drop_window=r.drop_window,
            max_drop_fraction=r.max_drop_fraction,
            max_filtered_fraction=r.max_filtered_fraction,
        )
        self.first_failure = FirstFailure()
        self._no_signal = None if r.filter_zero_variance else NoSignalWatch(r.drop_window)
        self.failure_log = FailureLog(cfg.logging.failure_summary_s)
        self.ledger = ledger if ledger is not None else PromptLedger()
        self.counters: dict[str, int] = {name: 0 for name in COUNTER_NAMES}
        self.next_step = start_step  # the index of the step whose batch is taken next
        self.in_training: list[Group] = []
        self._signal = StateSignal()
        self._in_flight: dict[int, InFlightGroup] = {}
        self._slots = RequestSlots(cfg.generation.max_inflight, self._signal)
        self._scoring = 0  # groups whose reward functions are running
        self._takes = 0
        self._seq = 0
        self._stopping = False
        self._jitter = random.Random(cfg.run.seed)
        self._last_progress: float | None = None  # loop time of the last finished rollout or trained step
        self._task_group: asyncio.TaskGroup | None = None

    # ------------------------------------------------------------------ views

    @property
    def in_flight_groups(self) -> int:
        return len(self._in_flight)

    @property
    def open_requests(self) -> int:
        return self._slots.open

    def metric_values(self) -> dict[str, int]:
        """Its gauges and counters by metric name (telemetry/keys.py), for the step's metrics line."""
        return {"rollout/inflight": self._slots.open, "buffer/size": len(self.buffer), **self.counters}

    def occupancy(self) -> int:
        """Groups admitted and not yet taken for a step (the step in training is the lag term of admission)."""
        return len(self._in_flight) + len(self.buffer)

    def raise_if_failed(self) -> None:
        """Raise the run's first fatal error, if there is one (see rollout/first_failure.py)."""
        self.first_failure.check()

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _mark_start(self) -> None:
        if self._last_progress is None:
            self._last_progress = self._now()

    def _undispatched(self) -> int:
        return sum(g.size - g.dispatched for g in self._in_flight.values())

    def _may_admit(self) -> bool:
        # Evaluated on every wake-up: the cheap necessary condition first (with no slot free no group may start),
        # before the sum over in-flight groups that may_admit_group needs.
        return self._slots.free > 0 and not self.source.exhausted and may_admit_group(
            occupancy=self.occupancy(),
            max_staleness=self.max_staleness,
            groups_per_step=self.groups_per_step,
            next_step=self.next_step,
            serving_version=self.generator.serving_version,
            free_request_slots=self._slots.free,
            undispatched_rollouts=self._undispatched(),
        )

    def _data_done(self) -> bool:
        """No group will ever reach the buffer again: the source is exhausted and nothing is in flight."""
        return self.source.exhausted and not self._in_flight

    # ------------------------------------------------------------------ dispatcher

    async def run(self) -> None:
        """Admit groups until `stop()`; owns every group task. Its waits end with `stop()` or the owner's cancellation."""
        self._mark_start()
        async with asyncio.TaskGroup() as task_group:
            self._task_group = task_group
            while True:
                await self._signal.wait_for(lambda: self._stopping or self.first_failure.failed or self._may_admit())
                if self._stopping or self.first_failure.failed:
                    break
                prompt = self.source.take()
                if prompt is None:  # the source's own word for the end of data
                    self._signal.notify()
                    continue
                self._admit(prompt)
            for group in list(self._in_flight.values()):
                if group.task is not None:
                    group.task.cancel()

    def _admit(self, prompt: Prompt) -> None:
        assert self._task_group is not None
        self._takes += 1
        group = InFlightGroup(key=self._takes, prompt=prompt, size=self.group_size)
        self.accounting.take()
        self._in_flight[group.key] = group
        group.task = self._task_group.create_task(self._run_group(group), name=f"group-{prompt.id}")
        self._signal.notify()

    def stop(self) -> None:
        """Stop admitting and cancel every in-flight group (not a failure); returns at once, `run()` winds down."""
        self._stopping = True
        self._signal.notify()
        for line in self.failure_log.flush(self._now()):
            log.warning(line)

    # ------------------------------------------------------------------ one group

    async def _run_group(self, group: InFlightGroup) -> None:
        async with asyncio.TaskGroup() as members:
            for member in range(group.size):
                slot = await self._slots.acquire()
                group.dispatched += 1
                task = members.create_task(self._run_rollout(group, member, slot), name=f"rollout-{group.prompt.id}-{member}")
                slot.release_with(task)
        await self._finish_group(group)

    async def _run_rollout(self, group: InFlightGroup, member: int, slot: Slot) -> None:
        request = rollout_request(self.cfg.run.seed, group.prompt, member, self.sampling)
        result: Completion | Exception
        self.observer.rollout_started(group.key, group.prompt.id, member, self._now())
        try:
            with slot:
                result = await self._generate_with_retries(request, group, member, slot)
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                self.observer.rollout_ended(group.key, member, "cancelled", group.dispatch_versions[member], 0, self._now())
                raise  # we were cancelled (stale, shutdown): not a failure
            # The backend raised CancelledError on its own (some clients do): a failed rollout.
            result = GenerationError(f"the backend cancelled request {request.request_id} by itself", backend=self.generator.name)
            result.__cause__ = exc
        except Exception as exc:  # noqa: BLE001 - classified: retries are exhausted, or not retryable, or fatal
            result = exc
        if isinstance(result, Completion):
            group.completions[member] = result
            self.counters["rollout/generated_tokens_total"] += len(result.token_ids)
        else:
            group.errors[member] = result
            self.counters["rollout/failed_total"] += 1
            if isinstance(result, FatalBackendError):
                self._fail_run(backend_fatal(result, self.generator.name, group.dispatch_versions[member], self.next_step))
            else:
                self._tolerated("failed", result)
        tokens = len(result.token_ids) if isinstance(result, Completion) else 0
        outcome: RolloutOutcome = "finished" if isinstance(result, Completion) else "failed"
        self.observer.rollout_ended(group.key, member, outcome, group.dispatch_versions[member], tokens, self._now())
        self._last_progress = self._now()  # a rollout finished (a cancelled one never gets here)

    async def _generate_with_retries(self, request: GenerationRequest, group: InFlightGroup, member: int, slot: Slot) -> Completion:
        """One rollout under the retry policy (rollout/retry.py); a rollout waiting to retry holds no request slot."""

        def record_dispatch() -> None:
            group.dispatch_versions[member] = self.generator.serving_version

        def count_retry(error: TransientGenerationError) -> None:
            self.counters["rollout/retries_total"] += 1
            self._tolerated("retried", error)

        return await generate_with_retries(
            self.generator, request, self.cfg.generation, jitter=self._jitter,
            before_attempt=record_dispatch, on_retry=count_retry, between_attempts=slot.released_for,
        )

    async def _finish_group(self, group: InFlightGroup) -> None:
        """Judge the finished group (rollout/judge.py) around the scoring of its survivors, and end it."""
        r = self.cfg.rollout
        completions = survivors(group.completions, group.errors, min_survivors=r.min_group_survivors)
        if isinstance(completions, Drop):
            self._end(group, completions)
            return
        self._scoring += 1
        try:
            scored = await self.scorer.score(group.prompt, [c.text for c in completions])
        except RewardError as exc:
            self._last_progress = self._now()
            if self.cfg.reward.on_error == "fail":
                self._fail_run(reward_failed(exc, group.version_floor(), self.next_step))
            else:
                self._tolerated("reward_error", exc)
            self._end(group, Drop("reward_error", exc))
            return
        finally:
            self._scoring -= 1
        self._last_progress = self._now()  # scoring a group is progress, however long the reward took
        rollouts = scored_rollouts(
            group.prompt, completions, scored, min_survivors=r.min_group_survivors,
            filter_zero_variance=r.filter_zero_variance, scale_by_std=self.cfg.train.loss.scale_by_std,
        )
        if isinstance(rollouts, Drop):
            self._end(group, rollouts)
            return
        if self._no_signal is not None and (warning := self._no_signal.observe(len({r.reward for r in rollouts}) == 1)):
            log.warning(warning)
        self._seq += 1
        finished = Group(prompt=group.prompt, rollouts=rollouts, seq=self._seq, failed_rollouts=group.size - len(completions))
        if is_stale(generation_version=finished.generation_version, step=self.next_step, max_staleness=self.max_staleness):
            self._end(group, STALE)
        else:
            self._end(group, finished)

    # ------------------------------------------------------------------ endings

    def _end(self, group: InFlightGroup, ending: Group | Drop | _Stale) -> None:
        """The one way an in-flight group ends: buffered (a `Group`), dropped (a `Drop`), or `STALE`:
        cancelled because no remaining step can train it (its rollouts aborted, its prompt requeued or dropped)."""
        del self._in_flight[group.key]
        if isinstance(ending, Group):
            self.observer.take_ended(group.key, group.prompt.id, "buffered", ending.seq, self._now())
            self.accounting.buffer()
            self.buffer.put(ending)
            self._judge_ending(group, "success", None)
        elif isinstance(ending, Drop):
            self.observer.take_ended(group.key, group.prompt.id, ending.reason, None, self._now())
            self.accounting.drop_in_flight(ending.reason)
            self._count_drop(ending.reason, group.prompt)
            self._judge_ending(group, ending.reason, ending.error)  # type: ignore[arg-type]
        else:
            if group.task is not None and group.task is not asyncio.current_task():
                group.task.cancel()
            self._count_stale(sum(c is not None for c in group.completions), group.finished_tokens())
            prompt = group.prompt
            if self.cfg.rollout.on_stale == "requeue" and prompt.requeues < self.cfg.rollout.max_requeues:
                self.observer.take_ended(group.key, prompt.id, "requeued", None, self._now())
                self.accounting.requeue_in_flight()
                self.counters["rollout/requeued_total"] += 1
                self.source.requeue(prompt)
            else:
                self.observer.take_ended(group.key, prompt.id, "stale", None, self._now())
                self.accounting.drop_in_flight("stale")
                self._count_drop("stale", prompt)
        self._signal.notify()

    def _count_stale(self, samples: int, tokens: int) -> None:
        """A group thrown away as stale, in flight or buffered, with its finished samples and their tokens."""
        self.counters["rollout/stale_groups_total"] += 1
        self.counters["rollout/stale_samples_total"] += samples
        self.counters["rollout/wasted_tokens_total"] += tokens

    def _count_drop(self, reason: DropReason, prompt: Prompt) -> None:
        self.counters["rollout/dropped_groups_total"] += 1
        self.counters[f"rollout/dropped/{reason}"] += 1
        self.ledger.dropped(prompt, reason, self.next_step)

    def _judge_ending(self, group: InFlightGroup, ending: GroupEnding, error: BaseException | None) -> None:
        verdict = self.policy.record(ending, error)
        if verdict is None:
            return
        version = min((v for v in group.dispatch_versions if v is not None), default=None)
        self._fail_run(policy_broken(verdict, self.generator.name, version, self.next_step))

    def _tolerated(self, what: Tolerated, error: BaseException) -> None:
        source = "the reward functions" if isinstance(error, RewardError) else getattr(error, "backend", "") or self.generator.name
        for line in self.failure_log.record(what, type(error).__name__, source, str(error), self._now()):
            log.warning(line)

    def _fail_run(self, diagnostic: Diagnostic) -> None:
        self.first_failure.fail(diagnostic)
        self._signal.notify()

    def _cancel_stale(self) -> None:
        for group in list(self._in_flight.values()):
            floor = group.version_floor()
            if floor is not None and is_stale(generation_version=floor, step=self.next_step, max_staleness=self.max_staleness):
                self._end(group, STALE)

    def _drop_stale_buffered(self, step: int) -> None:
        for group in self.buffer.remove_stale(step):
            self.observer.buffered_ended([group.seq], "stale", step, self._now())
            self.accounting.drop_buffered("stale")
            self._count_drop("stale", group.prompt)
            self._count_stale(len(group.rollouts), sum(len(r.completion.token_ids) for r in group.rollouts))

    # ------------------------------------------------------------------ the trainer's side

    async def next_batch(self, step: int, stall_timeout_s: float) -> list[Group] | None:
        """Wait for step `step`'s batch: `groups_per_step` trainable groups, oldest first.

        Returns a smaller final batch at end of data (unless `data.drop_last`), None when no
        group is left to train, raises the run's diagnostic if it failed, and `StallError` if
        no rollout finished and no step trained for `stall_timeout_s`.
        """
        if step != self.next_step:
            raise AssertionError(f"next_batch({step}) but the next step is {self.next_step}")
        self._mark_start()
        while True:
            self.raise_if_failed()
            self._drop_stale_buffered(step)
            if len(self.buffer) >= self.groups_per_step:
                return self._take(step, self.groups_per_step)
            if self._data_done():
                if len(self.buffer) and not self.cfg.data.drop_last:
                    return self._take(step, len(self.buffer))
                return None
            assert self._last_progress is not None
            deadline = self._last_progress + stall_timeout_s
            if self._now() >= deadline:
                self._fail_run(self._stalled(step, stall_timeout_s))
                continue
            try:
                async with asyncio.timeout_at(deadline):
                    await self._signal.wait_for(
                        lambda: len(self.buffer) >= self.groups_per_step or self._data_done() or self.first_failure.failed
                    )
            except TimeoutError:
                pass  # the loop re-checks: progress may have moved the deadline

    def _take(self, step: int, n: int) -> list[Group]:
        batch = self.buffer.take(n)
        for group in batch:
            if is_stale(generation_version=group.generation_version, step=step, max_staleness=self.max_staleness):
                raise AssertionError(f"group of version {group.generation_version} taken for step {step} with K={self.max_staleness}")
        self.in_training = batch
        self.next_step = step + 1
        self._cancel_stale()
        self._drop_stale_buffered(self.next_step)
        self._signal.notify()
        return batch

    def step_trained(self) -> None:
        """The step that took `in_training` has completed and its weights are published."""
        self.accounting.train_buffered(len(self.in_training))
        self.observer.buffered_ended([g.seq for g in self.in_training], "trained", self.next_step - 1, self._now())
        for group in self.in_training:
            self.ledger.trained(group.prompt, self.next_step - 1)
        self.in_training = []
        self._last_progress = self._now()
        self._signal.notify()

    def weights_published(self) -> None:
        """A generator's serving version changed: admission may open."""
        self._signal.notify()

    def _stalled(self, step: int, stall_timeout_s: float) -> Diagnostic:
        state = (f"{len(self.buffer)} buffered, {len(self._in_flight)} groups in flight with {self._slots.open} requests "
                 f"open and {self._scoring} being scored, source exhausted: {self.source.exhausted}")
        return stalled(step, stall_timeout_s, self.groups_per_step, state, self.generator.name, self.generator.serving_version)
