"""`PromptSource`: hands out the prompts of every epoch, and takes back requeued ones.

Pure bookkeeping: no asyncio, no I/O, no clocks; the collector owns the concurrency.

Invariants:
- Every prompt of every epoch is handed out by `take` exactly once, unless it is
  requeued; a requeued prompt is handed out once more per `requeue` call.
- Requeued prompts come first, oldest requeue first, before any prompt not yet handed out.
- Epoch e (0-based) hands out all prompts in an order that depends only on (seed, e)
  (a fresh shuffle per epoch when `shuffle`, else the given order); epochs do not
  interleave: epoch e+1 starts after the last prompt of epoch e was taken.
- Each handed-out prompt carries its `epoch`; `requeue` returns it with `requeues + 1` and
  the same epoch. The caller decides when a prompt has been requeued too often.
- `take()` returns None once every epoch is handed out and nothing is requeued; that is the
  normal end of data, not an error. A later `requeue` makes prompts available again.
- Resume: `done` maps an epoch to the ids whose take already ended in training or a drop;
  those are skipped, and everything else of that epoch (what was in flight, buffered or
  requeued when the checkpoint was written) is handed out again, in the epoch's order. A
  position cursor would lose exactly that in-flight work.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from collections.abc import Collection, Mapping, Sequence

from asyncgrpo.types import Prompt


class PromptSource:
    """Deterministic, epoch-based prompt dispenser with a requeue lane."""

    def __init__(
        self,
        prompts: Sequence[Prompt],
        *,
        num_epochs: int,
        shuffle: bool,
        seed: int,
        done: Mapping[int, Collection[int]] | None = None,
    ) -> None:
        if num_epochs < 1:
            raise ValueError(f"num_epochs must be at least 1, got {num_epochs}")
        base = [dataclasses.replace(p, epoch=0, requeues=0) for p in prompts]
        by_id = {p.id: p for p in base}
        if len(by_id) != len(base):
            raise ValueError("prompt ids must be unique within a PromptSource")
        self._prompts: tuple[Prompt, ...] = tuple(base)
        self._ids = frozenset(by_id)
        self.num_epochs = num_epochs
        self.shuffle = shuffle
        self.seed = seed
        self._done = {int(epoch): frozenset(ids) for epoch, ids in (done or {}).items()}
        # Prompts already done per epoch, so the size of any epoch is known without building its order:
        # `remaining` runs on every wake-up of the collector and must not grow with num_epochs.
        self._done_counts = {epoch: len(ids & self._ids) for epoch, ids in self._done.items()}
        # ... and of every epoch after the current one, kept up to date as epochs advance: a resumed
        # ledger names every epoch trained so far, and `remaining` must not grow with that either.
        self._done_later = sum(count for epoch, count in self._done_counts.items() if 0 < epoch < num_epochs)
        self._epoch = 0
        self._order: list[int] = self._epoch_order(0)
        self._cursor = 0
        self._requeued: deque[Prompt] = deque()
        self.taken_total = 0

    # -- reading -----------------------------------------------------------------------

    @property
    def prompts_per_epoch(self) -> int:
        return len(self._prompts)

    @property
    def total_prompts(self) -> int:
        """Prompts handed out over all epochs, requeues not counted."""
        return len(self._prompts) * self.num_epochs

    @property
    def epoch(self) -> int:
        """The epoch the next new (not requeued) prompt belongs to."""
        return self._epoch

    @property
    def requeued_pending(self) -> int:
        return len(self._requeued)

    @property
    def remaining(self) -> int:
        """How many more takes can succeed right now (requeued prompts included)."""
        rest_of_epoch = len(self._order) - self._cursor
        later_epochs = (self.num_epochs - self._epoch - 1) * len(self._prompts) - self._done_later
        return len(self._requeued) + rest_of_epoch + later_epochs

    @property
    def exhausted(self) -> bool:
        """True when `take()` would return None: every epoch handed out and nothing requeued."""
        return self.remaining == 0

    # -- taking ------------------------------------------------------------------------

    def take(self) -> Prompt | None:
        """The next prompt (requeued ones first), or None at the end of data."""
        if self._requeued:
            self.taken_total += 1
            return self._requeued.popleft()
        while self._cursor >= len(self._order):
            if self._epoch + 1 >= self.num_epochs or not self._prompts:
                return None
            self._epoch += 1
            self._done_later -= self._done_counts.get(self._epoch, 0)
            self._order = self._epoch_order(self._epoch)
            self._cursor = 0
        prompt = self._prompts[self._order[self._cursor]]
        self._cursor += 1
        self.taken_total += 1
        return dataclasses.replace(prompt, epoch=self._epoch) if self._epoch else prompt

    def requeue(self, prompt: Prompt) -> Prompt:
        """Put a taken prompt back, to be taken again before any new one; returns the queued copy."""
        if prompt.id not in self._ids:
            raise ValueError(f"prompt id {prompt.id} does not belong to this PromptSource")
        again = dataclasses.replace(prompt, requeues=prompt.requeues + 1)
        self._requeued.append(again)
        return again

    # -- internals ---------------------------------------------------------------------

    def _epoch_order(self, epoch: int) -> list[int]:
        if self._done_counts.get(epoch) == len(self._prompts):  # done before a resume: nothing to shuffle
            return []
        order = list(range(len(self._prompts)))
        if self.shuffle:
            random.Random(f"asyncgrpo:prompt-order:{self.seed}:{epoch}").shuffle(order)
        done = self._done.get(epoch, frozenset())
        return [i for i in order if self._prompts[i].id not in done]
