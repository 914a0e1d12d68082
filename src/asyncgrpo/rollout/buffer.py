"""The replay buffer: finished groups waiting for a training step.

Plain data structure; waiting for it happens in the collector, under its Condition.

Invariants:
- `take(n)` hands out the `n` groups of lowest generation version, ties broken by
  completion order (`Group.seq`).
- `remove_stale(step)` is the consumption-time check that makes the staleness bound
  hard: called before every take, it removes every group that is stale at `step` (staleness
  above K, or above its own bound: a resumed group's under `rollout.max_prefix_staleness`), so no
  such group can ever reach the loss.
"""

from __future__ import annotations

import heapq
from collections import Counter

from asyncgrpo.rollout.admission import is_stale
from asyncgrpo.types import Group


class ReplayBuffer:
    def __init__(self, max_staleness: int) -> None:
        self.max_staleness = max_staleness
        self._heap: list[tuple[int, int, Group]] = []
        self._targets: Counter[int | None] = Counter()  # buffered groups by target step: `count_target` in O(1)

    def __len__(self) -> int:
        return len(self._heap)

    def put(self, group: Group) -> None:
        heapq.heappush(self._heap, (group.generation_version, group.seq, group))
        self._targets[group.target_step] += 1

    def remove_stale(self, step: int) -> list[Group]:
        """Remove and return the groups that are stale at `step` (and so at every later step)."""
        stale = [g for _, _, g in self._heap if self._stale(g, step)]
        if stale:
            self._heap = [entry for entry in self._heap if not self._stale(entry[2], step)]
            heapq.heapify(self._heap)
        return self._forget(stale)

    def _stale(self, group: Group, step: int) -> bool:
        return is_stale(generation_version=group.generation_version, step=step, max_staleness=group.bound(self.max_staleness))

    def take(self, n: int, prefer_target: int | None = None) -> list[Group]:
        """Remove and return up to `n` groups, oldest generation version first; with `prefer_target`, the groups
        targeting that step (`Group.target_step`) before any other."""
        if prefer_target is None:
            return self._forget([heapq.heappop(self._heap)[2] for _ in range(min(n, len(self._heap)))])
        ordered = sorted(self._heap, key=lambda entry: (entry[2].target_step != prefer_target, entry[:2]))
        self._heap = ordered[n:]
        heapq.heapify(self._heap)
        return self._forget([entry[2] for entry in ordered[:n]])

    def _forget(self, removed: list[Group]) -> list[Group]:
        for group in removed:
            self._targets[group.target_step] -= 1
            if not self._targets[group.target_step]:
                del self._targets[group.target_step]
        return removed

    def count_target(self, step: int) -> int:
        """Buffered groups that target `step`: O(1), counted as groups come and go."""
        return self._targets[step]

    def groups(self) -> list[Group]:
        return [g for _, _, g in sorted(self._heap)]
