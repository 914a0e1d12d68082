"""`DeltaWeightPublisher`: the disk publisher that writes, per version, only what changed since the previous one.

Job: `stage(state, v)` writes ``weights_dir/v{v:06d}/`` holding either the full weights (the first version,
or whenever the delta would be no smaller: weight_delta.py) or ``weights.delta``: the elements changed since
version v-1 with a checksum of the full result. `install` asks the server to apply the delta in place
(``/collective_rpc asyncgrpo_apply_delta``; `asyncgrpo serve` has it, vLLM through the worker extension
vllm_weights.py) and falls back to a full load when the server holds another base, the delta is refused
or its checksum fails on the server: the full weights of that version are then written once, under
``v{v:06d}/full/``, and loaded with ``asyncgrpo_load_full``. A server without the extension (it fails the
call without being down) is remembered and gets vLLM's own ``reload_weights`` from then on.

Invariants:
- Every version has an identity, ``weights_id`` (``<publisher run id>-v<version>``), which the server reports
  back after a load; a delta names the identity of its base and is applied only on exactly that base, so a
  restarted server, one that missed a version, or another run's server always gets the full weights.
- Each install is one pause (keep, clearing the prefix cache), the loads, one resume, all within its
  `timeout_s` like `DiskWeightPublisher.install` (and /resume sent again after any failure).
- The publisher keeps one CPU copy of the latest staged weights (the next delta's base), patched in place by
  each delta it stages (no copy of the whole state per version). A delta version's full files are written
  from that copy, so only while it is the latest: a server that needs the full weights of a version already
  superseded (a recovering server's install racing the next stage) fails that install, and the next install
  brings it the latest. Staging and writing full files from the copy exclude each other (one lock).
- Counted in `counters` (merged into `HttpGenerator.stats()`): deltas applied, full loads, fallbacks
  from a delta to a full load (each also logged with the server and its reason) and the bytes staged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncgrpo.atomic import atomic_directory
from asyncgrpo.generation.weight_delta import (
    FORMAT,
    Delta,
    checksum,
    copy_state,
    dtype_names,
    encode_delta,
    save_delta,
    state_nbytes,
)
from asyncgrpo.generation.weight_sync import (
    VERSION_FILE,
    ControlClient,
    DiskWeightPublisher,
    StagedWeights,
    WeightSyncStepError,
    plain_tensors,
    prune,
    tied_embeddings,
    version_dir,
    write_weights,
    write_weights_at,
)

log = logging.getLogger("asyncgrpo")

DELTA_FILE = "weights.delta"  # not *.safetensors: a reader of the directory's full weights must not take it for them
FULL_SUBDIR = "full"


@dataclass(frozen=True)
class StagedVersion(StagedWeights):
    """A version as the delta publisher staged it. `path` is the version's directory; `delta` is set when it holds a
    delta against `base_id` (its full weights are then written by `full_path()` on first need)."""

    weights_id: str = ""
    base_id: str | None = None
    delta: Path | None = None
    nbytes: int = 0


class DeltaWeightPublisher(DiskWeightPublisher):
    """See the module docstring; arguments as `DiskWeightPublisher`."""

    def __init__(self, weights_dir: str | Path, *, model_config: str | Path | Mapping[str, Any] | None = None,
                 keep_last: int = 2) -> None:
        super().__init__(weights_dir, model_config=model_config, keep_last=keep_last)
        self.run_id = secrets.token_hex(6)
        self._base: dict[str, Any] | None = None  # the latest version staged, owned here and patched by each delta
        self._base_id: str | None = None
        self._base_lock = threading.Lock()  # taken on worker threads: staging, and writing full files from the base
        self._tied = tied_embeddings(model_config)  # lm_head.weight is written (and so part of every delta): plain_tensors
        self._without_extension: set[str] = set()  # servers that fail asyncgrpo_* calls: vLLM's reload_weights
        self.counters = {"weight_sync_deltas": 0, "weight_sync_full_loads": 0, "weight_sync_delta_fallbacks": 0,
                         "weight_sync_bytes_staged": 0, "weight_sync_changed_fraction": 0.0}

    async def stage(self, state: Mapping[str, Any], version: int) -> StagedWeights:
        staged = await asyncio.to_thread(self._stage, state, version)
        self.counters["weight_sync_bytes_staged"] += staged.nbytes
        return staged

    def _stage(self, state: Mapping[str, Any], version: int) -> StagedVersion:
        with self._base_lock:  # held by this thread to the end, even when the caller is cancelled meanwhile
            return self._stage_locked(state, version)

    def _stage_locked(self, state: Mapping[str, Any], version: int) -> StagedVersion:
        new = plain_tensors(state, tied_embeddings=self._tied, copy_aliases=False)  # the caller's, read before this returns
        weights_id = f"{self.run_id}-v{version}"
        base = self._base
        delta = encode_delta(base, new) if base is not None else None
        marker = {"weights_id": weights_id}
        if delta is None:
            path = write_weights(new, self.weights_dir, version, model_config=self.model_config,
                                 keep_last=self.keep_last, marker=marker)
            staged = StagedVersion(version, path, weights_id=weights_id, nbytes=state_nbytes(new))
            self._base = copy_state(new)  # a tied head stays one tensor: encoded once (weight_delta.Delta.aliases)
            self.counters["weight_sync_changed_fraction"] = 1.0
        else:
            path = self._write_delta(delta, new, version, weights_id)
            assert base is not None
            delta.apply_to(base)  # the base is now this version, bit for bit
            staged = StagedVersion(version, path, weights_id=weights_id, base_id=self._base_id, delta=path / DELTA_FILE,
                                   nbytes=delta.nbytes)
            self.counters["weight_sync_changed_fraction"] = delta.changed / max(1, delta.total)
        self._base_id = weights_id
        return staged

    def _write_delta(self, delta: Delta, new: Mapping[str, Any], version: int, weights_id: str) -> Path:
        final = version_dir(self.weights_dir, version)
        manifest = {"format": FORMAT, "version": version, "weights_id": weights_id, "base": self._base_id,
                    "checksum": checksum(new), "dtypes": dtype_names(new), "aliases": delta.aliases}
        with atomic_directory(final) as tmp:
            save_delta(tmp / DELTA_FILE, delta, manifest)
            (tmp / VERSION_FILE).write_text(json.dumps({"version": version, "weights_id": weights_id}))
        prune(self.weights_dir, version, self.keep_last)
        return final

    async def full_path(self, staged: StagedVersion) -> Path:
        """The directory of `staged`'s full weights, written from the base on first need (once). Raises
        WeightSyncStepError when a later version was staged first: the base is that one's now."""
        assert staged.path is not None
        if staged.delta is None:
            return staged.path
        return await asyncio.to_thread(self._write_full, staged, staged.path / FULL_SUBDIR)

    def _write_full(self, staged: StagedVersion, target: Path) -> Path:
        with self._base_lock:
            if not (target / VERSION_FILE).is_file():
                if staged.weights_id != self._base_id or self._base is None:
                    raise WeightSyncStepError(f"the full weights v{staged.version} were needed after a later version "
                                              f"was staged; the server gets the latest version next")
                write_weights_at(self._base, target, staged.version, model_config=self.model_config,
                                 marker={"weights_id": staged.weights_id})
        return target

    async def _load(self, server: ControlClient, staged: StagedWeights, left: Callable[[], float]) -> None:
        """The delta when the server can take it, else the full weights (see the module docstring)."""
        if not isinstance(staged, StagedVersion):
            await super()._load(server, staged, left)
            return
        if server.url not in self._without_extension and staged.delta is not None:
            answer = await self._rpc(server, "asyncgrpo_apply_delta",
                                     {"delta_path": str(staged.delta.resolve()), "weights_id": staged.weights_id}, left)
            if answer is not None and answer.get("applied"):
                self.counters["weight_sync_deltas"] += 1
                return
            self.counters["weight_sync_delta_fallbacks"] += 1
            reason = "it lacks the worker extension" if answer is None else answer.get("reason")
            log.warning("%s did not apply the delta of weights v%d (%s); loading the full weights instead",
                        server.url, staged.version, reason)
        path = str((await asyncio.wait_for(self.full_path(staged), left())).resolve())
        if server.url not in self._without_extension:
            answer = await self._rpc(server, "asyncgrpo_load_full", {"weights_path": path, "weights_id": staged.weights_id},
                                     left)
            if answer is not None:
                if not answer.get("applied"):
                    raise WeightSyncStepError(f"{server.url} could not load the full weights v{staged.version} from "
                                              f"{path}: {answer.get('reason')}")
                self.counters["weight_sync_full_loads"] += 1
                return
        await self._reload(server, path, left)
        self.counters["weight_sync_full_loads"] += 1

    async def _rpc(self, server: ControlClient, method: str, kwargs: dict[str, str], left: Callable[[], float]) -> dict[str, Any] | None:
        """`method` on the server: its first worker's answer, or None when the server answered the call with an error
        (no extension: remembered, and it gets vLLM's reload_weights from then on). A server that does not answer
        raises WeightSyncStepError."""
        try:
            text = await server.post("/collective_rpc", timeout_s=left(), json_body={"method": method, "kwargs": kwargs})
        except WeightSyncStepError as exc:
            if exc.status is None:
                raise
            self._without_extension.add(server.url)
            log.warning("%s failed %s (%s): it gets full reloads through reload_weights from now on. For deltas, start "
                        "vLLM with --worker-extension-cls asyncgrpo.generation.vllm_weights.DeltaWorkerExtension and "
                        "asyncgrpo importable", server.url, method, exc)
            return None
        results = json.loads(text).get("results") if text else None
        if not isinstance(results, list) or not results or not all(isinstance(r, dict) for r in results):
            raise WeightSyncStepError(f"{server.url} answered {method} with {text!r}, not a list of results")
        failed = [r for r in results if not r.get("applied")]
        return failed[0] if failed else results[0]
