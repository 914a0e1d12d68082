"""Garbage collection that keeps its pauses off the event loop's critical path during a run.

CPython's cyclic collector runs on whatever thread allocates, so on the event loop. A full
(generation 2) collection walks every tracked object: after torch, the model, the tokenizer and
the dataset are loaded that is hundreds of thousands of objects, and a pause of up to 147 ms
was measured landing on the loop (issue 15), where it delays every request, timeout and step.

`quiet_gc()` brackets the run after its setup:
- `gc.collect()` then `gc.freeze()`: everything alive after setup moves to the permanent
  generation, which collections never walk (setup objects live for the whole run anyway).
  `collect=False` skips the collection (tens of ms on a large heap): for callers that run many
  short pipelines in one process (the chaos suite's thousands of simulations); garbage left
  by setup is then frozen too, and freed after the block.
- generation 0's threshold rises from 700 to `young_threshold(rollouts_in_flight)`: `GEN0_THRESHOLD`
  (10,000), or `YOUNG_PER_ROLLOUT` per rollout in flight where that is more, so the loop's many
  short-lived objects (futures, handles, requests) die young in far fewer, still short, collections.

Why the threshold follows the rollouts in flight (issue 22): CPython counts generation 0 by the net
growth of tracked objects (allocations less deallocations), which in a run is its records (groups,
books), a constant per rollout; but a young collection walks every tracked object allocated since the
last one and still alive, which includes the objects of every rollout started since and still open:
up to about the rollouts in flight times what one holds. With a fixed threshold a rollout's share of the
collector's CPU therefore grew with the width (10 to 91 us per rollout from 64 to 16,384 in flight,
groups of 2; a third of the run's CPU at 16,384). A threshold proportional to the rollouts in flight
makes young collections rarer in the proportion they got longer, so their cost per rollout stays flat. Its price is bounded: cycles
that became garbage wait for at most one threshold's worth of net growth, `YOUNG_PER_ROLLOUT` objects
per rollout in flight, before a young collection frees them. Up to 312 rollouts in flight (the default
`generation.max_inflight` is 64) the threshold is `GEN0_THRESHOLD`, as before.
On exit the thresholds are restored and the frozen objects unfrozen (collectable again).
Nothing is ever disabled: cycles created during the run are still collected.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

GEN0_THRESHOLD = 10_000
YOUNG_PER_ROLLOUT = 32  # generation 0's threshold per rollout in flight: measured, see the module docstring


def young_threshold(rollouts_in_flight: int) -> int:
    """Generation 0's threshold during a run with up to `rollouts_in_flight` rollouts open at once."""
    return max(GEN0_THRESHOLD, YOUNG_PER_ROLLOUT * rollouts_in_flight)


@contextmanager
def quiet_gc(*, collect: bool = True, rollouts_in_flight: int = 0) -> Iterator[None]:
    """Freeze what setup left alive and collect young objects less often, for the duration of the block.
    `rollouts_in_flight`: the run's bound on rollouts open at once (`generation.max_inflight`)."""
    thresholds = gc.get_threshold()
    if collect:
        gc.collect()
    gc.freeze()
    gc.set_threshold(max(young_threshold(rollouts_in_flight), thresholds[0]), *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
