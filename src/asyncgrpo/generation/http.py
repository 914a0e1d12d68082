"""`HttpGenerator`: the `Generator` protocol over a pool of OpenAI-compatible completion servers (vLLM, `asyncgrpo serve`).

Job: send each rollout as one ``POST /v1/completions`` (body and answer: generation/http_client.py)
to the usable server with the least work, book how each attempt ended, and own the pool's lifecycle.
A request with a `TokenSink` (`rollout.on_stale: resume`) is streamed (generation/http_stream.py): each
chunk's tokens go to the sink as they arrive, so cancelling it (an interruption) keeps every token
received; its resumption (prompt + those ids, the budget left; rollout/resume.py) is an ordinary request
to whichever server is usable then, also when the first one died. Without a sink nothing is streamed.
Its parts: what is known of the servers and waiting for a usable one (http_servers.py), the start-up
checks (http_discovery.py), the health probes, recoveries and hung servers' return (http_probes.py),
and publishing weights to every server (http_weights.py).

Failures of the connection or the pool, classified here (answers are classified by the client):

    connection refused/reset/closed, connect timeout   -> TransientGenerationError (server marked unhealthy)
    no answer within the adaptive attempt timeout       -> RequestTimeoutError (transient)
    no usable server for backend_dead_after_s           -> BackendDeadError (fatal, names every server)
    every attempt failing, none answered, for the same  -> BackendDeadError (fatal, names every server)

Invariants:
- Deadlines: the caller bounds every attempt (request_timeout_s); inside that, an attempt past the
  adaptive budget of attempt_timeout.py is abandoned with `RequestTimeoutError` (transient: the
  caller retries it) once a newer request is answered, or at a multiple of its budget
  (attempt_clock.py). Its clock stands still while its server is paused by our weight install.
  Cancelling `generate` closes its HTTP connection at once (aiohttp closes a connection whose
  response was not read to the end), so the server aborts the request. Cancellation is never
  converted into an error.
- Dead backend. Every failed attempt (HTTP 5xx, reset, attempt timeout, ...) is booked in
  pool_health.py; once attempts have failed for ``backend_dead_after_s`` with no answer from any
  server in between, `generate` raises `BackendDeadError` naming each server and its last error
  (training and evaluation alike: both call `generate`).
- Hung servers. A server whose attempts time out ``HUNG_AFTER`` times in a row while another server
  answers is out of rotation (logged) until it answers a probe completion (http_probes.py). A server
  that answers /health but resets every request flips unhealthy and back: logged once, until it
  answers again.
- Lifecycle. `start()` checks ``/v1/models`` on every server (model name present), then starts the
  probe task, which `aclose()` cancels and awaits before it closes every connection.
- Sessions. The requests of one session (the same `request.affinity`: an agent's turns, agents/episode.py) go to
  the server its first request went to, whatever its load, so its growing prompt meets its own prefix in that
  server's cache; a new session goes to the least-loaded server, so sessions spread. A session whose server cannot
  take work (down, hung, failed its weight install) moves to the least-loaded usable server, from then on its own
  (counted in `session_moves`): a turn's prompt is the whole conversation in ids, so any server continues it.
  Pins are held weakly: a session's entry goes with its `Affinity`.
- Versions. A completion's `versions` (and a streamed request's sink entries) are the version of its
  server when the request was dispatched (a request held by a paused server may finish under newer
  weights: the stamp is the conservative, older one). With LoRA adapters (weight_sync: lora) a request
  names its server's adapter of that version as its model, and runs on exactly that version. A resumed
  request whose budget is spent (0 tokens left) is answered at once with an empty completion, without
  a server.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp

from asyncgrpo.config import GenerationConfig
from asyncgrpo.errors import (
    GenerationError,
    PromptRejectedError,
    RequestTimeoutError,
    TransientGenerationError,
)
from asyncgrpo.generation.attempt_clock import AnswerMarks, AttemptClock
from asyncgrpo.generation.attempt_timeout import LatencyTracker
from asyncgrpo.generation.http_client import completion_payload, read_completion
from asyncgrpo.generation.http_discovery import discover
from asyncgrpo.generation.http_probes import HealthProbes
from asyncgrpo.generation.http_servers import PooledServer, ServerPool
from asyncgrpo.generation.http_stream import CompletionStream
from asyncgrpo.generation.http_weights import WeightInstaller
from asyncgrpo.generation.pool_health import HUNG_AFTER
from asyncgrpo.generation.publisher_choice import make_publisher
from asyncgrpo.generation.session_pins import SessionPins
from asyncgrpo.generation.weight_sync import WeightPublisher
from asyncgrpo.types import Completion, GenerationRequest

log = logging.getLogger("asyncgrpo")


class HttpGenerator:
    """`Generator` over the servers of `cfg.http.base_urls`; see the module docstring.

    `weights_dir`: where `DiskWeightPublisher` writes versions (the servers must read it);
    `model_config`: the model directory, config.json path or config mapping copied next to the
    weights. `publisher` replaces the disk publisher. `initial_version`: the version the servers
    serve when started (0 for a fresh run; a resumed run passes its step and should publish its
    weights before generating).
    """

    def __init__(self, cfg: GenerationConfig, *, weights_dir: str | Path | None = None,
                 model_config: str | Path | Mapping[str, Any] | None = None, publisher: WeightPublisher | None = None,
                 name: str = "http", initial_version: int = 0) -> None:
        if not cfg.http.base_urls:
            raise ValueError("HttpGenerator needs at least one server in generation.http.base_urls")
        self.name = name
        self.cfg = cfg
        self.http = cfg.http
        if publisher is None and weights_dir is not None:
            publisher = make_publisher(cfg, weights_dir, model_config)
        self._pool = ServerPool(cfg, name, initial_version)
        self.counters = self._pool.counters
        self.model: str | None = cfg.http.model
        self._session: aiohttp.ClientSession | None = None
        self._probe_task: asyncio.Task | None = None
        self._latency = LatencyTracker(cap_s=cfg.request_timeout_s, factor=cfg.http.attempt_timeout_factor,
                                       floor_s=cfg.http.attempt_timeout_min_s)
        self._marks = AnswerMarks()
        self._weights = WeightInstaller(self._pool, publisher)
        self._probes = HealthProbes(self._pool, self._weights, self._latency, model_for=self._model_for)
        # Per request (the collector reuses one request object for all of a rollout's attempts): how many
        # of its attempts timed out here. Entries go with the request.
        self._timeouts: weakref.WeakKeyDictionary[GenerationRequest, int] = weakref.WeakKeyDictionary()
        self._pins: SessionPins[PooledServer] = SessionPins(name, self.counters, "server")

    # ------------------------------------------------------------------ views

    @property
    def serving_version(self) -> int:
        return self._pool.serving_version

    @property
    def servers(self) -> list[str]:
        return [s.url for s in self._pool.servers]

    def stats(self) -> dict[str, Any]:
        return {
            **self.counters,
            **getattr(self._weights.publisher, "counters", {}),  # the delta or LoRA publisher's: full loads, fallbacks, ...
            "serving_version": self.serving_version,
            "published_version": self._pool.published_version,
            "servers": [{"url": s.url, "healthy": s.healthy, "excluded": s.excluded, "hung": s.hung, "version": s.version,
                         "outstanding": s.outstanding, "dispatched": s.dispatched, "failed_installs": s.failed_installs,
                         "last_error": s.last_error} for s in self._pool.servers],
        }

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Check every server's /v1/models (within http.startup_timeout_s), then start the health probes."""
        if self._pool.closed:
            raise GenerationError(f"HTTP generator {self.name!r} is closed; create a new one.", backend=self.name)
        if self._pool.started:
            return
        headers = {"Authorization": f"Bearer {self.http.api_key}"} if self.http.api_key else None
        connect_s = min(10.0, self.cfg.request_timeout_s)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_s)
        # Completions reuse connections; idle ones close before a server's keep-alive does (uvicorn: 5 s).
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=3.0), timeout=timeout, headers=headers)
        # Probes and weight-sync calls each open a fresh connection: a pooled one the server has just
        # closed (idle, or after an error it answered) would fail them although the server is fine, and
        # a failed /resume leaves a server paused.
        self._pool.control_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True), timeout=timeout, headers=headers)
        try:
            self.model = await discover(self._pool.servers, self._pool.control_session, cfg=self.cfg, name=self.name)
        except BaseException:
            await self._close_sessions()
            raise
        self._pool.started = True
        self._pool.changed()
        self._probe_task = asyncio.create_task(self._probes.run(), name=f"{self.name}-health-probes")

    async def aclose(self) -> None:
        """Stop the probes and close every connection (requests still open fail: cancel them first). Idempotent."""
        self._pool.closed = True
        self._pool.signal.notify()
        task, self._probe_task = self._probe_task, None
        try:
            if task is not None:
                task.cancel()
                await asyncio.wait([task])  # a failure of its probes is recorded by HealthProbes.run itself
        finally:
            await self._close_sessions()

    async def _close_sessions(self) -> None:
        for session in (self._session, self._pool.control_session):
            if session is not None:
                await session.close()
        self._session = self._pool.control_session = None

    def replace_server(self, position: int, url: str, why: str) -> None:
        """The server at `position` of `servers` is now a new process at `url`: it takes work once it answers and has the
        latest weights (ServerPool.replace)."""
        self._pool.replace(position, url, why)

    def server_gone(self, position: int, why: str) -> None:
        """The server at `position` stays down for good (`why`, named by the errors that list the servers)."""
        self._pool.servers[position].gone = why

    # ------------------------------------------------------------------ generation

    async def generate(self, request: GenerationRequest) -> Completion:
        if request.sampling.max_new_tokens == 0 and request.resumed_tokens:
            # a resumed rollout whose prefix spent the budget: nothing to ask a server (base.py's contract)
            return Completion((), (), (), "length", self.serving_version)
        server = await self._server_for(request)
        url = server.url
        try:
            completion = await self._attempt(server, request)
        except PromptRejectedError:
            raise  # the server works; this prompt does not fit it
        except GenerationError as exc:
            if server.url == url:  # else its process was replaced meanwhile, and this says nothing of the new one
                self._attempt_failed(server, exc)  # raises BackendDeadError once failing for backend_dead_after_s
            raise
        if server.url == url:
            self._pool.health.answered(url, asyncio.get_running_loop().time())
            server.flapping = False
        return completion

    async def _server_for(self, request: GenerationRequest) -> PooledServer:
        """A usable server for `request`: its session's while that one is usable; else the least-loaded, which its session
        (if any) is pinned to from then on."""
        server = await self._pool.acquire("generate", prefer=self._pins.preferred(request.affinity))
        self._pins.chosen(request.affinity, server, server.url)
        return server

    def _model_for(self, server: PooledServer) -> str | None:
        """The model a request to `server` names: the LoRA publisher's adapter of the version it holds, if any."""
        return self._weights.model_for(server) or self.model

    async def _attempt(self, server: PooledServer, request: GenerationRequest) -> Completion:
        """One completion request to `server` under its attempt clock (attempt_clock.py)."""
        assert self._session is not None
        loop = asyncio.get_running_loop()
        version = server.version
        url = server.url  # the server's process may be replaced meanwhile (ServerPool.replace)
        model = self._model_for(server)
        sink = request.sink
        payload = self._probes.last_payload = completion_payload(request, model=model,
                                                          per_request_seed=self.http.seed == "per_request",
                                                          stream=sink is not None)
        stream = None if sink is None else CompletionStream(request, sink, url=url, version=version,
                                                             backend=self.name, model=model)
        failure: GenerationError | None = None
        text = ""
        timeouts = self._timeouts.get(request, 0)
        tokens = request.sampling.max_new_tokens
        budget = self._latency.timeout_s(timeouts, tokens)
        if server.outstanding == 0:
            server.quiet_since = loop.time()
        server.outstanding += 1
        server.dispatched += 1
        clock: AttemptClock | None = None
        try:
            # At the cap, the caller's request_timeout_s bounds the attempt alone.
            async with asyncio.timeout(None) as timeout:
                clock = AttemptClock(timeout, self._marks, budget_s=budget if budget < self._latency.cap_s else None,
                                     limit_s=self._latency.overdue_limit_s(budget), frozen=server.installing)
                server.attempts.add(clock)
                async with self._session.post(f"{url}/v1/completions", json=payload) as resp:
                    status = resp.status
                    if stream is None or status != 200:
                        text = await resp.text()
                    else:
                        failure = await self._read_stream(resp, stream)
        except aiohttp.ClientConnectionError as exc:  # refused, reset, closed, connect timeout (before TimeoutError: aiohttp's is both)
            if server.url == url:  # else it went to a process since replaced, which says nothing of the new one
                self._pool.mark_unhealthy(server, f"request {request.request_id}: {type(exc).__name__}: {exc}")
            raise TransientGenerationError(
                f"request {request.request_id} to {url} failed: {type(exc).__name__}: {exc}",
                backend=self.name) from exc
        except TimeoutError:
            assert clock is not None
            self._timeouts[request] = timeouts + 1
            self.counters["attempt_timeouts"] += 1
            why = "a newer request was answered meanwhile" if clock.overtaken else "nothing newer was answered to compare with"
            raise RequestTimeoutError(
                f"request {request.request_id} to {url} got no answer within its attempt budget of {budget:.3g} s "
                f"and was abandoned after {clock.active_s():.3g} s: {why} (attempt {timeouts + 1}; the adaptive attempt "
                f"timeout: {self._latency.describe()}; a transient failure)", backend=self.name) from None
        except aiohttp.ClientError as exc:  # a broken response body
            raise TransientGenerationError(
                f"request {request.request_id} to {url} failed: {type(exc).__name__}: {exc}",
                backend=self.name) from exc
        finally:
            if clock is not None:
                clock.close()
                server.attempts.discard(clock)
            server.outstanding -= 1
            if server.outstanding == 0:
                server.quiet_since = None
        if server.outstanding:
            server.quiet_since = loop.time()
        server.silence_reported = False
        if stream is not None and status == 200:
            if failure is not None:
                raise failure
            completion = stream.completion()
        else:
            completion = read_completion(status, text, url=url, request=request, version=version,
                                         backend=self.name, model=model)
        self._latency.record(clock.active_s(), tokens)
        self._marks.answered(clock.mark)
        self._timeouts.pop(request, None)
        return completion

    @staticmethod
    async def _read_stream(resp: aiohttp.ClientResponse, stream: CompletionStream) -> GenerationError | None:
        """Feed a streamed answer to `stream` (which appends each chunk's tokens to the request's sink) until it ends; a
        chunk that is an error ends the read (closing the connection: the server aborts the request) and is returned."""
        async for data in resp.content.iter_any():
            try:
                stream.feed(data)
            except GenerationError as exc:
                return exc
        return None

    def _attempt_failed(self, server: PooledServer, exc: GenerationError) -> None:
        """Book a failed attempt: the server's last error, the hung-server rule, and the dead-backend clock."""
        now = asyncio.get_running_loop().time()
        server.last_error = str(exc)
        timed_out = isinstance(exc, RequestTimeoutError)
        if self._pool.health.failed(server.url, now, timed_out=timed_out) and server.hung is None:
            self._suspend(server)
        failing = self._pool.health.failing_for(now)
        if failing is not None and failing >= self.cfg.backend_dead_after_s:
            raise self._pool.dead_error(failing) from exc

    def _suspend(self, server: PooledServer) -> None:
        """Take a server whose attempts keep timing out while others answer out of rotation (until a probe completion
        is answered, http_probes.py)."""
        server.hung = (f"its last {HUNG_AFTER} attempts got no answer within the attempt timeout while other servers "
                       f"answered; /health answers, so it looks hung")
        self.counters["hung_suspensions"] += 1
        log.warning("%s: server %s is out of rotation: %s. It takes no new work until it answers a one-token "
                    "completion, probed every %g s (generation.health_probe_interval_s).", self.name, server.url,
                    server.hung, self.cfg.health_probe_interval_s)
        self._pool.changed()

    # ------------------------------------------------------------------ weights

    async def load_weights(self, state: Mapping[str, Any] | None, version: int) -> None:
        """Publish `state` as `version` to every healthy server; returns once at least one serves it (http_weights.py)."""
        await self._weights.publish(state, version)
