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
- generation 0's threshold rises from 700 to `GEN0_THRESHOLD` allocations, so the loop's many
  short-lived objects (futures, handles, requests) die young in far fewer, still short, collections.
On exit the thresholds are restored and the frozen objects unfrozen (collectable again).
Nothing is ever disabled: cycles created during the run are still collected.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

GEN0_THRESHOLD = 10_000


@contextmanager
def quiet_gc(*, collect: bool = True) -> Iterator[None]:
    """Freeze what setup left alive and collect young objects less often, for the duration of the block."""
    thresholds = gc.get_threshold()
    if collect:
        gc.collect()
    gc.freeze()
    gc.set_threshold(max(GEN0_THRESHOLD, thresholds[0]), *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
