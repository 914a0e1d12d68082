"""Publishing new policy weights to generation servers: the `WeightPublisher` interface and its disk implementation.

Job: after a training step, get the trainer's weights of version v into every server, so that
`HttpGenerator` can stamp the server's serving version on what it generates.

A publisher works in two phases, so the generator keeps the policy (which servers, in what
order, health, deadlines, version bookkeeping) and the publisher only moves bytes:

- `stage(state, version)` once per version: make the weights available to servers.
- `install(server, staged, timeout_s)` once per server: make that server load them, all of it
  within `timeout_s`. It raises `WeightSyncStepError` on any failure; the generator then keeps
  the server out of work until a later install succeeds.

Supported: **disk** (`DiskWeightPublisher`). `stage` writes the state dict as safetensors in
the Hugging Face layout (``model.safetensors`` + the model's ``config.json``; tied weights under
every name, see `plain_tensors`) into
``weights_dir/v{version:06d}/``, atomically (temp dir + rename), keeping the last `keep_last`
versions; `install` runs vLLM's dev-mode sequence on the server:
``POST /pause?mode=keep`` (vLLM's default mode aborts in-flight requests; keep does not),
``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`` and
``POST /resume``. `/resume` is sent again after any failure, so a failed reload never leaves a
server paused with requests held. The servers must be able to
read `weights_dir` (same machine or a shared file system) and vLLM must run with
``VLLM_SERVER_DEV_MODE=1``; `asyncgrpo serve` has these endpoints built in.

**Delta** (`generation.http.weight_sync: delta`, delta_publisher.py): a subclass that writes per version only
the elements changed since the previous one, with a checksum of the result, and falls back to the full
weights per server. **LoRA** (`weight_sync: lora`, lora_publisher.py): a subclass that writes only the
adapter and has servers with LoRA support load it under a version name, falling back to the merged weights.

**Collective** (`generation.http.weight_sync: nccl`, collective_publisher.py): a subclass that keeps each
version in memory and broadcasts it to each server over a process group of its own through vLLM's
weight-transfer routes, with the disk path as its fallback.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from asyncgrpo.atomic import atomic_directory, leftover_temporaries
from asyncgrpo.errors import FatalBackendError

VERSION_FILE = "asyncgrpo_version.json"  # read by `asyncgrpo serve` to report the version it serves
WEIGHTS_FILE = "model.safetensors"
_VERSION_DIR = re.compile(r"^v(\d{6,})$")
RESUME_AFTER_FAILURE_S = 10.0


class WeightSyncStepError(Exception):
    """One step of one server's install failed. `status` is the HTTP status when the server answered;
    `unreachable` is true when it did not answer a call that needs no work (it looks down, not broken)."""

    def __init__(self, message: str, *, status: int | None = None, unreachable: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.unreachable = unreachable


class WeightSyncError(FatalBackendError):
    """No server could load a new weight version: the run cannot go on at the version it trained.

    `kind` is `misconfigured_backend` when every server refused with an HTTP 4xx (e.g. vLLM
    without VLLM_SERVER_DEV_MODE=1 answers 404, or the files are unreadable there), else
    `weight_sync` (timeouts, refused connections, 5xx).
    """

    kind = "weight_sync"

    def __init__(self, message: str, *, backend: str = "", misconfigured: bool = False) -> None:
        super().__init__(message, backend=backend)
        if misconfigured:
            self.kind = "misconfigured_backend"


@dataclass(frozen=True)
class StagedWeights:
    """A version made available to servers. `path` is where they read it (None: the publisher needs none)."""

    version: int
    path: Path | None


class ControlClient(Protocol):
    """What a publisher may do with one server: POST a control endpoint, raising WeightSyncStepError on failure."""

    url: str

    async def post(self, path: str, *, json_body: Any = None, params: Mapping[str, str] | None = None,
                   timeout_s: float) -> Any: ...


class WeightPublisher(Protocol):
    async def stage(self, state: Mapping[str, Any], version: int) -> StagedWeights: ...

    async def install(self, server: ControlClient, staged: StagedWeights, timeout_s: float) -> None: ...


class DiskWeightPublisher:
    """Writes versions under `weights_dir` and has servers reload them from there (see the module docstring).

    `model_config`: a model directory (its config.json and generation_config.json are copied),
    a config.json path, or a mapping written as config.json; None writes no config (vLLM's
    reload reads only the safetensors; the config makes each directory a loadable model).
    """

    def __init__(self, weights_dir: str | Path, *, model_config: str | Path | Mapping[str, Any] | None = None,
                 keep_last: int = 2) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.weights_dir = Path(weights_dir)
        self.model_config = model_config
        self.keep_last = keep_last

    async def stage(self, state: Mapping[str, Any], version: int) -> StagedWeights:
        path = await asyncio.to_thread(write_weights, state, self.weights_dir, version,
                                       model_config=self.model_config, keep_last=self.keep_last)
        return StagedWeights(version, path)

    async def install(self, server: ControlClient, staged: StagedWeights, timeout_s: float) -> None:
        """pause (keep), load (`_load`), resume; all three within `timeout_s`. On any failure /resume is sent once
        more (bounded by RESUME_AFTER_FAILURE_S): resuming a server that is not paused is harmless, and one
        left paused would hold its requests forever."""
        if staged.path is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s

        def left() -> float:
            return max(0.001, deadline - loop.time())

        try:
            # clear_cache: no KV computed under the old weights may be reused (a prefix-cache hit after the
            # reload would serve it). vLLM 0.32 defaults it to true, also for mode=keep, where its docs call it
            # deprecated; said explicitly so a changed default cannot go unnoticed (tests/integration/vllm/test_vllm.py).
            await server.post("/pause", params={"mode": "keep", "clear_cache": "true"}, timeout_s=left())
            await self._load(server, staged, left)
            await server.post("/resume", timeout_s=left())
        except BaseException as error:
            try:
                await server.post("/resume", timeout_s=RESUME_AFTER_FAILURE_S)
            except WeightSyncStepError as resume_error:
                raise WeightSyncStepError(f"{str(error) or type(error).__name__}; then /resume failed too: {resume_error}. "
                                          f"The server may stay paused: restart it, or POST {server.url}/resume by hand.",
                                          status=getattr(error, "status", None),
                                          unreachable=getattr(error, "unreachable", False) or resume_error.unreachable,
                                          ) from error
            raise

    async def _load(self, server: ControlClient, staged: StagedWeights, left: Callable[[], float]) -> None:
        """Load `staged` into the paused server: vLLM's reload_weights of its directory (a subclass may send less)."""
        assert staged.path is not None
        await self._reload(server, str(staged.path.resolve()), left)

    @staticmethod
    async def _reload(server: ControlClient, weights_path: str, left: Callable[[], float]) -> None:
        await server.post("/collective_rpc", timeout_s=left(), json_body={
            "method": "reload_weights", "kwargs": {"weights_path": weights_path}})


def version_dir(weights_dir: Path, version: int) -> Path:
    return Path(weights_dir) / f"v{version:06d}"


def write_weights(state: Mapping[str, Any], weights_dir: Path, version: int, *,
                  model_config: str | Path | Mapping[str, Any] | None = None, keep_last: int = 2,
                  marker: Mapping[str, Any] | None = None) -> Path:
    """Write `state` as `weights_dir/v{version:06d}/` atomically; prune to the last `keep_last` versions. Returns the dir."""
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    weights_dir = Path(weights_dir)
    weights_dir.mkdir(parents=True, exist_ok=True)
    final = write_weights_at(state, version_dir(weights_dir, version), version, model_config=model_config, marker=marker)
    prune(weights_dir, version, keep_last)
    return final


def write_weights_at(state: Mapping[str, Any], final: Path, version: int, *,
                     model_config: str | Path | Mapping[str, Any] | None = None,
                     marker: Mapping[str, Any] | None = None) -> Path:
    """Write `state` as the directory `final` atomically (safetensors, config, VERSION_FILE with `version` and the
    fields of `marker`, e.g. the delta publisher's ``weights_id``). Returns `final`."""
    from safetensors.torch import save_file

    with atomic_directory(final) as tmp:
        config = write_config(model_config, tmp)
        tied = bool(config.get("tie_word_embeddings")) if config else False
        save_file(plain_tensors(state, tied_embeddings=tied), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / VERSION_FILE).write_text(json.dumps({"version": version, **(marker or {})}))
    return final


async def full_weights_at(target: Path, weights: Mapping[str, Any], version: int, lock: asyncio.Lock, *,
                          model_config: str | Path | Mapping[str, Any] | None = None,
                          marker: Mapping[str, Any] | None = None) -> Path:
    """`target` holding `weights` as a full version directory, written on first need (once, under `lock`): the
    fallback of the publishers that send less (delta, LoRA adapters) to a server that cannot take it."""
    async with lock:
        if not (target / VERSION_FILE).is_file():
            await asyncio.to_thread(write_weights_at, weights, target, version, model_config=model_config, marker=marker)
        return target


def plain_tensors(state: Mapping[str, Any], *, tied_embeddings: bool, copy_aliases: bool = True) -> dict[str, Any]:
    """CPU, contiguous tensors that share no memory (safetensors refuses that); aliases are written as copies
    (`copy_aliases=False`: kept as one tensor under each name, for a reader that is not safetensors).

    Tied weights are written under every name, `lm_head.weight` included (added from the
    embedding when the state lacks it): vLLM's in-place reload (0.32, seen on CPU) replaces the
    embedding's tensor and leaves a tied head at the old weights unless the file has
    `lm_head.weight` ("ParallelLMHead: Failed to load weights"). Transformers and
    `asyncgrpo serve` load such a file unchanged.
    """
    out: dict[str, Any] = {}
    storages: set[int] = set()
    for name, tensor in state.items():
        t = tensor.detach().to("cpu")
        storage = t.untyped_storage().data_ptr()
        if (copy_aliases and storage in storages) or not t.is_contiguous():
            t = t.contiguous().clone()
        storages.add(t.untyped_storage().data_ptr())
        out[name] = t
    if tied_embeddings and "lm_head.weight" not in out and "model.embed_tokens.weight" in out:
        embedding = out["model.embed_tokens.weight"]
        out["lm_head.weight"] = embedding.clone() if copy_aliases else embedding
    return out


def tied_embeddings(model_config: str | Path | Mapping[str, Any] | None) -> bool:
    """Whether `model_config` (as `DiskWeightPublisher` takes it) ties the input embeddings and the LM head."""
    if model_config is None:
        return False
    if isinstance(model_config, Mapping):
        return bool(model_config.get("tie_word_embeddings"))
    source = Path(model_config)
    source = source / "config.json" if source.is_dir() else source
    return bool(json.loads(source.read_text()).get("tie_word_embeddings")) if source.is_file() else False


def write_config(model_config: str | Path | Mapping[str, Any] | None, target: Path) -> dict[str, Any] | None:
    if model_config is None:
        return None
    if isinstance(model_config, Mapping):
        config = dict(model_config)
        (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        return config
    source = Path(model_config)
    if source.is_dir():
        if not (source / "config.json").is_file():
            raise FileNotFoundError(f"model config directory {source} has no config.json")
        for extra in ("generation_config.json",):
            if (source / extra).is_file():
                shutil.copyfile(source / extra, target / extra)
        source = source / "config.json"
    shutil.copyfile(source, target / "config.json")
    return json.loads((target / "config.json").read_text())



def prune(weights_dir: Path, written: int, keep_last: int) -> None:
    """Keep `written` and the newest versions below it, `keep_last` in all. Versions above `written`
    are left over from an earlier run that got further (a resume, or a restart from scratch): no
    server needs them, and keeping them would make the just-written version look old."""
    versions = sorted(
        (int(m.group(1)), p)
        for p in weights_dir.iterdir()
        if (m := _VERSION_DIR.match(p.name)) and (p / VERSION_FILE).is_file()  # only versions asyncgrpo wrote
    )
    older = [path for v, path in versions if v < written]
    stale = [path for v, path in versions if v > written] + older[: max(0, len(older) - (keep_last - 1))]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    for path in leftover_temporaries(weights_dir, except_pid=os.getpid()):  # writes interrupted in an earlier process
        shutil.rmtree(path, ignore_errors=True)
