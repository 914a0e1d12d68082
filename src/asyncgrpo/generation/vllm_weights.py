"""`DeltaWorkerExtension`: the vLLM worker extension that loads the delta publisher's versions (delta_publisher.py).

Job: start vLLM with ``--worker-extension-cls asyncgrpo.generation.vllm_weights.DeltaWorkerExtension`` (and
this package importable there, e.g. PYTHONPATH pointing at asyncgrpo's ``src``; only torch, numpy and
safetensors are imported) and ``POST /collective_rpc`` gains the two methods `asyncgrpo serve` has:

- ``asyncgrpo_load_full {weights_path, weights_id}``: the ``*.safetensors`` of the directory, loaded;
- ``asyncgrpo_apply_delta {delta_path, weights_id}``: a delta against the weights held, written into the worker's
  copy and kept when its checksum of the full result matched (weight_delta.prepare_delta, Patches.apply); a delta
  against another base or format, a bad file or a failed check (its writes undone) is refused (``applied: false``
  with the reason), and the copy and the served weights stay as they were.

Both answer ``{"applied": bool, "reason"?, "weights_id"?}`` per worker.

Invariants:
- The worker keeps the published weights in their checkpoint layout and dtype (one CPU copy: vLLM's own
  parameters are fused and, on CPU, repacked for its GEMM kernels, so they cannot be compared with or patched
  by a delta). The delta is written into that copy in place and the checksum verified there before anything
  reaches the model; the model then gets every tensor of the copy through vLLM's in-place
  ``reload_weights(weights_iterator=...)``, the same path as a reload from disk (layer processing, tied heads), so
  what is served is what the checksum covered. Every tensor, not only the changed ones: vLLM reloads a layer
  from scratch (fused projections included) once any of its tensors arrives, and leaves one that gets none
  as it was with a warning; at the learning rates measured every layer changes each step anyway.
- The identity held is cleared before a load and set only after it completed: a load that failed midway
  leaves no base a delta could be applied to.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncgrpo.generation.weight_delta import DeltaError, load_delta, prepare_delta


class DeltaWorkerExtension:
    """Mixed into vLLM's worker class by vLLM (it calls `reload_weights` of that worker)."""

    _asyncgrpo_weights: dict[str, Any] | None = None
    _asyncgrpo_id: str | None = None

    def asyncgrpo_load_full(self, weights_path: str, weights_id: str) -> dict[str, Any]:
        from safetensors.torch import load_file

        files = sorted(Path(weights_path).glob("*.safetensors"))
        if not files:
            return {"applied": False, "reason": f"{weights_path} holds no .safetensors file"}
        weights: dict[str, Any] = {}
        for file in files:
            weights.update(load_file(str(file)))
        return self._asyncgrpo_install(weights, weights_id)

    def asyncgrpo_apply_delta(self, delta_path: str, weights_id: str) -> dict[str, Any]:
        try:
            entries, manifest = load_delta(Path(delta_path).read_bytes())
            if manifest["weights_id"] != weights_id:
                raise DeltaError(f"{delta_path} holds weights {manifest['weights_id']}, not {weights_id}")
            weights = self._asyncgrpo_weights or {}
            prepare_delta(weights, self._asyncgrpo_id, entries, manifest).apply(weights)
        except (DeltaError, OSError) as exc:
            return {"applied": False, "reason": str(exc)}
        return self._asyncgrpo_install(weights, weights_id)

    def _asyncgrpo_install(self, weights: dict[str, Any], weights_id: str) -> dict[str, Any]:
        self._asyncgrpo_id = None
        self.reload_weights(weights_iterator=iter(list(weights.items())))  # type: ignore[attr-defined]
        self._asyncgrpo_weights, self._asyncgrpo_id = weights, weights_id
        return {"applied": True, "weights_id": weights_id}
