"""The failure policy: consecutive budget, streak resets, and the trickle window."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.config import load_config, tolerance_warnings
from asyncgrpo.rollout.failures import FailurePolicy

OUTCOMES = ("success", "failed", "too_few_survivors", "invalid_prompt", "filtered", "reward_error")


def policy(**overrides):
    args = dict(max_generation_failures=0, drop_window=64, max_drop_fraction=1.0, max_filtered_fraction=1.0)
    args.update(overrides)
    return FailurePolicy(**args)


def test_tolerance_zero_first_generation_failure_is_fatal_and_keeps_the_error():
    error = RuntimeError("boom")
    verdict = policy().record("failed", error)
    assert verdict is not None and verdict.kind == "generation_failures"
    assert verdict.count == 1 and verdict.threshold == 0
    assert verdict.examples["failed"] is error
    assert "rollout.max_generation_failures = 0" in verdict.message


def test_tolerance_three_fails_on_the_fourth_in_a_row():
    p = policy(max_generation_failures=3)
    assert [p.record("failed") is None for _ in range(3)] == [True, True, True]
    assert p.record("failed").count == 4


def test_success_resets_the_streak_and_other_drops_leave_it():
    p = policy(max_generation_failures=1)
    assert p.record("failed") is None
    for neutral in ("too_few_survivors", "invalid_prompt", "filtered", "reward_error"):
        assert p.record(neutral) is None
        assert p.streak == 1
    assert p.record("success") is None and p.streak == 0
    assert p.record("failed") is None


@given(st.lists(st.sampled_from(OUTCOMES), max_size=60), st.integers(0, 5))
def test_the_budget_is_broken_exactly_when_the_streak_exceeds_the_tolerance(outcomes, tolerance):
    p = policy(max_generation_failures=tolerance)
    streak = 0
    for outcome in outcomes:
        streak = 0 if outcome == "success" else streak + 1 if outcome == "failed" else streak
        verdict = p.record(outcome)
        assert (verdict is not None) == (streak > tolerance)
        if verdict is not None:
            break


def test_drop_fraction_counts_only_after_a_full_window_and_names_the_reasons():
    p = policy(max_generation_failures=100, drop_window=4, max_drop_fraction=0.5)
    assert p.record("too_few_survivors", ValueError("one survivor")) is None
    assert p.record("failed", RuntimeError("x")) is None
    assert p.record("invalid_prompt") is None  # 3 finished: the window is not full yet
    verdict = p.record("reward_error")
    assert verdict.kind == "drop_fraction" and verdict.count == 4
    assert verdict.by_reason == {"failed": 1, "too_few_survivors": 1, "invalid_prompt": 1, "reward_error": 1}
    assert set(verdict.examples) == {"failed", "too_few_survivors"}


def test_a_drop_fraction_verdict_stands_for_its_most_frequent_reason():
    # reward_error first in the window, but failed is the most frequent: its first error stands for the verdict.
    e0, e1, e2 = RuntimeError("reward broke"), RuntimeError("outage 1"), RuntimeError("outage 2")
    p = policy(max_generation_failures=100, drop_window=3, max_drop_fraction=0.5)
    assert p.record("reward_error", e0) is None
    assert p.record("failed", e1) is None
    verdict = p.record("failed", e2)
    assert verdict.kind == "drop_fraction" and verdict.count == 3 and verdict.threshold == 0.5
    assert verdict.original is e1
    assert verdict.by_reason == {"failed": 2, "reward_error": 1}
    assert "3 of the last 3 groups were dropped (failed: 2, reward_error: 1), more than rollout.max_drop_fraction = 0.5" in verdict.message


def test_a_drop_fraction_verdict_whose_top_reason_has_no_error_falls_back_to_another_example():
    e0 = RuntimeError("reward broke")
    p = policy(max_generation_failures=100, drop_window=3, max_drop_fraction=0.5)
    assert p.record("reward_error", e0) is None
    assert p.record("too_few_survivors") is None  # dropped after scoring: no error to show
    verdict = p.record("too_few_survivors")
    assert verdict.by_reason == {"too_few_survivors": 2, "reward_error": 1}
    assert verdict.original is e0 and verdict.examples == {"reward_error": e0}


def test_drop_fraction_at_the_limit_is_allowed():
    p = policy(max_generation_failures=100, drop_window=4, max_drop_fraction=0.5)
    for outcome in ("failed", "success", "failed", "success", "success"):
        assert p.record(outcome) is None


def test_filtered_fraction_says_the_rewards_carry_no_signal():
    p = policy(drop_window=2, max_filtered_fraction=0.5)
    assert p.record("filtered") is None
    verdict = p.record("filtered")
    assert verdict.kind == "filtered_fraction" and "no signal" in verdict.message
    assert verdict.count == 2 and verdict.threshold == 0.5 and verdict.by_reason == {"filtered": 2}
    assert verdict.message.startswith("2 of the last 2 groups had rewards that were all equal")
    assert verdict.original is None


def test_filtered_fraction_at_the_limit_is_allowed():
    p = policy(drop_window=4, max_filtered_fraction=0.5)
    for outcome in ("filtered", "success", "filtered", "success", "success", "filtered"):
        assert p.record(outcome) is None


def test_fraction_one_turns_the_trickle_rules_off():
    p = policy(max_generation_failures=10**6, drop_window=3, max_drop_fraction=1.0, max_filtered_fraction=1.0)
    for outcome in ("failed", "filtered", "too_few_survivors") * 10:
        assert p.record(outcome) is None


def test_the_diagnostic_carries_the_breaking_groups_error_not_an_old_one():
    p = policy(max_generation_failures=1, drop_window=3)
    p.record("failed", RuntimeError("an old blip"))
    p.record("success")
    p.record("too_few_survivors", ValueError("one survivor"))
    assert p.record("failed", RuntimeError("outage 1")) is None
    verdict = p.record("failed", RuntimeError("outage 2"))
    assert str(verdict.original) == "outage 2"
    assert "an old blip" not in {str(e) for e in verdict.examples.values()}  # out of the window by now


# ---------------------------------------------------------------- the tolerance warning tells the policy's truth


def first_verdict_kind(p: FailurePolicy, successes_first: int) -> str:
    """Finish `successes_first` good groups, then failed groups until the policy gives a verdict; its kind."""
    for _ in range(successes_first):
        assert p.record("success") is None
    while (verdict := p.record("failed")) is None:
        pass
    return verdict.kind


@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.5, 0.75, 0.9, 1.0])
@pytest.mark.parametrize("window", [1, 2, 3, 5, 8, 13])
@pytest.mark.parametrize("budget", range(0, 15))
def test_the_tolerance_warning_says_when_the_failure_budget_can_be_reached(budget, window, fraction):
    cfg = load_config(None, [f"rollout.max_generation_failures={budget}", f"rollout.drop_window={window}", f"rollout.max_drop_fraction={fraction}"])
    warnings = tolerance_warnings(cfg)
    tolerances = dict(max_generation_failures=budget, drop_window=window, max_drop_fraction=fraction)
    at_start = first_verdict_kind(policy(**tolerances), successes_first=0)
    later = first_verdict_kind(policy(**tolerances), successes_first=window)
    if not warnings:
        assert at_start == later == "generation_failures"
    elif "can never be reached" in warnings[0]:
        assert at_start == later == "drop_fraction"
    else:
        assert f"applies only until the first {window} groups" in warnings[0]
        assert (at_start, later) == ("generation_failures", "drop_fraction")


def test_a_budget_of_40_in_the_default_window_is_reachable_at_the_start_and_the_warning_says_so():
    # The run the issue saw: warned "can never be reached", then failed with 41 consecutive failures.
    cfg = load_config(None, ["rollout.max_generation_failures=40"])
    (warning,) = tolerance_warnings(cfg)
    assert "can never be reached" not in warning
    assert "applies only until the first 64 groups" in warning and "after 33 consecutive all-failed groups" in warning
    assert first_verdict_kind(policy(max_generation_failures=40, max_drop_fraction=0.5), successes_first=0) == "generation_failures"


@given(st.lists(st.sampled_from(OUTCOMES), max_size=40), st.integers(1, 6), st.sampled_from([0.0, 0.25, 0.5]))
def test_the_trickle_rules_judge_exactly_the_last_window_of_endings(outcomes, window, fraction):
    p = policy(max_generation_failures=10**6, drop_window=window, max_drop_fraction=fraction, max_filtered_fraction=fraction)
    for i, outcome in enumerate(outcomes):
        verdict = p.record(outcome)
        last = outcomes[max(0, i + 1 - window) : i + 1]
        dropped = sum(o in ("failed", "too_few_survivors", "invalid_prompt", "reward_error") for o in last)
        filtered = last.count("filtered")
        if i + 1 < window:
            assert verdict is None
        elif dropped > fraction * window:
            assert verdict is not None and verdict.kind == "drop_fraction" and verdict.count == dropped
        elif filtered > fraction * window:
            assert verdict is not None and verdict.kind == "filtered_fraction" and verdict.count == filtered
        else:
            assert verdict is None
