"""Start-up checks of the HTTP server pool: every server's ``GET /v1/models``, then the model and context checks.

Job: `discover` waits (within `generation.http.startup_timeout_s`) for every server to list its
models, retrying while a server is still starting, and refuses a pool it cannot use: a server that
is not OpenAI-compatible, refuses the credentials, serves another model, or has a context too short
for `generation.max_new_tokens` (`MisconfiguredBackendError`); servers that never answer
(`BackendDeadError`, naming each with its last error). Invariant: each check is bounded by the
startup timeout; a server's `models`, `max_model_len` and `last_error` are what it last answered.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Protocol

import aiohttp

from asyncgrpo.config import GenerationConfig
from asyncgrpo.errors import BackendDeadError, MisconfiguredBackendError
from asyncgrpo.generation.http_client import server_message

_STARTUP_RETRY_S = (0.05, 1.0)  # first and largest delay between /v1/models attempts while a server starts


class Discoverable(Protocol):
    url: str
    models: list[str]
    max_model_len: int | None
    last_error: str


async def discover(servers: Sequence[Discoverable], session: aiohttp.ClientSession | None, *, cfg: GenerationConfig,
                   name: str) -> str:
    """Check every server (see the module docstring); return the model name to request."""
    assert session is not None
    timeout = cfg.http.startup_timeout_s
    model = cfg.http.model
    try:
        async with asyncio.timeout(timeout):
            async with asyncio.TaskGroup() as group:
                for server in servers:
                    group.create_task(_discover(server, session, name))
    except BaseExceptionGroup as errors:  # the first server that failed the check; the others were cancelled
        raise errors.exceptions[0] from None
    except TimeoutError:
        missing = [s for s in servers if not s.models]
        raise BackendDeadError(
            f"{len(missing)} of {len(servers)} generation servers did not answer GET /v1/models within "
            f"generation.http.startup_timeout_s = {timeout:g} s: "
            + "; ".join(f"{s.url} (last error: {s.last_error or 'no answer'})" for s in missing)
            + ". Check that they are started and the URLs in generation.http.base_urls are right, or raise "
            "generation.http.startup_timeout_s for slow starts.", backend=name) from None
    if model is None:
        model = servers[0].models[0]
    for server in servers:
        if server.max_model_len is not None and cfg.max_new_tokens >= server.max_model_len:
            raise MisconfiguredBackendError(
                f"generation.max_new_tokens = {cfg.max_new_tokens} leaves no room for a prompt in the "
                f"max_model_len = {server.max_model_len} of server {server.url}. Fix: lower generation.max_new_tokens "
                f"(prompts take up to data.max_prompt_tokens more), or serve a longer context.", backend=name)
    for server in servers:
        if model not in server.models:
            asked = "generation.http.model" if cfg.http.model else f"the model of {servers[0].url}"
            raise MisconfiguredBackendError(
                f"server {server.url} does not serve model {model!r} ({asked}); it serves {server.models}. "
                f"Fix: set generation.http.model to the name the servers serve, or start every server with "
                f"--served-model-name {model}.", backend=name)
    return model


async def _discover(server: Discoverable, session: aiohttp.ClientSession, name: str) -> None:
    """GET /v1/models until it answers; retried while the server is not up yet (the caller bounds it)."""
    delay = _STARTUP_RETRY_S[0]
    while True:
        try:
            async with session.get(f"{server.url}/v1/models") as resp:
                status, text = resp.status, await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            server.last_error = f"GET /v1/models: {type(exc).__name__}: {exc}"
        else:
            if status == 200:
                try:
                    entries = json.loads(text)["data"]
                    server.models = [str(entry["id"]) for entry in entries]
                    lengths = [entry.get("max_model_len") for entry in entries if entry.get("max_model_len")]
                    server.max_model_len = int(lengths[0]) if lengths else None
                except (ValueError, KeyError, TypeError) as exc:
                    raise MisconfiguredBackendError(
                        f"server {server.url} answered GET /v1/models with something that is not a model list "
                        f"({text[:200]!r}): is it an OpenAI-compatible server?", backend=name) from exc
                if not server.models:
                    raise MisconfiguredBackendError(f"server {server.url} serves no model (GET /v1/models is empty).",
                                                    backend=name)
                server.last_error = ""
                return
            if status in (401, 403, 404):
                what = {401: "refused the credentials (check generation.http.api_key)",
                        403: "refused the credentials (check generation.http.api_key)",
                        404: "has no /v1/models: is the URL an OpenAI-compatible server's base URL (without /v1)?"}[status]
                raise MisconfiguredBackendError(f"server {server.url} {what}; it answered HTTP {status}: "
                                                f"{server_message(text)}", backend=name)
            server.last_error = f"GET /v1/models answered HTTP {status}: {server_message(text)}"
        await asyncio.sleep(delay)  # the server is starting: nothing to wait on but time
        delay = min(delay * 2, _STARTUP_RETRY_S[1])
