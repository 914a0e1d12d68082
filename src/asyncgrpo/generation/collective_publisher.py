"""`CollectiveWeightPublisher`: weights broadcast to each server over a process group (NCCL on GPUs, gloo on CPU).

Job: `generation.http.weight_sync: nccl`. `stage(state, v)` copies the weights into one flat buffer on the
trainer's device (collective_group.py; nothing is written to disk); `install` drives vLLM's weight-transfer
API on one server over HTTP while the trainer broadcasts the buffer, in these phases:

1. **group init** (first install, or after a failure): a TCPStore on a free port of `host`, then, at once,
   ``POST /init_weight_transfer_engine {init_info}`` to the server and the trainer's side of the rendezvous;
2. **pause**: ``POST /pause?mode=keep&clear_cache=true`` (as the disk path: requests wait, none is lost);
3. **abandon**: ``POST /collective_rpc asyncgrpo_abandon_weight_update`` (collective_vllm.py): an update an
   earlier sync left unfinished (one that failed in broadcast or finish, here or in a trainer that has since
   restarted) is dropped, else vLLM refuses every later start ("a weight update is already active");
4. **start**: ``POST /start_weight_update``;
5. **broadcast**: ``POST /update_weights {update_info}`` (the metadata: names, dtypes, shapes, sizes) and, at
   once, the trainer's broadcast of the data; the server's worker receives and loads the weights;
6. **finish**: ``POST /finish_weight_update {weight_version}`` (vLLM finalizes its layer-wise reload);
7. **resume**: ``POST /resume`` (sent again after any failure, like the disk path).

The server side is vLLM started with ``--worker-extension-cls asyncgrpo.generation.collective_vllm.
CollectiveWorkerExtension --weight-transfer-config '{"backend": "asyncgrpo"}'`` (collective_vllm.py).

Invariants:
- A staged version holds one copy of the weights on the trainer's device (CUDA for NCCL), so training may go
  on meanwhile; it is freed once it is not the latest and no server holds it (a copy per version servers hold).
- One group per server (trainer rank 0, the server's worker rank 1): a server that hangs or dies breaks
  only its own group; the others are updated by their own installs, which the installer runs
  concurrently (http_weights.py). The price is one broadcast per server from the trainer.
- Every phase runs under the install's deadline (`generation.weight_sync_timeout_s`, the share the
  installer gives it); the trainer's side of each collective runs on a thread of its own that is
  abandoned at the deadline (collective_thread.py), and the transport's own timeout ends it later.
  Nothing waits without a deadline.
- A failure names the server and the phase, once: it is kept in `diagnostics[url]` (sticky: a later
  failure of another kind, such as /resume, does not replace it) and logged, the group is dropped, and
  `on_failure` decides: **disk** loads that version from disk at once when the server still answers
  (written on first need under `weights_dir`, as the full path does), and the server stays on the disk
  path for the rest of the run; **skip** raises, so the installer keeps the server out of work (marked
  unhealthy when it did not answer) until a later install succeeds, and the run stops with
  `WeightSyncError` only when no server took the version.
- A sync that failed after its start may leave the server's update unfinished: vLLM's flag set (every later
  start refused) and its layer-wise reload half done (a later reload, from disk too, would load wrong
  weights). Every collective sync abandons first (phase 3), and a server that failed after its start
  abandons before its next load from disk; until then it holds a mix of versions and takes no work.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from asyncgrpo.generation.collective_group import (
    DEFAULT_CHUNK_BYTES,
    FlatWeights,
    flatten,
    master_store,
    open_group,
    send,
    unflatten,
    update_info,
)
from asyncgrpo.generation.collective_thread import abandonable
from asyncgrpo.generation.weight_sync import (
    VERSION_FILE,
    ControlClient,
    DiskWeightPublisher,
    StagedWeights,
    WeightSyncError,
    WeightSyncStepError,
    tied_embeddings,
    version_dir,
    write_weights,
)

log = logging.getLogger("asyncgrpo")

# A phase's HTTP calls may run this much past the phase's deadline, so that the deadline (the enclosing
# asyncio.timeout) always ends a hung phase first: a server that does not answer within it is marked unhealthy.
PAST_DEADLINE_S = 1.0

ABANDON = "asyncgrpo_abandon_weight_update"  # the worker extension's method (collective_vllm.py)

SERVER_HINT = ("start vLLM with --worker-extension-cls asyncgrpo.generation.collective_vllm.CollectiveWorkerExtension "
               "--weight-transfer-config '{\"backend\": \"asyncgrpo\"}' (VLLM_SERVER_DEV_MODE=1, asyncgrpo importable)")


@dataclass(frozen=True)
class StagedTensors(StagedWeights):
    """A version held in memory as one flat buffer; `path` is where its full weights go if a server needs the disk path."""

    flat: FlatWeights | None = field(default=None, repr=False, compare=False)
    backend: str = "gloo"
    disk_lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False, compare=False)


@dataclass
class _Group:
    store: Any
    group: Any


class CollectiveWeightPublisher(DiskWeightPublisher):
    """See the module docstring. `host`: the trainer's address as the servers reach it (the rendezvous binds there);
    `backend`: gloo, nccl, or auto (nccl for CUDA weights, else gloo); `collective_timeout_s`: the transport's own
    bound on every rendezvous and broadcast (it ends abandoned threads)."""

    def __init__(self, weights_dir: str | Path, *, model_config: str | Path | Mapping[str, Any] | None = None,
                 keep_last: int = 2, host: str = "127.0.0.1", backend: Literal["auto", "gloo", "nccl"] = "auto",
                 on_failure: Literal["disk", "skip"] = "disk", collective_timeout_s: float = 300.0,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        super().__init__(weights_dir, model_config=model_config, keep_last=keep_last)
        self.host = host
        self.backend = backend
        self.on_failure = on_failure
        self.collective_timeout_s = collective_timeout_s
        self.chunk_bytes = chunk_bytes
        self._tied = tied_embeddings(model_config)
        self._groups: dict[str, _Group] = {}
        self._on_disk: set[str] = set()  # servers moved to the disk path by a failure (on_failure: disk)
        self._unfinished: set[str] = set()  # servers whose last collective sync failed and that have not abandoned it since
        self.diagnostics: dict[str, str] = {}  # server URL -> its first collective failure, naming the phase
        self.counters = {"weight_sync_collective": 0, "weight_sync_collective_failures": 0,
                         "weight_sync_disk_fallbacks": 0, "weight_sync_bytes_broadcast": 0,
                         "weight_sync_collective_abandoned": 0}

    async def stage(self, state: Mapping[str, Any], version: int) -> StagedWeights:
        return await asyncio.to_thread(self._stage, state, version)

    def _stage(self, state: Mapping[str, Any], version: int) -> StagedTensors:
        tensors = dict(state)
        if self._tied and "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]  # as the disk path writes it (plain_tensors)
        on_cuda = any(getattr(t, "is_cuda", False) for t in tensors.values())
        backend = self.backend if self.backend != "auto" else ("nccl" if on_cuda else "gloo")
        if backend == "nccl" and not on_cuda:
            raise WeightSyncError("generation.http.collective.backend is nccl but the trainer's weights are not on a CUDA "
                                  "device: set it to gloo (or auto), or train on a GPU.", backend="http", misconfigured=True)
        device = next(t.device for t in tensors.values() if t.is_cuda) if backend == "nccl" else "cpu"
        flat = flatten(tensors, device=device)
        return StagedTensors(version, version_dir(self.weights_dir, version), flat=flat, backend=backend)

    async def _load(self, server: ControlClient, staged: StagedWeights, left: Callable[[], float]) -> None:
        if not isinstance(staged, StagedTensors) or server.url in self._on_disk:
            if server.url in self._unfinished:  # its half-done layer-wise reload would corrupt the reload from disk too
                try:
                    await self._abandon(server, left())
                except WeightSyncStepError as exc:
                    hint = f"; {SERVER_HINT}" if exc.status is not None else ""
                    raise WeightSyncStepError(f"{server.url}: dropping the update a failed collective sync left unfinished, "
                                              f"before loading v{staged.version} from disk: {exc}{hint}",
                                              status=exc.status, unreachable=exc.unreachable) from exc
            await self._load_from_disk(server, staged, left)
            return
        try:
            await self._broadcast(server, staged, left)
        except WeightSyncStepError as exc:
            self._failed(server.url, exc)
            if self.on_failure == "skip":
                raise
            self._on_disk.add(server.url)
            if exc.unreachable:  # marked unhealthy: its recovery loads the latest version from disk
                raise
            self.counters["weight_sync_disk_fallbacks"] += 1
            await self._load(server, staged, left)  # from disk now
            return
        self.counters["weight_sync_collective"] += 1
        assert staged.flat is not None
        self.counters["weight_sync_bytes_broadcast"] += staged.flat.nbytes

    async def _broadcast(self, server: ControlClient, staged: StagedTensors, left: Callable[[], float]) -> None:
        """Phases 1 and 3-6 of the module docstring on the paused server; WeightSyncStepError names the failed phase."""
        assert staged.flat is not None
        flat = staged.flat
        phase = "group init"
        try:
            async with asyncio.timeout(left()):
                member = await self._group(server, staged.backend, left)
                phase = "abandon"
                await self._abandon(server, left() + PAST_DEADLINE_S)
                phase = "start"
                await server.post("/start_weight_update", timeout_s=left() + PAST_DEADLINE_S)
                phase = "broadcast"
                info = update_info(flat, self.chunk_bytes, staged.version)
                async with asyncio.TaskGroup() as tasks:
                    tasks.create_task(server.post("/update_weights", json_body={"update_info": info},
                                                  timeout_s=left() + PAST_DEADLINE_S))
                    tasks.create_task(abandonable(lambda: send(member.group, flat, self.chunk_bytes),
                                                  name=f"asyncgrpo-broadcast-{server.url}"))
                phase = "finish"
                await server.post("/finish_weight_update", json_body={"weight_version": str(staged.version)},
                                  timeout_s=left() + PAST_DEADLINE_S)
        except BaseException as error:
            self._groups.pop(server.url, None)  # mid-collective or half formed: unusable; the next install forms a new one
            if phase in ("start", "broadcast", "finish"):  # the server may hold an update it started
                self._unfinished.add(server.url)
            cause = _first(error)
            if isinstance(cause, asyncio.CancelledError):
                raise
            where = f"{server.url}: collective weight sync of v{staged.version} failed in phase '{phase}'"
            if isinstance(cause, TimeoutError):
                raise WeightSyncStepError(f"{where}: no progress within the deadline (generation.weight_sync_timeout_s)",
                                          unreachable=True) from None
            if isinstance(cause, WeightSyncStepError):
                # Only the first calls can fail for a server started without our extension: a refused start comes
                # after the abandon call reached it (e.g. vLLM's "already active"), where the hint would mislead.
                hint = f"; {SERVER_HINT}" if cause.status is not None and phase in ("group init", "abandon") else ""
                raise WeightSyncStepError(f"{where}: {cause}{hint}", status=cause.status,
                                          unreachable=cause.unreachable) from cause
            if isinstance(cause, (RuntimeError, ValueError, OSError)):  # the trainer's side of the collective
                raise WeightSyncStepError(f"{where}: {type(cause).__name__}: {cause}") from cause
            raise

    async def _group(self, server: ControlClient, backend: str, left: Callable[[], float]) -> _Group:
        """This server's group, formed now if there is none: the server and the trainer join it at once."""
        member = self._groups.get(server.url)
        if member is not None:
            return member
        store = await asyncio.to_thread(master_store, self.host, 2, self.collective_timeout_s)
        init = {"master_address": self.host, "master_port": store.port, "rank_offset": 1, "world_size": 2,
                "backend": backend, "timeout_s": self.collective_timeout_s}
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(server.post("/init_weight_transfer_engine", json_body={"init_info": init},
                                          timeout_s=left() + PAST_DEADLINE_S))
            joined = tasks.create_task(abandonable(
                lambda: open_group(self.host, store.port, 0, 2, backend, self.collective_timeout_s, store=store),
                name=f"asyncgrpo-rendezvous-{server.url}"))
        member = self._groups[server.url] = _Group(store, joined.result())
        return member

    async def _abandon(self, server: ControlClient, timeout_s: float) -> None:
        """Drop the server's unfinished weight update, if any (phase 3 of the module docstring); counted when there
        was one. A refusal or an answer that is not one result per worker raises WeightSyncStepError."""
        text = await server.post("/collective_rpc", json_body={"method": ABANDON, "kwargs": {}},
                                 timeout_s=timeout_s)
        try:
            results = json.loads(text)["results"]
            abandoned = [bool(result["abandoned"]) for result in results]
        except (ValueError, TypeError, KeyError) as exc:
            raise WeightSyncStepError(f"{ABANDON} answered {text!r}, not one {{\"abandoned\": bool}} per worker "
                                      f"({type(exc).__name__}: {exc})") from None
        if not abandoned:
            raise WeightSyncStepError(f"{ABANDON} answered {text!r}: no worker answered")
        self._unfinished.discard(server.url)
        if any(abandoned):
            self.counters["weight_sync_collective_abandoned"] += 1
            log.info("%s: dropped an unfinished weight update (a sync that failed before it finished)", server.url)

    def _failed(self, url: str, exc: WeightSyncStepError) -> None:
        self.counters["weight_sync_collective_failures"] += 1
        if url in self.diagnostics:
            return
        then = ("it takes no work until a later sync succeeds" if self.on_failure == "skip"
                else "it is marked unhealthy and gets the weights from disk once it answers again" if exc.unreachable
                else "it gets the weights from disk from now on")
        self.diagnostics[url] = f"{exc}; {then} (generation.http.collective.on_failure: {self.on_failure})"
        log.warning("%s", self.diagnostics[url])

    async def _load_from_disk(self, server: ControlClient, staged: StagedWeights, left: Callable[[], float]) -> None:
        path = await asyncio.wait_for(self.full_path(staged), left()) if isinstance(staged, StagedTensors) else staged.path
        assert path is not None
        await self._reload(server, str(path.resolve()), left)

    async def full_path(self, staged: StagedTensors) -> Path:
        """The directory of `staged`'s full weights, written on first need (once, under its lock)."""
        assert staged.path is not None and staged.flat is not None
        flat = staged.flat
        async with staged.disk_lock:
            if not (staged.path / VERSION_FILE).is_file():
                await asyncio.to_thread(write_weights, unflatten(flat), self.weights_dir, staged.version,
                                        model_config=self.model_config, keep_last=self.keep_last)
            return staged.path


def _first(error: BaseException) -> BaseException:
    """The first leaf of an exception group (a TaskGroup's), else the error itself."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error
