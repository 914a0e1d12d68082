"""The collector: takes prompts, generates their groups, scores them, and hands batches to the trainer.

One `Collector` owns, for one run: the admission decisions, a task per in-flight group
(and under it a task per rollout), the replay buffer, the accounting, the failure policy
and the run's health. All of its state lives on one event loop and changes only in
synchronous code; every change calls `StateSignal.notify()`.

Invariants (DESIGN.md §2):
- Every take of a prompt ends in exactly one outcome (`Accounting` checks the identity);
  whoever ends a group first (finish, stale cancellation) removes it from `_in_flight`,
  and only a group still there can be ended.
- No group with staleness > K reaches the trainer: `next_batch` removes untrainable groups
  right before taking a batch, and in-flight groups that can no longer make any step are
  cancelled (requests aborted, slots freed) as soon as the steps move past them.
- Errors are never swallowed: a rollout error is retried (transient), or fails the rollout
  (counted); group outcomes feed the failure policy; a broken budget, a misconfigured
  backend or a fatal reward error becomes the run's sticky diagnostic, which the trainer
  raises through `check_health()`.
- Cancellation (stale, shutdown, end of data) is never counted as a failure.
- Tasks: `run()` owns a TaskGroup with one task per in-flight group; each group task owns
  a TaskGroup with one task per dispatched rollout. `stop()` cancels them all; work
  unfinished at exit stays reported as in flight or buffered.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
from dataclasses import dataclass, field
from typing import Any, Protocol

from asyncgrpo.config import Config
from asyncgrpo.errors import (
    Diagnostic,
    GenerationError,
    FatalBackendError,
    PromptRejectedError,
    RewardError,
    TransientGenerationError,
)
from asyncgrpo.generation.base import Generator
from asyncgrpo.rewards.scoring import unscored_group_error
from asyncgrpo.rollout.accounting import Accounting
from asyncgrpo.rollout.admission import is_doomed, is_trainable, may_admit_group
from asyncgrpo.rollout.buffer import ReplayBuffer
from asyncgrpo.rollout.failure_log import FailureLog, Tolerated
from asyncgrpo.rollout.failures import FailurePolicy, GroupOutcome
from asyncgrpo.rollout.health import Health, format_traceback
from asyncgrpo.rollout.no_signal import NoSignalWatch
from asyncgrpo.rollout.ledger import PromptLedger
from asyncgrpo.rollout.retry import generate_with_retries
from asyncgrpo.rollout.signal import StateSignal
from asyncgrpo.training.advantages import group_advantages
from asyncgrpo.types import DROP_REASONS, Completion, DropReason, GenerationRequest, Group, Prompt, Rollout, SamplingParams

log = logging.getLogger("asyncgrpo")

COUNTER_NAMES: tuple[str, ...] = (
    "rollout/failed_total",
    "rollout/dropped_groups_total",
    *(f"rollout/dropped/{reason}" for reason in DROP_REASONS),
    "rollout/stale_groups_total",
    "rollout/stale_samples_total",
    "rollout/retries_total",
    "rollout/requeued_total",
    "rollout/wasted_tokens_total",
    "rollout/generated_tokens_total",
)


class PromptSourceLike(Protocol):
    @property
    def exhausted(self) -> bool: ...

    def take(self) -> Prompt | None: ...

    def requeue(self, prompt: Prompt) -> None: ...


class ScorerLike(Protocol):
    async def score(self, prompt: Prompt, completions: list[str]) -> list[Any]: ...


@dataclass
class _InFlightGroup:
    """A group between its take and its outcome. Lists are indexed by member (rollout) number."""

    key: int
    prompt: Prompt
    size: int
    task: asyncio.Task[None] | None = None
    dispatched: int = 0
    dispatch_versions: list[int | None] = field(default_factory=list)
    completions: list[Completion | None] = field(default_factory=list)
    errors: list[BaseException | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.dispatch_versions = [None] * self.size
        self.completions = [None] * self.size
        self.errors = [None] * self.size

    def version_floor(self) -> int | None:
        """Lowest version any of its surviving tokens has or can have (a member being retried counts with
        its current attempt's version); None while nothing live is dispatched."""
        versions = [
            c.generation_version if c is not None else v
            for c, v, e in zip(self.completions, self.dispatch_versions, self.errors)
            if e is None and (c is not None or v is not None)
        ]
        return min(versions, default=None)

    def finished_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions if c is not None)


def request_seed(run_seed: int, prompt: Prompt, member: int) -> int:
    """A per-request sampling seed, stable across runs and resumes for the same take of a prompt."""
    text = f"{run_seed}:{prompt.id}:{prompt.epoch}:{prompt.requeues}:{member}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


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
    ) -> None:
        self.cfg = cfg
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
        self.health = Health()
        self._no_signal = None if r.filter_zero_variance else NoSignalWatch(r.drop_window)
        self.failure_log = FailureLog(cfg.logging.failure_summary_s)
        self.ledger = ledger if ledger is not None else PromptLedger()
        self.counters: dict[str, int] = {name: 0 for name in COUNTER_NAMES}
        self.steps_taken = start_step
        self.in_training: list[Group] = []
        self._signal = StateSignal()
        self._in_flight: dict[int, _InFlightGroup] = {}
        self._open_requests = 0
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
        return self._open_requests

    def occupancy(self) -> int:
        """Groups admitted and not yet taken for a step (the step in training is the lag term of admission)."""
        return len(self._in_flight) + len(self.buffer)

    def check_health(self) -> None:
        self.health.check()

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _mark_start(self) -> None:
        if self._last_progress is None:
            self._last_progress = self._now()

    def _undispatched(self) -> int:
        return sum(g.size - g.dispatched for g in self._in_flight.values())

    def _may_admit(self) -> bool:
        return not self.source.exhausted and may_admit_group(
            occupancy=self.occupancy(),
            max_staleness=self.max_staleness,
            groups_per_step=self.groups_per_step,
            steps_taken=self.steps_taken,
            serving_version=self.generator.serving_version,
            free_request_slots=self.cfg.generation.max_inflight - self._open_requests,
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
                await self._signal.wait_for(lambda: self._stopping or self.health.failed or self._may_admit())
                if self._stopping or self.health.failed:
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
        group = _InFlightGroup(key=self._takes, prompt=prompt, size=self.group_size)
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

    async def _run_group(self, group: _InFlightGroup) -> None:
        async with asyncio.TaskGroup() as members:
            for member in range(group.size):
                await self._signal.wait_for(lambda: self._open_requests < self.cfg.generation.max_inflight)
                self._open_requests += 1
                group.dispatched += 1
                members.create_task(self._run_rollout(group, member), name=f"rollout-{group.prompt.id}-{member}")
        await self._finish_group(group)

    async def _run_rollout(self, group: _InFlightGroup, member: int) -> None:
        prompt = group.prompt
        request = GenerationRequest(
            request_id=f"{prompt.id}-{prompt.epoch}-{prompt.requeues}-{member}",
            prompt_id=prompt.id,
            prompt_token_ids=prompt.token_ids,
            sampling=self.sampling,
            seed=request_seed(self.cfg.run.seed, prompt, member),
        )
        outcome: Completion | Exception
        try:
            outcome = await self._generate_with_retries(request, group, member)
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # we were cancelled (stale, shutdown): not a failure
            # The backend raised CancelledError on its own (some clients do): a failed rollout.
            outcome = GenerationError(f"the backend cancelled request {request.request_id} by itself", backend=self.generator.name)
            outcome.__cause__ = exc
        except Exception as exc:  # noqa: BLE001 - classified: retries are exhausted, or not retryable, or fatal
            outcome = exc
        finally:
            self._open_requests -= 1
            self._signal.notify()
        if isinstance(outcome, Completion):
            group.completions[member] = outcome
            self.counters["rollout/generated_tokens_total"] += len(outcome.token_ids)
        else:
            group.errors[member] = outcome
            self.counters["rollout/failed_total"] += 1
            if isinstance(outcome, FatalBackendError):
                self._fail_run(
                    Diagnostic(
                        kind=outcome.kind,
                        message=f"The generation backend cannot serve this run: {outcome}. Retrying cannot fix this; "
                        f"check the servers, the model name, the URLs and the credentials.",
                        backend=outcome.backend or self.generator.name,
                        generation_version=group.dispatch_versions[member],
                        trainer_step=self.steps_taken,
                        original=outcome,
                        traceback=format_traceback(outcome),
                    )
                )
            else:
                self._tolerated("failed", outcome)
        self._last_progress = self._now()  # a rollout finished (a cancelled one never gets here)

    async def _generate_with_retries(self, request: GenerationRequest, group: _InFlightGroup, member: int) -> Completion:
        """One rollout under the retry policy (rollout/retry.py); a rollout waiting to retry holds no request slot."""
        g = self.cfg.generation

        def record_dispatch() -> None:
            group.dispatch_versions[member] = self.generator.serving_version

        def count_retry(error: TransientGenerationError) -> None:
            self.counters["rollout/retries_total"] += 1
            self._tolerated("retried", error)

        async def wait_without_a_slot(delay: float) -> None:
            # Waiting to retry holds no request open at the server: the slot serves other rollouts meanwhile.
            self._open_requests -= 1
            self._signal.notify()
            try:
                await asyncio.sleep(delay)
                await self._signal.wait_for(lambda: self._open_requests < g.max_inflight)
            finally:
                self._open_requests += 1  # the caller's `finally` gives it back, whatever happens

        return await generate_with_retries(
            self.generator, request, g, jitter=self._jitter,
            before_attempt=record_dispatch, on_retry=count_retry, between_attempts=wait_without_a_slot,
        )

    async def _finish_group(self, group: _InFlightGroup) -> None:
        survivors = [(m, c) for m, c in enumerate(group.completions) if c is not None]
        errors = [e for e in group.errors if e is not None]
        if len(survivors) + len(errors) != group.size:
            raise AssertionError(f"group of prompt {group.prompt.id}: {len(survivors)} survivors + {len(errors)} errors != {group.size}")
        if not survivors:
            rejected = [e for e in errors if isinstance(e, PromptRejectedError)]
            if len(rejected) == len(errors):
                self._end_dropped(group, "invalid_prompt", rejected[0])
            else:
                self._end_dropped(group, "failed", next(e for e in errors if not isinstance(e, PromptRejectedError)))
            return
        if len(survivors) < self.cfg.rollout.min_group_survivors:
            self._end_dropped(group, "too_few_survivors", errors[0] if errors else None)
            return
        self._scoring += 1
        try:
            scored = await self.scorer.score(group.prompt, [c.text for _, c in survivors])
        except RewardError as exc:
            self._last_progress = self._now()
            if self.cfg.reward.on_error == "fail":
                self._fail_run(
                    Diagnostic(
                        kind="reward_error",
                        message=f"A reward function failed: {exc}. Fix the function, or set reward.on_error: drop "
                        f"to drop such groups (counted as reward_error) instead of stopping.",
                        generation_version=group.version_floor(),
                        trainer_step=self.steps_taken,
                        original=exc,
                        traceback=format_traceback(exc),
                    )
                )
            else:
                self._tolerated("reward_error", exc)
            self._end_dropped(group, "reward_error", exc)
            return
        finally:
            self._scoring -= 1
        self._last_progress = self._now()  # scoring a group is progress, however long the reward took
        kept = [(c, s) for (_, c), s in zip(survivors, scored) if s.reward is not None]
        if len(kept) < self.cfg.rollout.min_group_survivors:
            self._end_dropped(group, "too_few_survivors", unscored_group_error(group.prompt, scored, self.cfg.rollout.min_group_survivors))
            return
        rewards = [float(s.reward) for _, s in kept]
        if self.cfg.rollout.filter_zero_variance and max(rewards) == min(rewards):
            self._end_dropped(group, "filtered", None)
            return
        if self._no_signal is not None and (warning := self._no_signal.observe(max(rewards) == min(rewards))):
            log.warning(warning)
        advantages = group_advantages(rewards, scale_by_std=self.cfg.train.loss.scale_by_std)
        self._seq += 1
        finished = Group(
            prompt=group.prompt,
            rollouts=tuple(
                Rollout(completion=c, reward=r, advantage=a, reward_terms=dict(s.terms))
                for (c, s), r, a in zip(kept, rewards, advantages)
            ),
            seq=self._seq,
            failed_rollouts=len(errors),
        )
        if is_doomed(version_floor=finished.generation_version, steps_taken=self.steps_taken, max_staleness=self.max_staleness):
            self._end_stale(group)
            return
        del self._in_flight[group.key]
        self.accounting.buffer()
        self.buffer.put(finished)
        self._record_outcome(group, "success", None)
        self._signal.notify()

    # ------------------------------------------------------------------ outcomes

    def _end_dropped(self, group: _InFlightGroup, reason: DropReason, error: BaseException | None) -> None:
        del self._in_flight[group.key]
        self.accounting.drop_in_flight(reason)
        self._count_drop(reason, group.prompt)
        self._record_outcome(group, reason, error)  # type: ignore[arg-type]
        self._signal.notify()

    def _end_stale(self, group: _InFlightGroup) -> None:
        """Cancel a group no remaining step can train: abort its rollouts, then requeue or drop its prompt."""
        del self._in_flight[group.key]
        if group.task is not None and group.task is not asyncio.current_task():
            group.task.cancel()
        self.counters["rollout/stale_groups_total"] += 1
        finished = [c for c in group.completions if c is not None]
        self.counters["rollout/stale_samples_total"] += len(finished)
        self.counters["rollout/wasted_tokens_total"] += group.finished_tokens()
        prompt = group.prompt
        if self.cfg.rollout.on_stale == "requeue" and prompt.requeues < self.cfg.rollout.max_requeues:
            self.accounting.requeue_in_flight()
            self.counters["rollout/requeued_total"] += 1
            self.source.requeue(prompt)
        else:
            self.accounting.drop_in_flight("stale")
            self._count_drop("stale", prompt)
        self._signal.notify()

    def _count_drop(self, reason: DropReason, prompt: Prompt) -> None:
        self.counters["rollout/dropped_groups_total"] += 1
        self.counters[f"rollout/dropped/{reason}"] += 1
        self.ledger.dropped(prompt, reason, self.steps_taken)

    def _record_outcome(self, group: _InFlightGroup, outcome: GroupOutcome, error: BaseException | None) -> None:
        verdict = self.policy.record(outcome, error)
        if verdict is None:
            return
        self._fail_run(
            Diagnostic(
                kind=verdict.kind,
                message=verdict.message,
                backend=self.generator.name,
                generation_version=min((v for v in group.dispatch_versions if v is not None), default=None),
                trainer_step=self.steps_taken,
                count=verdict.count,
                threshold=verdict.threshold,
                original=verdict.original,
                traceback=format_traceback(verdict.original),
                details={
                    "by_reason": verdict.by_reason,
                    "examples": {reason: repr(e) for reason, e in verdict.examples.items()},
                },
            )
        )

    def _tolerated(self, what: Tolerated, error: BaseException) -> None:
        source = "the reward functions" if isinstance(error, RewardError) else getattr(error, "backend", "") or self.generator.name
        for line in self.failure_log.record(what, type(error).__name__, source, str(error), self._now()):
            log.warning(line)

    def _fail_run(self, diagnostic: Diagnostic) -> None:
        self.health.fail(diagnostic)
        self._signal.notify()

    def _cancel_doomed(self) -> None:
        for group in list(self._in_flight.values()):
            floor = group.version_floor()
            if floor is not None and is_doomed(version_floor=floor, steps_taken=self.steps_taken, max_staleness=self.max_staleness):
                self._end_stale(group)

    def _expire_buffered(self, step: int) -> None:
        for group in self.buffer.remove_untrainable(step):
            self.accounting.drop_buffered("stale")
            self._count_drop("stale", group.prompt)
            self.counters["rollout/stale_groups_total"] += 1
            self.counters["rollout/stale_samples_total"] += len(group.rollouts)
            self.counters["rollout/wasted_tokens_total"] += sum(len(r.completion.token_ids) for r in group.rollouts)

    # ------------------------------------------------------------------ the trainer's side

    async def next_batch(self, step: int, stall_timeout_s: float) -> list[Group] | None:
        """Wait for step `step`'s batch: `groups_per_step` trainable groups, oldest first.

        Returns a smaller final batch at end of data (unless `data.drop_last`), None when no
        group is left to train, raises the run's diagnostic if it failed, and `StallError` if
        no rollout finished and no step trained for `stall_timeout_s`.
        """
        if step != self.steps_taken:
            raise AssertionError(f"next_batch({step}) but {self.steps_taken} steps were taken")
        self._mark_start()
        while True:
            self.check_health()
            self._expire_buffered(step)
            if len(self.buffer) >= self.groups_per_step:
                return self._take(step, self.groups_per_step)
            if self._data_done():
                if len(self.buffer) and not self.cfg.data.drop_last:
                    return self._take(step, len(self.buffer))
                return None
            assert self._last_progress is not None
            deadline = self._last_progress + stall_timeout_s
            if self._now() >= deadline:
                self._fail_run(self._stall_diagnostic(step, stall_timeout_s))
                continue
            try:
                async with asyncio.timeout_at(deadline):
                    await self._signal.wait_for(
                        lambda: len(self.buffer) >= self.groups_per_step or self._data_done() or self.health.failed
                    )
            except TimeoutError:
                pass  # the loop re-checks: progress may have moved the deadline

    def _take(self, step: int, n: int) -> list[Group]:
        batch = self.buffer.take(n)
        for group in batch:
            if not is_trainable(generation_version=group.generation_version, step=step, max_staleness=self.max_staleness):
                raise AssertionError(f"group of version {group.generation_version} taken for step {step} with K={self.max_staleness}")
        self.in_training = batch
        self.steps_taken = step + 1
        self._cancel_doomed()
        self._expire_buffered(self.steps_taken)
        self._signal.notify()
        return batch

    def step_trained(self) -> None:
        """The step that took `in_training` has completed and its weights are published."""
        self.accounting.train_buffered(len(self.in_training))
        for group in self.in_training:
            self.ledger.trained(group.prompt, self.steps_taken - 1)
        self.in_training = []
        self._last_progress = self._now()
        self._signal.notify()

    def weights_published(self) -> None:
        """A generator's serving version changed: admission may open."""
        self._signal.notify()

    def _stall_diagnostic(self, step: int, stall_timeout_s: float) -> Diagnostic:
        return Diagnostic(
            kind="stall",
            message=(
                f"The pipeline stalled: no rollout finished and no step trained for {stall_timeout_s:g} s "
                f"(rollout.stall_timeout_s) while step {step} waited for {self.groups_per_step} groups. "
                f"State: {len(self.buffer)} buffered, {len(self._in_flight)} groups in flight with "
                f"{self._open_requests} requests open and {self._scoring} being scored, source exhausted: {self.source.exhausted}, "
                f"serving version {self.generator.serving_version}. Check that the generation backend answers."
            ),
            backend=self.generator.name,
            generation_version=self.generator.serving_version,
            trainer_step=step,
            threshold=stall_timeout_s,
        )
