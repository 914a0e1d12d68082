"""`HttpGenerator`: the `Generator` protocol over a pool of OpenAI-compatible completion servers (vLLM, `asyncgrpo serve`).

Job: the server pool. Send each rollout as one ``POST /v1/completions`` (body and answer:
generation/http_client.py) to a healthy server, keep track of which server is alive and which
weights each one serves, fail over between them, and install new weights on every one of them.

Failures of the connection or the pool, classified here (answers are classified by the client):

    connection refused/reset/closed, connect timeout   -> TransientGenerationError (server marked unhealthy)
    no answer within the adaptive attempt timeout       -> RequestTimeoutError (transient)
    no usable server for backend_dead_after_s           -> BackendDeadError (fatal, names every server)
    every attempt failing, none answered, for the same  -> BackendDeadError (fatal, names every server)

Invariants:
- Deadlines: the caller bounds every attempt (request_timeout_s); inside that, an attempt past the
  adaptive budget of attempt_timeout.py is abandoned with `RequestTimeoutError` (transient: the
  caller retries it) once a newer request is answered, or at a multiple of its budget
  (attempt_clock.py). Its clock stands still while its server is paused by our weight install. A
  server holding open requests that answers none for `LatencyTracker.silence_s` is logged once by
  name (checked by its probe loop). Cancelling `generate` closes its HTTP connection at once
  (aiohttp closes a connection whose response was not read to the end), so the server aborts the
  request. Cancellation is never converted into an error.
- Dead backend. Every failed attempt (HTTP 5xx, reset, attempt timeout, ...) is booked in
  pool_health.py; once attempts have failed for ``backend_dead_after_s`` with no answer from any
  server in between, `generate` raises `BackendDeadError` naming each server and its last error
  (training and evaluation alike: both call `generate`).
- Hung servers. A server whose attempts time out ``HUNG_AFTER`` times in a row while another server
  answers is out of rotation (logged); its probe loop sends it a one-token completion every probe
  interval, and once one is answered it is back in rotation (logged). A server that answers
  /health but resets every request flips unhealthy and back: logged once, until it answers again.
- Health. `start()` checks ``/v1/models`` on every server (model name present) and then starts one
  probe loop per server (``GET /health`` every ``health_probe_interval_s``), all owned by one
  TaskGroup in the probe task (`_run_probes`), which `aclose()` cancels and awaits; if a probe
  loop fails, the task records why, and every later call raises `BackendDeadError` naming it. A
  server that fails a probe, or a request with a connection error (which also triggers an
  immediate probe), is unhealthy until a probe succeeds. A server
  that comes back is first given the latest published weights (it may have restarted with its
  original ones) and only then takes work again.
- Waiting. With no usable server (healthy and serving the published weights), `generate` and
  `load_weights` wait on a `StateSignal` predicate (woken by every health or weight change,
  nothing polls) and raise `BackendDeadError` once no server has been usable for
  ``backend_dead_after_s``; the message names each server and its last error.
- Weights. `load_weights(state, version)` stages the state once through a `WeightPublisher`
  (default: `DiskWeightPublisher` under `weights_dir`) and installs it on every healthy server
  concurrently, one install per server at a time (a per-server lock), each step under
  ``generation.weight_sync_timeout_s`` (/pause and /resume under the probe timeout). A server whose
  install fails takes no work until a later install succeeds (counted in
  `stats()["weight_sync_failures"]`). An install runs as the server's own task: marking the server
  unhealthy (a failed probe, a refused connection, /pause or /resume unanswered) cancels it, so no
  publication waits on a server known to be down; it reloads on return (`_recover`, a task beside
  its probe loop, which keeps probing). If every target went down, publication waits for a server
  like `generate` does (`BackendDeadError` after backend_dead_after_s); if servers that answer all
  failed to install, `WeightSyncError` (fatal) names them. `state=None` means "same weights": versions advance with no
  transfer.
- Versions. A server's version is the version it is known to have loaded; a completion's
  `versions` are the version of its server when the request was dispatched (a request held by a
  paused server may finish under newer weights: the stamp is the conservative, older one).
  `serving_version` is the lowest version among servers that can take work (the latest published
  version while none can).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from asyncgrpo.config import GenerationConfig
from asyncgrpo.errors import (
    BackendDeadError,
    GenerationError,
    PromptRejectedError,
    RequestTimeoutError,
    TransientGenerationError,
)
from asyncgrpo.generation.attempt_clock import AnswerMarks, AttemptClock
from asyncgrpo.generation.attempt_timeout import LatencyTracker
from asyncgrpo.generation.http_client import completion_payload, read_completion, server_message
from asyncgrpo.generation.http_control import HttpControl
from asyncgrpo.generation.http_discovery import discover
from asyncgrpo.generation.pool_health import HUNG_AFTER, PoolHealth
from asyncgrpo.generation.weight_sync import (
    RESUME_AFTER_FAILURE_S,
    DiskWeightPublisher,
    StagedWeights,
    WeightPublisher,
    WeightSyncError,
    WeightSyncStepError,
)
from asyncgrpo.sync import StateSignal
from asyncgrpo.types import Completion, GenerationRequest

log = logging.getLogger("asyncgrpo")

INSTALL_SHARE = 0.8  # of generation.weight_sync_timeout_s: server installs end before the pipeline's deadline


@dataclass(eq=False)
class _Server:
    url: str
    version: int
    healthy: bool = True
    loaded: StagedWeights | None = None  # the staged weights it has loaded (None: its own, or unknown after an outage)
    excluded: str | None = None  # why it takes no work although it answers (a failed weight install)
    hung: str | None = None  # why it is out of rotation although /health answers (its attempts time out)
    flapping: bool = False  # back after an outage, no request answered since: its marks and returns log at debug level
    last_error: str = ""
    outstanding: int = 0
    dispatched: int = 0
    failed_installs: int = 0
    last_status: int | None = None  # HTTP status of its last failed install step, if it answered
    epoch: int = 0  # bumped when it is marked unhealthy: a probe that overlapped the change probes again
    models: list[str] = field(default_factory=list)
    max_model_len: int | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    waker: asyncio.Future | None = None
    attempts: set[AttemptClock] = field(default_factory=set)  # its open completion requests
    installing: bool = False  # paused by us for a weight install: its attempts' clocks stand still
    install: asyncio.Task | None = None  # the install in progress; an unhealthy mark cancels it
    quiet_since: float | None = None  # loop time since which it has held requests open, answered none, not paused by us
    silence_reported: bool = False  # warned that it answers nothing; reset by its next answer

    @property
    def usable(self) -> bool:
        return self.healthy and self.excluded is None and self.hung is None

    def describe(self) -> str:
        if not self.healthy:
            state = "unreachable"
        elif self.excluded is not None:
            state = f"takes no work ({self.excluded})"
        elif self.hung is not None:
            state = f"out of rotation ({self.hung})"
        else:
            state = "answers /health"
        last = f"; last error: {self.last_error}" if self.last_error else ""
        return f"{self.url}: {state}{last}"


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
            publisher = DiskWeightPublisher(weights_dir, model_config=model_config)
        self._publisher = publisher
        self._servers = [_Server(url=url.rstrip("/"), version=initial_version) for url in cfg.http.base_urls]
        self._published_version = initial_version
        self._latest: StagedWeights | None = None
        self.model: str | None = cfg.http.model
        self._signal = StateSignal()
        self._session: aiohttp.ClientSession | None = None
        self._control_session: aiohttp.ClientSession | None = None
        self._probe_task: asyncio.Task | None = None
        self._probe_failure: BaseException | None = None
        self._none_usable_since: float | None = None
        self._started = False
        self._closed = False
        self._latency = LatencyTracker(cap_s=cfg.request_timeout_s, factor=cfg.http.attempt_timeout_factor,
                                       floor_s=cfg.http.attempt_timeout_min_s)
        self._marks = AnswerMarks()
        self._health = PoolHealth([s.url for s in self._servers])
        self._last_payload: dict[str, Any] | None = None  # the newest request's body: the hung-server probe reuses its prompt
        # Per request (the collector reuses one request object for all of a rollout's attempts): how many
        # of its attempts timed out here. Entries go with the request.
        self._timeouts: weakref.WeakKeyDictionary[GenerationRequest, int] = weakref.WeakKeyDictionary()
        self.counters = {"weight_sync_failures": 0, "unhealthy_marks": 0, "recoveries": 0, "attempt_timeouts": 0,
                         "hung_suspensions": 0, "hung_returns": 0}

    # ------------------------------------------------------------------ views

    @property
    def serving_version(self) -> int:
        usable = [s.version for s in self._servers if s.usable]
        return min(usable) if usable else self._published_version

    @property
    def servers(self) -> list[str]:
        return [s.url for s in self._servers]

    def stats(self) -> dict[str, Any]:
        return {
            **self.counters,
            "serving_version": self.serving_version,
            "published_version": self._published_version,
            "servers": [{"url": s.url, "healthy": s.healthy, "excluded": s.excluded, "hung": s.hung, "version": s.version,
                         "outstanding": s.outstanding, "dispatched": s.dispatched, "failed_installs": s.failed_installs,
                         "last_error": s.last_error} for s in self._servers],
        }

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Check every server's /v1/models (within http.startup_timeout_s), then start the health probes."""
        if self._closed:
            raise GenerationError(f"HTTP generator {self.name!r} is closed; create a new one.", backend=self.name)
        if self._started:
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
        self._control_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True), timeout=timeout, headers=headers)
        try:
            self.model = await discover(self._servers, self._control_session, cfg=self.cfg, name=self.name)
        except BaseException:
            await self._close_sessions()
            raise
        self._started = True
        self._changed()
        self._probe_task = asyncio.create_task(self._run_probes(), name=f"{self.name}-health-probes")

    async def aclose(self) -> None:
        """Stop the probes and close every connection (requests still open fail: cancel them first). Idempotent."""
        self._closed = True
        self._signal.notify()
        task, self._probe_task = self._probe_task, None
        try:
            if task is not None:
                task.cancel()
                await asyncio.wait([task])  # a failure of its probes is recorded by _run_probes itself
        finally:
            await self._close_sessions()

    async def _close_sessions(self) -> None:
        for session in (self._session, self._control_session):
            if session is not None:
                await session.close()
        self._session = self._control_session = None

    # ------------------------------------------------------------------ generation

    async def generate(self, request: GenerationRequest) -> Completion:
        server = await self._acquire(lambda: any(s.usable for s in self._servers), "generate")
        try:
            completion = await self._attempt(server, request)
        except PromptRejectedError:
            raise  # the server works; this prompt does not fit it
        except GenerationError as exc:
            self._attempt_failed(server, exc)  # raises BackendDeadError once failing for backend_dead_after_s
            raise
        self._health.answered(server.url, asyncio.get_running_loop().time())
        server.flapping = False
        return completion

    async def _attempt(self, server: _Server, request: GenerationRequest) -> Completion:
        """One completion request to `server` under its attempt clock (attempt_clock.py)."""
        assert self._session is not None
        loop = asyncio.get_running_loop()
        version = server.version
        payload = self._last_payload = completion_payload(request, model=self.model,
                                                          per_request_seed=self.http.seed == "per_request")
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
                async with self._session.post(f"{server.url}/v1/completions", json=payload) as resp:
                    status, text = resp.status, await resp.text()
        except aiohttp.ClientConnectionError as exc:  # refused, reset, closed, connect timeout (before TimeoutError: aiohttp's is both)
            self._mark_unhealthy(server, f"request {request.request_id}: {type(exc).__name__}: {exc}")
            raise TransientGenerationError(
                f"request {request.request_id} to {server.url} failed: {type(exc).__name__}: {exc}",
                backend=self.name) from exc
        except TimeoutError:
            assert clock is not None
            self._timeouts[request] = timeouts + 1
            self.counters["attempt_timeouts"] += 1
            why = "a newer request was answered meanwhile" if clock.overtaken else "nothing newer was answered to compare with"
            raise RequestTimeoutError(
                f"request {request.request_id} to {server.url} got no answer within its attempt budget of {budget:.3g} s "
                f"and was abandoned after {clock.active_s():.3g} s: {why} (attempt {timeouts + 1}; the adaptive attempt "
                f"timeout: {self._latency.describe()}; a transient failure)", backend=self.name) from None
        except aiohttp.ClientError as exc:  # a broken response body
            raise TransientGenerationError(
                f"request {request.request_id} to {server.url} failed: {type(exc).__name__}: {exc}",
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
        completion = read_completion(status, text, url=server.url, request=request, version=version,
                                     backend=self.name, model=self.model)
        self._latency.record(clock.active_s(), tokens)
        self._marks.answered(clock.mark)
        self._timeouts.pop(request, None)
        return completion

    def _attempt_failed(self, server: _Server, exc: GenerationError) -> None:
        """Book a failed attempt: the server's last error, the hung-server rule, and the dead-backend clock."""
        now = asyncio.get_running_loop().time()
        server.last_error = str(exc)
        timed_out = isinstance(exc, RequestTimeoutError)
        if self._health.failed(server.url, now, timed_out=timed_out) and server.hung is None:
            self._suspend(server)
        failing = self._health.failing_for(now)
        if failing is not None and failing >= self.cfg.backend_dead_after_s:
            raise self._dead_error(failing) from exc

    def _dead_error(self, failing_s: float) -> BackendDeadError:
        return BackendDeadError(
            f"no request to any generation server succeeded for {failing_s:.1f} s of failing attempts "
            f"(generation.backend_dead_after_s = {self.cfg.backend_dead_after_s:g}): "
            + "; ".join(s.describe() for s in self._servers)
            + ". Check the servers' own logs for why they fail every request (or raise generation.backend_dead_after_s "
            "to keep retrying longer).", backend=self.name)

    def _suspend(self, server: _Server) -> None:
        """Take a server whose attempts keep timing out while others answer out of rotation (until a probe completion
        is answered, see `_probe_loop`)."""
        server.hung = (f"its last {HUNG_AFTER} attempts got no answer within the attempt timeout while other servers "
                       f"answered; /health answers, so it looks hung")
        self.counters["hung_suspensions"] += 1
        log.warning("%s: server %s is out of rotation: %s. It takes no new work until it answers a one-token "
                    "completion, probed every %g s (generation.health_probe_interval_s).", self.name, server.url,
                    server.hung, self.cfg.health_probe_interval_s)
        self._changed()

    # ------------------------------------------------------------------ weights

    async def load_weights(self, state: Mapping[str, Any] | None, version: int) -> None:
        """Publish `state` as `version` to every healthy server; returns once at least one serves it (see module docstring)."""
        self._check_open()
        if version < self._published_version:
            raise ValueError(f"load_weights: version {version} is older than the published version "
                             f"{self._published_version}; versions must not decrease.")
        if state is None:  # the same weights under a new version number: nothing to transfer
            self._published_version = version
            for server in self._servers:
                if server.excluded is None and server.loaded is self._latest:
                    server.version = version
            self._changed()
            return
        if self._publisher is None:
            raise GenerationError(f"HTTP generator {self.name!r} has no weights_dir (or publisher), so it cannot "
                                  f"publish weights: set generation.http.weights_dir.", backend=self.name)
        # Installs end well inside the pipeline's own deadline for the whole publication, so that a slow
        # server is excluded (and the others go on) rather than failing the run.
        deadline = asyncio.get_running_loop().time() + INSTALL_SHARE * self.cfg.weight_sync_timeout_s
        staged = await self._publisher.stage(state, version)
        self._latest = staged
        self._published_version = version
        while True:
            # Every server known to be down: wait for one to come back (its recovery installs this version)
            # or raise BackendDeadError after backend_dead_after_s.
            await self._acquire(lambda: any(s.healthy for s in self._servers), f"publish weights v{version}")
            targets = [s for s in self._servers if s.healthy]
            async with asyncio.TaskGroup() as group:
                results = [group.create_task(self._sync_server(s, deadline)) for s in targets]
            self._changed()
            if any(r.result() for r in results):
                return
            failed = [s for s in targets if s.healthy]  # answered, yet could not install; the others went down
            if failed:
                break
        misconfigured = all(s.last_status is not None and 400 <= s.last_status < 500 for s in failed)
        raise WeightSyncError(
            f"no generation server loaded weights v{version}: " + "; ".join(s.describe() for s in targets)
            + f". The servers must read {staged.path} and accept /pause, /collective_rpc reload_weights and /resume "
            "(vLLM: VLLM_SERVER_DEV_MODE=1).", backend=self.name, misconfigured=misconfigured)

    async def _sync_server(self, server: _Server, deadline: float) -> bool:
        """Install the latest staged weights on `server` by the loop time `deadline`; True on success.

        One install per server at a time (its lock). The install runs as the server's own task, so that
        marking the server unhealthy cancels it (`_mark_unhealthy`): nobody waits on a server known to be
        down; it gets the latest weights when it is back (`_recover`)."""
        async with server.lock:
            if not server.healthy:
                return False  # marked while this waited for the lock
            install = server.install = asyncio.create_task(self._install_latest(server, deadline),
                                                           name=f"{self.name}-install-{server.url}")
            try:
                return await install
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # our caller is cancelled (awaiting the install cancelled it too)
                return False  # the unhealthy mark cancelled it
            finally:
                server.install = None

    async def _install_latest(self, server: _Server, deadline: float) -> bool:
        """Install the latest staged weights on `server` (again, if newer ones were staged meanwhile). True on success."""
        assert self._control_session is not None and self._publisher is not None
        loop = asyncio.get_running_loop()
        while self._latest is not None and server.loaded is not self._latest:  # identity: one object per stage()
            target = self._latest
            self._pause_clocks(server, True)
            try:
                budget = deadline - loop.time()
                if budget <= 0:
                    raise WeightSyncStepError(f"no time left to load weights v{target.version} on {server.url} "
                                              f"within generation.weight_sync_timeout_s")
                control = HttpControl(self._control_session, server.url, self._probe_timeout_s())
                async with asyncio.timeout(budget + RESUME_AFTER_FAILURE_S):  # the publisher's own bound, enforced
                    await self._publisher.install(control, target, budget)
            except TimeoutError:
                exc = WeightSyncStepError(f"loading weights v{target.version} on {server.url} did not finish "
                                          f"within {budget:g} s (generation.weight_sync_timeout_s)")
                self._install_failed(server, target, exc)
                return False
            except WeightSyncStepError as exc:
                if exc.unreachable:  # like a failed probe: it gets the latest weights when it answers again
                    self._mark_unhealthy(server, f"loading weights v{target.version}: {exc}")
                else:
                    self._install_failed(server, target, exc)
                return False
            except (aiohttp.ClientError, OSError) as exc:
                self._install_failed(server, target, exc)
                return False
            finally:
                self._pause_clocks(server, False)
            server.loaded = target
            server.last_status = None
            server.version = self._published_version if self._latest is target else target.version
            server.excluded = None
            self._changed()
        if self._latest is None:  # nothing ever staged: its own weights are the published ones
            server.version = self._published_version
            server.excluded = None
            self._changed()
        return True

    def _pause_clocks(self, server: _Server, paused: bool) -> None:
        """Our install pauses the server: its requests' attempt clocks stand still meanwhile and keep their
        budgets (a request that resumes by prefilling again is not abandoned while newer ones are no faster,
        attempt_clock.py); the latencies are kept."""
        server.installing = paused
        for clock in server.attempts:
            clock.freeze() if paused else clock.thaw()
        if not paused and server.quiet_since is not None:
            server.quiet_since = asyncio.get_running_loop().time()

    def _install_failed(self, server: _Server, target: StagedWeights, exc: BaseException) -> None:
        server.failed_installs += 1
        self.counters["weight_sync_failures"] += 1
        server.excluded = f"loading weights v{target.version} failed"
        server.last_error = str(exc)
        server.last_status = getattr(exc, "status", None)
        log.warning("%s: %s could not load weights v%d and takes no work until a later load succeeds "
                    "(a failed reload can leave a vLLM server unable to generate: restart it if it does "
                    "not recover): %s", self.name, server.url, target.version, exc)
        self._changed()

    # ------------------------------------------------------------------ health

    async def _acquire(self, predicate: Callable[[], bool], purpose: str) -> _Server:
        """Wait until `predicate()` (some server can serve `purpose`); return the usable server with least work.

        Raises BackendDeadError once no server has been usable for backend_dead_after_s.
        """
        loop = asyncio.get_running_loop()
        while True:
            self._check_open()
            failing = self._health.failing_for(loop.time())
            if failing is not None and failing >= self.cfg.backend_dead_after_s:
                raise self._dead_error(failing)
            if predicate():
                usable = [s for s in self._servers if s.usable] or [s for s in self._servers if s.healthy]
                return min(usable, key=lambda s: s.outstanding)
            since = self._none_usable_since if self._none_usable_since is not None else loop.time()
            deadline = since + self.cfg.backend_dead_after_s
            if loop.time() >= deadline:
                raise BackendDeadError(
                    f"no generation server could take work for {loop.time() - since:.1f} s "
                    f"(generation.backend_dead_after_s = {self.cfg.backend_dead_after_s:g}) while trying to {purpose}: "
                    + "; ".join(s.describe() for s in self._servers)
                    + ". Check that the servers are running and reachable, or raise generation.backend_dead_after_s "
                    "to wait longer for restarts.", backend=self.name)
            try:
                async with asyncio.timeout_at(deadline):
                    await self._signal.wait_for(lambda: predicate() or self._closed or self._probe_failure is not None)
            except TimeoutError:
                pass  # re-checked above: raises unless a server came back at the deadline

    def _check_open(self) -> None:
        if self._probe_failure is not None:
            raise BackendDeadError(f"the health probes of {self.name!r} stopped with "
                                   f"{type(self._probe_failure).__name__}: {self._probe_failure}; server health is "
                                   f"unknown, so no work can be routed.", backend=self.name) from self._probe_failure
        if self._closed:
            raise GenerationError(f"HTTP generator {self.name!r} is closed; the request was not sent.", backend=self.name)
        if not self._started:
            raise GenerationError(f"HTTP generator {self.name!r} is not started: await start() first.", backend=self.name)

    def _changed(self) -> None:
        """Every change of health, exclusion or version ends here: keep the dead-since clock, wake waiters."""
        if any(s.usable for s in self._servers):
            self._none_usable_since = None
        elif self._none_usable_since is None:
            self._none_usable_since = asyncio.get_running_loop().time()
        self._signal.notify()

    def _mark_unhealthy(self, server: _Server, error: str) -> None:
        server.last_error = error
        server.epoch += 1
        if server.healthy:
            server.healthy = False
            self.counters["unhealthy_marks"] += 1
            # Once per outage: a server whose /health answers but which resets every request flaps many times a second.
            level = logging.DEBUG if server.flapping else logging.WARNING
            log.log(level, "%s: server %s is unhealthy: %s", self.name, server.url, error)
        if self._latest is not None:
            server.loaded = None  # it may restart with its original weights: reinstall when it is back
        if server.install is not None and not server.install.done() and server.install is not asyncio.current_task():
            log.warning("%s: abandoning the weight install on %s (unhealthy); it gets the latest weights when it "
                        "is back", self.name, server.url)
            server.install.cancel()
        if server.waker is not None and not server.waker.done():
            server.waker.set_result(None)  # probe now rather than at the next interval
        self._changed()

    async def _run_probes(self) -> None:
        """The probe task: one TaskGroup owns every server's probe loop (and under it its recoveries) until
        `aclose()` cancels it. A loop that fails stops them all: the failure is kept, and work stops being routed."""
        try:
            async with asyncio.TaskGroup() as group:
                for server in self._servers:
                    group.create_task(self._probe_loop(server), name=f"{self.name}-probe-{server.url}")
        except Exception as exc:  # noqa: BLE001 - kept and raised to every caller by _check_open
            self._probe_failure = exc
            log.error("%s: health probes stopped: %r", self.name, exc)
            self._signal.notify()

    async def _probe_loop(self, server: _Server) -> None:
        """Probe every interval (at once after an unhealthy mark). A server that is back is recovered by a
        task of its own, so that probing goes on meanwhile and can cancel the recovery's install."""
        loop = asyncio.get_running_loop()
        interval = self.cfg.health_probe_interval_s
        async with asyncio.TaskGroup() as recoveries:
            while True:
                epoch = server.epoch
                error = await self._probe(server)
                if server.epoch != epoch:
                    continue  # marked unhealthy while the probe ran: its answer may predate that; probe again
                if error is not None:
                    self._mark_unhealthy(server, error)
                elif not server.healthy:
                    # Healthy at once (installs go only to healthy servers); excluded until the install succeeds.
                    # Back after an outage, it is a new process: whatever hung is gone.
                    server.healthy = True
                    server.hung = None
                    self._health.reinstated(server.url)
                    server.excluded = "back after an outage, reloading the latest weights" if self._latest is not None else None
                    self._changed()
                    recoveries.create_task(self._recover(server, server.epoch), name=f"{self.name}-recover-{server.url}")
                elif server.hung is not None:
                    await self._probe_hung(server)
                else:
                    self._report_silence(server)
                server.waker = loop.create_future()
                try:
                    async with asyncio.timeout(interval):
                        await server.waker
                except TimeoutError:
                    pass
                finally:
                    server.waker = None

    def _report_silence(self, server: _Server) -> None:
        """Warn (once per episode) about a server that answers /health but none of its open requests."""
        now = asyncio.get_running_loop().time()
        limit = self._latency.silence_s()
        if (server.silence_reported or server.quiet_since is None or server.installing
                or now - server.quiet_since < limit):
            return
        server.silence_reported = True
        held = sum(s.outstanding for s in self._servers)
        log.warning("%s: server %s has answered none of its %d open requests for %.1f s although /health answers: it "
                    "looks hung. %d of generation.max_inflight = %d request slots are held open. Each attempt is "
                    "abandoned and retried after %.3g s (%s).", self.name, server.url, server.outstanding,
                    now - server.quiet_since, held, self.cfg.max_inflight, self._latency.timeout_s(),
                    self._latency.describe())
    async def _probe_hung(self, server: _Server) -> None:
        """Send a server that is out of rotation for hanging a one-token completion (the newest request's
        prompt); it is back in rotation once that is answered within the probe's deadline."""
        if self._last_payload is None:
            return
        assert self._control_session is not None
        timeout_s = max(self._probe_timeout_s(), self._latency.timeout_s(0, 1))
        try:
            async with asyncio.timeout(timeout_s):
                async with self._control_session.post(f"{server.url}/v1/completions",
                                                      json={**self._last_payload, "max_tokens": 1}) as resp:
                    status, text = resp.status, await resp.text()
            if status != 200:
                raise GenerationError(f"probe completion answered HTTP {status}: {server_message(text)}")
        except TimeoutError:
            server.last_error = f"probe completion: no answer within {timeout_s:.3g} s"
            return
        except (aiohttp.ClientError, GenerationError) as exc:
            server.last_error = f"probe completion: {exc}"
            return
        if server.hung is None:
            return  # an outage and a recovery came first
        server.hung = None
        self._health.reinstated(server.url)
        self.counters["hung_returns"] += 1
        log.warning("%s: server %s answered a probe completion and is back in rotation", self.name, server.url)
        self._changed()

    def _probe_timeout_s(self) -> float:
        """How long a health probe, /pause or /resume may take before the server counts as not answering."""
        return min(max(1.0, self.cfg.health_probe_interval_s), 10.0)

    async def _probe(self, server: _Server) -> str | None:
        """None if GET /health answered 200 in time, else what went wrong."""
        assert self._control_session is not None
        timeout_s = self._probe_timeout_s()
        try:
            async with asyncio.timeout(timeout_s):
                async with self._control_session.get(f"{server.url}/health") as resp:
                    await resp.read()
                    status = resp.status
        except TimeoutError:
            return f"health probe: no answer within {timeout_s:g} s"
        except aiohttp.ClientError as exc:
            return f"health probe: {type(exc).__name__}: {exc}"
        return None if status == 200 else f"health probe: HTTP {status}"

    async def _recover(self, server: _Server, epoch: int) -> None:
        """A probe succeeded after an outage (the server is marked healthy, and excluded while weights are
        published): reinstall the latest weights, then it takes work."""
        if self._latest is not None:
            await self._sync_server(server, asyncio.get_running_loop().time() + INSTALL_SHARE * self.cfg.weight_sync_timeout_s)
        if server.epoch == epoch and server.usable:
            self.counters["recoveries"] += 1
            log.log(logging.DEBUG if server.flapping else logging.WARNING,
                    "%s: server %s is healthy again (serving version %d); until it answers a request, it is marked "
                    "unhealthy and back again silently", self.name, server.url, server.version)
            server.flapping = True
