"""`PoolHealth`: the dead-backend clock and the hung-server rule (pure: times are passed in)."""

from __future__ import annotations

from asyncgrpo.generation.pool_health import HUNG_AFTER, PoolHealth

A, B = "http://a", "http://b"


def test_the_dead_clock_starts_at_the_first_failure_and_only_an_answer_stops_it():
    h = PoolHealth([A, B])
    assert h.failing_for(100.0) is None  # idle time is not failing
    h.answered(A, 1.0)
    assert h.failing_for(500.0) is None
    h.failed(A, 600.0, timed_out=False)  # HTTP 500
    h.failed(B, 610.0, timed_out=False)  # connection reset
    assert h.failing_for(660.0) == 60.0
    h.answered(B, 661.0)
    assert h.failing_for(700.0) is None
    h.failed(A, 701.0, timed_out=True)
    assert h.failing_for(702.0) == 1.0


def test_a_server_whose_attempts_keep_timing_out_while_another_answers_looks_hung():
    h = PoolHealth([A, B])
    verdicts = []
    for i in range(HUNG_AFTER):
        h.answered(B, 10.0 + i)
        verdicts.append(h.failed(A, 10.5 + i, timed_out=True))
    assert verdicts == [False] * (HUNG_AFTER - 1) + [True]
    assert h.timeouts_in_a_row(A) == HUNG_AFTER
    h.reinstated(A)
    assert h.timeouts_in_a_row(A) == 0


def test_a_lone_slow_server_is_never_reported_hung():
    """Nobody else answered since its streak began: taking it out would leave nothing (the dead clock decides)."""
    h = PoolHealth([A, B])
    h.answered(B, 1.0)  # before the streak
    assert not any(h.failed(A, 2.0 + i, timed_out=True) for i in range(3 * HUNG_AFTER))
    single = PoolHealth([A])
    single.answered(A, 1.0)
    assert not any(single.failed(A, 2.0 + i, timed_out=True) for i in range(3 * HUNG_AFTER))


def test_an_answer_or_an_http_error_ends_a_streak_of_timeouts():
    h = PoolHealth([A, B])
    h.answered(B, 0.0)
    for other_outcome in ("answer", "error"):
        for i in range(HUNG_AFTER - 1):
            h.answered(B, 1.0 + i)
            assert not h.failed(A, 1.5 + i, timed_out=True)
        if other_outcome == "answer":
            h.answered(A, 5.0)
        else:
            assert not h.failed(A, 5.0, timed_out=False)
        assert h.timeouts_in_a_row(A) == 0


def test_the_hung_rule_asks_whether_another_server_answered_since_the_streak_began_whatever_the_order():
    """Booked in O(1), the rule matches the scan over every server's last answer."""
    import random

    rng = random.Random(0)
    urls = [f"http://s{i}" for i in range(5)]
    h = PoolHealth(urls)
    last_answer: dict[str, float] = {}
    streak: dict[str, float] = {}
    for step in range(5000):
        now, url = float(step), rng.choice(urls)
        if rng.random() < 0.3:
            h.answered(url, now)
            last_answer[url] = now
            streak.pop(url, None)
        else:
            streak.setdefault(url, now)
            expected = h.timeouts_in_a_row(url) + 1 >= HUNG_AFTER and any(
                other != url and t >= streak[url] for other, t in last_answer.items())
            assert h.failed(url, now, timed_out=True) == expected
