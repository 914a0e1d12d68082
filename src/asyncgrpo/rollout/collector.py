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
  cancelled (requests aborted, slots freed) as soon as the steps move past them; the staleness
  policy (rollout/stale_policy.py) decides what a step waits for before it moves.
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
from collections.abc import Callable
from typing import Any, Protocol

from asyncgrpo.config import Config, EnvConfig
from asyncgrpo.distill.judge import taught_rollouts
from asyncgrpo.environments.conversation import Codec
from asyncgrpo.environments.hosts import open_host
from asyncgrpo.environments.protocol import EnvironmentHost
from asyncgrpo.errors import Diagnostic, FatalBackendError, GenerationError, RewardError, TeacherError, TransientGenerationError
from asyncgrpo.generation.base import Generator
from asyncgrpo.rollout import token_books
from asyncgrpo.rollout.accounting import Accounting
from asyncgrpo.rollout.admission import is_stale, may_admit_group
from asyncgrpo.rollout.buffer import ReplayBuffer
from asyncgrpo.rollout.diagnostics import backend_fatal, policy_broken, reward_failed, stalled, teacher_failed
from asyncgrpo.rollout.episode import EpisodeRunner, add_env_reward, count_episode
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
from asyncgrpo.rollout.stale_policy import StepTargets, is_straggler, may_finish_early, patience_deadline
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
    """Scores a group's survivors, given as `Completion`s: the reward functions (rewards/scoring.py) get their texts (an
    episode's messages) and token ids; under `algorithm: distill` the teacher (distill/teacher.py) scores their token ids."""

    async def score(self, prompt: Prompt, completions: list[Any]) -> list[Any]: ...


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
        codec: Codec | None = None,
        host_factory: Callable[[EnvConfig], EnvironmentHost] = open_host,
        accounting: Accounting | None = None,
    ) -> None:
        """`codec` renders and tokenizes an episode's messages, `host_factory` makes each episode's host (the
        simulator's own): both for an `env:` section (rollout/episode.py). `accounting`: a resumed run's books
        (`Accounting.resumed`); a fresh one when None."""
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
        self.accounting = accounting if accounting is not None else Accounting()
        self.policy = FailurePolicy(
            max_generation_failures=r.max_generation_failures,
            drop_window=r.drop_window,
            max_drop_fraction=r.max_drop_fraction,
            max_filtered_fraction=r.max_filtered_fraction,
        )
        self.first_failure = FirstFailure()
        self.per_sample = cfg.algorithm == "distill"  # each sample is its own unit, scored by the teacher (distill/)
        self._no_signal = None if r.filter_zero_variance or self.per_sample else NoSignalWatch(r.drop_window)
        self.failure_log = FailureLog(cfg.logging.failure_summary_s)
        self.ledger = ledger if ledger is not None else PromptLedger()
        self.counters: dict[str, int] = {name: 0 for name in COUNTER_NAMES}
        self.next_step = start_step  # the index of the step whose batch is taken next
        self.in_training: list[Group] = []
        self._signal = StateSignal()
        self._in_flight: dict[int, InFlightGroup] = {}
        self._slots = RequestSlots(cfg.generation.max_inflight, self._signal)
        self._scoring = 0  # groups whose reward functions are running
        self._seq = 0
        self._stopping = False
        self._jitter = random.Random(cfg.run.seed)
        self._last_progress: float | None = None  # loop time of the last finished rollout, episode turn or trained step
        self._task_group: asyncio.TaskGroup | None = None
        self._episodes: EpisodeRunner | None = None  # env: each rollout is an episode, its slot held for the whole episode
        if cfg.env is not None:
            if codec is None:
                raise ValueError("a Collector with an env: section needs the codec that tokenizes its episodes")
            self._episodes = EpisodeRunner(
                cfg.env, cfg.generation, codec, self.counters, prompt_key=cfg.data.prompt_key,
                max_prompt_tokens=cfg.data.max_prompt_tokens, jitter=self._jitter, host_factory=host_factory,
            )
        self._targets = StepTargets(r.groups_per_step) if r.on_stale == "wait" else None  # rollout/stale_policy.py
        self._step_started: float | None = None  # loop time the batch in training was taken
        self._last_step_s: float | None = None  # how long the last step trained (the unit of rollout.patience_share)

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
            over_admit_groups=self.cfg.rollout.over_admit_groups,
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
        self.accounting.take()  # the take's key is its number in the run (a resumed run's accounting continues it)
        group = InFlightGroup(key=self.accounting.taken, prompt=prompt, size=self.group_size)
        if self._targets is not None:
            group.target_step = self._targets.assign(self.next_step, self.generator.serving_version + self.max_staleness)
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
                group.member_tasks[member] = task
                slot.release_with(task)
        await self._finish_group(group)

    async def _run_rollout(self, group: InFlightGroup, member: int, slot: Slot) -> None:
        request = rollout_request(self.cfg.run.seed, group.prompt, member, self.sampling)
        result: Completion | Exception
        started = self._now()
        self.observer.rollout_started(group.key, group.prompt.id, member, started)
        try:
            with slot:
                if self._episodes is not None:
                    result = await self._run_episode(self._episodes, request, group, member, slot)
                else:
                    result = await self._generate_with_retries(request, group, member, slot)
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                self.observer.rollout_ended(group.key, member, "cancelled", group.dispatch_versions[member], 0, self._now())
                token_books.rollout_ended(self.counters, self._now() - started)
                raise  # we were cancelled (stale, shutdown): not a failure
            # The backend raised CancelledError on its own (some clients do): a failed rollout.
            result = GenerationError(f"the backend cancelled request {request.request_id} by itself", backend=self.generator.name)
            result.__cause__ = exc
        except Exception as exc:  # noqa: BLE001 - classified: retries are exhausted, or not retryable, or fatal
            result = exc
        if isinstance(result, Completion):
            group.completions[member] = result
            self.counters["rollout/generated_tokens_total"] += result.model_tokens
            count_episode(self.counters, result)
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
        group.ms[member] = token_books.rollout_ended(self.counters, self._now() - started)
        self._last_progress = self._now()  # a rollout finished (a cancelled one never gets here)

    async def _generate_with_retries(
        self, request: GenerationRequest, group: InFlightGroup, member: int, slot: Slot, floor: int | None = None
    ) -> Completion:
        """One rollout under the retry policy (rollout/retry.py); a rollout waiting to retry holds no request slot.
        `floor`: the oldest version of an episode's earlier turns, kept as the member's dispatch version."""

        def record_dispatch() -> None:
            version = self.generator.serving_version
            group.dispatch_versions[member] = version = version if floor is None else min(version, floor)
            if group.key in self._in_flight and is_stale(generation_version=version, step=self.next_step, max_staleness=self.max_staleness):
                # Admitted before the step that made its version stale was taken, dispatched after: it would be generated
                # in vain. It ends now as stale; its cancellation reaches this request at its first await, as any stale one.
                self._end(group, STALE)

        def count_retry(error: TransientGenerationError) -> None:
            self.counters["rollout/retries_total"] += 1
            self._tolerated("retried", error)

        return await generate_with_retries(
            self.generator, request, self.cfg.generation, jitter=self._jitter,
            before_attempt=record_dispatch, on_retry=count_retry, between_attempts=slot.released_for,
        )

    async def _run_episode(self, episodes: EpisodeRunner, request: GenerationRequest, group: InFlightGroup, member: int, slot: Slot) -> Completion:
        """One rollout as an episode (rollout/episode.py), its turns generated under the retry policy."""

        def count_retry(error: Exception) -> None:
            self.counters["rollout/retries_total"] += 1
            self._tolerated("retried", error)

        def turn_ended() -> None:  # an episode's turn is progress: the stall bound need not cover env.max_turns turns
            self._last_progress = self._now()

        return await episodes.run(
            group.prompt, request, lambda turn, floor: self._generate_with_retries(turn, group, member, slot, floor),
            on_retry=count_retry, between_attempts=slot.released_for, on_progress=turn_ended,
        )

    async def _finish_group(self, group: InFlightGroup) -> None:
        """Judge the finished group (rollout/judge.py) around the scoring of its survivors, and end it."""
        r = self.cfg.rollout
        completions = survivors(*group.kept(), min_survivors=r.min_group_survivors)
        if isinstance(completions, Drop):
            self._end(group, completions)
            return
        self._scoring += 1
        try:
            scored = await self.scorer.score(group.prompt, completions)
            if self.cfg.env is not None:
                scored = add_env_reward(scored, completions, self.cfg.env, group.prompt)
        except (RewardError, TeacherError) as exc:
            self._last_progress = self._now()
            on_error = self.cfg.distill.on_error if isinstance(exc, TeacherError) else self.cfg.reward.on_error
            if on_error == "fail":
                version = group.version_floor()
                self._fail_run(teacher_failed(exc, version, self.next_step) if isinstance(exc, TeacherError)
                               else reward_failed(exc, version, self.next_step))
            else:
                self._tolerated("reward_error", exc)
            self._end(group, Drop("reward_error", exc))
            return
        finally:
            self._scoring -= 1
        self._last_progress = self._now()  # scoring a group is progress, however long the reward took
        rollouts = taught_rollouts(completions, scored) if self.per_sample else scored_rollouts(
            group.prompt, completions, scored, min_survivors=r.min_group_survivors,
            filter_zero_variance=r.filter_zero_variance, scale_by_std=self.cfg.train.loss.scale_by_std,
        )
        if isinstance(rollouts, Drop):
            self._end(group, rollouts)
            return
        if self._no_signal is not None and (warning := self._no_signal.observe(len({r.reward for r in rollouts}) == 1)):
            log.warning(warning)
        self._seq += 1
        kept = [r.completion for r in rollouts]
        token_books.group_wasted(self.counters, "failed", group.finished_tokens() - sum(c.model_tokens for c in kept))  # unscored
        finished = Group(prompt=group.prompt, rollouts=rollouts, seq=self._seq, failed_rollouts=sum(e is not None for e in group.errors),
                         generation_ms=group.ms_of(kept), target_step=group.target_step)
        if is_stale(generation_version=finished.generation_version, step=self.next_step, max_staleness=self.max_staleness):
            self._end(group, STALE)
        else:
            self._end(group, finished)

    # ------------------------------------------------------------------ endings

    def _end(self, group: InFlightGroup, ending: Group | Drop | _Stale) -> None:
        """The one way an in-flight group ends: buffered (a `Group`), dropped (a `Drop`), or `STALE`:
        cancelled because no remaining step can train it (its rollouts aborted, its prompt requeued or dropped)."""
        del self._in_flight[group.key]
        if not isinstance(ending, Group):
            self._untarget(group.target_step)
        if isinstance(ending, Group):
            self.observer.take_ended(group.key, group.prompt.id, "buffered", ending.seq, self._now())
            self.accounting.buffer()
            self.buffer.put(ending)
            self._judge_ending(group, "success", None)
        elif isinstance(ending, Drop):
            self.observer.take_ended(group.key, group.prompt.id, ending.reason, None, self._now())
            self.accounting.drop_in_flight(ending.reason)
            self._count_drop(ending.reason, group.prompt)
            token_books.group_wasted(self.counters, ending.reason, group.finished_tokens())
            self._judge_ending(group, ending.reason, ending.error)  # type: ignore[arg-type]
        else:
            if group.task is not None and group.task is not asyncio.current_task():
                group.task.cancel()
            # A group's stale samples are its finished ones; a distilled sample is the unit, so it counts finished or not.
            finished = sum(c is not None for c in group.completions)
            self._count_stale(group.live_members() if self.per_sample else finished, finished, group.finished_tokens())
            prompt = group.prompt
            if self.cfg.rollout.on_stale in ("requeue", "patience") and prompt.requeues < self.cfg.rollout.max_requeues:
                self.observer.take_ended(group.key, prompt.id, "requeued", None, self._now())
                self.accounting.requeue_in_flight()
                self.counters["rollout/requeued_total"] += 1
                self.source.requeue(prompt)
            else:
                self.observer.take_ended(group.key, prompt.id, "stale", None, self._now())
                self.accounting.drop_in_flight("stale")
                self._count_drop("stale", prompt)
        self._signal.notify()

    def _count_stale(self, samples: int, completions: int, tokens: int) -> None:
        """A group thrown away as stale, in flight or buffered: its samples, its finished completions and their tokens."""
        self.counters["rollout/stale_groups_total"] += 1
        self.counters["rollout/stale_samples_total"] += samples
        self.counters["rollout/stale_completions_total"] += completions
        self.counters["rollout/wasted_tokens_total"] += tokens
        token_books.group_wasted(self.counters, "stale", tokens)

    def _untarget(self, step: int | None) -> None:
        if self._targets is not None and step is not None:
            self._targets.release(step)

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
        if isinstance(error, (RewardError, TeacherError)):
            source = "the teacher" if isinstance(error, TeacherError) else "the reward functions"
        else:
            source = getattr(error, "backend", "") or self.generator.name
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
            self._untarget(group.target_step)
            self._count_drop("stale", group.prompt)
            self._count_stale(len(group.rollouts), len(group.rollouts), sum(r.completion.model_tokens for r in group.rollouts))

    # ------------------------------------------------------------------ the trainer's side

    async def next_batch(self, step: int, stall_timeout_s: float) -> list[Group] | None:
        """Wait for step `step`'s batch: `groups_per_step` trainable groups, oldest first.

        Returns a smaller final batch at end of data (unless `data.drop_last`), None when no
        group is left to train, raises the run's diagnostic if it failed, and `StallError` if
        no rollout (or episode turn) finished and no step trained for `stall_timeout_s`.
        """
        if step != self.next_step:
            raise AssertionError(f"next_batch({step}) but the next step is {self.next_step}")
        self._mark_start()
        while True:
            self.raise_if_failed()
            self._drop_stale_buffered(step)
            if self._ready(step):
                if self.cfg.rollout.on_stale == "patience":
                    await self._wait_for_stragglers(step)
                if self.cfg.rollout.partial_groups:
                    await self._finish_stragglers_early(step)
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
                    await self._signal.wait_for(lambda: self._ready(step) or self._data_done() or self.first_failure.failed)
            except TimeoutError:
                pass  # the loop re-checks: progress may have moved the deadline

    def _ready(self, step: int) -> bool:
        """A full batch for `step` is buffered; with `wait`, of its own groups, or of any once none of its own is left to come."""
        if self._targets is None or self.buffer.count_target(step) >= self.groups_per_step:
            return len(self.buffer) >= self.groups_per_step
        own_coming = any(g.target_step == step for g in self._in_flight.values())
        return self.source.exhausted and not own_coming and len(self.buffer) >= self.groups_per_step

    async def _wait_for_stragglers(self, step: int) -> None:
        """`patience`: wait, up to its share of a step, until no in-flight group is one the next step would cancel."""
        deadline = patience_deadline(now=self._now(), last_step_s=self._last_step_s, share=self.cfg.rollout.patience_share)
        k = self.max_staleness
        try:
            async with asyncio.timeout_at(deadline):
                await self._signal.wait_for(lambda: self.first_failure.failed or not any(
                    is_straggler(version_floor=g.version_floor(), step=step, max_staleness=k) for g in self._in_flight.values()))
        except TimeoutError:
            pass  # the stragglers left are cancelled when the steps move past them
        self.raise_if_failed()

    async def _finish_stragglers_early(self, step: int) -> None:
        """`rollout.partial_groups`: stragglers with enough finished members end now with them, scored in time for this step."""
        r = self.cfg.rollout
        early = [g for g in self._in_flight.values() if may_finish_early(
            version_floor=g.version_floor(), step=step, max_staleness=self.max_staleness, dispatched=g.dispatched == g.size,
            finished=sum(c is not None for c in g.completions), min_survivors=r.min_group_survivors)]
        for group in early:
            group.finish_early()
        try:
            async with asyncio.timeout(self.cfg.stall_timeout_s):  # their scoring ends within the reward time limits
                await self._signal.wait_for(lambda: self.first_failure.failed or all(g.key not in self._in_flight for g in early))
        except TimeoutError:
            pass  # those still scoring are cancelled as stale when the steps move past them
        self.raise_if_failed()

    def _take(self, step: int, n: int) -> list[Group]:
        batch = self.buffer.take(n, prefer_target=step if self._targets is not None else None)
        for group in batch:
            self._untarget(group.target_step)
            if is_stale(generation_version=group.generation_version, step=step, max_staleness=self.max_staleness):
                raise AssertionError(f"group of version {group.generation_version} taken for step {step} with K={self.max_staleness}")
        self.in_training = batch
        self._step_started = self._now()
        self.next_step = step + 1
        self._cancel_stale()
        self._drop_stale_buffered(self.next_step)
        self._signal.notify()
        return batch

    @property
    def steps_trained(self) -> int:
        """Steps completed: every step whose batch was taken, less the one training now (TRL's trainer_state.global_step)."""
        return self.next_step - (1 if self.in_training else 0)

    def step_trained(self) -> None:
        """The step that took `in_training` has completed and its weights are published."""
        self.accounting.train_buffered(len(self.in_training))
        token_books.step_trained(self.counters, self.in_training)
        self.observer.buffered_ended([g.seq for g in self.in_training], "trained", self.next_step - 1, self._now())
        for group in self.in_training:
            self.ledger.trained(group.prompt, self.next_step - 1)
        self.in_training = []
        self._last_progress = self._now()
        if self._step_started is not None:
            self._last_step_s = self._last_progress - self._step_started
        self._signal.notify()

    def weights_published(self) -> None:
        """A generator's serving version changed: admission may open."""
        self._signal.notify()

    def _stalled(self, step: int, stall_timeout_s: float) -> Diagnostic:
        scoring = f"{self._scoring} being scored" + (f" by the teacher ({self.scorer.state()})" if self.per_sample else "")  # type: ignore[attr-defined]
        state = (f"{len(self.buffer)} buffered, {len(self._in_flight)} groups in flight with {self._slots.open} requests "
                 f"open and {scoring}, source exhausted: {self.source.exhausted}")
        bound, source = self.cfg.stall_bound()
        source = source if bound == stall_timeout_s else "as the caller set it"
        return stalled(step, stall_timeout_s, source, self.groups_per_step, state, self.generator.name, self.generator.serving_version)
