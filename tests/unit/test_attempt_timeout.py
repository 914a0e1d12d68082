"""`LatencyTracker`: the adaptive attempt timeout (pure: no clock, no I/O)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncgrpo.generation.attempt_timeout import MIN_SAMPLES, OVERDUE_FACTOR, WINDOW, LatencyTracker

TOKENS = 16  # what every answer in these tests asked for


def tracker(**kw) -> LatencyTracker:
    return LatencyTracker(**{"cap_s": 60.0, "factor": 3.0, "floor_s": 0.1, **kw})


def test_before_enough_answers_an_attempt_may_take_the_whole_request_timeout():
    t = tracker()
    for _ in range(MIN_SAMPLES - 1):
        t.record(0.02, TOKENS)
    assert t.quantile_s() is None and t.timeout_s() == 60.0 and t.silence_s() == 60.0
    assert "request_timeout_s = 60" in t.describe()
    t.record(0.02, TOKENS)
    assert t.timeout_s() == pytest.approx(0.1)  # 3 x 0.02 is under the floor


def test_the_timeout_is_factor_times_the_99th_percentile_of_recent_answers():
    t = tracker()
    for i in range(100):
        t.record(0.01 * (i + 1), TOKENS)  # 0.01 .. 1.00 s
    assert t.quantile_s() == pytest.approx(0.99)
    assert t.timeout_s() == pytest.approx(3 * 0.99)
    assert t.silence_s() == pytest.approx(3 * 0.99)
    assert "99% latency 0.99 s of the last 100 answers" in t.describe()


def test_only_the_last_window_of_answers_counts():
    t = tracker()
    for _ in range(WINDOW):
        t.record(5.0, TOKENS)
    assert t.timeout_s() == pytest.approx(15.0)
    for _ in range(WINDOW):
        t.record(0.5, TOKENS)  # the server got faster: the old latencies leave the window
    assert t.timeout_s() == pytest.approx(1.5)


def test_the_timeout_is_capped_by_the_request_timeout_and_floored():
    slow = tracker(cap_s=10.0)
    fast = tracker(floor_s=0.25)
    for _ in range(MIN_SAMPLES):
        slow.record(8.0, TOKENS)
        fast.record(0.001, TOKENS)
    assert slow.timeout_s() == 10.0
    assert fast.timeout_s() == 0.25


def test_each_earlier_timeout_of_a_request_doubles_its_next_attempt_up_to_the_cap():
    t = tracker(cap_s=5.0)
    for _ in range(MIN_SAMPLES):
        t.record(0.2, TOKENS)
    assert [round(t.timeout_s(n), 3) for n in range(5)] == [0.6, 1.2, 2.4, 4.8, 5.0]
    assert t.timeout_s(10_000) == 5.0  # no overflow


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_a_latency_that_is_not_a_duration_is_refused(bad):
    with pytest.raises(ValueError, match="latency"):
        tracker().record(bad, TOKENS)


def test_an_answer_must_have_asked_for_at_least_one_token():
    with pytest.raises(ValueError, match="tokens asked for"):
        tracker().record(0.1, 0)


def test_a_request_asking_for_more_tokens_than_the_answers_seen_gets_proportionally_longer():
    """Long completions are not cut at the latency of short ones (e.g. an evaluation with a larger max_new_tokens)."""
    t = tracker()
    for _ in range(MIN_SAMPLES):
        t.record(0.4, 16)  # 25 ms per token asked
    assert t.timeout_s(tokens=16) == pytest.approx(3 * 0.4)
    assert t.timeout_s(tokens=64) == pytest.approx(3 * 0.4 * 4)
    assert t.timeout_s(1, tokens=64) == pytest.approx(3 * 0.4 * 4 * 2)
    assert t.timeout_s(tokens=4096) == 60.0  # still capped


def test_a_request_asking_for_fewer_tokens_never_gets_less_than_the_plain_quantile():
    """Prefill and queueing do not shrink with max_tokens: a short request keeps the whole-answer budget."""
    t = tracker()
    for _ in range(MIN_SAMPLES):
        t.record(0.4, 16)
    assert t.timeout_s(tokens=1) == t.timeout_s() == pytest.approx(3 * 0.4)


def test_mixed_lengths_scale_by_the_slowest_per_token_answers():
    t = tracker()
    for _ in range(MIN_SAMPLES):
        t.record(0.1, 4)  # 25 ms per token
        t.record(0.2, 16)  # 12.5 ms per token
    assert t.quantile_s() == pytest.approx(0.2)
    assert t.timeout_s(tokens=32) == pytest.approx(3 * 0.025 * 32)


def test_an_overdue_attempt_nothing_overtook_is_abandoned_at_a_multiple_of_its_budget_capped():
    t = tracker(cap_s=10.0)
    assert t.overdue_limit_s(0.5) == pytest.approx(OVERDUE_FACTOR * 0.5)
    assert t.overdue_limit_s(9.0) == 10.0


def test_settings_out_of_range_are_refused():
    with pytest.raises(ValueError, match="factor >= 1"):
        LatencyTracker(cap_s=1.0, factor=0.5, floor_s=0.1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 10, allow_nan=False), max_size=3 * WINDOW))
def test_the_quantile_is_that_of_the_last_window_of_answers(events):
    t, seen = tracker(), []
    for latency in events:
        t.record(latency, TOKENS)
        seen.append(latency)
        window = sorted(seen[-WINDOW:])
        expected = None if len(window) < MIN_SAMPLES else window[min(len(window) - 1, math.ceil(0.99 * len(window)) - 1)]
        assert t.quantile_s() == expected and t.samples == len(window)
