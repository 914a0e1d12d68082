"""The staleness policies' pure parts: the policy objects and their registry, step targets (wait), stragglers and the
patience deadline, the buffer's preference for a step's own groups, and where the token books put tokens."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import get_args

import pytest

from asyncgrpo.config import RolloutConfig
from asyncgrpo.metric_names import COUNTER_NAMES
from asyncgrpo.rollout import token_books
from asyncgrpo.rollout.admission import group_capacity
from asyncgrpo.rollout.buffer import ReplayBuffer
from asyncgrpo.rollout.stale_policy import STALE_POLICIES, StalePolicy, StepTargets, is_straggler, may_finish_early, patience_deadline, stale_policy
from asyncgrpo.types import Completion, Group, Prompt, Rollout


def test_targets_fill_the_lowest_step_with_room_and_a_release_reopens_it():
    targets = StepTargets(groups_per_step=2)
    assert [targets.assign(5, 7) for _ in range(5)] == [5, 5, 6, 6, 7]
    targets.release(5)
    assert targets.assign(5, 7) == 5  # a dropped group's replacement trains in the same step
    assert targets.assign(6, 7) == 7  # steps before next_step are never targeted
    with pytest.raises(AssertionError, match="every step from 5 to 7 full"):
        targets.assign(5, 7)  # every step within the bound is full: admission would not have admitted
    with pytest.raises(AssertionError, match="released a target of step 9, which has none"):
        targets.release(9)


def test_targets_find_room_exactly_when_the_admission_rule_admits():
    # Live targets (admitted, not taken) are the occupancy; room in [next_step, serving + K] <=> occupancy < capacity.
    for k, g, lag in itertools.product(range(4), range(1, 4), range(0, 3)):
        next_step, serving = 10, 10 - lag
        targets = StepTargets(g)
        capacity = group_capacity(max_staleness=k, groups_per_step=g, next_step=next_step, serving_version=serving)
        for _ in range(capacity):
            assert targets.assign(next_step, serving + k) <= serving + k
        with pytest.raises(AssertionError):
            targets.assign(next_step, serving + k)


def test_a_straggler_is_trainable_now_and_stale_at_the_next_step():
    assert [is_straggler(version_floor=v, step=5, max_staleness=2) for v in (2, 3, 4, 5)] == [False, True, False, False]
    assert not is_straggler(version_floor=None, step=5, max_staleness=2)  # nothing dispatched: served at the new version


def test_only_a_fully_dispatched_straggler_with_enough_finished_members_finishes_early():
    base = dict(version_floor=3, step=5, max_staleness=2, min_survivors=2)
    assert may_finish_early(dispatched=True, finished=2, **base)
    assert not may_finish_early(dispatched=True, finished=1, **base)  # too few would survive
    assert not may_finish_early(dispatched=False, finished=3, **base)  # a member still waits for a slot
    assert not may_finish_early(dispatched=True, finished=2, **{**base, "version_floor": 4})  # not a straggler


def test_patience_waits_its_share_of_the_last_step():
    assert patience_deadline(now=10.0, last_step_s=4.0, share=0.5) == 12.0
    assert patience_deadline(now=10.0, last_step_s=None, share=0.5) == 10.0  # no step timed yet: no wait


def _group(seq: int, version: int, target: int | None, tokens: int = 3, ms: int = 0) -> Group:
    completion = Completion(token_ids=(4,) * tokens, logprobs=(-1.0,) * tokens, versions=(version,) * tokens,
                            finish_reason="stop", dispatch_version=version)
    rollouts = (Rollout(completion=completion, reward=0.0, advantage=0.0),) * 2
    return Group(prompt=Prompt(id=seq, text="p", token_ids=(1,)), rollouts=rollouts, seq=seq, target_step=target, generation_ms=ms)


def test_the_buffer_hands_a_step_its_own_groups_first_then_the_oldest():
    buffer = ReplayBuffer(max_staleness=2)
    for seq, version, target in ((1, 0, 2), (2, 1, 1), (3, 0, 1), (4, 2, 3), (5, 0, 2)):
        buffer.put(_group(seq, version, target))
    assert buffer.count_target(2) == 2
    assert [g.seq for g in buffer.take(3, prefer_target=2)] == [1, 5, 3]
    assert (buffer.count_target(2), buffer.count_target(1), buffer.count_target(3)) == (0, 1, 1)
    assert [g.seq for g in buffer.take(5)] == [2, 4]
    assert buffer.count_target(1) == buffer.count_target(3) == 0


def test_the_token_books_put_each_token_in_one_place():
    counters = dict.fromkeys(COUNTER_NAMES, 0)
    assert token_books.rollout_ended(counters, 0.0126) == 13
    token_books.group_wasted(counters, "too_few_survivors", 7)
    token_books.group_wasted(counters, "reward_error", 1)
    token_books.group_wasted(counters, "filtered", 2)
    token_books.group_wasted(counters, "stale", 5)
    token_books.step_trained(counters, [_group(1, 0, None, tokens=3, ms=13), _group(2, 0, None, tokens=4, ms=20)])
    assert {k.removeprefix("rollout/"): v for k, v in counters.items() if v} == {
        "wasted_tokens/failed": 8, "wasted_tokens/filtered": 2, "wasted_tokens/stale": 5, "generation_ms_total": 13,
        "trained_completions_total": 4, "trained_tokens_total": 14, "trained_generation_ms_total": 33,
    }


LEFT, DONE = SimpleNamespace(exhausted=False), SimpleNamespace(exhausted=True)  # a prompt source with prompts left, and without


def _policy(on_stale: str, **rollout) -> StalePolicy:
    return stale_policy(RolloutConfig(on_stale=on_stale, groups_per_step=2, max_requeues=1, patience_share=0.5, **rollout))


def test_every_on_stale_value_has_its_policy_in_the_registry():
    assert set(STALE_POLICIES) == set(get_args(RolloutConfig.model_fields["on_stale"].annotation))
    assert {name: type(_policy(name)).__name__ for name in STALE_POLICIES} == {
        "patience": "PatiencePolicy", "requeue": "RequeuePolicy", "drop": "DropPolicy", "wait": "WaitPolicy", "resume": "ResumePolicy"}


def test_what_each_policy_does_with_a_group_left_behind_and_how_long_a_ready_batch_waits():
    fresh, spent = Prompt(id=0, text="p", token_ids=(1,)), Prompt(id=0, text="p", token_ids=(1,), requeues=1)
    answers = {name: ([_policy(name).left_behind(p) for p in (fresh, spent)], _policy(name).wait_until(10.0, 4.0),
                      _policy(name).wait_until(10.0, None)) for name in STALE_POLICIES}
    assert answers == {
        "patience": (["requeue", "drop"], 12.0, 10.0),  # up to max_requeues; half of the last step's 4 s
        "requeue": (["requeue", "drop"], None, None),
        "drop": (["drop", "drop"], None, None),
        "wait": (["drop", "drop"], None, None),  # wait never leaves a group behind; should the bound cut one, it is dropped
        "resume": (["requeue", "drop"], None, None),  # a group it cannot resume is left behind as requeue leaves it
    }
    assert _policy("requeue", partial_groups=True).finish_early and not _policy("requeue").finish_early


def test_only_wait_targets_steps_and_a_step_waits_for_its_own_groups():
    for name in ("patience", "requeue", "drop"):
        policy = _policy(name)
        assert policy.target(3, 5) is None and policy.prefer_target(3) is None
        assert policy.ready(3, ReplayBuffer(max_staleness=2), LEFT) is False
    wait = _policy("wait")
    assert [wait.target(3, 5) for _ in range(4)] == [3, 3, 4, 4] and wait.prefer_target(3) == 3
    buffer = ReplayBuffer(max_staleness=2)
    for seq, target in ((1, 4), (2, 4), (3, 3)):
        buffer.put(_group(seq, 2, target))
    assert not wait.ready(3, buffer, DONE)  # three buffered, but step 3's other group is still coming (in flight)
    assert wait.ready(4, buffer, LEFT)  # step 4's own two are buffered
    wait.release(3)  # step 3's other group was dropped: none of its own is coming
    assert not wait.ready(3, buffer, LEFT)  # more of its own may be admitted
    assert wait.ready(3, buffer, DONE)
    wait.release(None)  # a group without a target holds no room
    assert wait.target(3, 5) == 3


def test_wait_readiness_costs_the_same_with_two_or_two_thousand_groups_buffered():
    # read on every wake-up of the trainer (issue 22): counts kept as groups come and go, no scan of the buffer
    from tests.unit.test_source import trace_events

    def state(groups: int) -> tuple[StalePolicy, ReplayBuffer]:
        wait, buffer = _policy("wait"), ReplayBuffer(max_staleness=2)
        for seq in range(groups):
            buffer.put(_group(seq, 2, wait.target(3, 3 + groups)))
        return wait, buffer

    (few, few_buffer), (many, many_buffer) = state(2), state(2000)
    assert trace_events(lambda: many.ready(1003, many_buffer, DONE)) == trace_events(lambda: few.ready(4, few_buffer, DONE))
