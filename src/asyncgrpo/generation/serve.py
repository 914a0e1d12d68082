"""`asyncgrpo serve MODEL`'s application: an OpenAI-compatible completion server over the in-process `LocalEngine`.

Job: speak the subset of vLLM's HTTP API that asyncgrpo's `HttpGenerator` uses, with vLLM's
request and response shapes, so one client drives both a vLLM server and this one (tests,
CPU machines, and a reference for what the client expects). The shapes themselves (a completion
body validated, the answer's and the error's bodies) are serve_protocol.py's; this module holds the
server's state, its endpoints, and the bounds on what a request may cost.

Endpoints:
- ``POST /v1/completions``: ``model``, ``prompt`` (token ids, or a string that is tokenized),
  ``max_tokens`` (default: the rest of the context, as vLLM), ``temperature``, ``top_p``, ``top_k``
  (-1 or 0: off), ``min_p``, ``repetition_penalty``, ``seed``,
  ``logprobs`` (0 or null: the sampled tokens' logprobs), ``return_token_ids``,
  ``stop_token_ids``, ``ignore_eos``, ``n`` (1 only), ``stream`` (server-sent events, one chunk per
  decoding step: serve_stream.py). Fields this server does not implement are
  accepted only at their neutral value (``echo: false``, ``presence_penalty: 0``, ...); any other
  value is a 422 naming the field, since silently ignoring a sampling setting would change results.
  Logprobs are of the distribution actually sampled (sampling.py: repetition penalty, temperature,
  min-p, top-k, top-p, renormalised over the kept support), like vLLM with ``--logprobs-mode
  processed_logprobs``; T = 0 is greedy (after the penalty) with logprobs at T = 1.
- ``GET /health``, ``GET /v1/models`` (``data[0].id`` and ``max_model_len``; then the LoRA adapters loaded).
- ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (vLLM's bodies): a peft adapter merged into the
  base weights and served as a new version; requests may name any loaded adapter as their model (lora_serve.py).
- ``POST /pause?mode=keep|wait|abort`` (vLLM's default is ``abort``): new requests wait until
  ``POST /resume``. ``keep``: requests already generating keep running (vLLM freezes them; the
  client sees no difference); ``wait``: returns once they have finished; ``abort``: they end at
  once with ``finish_reason: "abort"``.
- ``POST /collective_rpc`` with ``{"method": "reload_weights", "kwargs": {"weights_path": DIR}}``:
  loads every ``*.safetensors`` file of DIR into the engine and bumps the serving version (to the
  version in DIR/asyncgrpo_version.json when the publisher wrote one and it is not older, else
  by one). Weights holding NaN or inf, and files that are not regular files (a FIFO would block
  the read forever), are refused (HTTP 400 naming them; the weights served stay as they were);
  a read that takes longer than ``--reload-timeout-s`` is abandoned (HTTP 504); serve_weights.py.
  If the engine has failed (its decoding thread died), a good reload starts a new engine over
  the same model with the new weights: the server recovers without a restart. Like vLLM's
  dev-mode endpoint, it reads any path this process can read: bind to loopback or a private
  network only.
- ``GET /stats`` (asyncgrpo extension, for tests and operators): serving version, request
  counters (total, active, waiting on a pause, completed, aborted, rejected), reloads, pause
  state, and the engine's own counters under ``engine``.

Errors use vLLM's body ``{"error": {"message", "type", "param", "code"}}``: 400 for a malformed
body, a string prompt over ``--max-prompt-chars`` (refused before it is tokenised) or a prompt the
model cannot take (the message says "maximum context length" / "longer than the maximum model
length", as vLLM's does), 404 for a model name this server does not serve, 413 for a body over the
limit derived from ``--max-prompt-chars``, 422 for an unsupported field value, 500/503 when the
engine failed or is closed, 504 for a reload whose read timed out.

Invariants:
- A client that disconnects cancels its handler (aiohttp ``handler_cancellation``), which
  cancels the engine request: the engine drops it at the next decoding step and ``/stats``
  counts it under ``requests_aborted``. Nothing keeps generating for a client that left.
- Every request ends in exactly one counter: completed, aborted or rejected.
- Nothing a request sends is unbounded in memory or in event-loop time: the body is at most
  ``max_body_bytes``, a string prompt at most ``max_prompt_chars`` before it is tokenised, and it is
  tokenised on a worker thread, so /health and every other request keep being answered meanwhile.
- The process around the application (commands/serve.py) stops on SIGINT/SIGTERM: it closes
  connections (cancelling handlers), then the engine; bounded.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from aiohttp import web

from asyncgrpo.errors import GenerationError, PromptRejectedError
from asyncgrpo.generation.lora_serve import AdapterState, add_lora_routes
from asyncgrpo.generation.serve_protocol import BadRequest, abort_body, completion_body, error_response, parse_completion
from asyncgrpo.generation.serve_stream import StreamedTokens, stream_answer
from asyncgrpo.generation.serve_weights import read_bounded, read_delta_file, read_marker, read_weights_dir
from asyncgrpo.generation.weight_delta import DeltaError, Patches, prepare_delta
from asyncgrpo.sync import StateSignal
from asyncgrpo.threads import DaemonThreadPool

log = logging.getLogger("asyncgrpo.serve")

# Request bounds. A string prompt longer than --max-prompt-chars (default: this many characters per token of
# max_model_len, far more than any tokenizer packs into a token of real text) is refused before it is tokenised; the body
# may hold that many characters at JSON's longest escape (a surrogate pair, 12 bytes), plus room for the other fields.
PROMPT_CHARS_PER_TOKEN = 16
BODY_BYTES_PER_PROMPT_CHAR = 12
BODY_BYTES_OTHER_FIELDS = 1 << 20
RELOAD_TIMEOUT_S = 300.0
RPC_METHODS = ("reload_weights", "asyncgrpo_load_full", "asyncgrpo_apply_delta")  # delta_publisher.py sends the last two


class ServerState:
    """Everything the handlers share; lives on the server's event loop. `engine` is replaced (by
    `engine_factory(version)`, an engine not yet started) when a reload finds it failed. String prompts are
    tokenised on one worker thread (`prompt_threads`) with a copy of the tokenizer of its own (`prompt_tokenizer`):
    never on the event loop, and never with the tokenizer the loop decodes with (fast tokenizers raise "Already
    borrowed" when two threads use one)."""

    def __init__(self, engine: Any, tokenizer: Any, *, model_name: str, max_model_len: int, vocab_size: int,
                 model_dir: str | None, engine_factory: Callable[[int], Any] | None = None,
                 max_prompt_chars: int | None = None, reload_timeout_s: float = RELOAD_TIMEOUT_S) -> None:
        self.engine = engine
        self.engine_factory = engine_factory
        self.tokenizer = tokenizer
        self.prompt_tokenizer = copy.deepcopy(tokenizer)
        self.prompt_threads = DaemonThreadPool(1, name="asyncgrpo-serve-tokenize")
        self.max_prompt_chars = max_prompt_chars or PROMPT_CHARS_PER_TOKEN * max_model_len
        self.max_body_bytes = BODY_BYTES_OTHER_FIELDS + BODY_BYTES_PER_PROMPT_CHAR * self.max_prompt_chars
        self.reload_timeout_s = reload_timeout_s
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        self.paused = False
        self.signal = StateSignal()
        self.generating: set[asyncio.Task] = set()  # engine calls in progress
        self.reload_lock = asyncio.Lock()
        self.weights_id: str | None = None  # the delta publisher's identity of the weights served (None: unknown)
        self.adapters = AdapterState()  # LoRA adapters merged into the served weights (lora_serve.py)
        self.counters = {"requests_total": 0, "requests_completed": 0, "requests_aborted": 0, "requests_rejected": 0,
                         "requests_waiting": 0, "reloads": 0, "reload_failures": 0, "deltas_applied": 0,
                         "delta_refusals": 0, "adapters_loaded": 0}

    @property
    def adapter_names(self) -> Collection[str]:
        return self.adapters.loaded.keys()

    def stats(self) -> dict[str, Any]:
        engine = self.engine.stats()
        return {
            "engine_failure": None if self.engine.failure is None else repr(self.engine.failure),
            "model": self.model_name,
            "serving_version": engine["serving_version"],
            "weights_id": self.weights_id,
            "paused": self.paused,
            "requests_active": len(self.generating),
            **self.counters,
            "engine": engine,
        }


STATE = web.AppKey("state", ServerState)


def create_app(engine: Any, tokenizer: Any, *, model_name: str, max_model_len: int, vocab_size: int,
               model_dir: str | None = None, engine_factory: Callable[[int], Any] | None = None,
               max_prompt_chars: int | None = None, reload_timeout_s: float = RELOAD_TIMEOUT_S) -> web.Application:
    """The aiohttp application over a started `LocalEngine`; run it with `handler_cancellation=True`
    (as commands.serve.run_server does) so that a client disconnecting aborts its request. `engine_factory(version)`
    builds a replacement engine over the same model (see ServerState); without it a failed engine stays failed.
    `max_prompt_chars` (None: PROMPT_CHARS_PER_TOKEN x max_model_len) bounds string prompts and, through it, the
    body; `reload_timeout_s` bounds reading a reload's weights, and installing them."""
    state = ServerState(engine, tokenizer, model_name=model_name, max_model_len=max_model_len, vocab_size=vocab_size,
                        model_dir=model_dir, engine_factory=engine_factory, max_prompt_chars=max_prompt_chars,
                        reload_timeout_s=reload_timeout_s)
    app = web.Application(client_max_size=state.max_body_bytes)
    app[STATE] = state

    async def health(_: web.Request) -> web.Response:
        if state.engine.failure is not None:
            return error_response(503, f"the engine failed: {state.engine.failure!r}; a good reload_weights restarts it")
        return web.Response(status=200)

    async def models(_: web.Request) -> web.Response:
        created = int(time.time())
        return web.json_response({"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "asyncgrpo",
            "root": model_dir or model_name, "parent": None, "max_model_len": max_model_len}] + [{
            "id": name, "object": "model", "created": created, "owned_by": "asyncgrpo", "root": path, "parent": model_name,
            "max_model_len": None} for name, path in state.adapters.loaded.items()]})

    async def stats(_: web.Request) -> web.Response:
        return web.json_response(state.stats())

    async def pause(request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in ("keep", "wait", "abort"):
            return web.json_response({"error": f"mode must be one of keep, wait, abort; got {mode!r}"}, status=400)
        state.paused = True
        state.signal.notify()
        if mode == "abort":
            for task in list(state.generating):
                task.cancel()
        elif mode == "wait":
            await state.signal.wait_for(lambda: not state.generating)
        return web.json_response({"status": "paused"})

    async def resume(_: web.Request) -> web.Response:
        state.paused = False
        state.signal.notify()
        return web.json_response({"status": "resumed"})

    async def is_paused(_: web.Request) -> web.Response:
        return web.json_response({"is_paused": state.paused})

    async def collective_rpc(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error_response(400, f"JSON decode error: {exc}")
        except web.HTTPRequestEntityTooLarge:
            return error_response(413, _too_large(state))
        if not isinstance(body, dict) or body.get("method") is None:
            return error_response(400, "Missing 'method' in request body")
        method, kwargs = body["method"], body.get("kwargs") or {}
        if method not in RPC_METHODS:
            return error_response(400, f"method {method!r} is not supported by asyncgrpo serve; it supports "
                                       f"{', '.join(RPC_METHODS)}")
        delta = method == "asyncgrpo_apply_delta"
        path = kwargs.get("delta_path") if delta else kwargs.get("weights_path") or model_dir
        if not path:
            return error_response(400, f"{method} needs kwargs.{'delta_path' if delta else 'weights_path'}"
                                       + ("" if delta else " (this server was not started from a directory)"))
        async with state.reload_lock:
            try:
                if delta:
                    served, held = state.engine.weights(), state.weights_id
                    patches, manifest = await read_bounded(
                        lambda: _prepared(served, held, Path(path)), state.reload_timeout_s)
                    file_version: int | None = int(manifest["version"])
                    weights_id = manifest["weights_id"]
                else:
                    (weights, file_version), marker = await read_bounded(
                        lambda: (read_weights_dir(Path(path)), read_marker(Path(path))), state.reload_timeout_s)
                    weights_id = (marker or {}).get("weights_id")
                current = state.engine.serving_version
                version = file_version if file_version is not None and file_version >= current else current + 1
                state.weights_id = None  # until the install is complete: no delta may apply to half-loaded weights
                if delta:
                    await _apply_delta(state, patches, version)
                else:
                    await _install(state, weights, version)
                state.adapters.reset()
                state.weights_id = weights_id
            except DeltaError as exc:  # another base, a bad file or a failed checksum: the publisher sends the full weights
                state.counters["delta_refusals"] += 1
                log.warning("asyncgrpo serve: refused the weight delta %s: %s", path, exc)
                return web.json_response({"results": [{"applied": False, "reason": str(exc)}]})
            except GenerationError as exc:  # the engine is closed
                state.counters["reload_failures"] += 1
                return error_response(503, f"{method} from {path}: {exc}")
            except TimeoutError as exc:  # the read abandoned on its daemon thread, or the engine did not take the weights in time
                state.counters["reload_failures"] += 1
                log.warning("asyncgrpo serve: %s from %s failed: %s", method, path, exc)
                return error_response(504, f"{method} from {path}: {exc}")
            except Exception as exc:  # noqa: BLE001 - unreadable files, wrong keys or shapes: told to the caller
                state.counters["reload_failures"] += 1
                log.warning("asyncgrpo serve: %s from %s failed: %s", method, path, exc)
                return error_response(400, f"{method} from {path}: {type(exc).__name__}: {exc}")
        state.counters["deltas_applied" if delta else "reloads"] += 1
        log.info("asyncgrpo serve: loaded weights from %s as version %d", path, version)
        if method == "reload_weights":
            return web.json_response({"results": [None]})
        return web.json_response({"results": [{"applied": True, "weights_id": weights_id, "version": version}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        state.counters["requests_total"] += 1
        try:
            body = await _read_json(state, request)
            prompt_ids = await _tokenize_prompt(state, body.get("prompt"))
            gen_request, want_ids, want_logprobs, stream = parse_completion(state, body, prompt_ids)
            if stream:
                gen_request = replace(gen_request, sink=StreamedTokens())
        except BadRequest as exc:
            state.counters["requests_rejected"] += 1
            return error_response(exc.status, str(exc), exc.param)
        try:
            if state.paused:
                state.counters["requests_waiting"] += 1
                try:
                    await state.signal.wait_for(lambda: not state.paused)
                finally:
                    state.counters["requests_waiting"] -= 1
            engine = state.engine  # this request's engine, even if a reload replaces it meanwhile
            task = asyncio.ensure_future(engine.generate(gen_request))
            state.generating.add(task)
            state.signal.notify()
            try:
                if stream and (streamed := await stream_answer(state, request, gen_request, task, want_ids, want_logprobs)):
                    state.counters["requests_aborted" if task.cancelled() else "requests_completed" if task.exception() is None
                                   else "requests_rejected"] += 1
                    return streamed
                completion = await task
            finally:
                state.generating.discard(task)
                task.cancel()  # no-op when done; a cancelled handler cancels its engine call
                state.signal.notify()
        except asyncio.CancelledError:
            state.counters["requests_aborted"] += 1
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # the client went away (or the server is shutting down)
            return web.json_response(abort_body(state, gen_request))  # /pause?mode=abort
        except PromptRejectedError as exc:
            state.counters["requests_rejected"] += 1
            return error_response(400, str(exc), "prompt")
        except GenerationError as exc:
            state.counters["requests_rejected"] += 1
            return error_response(503 if engine.failure is None else 500, str(exc))
        state.counters["requests_completed"] += 1
        return web.json_response(completion_body(state, gen_request, completion, want_ids, want_logprobs))

    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/stats", stats)
    app.router.add_post("/pause", pause)
    app.router.add_post("/resume", resume)
    app.router.add_get("/is_paused", is_paused)
    app.router.add_post("/collective_rpc", collective_rpc)
    app.router.add_post("/v1/completions", completions)
    add_lora_routes(app, state, lambda weights, version: _install(state, {**state.engine.weights(), **weights}, version))
    return app


async def _install(state: ServerState, weights: dict[str, Any], version: int) -> None:
    """Load `weights` as `version` into the engine; a failed engine is replaced by a new one that has them."""
    failed = state.engine
    if failed.failure is None or state.engine_factory is None:
        async with asyncio.timeout(state.reload_timeout_s):  # a hung decoding step never takes it: 504, the next sync retries
            await failed.load_weights(weights, version)
        return
    replacement = state.engine_factory(failed.serving_version)
    await replacement.load_weights(weights, version)  # not started yet: applied at once, nothing runs on the model
    await replacement.start()
    state.engine = replacement
    log.warning("asyncgrpo serve: the engine had failed (%r); restarted it with the reloaded weights (version %d)",
                failed.failure, version)
    await failed.aclose()  # its thread has exited: releases nothing more, idempotent


def _prepared(served: Mapping[str, Any], held: str | None, path: Path) -> tuple[Patches, dict[str, Any]]:
    """The delta at `path` (read on the caller's daemon thread) checked against the served weights, and its manifest."""
    entries, manifest = read_delta_file(path)
    return prepare_delta(served, held, entries, manifest), manifest


async def _apply_delta(state: ServerState, patches: Patches, version: int) -> None:
    """Write `patches` into the engine's own weights as `version`, on its thread between decoding steps: no request
    sees a half-applied delta, and one whose checksum fails is undone before decoding goes on (DeltaError)."""
    if state.engine.failure is not None:
        raise DeltaError(f"the engine had failed ({state.engine.failure!r}); the full weights restart it")
    # Bounded as the read is: a load not yet taken is withdrawn; one taken finishes or undoes itself on the engine thread,
    # and with weights_id unset the next sync is a full one.
    async with asyncio.timeout(state.reload_timeout_s):
        await state.engine.load_weights(patches.apply, version)


def _too_large(state: ServerState) -> str:
    return (f"the request body is larger than this server's limit of {state.max_body_bytes} bytes, derived from its prompt "
            f"limit --max-prompt-chars = {state.max_prompt_chars} ({BODY_BYTES_PER_PROMPT_CHAR} bytes per character plus "
            f"{BODY_BYTES_OTHER_FIELDS} for the other fields). Fix: send a shorter prompt, or restart the server with a "
            f"larger --max-prompt-chars")


async def _read_json(state: ServerState, request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(400, f"the request body is not valid JSON: {exc}") from None
    except web.HTTPRequestEntityTooLarge:
        raise BadRequest(413, _too_large(state)) from None
    if not isinstance(body, dict):
        raise BadRequest(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


async def _tokenize_prompt(state: ServerState, prompt: Any) -> list[int] | None:
    """A string prompt's token ids, tokenised off the event loop once its length is within `max_prompt_chars`
    (raise BadRequest naming the limit and the flag that raises it); None for any other prompt."""
    if not isinstance(prompt, str) or not prompt:
        return None
    if len(prompt) > state.max_prompt_chars:
        raise BadRequest(400, f"The prompt is {len(prompt)} characters long, over this server's limit of "
                               f"--max-prompt-chars = {state.max_prompt_chars} (a longer prompt is refused before it is "
                               f"tokenised; the default is {PROMPT_CHARS_PER_TOKEN} characters per token of the maximum "
                               f"model length). Fix: send a shorter prompt (or its token ids), or restart the server with a "
                               f"larger --max-prompt-chars.", "prompt")
    tokenizer = state.prompt_tokenizer
    async with state.prompt_threads.worker() as thread:
        return list(await thread.call(lambda: tokenizer(prompt, add_special_tokens=True)["input_ids"]))
