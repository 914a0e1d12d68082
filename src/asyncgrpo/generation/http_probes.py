"""Health probes of the HTTP server pool: who answers, who is back, and whether a hung server answers again.

Job: one probe loop per server (``GET /health`` every ``health_probe_interval_s``, at once after an
unhealthy mark), all owned by one TaskGroup (`HealthProbes.run`, the generator's probe task); the
recovery of a server that is back; the one-token probe completion that brings a hung server back into
rotation; the warning about a server that answers /health but none of its open requests.

Invariants:
- A server that fails a probe is unhealthy until a probe succeeds; a probe that overlapped an unhealthy
  mark is repeated (its answer may predate the mark).
- A server that comes back is healthy at once but takes no work until it has the latest published
  weights (its recovery, a task beside its probe loop, which keeps probing and so can cancel it); a
  server back after an outage is a new process, no longer hung.
- A server out of rotation for hanging is sent a one-token completion (the newest request's prompt,
  `last_payload`, not streamed, naming the model that server serves) every probe interval; once one is
  answered within the probe's deadline it is back in rotation (logged).
- A server holding open requests that answers none for `LatencyTracker.silence_s` is logged once by
  name, until it answers again.
- If a probe loop fails, `run` records why in the pool and every later call raises `BackendDeadError`
  naming it (http_servers.py `check_open`); cancelling `run` (the generator's aclose) ends every loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import aiohttp

from asyncgrpo.errors import GenerationError
from asyncgrpo.generation.attempt_timeout import LatencyTracker
from asyncgrpo.generation.http_client import server_message
from asyncgrpo.generation.http_servers import PooledServer, ServerPool
from asyncgrpo.generation.http_weights import INSTALL_SHARE, WeightInstaller

log = logging.getLogger("asyncgrpo")


class HealthProbes:
    """Probes the servers of `pool`; recoveries install weights through `weights`; `latency` is the generator's
    (the hung server's probe and the silence warning read it)."""

    def __init__(self, pool: ServerPool, weights: WeightInstaller, latency: LatencyTracker, *,
                 model_for: Callable[[PooledServer], str | None]) -> None:
        self.pool = pool
        self.weights = weights
        self.latency = latency
        self.model_for = model_for  # the model a request to a server names (its own LoRA adapter, if any)
        self.last_payload: dict[str, Any] | None = None  # the newest request's body (set by the generator)

    async def run(self) -> None:
        """The probe task: one TaskGroup owns every server's probe loop (and under it its recoveries) until
        `aclose()` cancels it. A loop that fails stops them all: the failure is kept, and work stops being routed."""
        try:
            async with asyncio.TaskGroup() as group:
                for server in self.pool.servers:
                    group.create_task(self._probe_loop(server), name=f"{self.pool.name}-probe-{server.url}")
        except Exception as exc:  # noqa: BLE001 - kept and raised to every caller by ServerPool.check_open
            self.pool.probe_failure = exc
            log.error("%s: health probes stopped: %r", self.pool.name, exc)
            self.pool.signal.notify()

    async def _probe_loop(self, server: PooledServer) -> None:
        """Probe every interval (at once after an unhealthy mark). A server that is back is recovered by a
        task of its own, so that probing goes on meanwhile and can cancel the recovery's install."""
        loop = asyncio.get_running_loop()
        interval = self.pool.cfg.health_probe_interval_s
        async with asyncio.TaskGroup() as recoveries:
            while True:
                epoch = server.epoch
                error = await self._probe(server)
                if server.epoch != epoch:
                    continue  # marked unhealthy while the probe ran: its answer may predate that; probe again
                if error is not None:
                    self.pool.mark_unhealthy(server, error)
                elif not server.healthy:
                    # Healthy at once (installs go only to healthy servers); excluded until the install succeeds.
                    # Back after an outage, it is a new process: whatever hung is gone.
                    server.healthy = True
                    server.hung = None
                    self.pool.health.reinstated(server.url)
                    server.excluded = "back after an outage, reloading the latest weights" if self.pool.latest is not None else None
                    self.pool.changed()
                    recoveries.create_task(self._recover(server, server.epoch), name=f"{self.pool.name}-recover-{server.url}")
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

    def _report_silence(self, server: PooledServer) -> None:
        """Warn (once per episode) about a server that answers /health but none of its open requests."""
        now = asyncio.get_running_loop().time()
        limit = self.latency.silence_s()
        if (server.silence_reported or server.quiet_since is None or server.installing
                or now - server.quiet_since < limit):
            return
        server.silence_reported = True
        held = self.pool.index.outstanding
        log.warning("%s: server %s has answered none of its %d open requests for %.1f s although /health answers: it "
                    "looks hung. %d of generation.max_inflight = %d request slots are held open. Each attempt is "
                    "abandoned and retried after %.3g s (%s).", self.pool.name, server.url, server.outstanding,
                    now - server.quiet_since, held, self.pool.cfg.max_inflight, self.latency.timeout_s(),
                    self.latency.describe())
    async def _probe_hung(self, server: PooledServer) -> None:
        """Send a server that is out of rotation for hanging a one-token completion (the newest request's
        prompt); it is back in rotation once that is answered within the probe's deadline."""
        if self.last_payload is None:
            return
        assert self.pool.control_session is not None
        timeout_s = max(self.pool.probe_timeout_s(), self.latency.timeout_s(0, 1))
        try:
            async with asyncio.timeout(timeout_s):
                async with self.pool.control_session.post(f"{server.url}/v1/completions", json=self._probe_body(server)) as resp:
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
        self.pool.health.reinstated(server.url)
        self.pool.counters["hung_returns"] += 1
        log.warning("%s: server %s answered a probe completion and is back in rotation", self.pool.name, server.url)
        self.pool.changed()

    def _probe_body(self, server: PooledServer) -> dict[str, Any]:
        """The newest request's prompt as a plain one-token completion that names the model `server` itself serves
        (the newest request may have been streamed, or have named another server's adapter)."""
        assert self.last_payload is not None
        body = {key: value for key, value in self.last_payload.items() if key != "stream"}
        return {**body, "max_tokens": 1, "model": self.model_for(server)}

    async def _probe(self, server: PooledServer) -> str | None:
        """None if GET /health answered 200 in time, else what went wrong."""
        assert self.pool.control_session is not None
        timeout_s = self.pool.probe_timeout_s()
        try:
            async with asyncio.timeout(timeout_s):
                async with self.pool.control_session.get(f"{server.url}/health") as resp:
                    await resp.read()
                    status = resp.status
        except TimeoutError:
            return f"health probe: no answer within {timeout_s:g} s"
        except aiohttp.ClientError as exc:
            return f"health probe: {type(exc).__name__}: {exc}"
        return None if status == 200 else f"health probe: HTTP {status}"

    async def _recover(self, server: PooledServer, epoch: int) -> None:
        """A probe succeeded after an outage (the server is marked healthy, and excluded while weights are
        published): reinstall the latest weights, then it takes work."""
        if self.pool.latest is not None:
            await self.weights.sync_server(server, asyncio.get_running_loop().time() + INSTALL_SHARE * self.pool.cfg.weight_sync_timeout_s)
        if server.epoch == epoch and server.usable:
            self.pool.counters["recoveries"] += 1
            log.log(logging.DEBUG if server.flapping else logging.WARNING,
                    "%s: server %s is healthy again (serving version %d); until it answers a request, it is marked "
                    "unhealthy and back again silently", self.pool.name, server.url, server.version)
            server.flapping = True
