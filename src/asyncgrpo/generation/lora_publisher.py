"""`LoraWeightPublisher`: the disk publisher that sends a LoRA policy's adapter, not its merged weights.

Job: with `train.lora` and ``generation.http.weight_sync: lora``, `stage(state, v)` writes only the adapter that
`state` carries (lora_adapter.py) as ``weights_dir/v{v:06d}/adapter/`` in peft's save_pretrained layout;
`install` has the server load it as a new adapter named ``policy-v{v}-{run id}`` (``POST /v1/load_lora_adapter``:
vLLM started with ``--enable-lora --max-lora-rank >= train.lora.r`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``)
and unloads the ones it loaded before beyond the newest `keep_loaded`. Requests to that server then name the
adapter as their model (`model_for`), so each one runs on exactly one version and no prefix cache mixes versions
(vLLM keys cached blocks by the adapter's name and path; the run id keeps a later run on the same servers from
meeting an earlier run's ``policy-v1``). No pause is needed: in-flight requests keep their own adapter.

Fallback: a server that answers the load with an error (no LoRA support: 404 without the runtime-updating
variable, 500 without ``--enable-lora``, 400 for a rank above ``--max-lora-rank``) is remembered, logged once
with its answer and counted (``weight_sync_lora_fallbacks``), and from then on gets the merged weights through
the full disk path (pause, reload, resume: `DiskWeightPublisher.install`), written once per version on first
need under ``v{v:06d}/full/``; its requests name the served model. A state that carries no adapter (a trainer
without it) is published whole to every server, logged once.

Invariants:
- Every call of an install is bounded by its `timeout_s` (the installer's machinery marks a server that does not
  answer unhealthy and one that fails excluded, as for the other publishers).
- Loading is idempotent (``load_inplace``: a retried or recovering install of the same version succeeds), and an
  unload the server answers 404 to (a restarted server lost it) is done.
- The merged weights a staged version keeps for the fallback are references, not copies: LoRA freezes the base
  weights and merges the adapted linears into fresh tensors (training/lora.py), so no later step changes them.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncgrpo.atomic import atomic_directory
from asyncgrpo.generation.lora_adapter import AdapterWeights, write_adapter
from asyncgrpo.generation.weight_sync import (
    VERSION_FILE,
    ControlClient,
    DiskWeightPublisher,
    StagedWeights,
    WeightSyncStepError,
    full_weights_at,
    prune,
    version_dir,
)

log = logging.getLogger("asyncgrpo")

ADAPTER_SUBDIR = "adapter"
FULL_SUBDIR = "full"
KEEP_LOADED = 2  # adapters left loaded per server: the newest and the one before (requests still naming it finish)


@dataclass(frozen=True)
class StagedAdapter(StagedWeights):
    """A version staged as an adapter: `name` is what servers load it as and requests name; `adapter` its
    directory; `merged` the merged weights a server without LoRA support gets (written on first need)."""

    name: str = ""
    adapter: Path = Path()
    merged: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    full_lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False, compare=False)


class LoraWeightPublisher(DiskWeightPublisher):
    """See the module docstring; `weights_dir` and `model_config` as `DiskWeightPublisher`."""

    def __init__(self, weights_dir: str | Path, *, model_config: str | Path | Mapping[str, Any] | None = None,
                 keep_loaded: int = KEEP_LOADED) -> None:
        if keep_loaded < 1:
            raise ValueError(f"keep_loaded must be >= 1, got {keep_loaded}")
        super().__init__(weights_dir, model_config=model_config, keep_last=keep_loaded + 1)  # + one being loaded
        self.keep_loaded = keep_loaded
        self.run_id = secrets.token_hex(4)
        self._without_lora: set[str] = set()
        self._loaded: dict[str, collections.deque[str]] = {}  # per server: the adapters loaded there, oldest first
        self._serving: dict[str, str] = {}  # per server: the adapter its requests name
        self._merged_only_logged = False
        self.counters = {"weight_sync_adapters": 0, "weight_sync_full_loads": 0, "weight_sync_lora_fallbacks": 0,
                         "weight_sync_bytes_staged": 0}

    def model_for(self, url: str) -> str | None:
        """The model requests to the server `url` must name: the adapter it serves, or None (its own model)."""
        return self._serving.get(url)

    def adapter_name(self, version: int) -> str:
        return f"policy-v{version}-{self.run_id}"

    async def stage(self, state: Mapping[str, Any], version: int) -> StagedWeights:
        adapter: AdapterWeights | None = getattr(state, "adapter", None)
        if adapter is None:
            if not self._merged_only_logged:
                self._merged_only_logged = True
                log.warning("generation.http.weight_sync = lora, but the trainer's weights carry no adapter (a sharded "
                            "trainer gathers merged weights only): every server gets the merged weights")
            staged = await super().stage(state, version)
            self.counters["weight_sync_bytes_staged"] += sum(t.numel() * t.element_size() for t in state.values())
            return staged
        path = await asyncio.to_thread(self._write, adapter, version)
        self.counters["weight_sync_bytes_staged"] += adapter.nbytes
        return StagedAdapter(version, path, name=self.adapter_name(version), adapter=path / ADAPTER_SUBDIR, merged=state)

    def _write(self, adapter: AdapterWeights, version: int) -> Path:
        final = version_dir(self.weights_dir, version)
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        with atomic_directory(final) as tmp:
            (tmp / ADAPTER_SUBDIR).mkdir()
            write_adapter(adapter, tmp / ADAPTER_SUBDIR)
            (tmp / VERSION_FILE).write_text(json.dumps({"version": version, "adapter": self.adapter_name(version)}))
        prune(self.weights_dir, version, self.keep_last)
        return final

    async def install(self, server: ControlClient, staged: StagedWeights, timeout_s: float) -> None:
        """The adapter when the server takes adapters, else the merged weights (see the module docstring)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s

        def left() -> float:
            return max(0.001, deadline - loop.time())

        if not isinstance(staged, StagedAdapter):
            self._serving.pop(server.url, None)
            await super().install(server, staged, timeout_s)
            self.counters["weight_sync_full_loads"] += 1
            return
        if server.url not in self._without_lora:
            if await self._load_adapter(server, staged, left):
                return
        # From here its requests name the served model: until the reload they run on the weights it had loaded.
        self._serving.pop(server.url, None)
        full = await asyncio.wait_for(full_weights_at(staged.adapter.parent / FULL_SUBDIR, staged.merged, staged.version,
                                                      staged.full_lock, model_config=self.model_config), left())
        await super().install(server, StagedWeights(staged.version, full), left())
        self.counters["weight_sync_full_loads"] += 1

    async def _load_adapter(self, server: ControlClient, staged: StagedAdapter, left: Callable[[], float]) -> bool:
        """Load `staged` on `server` and unload its older adapters; False when it answered that it cannot (remembered)."""
        try:
            await server.post("/v1/load_lora_adapter", timeout_s=left(), json_body={
                "lora_name": staged.name, "lora_path": str(staged.adapter.resolve()), "load_inplace": True})
        except WeightSyncStepError as exc:
            if exc.status is None:
                raise  # no answer: the installer's machinery decides (unhealthy, or excluded)
            self._without_lora.add(server.url)
            self.counters["weight_sync_lora_fallbacks"] += 1
            log.warning("%s cannot load LoRA adapters (%s): it gets the merged weights of every version from now on. For "
                        "adapters, start vLLM with --enable-lora --max-lora-rank >= train.lora.r and "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True", server.url, exc)
            return False
        self._serving[server.url] = staged.name
        loaded = self._loaded.setdefault(server.url, collections.deque())
        if staged.name not in loaded:
            loaded.append(staged.name)
        while len(loaded) > self.keep_loaded:
            oldest = loaded[0]
            try:
                await server.post("/v1/unload_lora_adapter", timeout_s=left(), json_body={"lora_name": oldest})
            except WeightSyncStepError as exc:
                if exc.status != 404:  # 404: not loaded there (a restarted server lost it)
                    raise WeightSyncStepError(f"{server.url} loaded adapter {staged.name} but could not unload "
                                              f"{oldest}: {exc}", status=exc.status) from exc
            loaded.popleft()
        self.counters["weight_sync_adapters"] += 1
        return True
