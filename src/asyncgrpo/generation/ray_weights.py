"""`StoredWeights`: a state dict that stays in Ray's object store, passed by reference.

Job: let a trainer on Ray (training/ray_trainer.py: rank 0's weights) publish through the
generators' ordinary `load_weights(state, version)` without the driver ever holding the tensors:
`RayGenerator` hands `ref` to its actors, which read the weights from the store themselves.

Invariants:
- It is a read-only `Mapping`, so any other consumer still gets the weights: they are fetched
  once, on first use, within `timeout_s` (a fetch that takes longer raises TimeoutError).
- The reference keeps the object alive as long as this object (or a holder of `ref`) lives.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from asyncgrpo.generation.ray_cluster import import_ray


class StoredWeights(Mapping[str, Any]):
    def __init__(self, ref: Any, *, timeout_s: float) -> None:
        self.ref = ref
        self.timeout_s = timeout_s
        self._fetched: dict[str, Any] | None = None

    def _state(self) -> dict[str, Any]:
        if self._fetched is None:
            ray = import_ray()
            try:
                self._fetched = dict(ray.get(self.ref, timeout=self.timeout_s))
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(f"the weights in Ray's object store did not arrive within {self.timeout_s:g} s") from None
        return self._fetched

    def __getitem__(self, name: str) -> Any:
        return self._state()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._state())

    def __len__(self) -> int:
        return len(self._state())
