"""Servers the run starts itself: `generation.http.launch` under `runtime: ray`.

Job: `ServerLauncher` starts `launch.count` server actors (launch_actor.py) on the Ray cluster, in one
placement group when `launch.placement` asks for it, waits until every server answers /health, hands
back their URLs, reports each server's exit while the run goes on, starts a new actor in place of one
that died and hands its URL to the pool, and stops them all at the end.
`LaunchedHttpGenerator` is the `Generator` over them: the ordinary `HttpGenerator` (generation/http.py)
over `generation.http.base_urls` plus the launched URLs, so weight sync, health probes, failover and
resume apply unchanged.

Invariants:
- Start-up is bounded: the cluster by `ray.startup_timeout_s` (ray_cluster.py), the placement group by
  the same, each server by `launch.start_timeout_s` (the actor races /health against the process's exit).
  A server that does not come up fails the start with one paragraph naming it, its command, its log's
  last lines and the fix (`BackendDeadError`; a program missing on its node: `ConfigError`); every
  actor started so far is stopped first.
- A server that exits mid-run is restarted on the same port by its actor, which the log says; the HTTP
  pool marks it unhealthy meanwhile and installs the current weights before it takes work again.
- A server whose actor dies (its node lost, its process killed: the watcher's pending `exited` call
  raises a RayError, so nothing polls) gets a new actor in the same placement bundle, on a new port:
  started and bounded as at start-up, its URL then replaces the old one in the pool (`ServerSlots`;
  the pool treats it as a server back after an outage: the current weights before any work).
- Both kinds of restart spend one budget per server, `launch.max_restarts` (a replacement actor gets
  what is left for its own process restarts). Past it, or when a restart fails (its dead actor not killed for sure
  within 30 s included: it might serve on), the server stays
  down, the log says why and that the run goes on with the others, the pool's error messages name
  the reason (`server_gone`), and a pool with no server left fails as any HTTP pool does
  (`BackendDeadError` after `generation.backend_dead_after_s`).
- `aclose()` (bounded, idempotent) stops each server's process group through its actor, kills the
  actors, releases the placement group and lets go of Ray; no server process outlives the run (an
  actor killed before it could stop its server takes it along: PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from asyncgrpo.config import Config
from asyncgrpo.errors import BackendDeadError, ConfigError, GenerationError
from asyncgrpo.generation.http import HttpGenerator
from asyncgrpo.generation.launch_actor import LaunchFailure, LaunchSpec, ServerActor, ServerExit, default_command
from asyncgrpo.generation.ray_cluster import RayCluster, import_ray
from asyncgrpo.generation.ray_placement import RolePlacement
from asyncgrpo.threads import run_in_daemon_thread
from asyncgrpo.types import Completion, GenerationRequest

log = logging.getLogger("asyncgrpo")

_STOP_TIMEOUT_S = 30.0  # each actor's stop: its server's SIGTERM grace (10 s) and more


class ServerSlots(Protocol):
    """Where the launcher hands a server's new URL, or says it stays down (`HttpGenerator`; positions in its servers)."""

    def replace_server(self, position: int, url: str, why: str) -> None: ...

    def server_gone(self, position: int, why: str) -> None: ...


def launch_specs(cfg: Config, log_dir: Path) -> list[LaunchSpec]:
    """What each of the `launch.count` actors runs (named server-0, server-1, ...)."""
    launch = cfg.generation.http.launch
    assert launch is not None
    command = tuple(launch.command) if launch.command else default_command(launch.engine)
    model_args = (cfg.model.path,) if launch.engine == "serve" else ("--model", cfg.model.path)
    return [LaunchSpec(name=f"server-{index}", command=command, model_args=model_args, args=tuple(launch.args),
                       env=tuple(sorted(launch.env.items())), log_dir=str(log_dir), start_timeout_s=launch.start_timeout_s,
                       max_restarts=launch.max_restarts) for index in range(launch.count)]


class ServerLauncher:
    """The launched servers of one run; see the module docstring. `log_dir`: where each server's log goes."""

    def __init__(self, cfg: Config, log_dir: Path) -> None:
        launch = cfg.generation.http.launch
        if launch is None:
            raise ValueError("ServerLauncher needs generation.http.launch")
        self.cfg, self.launch = cfg, launch
        self.specs = launch_specs(cfg, log_dir)
        self._cluster = RayCluster(cfg.ray, timeout_s=cfg.run.shutdown_timeout_s)
        self._placement = RolePlacement(launch, launch.count, key="generation.http.launch")
        self.handles: list[Any] = []  # the actors' Ray handles, in order
        self.urls: list[str] = []
        self._watchers: list[asyncio.Task] = []

    async def start(self) -> list[str]:
        """Start every server and wait until each answers /health; their URLs, in order."""
        await self._cluster.connect()
        try:
            await self._start_actors()
        except BaseException:
            await self.aclose()
            raise
        log.info("launched %d generation servers: %s", len(self.urls), ", ".join(self.urls))
        return self.urls

    def watch(self, slots: ServerSlots, first: int) -> None:
        """Watch every server until `aclose()`: server `index` is `slots`' position `first + index`."""
        self._watchers = [asyncio.create_task(self._watch_or_say_why(index, slots, first + index), name=f"{spec.name}-watch")
                          for index, spec in enumerate(self.specs)]

    async def _watch_or_say_why(self, index: int, slots: ServerSlots, position: int) -> None:
        """`_watch`; should it fail unexpectedly (a new actor refused by Ray, say), the server stays down, named with why,
        rather than its watcher ending on an exception nobody observes."""
        try:
            await self._watch(index, slots, position)
        except Exception as exc:  # noqa: BLE001 - whatever it was, it is named where the pool's errors list the servers
            self._gone(slots, position, self.specs[index], self.urls[index],
                       f"watching it failed: {type(exc).__name__}: {exc}")

    def _actor(self, index: int, spec: LaunchSpec) -> Any:
        """A new actor for server `index` (in its bundle of the placement group, if any), running `spec`."""
        ray, launch = import_ray(), self.launch
        options = {"num_cpus": launch.num_cpus, "num_gpus": launch.num_gpus, "max_restarts": 0, "max_task_retries": 0}
        return ray.remote(ServerActor).options(**options, **self._placement.options(index)).remote(spec)

    async def _start_actors(self) -> None:
        ray = import_ray()
        launch, timeout_s = self.launch, self.cfg.ray.startup_timeout_s
        try:
            await self._placement.reserve(timeout_s)
        except TimeoutError:
            raise BackendDeadError(self._placement_problem(ray), backend="http") from None
        self.handles = [self._actor(index, spec) for index, spec in enumerate(self.specs)]
        try:  # placement of the actors, then each server's own start (bounded by the actor: start_timeout_s)
            async with asyncio.timeout(timeout_s + launch.start_timeout_s):
                answers = await asyncio.gather(*(self._started(spec, handle) for spec, handle in zip(self.specs, self.handles,
                                                                                                    strict=True)))
        except TimeoutError:
            raise BackendDeadError(self._placement_problem(ray), backend="http") from None
        failures = [answer for answer in answers if isinstance(answer, LaunchFailure)]
        if failures:
            message = " ".join(failure.message for failure in failures)
            if any(failure.kind == "config" for failure in failures):
                raise ConfigError(message)
            raise BackendDeadError(message, backend="http")
        self.urls = [str(answer) for answer in answers]

    async def _started(self, spec: LaunchSpec, handle: Any) -> str | LaunchFailure:
        ray = import_ray()
        try:
            answer: str | LaunchFailure = await handle.start.remote()
        except ray.exceptions.RayError as exc:
            return LaunchFailure("start", f"server {spec.name}: its actor failed to start: {type(exc).__name__}: {exc}")
        return answer

    def _placement_problem(self, ray: Any) -> str:
        launch = self.launch
        try:
            available = ray.available_resources()
        except Exception as exc:  # noqa: BLE001 - only for the message
            available = f"unknown ({exc})"
        return (f"the {launch.count} server actors of generation.http.launch were not all placed and started within "
                f"ray.startup_timeout_s + generation.http.launch.start_timeout_s = {self.cfg.ray.startup_timeout_s:g} + "
                f"{launch.start_timeout_s:g} s. Each asks for num_cpus = {launch.num_cpus:g} and num_gpus = "
                f"{launch.num_gpus:g} ({self._placement.describe()}); the cluster has free: {available}. Fix: lower "
                f"generation.http.launch.count or its num_cpus/num_gpus, or give the cluster more nodes.")

    async def _watch(self, index: int, slots: ServerSlots, position: int) -> None:
        """Report each exit of server `index` while the run goes on (its actor restarts it); when its actor dies, start
        another in its place while restarts are left and hand `slots` its URL; say when it stays down."""
        ray = import_ray()
        spec, left, seen = self.specs[index], self.launch.max_restarts, 0
        while True:
            url = self.urls[index]
            try:
                exit_: ServerExit | None = await self.handles[index].exited.remote(seen)
            except ray.exceptions.RayError as exc:
                died = f"its actor died ({type(exc).__name__})"
                if left == 0:
                    self._gone(slots, position, spec, url, f"{died}; generation.http.launch.max_restarts = "
                               f"{self.launch.max_restarts} spent")
                    return
                left -= 1
                log.warning("warning: the actor of launched server %s (%s) died (%s); starting another in its place on a "
                            "new port (%d restarts left)", spec.name, url, type(exc).__name__, left)
                answer = await self._relaunch(index, left)
                if isinstance(answer, LaunchFailure):
                    self._gone(slots, position, spec, url, f"{died} and its replacement did not start: {answer.message}")
                    return
                self.urls[index], seen = answer, 0
                log.warning("warning: launched server %s is back at %s in place of %s; it gets the current weights "
                            "before it takes work", spec.name, answer, url)
                slots.replace_server(position, answer, f"launched server {spec.name}: {died}")
                continue
            if exit_ is None:
                return
            seen = exit_.count
            tail = " | ".join(exit_.log_tail.splitlines()[-3:])
            if not exit_.restarted:
                self._gone(slots, position, spec, url, f"it exited with code {exit_.code} and "
                           f"generation.http.launch.max_restarts = {self.launch.max_restarts} is spent, or it did not "
                           f"come back. Its log ended with: {tail}")
                return
            left = exit_.restarts_left
            log.warning("warning: launched server %s (%s) exited with code %s; restarting it on the same port (%d restarts "
                        "left); it gets the current weights before it takes work. Its log ended with: %s",
                        spec.name, url, exit_.code, left, tail)

    async def _relaunch(self, index: int, restarts_left: int) -> str | LaunchFailure:
        """A new actor for server `index` in place of its dead one (killed for sure first: a merely unreachable one must
        not serve on), with `restarts_left` for its own process; its URL once /health answers, or why not."""
        ray = import_ray()
        dead, spec = self.handles[index], dataclasses.replace(self.specs[index], max_restarts=restarts_left)
        try:
            async with asyncio.timeout(_STOP_TIMEOUT_S):
                await run_in_daemon_thread(lambda: ray.kill(dead, no_restart=True), name="asyncgrpo-ray-kill")
        except Exception as exc:  # noqa: BLE001 - ray.kill's errors are not typed; whatever it raised, the old actor may live
            return LaunchFailure("start", f"server {spec.name}: its dead actor could not be killed for sure within "
                                          f"{_STOP_TIMEOUT_S:g} s ({type(exc).__name__}: {exc}), so no other actor is started "
                                          f"in its place")
        handle = self.handles[index] = self._actor(index, spec)  # in `handles` at once: aclose stops it
        try:
            async with asyncio.timeout(self.cfg.ray.startup_timeout_s + self.launch.start_timeout_s):
                return await self._started(spec, handle)
        except TimeoutError:
            return LaunchFailure("start", self._placement_problem(ray))

    def _gone(self, slots: ServerSlots, position: int, spec: LaunchSpec, url: str, why: str) -> None:
        log.warning("warning: launched server %s (%s) stays down: %s; the run goes on with the other servers",
                    spec.name, url, why)
        slots.server_gone(position, f"launched server {spec.name} stays down: {why}")

    async def aclose(self) -> None:
        """Stop every server and actor, release the placement group, let go of Ray. Bounded and idempotent."""
        watchers, self._watchers = self._watchers, []
        for task in watchers:
            task.cancel()
        if watchers:
            await asyncio.wait(watchers)
        handles, self.handles = self.handles, []
        try:
            if handles:
                ray = import_ray()
                try:
                    async with asyncio.timeout(_STOP_TIMEOUT_S):
                        await asyncio.gather(*(handle.stop.remote() for handle in handles), return_exceptions=True)
                except TimeoutError:
                    log.warning("warning: stopping the launched servers took over %g s; killing their actors, which "
                                "takes the servers along", _STOP_TIMEOUT_S)
                try:
                    async with asyncio.timeout(_STOP_TIMEOUT_S):  # a kill can hang (a node that does not answer): abandoned
                        await run_in_daemon_thread(lambda: [ray.kill(handle, no_restart=True) for handle in handles],
                                                   name="asyncgrpo-ray-kill")
                except Exception as exc:  # noqa: BLE001 - ray.kill's errors are not typed; the placement group still goes
                    log.warning("warning: killing the launched servers' actors failed or took over %g s (%s: %s); "
                                "Ray removes them when the driver disconnects", _STOP_TIMEOUT_S, type(exc).__name__, exc)
        finally:
            await self._placement.release()
            await self._cluster.disconnect()


class LaunchedHttpGenerator:
    """`Generator` over the servers of `generation.http.base_urls` and those it launches; see the module docstring.

    The `HttpGenerator` arguments are passed on; it is built in `start()`, once the URLs are known."""

    def __init__(self, cfg: Config, *, log_dir: Path, weights_dir: Path, model_config: str | Path | Mapping[str, Any],
                 initial_version: int = 0, name: str = "http") -> None:
        self.name = name
        self.cfg = cfg
        self.launcher = ServerLauncher(cfg, log_dir)
        self._http_args: dict[str, Any] = {"weights_dir": weights_dir, "model_config": model_config, "name": name,
                                           "initial_version": initial_version}
        self._initial_version = initial_version
        self.http: HttpGenerator | None = None
        self._closed = False

    @property
    def serving_version(self) -> int:
        return self.http.serving_version if self.http is not None else self._initial_version

    async def start(self) -> None:
        if self._closed:
            raise GenerationError(f"HTTP generator {self.name!r} is closed; create a new one.", backend=self.name)
        if self.http is not None:
            return
        urls = await self.launcher.start()
        generation = self.cfg.generation
        listed = generation.http.model_copy(update={"base_urls": [*generation.http.base_urls, *urls]})
        http = HttpGenerator(generation.model_copy(update={"http": listed}), **self._http_args)
        try:
            await http.start()
        except BaseException:
            await http.aclose()
            await self.launcher.aclose()
            raise
        self.http = http
        self.launcher.watch(http, first=len(generation.http.base_urls))

    def _started(self) -> HttpGenerator:
        if self.http is None:
            raise GenerationError(f"HTTP generator {self.name!r} is not started: await start() first.", backend=self.name)
        return self.http

    def stats(self) -> dict[str, Any]:
        """The HTTP generator's (servers, counters); empty before `start()`."""
        return self.http.stats() if self.http is not None else {}

    async def generate(self, request: GenerationRequest) -> Completion:
        return await self._started().generate(request)

    async def load_weights(self, state: Mapping[str, Any] | None, version: int) -> None:
        await self._started().load_weights(state, version)

    async def aclose(self) -> None:
        """Close the HTTP pool, then stop the servers (bounded, idempotent)."""
        self._closed = True
        try:
            if self.http is not None:
                await self.http.aclose()
        finally:
            await self.launcher.aclose()
