"""A fake engine for `weight_sync: nccl`: a real process that speaks vLLM's weight-transfer routes over gloo.

Run as ``python -m tests.integration.collective_server PORT``. It answers what `HttpGenerator` needs
(/health, /v1/models, /pause, /resume, /collective_rpc reload_weights and asyncgrpo_abandon_weight_update)
and vLLM's weight-transfer routes, joining the trainer's process group and receiving the broadcast with
collective_group.py, the same code vLLM's worker runs (collective_vllm.py). GET /state reports what it
holds: the checksum of the weights received (weight_delta.checksum), the version finished, the directories
reloaded from disk, the number of chunks received, and whether an update is active.

The update's state is vLLM 0.32's (gpu_worker.py, model_loader/reload): `active` is the worker's flag: a
start succeeds only while it is clear and sets it; an update fails without it, and clears it when it fails
(vLLM resets the session when ``update_weights`` raises); a finish fails without it, and clears it only when it
succeeds. `reloading` is the layer-wise reload a start begins: only a successful finish ends it, so a failed
update or finish leaves it half done, and a reload from disk then answers 500 (a stand-in: vLLM's would load
wrong weights through it, silently). asyncgrpo_abandon_weight_update clears both, as the worker extension does.

``POST /fault {"phase", "mode"}`` makes the next call of that phase ("group init", "start", "broadcast",
"finish") fail: "hang" (never answers, never takes part in the collective), "die" (the process exits at
once; in "broadcast", after receiving the first chunk, i.e. mid-transfer) or "error" (HTTP 500).
``POST /release`` ends the hangs (their calls answer 500), so one process serves many tests.
Collectives run on a thread, so /state answers while one waits.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

from aiohttp import web

from asyncgrpo.generation.collective_group import open_group, parse_update_info, receive, unflatten
from asyncgrpo.generation.weight_delta import checksum

ROUTES = {"/init_weight_transfer_engine": "group init", "/start_weight_update": "start",
          "/update_weights": "broadcast", "/finish_weight_update": "finish"}


class _DieAfterFirstChunk:
    """A process group whose second broadcast exits the process: a server killed mid-transfer."""

    def __init__(self, group: Any) -> None:
        self.group, self.calls = group, 0

    def broadcast(self, tensor: Any, root: int) -> Any:
        self.calls += 1
        if self.calls > 1:
            os._exit(17)
        return self.group.broadcast(tensor, root)


class Engine:
    def __init__(self) -> None:
        self.faults: dict[str, str] = {}
        self.hung: list[asyncio.Future[None]] = []
        self.group: Any = None
        self.pending: dict[str, Any] | None = None
        self.state = {"checksum": None, "version": None, "reloads": [], "chunks": 0, "paused": False, "active": False,
                      "reloading": False}

    async def fault(self, phase: str) -> web.Response | None:
        mode = self.faults.pop(phase, None)
        if mode == "hang":  # until POST /release: the trainer's deadline must end its wait first
            hung = asyncio.get_running_loop().create_future()
            self.hung.append(hung)
            await hung
            return web.json_response({"error": f"released from a hang in {phase}"}, status=500)
        if mode == "die" and phase != "broadcast":
            os._exit(17)
        if mode == "error":
            return web.json_response({"error": f"injected failure in {phase}"}, status=500)
        return None

    async def control(self, request: web.Request) -> web.Response:
        phase = ROUTES[request.path]
        body = await request.json() if request.can_read_body else {}
        mode = self.faults.get(phase)
        if phase in ("broadcast", "finish") and not self.state["active"]:
            return web.json_response({"error": f"{phase} without a matching start_weight_update"}, status=500)
        failed = await self.fault(phase)
        if failed is not None:
            if phase == "broadcast" and mode == "error":  # raised in update_weights: vLLM ends the session
                self.state["active"] = False
            return failed
        if phase == "group init":
            info = body["init_info"]
            self.group = await asyncio.to_thread(open_group, info["master_address"], info["master_port"],
                                                 info["rank_offset"], info["world_size"], info["backend"], info["timeout_s"])
        elif phase == "start":
            if self.state["active"]:
                return web.json_response({"error": "start_weight_update called while a weight update is already "
                                                   "active. Call finish_weight_update first."}, status=500)
            self.state.update(active=True, reloading=True)
        elif phase == "broadcast":
            metas, total, chunk_bytes = parse_update_info(body["update_info"])
            group = _DieAfterFirstChunk(self.group) if mode == "die" else self.group
            try:
                flat = await asyncio.to_thread(receive, group, metas, total, chunk_bytes)
            except Exception:
                self.state["active"] = False
                raise
            self.pending = unflatten(flat)
            self.state["chunks"] = -(-total // chunk_bytes)
        elif phase == "finish":
            assert self.pending is not None
            self.state.update(checksum=checksum(self.pending), version=body.get("weight_version"), active=False,
                              reloading=False)
        return web.json_response({"message": "ok"})


def app() -> web.Application:
    engine = Engine()

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "max_model_len": 512}]})

    async def pause(_: web.Request) -> web.Response:
        engine.state["paused"] = True
        return web.json_response({})

    async def resume(_: web.Request) -> web.Response:
        engine.state["paused"] = False
        return web.json_response({})

    async def rpc(request: web.Request) -> web.Response:
        body = await request.json()
        if body["method"] == "asyncgrpo_abandon_weight_update":
            abandoned = engine.state["active"] or engine.state["reloading"]
            engine.state.update(active=False, reloading=False)
            engine.pending = None
            return web.json_response({"results": [{"abandoned": abandoned}]})
        if engine.state["reloading"]:
            return web.json_response({"error": "reload_weights through a half-done layer-wise reload"}, status=500)
        engine.state["reloads"].append(body["kwargs"]["weights_path"])
        return web.json_response({"results": [None]})

    async def state(_: web.Request) -> web.Response:
        return web.json_response(engine.state)

    async def fault(request: web.Request) -> web.Response:
        body = await request.json()
        engine.faults[body["phase"]] = body["mode"]
        return web.json_response({})

    async def release(_: web.Request) -> web.Response:
        for hung in engine.hung:
            hung.set_result(None)
        engine.hung.clear()
        return web.json_response({})

    application = web.Application()
    application.router.add_get("/health", health)
    application.router.add_get("/v1/models", models)
    application.router.add_post("/pause", pause)
    application.router.add_post("/resume", resume)
    application.router.add_post("/collective_rpc", rpc)
    application.router.add_get("/state", state)
    application.router.add_post("/fault", fault)
    application.router.add_post("/release", release)
    for route in ROUTES:
        application.router.add_post(route, engine.control)
    return application


if __name__ == "__main__":
    web.run_app(app(), host="127.0.0.1", port=int(sys.argv[1]), print=None)
