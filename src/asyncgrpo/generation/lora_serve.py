"""`asyncgrpo serve`'s LoRA adapters: vLLM's ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

Job: `merge_adapter(base, directory)` reads an adapter in peft's save_pretrained layout and returns the adapted
linears' merged weights, W + (lora_alpha / r) * B @ A (sqrt(r) with use_rslora), as peft's merge computes them;
`add_lora_routes(app, state, install)` gives serve.py the two endpoints (bodies as vLLM's: ``lora_name``,
``lora_path``, ``load_inplace``) over its one set of weights.

Invariants:
- Adapters never compound: each load merges into the base (the weights a reload installed last, or the model's
  own), never into the previous merge; `AdapterState.reset` (called after every reload) makes the new weights the base.
- The weights served are the base merged with the adapter loaded last, installed as the version of the publisher's
  marker next to the adapter (``../asyncgrpo_version.json``), like a reload. Every loaded adapter's name is accepted as
  a request's model; with one set of weights a request naming an older one runs on the newest (its version stamp,
  given by the client at dispatch, is the older, conservative one).
- Refused with HTTP 400 naming the adapter, the served weights unchanged: missing or non-regular files, a config this
  merge does not implement (DoRA, per-module rank or alpha patterns, fan_in_fan_out), modules that are not weights of
  the model, shapes that do not fit; a name already loaded without ``load_inplace``. 404: unloading an unknown name.
  Reading the files is bounded by ``--reload-timeout-s`` (HTTP 504).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from asyncgrpo.generation.lora_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from asyncgrpo.generation.serve_protocol import error_response
from asyncgrpo.generation.serve_weights import read_bounded, read_marker, read_regular_file

log = logging.getLogger("asyncgrpo.serve")

PEFT_PREFIX = "base_model.model."
UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "rank_pattern": {}, "alpha_pattern": {}}


class AdapterError(ValueError):
    """An adapter this server cannot merge; the message names what and why."""


@dataclass
class AdapterState:
    """The adapters a server holds: `loaded` name -> path (oldest first), and the `base` of the adapted weights
    (copies of the weights they replace, taken at the first load after a reload)."""

    loaded: dict[str, str] = field(default_factory=dict)
    base: dict[str, Any] | None = None

    def reset(self) -> None:
        """New weights were installed: they are the base, and no adapter is applied to them."""
        self.loaded.clear()
        self.base = None


def merge_adapter(base: Mapping[str, Any], directory: Path) -> dict[str, Any]:
    """The merged weights of the linears the adapter in `directory` adapts (names as in `base`); AdapterError if unfit."""
    import torch
    from safetensors.torch import load

    config = json.loads(read_regular_file(directory / ADAPTER_CONFIG))
    for key, neutral in UNSUPPORTED.items():
        if config.get(key) not in (neutral, None):
            raise AdapterError(f"{directory}: {key} = {config[key]!r} is not supported by asyncgrpo serve's merge "
                               f"(it merges plain LoRA)")
    r = int(config["r"])
    scale = float(config["lora_alpha"]) / (math.sqrt(r) if config.get("use_rslora") else r)
    tensors = load(read_regular_file(directory / ADAPTER_WEIGHTS))
    merged: dict[str, Any] = {}
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removesuffix(".lora_A.weight").removeprefix(PEFT_PREFIX)
        b = tensors.get(key.replace(".lora_A.", ".lora_B."))
        weight = base.get(f"{module}.weight")
        if b is None or weight is None:
            raise AdapterError(f"{directory}: {module} has no {'lora_B' if b is None else 'weight in this model'}")
        if (b.shape[0], a.shape[1]) != tuple(weight.shape) or b.shape[1] != a.shape[0]:
            raise AdapterError(f"{directory}: {module}'s adapter ({tuple(b.shape)} @ {tuple(a.shape)}) does not fit its "
                               f"weight {tuple(weight.shape)}")
        with torch.no_grad():
            merged[f"{module}.weight"] = weight + (scale * (b.float() @ a.float())).to(weight.dtype)
    if not merged:
        raise AdapterError(f"{directory}/{ADAPTER_WEIGHTS} holds no lora_A weights")
    return merged


def add_lora_routes(app: web.Application, state: Any, install: Callable[[dict[str, Any], int], Awaitable[None]]) -> None:
    """Register the two endpoints on `app`; `state` is serve.py's ServerState (engine, reload_lock, adapters, counters,
    reload_timeout_s), `install(weights, version)` its installer of a full or partial set of weights."""
    adapters: AdapterState = state.adapters

    async def body_of(request: web.Request) -> dict[str, Any] | web.Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error_response(400, f"JSON decode error: {exc}")
        if not isinstance(body, dict) or not body.get("lora_name"):
            return error_response(400, "'lora_name' needs to be provided")
        return body

    async def load_adapter(request: web.Request) -> web.Response:
        body = await body_of(request)
        if isinstance(body, web.Response):
            return body
        name, path = str(body["lora_name"]), body.get("lora_path")
        if not path:
            return error_response(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if name == state.model_name:
            return error_response(400, f"The lora adapter '{name}' conflicts with a served base model.")
        if name in adapters.loaded and not body.get("load_inplace"):
            return error_response(400, f"The lora adapter '{name}' has already been loaded. If you want to load the "
                                       f"adapter in place, set 'load_inplace' to True.")
        async with state.reload_lock:
            base = adapters.base if adapters.base is not None else state.engine.weights()
            try:
                merged, marker = await read_bounded(lambda: (merge_adapter(base, Path(path)), read_marker(Path(path).parent)),
                                                    state.reload_timeout_s)
            except TimeoutError as exc:
                return error_response(504, f"load_lora_adapter {name} from {path}: {exc}")
            except (AdapterError, OSError, KeyError, ValueError) as exc:
                state.counters["reload_failures"] += 1
                return error_response(400, f"load_lora_adapter {name} from {path}: {type(exc).__name__}: {exc}")
            if adapters.base is None:
                adapters.base = {key: base[key].detach().clone() for key in merged}
            current = state.engine.serving_version
            version = int(marker["version"]) if marker is not None and int(marker["version"]) >= current else current + 1
            state.weights_id = None  # no delta applies to adapted weights
            await install(merged, version)
            adapters.loaded.pop(name, None)
            adapters.loaded[name] = str(path)
        state.counters["adapters_loaded"] += 1
        log.info("asyncgrpo serve: loaded LoRA adapter %s from %s as version %d", name, path, version)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_adapter(request: web.Request) -> web.Response:
        body = await body_of(request)
        if isinstance(body, web.Response):
            return body
        name = str(body["lora_name"])
        if adapters.loaded.pop(name, None) is None:
            return error_response(404, f"The lora adapter '{name}' cannot be found.")
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    app.router.add_post("/v1/load_lora_adapter", load_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_adapter)
