"""The collector's books, each on its own: replay buffer expiry, accounting, the prompt ledger, tracebacks, token books, the no-signal
watch; and `Books`, which records every ending in all of them at once.

The pipeline tests reach these only along their happy paths (a buffered group rarely goes
stale, a ledger sink is a real run's file); these pin the rest (mutation testing found them
unchecked: docs/benchmarks.md, "Mutation testing").
"""

from __future__ import annotations

from collections import Counter

import pytest

from asyncgrpo.rollout import token_books
from asyncgrpo.rollout.accounting import Accounting
from asyncgrpo.rollout.books import Books
from asyncgrpo.rollout.buffer import ReplayBuffer
from asyncgrpo.rollout.failures import FailurePolicy
from asyncgrpo.rollout.first_failure import format_traceback
from asyncgrpo.rollout.in_flight import InFlightGroup
from asyncgrpo.rollout.ledger import PromptLedger
from asyncgrpo.rollout.no_signal import NoSignalWatch
from asyncgrpo.types import Completion, Drop, Group, Prompt, Rollout


def group(prompt_id: int, version: int, seq: int) -> Group:
    completion = Completion(token_ids=(5,), logprobs=(-1.0,), versions=(version,), finish_reason="stop", dispatch_version=version)
    rollouts = tuple(Rollout(completion=completion, reward=float(r), advantage=0.0) for r in (0, 1))
    return Group(prompt=Prompt(id=prompt_id, text="p", token_ids=(1,)), rollouts=rollouts, seq=seq)


def test_the_buffer_removes_exactly_the_groups_too_old_for_the_step_and_keeps_the_rest_in_order():
    buffer = ReplayBuffer(max_staleness=1)
    for prompt_id, version, seq in ((0, 3, 1), (1, 1, 2), (2, 2, 3), (3, 2, 4), (4, 1, 5)):
        buffer.put(group(prompt_id, version, seq))
    assert buffer.remove_stale(2) == []  # versions >= 1 are trainable at step 2 with K=1
    stale = buffer.remove_stale(3)  # version 1 is not
    assert sorted(g.prompt.id for g in stale) == [1, 4] and len(buffer) == 3
    assert [g.prompt.id for g in buffer.take(3)] == [2, 3, 0]  # still a heap: oldest version, then seq


def test_accounting_counts_every_requeue_and_refuses_to_leave_an_empty_bucket():
    acc = Accounting()
    for _ in range(3):
        acc.take()
    acc.requeue_in_flight()
    acc.requeue_in_flight()
    acc.take()
    acc.buffer()
    acc.buffer()
    acc.drop_buffered("stale")
    acc.drop_buffered("stale")
    assert acc.requeued == 2 and acc.dropped["stale"] == 2 and acc.in_flight == acc.buffered == 0 and acc.balanced()
    with pytest.raises(AssertionError, match=r"^accounting: a group left 'in flight' but none was in flight$"):
        acc.buffer()
    with pytest.raises(AssertionError, match=r"^accounting: a group left 'buffered' but none was buffered$"):
        acc.train_buffered(1)


def test_a_resumed_accounting_counts_what_was_in_flight_or_buffered_as_requeued():
    acc = Accounting()
    for _ in range(6):
        acc.take()
    acc.buffer()
    acc.buffer()
    acc.train_buffered(1)
    acc.drop_in_flight("failed")
    acc.requeue_in_flight()
    saved = acc.to_json()
    assert saved == {
        "taken": 6, "trained": 1, "requeued": 1, "dropped": {**{r: 0 for r in acc.dropped}, "failed": 1},
        "in_flight": 2, "buffered": 1,
    }
    resumed = Accounting.resumed(saved)
    assert resumed.to_json() == {**saved, "requeued": 1 + 2 + 1, "in_flight": 0, "buffered": 0}
    assert resumed.balanced()
    # a checkpoint from before a drop reason existed resumes with 0 of it
    older = {**saved, "dropped": {"failed": 1}}
    assert Accounting.resumed(older).dropped == {**{r: 0 for r in acc.dropped}, "failed": 1}


def test_the_ledger_records_each_end_once_and_tells_its_sink():
    records = []
    ledger = PromptLedger(done={"1": [7]}, sink=records.append)
    ledger.trained(Prompt(id=3, text="p", token_ids=(1,)), step=4)
    ledger.dropped(Prompt(id=5, text="p", token_ids=(1,), epoch=1), "stale", step=6)
    assert records == [
        {"epoch": 0, "prompt_id": 3, "step": 4, "outcome": "trained"},
        {"epoch": 1, "prompt_id": 5, "step": 6, "outcome": "dropped", "reason": "stale"},
    ]
    assert ledger.done_by_epoch() == {0: [3], 1: [5, 7]}
    with pytest.raises(AssertionError, match=r"^prompt 7 of epoch 1 ended twice$"):
        ledger.trained(Prompt(id=7, text="p", token_ids=(1,), epoch=1), step=9)


def test_a_rollouts_generator_time_is_counted_in_whole_milliseconds():
    counters: Counter[str] = Counter()
    assert token_books.rollout_ended(counters, 1.5) == 1500 and token_books.rollout_ended(counters, 0.0004) == 0
    assert counters["rollout/generation_ms_total"] == 1500


def test_the_no_signal_warning_says_what_share_of_the_window_was_flat():
    watch = NoSignalWatch(4)
    assert [watch.observe(flat) for flat in (True, False, True)] == [None, None, None]  # the window is not full yet
    warning = watch.observe(True)
    assert warning is not None and "3 of the last 4 groups" in warning and "(75%)" in warning
    assert watch.observe(True) is None  # once per run


def test_no_exception_formats_as_no_traceback():
    assert format_traceback(None) == ""
    try:
        raise ValueError("boom")
    except ValueError as exc:
        lines = format_traceback(exc).splitlines()
    assert lines[0] == "Traceback (most recent call last):" and lines[1].startswith('  File "') and lines[-1] == "ValueError: boom"


class Recorder:
    """An observer that keeps every call (rollout/events.py)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def rollout_started(self, take, prompt_id, member, t):
        self.calls.append(("started", take, member))

    def rollout_ended(self, take, member, outcome, version, tokens, t):
        self.calls.append(("rollout", take, member, outcome, tokens))

    def take_ended(self, take, prompt_id, ending, seq, t):
        self.calls.append(("take", take, ending, seq))

    def buffered_ended(self, seqs, outcome, step, t):
        self.calls.append(("buffered", tuple(seqs), outcome, step))


def in_flight(books: Books, prompt_id: int, size: int = 2) -> InFlightGroup:
    group = InFlightGroup(key=books.take(), prompt=Prompt(id=prompt_id, text="p", token_ids=(1,)), size=size)
    group.dispatch_versions = [0] * size
    return group


def test_the_books_record_every_ending_in_every_record_once():
    observer, records = Recorder(), []
    books = Books(FailurePolicy(max_generation_failures=5, drop_window=10, max_drop_fraction=1.0, max_filtered_fraction=1.0),
                  ledger=PromptLedger(sink=records.append), observer=observer)
    kept, lost, requeued, stale = (in_flight(books, i) for i in range(4))
    books.rollout_started(kept, 0, 0.0)
    books.rollout_ended(kept, 0, group(0, 0, 1).rollouts[0].completion, 0.25, 1.0)
    books.rollout_started(lost, 1, 0.0)
    books.rollout_ended(lost, 1, RuntimeError("500"), 0.5, 1.0)
    books.rollout_cancelled(stale, 0, 0.125, 1.0)
    books.retried()
    assert kept.completions[0] is not None and kept.ms[0] == 250 and isinstance(lost.errors[1], RuntimeError) and lost.ms[1] == 500
    buffered = group(0, 0, seq=1)
    assert books.buffered(kept, buffered, 2.0) is None
    assert books.dropped(lost, Drop("failed", lost.errors[1]), step=3, t=2.0) is None
    books.left_behind(requeued, samples=1, fate="requeue", step=3, t=2.0)
    books.left_behind(stale, samples=2, fate="drop", step=3, t=2.0)
    books.trained([buffered], step=3, t=3.0)
    late = in_flight(books, 4)
    books.buffered(late, group(4, 0, seq=2), 3.0)
    books.stale_buffered(group(4, 0, seq=2), step=4, t=4.0)
    acc, counters = books.accounting, books.counters
    assert acc.to_json() == {"taken": 5, "trained": 1, "requeued": 1, "in_flight": 0, "buffered": 0,
                             "dropped": {**dict.fromkeys(acc.dropped, 0), "failed": 1, "stale": 2}}
    assert {k: v for k, v in counters.items() if v} == {
        "rollout/generated_tokens_total": 1, "rollout/failed_total": 1, "rollout/retries_total": 1, "rollout/generation_ms_total": 875,
        "rollout/dropped_groups_total": 3, "rollout/dropped/failed": 1, "rollout/dropped/stale": 2, "rollout/requeued_total": 1,
        "rollout/stale_groups_total": 3, "rollout/stale_samples_total": 1 + 2 + 2, "rollout/stale_completions_total": 2,
        "rollout/wasted_tokens_total": 2, "rollout/wasted_tokens/stale": 2,
        "rollout/trained_completions_total": 2, "rollout/trained_tokens_total": 2,
    }
    assert [(r["prompt_id"], r["outcome"], r.get("reason")) for r in records] == [(1, "dropped", "failed"), (3, "dropped", "stale"),
                                                                                  (0, "trained", None), (4, "dropped", "stale")]
    assert [c for c in observer.calls if c[0] in ("take", "buffered")] == [
        ("take", 1, "buffered", 1), ("take", 2, "failed", None), ("take", 3, "requeued", None), ("take", 4, "stale", None),
        ("buffered", (1,), "trained", 3), ("take", 5, "buffered", 2), ("buffered", (2,), "stale", 4),
    ]
    assert [c[3] for c in observer.calls if c[0] == "rollout"] == ["finished", "failed", "cancelled"]
    assert books.policy.judged == 3 and books.policy.streak == 0  # two buffered, one failed; a cancellation is never judged


def test_a_judged_ending_returns_the_failure_policys_verdict():
    books = Books(FailurePolicy(max_generation_failures=0, drop_window=10, max_drop_fraction=1.0, max_filtered_fraction=1.0))
    error = RuntimeError("down")
    verdict = books.dropped(in_flight(books, 0), Drop("failed", error), step=0, t=0.0)
    assert verdict is not None and verdict.kind == "generation_failures" and verdict.original is error
