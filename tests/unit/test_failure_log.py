"""FailureLog: the first tolerated failure of each kind in full, then counts at most once per interval."""

from __future__ import annotations

import pytest

from asyncgrpo.rollout.failure_log import FailureLog


def test_the_first_failure_of_each_class_and_source_is_shown_in_full():
    log = FailureLog(30.0)
    first = log.record("failed", "RolloutDeadlineError", "http", "request 3-0-0-1 still failing", now=0.0)
    assert len(first) == 1 and "RolloutDeadlineError from http: request 3-0-0-1 still failing" in first[0]
    assert "rollout failed" in first[0] and "logging.failure_summary_s = 30 s" in first[0]
    assert log.record("failed", "RolloutDeadlineError", "http", "again", now=1.0) == []
    # another class, another source, another kind of tolerance: each is new
    assert len(log.record("failed", "GenerationError", "http", "HTTP 400", now=2.0)) == 1
    assert len(log.record("failed", "RolloutDeadlineError", "other", "x", now=3.0)) == 1
    assert "attempt retried" in log.record("retried", "RolloutDeadlineError", "http", "x", now=4.0)[0]


def test_a_summary_counts_by_kind_class_and_source_and_comes_at_most_once_per_interval():
    log = FailureLog(10.0)
    lines = []
    for t in range(0, 25):  # one failure per second, alternating classes
        cls = "TransientGenerationError" if t % 2 else "RequestTimeoutError"
        lines += [(t, line) for line in log.record("retried", cls, "scripted", "m", now=float(t))]
    summaries = [(t, line) for t, line in lines if line.startswith("tolerated failures in the last")]
    assert [t for t, _ in summaries] == [10, 20]
    # the first period runs from the first failure (t=0) to t=10: 11 failures, 6 timeouts and 5 transients
    assert summaries[0][1] == (
        "tolerated failures in the last 10 s: 11 x attempt retried "
        "(RequestTimeoutError from scripted: 6, TransientGenerationError from scripted: 5)"
    )
    # the second counts only what came after the first summary
    assert summaries[1][1].startswith("tolerated failures in the last 10 s: 10 x attempt retried")
    assert log.flush(24.5) == ["tolerated failures in the last 4 s: 4 x attempt retried "
                               "(RequestTimeoutError from scripted: 2, TransientGenerationError from scripted: 2)"]
    assert log.flush(30.0) == []  # nothing new since


def test_no_summary_repeats_what_was_already_shown_in_full():
    log = FailureLog(5.0)
    assert len(log.record("failed", "A", "s", "m", now=0.0)) == 1
    assert len(log.record("failed", "B", "s", "m", now=100.0)) == 1  # new: shown in full, so no summary is due
    assert log.flush(200.0) == []
    # a repeat is due for a summary at once (the period began at the first failure); it counts the whole period
    assert log.record("failed", "A", "s", "m", now=201.0) == [
        "tolerated failures in the last 201 s: 3 x rollout failed (A from s: 2, B from s: 1)"
    ]
    assert log.flush(300.0) == []


def test_kinds_are_summarised_separately():
    log = FailureLog(1.0)
    log.record("retried", "T", "gen", "m", now=0.0)
    log.record("reward_error", "RewardError", "the reward functions", "m", now=0.0)
    log.record("retried", "T", "gen", "m", now=0.5)
    (summary,) = log.record("reward_error", "RewardError", "the reward functions", "m", now=1.0)
    assert summary == ("tolerated failures in the last 1 s: 2 x attempt retried (T from gen: 2); "
                       "2 x group dropped for a reward error (RewardError from the reward functions: 2)")


@pytest.mark.parametrize("interval", [0.0, -1.0, float("nan")])
def test_the_interval_must_be_positive(interval):
    with pytest.raises(ValueError, match=r"^summary_interval_s must be > 0, got "):
        FailureLog(interval)
