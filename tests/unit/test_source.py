"""PromptSource: epochs, reshuffles, end of data, requeues and exactly-once hand-out."""

from __future__ import annotations

import sys
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncgrpo.data.source import PromptSource
from asyncgrpo.types import Prompt

pytestmark = pytest.mark.timeout(60)


def make_prompts(n: int, first_id: int = 0) -> list[Prompt]:
    return [Prompt(id=first_id + i, text=f"p{i}", token_ids=(i,), columns={"k": i}) for i in range(n)]


def drain(source: PromptSource) -> list[Prompt]:
    out = []
    while (p := source.take()) is not None:
        out.append(p)
    return out


def test_epochs_hand_out_each_prompt_once_and_reshuffle():
    source = PromptSource(make_prompts(20), num_epochs=3, shuffle=True, seed=0)
    assert source.prompts_per_epoch == 20 and source.total_prompts == 60 and source.remaining == 60
    taken = drain(source)
    assert len(taken) == 60 and source.taken_total == 60
    epochs = [[p.id for p in taken if p.epoch == e] for e in range(3)]
    assert [p.epoch for p in taken] == [0] * 20 + [1] * 20 + [2] * 20  # epochs do not interleave
    assert all(sorted(ids) == list(range(20)) for ids in epochs)
    assert len({tuple(ids) for ids in epochs}) == 3  # a fresh shuffle each epoch
    assert epochs[0] != list(range(20))
    assert all(p.requeues == 0 and p.columns == {"k": p.id} for p in taken)


def test_order_is_deterministic_for_a_seed():
    def order(seed):
        return [(p.id, p.epoch) for p in drain(PromptSource(make_prompts(15), num_epochs=2, shuffle=True, seed=seed))]

    assert order(1) == order(1)
    assert order(1) != order(2)


def test_no_shuffle_keeps_the_given_order():
    prompts = make_prompts(5, first_id=10)
    taken = drain(PromptSource(prompts, num_epochs=2, shuffle=False, seed=0))
    assert [p.id for p in taken] == [10, 11, 12, 13, 14] * 2


def test_exhaustion_returns_none_repeatedly():
    source = PromptSource(make_prompts(2), num_epochs=1, shuffle=True, seed=0)
    assert not source.exhausted
    assert source.take() is not None
    assert source.take() is not None
    assert source.exhausted and source.remaining == 0
    assert source.take() is None
    assert source.take() is None
    assert source.taken_total == 2

    empty = PromptSource([], num_epochs=3, shuffle=True, seed=0)
    assert empty.exhausted and empty.take() is None


def test_requeued_prompts_come_first_in_requeue_order():
    source = PromptSource(make_prompts(6), num_epochs=1, shuffle=False, seed=0)
    a, b, _ = source.take(), source.take(), source.take()
    source.requeue(b)
    again = source.requeue(a)
    assert again.requeues == 1 and again.id == a.id and again.epoch == a.epoch
    assert source.remaining == 5
    first, second = source.take(), source.take()
    assert (first.id, first.requeues) == (b.id, 1)
    assert (second.id, second.requeues) == (a.id, 1)
    assert source.take().id == 3
    # A prompt requeued twice carries requeues == 2.
    assert source.requeue(first).requeues == 2
    twice = source.take()
    assert (twice.id, twice.requeues) == (b.id, 2)
    assert source.take().id == 4


def test_requeue_after_exhaustion_reopens_the_source():
    source = PromptSource(make_prompts(1), num_epochs=1, shuffle=False, seed=0)
    p = source.take()
    assert source.exhausted
    source.requeue(p)
    assert not source.exhausted
    assert source.take().id == p.id
    assert source.take() is None


def test_requeue_keeps_the_epoch_across_epoch_boundaries():
    source = PromptSource(make_prompts(2), num_epochs=2, shuffle=False, seed=0)
    p0 = source.take()
    source.take()
    nxt = source.take()
    assert nxt.epoch == 1
    source.requeue(p0)
    back = source.take()
    assert back.epoch == 0 and back.requeues == 1


def test_requeue_of_a_foreign_prompt_is_rejected():
    source = PromptSource(make_prompts(2), num_epochs=1, shuffle=False, seed=0)
    with pytest.raises(ValueError, match="does not belong"):
        source.requeue(Prompt(id=99, text="x", token_ids=()))


def test_a_resumed_source_hands_out_everything_not_done_in_the_epoch_order():
    prompts = make_prompts(7)
    reference = PromptSource(prompts, num_epochs=2, shuffle=True, seed=5)
    order = [(p.id, p.epoch) for p in iter(reference.take, None)]
    # At the checkpoint: the first 4 of epoch 0 and the first of epoch 1 were done (trained or
    # dropped); the rest were in flight, buffered or not yet taken.
    done = {0: {pid for pid, _ in order[:4]}, 1: {order[7][0]}}
    resumed = PromptSource(prompts, num_epochs=2, shuffle=True, seed=5, done=done)
    assert [(p.id, p.epoch) for p in iter(resumed.take, None)] == order[4:7] + order[8:]


def test_a_fully_done_epoch_is_skipped():
    prompts = make_prompts(3)
    resumed = PromptSource(prompts, num_epochs=2, shuffle=False, seed=0, done={0: {0, 1, 2}})
    assert [(p.id, p.epoch) for p in iter(resumed.take, None)] == [(0, 1), (1, 1), (2, 1)]


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(0, 12),
    num_epochs=st.integers(1, 3),
    seed=st.integers(0, 1000),
    shuffle=st.booleans(),
    actions=st.lists(st.integers(0, 9), max_size=80),
)
def test_every_prompt_exactly_once_per_epoch_under_requeues(n, num_epochs, seed, shuffle, actions):
    """Random take/requeue sequences: every (id, epoch) is handed out once plus once per requeue,
    requeued prompts always come first, and the identity taken == new + requeued holds."""
    source = PromptSource(make_prompts(n), num_epochs=num_epochs, shuffle=shuffle, seed=seed)
    outstanding: list = []  # taken and not requeued
    pending_requeues: list = []  # requeued and not yet taken again, in order
    handed = Counter()
    requeue_count = Counter()
    for action in actions + [0] * (n * num_epochs + 100):
        if action >= 7 and outstanding:  # requeue one outstanding prompt
            victim = outstanding.pop(action % len(outstanding))
            queued = source.requeue(victim)
            assert queued.requeues == victim.requeues + 1
            pending_requeues.append(queued)
            requeue_count[(victim.id, victim.epoch)] += 1
            continue
        remaining_before = source.remaining
        p = source.take()
        if p is None:
            assert source.exhausted and not pending_requeues and remaining_before == 0
            if not outstanding:
                break
            continue
        assert source.remaining == remaining_before - 1
        if pending_requeues:
            assert p == pending_requeues.pop(0)  # requeued ones first, in order
        else:
            assert p.requeues == 0
        handed[(p.id, p.epoch)] += 1
        outstanding.append(p)
    # Drained: every prompt of every epoch handed out once, plus once per requeue.
    assert source.take() is None and source.exhausted
    expected = {(i, e): 1 + requeue_count[(i, e)] for i in range(n) for e in range(num_epochs)}
    assert dict(handed) == expected
    assert source.taken_total == sum(handed.values())


def test_exhausted_agrees_with_take_when_later_epochs_are_done():
    # At the checkpoint one prompt of epoch 0 was still requeued and all of epoch 1 was done.
    prompts = make_prompts(3)
    source = PromptSource(prompts, num_epochs=2, shuffle=False, seed=0, done={0: {1, 2}, 1: {0, 1, 2}})
    assert not source.exhausted and source.remaining == 1
    assert source.take().id == 0
    assert source.exhausted and source.take() is None


def test_remaining_counts_prompts_done_in_later_epochs_without_building_their_order():
    source = PromptSource(make_prompts(4), num_epochs=3, shuffle=True, seed=0, done={2: [0, 1], 7: [3]})
    assert source.remaining == 4 + 4 + 2  # an epoch beyond num_epochs in the ledger counts for nothing
    taken = [source.take() for _ in range(10)]
    assert all(p is not None for p in taken) and source.exhausted and source.take() is None
    assert sorted(p.id for p in taken if p.epoch == 2) == [2, 3]


def trace_events(read) -> int:
    """How many Python calls and lines `read()` executes: a count, so a cost that grows shows without a clock."""
    events = 0

    def tracer(frame, event, arg):
        nonlocal events
        events += 1
        return tracer

    sys.settrace(tracer)
    try:
        read()
    finally:
        sys.settrace(None)
    return events


def test_remaining_does_not_grow_with_the_epochs_a_resumed_ledger_names():
    def resumed(epochs_done: int) -> PromptSource:
        done = {epoch: [0, 1, 2, 3] for epoch in range(epochs_done)} | {epochs_done: [0]}
        source = PromptSource(make_prompts(4), num_epochs=epochs_done + 3, shuffle=True, seed=0, done=done)
        assert source.take().epoch == epochs_done  # every fully done epoch is skipped
        return source

    few, many = resumed(3), resumed(3000)
    assert few.remaining == many.remaining == 2 + 4 + 4
    assert trace_events(lambda: many.exhausted) == trace_events(lambda: few.exhausted)


def test_an_astronomical_number_of_epochs_costs_no_more_than_two():
    huge = PromptSource(make_prompts(4), num_epochs=10**15, shuffle=True, seed=0, done={10**14: [1]})
    small = PromptSource(make_prompts(4), num_epochs=2, shuffle=True, seed=0, done={1: [1]})
    assert huge.remaining == 4 * 10**15 - 1 and not huge.exhausted
    assert trace_events(lambda: huge.exhausted) == trace_events(lambda: small.exhausted)
