"""The collector: runs each admitted prompt's group of rollouts, and hands how each rollout, group and take ended to the books.

One `Collector` owns, for one run: the admission loop, a task per in-flight group (and under it a
task per rollout), the request slots and the run's first fatal error. It asks the staleness policy
(rollout/stale_policy.py) which step a new group targets and whether a finished group is trainable,
leaves what becomes of the rollouts the steps leave behind to the policy's runner (rollout/resumption.py:
cancel the group, or interrupt and resume its rollouts), hands every ending to the books
(rollout/books.py; it updates none of their records itself) and every finished group to the trainer's
side (rollout/batches.py: the buffer and each step's batch). It has no mode switch on the policy. Its
state lives on one event loop and changes only in synchronous code, each change followed by
`StateSignal.notify()`.

Invariants (DESIGN.md §2):
- Every in-flight group ends exactly once, through `_end`: buffered, dropped, or stale (cancelled:
  requests aborted, slots freed, its prompt requeued or dropped as the policy says); whoever ends
  it first removes it from `_in_flight`, and only a group still there can be ended. Each ending
  reaches the books in one call.
- A group no remaining step can train is cancelled as soon as the steps move past it (`_cancel_stale`), unless the runner
  resumes it, or when it is dispatched, or finishes, after that; under resume also at a publication that rules it out.
- Errors are never swallowed: a rollout error is retried (transient) or fails the rollout; judged
  groups feed the failure policy; a broken budget, a misconfigured backend or a fatal reward error
  becomes the run's sticky diagnostic (`raise_if_failed()`). Cancellation is never a failure.
- Tasks: `run()` owns a TaskGroup with one task per in-flight group, each group task a TaskGroup
  with one task per dispatched rollout; `stop()` cancels them all, and work unfinished at exit
  stays reported as in flight or buffered.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Coroutine, Mapping
from typing import Literal

from asyncgrpo.algorithms.base import Algorithm
from asyncgrpo.config import Config, EnvConfig
from asyncgrpo.environments.conversation import Codec
from asyncgrpo.environments.hosts import open_host
from asyncgrpo.environments.protocol import EnvironmentHost
from asyncgrpo.errors import Diagnostic, FatalBackendError, GenerationError, RewardError, TeacherError
from asyncgrpo.generation.base import Generator
from asyncgrpo.rollout.accounting import Accounting
from asyncgrpo.rollout.admission import is_stale, may_admit_group
from asyncgrpo.rollout.batches import Batches
from asyncgrpo.rollout.books import Books
from asyncgrpo.rollout.diagnostics import backend_fatal, policy_broken, scoring_failed, stalled
from asyncgrpo.rollout.episode import EpisodeRunner, add_env_reward
from asyncgrpo.rollout.events import RolloutObserver
from asyncgrpo.rollout.failure_log import FailureLog, Tolerated, source_of
from asyncgrpo.rollout.failures import FailurePolicy, Verdict
from asyncgrpo.rollout.first_failure import FirstFailure
from asyncgrpo.rollout.in_flight import InFlightGroup, rollout_request
from asyncgrpo.rollout.judge import survivors
from asyncgrpo.rollout.ledger import PromptLedger
from asyncgrpo.rollout.no_signal import NoSignalWatch
from asyncgrpo.rollout.ports import PromptSourceLike, ScorerLike
from asyncgrpo.rollout.resumption import runner_for
from asyncgrpo.rollout.retry import generate_with_retries
from asyncgrpo.rollout.slots import RequestSlots, Slot
from asyncgrpo.rollout.stale_policy import stale_policy
from asyncgrpo.sync import SharedTimeout, StateSignal
from asyncgrpo.types import Completion, Drop, GenerationRequest, Group, Prompt, SamplingParams

log = logging.getLogger("asyncgrpo")
STALE: Literal["stale"] = "stale"  # the ending of a group that no remaining step can train


class Collector:
    def __init__(
        self,
        cfg: Config,
        *,
        source: PromptSourceLike,
        generator: Generator,
        scorer: ScorerLike,
        algorithm: Algorithm,
        sampling: SamplingParams,
        start_step: int = 0,
        accounting: Accounting | None = None,
        counters: Mapping[str, int] | None = None,
        ledger: PromptLedger | None = None,
        observer: RolloutObserver | None = None,
        codec: Codec | None = None,
        host_factory: Callable[[EnvConfig], EnvironmentHost] = open_host,
    ) -> None:
        """`accounting`, `counters` and `ledger` continue a checkpoint's (rollout/books.py). `codec` renders and tokenizes an
        episode's messages, `host_factory` makes each episode's host (the simulator's own): both for an `env:`
        section (rollout/episode.py)."""
        self.cfg = cfg
        self.source = source
        self.generator = generator
        self.scorer = scorer
        self.algorithm = algorithm  # the unit, judging a scored unit (algorithms/)
        self.sampling = sampling
        r = cfg.rollout
        self.max_staleness = r.max_staleness
        self.books = Books(FailurePolicy.from_rollout(r), accounting=accounting, ledger=ledger, counters=counters, observer=observer)
        self.stale = stale_policy(r)  # rollout.on_stale: the policy decides, its runner acts on rollouts left behind
        self._left_behind = runner_for(self.stale, self.books, continues_in_flight=getattr(generator, "continues_in_flight", False),
                                       episode_tokens=cfg.env.max_tokens if cfg.env is not None else None)
        self.first_failure = FirstFailure()
        self._no_signal = NoSignalWatch(r.drop_window) if algorithm.watches_no_signal and not r.filter_zero_variance else None
        self.failure_log = FailureLog(cfg.logging.failure_summary_s)
        self._signal = StateSignal()
        self._in_flight: dict[int, InFlightGroup] = {}
        self._undispatched = 0  # running sum of `size - dispatched` over `_in_flight`: admission reads it on every wake-up
        self._slots = RequestSlots(cfg.generation.max_inflight, self._signal)
        self._attempt_timeouts = SharedTimeout(cfg.generation.request_timeout_s)  # one loop timer for every rollout's attempts
        self.batches = Batches(cfg, books=self.books, stale=self.stale, signal=self._signal, first_failure=self.first_failure,
                               in_flight=self._in_flight, source=source, start_step=start_step, on_advance=self._cancel_stale, stalled=self._stalled)
        self._scoring = 0  # groups whose reward functions are running
        self._seq = 0
        self._stopping = False
        self._jitter = random.Random(cfg.run.seed)
        self._task_group: asyncio.TaskGroup | None = None
        self._episodes = EpisodeRunner.of_run(cfg, codec, self.counters, self._jitter, host_factory)  # env: a rollout is an episode
        self._generate = self._left_behind.rollouts(self._generate_with_retries)  # a rollout: one request, or a resumed chain

    # ------------------------------------------------------------------ views

    @property
    def accounting(self) -> Accounting:
        return self.books.accounting

    @property
    def counters(self) -> dict[str, int]:
        return self.books.counters

    @property
    def next_step(self) -> int:
        """The index of the step whose batch is taken next."""
        return self.batches.next_step

    @property
    def in_flight_groups(self) -> int:
        return len(self._in_flight)

    @property
    def open_requests(self) -> int:
        return self._slots.open

    def metric_values(self) -> dict[str, int]:
        """Its gauges and counters by metric name (metric_names.py), for the step's metrics line."""
        return {"rollout/inflight": self._slots.open, "buffer/size": len(self.batches.buffer),
                "rollout/trained_version_span": self.batches.version_span, **self.counters}

    def raise_if_failed(self) -> None:
        """Raise the run's first fatal error, if there is one (see rollout/first_failure.py)."""
        self.first_failure.check()

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    @property
    def undispatched_rollouts(self) -> int:
        """Rollouts of in-flight groups still waiting for a request slot: O(1), kept where groups start, dispatch and end."""
        return self._undispatched

    def _may_admit(self) -> bool:
        # Evaluated on every wake-up of the dispatcher, O(1): counts only, no scan of the groups in flight. The occupancy is the
        # groups admitted and not yet taken for a step (the step in training is the lag term of admission, rollout/admission.py).
        return self._slots.free > 0 and not self.source.exhausted and may_admit_group(
            occupancy=len(self._in_flight) + len(self.batches.buffer), max_staleness=self.max_staleness, next_step=self.next_step,
            groups_per_step=self.cfg.rollout.groups_per_step, serving_version=self.generator.serving_version,
            free_request_slots=self._slots.free, undispatched_rollouts=self._undispatched, over_admit_groups=self.cfg.rollout.over_admit_groups,
        )

    # ------------------------------------------------------------------ dispatcher

    async def run(self) -> None:
        """Admit groups until `stop()`; owns every group task. Its waits end with `stop()` or the owner's cancellation."""
        self.batches.mark_start()
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
        group = InFlightGroup(key=self.books.take(), prompt=prompt, size=self.cfg.rollout.group_size)
        group.target_step = self.stale.target(self.next_step, self.generator.serving_version + self.max_staleness)
        self._in_flight[group.key] = group
        self._undispatched += group.size
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
                self._undispatched -= group.key in self._in_flight  # an ended group's rest was subtracted by `_end`
                task = members.create_task(self._run_rollout(group, member, slot), name=f"rollout-{group.prompt.id}-{member}")
                group.member_tasks[member] = task
                slot.release_with(task)
        await self._finish_group(group)

    async def _run_rollout(self, group: InFlightGroup, member: int, slot: Slot) -> None:
        request = rollout_request(self.cfg.run.seed, group.prompt, member, self.sampling)
        result: Completion | Exception
        started = self._now()
        self.books.rollout_started(group, member, started)
        try:
            with slot:
                if self._episodes is not None:  # an episode (rollout/episode.py): each turn generated as a plain rollout is
                    result = await self._episodes.run(
                        group.prompt, request, lambda turn, floor: self._generate(turn, group, member, slot, floor),
                        on_retry=self._retried, between_attempts=slot.released_for, on_progress=self.batches.progressed,
                    )  # an episode's turn is progress: the stall bound need not cover env.max_turns turns
                else:  # one request, or under rollout.on_stale: resume a chain of them (rollout/resumption.py)
                    result = await self._generate(request, group, member, slot)
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                self.books.rollout_cancelled(group, member, self._now() - started, self._now())
                raise  # we were cancelled (stale, shutdown): not a failure
            # The backend raised CancelledError on its own (some clients do): a failed rollout.
            result = GenerationError(f"the backend cancelled request {request.request_id} by itself", backend=self.generator.name)
            result.__cause__ = exc
        except Exception as exc:  # noqa: BLE001 - classified: retries are exhausted, or not retryable, or fatal
            result = exc
        self.books.rollout_ended(group, member, result, self._now() - started, self._now())
        if isinstance(result, FatalBackendError):
            self._fail_run(backend_fatal(result, self.generator.name, group.dispatch_versions[member], self.next_step))
        elif not isinstance(result, Completion):
            self._tolerated("failed", result)
        self.batches.progressed()  # a rollout finished (a cancelled one never gets here)

    def _generate_with_retries(
        self, request: GenerationRequest, group: InFlightGroup, member: int, slot: Slot, floor: int | None = None
    ) -> Coroutine[object, object, Completion]:
        """A rollout's request under the retry policy (rollout/retry.py); a rollout waiting to retry holds no request slot.
        `floor`: the oldest version of an episode's earlier turns, kept as the member's dispatch version. Returns the retry
        loop's coroutine itself, not a coroutine wrapping it: one coroutine fewer per rollout in flight."""

        def record_dispatch() -> None:
            version = self.generator.serving_version
            group.dispatch_versions[member] = version = version if floor is None else min(version, floor)
            if group.key in self._in_flight and is_stale(generation_version=version, step=self.next_step, max_staleness=self.max_staleness):
                # Admitted before the step that made its version stale was taken, dispatched after: it would be generated
                # in vain. It ends now as stale; its cancellation reaches this request at its first await, as any stale one.
                self._end(group, STALE)

        return generate_with_retries(
            self.generator, request, self.cfg.generation, jitter=self._jitter,
            before_attempt=record_dispatch, on_retry=self._retried, between_attempts=slot.released_for,
            timeouts=self._attempt_timeouts,
        )

    def _retried(self, error: Exception) -> None:
        self.books.retried()
        self._tolerated("retried", error)

    async def _finish_group(self, group: InFlightGroup) -> None:
        """Judge the finished group (rollout/judge.py) around the scoring of its survivors, and end it."""
        completions = survivors(*group.kept(), min_survivors=self.cfg.rollout.min_group_survivors)
        if isinstance(completions, Drop):
            self._end(group, completions)
            return
        self._scoring += 1
        try:
            scored = await self.scorer.score(group.prompt, completions)
            if self.cfg.env is not None:
                scored = add_env_reward(scored, completions, self.cfg.env, group.prompt)
        except (RewardError, TeacherError) as exc:
            self.batches.progressed()
            if (fatal := scoring_failed(exc, self.cfg, group.version_floor(), self.next_step)) is not None:
                self._fail_run(fatal)
            else:
                self._tolerated("reward_error", exc)
            self._end(group, Drop("reward_error", exc))
            return
        finally:
            self._scoring -= 1
        self.batches.progressed()  # scoring a group is progress, however long the reward took
        rollouts = self.algorithm.judge(group.prompt, completions, scored)
        if isinstance(rollouts, Drop):
            self._end(group, rollouts)
            return
        if self._no_signal is not None and (warning := self._no_signal.observe(len({r.reward for r in rollouts}) == 1)):
            log.warning(warning)
        self._seq += 1
        kept = [r.completion for r in rollouts]
        finished = Group(prompt=group.prompt, rollouts=rollouts, seq=self._seq, failed_rollouts=sum(e is not None for e in group.errors),
                         generation_ms=group.ms_of(kept), target_step=group.target_step,
                         max_staleness=self._left_behind.bound_of(group))
        trainable, masked = self.stale.trainable(finished, self.next_step)  # resume: tokens older than the bound masked out
        if trainable is not None:  # a stale group's finished tokens are all wasted as stale, its unscored ones among them
            self.books.unscored(group.finished_tokens() - sum(c.model_tokens for c in kept))
        self.books.masked(masked)
        self._end(group, STALE if trainable is None else trainable)

    # ------------------------------------------------------------------ endings

    def _end(self, group: InFlightGroup, ending: Group | Drop | Literal["stale"]) -> None:
        """The one way an in-flight group ends: buffered (a `Group`), dropped (a `Drop`), or `STALE`:
        cancelled because no remaining step can train it (its rollouts aborted, its prompt requeued or dropped)."""
        del self._in_flight[group.key]
        self._undispatched -= group.size - group.dispatched
        verdict: Verdict | None = None
        if isinstance(ending, Group):
            verdict = self.books.buffered(group, ending, self._now())
            self.batches.buffer.put(ending)
        elif isinstance(ending, Drop):
            self.stale.release(group.target_step)
            verdict = self.books.dropped(group, ending, self.next_step, self._now())
        else:
            self.stale.release(group.target_step)
            if group.task is not None and group.task is not asyncio.current_task():
                group.task.cancel()
            # A group's stale samples are its finished ones; a distilled sample is the unit, so it counts finished or not.
            samples = group.live_members() if self.algorithm.per_sample else sum(c is not None for c in group.completions)
            fate = self.stale.left_behind(group.prompt)
            self.books.left_behind(group, samples, fate, self.next_step, self._now())
            if fate == "requeue":
                self.source.requeue(group.prompt)
        if verdict is not None:
            version = min((v for v in group.dispatch_versions if v is not None), default=None)
            self._fail_run(policy_broken(verdict, self.generator.name, version, self.next_step))
        self._signal.notify()

    def _tolerated(self, what: Tolerated, error: BaseException) -> None:
        for line in self.failure_log.record(what, type(error).__name__, source_of(error, self.generator.name), str(error), self._now()):
            log.warning(line)

    def _fail_run(self, diagnostic: Diagnostic) -> None:
        self.first_failure.fail(diagnostic)
        self._signal.notify()

    def _cancel_stale(self) -> None:
        for group in list(self._in_flight.values()):
            floor = group.version_floor()
            stale = floor is not None and is_stale(generation_version=floor, step=self.next_step, max_staleness=self.max_staleness)
            if stale and not self._left_behind.resume(group, self.next_step):  # resume: its rollouts behind interrupted instead
                self._end(group, STALE)

    # ------------------------------------------------------------------ the trainer's side (rollout/batches.py)

    async def next_batch(self, step: int, stall_timeout_s: float) -> list[Group] | None:
        """Step `step`'s batch, once it is ready (`Batches.next_batch`)."""
        return await self.batches.next_batch(step, stall_timeout_s)

    def step_trained(self) -> None:
        """The step that took the batch in training has completed and its weights are published."""
        self.batches.step_trained()

    @property
    def steps_trained(self) -> int:
        return self.batches.steps_trained

    def weights_published(self) -> None:
        """A generator's serving version changed: admission may open; under `rollout.on_stale: resume` running rollouts of an older
        version are interrupted to continue under the new one, and groups the masked-share limit already rules out end stale."""
        for group in self._left_behind.weights_published(self._in_flight.values(), self.generator.serving_version, self.next_step):
            self._end(group, STALE)
        self._signal.notify()

    def _stalled(self, step: int, stall_timeout_s: float) -> Diagnostic:
        return stalled(step, stall_timeout_s, self.cfg, buffered=len(self.batches.buffer), in_flight=len(self._in_flight),
                       open_requests=self._slots.open, scoring=self._scoring, scoring_state=self.algorithm.scoring_state(self.scorer),
                       exhausted=self.source.exhausted, backend=self.generator.name, serving_version=self.generator.serving_version)
