"""quiet_gc: setup objects are frozen out of every collection during the run, young ones collected less often."""

from __future__ import annotations

import gc
import weakref

import pytest

from asyncgrpo.commands.gc_pauses import GEN0_THRESHOLD, YOUNG_PER_ROLLOUT, quiet_gc, young_threshold


@pytest.fixture(autouse=True)
def _restore_gc():
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_setup_objects_are_frozen_and_young_collections_rarer_inside_only():
    setup = [[i] for i in range(1000)]  # alive before the block, like a loaded model's objects
    before = gc.get_threshold()
    with quiet_gc():
        assert gc.get_freeze_count() >= len(setup)  # never walked by a collection during the run
        assert gc.get_threshold() == (GEN0_THRESHOLD, *before[1:])
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before


def test_young_threshold_grows_with_the_rollouts_in_flight_past_the_floor():
    # a young collection walks every open rollout's objects: its threshold follows them (issue 22), never below the floor
    assert young_threshold(0) == young_threshold(64) == GEN0_THRESHOLD
    assert young_threshold(16_384) == YOUNG_PER_ROLLOUT * 16_384 > GEN0_THRESHOLD
    before = gc.get_threshold()
    with quiet_gc(collect=False, rollouts_in_flight=16_384):
        assert gc.get_threshold() == (YOUNG_PER_ROLLOUT * 16_384, *before[1:])
    assert gc.get_threshold() == before


def test_cycles_made_during_the_run_are_still_collected():
    class Node:
        pass

    with quiet_gc():
        node = Node()
        node.self = node  # a cycle: only the collector frees it
        gone = weakref.ref(node)
        del node
        gc.collect()
        assert gone() is None


SEEN_FROZEN: list[int] = []
SEEN_THRESHOLDS: list[int] = []


def freeze_probe(prompts, completions, **columns):
    """A reward (inline, on the simulator's loop) that records how many objects are frozen, and generation 0's
    threshold, while the run goes on."""
    SEEN_FROZEN.append(gc.get_freeze_count())
    SEEN_THRESHOLDS.append(gc.get_threshold()[0])
    return [1.0] * len(completions)


def test_a_simulated_run_freezes_its_setup_while_it_runs():
    from asyncgrpo.commands.simulate import simulate
    from asyncgrpo.config import load_config

    SEEN_FROZEN.clear()
    SEEN_THRESHOLDS.clear()
    cfg = load_config("recipes/simulate.yaml", [
        "reward.functions=[tests.unit.test_gc_pauses:freeze_probe]", "simulate.faults=[]", "train.max_steps=2",
        "generation.max_inflight=1024",  # past the floor: the run's young threshold follows it
    ])
    assert simulate(cfg).result.outcome == "completed"
    assert SEEN_FROZEN and min(SEEN_FROZEN) > 0 and gc.get_freeze_count() == 0
    assert set(SEEN_THRESHOLDS) == {young_threshold(1024)} and young_threshold(1024) > GEN0_THRESHOLD
