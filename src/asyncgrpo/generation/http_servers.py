"""The HTTP server pool's shared state: which server is alive, which weights it serves, and waiting for one.

Job: hold what `HttpGenerator` (generation/http.py), its health probes (http_probes.py) and its weight
installs (http_weights.py) know of the servers (`PooledServer`), the published and staged weights, the
counters, the connection for control calls (probes, /pause, reloads, /resume), and the one `StateSignal`
every change wakes; mark a server unhealthy; and wait for a server that can take work.

Invariants:
- Every change of health, exclusion or version goes through `changed()`, which keeps the clock of how
  long no server has been usable and wakes the waiters only when one of them can go on (a first server
  usable again, or a first healthy one): a probe of a server that stays down wakes nobody.
- Nothing per request scans the servers: a `PooledServer` keeps its entry in the pool's `ServerIndex`
  (http_balance.py) up to date on every change of its health, exclusion, hung mark, version or open
  requests, so choosing a server, `serving_version` and the waiters' predicates are O(1) and each
  change O(log n) in the number of servers.
- Waiting. With no usable server (healthy and serving the published weights), `acquire` waits on a
  `StateSignal` predicate (woken as said above, nothing polls) and raises `BackendDeadError` once no
  server has been usable for ``backend_dead_after_s``; the message names each server and its last
  error. It raises once attempts have failed for that long with no answer in between (pool_health.py;
  its deadline bounds the wait too), and at once when the probes stopped, the pool is closed or not started.
- A server marked unhealthy (a failed probe, a refused connection, an unanswered control call) takes no
  work until a probe succeeds; its install in progress is cancelled (no publication waits on a server
  known to be down), its probe loop is woken to probe at once, and, once weights were staged, it is
  given the latest ones when it is back (it may have restarted with its original weights).
- Replacement. A server whose process is replaced by one at another URL (`replace`: a launched server whose
  actor died, generation/launch.py) keeps its place in the pool; from then on every probe, install and
  request goes to the new URL, and it counts as a server back after an outage (above). A request still
  open to the old URL fails over as any failed attempt does.
- Versions. A server's version is the version it is known to have loaded; `serving_version` is the
  lowest version among servers that can take work (the latest published version while none can).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from asyncgrpo.config import GenerationConfig
from asyncgrpo.errors import BackendDeadError, GenerationError
from asyncgrpo.generation.attempt_clock import AttemptClock
from asyncgrpo.generation.http_balance import ServerIndex
from asyncgrpo.generation.pool_health import PoolHealth
from asyncgrpo.generation.weight_sync import StagedWeights
from asyncgrpo.sync import StateSignal

log = logging.getLogger("asyncgrpo")

_INDEXED = frozenset({"healthy", "excluded", "hung", "version", "outstanding"})  # what the pool's index reads


@dataclass(eq=False)
class PooledServer:
    """One server of the pool, as the generator knows it (each field says what it records)."""

    url: str
    version: int
    healthy: bool = True
    loaded: StagedWeights | None = None  # the staged weights it has loaded (None: its own, or unknown after an outage)
    excluded: str | None = None  # why it takes no work although it answers (a failed weight install)
    hung: str | None = None  # why it is out of rotation although /health answers (its attempts time out)
    gone: str | None = None  # why it stays down for good (its launcher gave up on it), for error messages
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
    position: int = -1  # its place in cfg.http.base_urls (set by the index)
    index: ServerIndex[PooledServer] | None = None  # the pool's index, refreshed on every change of an `_INDEXED` field

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in _INDEXED and self.index is not None:
            self.index.refresh(self)

    @property
    def usable(self) -> bool:
        """Whether it can take work: healthy, serving the published weights, not hung."""
        return self.healthy and self.excluded is None and self.hung is None

    def describe(self) -> str:
        """Its URL, its state and its last error, for an error message."""
        if not self.healthy:
            state = "unreachable"
        elif self.excluded is not None:
            state = f"takes no work ({self.excluded})"
        elif self.hung is not None:
            state = f"out of rotation ({self.hung})"
        else:
            state = "answers /health"
        gone = f" ({self.gone})" if self.gone is not None else ""
        last = f"; last error: {self.last_error}" if self.last_error else ""
        return f"{self.url}: {state}{gone}{last}"


class ServerPool:
    """The servers of `cfg.http.base_urls` and what is known of them; `name` is the generator's (in messages)."""

    def __init__(self, cfg: GenerationConfig, name: str, initial_version: int) -> None:
        self.cfg = cfg
        self.name = name
        self.servers = [PooledServer(url=url.rstrip("/"), version=initial_version) for url in cfg.http.base_urls]
        self.index = ServerIndex(self.servers)
        for server in self.servers:
            server.index = self.index
        self._could_go_on = (True, True)  # (some server usable, some healthy) when waiters were last woken
        self.published_version = initial_version
        self.latest: StagedWeights | None = None  # the weights staged last (None: the servers' own)
        self.signal = StateSignal()
        self.health = PoolHealth([s.url for s in self.servers])
        self.control_session: aiohttp.ClientSession | None = None  # set by the generator's start, cleared by aclose
        self.probe_failure: BaseException | None = None
        self.none_usable_since: float | None = None
        self.started = False
        self.closed = False
        self.counters = {"weight_sync_failures": 0, "unhealthy_marks": 0, "recoveries": 0, "attempt_timeouts": 0,
                         "hung_suspensions": 0, "hung_returns": 0}

    @property
    def serving_version(self) -> int:
        """The lowest version among servers that can take work; the published version while none can."""
        version = self.index.lowest_version()
        return self.published_version if version is None else version

    async def acquire(self, purpose: str, prefer: PooledServer | None = None) -> PooledServer:
        """Wait until a server is usable; return `prefer` if it is usable, else the usable server with the fewest open
        requests (the first listed among equals). Raises BackendDeadError once no server has been usable for
        backend_dead_after_s."""
        await self.wait(lambda: self.index.usable_count > 0, purpose)
        if prefer is not None and prefer.usable:
            return prefer
        server = self.index.least_loaded()
        assert server is not None
        return server

    async def wait(self, ready: Callable[[], bool], purpose: str) -> None:
        """Wait until `ready()`, which may only become true when a first server becomes usable or healthy
        (what `changed()` wakes for); the errors are `acquire`'s."""
        loop = asyncio.get_running_loop()
        while True:
            self.check_open()
            failing = self.health.failing_for(loop.time())
            if failing is not None and failing >= self.cfg.backend_dead_after_s:
                raise self.dead_error(failing)
            if ready():
                return
            since = self.none_usable_since if self.none_usable_since is not None else loop.time()
            deadline = since + self.cfg.backend_dead_after_s
            if loop.time() >= deadline:
                raise BackendDeadError(
                    f"no generation server could take work for {loop.time() - since:.1f} s "
                    f"(generation.backend_dead_after_s = {self.cfg.backend_dead_after_s:g}) while trying to {purpose}: "
                    + "; ".join(s.describe() for s in self.servers)
                    + ". Check that the servers are running and reachable, or raise generation.backend_dead_after_s "
                    "to wait longer for restarts.", backend=self.name)
            failing_since = self.health.failing_since
            if failing_since is not None:  # the dead-backend clock may run out first
                deadline = min(deadline, failing_since + self.cfg.backend_dead_after_s)
            try:
                async with asyncio.timeout_at(deadline):
                    await self.signal.wait_for(lambda: ready() or self.closed or self.probe_failure is not None)
            except TimeoutError:
                pass  # re-checked above: raises unless a server came back at the deadline

    def check_open(self) -> None:
        """Raise unless the pool can route work: its probes running, started and not closed."""
        if self.probe_failure is not None:
            raise BackendDeadError(f"the health probes of {self.name!r} stopped with "
                                   f"{type(self.probe_failure).__name__}: {self.probe_failure}; server health is "
                                   f"unknown, so no work can be routed.", backend=self.name) from self.probe_failure
        if self.closed:
            raise GenerationError(f"HTTP generator {self.name!r} is closed; the request was not sent.", backend=self.name)
        if not self.started:
            raise GenerationError(f"HTTP generator {self.name!r} is not started: await start() first.", backend=self.name)

    def changed(self) -> None:
        """Every change of health, exclusion or version ends here: keep the dead-since clock; wake the waiters
        when a first server became usable or healthy (a waiter waits only while none is)."""
        usable, healthy = self.index.usable_count > 0, self.index.healthy_count > 0
        if usable:
            self.none_usable_since = None
        elif self.none_usable_since is None:
            self.none_usable_since = asyncio.get_running_loop().time()
        was_usable, was_healthy = self._could_go_on
        if (usable and not was_usable) or (healthy and not was_healthy):
            self.signal.notify()
        self._could_go_on = (usable, healthy)

    def mark_unhealthy(self, server: PooledServer, error: str) -> None:
        """`server` failed a probe or a connection: unhealthy until a probe succeeds (see the module docstring)."""
        server.last_error = error
        server.epoch += 1
        if server.healthy:
            server.healthy = False
            self.counters["unhealthy_marks"] += 1
            # Once per outage: a server whose /health answers but which resets every request flaps many times a second.
            level = logging.DEBUG if server.flapping else logging.WARNING
            log.log(level, "%s: server %s is unhealthy: %s", self.name, server.url, error)
        if self.latest is not None:
            server.loaded = None  # it may restart with its original weights: reinstall when it is back
        if server.install is not None and not server.install.done() and server.install is not asyncio.current_task():
            log.warning("%s: abandoning the weight install on %s (unhealthy); it gets the latest weights when it "
                        "is back", self.name, server.url)
            server.install.cancel()
        if server.waker is not None and not server.waker.done():
            server.waker.set_result(None)  # probe now rather than at the next interval
        self.changed()

    def replace(self, position: int, url: str, why: str) -> None:
        """The server at `position` (its place in `base_urls`) is now a new process at `url` (its launcher started one in
        place of a dead one): it keeps its place, sessions and counters; it is unhealthy until a probe of `url` answers,
        then takes no work until it has the latest weights (as any server back after an outage)."""
        server = self.servers[position]
        old, url = server.url, url.rstrip("/")
        if url != old:
            self.health.replace(old, url)
        server.url = url
        server.gone = None
        server.hung = None  # a new process: whatever hung is gone, and its return is news
        server.flapping = False
        log.warning("%s: server %s is replaced by %s (%s); it takes work once it answers and has the latest weights",
                    self.name, old, url, why)
        self.mark_unhealthy(server, f"replaced {old} ({why})")

    def dead_error(self, failing_s: float) -> BackendDeadError:
        """The error of a backend whose attempts have all failed for `failing_s`, naming every server."""
        return BackendDeadError(
            f"no request to any generation server succeeded for {failing_s:.1f} s of failing attempts "
            f"(generation.backend_dead_after_s = {self.cfg.backend_dead_after_s:g}): "
            + "; ".join(s.describe() for s in self.servers)
            + ". Check the servers' own logs for why they fail every request (or raise generation.backend_dead_after_s "
            "to keep retrying longer).", backend=self.name)

    def probe_timeout_s(self) -> float:
        """How long a health probe, /pause or /resume may take before the server counts as not answering."""
        return min(max(1.0, self.cfg.health_probe_interval_s), 10.0)
