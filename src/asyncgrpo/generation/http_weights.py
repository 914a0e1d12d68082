"""Publishing new weights to every server of the HTTP pool (`HttpGenerator.load_weights`).

Job: stage a state once through a `WeightPublisher` (default: `DiskWeightPublisher` under `weights_dir`,
weight_sync.py) and install it on every healthy server concurrently; install the latest weights on a
server that is back after an outage (called by its recovery, http_probes.py).

Invariants:
- One install per server at a time (a per-server lock), each step under
  ``generation.weight_sync_timeout_s`` (/pause and /resume under the probe timeout), and every install
  ends within `INSTALL_SHARE` of it, well inside the pipeline's own deadline.
- A server whose install fails takes no work until a later install succeeds (counted in
  `stats()["weight_sync_failures"]`). An install runs as the server's own task: marking the server
  unhealthy (a failed probe, a refused connection, /pause or /resume unanswered) cancels it, so no
  publication waits on a server known to be down; it reloads on return.
- If every target went down, publication waits for a server like `generate` does (`BackendDeadError`
  after backend_dead_after_s); if servers that answer all failed to install, `WeightSyncError` (fatal)
  names them. `state=None` means "same weights": versions advance with no transfer; versions never
  decrease.
- While our install pauses a server, the attempt clocks of its requests stand still (attempt_clock.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp

from asyncgrpo.errors import GenerationError
from asyncgrpo.generation.http_control import HttpControl
from asyncgrpo.generation.http_servers import PooledServer, ServerPool
from asyncgrpo.generation.weight_sync import (
    RESUME_AFTER_FAILURE_S,
    StagedWeights,
    WeightPublisher,
    WeightSyncError,
    WeightSyncStepError,
)

log = logging.getLogger("asyncgrpo")

INSTALL_SHARE = 0.8  # of generation.weight_sync_timeout_s: server installs end before the pipeline's deadline


class WeightInstaller:
    """Publishes weights to the servers of `pool` through `publisher` (None: it cannot publish new weights)."""

    def __init__(self, pool: ServerPool, publisher: WeightPublisher | None) -> None:
        self.pool = pool
        self.publisher = publisher

    async def publish(self, state: Mapping[str, Any] | None, version: int) -> None:
        """Publish `state` as `version` to every healthy server; returns once at least one serves it (see module docstring)."""
        self.pool.check_open()
        if version < self.pool.published_version:
            raise ValueError(f"load_weights: version {version} is older than the published version "
                             f"{self.pool.published_version}; versions must not decrease.")
        if state is None:  # the same weights under a new version number: nothing to transfer
            self.pool.published_version = version
            for server in self.pool.servers:
                if server.excluded is None and server.loaded is self.pool.latest:
                    server.version = version
            self.pool.changed()
            return
        if self.publisher is None:
            raise GenerationError(f"HTTP generator {self.pool.name!r} has no weights_dir (or publisher), so it cannot "
                                  f"publish weights: set generation.http.weights_dir.", backend=self.pool.name)
        # Installs end well inside the pipeline's own deadline for the whole publication, so that a slow
        # server is excluded (and the others go on) rather than failing the run.
        deadline = asyncio.get_running_loop().time() + INSTALL_SHARE * self.pool.cfg.weight_sync_timeout_s
        staged = await self.publisher.stage(state, version)
        self.pool.latest = staged
        self.pool.published_version = version
        while True:
            # Every server known to be down: wait for one to come back (its recovery installs this version)
            # or raise BackendDeadError after backend_dead_after_s.
            await self.pool.wait(lambda: self.pool.index.healthy_count > 0, f"publish weights v{version}")
            targets = [s for s in self.pool.servers if s.healthy]
            async with asyncio.TaskGroup() as group:
                results = [group.create_task(self.sync_server(s, deadline)) for s in targets]
            self.pool.changed()
            if any(r.result() for r in results):
                return
            failed = [s for s in targets if s.healthy]  # answered, yet could not install; the others went down
            if failed:
                break
        misconfigured = all(s.last_status is not None and 400 <= s.last_status < 500 for s in failed)
        raise WeightSyncError(
            f"no generation server loaded weights v{version}: " + "; ".join(s.describe() for s in targets)
            + f". The servers must read {staged.path} and accept /pause, /collective_rpc reload_weights and /resume "
            "(vLLM: VLLM_SERVER_DEV_MODE=1).", backend=self.pool.name, misconfigured=misconfigured)

    def model_for(self, server: PooledServer) -> str | None:
        """The model requests to `server` must name when its publisher decides it (the LoRA publisher's adapter
        of the version it installed there), else None: the model the server serves."""
        pick = getattr(self.publisher, "model_for", None)
        return pick(server.url) if pick is not None else None

    async def sync_server(self, server: PooledServer, deadline: float) -> bool:
        """Install the latest staged weights on `server` by the loop time `deadline`; True on success.

        One install per server at a time (its lock). The install runs as the server's own task, so that
        marking the server unhealthy cancels it (`_mark_unhealthy`): nobody waits on a server known to be
        down; it gets the latest weights when it is back (`_recover`)."""
        async with server.lock:
            if not server.healthy:
                return False  # marked while this waited for the lock
            install = server.install = asyncio.create_task(self._install_latest(server, deadline),
                                                           name=f"{self.pool.name}-install-{server.url}")
            try:
                return await install
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # our caller is cancelled (awaiting the install cancelled it too)
                return False  # the unhealthy mark cancelled it
            finally:
                server.install = None

    async def _install_latest(self, server: PooledServer, deadline: float) -> bool:
        """Install the latest staged weights on `server` (again, if newer ones were staged meanwhile). True on success."""
        assert self.pool.control_session is not None and self.publisher is not None
        loop = asyncio.get_running_loop()
        while self.pool.latest is not None and server.loaded is not self.pool.latest:  # identity: one object per stage()
            target = self.pool.latest
            self._pause_clocks(server, True)
            try:
                budget = deadline - loop.time()
                if budget <= 0:
                    raise WeightSyncStepError(f"no time left to load weights v{target.version} on {server.url} "
                                              f"within generation.weight_sync_timeout_s")
                control = HttpControl(self.pool.control_session, server.url, self.pool.probe_timeout_s())
                async with asyncio.timeout(budget + RESUME_AFTER_FAILURE_S):  # the publisher's own bound, enforced
                    await self.publisher.install(control, target, budget)
            except TimeoutError:
                exc = WeightSyncStepError(f"loading weights v{target.version} on {server.url} did not finish "
                                          f"within {budget:g} s (generation.weight_sync_timeout_s)")
                self._install_failed(server, target, exc)
                return False
            except WeightSyncStepError as exc:
                if exc.unreachable:  # like a failed probe: it gets the latest weights when it answers again
                    self.pool.mark_unhealthy(server, f"loading weights v{target.version}: {exc}")
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
            server.version = self.pool.published_version if self.pool.latest is target else target.version
            server.excluded = None
            self.pool.changed()
        if self.pool.latest is None:  # nothing ever staged: its own weights are the published ones
            server.version = self.pool.published_version
            server.excluded = None
            self.pool.changed()
        return True

    def _pause_clocks(self, server: PooledServer, paused: bool) -> None:
        """Our install pauses the server: its requests' attempt clocks stand still meanwhile and keep their
        budgets (a request that resumes by prefilling again is not abandoned while newer ones are no faster,
        attempt_clock.py); the latencies are kept."""
        server.installing = paused
        for clock in server.attempts:
            clock.freeze() if paused else clock.thaw()
        if not paused and server.quiet_since is not None:
            server.quiet_since = asyncio.get_running_loop().time()

    def _install_failed(self, server: PooledServer, target: StagedWeights, exc: BaseException) -> None:
        server.failed_installs += 1
        self.pool.counters["weight_sync_failures"] += 1
        server.excluded = f"loading weights v{target.version} failed"
        server.last_error = str(exc)
        server.last_status = getattr(exc, "status", None)
        log.warning("%s: %s could not load weights v%d and takes no work until a later load succeeds "
                    "(a failed reload can leave a vLLM server unable to generate: restart it if it does "
                    "not recover): %s", self.pool.name, server.url, target.version, exc)
        self.pool.changed()
