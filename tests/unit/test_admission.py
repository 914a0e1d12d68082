"""The admission and staleness rules, exhaustively over small values and by property."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.rollout.admission import group_capacity, is_stale, may_admit_group


def test_capacity_with_weights_synced_after_every_step_is_the_design_formula():
    # Waiting for step s with version s served: (K + 1) * G places.
    for k, g, s in itertools.product(range(5), range(1, 5), range(6)):
        assert group_capacity(max_staleness=k, groups_per_step=g, next_step=s, serving_version=s) == (k + 1) * g


def test_staleness_zero_admits_nothing_while_a_step_trains():
    # Step s taken (next_step = s + 1), weights of s + 1 not yet served: synchronous GRPO waits.
    assert group_capacity(max_staleness=0, groups_per_step=4, next_step=3, serving_version=2) == 0


def test_lagging_serving_version_shrinks_capacity():
    assert group_capacity(max_staleness=2, groups_per_step=3, next_step=5, serving_version=4) == 6
    assert group_capacity(max_staleness=1, groups_per_step=3, next_step=5, serving_version=3) == 0


def test_serving_version_ahead_of_steps_is_an_internal_error():
    with pytest.raises(ValueError):
        group_capacity(max_staleness=1, groups_per_step=1, next_step=2, serving_version=3)


@given(k=st.integers(0, 6), g=st.integers(1, 8), steps=st.integers(0, 50), lag=st.integers(0, 7))
def test_every_group_admission_allows_is_in_bound(k, g, steps, lag):
    """The group admitted with `p` groups ahead of it (trained oldest first, `g` per step) is served
    at `steps - lag` and trained at step `steps + p // g` at the latest; that must be within K."""
    serving = steps - lag
    if serving < 0:
        return
    capacity = group_capacity(max_staleness=k, groups_per_step=g, next_step=steps, serving_version=serving)
    for ahead in range(capacity):
        assert not is_stale(generation_version=serving, step=steps + ahead // g, max_staleness=k)
    if lag <= k:  # and the trainer is never starved by the rule itself: a whole batch fits
        assert capacity >= g


def test_may_admit_needs_room_for_the_group_and_a_free_request_slot():
    base = dict(max_staleness=1, groups_per_step=2, next_step=0, serving_version=0)
    assert may_admit_group(occupancy=3, free_request_slots=1, undispatched_rollouts=0, **base)
    assert not may_admit_group(occupancy=4, free_request_slots=8, undispatched_rollouts=0, **base)
    assert not may_admit_group(occupancy=0, free_request_slots=0, undispatched_rollouts=0, **base)
    # Rollouts of admitted groups still waiting for a slot go first.
    assert not may_admit_group(occupancy=1, free_request_slots=3, undispatched_rollouts=3, **base)
    assert may_admit_group(occupancy=1, free_request_slots=4, undispatched_rollouts=3, **base)


def test_stale_exhaustively():
    for k, version, step in itertools.product(range(4), range(6), range(10)):
        assert (not is_stale(generation_version=version, step=step, max_staleness=k)) == (step - version <= k)
        assert is_stale(generation_version=version, step=step, max_staleness=k) == (step > version + k)


def test_a_serving_version_ahead_of_the_steps_is_a_bug_and_says_so():
    with pytest.raises(ValueError, match=r"^serving version 3 is ahead of the steps taken \(2\)$"):
        group_capacity(max_staleness=1, groups_per_step=1, next_step=2, serving_version=3)


def test_over_admission_raises_only_an_open_capacity():
    base = dict(max_staleness=1, groups_per_step=2, free_request_slots=8, undispatched_rollouts=0)
    assert may_admit_group(occupancy=4, next_step=3, serving_version=3, over_admit_groups=1, **base)
    assert not may_admit_group(occupancy=5, next_step=3, serving_version=3, over_admit_groups=1, **base)
    # While K = 0 trains a step nothing may start: a group admitted now could never be trained.
    assert not may_admit_group(occupancy=0, next_step=4, serving_version=3, over_admit_groups=3, **{**base, "max_staleness": 0})
