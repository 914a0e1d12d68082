"""The staleness policy's runner (rollout/resumption.py), its trainability check (`StalePolicy.trainable`) and the retry
loop's sink (rollout/retry.py): what the collector hands a rollout left behind to, on a bare event loop."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import pytest

from asyncgrpo.commands.vtime import run_virtual
from asyncgrpo.config import GenerationConfig
from asyncgrpo.errors import TransientGenerationError
from asyncgrpo.rollout.books import Books
from asyncgrpo.rollout.failures import FailurePolicy
from asyncgrpo.rollout.in_flight import InFlightGroup
from asyncgrpo.rollout.resumption import Cancelling, Resuming, runner_for
from asyncgrpo.rollout.retry import generate_with_retries
from asyncgrpo.rollout.stale_policy import stale_policy
from asyncgrpo.types import Completion, GenerationRequest, Prompt, SamplingParams, TokenSink
from tests.sim.fakes import recipe
from tests.unit.test_resume import completion, group

REQUEST = GenerationRequest(request_id="0-0-0-0", prompt_id=0, prompt_token_ids=(1, 2), sampling=SamplingParams(max_new_tokens=8), seed=1)


def runner(on_stale: str, *, in_place: bool = False, **rollout: object) -> tuple[Cancelling, Books]:
    r = recipe(rollout={"on_stale": on_stale, **rollout}).rollout
    books = Books(FailurePolicy.from_rollout(r))
    return runner_for(stale_policy(r), books, continues_in_flight=in_place), books


def test_every_policy_but_resume_cancels_a_group_left_behind_and_resume_on_an_in_place_backend_interrupts_nothing() -> None:
    for on_stale in ("patience", "requeue", "drop", "wait"):
        plain, _ = runner(on_stale)
        assert type(plain) is Cancelling
        assert not plain.resume(InFlightGroup(key=1, prompt=Prompt(id=0, text="p", token_ids=(1,)), size=2), step=5)
    in_place, books = runner("resume", in_place=True)
    assert isinstance(in_place, Resuming)
    g = InFlightGroup(key=1, prompt=Prompt(id=0, text="p", token_ids=(1,)), size=1)
    assert plain.rollouts(_answer) is _answer  # a request is the rollout: no wrapper
    g.member_tasks[0] = _Running()  # type: ignore[assignment]
    g.dispatch_versions[0] = 0
    in_place.weights_published([g], version=3, step=3)
    assert in_place.resume(g, step=3) and g.interrupts == [0]  # in place: the policy lets it go on, nothing interrupted
    assert books.counters["rollout/resumed_rollouts_total"] == 0


def test_in_place_a_rollout_that_went_on_under_newer_weights_makes_its_group_resumed_for_max_prefix_staleness() -> None:
    # The local engine (and Ray actors) continue a rollout in place across a publication, each token stamped with its
    # version: nothing is interrupted, so `resumptions` stays 0, yet the group was resumed as an interrupted one would be.
    # Its tokens are bounded by rollout.max_prefix_staleness, as the collector builds its Group (rollout/collector.py).
    in_place, _ = runner("resume", in_place=True, max_staleness=1, max_prefix_staleness=2, max_masked_share=0.0)
    assert isinstance(in_place, Resuming)
    policy = stale_policy(recipe(rollout={"on_stale": "resume", "max_staleness": 1, "max_prefix_staleness": 2,
                                          "max_masked_share": 0.0}).rollout)

    def finished(*members: Completion) -> InFlightGroup:
        g = InFlightGroup(key=1, prompt=Prompt(id=0, text="p", token_ids=(1, 2)), size=len(members))
        g.completions = list(members)
        return g

    went_on = finished(completion((5, 6, 7), (0, 0, 1)), completion((8,), (0,)))  # member 0 went on under version 1
    assert in_place.bound_of(went_on) == 2
    buffered = replace(group(*(c for c in went_on.completions if c is not None)), max_staleness=in_place.bound_of(went_on))
    assert policy.trainable(buffered, step=2) == (buffered, 0)  # version 0 is 2 steps old at step 2: within the prefix bound
    one_version = finished(completion((5, 6), (0, 0)), completion((8,), (0,)))
    assert in_place.bound_of(one_version) is None  # never went on under newer weights: the run's K
    interrupted, _ = runner("resume", max_staleness=1, max_prefix_staleness=2)
    assert interrupted.bound_of(went_on) is None  # not in place: only an interruption makes a group resumed
    went_on.resumptions[1] = 1
    assert interrupted.bound_of(went_on) == 2


def test_under_resume_an_episodes_turn_is_dispatched_without_the_floor_of_its_earlier_turns() -> None:
    # The collector's retry policy keeps the floor as the member's dispatch version, and ends the group as stale at the
    # turn's dispatch once the floor is past K. Under resume an episode's earlier turns are a prefix instead, held to the
    # bound token by token: the turn goes on, and the turns past the bound are masked (tests/sim/test_episode_resume.py).
    floors: list[int | None] = []

    async def attempts(request: GenerationRequest, group: InFlightGroup, member: int, slot: object, floor: int | None = None) -> Completion:
        floors.append(floor)
        return completion((9,), (3,))

    async def main() -> None:
        for on_stale, in_place in (("resume", False), ("resume", True), ("patience", False)):
            generate = runner(on_stale, in_place=in_place)[0].rollouts(attempts)
            assert (await generate(REQUEST, InFlightGroup(key=1, prompt=Prompt(id=0, text="p", token_ids=(1,)), size=1), 0, None, 0)
                    ).token_ids == (9,)

    asyncio.run(main())
    assert floors == [None, None, 0]  # every policy but resume keeps the floor


class _Running:
    """A member's task that is still running (the in-place runner must not cancel it)."""

    def done(self) -> bool:
        return False

    def cancel(self) -> bool:
        raise AssertionError("an in-place rollout was interrupted")


async def _answer(request: GenerationRequest, group: InFlightGroup, member: int, slot: object) -> Completion:
    return completion((9,), (0,))


def test_an_interrupted_rollout_continues_from_its_tokens_and_a_cancellation_from_elsewhere_still_cancels() -> None:
    resuming, books = runner("resume", max_resumptions=1)
    seen: list[GenerationRequest] = []

    async def attempts(request: GenerationRequest, group: InFlightGroup, member: int, slot: object) -> Completion:
        seen.append(request)
        assert request.sink is not None
        if len(seen) == 1:  # the first attempt generates two tokens at version 0, then waits until interrupted
            request.sink.extend((5, 6), (-0.5, -0.6), (0, 0), "ab")
            await asyncio.get_running_loop().create_future()
        return completion((7,), (1,), "stop")

    async def main() -> None:
        g = InFlightGroup(key=1, prompt=Prompt(id=0, text="p", token_ids=(1, 2)), size=2)
        task = asyncio.create_task(resuming.rollouts(attempts)(REQUEST, g, 0, None))
        g.member_tasks[0], g.dispatch_versions[0] = task, 0
        await asyncio.sleep(0)
        resuming.weights_published([g], version=1, step=1)
        joined = await task
        assert joined.token_ids == (5, 6, 7) and joined.versions == (0, 0, 1) and joined.text == "abt"
        assert seen[1].prompt_token_ids == (1, 2, 5, 6) and seen[1].sampling.max_new_tokens == 6
        assert g.resumptions[0] == 1 and g.interrupts[0] == 0 and books.counters["rollout/resumed_rollouts_total"] == 1
        assert resuming.bound_of(g) is None  # no rollout.max_prefix_staleness: the run's K

        async def hangs(request: GenerationRequest, *rest: object) -> Completion:
            return await asyncio.get_running_loop().create_future()

        again = asyncio.create_task(resuming.rollouts(hangs)(REQUEST, g, 1, None))
        g.member_tasks[1], g.dispatch_versions[1] = again, 0
        await asyncio.sleep(0)
        assert resuming.resume(g, step=2)  # member 1 (version 0) is past K = 1 at step 2: interrupted, the group goes on
        assert g.interrupts[1] == 1
        again.cancel()  # a cancellation that is no interruption (stale, shutdown) reaches the task
        with pytest.raises(asyncio.CancelledError):
            await again
        once = InFlightGroup(key=2, prompt=Prompt(id=1, text="p", token_ids=(1, 2)), size=1)
        once.member_tasks[0], once.dispatch_versions[0], once.resumptions[0] = asyncio.create_task(hangs(REQUEST)), 0, 1
        once.generating[0] = True  # it awaits its request (the runner marks it so around each one)
        assert not resuming.resume(once, step=2)  # resumed rollout.max_resumptions times already: the group is cancelled
        assert once.interrupts == [0] and books.counters["rollout/resumed_rollouts_total"] == 2
        once.member_tasks[0].cancel()

    asyncio.run(main())


def test_trainable_masks_a_resumed_groups_old_tokens_and_says_stale_where_the_bound_still_cuts() -> None:
    requeue = stale_policy(recipe(rollout={"on_stale": "requeue"}).rollout)
    old = group(completion((1, 2), (0, 0)))
    assert requeue.trainable(old, step=1) == (old, 0)
    assert requeue.trainable(old, step=2) == (None, 0)  # K = 1: version 0 is stale at step 2
    resume = stale_policy(recipe(rollout={"on_stale": "resume", "max_masked_share": 0.5}).rollout)
    mixed = group(completion((1, 2, 3, 4), (0, 1, 2, 3)))
    kept, masked = resume.trainable(mixed, step=3)
    assert kept is not None and masked == 2 and kept.rollouts[0].completion.loss_mask == (False, False, True, True)
    assert resume.trainable(mixed, step=5) == (None, 0)  # 3 of 4 tokens past the bound: over rollout.max_masked_share
    # Every token masked (within rollout.max_masked_share 1): stale, and none counted masked (its tokens are wasted as stale).
    every = stale_policy(recipe(rollout={"on_stale": "resume", "max_masked_share": 1.0}).rollout)
    assert every.trainable(group(completion((1, 2), (0, 0))), step=5) == (None, 0)


class _FailsOnce:
    """A backend whose first attempt streams two tokens and then fails transiently; the second answers."""

    name = "fails-once"

    def __init__(self) -> None:
        self.sink_at_attempt: list[int] = []

    async def generate(self, request: GenerationRequest) -> Completion:
        assert request.sink is not None
        self.sink_at_attempt.append(len(request.sink))
        request.sink.extend((5, 6), (-0.5, -0.6), (0, 0))
        if len(self.sink_at_attempt) == 1:
            raise TransientGenerationError("reset", backend=self.name)
        return completion((5, 6), (0, 0))


def test_the_retry_loop_empties_the_sink_before_each_attempt_and_after_a_failed_one() -> None:
    g = GenerationConfig(request_timeout_s=10.0, rollout_deadline_s=60.0, retry_backoff_s=0.1, retry_backoff_max_s=0.1)
    sink, backend, at_retry = TokenSink(), _FailsOnce(), []
    sink.extend((9,), (-0.9,), (0,))  # tokens of an earlier request: no attempt starts with them

    async def main() -> None:
        request = GenerationRequest(request_id="r", prompt_id=0, prompt_token_ids=(1,), sampling=SamplingParams(max_new_tokens=4),
                                    seed=1, sink=sink)
        await generate_with_retries(backend, request, g, jitter=random.Random(0), on_retry=lambda error: at_retry.append(len(sink)))

    run_virtual(main())
    assert backend.sink_at_attempt == [0, 0] and at_retry == [0]  # a failed attempt's tokens are no prefix of its retry
    assert sink.token_ids == [5, 6]  # the current attempt's tokens only
