"""The prompt ledger: how each take of a prompt ended for good — trained at a step, or dropped with a reason.

It is what makes resume exact (DESIGN.md §4; SkyRL's approach): a checkpoint stores, per
epoch, the ids whose take has ended, and a resumed run skips exactly those. Whatever was
in flight, buffered or requeued at the checkpoint is not in the ledger, so it is generated
again: nothing is lost and nothing is trained twice within an epoch.

Invariants:
- A prompt id is recorded at most once per epoch (a second record is an internal error).
- Requeues and shutdown cancellations are not endings and are never recorded.
- Every record is also passed to `sink` (run.py appends it to `outcomes.jsonl`), in order.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from asyncgrpo.types import DropReason, Prompt

Sink = Callable[[dict[str, Any]], None]


class PromptLedger:
    def __init__(self, done: Mapping[int, Collection[int]] | None = None, sink: Sink | None = None) -> None:
        self._done: dict[int, set[int]] = {int(e): set(ids) for e, ids in (done or {}).items()}
        self._sink = sink

    def trained(self, prompt: Prompt, step: int) -> None:
        self._record(prompt, {"step": step, "outcome": "trained"})

    def dropped(self, prompt: Prompt, reason: DropReason, step: int) -> None:
        self._record(prompt, {"step": step, "outcome": "dropped", "reason": reason})

    def done_by_epoch(self) -> dict[int, list[int]]:
        """JSON-ready: epoch -> sorted ids whose take ended in training or a drop."""
        return {epoch: sorted(ids) for epoch, ids in sorted(self._done.items())}

    def _record(self, prompt: Prompt, fields: dict[str, Any]) -> None:
        ids = self._done.setdefault(prompt.epoch, set())
        if prompt.id in ids:
            raise AssertionError(f"prompt {prompt.id} of epoch {prompt.epoch} ended twice")
        ids.add(prompt.id)
        if self._sink is not None:
            self._sink({"epoch": prompt.epoch, "prompt_id": prompt.id, **fields})
